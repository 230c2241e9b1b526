"""Open-domain string metrics over HTTP, in process: candidate estimates and heavy hitters.

``GET /v1/metrics/{name}/estimate`` answers a ``cms``, ``hcms``, ``pem`` or ``sfp`` metric at
candidate strings (the metric's labels by default, or the request's), and
``GET /v1/metrics/{name}/heavy-hitters?k=`` a discovery metric (``pem``, ``sfp``) with the
strings it finds. The reports are encoded with a seeded generator and posted in two
batches, so the server merges two partial rows; its answer must equal the mechanism's
own ``estimate`` / ``heavy_hitters`` of ``aggregate(reports)`` exactly (integer counts
merge exactly): estimates for all four, heavy hitters for ``pem`` (``sfp``'s are found end
to end in ``tests/client/test_string_reporting.py``). Bad arguments get problem
documents: k out of range, heavy hitters of a metric that cannot discover strings, an
unknown metric, too few reports, candidates missing or too long.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.demo_data import DEMO_HOURS, DEMO_REPORTS_PER_HOUR, fill_demo_data
from aggregator.estimates import MAX_HEAVY_HITTERS
from aggregator.service import InvalidEstimateError, Services
from aggregator.settings import Settings
from shared.mechanisms import make_mechanism
from shared.mechanisms.strings import OpenStringMechanism
from shared.schemas import MechanismSpec, MetricDefinition

KEYS = {
    "admin": "strings-test-admin-key-0123456789",
    "analyst": "strings-test-analyst-key-0123456789",
    "device": "strings-test-device-key-0123456789",
}
MIN_REPORTS = 10
#: The population every metric's devices hold (max_length 4 bytes), by weight.
STRINGS = ["kiwi", "fig", "plum", "lime", "pear", "Öl", ""]
WEIGHTS = np.array([30, 22, 16, 12, 10, 6, 4], dtype=np.float64)
LABELS = ["kiwi", "fig", "plum"]
SPECS: dict[str, dict[str, Any]] = {
    "cms": {"mechanism": "cms", "epsilon": 3.0, "sketch_width": 64, "sketch_depth": 8},
    "hcms": {"mechanism": "hcms", "epsilon": 3.0, "sketch_width": 64, "sketch_depth": 8},
    "pem": {"mechanism": "pem", "epsilon": 4.0, "max_length": 4},
    "sfp": {
        "mechanism": "sfp",
        "epsilon": 4.0,
        "max_length": 4,
        "sketch_width": 64,
        "sketch_depth": 8,
    },
}
NUMERIC = {"mechanism": "piecewise", "epsilon": 1.0, "lower": 0.0, "upper": 10.0}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """The service on a fresh SQLite file, the three test keys imported."""
    settings = Settings(
        database=str(tmp_path / "strings.sqlite3"), min_reports=MIN_REPORTS, compaction_interval=0
    )
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as test_client:
        yield test_client


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


def define(client: TestClient, name: str, labels: list[str] | None = None) -> OpenStringMechanism:
    """Define metric ``name`` with ``SPECS[name]`` (and ``labels``); its mechanism."""
    body: dict[str, Any] = {"mechanism": SPECS[name], "labels": labels}
    response = client.put(f"/v1/metrics/{name}", json=body, headers=auth("admin"))
    assert response.status_code == 201, response.text
    mechanism = make_mechanism(MechanismSpec.model_validate(SPECS[name]))
    assert isinstance(mechanism, OpenStringMechanism)
    return mechanism


def post_reports(client: TestClient, name: str, mechanism: Any, n: int, seed: int) -> Any:
    """``n`` devices' reports of strings drawn from ``STRINGS``, encoded with a seeded
    generator and posted in two batches; the statistics they aggregate to."""
    rng = np.random.default_rng(seed)
    values = [STRINGS[i] for i in rng.choice(len(STRINGS), n, p=WEIGHTS / WEIGHTS.sum())]
    encoded = mechanism.encode(values, rng=rng)
    payloads = mechanism.to_payloads(encoded)
    for chunk in (payloads[: n // 3], payloads[n // 3 :]):
        body = {
            "reports": [
                {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": p}
                for p in chunk
            ]
        }
        response = client.post("/v1/reports", json=body, headers=auth("device"))
        assert response.json() == {"accepted": len(chunk), "duplicates": 0}, response.text
    return mechanism.aggregate(encoded)


def problem(response: Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{kind}" and body["status"] == status and body["detail"]
    return body


def assert_items(items: list[dict[str, Any]], strings: list[str], expected: Any) -> None:
    """The published items are the mechanism's estimate, exactly."""
    low, high = expected.ci(0.95)
    assert [item["string"] for item in items] == strings
    assert [item["frequency"] for item in items] == expected.frequencies.tolist()
    assert [item["std"] for item in items] == expected.std.tolist()
    assert [item["ci_low"] for item in items] == low.tolist()
    assert [item["ci_high"] for item in items] == high.tolist()
    assert [item["count"] for item in items] == expected.counts.tolist()


