"""Analyst requests on large domains are bounded in size, work and concurrency.

The attack: an analyst key asks ``/estimate`` of a metric of 2^20 categories, which
answered 228 MB (an object per category) in 8 to 40 s; six at once took the server to
5.26 GB; ``/series`` served any single step however large; PEM ``heavy-hitters?k=100``
took 34 s of CPU. Now a large domain's estimate lists its largest estimates by default
(``partial``), chosen ones (``values``), pages (``offset``, ``limit``) or compact vectors
(``format=vectors``); a series counts every step against its bound; heavy hitters are
bounded in k and screened (``shared.mechanisms.pem``); and estimates are computed at most
``max_concurrent_estimates`` at once.

The 2^20 metric's statistics are written straight into storage (the mechanism's own
aggregate of simulated reports), as ingesting the reports would only slow the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response

import aggregator.service
from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.estimates import MAX_HEAVY_HITTERS, MAX_SERIES_VALUES
from aggregator.settings import Settings
from aggregator.storage import PartialRow
from aggregator.value_listing import (
    DEFAULT_TOP_VALUES,
    FULL_LIST_DOMAIN,
    MAX_LISTED_VALUES,
    decode_vector,
)
from shared.estimates import Estimate
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

KEYS = {
    "admin": "large-admin-key-0123456789",
    "analyst": "large-analyst-key-0123456789",
    "device": "large-device-key-0123456789",
}
D = 1 << 20
HUGE = {"mechanism": "hr", "epsilon": 4.0, "domain_size": D}
#: Categories most reports hold, in decreasing frequency (0.2 down to 0.067 of 30,000
#: reports); the rest spread over the domain. HR's std at epsilon 4 is about
#: (e^4 + 1) / (e^4 - 1) / sqrt(n) = 0.006: neighbours are 5.5 std apart (swapped with
#: probability Phi(-5.5 / sqrt 2) < 1e-4 each), the last 11 std above zero, where the
#: largest of 2^20 null estimates lies below 6 std but with probability < 1e-3.
HEAVY = np.array([777_777, 3, 1_048_575, 524_288, 65_536])
MB = 1_000_000
BUCKET = 3600 * (int(time.time()) // 3600 - 1)


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Estimate]]:
    """A service with the 2^20 metric ``huge`` (30,000 HR reports in one time bucket) and
    the mechanism's estimate of them, as the published one must be."""
    settings = Settings(
        database=str(tmp_path_factory.mktemp("large") / "large.sqlite3"),
        min_reports=1,
        compaction_interval=0,
        rate_limit_per_second=1e6,
        rate_limit_burst=10**6,
        max_concurrent_estimates=2,
    )
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        response = client.put("/v1/metrics/huge", json={"mechanism": HUGE}, headers=auth("admin"))
        assert response.status_code == 201, response.text
        mech = make_mechanism(MechanismSpec.model_validate(HUGE))
        rng = np.random.default_rng(24)
        values = np.concatenate(
            [np.repeat(HEAVY, [6000, 5000, 4000, 3000, 2000]), rng.integers(0, D, 10_000)]
        )
        stats = mech.aggregate(mech.encode(values, rng))
        storage = client.app.state.services.repositories.reports  # type: ignore[attr-defined]
        storage.add_partial_rows([PartialRow("huge", 1, BUCKET, stats.n, stats.to_bytes())])
        assert isinstance(stats, CountStatistics)
        expected = mech.estimate(stats)
        assert isinstance(expected, Estimate)
        yield client, expected


def get(client: TestClient, path: str, **params: Any) -> Response:
    return client.get(f"/v1/metrics/huge/{path}", params=params, headers=auth("analyst"))


