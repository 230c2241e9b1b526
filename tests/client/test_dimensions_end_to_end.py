"""End to end: devices record with public dimensions through ``TelemetryClient`` into a real
aggregator process (``aggregator`` fixture: ``aggregator.cli serve`` on a free loopback
port, ``--min-reports 1``), and ``estimate?by=`` agrees with each cell's truth.

Tolerance: the populations are fixed (seeded); the perturbation is the devices' (secure,
unseeded). Each checked estimate is within ``z std`` of its cell's truth, z two-sided at
1e-6 Bonferroni over the estimates one assertion covers (``tests.distribution_checks``):
false-failure rate at most 1e-6 per assertion (normal approximation of sums of hundreds
of bounded terms).
"""

from __future__ import annotations

import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client.outbox import Outbox
from tests.distribution_checks import normal_bound
from tests.support import fleet_client

#: Every test here starts a real server process or CLI: the slow lane.
pytestmark = pytest.mark.slow

DIMS = {"platform": ["android", "ios"], "version": ["1.0", "2.0"]}
CELLS = [dict(zip(DIMS, combo, strict=True)) for combo in itertools.product(*DIMS.values())]
LABELS = ["light", "dark", "system"]
CRASH = {
    "mechanism": {"mechanism": "grr", "epsilon": 2.0, "domain_size": 3},
    "labels": LABELS,
    "dimensions": DIMS,
}
MINUTES = {
    "mechanism": {"mechanism": "piecewise", "epsilon": 2.0, "lower": 0.0, "upper": 60.0},
    "dimensions": DIMS,
}
#: Devices per cell.
PER_CELL = 1200
#: Each cell's category shares, and the Beta(a, b) of its minutes (times 60).
SHARES = [[0.7, 0.2, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]
BETAS = [(2.0, 5.0), (5.0, 2.0), (1.0, 1.0), (4.0, 4.0)]


def get(server: Any, metric: str, **params: Any) -> httpx.Response:
    return httpx.get(
        f"{server.url}/v1/metrics/{metric}/estimate",
        params=params,
        headers=server.headers("analyst"),
        timeout=60.0,
    )


def record_cell(
    server: Any, state_dir: Path, cell: int, themes: list[str], minutes: list[float]
) -> bool:
    """One client object records its cell's devices (a theme and minutes each), flushes."""
    with fleet_client(server.url, server.keys["device"], state_dir, batch_size=256) as client:
        for theme, length in zip(themes, minutes, strict=True):
            client.record("theme", theme, dimensions=CELLS[cell])
            client.record("minutes", length, dimensions=CELLS[cell])
        return client.flush(timeout=60.0)


def test_devices_with_dimensions_estimate_by_agrees_with_each_cell(
    aggregator: Any, tmp_path: Path
) -> None:
    aggregator.define("theme", CRASH)
    aggregator.define("minutes", MINUTES)
    rng = np.random.default_rng(27)
    values = [rng.choice(3, size=PER_CELL, p=share) for share in SHARES]
    lengths = [np.round(60.0 * rng.beta(a, b, PER_CELL), 2) for a, b in BETAS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        delivered = list(
            pool.map(
                lambda c: record_cell(
                    aggregator,
                    tmp_path / f"cell-{c}",
                    c,
                    [LABELS[i] for i in values[c]],
                    lengths[c].tolist(),
                ),
                range(len(CELLS)),
            )
        )
    assert all(delivered)

    theme = get(aggregator, "theme", by="platform,version")
    assert theme.status_code == 200, theme.text
    groups = theme.json()["groups"]
    assert [group["dimensions"] for group in groups] == CELLS
    z = normal_bound(len(CELLS) * 3)
    for group, cell_values in zip(groups, values, strict=True):
        assert group["n"] == PER_CELL
        shares = np.bincount(cell_values, minlength=3) / PER_CELL
        for item, share in zip(group["estimates"], shares.tolist(), strict=True):
            assert abs(item["frequency"] - share) <= z * item["std"], (group["dimensions"], item)

    minutes = get(aggregator, "minutes", by="version", where="platform:ios")
    assert minutes.status_code == 200, minutes.text
    body = minutes.json()
    assert body["where"] == {"platform": "ios"} and body["n"] == 2 * PER_CELL
    z = normal_bound(2)
    for group, cell in zip(body["groups"], (2, 3), strict=True):
        assert group["dimensions"] == {"version": CELLS[cell]["version"]}
        truth = float(lengths[cell].mean())
        assert abs(group["mean"] - truth) <= z * group["std"], (group, truth)


def test_a_bad_dimension_is_refused_on_the_device_before_anything_is_spent(
    aggregator: Any, tmp_path: Path
) -> None:
    aggregator.define("theme", CRASH)
    with fleet_client(aggregator.url, aggregator.keys["device"], tmp_path, 64) as client:
        for given, words in (
            ({"platform": "tv", "version": "1.0"}, "dimensions.platform"),
            ({"platform": "ios"}, "dimensions.version"),
            ({"platform": "ios", "version": "1.0", "os": "x"}, "dimensions.os"),
            (None, "dimensions.platform"),
        ):
            with pytest.raises(ValueError, match=words):
                client.record("theme", "dark", dimensions=given)
        with pytest.raises(ValueError, match="declares no dimensions"):
            client.record("app.theme", "dark", dimensions={"platform": "ios"})
        assert client.budget().spent_lifetime == 0 and client.queued == 0
        client.record("theme", "dark", dimensions=CELLS[1])
        assert client.queued == 1 and client.flush(timeout=30.0)
    body = get(aggregator, "theme", by="platform").json()
    assert body["n"] == 1 and [g["dimensions"] for g in body["groups"]] == [{"platform": "android"}]


def test_a_bad_dimension_sent_raw_is_a_422_naming_it_and_changes_nothing(
    aggregator: Any,
) -> None:
    aggregator.define("theme", CRASH)

    def report(dimensions: dict[str, str]) -> dict[str, Any]:
        return {
            "report_id": str(uuid.uuid4()),
            "metric": "theme",
            "version": 1,
            "payload": {"value": 1},
            "dimensions": dimensions,
        }

    def send(reports: list[dict[str, Any]]) -> httpx.Response:
        return httpx.post(
            f"{aggregator.url}/v1/reports",
            json={"reports": reports},
            headers=aggregator.headers("device"),
            timeout=30.0,
        )

    assert send([report(CELLS[0])]).json() == {"accepted": 1, "duplicates": 0}
    before = get(aggregator, "theme", by="platform").json()
    refused = send([report(CELLS[2]), report({"platform": "tv", "version": "1.0"})])
    assert refused.status_code == 422
    problem = refused.json()
    assert problem["errors"][0]["field"] == "dimensions.platform"
    assert problem["errors"][0]["report"] == 1 and "'tv'" in problem["errors"][0]["message"]
    assert get(aggregator, "theme", by="platform").json() == before  # nothing stored


def test_dimensions_stay_with_queued_reports_across_a_restart(
    aggregator: Any, tmp_path: Path
) -> None:
    """Reports queued while the aggregator is down keep their dimensions in the outbox, and
    a new client on the same state directory delivers them."""
    aggregator.define("theme", CRASH)
    client = fleet_client(aggregator.url, aggregator.keys["device"], tmp_path, 1000)
    client.record("theme", "light", dimensions=CELLS[3])
    client.record("theme", "dark", dimensions=CELLS[3])
    aggregator.kill()
    client.close(timeout=0.5)
    aggregator.start()
    with fleet_client(aggregator.url, aggregator.keys["device"], tmp_path, 1000) as again:
        assert again.queued == 2 and again.flush(timeout=30.0)
    body = get(aggregator, "theme", by="platform,version").json()
    assert body["n"] == 2 and [g["dimensions"] for g in body["groups"]] == [CELLS[3]]


def test_outbox_rows_without_dimensions_still_load(tmp_path: Path) -> None:
    """A row queued before dimensions existed (no ``dimensions`` key) is sent as it was."""
    old = {"report_id": str(uuid.uuid4()), "metric": "m", "version": 1, "payload": {"value": 1}}
    new = {**old, "report_id": str(uuid.uuid4()), "dimensions": {"platform": "ios"}}
    box = Outbox(tmp_path)
    box.add([old])
    box.close()
    box = Outbox(tmp_path)
    try:
        box.add([new])
        assert [queued.body for queued in box.peek(10)] == [old, new]
    finally:
        box.close()