@pytest.mark.parametrize("name", list(SPECS))
def test_candidate_estimates_equal_the_mechanisms(client: TestClient, name: str) -> None:
    """Estimated at the metric's labels by default, at the request's candidates when given
    (one no device holds among them); RAPPOR's decoding fields are null."""
    mechanism = define(client, name, LABELS)
    stats = post_reports(client, name, mechanism, 600, seed=sum(map(ord, name)))

    response = client.get(f"/v1/metrics/{name}/estimate", headers=auth("analyst"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["kind"], body["mechanism"], body["n"]) == ("string", name, 600)
    assert (body["epsilon"], body["min_reports"], body["buckets"]) == (
        SPECS[name]["epsilon"],
        MIN_REPORTS,
        1,
    )
    assert_items(body["candidates"], LABELS, mechanism.estimate(stats, LABELS))
    assert all(item["detected"] is None for item in body["candidates"])
    for field in ("epsilon_infinity", "detected", "explained_mass", "correction", "alpha"):
        assert body[field] is None

    asked = ["Öl", "nope", "kiwi"]
    response = client.get(
        f"/v1/metrics/{name}/estimate", params={"candidates": asked}, headers=auth("analyst")
    )
    assert response.status_code == 200, response.text
    assert_items(response.json()["candidates"], asked, mechanism.estimate(stats, asked))


def test_heavy_hitters_equal_the_mechanisms(client: TestClient) -> None:
    """pem's; sfp's (seconds per search: a 2^24-point transform per fragment position) are
    found end to end in ``tests/client/test_string_reporting.py``."""
    name = "pem"
    mechanism = define(client, name)
    stats = post_reports(client, name, mechanism, 1200, seed=7 + len(name))
    response = client.get(
        f"/v1/metrics/{name}/heavy-hitters", params={"k": 3}, headers=auth("analyst")
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["kind"], body["k"], body["n"], body["mechanism"]) == (
        "heavy-hitters",
        3,
        1200,
        name,
    )
    assert body["window"] == {"start": None, "end": None}
    found = mechanism.heavy_hitters(stats, 3)
    assert_items(body["heavy_hitters"], list(found.strings), found)
    # A window without reports is refused as the estimate's is.
    late = {"k": 3, "start": "2100-01-01T00:00:00Z"}
    refused = client.get(f"/v1/metrics/{name}/heavy-hitters", params=late, headers=auth("analyst"))
    problem(refused, 409, "not-enough-reports")


def test_bad_heavy_hitter_requests_get_problem_documents(client: TestClient) -> None:
    define(client, "cms", LABELS)
    define(client, "pem")
    response = client.put("/v1/metrics/minutes", json={"mechanism": NUMERIC}, headers=auth("admin"))
    assert response.status_code == 201, response.text

    def heavy(name: str, role: str = "analyst", **params: Any) -> Response:
        return client.get(f"/v1/metrics/{name}/heavy-hitters", params=params, headers=auth(role))

    for k in (0, -3, MAX_HEAVY_HITTERS + 1, "ten"):
        body = problem(heavy("pem", k=k), 422, "invalid-request")
        assert [error["field"] for error in body["errors"]] == ["query.k"]
    cms = problem(heavy("cms"), 422, "not-a-discovery-metric")
    assert "'cms'" in cms["detail"] and "estimate?candidates=" in cms["detail"]
    numeric = problem(heavy("minutes"), 422, "not-a-discovery-metric")
    assert "'piecewise'" in numeric["detail"]
    problem(heavy("absent"), 404, "unknown-metric")
    problem(heavy("pem", version=2), 404, "unknown-metric")
    assert "holds 0 reports" in problem(heavy("pem"), 409, "not-enough-reports")["detail"]
    problem(heavy("pem", start="yesterday"), 422, "invalid-request")
    assert heavy("pem", role="device").status_code == 403
    assert client.get("/v1/metrics/pem/heavy-hitters").status_code == 401
    # The service refuses a k out of range itself, for callers other than the route.
    service = client.app.state.aggregator  # type: ignore[attr-defined]
    with pytest.raises(InvalidEstimateError, match=f"1..{MAX_HEAVY_HITTERS}"):
        service.heavy_hitters("pem", 0)


def test_bad_candidates_get_problem_documents(client: TestClient) -> None:
    """None listed nor asked for; longer than a discovery metric's max_length."""
    post_reports(client, "cms", define(client, "cms"), 100, seed=3)
    post_reports(client, "pem", define(client, "pem"), 100, seed=4)

    def estimate(name: str, **params: Any) -> Response:
        return client.get(f"/v1/metrics/{name}/estimate", params=params, headers=auth("analyst"))

    assert "candidates=" in problem(estimate("cms"), 422, "invalid-request")["detail"]
    too_long = estimate("pem", candidates=["kiwi", "Äpfel"])
    assert "max_length" in problem(too_long, 422, "invalid-request")["detail"]


@pytest.mark.slow
def test_demo_data_fills_string_metrics_with_candidates(tmp_path: Path) -> None:
    """``serve --demo-data``: a string metric's simulated devices hold its labels that fit
    its max_length (Zipf shares); one without labels is left empty. The pem population's
    top label (share 0.57 of the three that fit, 14,400 reports at epsilon 4) is its top
    heavy hitter: the next string's share is 0.27, over 10 estimated sd below."""
    services = Services.open(Settings(database=str(tmp_path / "demo.sqlite3")))
    service = services.aggregator
    try:
        labels = {"cms": LABELS, "pem": ["kiwi", "Äpfel", "fig", "plum"], "sfp": None}
        for name, listed in labels.items():
            service.define(
                name,
                MetricDefinition.model_validate({"mechanism": SPECS[name], "labels": listed}),
            )
        per_metric = DEMO_HOURS * DEMO_REPORTS_PER_HOUR
        stored = fill_demo_data(service, rng=np.random.default_rng(11))
        assert stored == {"cms": per_metric, "pem": per_metric}
        estimate = service.estimate("cms")
        candidates = estimate["candidates"]
        assert estimate["n"] == per_metric and isinstance(candidates, list)
        assert [item["string"] for item in candidates] == LABELS
        hitters = service.heavy_hitters("pem", 1)["heavy_hitters"]
        assert isinstance(hitters, list) and [item["string"] for item in hitters] == ["kiwi"]
    finally:
        services.close()
