"""End to end: devices record several private attributes in one report through
``TelemetryClient`` into a real aggregator process (``aggregator`` fixture), with a public
dimension beside them, and the estimate's per-attribute shares, mean and joint cells of the
declared pair agree with the devices' truth.

Tolerance: the population is fixed (seeded); the perturbation and each device's sampled
view are the devices' (secure, unseeded). Each checked value is within ``z std`` of its
truth, z two-sided at 1e-6 Bonferroni over the values one assertion covers
(``tests.distribution_checks``): false-failure rate at most 1e-6 per assertion (normal
approximation of sums of thousands of bounded terms).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.distribution_checks import normal_bound
from tests.support import fleet_client

#: Every test here starts a real server process or CLI: the slow lane.
pytestmark = pytest.mark.slow

THEMES = ["light", "dark", "system"]
SIZES = ["small", "medium", "large"]
DISPLAY = {
    "mechanism": {
        "mechanism": "auto",  # resolved when the metric is defined
        "epsilon": 3.0,
        "attributes": [
            {"name": "theme", "domain_size": 3, "labels": THEMES},
            {"name": "text_size", "domain_size": 3, "labels": SIZES},
            {"name": "brightness", "lower": 0.0, "upper": 100.0},
        ],
        "pairs": [["theme", "text_size"]],
    },
    "dimensions": {"platform": ["android", "ios"]},
}
DEVICES = 6000
SHARDS = 4


def record(server: Any, state_dir: Path, rows: list[tuple[int, int, float, str]]) -> bool:
    """One client object records its devices' attribute records, then flushes."""
    with fleet_client(server.url, server.keys["device"], state_dir, batch_size=256) as client:
        for theme, size, brightness, platform in rows:
            client.record(
                "display",
                {"theme": THEMES[theme], "text_size": size, "brightness": brightness},
                dimensions={"platform": platform},
            )
        return client.flush(timeout=60.0)


def test_attribute_records_reach_consistent_estimates_that_agree_with_the_truth(
    aggregator: Any, tmp_path: Path
) -> None:
    defined = aggregator.define("display", DISPLAY)
    assert defined["mechanism"]["mechanism"] in ("spl", "smp", "rsfd")  # auto resolved
    rng = np.random.default_rng(29)
    theme = rng.choice(3, size=DEVICES, p=[0.5, 0.3, 0.2])
    size = np.where(rng.random(DEVICES) < 0.6, theme, rng.choice(3, size=DEVICES))
    brightness = np.round(100.0 * rng.beta(2.0, 5.0, DEVICES), 1)
    platform = np.where(rng.random(DEVICES) < 0.5, "android", "ios")
    rows = list(
        zip(theme.tolist(), size.tolist(), brightness.tolist(), platform.tolist(), strict=True)
    )
    shards = [rows[i::SHARDS] for i in range(SHARDS)]
    with ThreadPoolExecutor(max_workers=SHARDS) as pool:
        delivered = list(
            pool.map(lambda s: record(aggregator, tmp_path / f"shard-{s}", shards[s]), range(4))
        )
    assert all(delivered)

    response = httpx.get(
        f"{aggregator.url}/v1/metrics/display/estimate",
        params={"by": "platform"},
        headers=aggregator.headers("analyst"),
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["kind"] == "attributes" and body["n"] == DEVICES
    assert [group["dimensions"] for group in body["groups"]] == [
        {"platform": "android"},
        {"platform": "ios"},
    ]
    assert sum(group["n"] for group in body["groups"]) == DEVICES

    attributes = {attribute["name"]: attribute for attribute in body["attributes"]}
    z = normal_bound(3 + 3 + 1)
    for name, values in (("theme", theme), ("text_size", size)):
        shares = np.bincount(values, minlength=3) / DEVICES
        for item, share in zip(attributes[name]["estimates"], shares.tolist(), strict=True):
            assert abs(item["frequency"] - share) <= z * item["std"], (name, item, share)
    mean = attributes["brightness"]
    assert abs(mean["mean"] - float(brightness.mean())) <= z * mean["std"], mean

    (joint,) = body["marginals"]
    assert joint["attributes"] == ["theme", "text_size"]
    assert joint["rows"] == THEMES and joint["columns"] == SIZES
    truth = np.zeros((3, 3))
    np.add.at(truth, (theme, size), 1.0 / DEVICES)
    z = normal_bound(9)
    for cell in joint["cells"]:  # rows and columns named by their labels
        share = truth[THEMES.index(cell["row"]), SIZES.index(cell["column"])]
        assert abs(cell["frequency"] - share) <= z * cell["std"], (cell, share)
    # consistent: each row of the joint sums to the theme's one-way estimate
    sums = np.zeros(3)
    for cell in joint["cells"]:
        sums[THEMES.index(cell["row"])] += cell["frequency"]
    estimated = [item["frequency"] for item in attributes["theme"]["estimates"]]
    np.testing.assert_allclose(sums, estimated, atol=1e-9)


def test_a_record_missing_an_attribute_is_refused_on_the_device(
    aggregator: Any, tmp_path: Path
) -> None:
    aggregator.define("display", DISPLAY)
    with fleet_client(aggregator.url, aggregator.keys["device"], tmp_path, 64) as client:
        with pytest.raises(ValueError, match="brightness"):
            client.record(
                "display", {"theme": "dark", "text_size": 1}, dimensions={"platform": "ios"}
            )
        with pytest.raises(ValueError, match="shade"):
            client.record(
                "display",
                {"theme": "dark", "text_size": 1, "brightness": 3.0, "shade": 1},
                dimensions={"platform": "ios"},
            )
        assert client.budget().spent_lifetime == 0 and client.queued == 0