def ok(response: Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text[:500]
    body: dict[str, Any] = response.json()
    return body


def refused(response: Response) -> str:
    assert response.status_code == 422, response.text[:500]
    assert response.headers["content-type"].startswith("application/problem+json")
    return str(response.json()["detail"])


def test_the_default_estimate_lists_the_largest_estimates_in_a_few_megabytes(
    served: tuple[TestClient, Estimate],
) -> None:
    client, expected = served
    response = get(client, "estimate")
    assert len(response.content) < 5 * MB
    body = ok(response)
    assert body["domain_size"] == D and body["partial"] is True
    assert body["order"] == "frequency" and body["offset"] == 0
    assert body["next_offset"] == DEFAULT_TOP_VALUES
    listed = [item["index"] for item in body["estimates"]]
    assert len(listed) == DEFAULT_TOP_VALUES
    # The largest unbiased estimates, largest first, ties by index: exactly.
    ranking = np.lexsort((np.arange(D), -expected.frequencies))[:DEFAULT_TOP_VALUES]
    assert listed == ranking.tolist()
    assert listed[: HEAVY.size] == HEAVY.tolist()
    assert [item["frequency"] for item in body["estimates"]] == (
        expected.frequencies[ranking].tolist()
    )
    projected = expected.postprocessed().frequencies
    assert [item["index"] for item in body["postprocessed"]] == listed
    assert [item["frequency"] for item in body["postprocessed"]] == projected[ranking].tolist()


def test_values_lists_exactly_the_categories_named(served: tuple[TestClient, Estimate]) -> None:
    client, expected = served
    named = [5, 777_777, 0, D - 1]
    body = ok(get(client, "estimate", values=[str(index) for index in named]))
    assert [item["index"] for item in body["estimates"]] == named
    assert body["order"] == "values" and body["partial"] is True and body["next_offset"] is None
    frequencies = expected.frequencies[named]
    low, high = expected.ci(0.95)
    assert [item["frequency"] for item in body["estimates"]] == frequencies.tolist()
    assert [item["std"] for item in body["estimates"]] == expected.std[named].tolist()
    assert [item["ci_low"] for item in body["estimates"]] == low[named].tolist()
    assert [item["ci_high"] for item in body["estimates"]] == high[named].tolist()
    assert [item["count"] for item in body["estimates"]] == (frequencies * expected.n).tolist()
    for bad, message in [
        (["1048576"], "not a category index 0..1048575"),
        (["-1"], "not a category index"),
        (["red"], "not a category index"),
        (["7", "7"], "already listed"),
    ]:
        assert message in refused(get(client, "estimate", values=bad))


def test_pages_in_index_order_cover_the_domain(served: tuple[TestClient, Estimate]) -> None:
    client, expected = served
    body = ok(get(client, "estimate", order="index", offset=D - 3, limit=10))
    assert [item["index"] for item in body["estimates"]] == [D - 3, D - 2, D - 1]
    assert body["next_offset"] is None and body["partial"] is True
    body = ok(get(client, "estimate", order="frequency", offset=2, limit=2))
    assert [item["index"] for item in body["estimates"]] == HEAVY[2:4].tolist()
    assert body["next_offset"] == 4
    assert "past the last category" in refused(get(client, "estimate", offset=D))
    detail = refused(get(client, "estimate", limit=MAX_LISTED_VALUES + 1))
    assert "format=vectors" in detail
    assert "omit order, offset and limit" in refused(get(client, "estimate", values=["1"], limit=5))


def test_the_whole_vector_comes_as_float32_vectors(served: tuple[TestClient, Estimate]) -> None:
    client, expected = served
    response = get(client, "estimate", format="vectors")
    # 3 vectors of 2^20 float32 in base64: 16.8 MB, against 228 MB as objects.
    assert len(response.content) < 17.5 * MB
    body = ok(response)
    assert body["estimates"] == [] and body["postprocessed"] == []
    vectors = body["vectors"]
    assert vectors["first"] == 0 and vectors["count"] == D and body["partial"] is False
    frequency = decode_vector(vectors["frequency"])
    np.testing.assert_array_equal(frequency, expected.frequencies.astype(np.float32))
    np.testing.assert_array_equal(decode_vector(vectors["std"]), expected.std.astype(np.float32))
    projected = expected.postprocessed().frequencies.astype(np.float32)
    np.testing.assert_array_equal(decode_vector(vectors["postprocessed"]), projected)
    page = ok(get(client, "estimate", format="vectors", offset=100, limit=50))["vectors"]
    assert page["first"] == 100 and page["count"] == 50
    np.testing.assert_array_equal(decode_vector(page["frequency"]), frequency[100:150])
    assert "index order" in refused(get(client, "estimate", format="vectors", values=["1"]))


def test_a_series_counts_every_step_against_its_bound(
    served: tuple[TestClient, Estimate],
) -> None:
    client, _ = served
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(BUCKET))
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(BUCKET + 3600))
    # One step: listed as /estimate lists it (it used to be served whole, 2^21 values).
    response = get(client, "series", start=start, end=end)
    assert len(response.content) < 5 * MB
    (step,) = ok(response)["steps"]
    assert len(step["estimate"]["estimates"]) == DEFAULT_TOP_VALUES
    assert step["estimate"] == ok(get(client, "estimate", start=start, end=end))
    # Steps of the most categories a step may list: five fit, six are refused, saying
    # what to narrow (each step counts, the first one too).
    fits = MAX_SERIES_VALUES // (2 * MAX_LISTED_VALUES)
    day = BUCKET // 86400 * 86400
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(day + 86400))
    for steps in (fits, fits + 1):
        first = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(day - (steps - 1) * 86400))
        answer = get(client, "series", start=first, end=end, step="1d", limit=MAX_LISTED_VALUES)
        if steps == fits:
            assert len(ok(answer)["steps"]) == fits
        else:
            detail = refused(answer)
            assert f"{steps} steps x {2 * MAX_LISTED_VALUES} values" in detail
            assert "limit=" in detail and "values=" in detail


@pytest.mark.slow
def test_estimates_are_computed_a_bounded_number_at_once(
    served: tuple[TestClient, Estimate], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _ = served
    running = most = 0
    lock = threading.Lock()
    build = aggregator.service.build_estimate

    def slow_build(*args: Any, **kwargs: Any) -> dict[str, object]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.3)
        try:
            return build(*args, **kwargs)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(aggregator.service, "build_estimate", slow_build)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: get(client, "estimate"), range(6)))
    assert all(answer.status_code == 200 for answer in answers)
    assert most == 2  # Settings.max_concurrent_estimates


def test_heavy_hitters_past_the_cap_are_refused(served: tuple[TestClient, Estimate]) -> None:
    client, _ = served
    response = get(client, "heavy-hitters", k=MAX_HEAVY_HITTERS + 1)
    assert response.status_code == 422


def test_the_openapi_document_states_the_bounds(served: tuple[TestClient, Estimate]) -> None:
    client, _ = served
    document = client.get("/openapi.json").json()
    operation = document["paths"]["/v1/metrics/{name}/estimate"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert parameters["values"]["schema"]["maxItems"] == MAX_LISTED_VALUES
    limit = parameters["limit"]
    assert f"{MAX_LISTED_VALUES:,}" in limit["description"]
    assert f"{DEFAULT_TOP_VALUES:,}" in limit["description"]
    assert f"{FULL_LIST_DOMAIN:,}" in limit["description"]
    assert parameters["format"]["schema"]["enum"] == ["json", "vectors"]
    hitters = document["paths"]["/v1/metrics/{name}/heavy-hitters"]["get"]
    (k,) = [p for p in hitters["parameters"] if p["name"] == "k"]
    assert k["schema"]["maximum"] == MAX_HEAVY_HITTERS
    categorical = document["components"]["schemas"]["CategoricalEstimateOut"]
    assert {"domain_size", "partial", "order", "offset", "next_offset"} <= set(
        categorical["required"]
    )


def test_small_domains_list_everything_and_values_take_labels(
    served: tuple[TestClient, Estimate],
) -> None:
    client, _ = served
    labels = ["red", "green", "blue", "0"]
    spec = {"mechanism": {"mechanism": "grr", "epsilon": 2.0, "domain_size": 4}, "labels": labels}
    assert client.put("/v1/metrics/colour", json=spec, headers=auth("admin")).status_code == 201
    mech = make_mechanism(MechanismSpec.model_validate(spec["mechanism"]))
    stats = mech.aggregate(mech.encode(np.arange(400) % 4, np.random.default_rng(5)))
    storage = client.app.state.services.repositories.reports  # type: ignore[attr-defined]
    storage.add_partial_rows([PartialRow("colour", 1, BUCKET, stats.n, stats.to_bytes())])
    path = "/v1/metrics/colour/estimate"
    whole = ok(client.get(path, headers=auth("analyst")))
    assert [item["label"] for item in whole["estimates"]] == labels
    assert {key: whole[key] for key in ("domain_size", "partial", "order", "offset")} == {
        "domain_size": 4,
        "partial": False,
        "order": "index",
        "offset": 0,
    }
    assert whole["next_offset"] is None and whole["vectors"] is None
    # A label wins over the index it spells: "0" is the label of category 3.
    chosen = ok(client.get(path, params={"values": ["green", "0", "2"]}, headers=auth("analyst")))
    assert [item["index"] for item in chosen["estimates"]] == [1, 3, 2]
    assert chosen["estimates"] == [whole["estimates"][i] for i in (1, 3, 2)]
    assert chosen["postprocessed"] == [whole["postprocessed"][i] for i in (1, 3, 2)]
    numeric = {"mechanism": {"mechanism": "laplace", "epsilon": 1.0, "lower": 0, "upper": 1}}
    assert client.put("/v1/metrics/level", json=numeric, headers=auth("admin")).status_code == 201
    level = make_mechanism(MechanismSpec.model_validate(numeric["mechanism"]))
    moments = level.aggregate(level.encode(np.full(200, 0.5), np.random.default_rng(6)))
    storage.add_partial_rows([PartialRow("level", 1, BUCKET, moments.n, moments.to_bytes())])
    detail = refused(client.get("/v1/metrics/level/estimate?limit=3", headers=auth("analyst")))
    assert "categorical metric" in detail
