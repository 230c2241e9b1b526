"""``GET /v1/metrics/{name}/series``: one estimate per hour or UTC day, each the estimate
endpoint's own answer for that step's window.

Checked: the steps' grid (widened to whole steps, defaults, limits), each released step
equal to ``/estimate`` over its window and version for every kind of metric, steps below
the per-bucket release threshold listed with their ``n`` and no estimate (where the
estimate endpoint answers 409), a version change inside the range (a series is of one
version), one storage query per series, every refusal as a problem document, and the
OpenAPI document.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator import demo_data
from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.demo_data import fill_demo_data
from aggregator.estimates import (
    DEFAULT_SERIES_STEPS,
    MAX_SERIES_STEPS,
    MAX_SERIES_VALUES,
    SeriesGrid,
    SeriesOut,
)
from aggregator.registry import DEMO_METRICS
from aggregator.repositories.reports import PROFILE
from aggregator.settings import Settings
from aggregator.value_listing import DEFAULT_TOP_VALUES

KEYS = {
    "admin": "series-admin-key-0123456789",
    "analyst": "series-analyst-key-0123456789",
    "device": "series-device-key-0123456789",
}
MIN_REPORTS = 10
GRR4 = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
#: The start of the UTC hour the module began in: every report is stamped before it.
BASE = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Api:
    client: TestClient
    app: Any

    @staticmethod
    def auth(role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[role]}"}

    def define(self, name: str, spec: dict[str, Any], labels: list[str] | None = None) -> int:
        body: dict[str, Any] = {"mechanism": spec}
        if labels is not None:
            body["labels"] = labels
        response = self.client.put(f"/v1/metrics/{name}", json=body, headers=self.auth("admin"))
        assert response.status_code in (200, 201), response.text
        return int(response.json()["version"])

    def post(self, name: str, version: int, values: list[int], hour: datetime) -> None:
        """GRR reports of ``values`` as sent (any value is a valid report), stamped ``hour``."""
        batch = [
            {
                "report_id": str(uuid.uuid4()),
                "metric": name,
                "version": version,
                "payload": {"value": value},
                "time": iso(hour),
            }
            for value in values
        ]
        response = self.client.post(
            "/v1/reports", json={"reports": batch}, headers=self.auth("device")
        )
        assert response.json() == {"accepted": len(values), "duplicates": 0}, response.text

    def series(self, name: str, role: str = "analyst", **params: Any) -> Response:
        return self.client.get(f"/v1/metrics/{name}/series", params=params, headers=self.auth(role))

    def series_body(self, name: str, **params: Any) -> dict[str, Any]:
        response = self.series(name, **params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def estimate(self, name: str, **params: Any) -> Response:
        return self.client.get(
            f"/v1/metrics/{name}/estimate", params=params, headers=self.auth("analyst")
        )


@contextmanager
def running(database: str) -> Iterator[Api]:
    settings = Settings(
        database=database,
        min_reports=MIN_REPORTS,
        compaction_interval=0,
        rate_limit_per_second=1e6,
        rate_limit_burst=10**6,
    )
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Api(client, app)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with running(str(tmp_path_factory.mktemp("series") / "series.sqlite3")) as service:
        yield service


def problem(response: Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{kind}"
    return body


def assert_steps_are_their_windows_estimates(api: Api, body: dict[str, Any]) -> None:
    """Each step: an estimate equal to ``/estimate`` over its window and version, or null
    exactly where ``/estimate`` refuses for want of reports; ``n`` counts every report."""
    for step in body["steps"]:
        answer = api.estimate(
            body["metric"], start=step["start"], end=step["end"], version=body["version"]
        )
        if step["estimate"] is None:
            assert answer.status_code == 409, (step, answer.text)
            assert f"holds {step['n']} reports" in answer.json()["detail"]
        else:
            assert answer.status_code == 200, answer.text
            expected = answer.json()
            if expected["kind"] == "distribution":  # a series lists no histogram or CDF
                expected |= {"histogram": [], "cdf": []}
            if expected["kind"] == "attributes":  # nor a pair's joint distribution
                expected |= {"marginals": []}
            assert step["estimate"] == expected
            estimate = step["estimate"]
            assert estimate["n"] + estimate["suppressed_reports"] == step["n"]


# --- the grid of steps ----------------------------------------------------------------------


def test_the_range_is_widened_to_whole_utc_steps() -> None:
    start = datetime(2026, 11, 20, 10, 30, tzinfo=UTC)
    end = datetime(2026, 11, 20, 12, 0, 1, tzinfo=UTC)
    grid = SeriesGrid.of(start, end, "1h", 3600, BASE)
    assert grid.first == int(datetime(2026, 11, 20, 10, tzinfo=UTC).timestamp())
    assert (grid.count, grid.seconds) == (3, 3600)
    assert grid.stop == int(datetime(2026, 11, 20, 13, tzinfo=UTC).timestamp())
    # Days are UTC days, whatever the offset the times are written in.
    local = datetime.fromisoformat("2026-11-20T01:00:00+02:00")  # 2026-11-19T23:00Z
    days = SeriesGrid.of(local, local + timedelta(hours=2), "1d", 3600, BASE)
    assert days.first == int(datetime(2026, 11, 19, tzinfo=UTC).timestamp())
    assert days.count == 2
    assert days.window(1).as_json() == {
        "start": "2026-11-20T00:00:00Z",
        "end": "2026-11-21T00:00:00Z",
    }
    # An end on a step boundary is not widened.
    exact = SeriesGrid.of(start, datetime(2026, 11, 20, 12, tzinfo=UTC), "1h", 3600, BASE)
    assert exact.count == 2


def test_default_range_ends_with_the_current_step() -> None:
    now = datetime(2026, 11, 20, 10, 30, tzinfo=UTC)
    hours = SeriesGrid.of(None, None, "1h", 3600, now)
    assert hours.stop == int(datetime(2026, 11, 20, 11, tzinfo=UTC).timestamp())
    assert hours.count == DEFAULT_SERIES_STEPS["1h"] == 168
    days = SeriesGrid.of(None, None, "1d", 3600, now)
    assert days.stop == int(datetime(2026, 11, 21, tzinfo=UTC).timestamp())
    assert days.count == DEFAULT_SERIES_STEPS["1d"] == 30
    start_only = SeriesGrid.of(now - 3 * HOUR, None, "1h", 3600, now)
    assert start_only.count == 4  # 07:00 to 11:00, the current hour included


@pytest.mark.parametrize(
    ("start", "end", "step", "bucket", "message"),
    [
        (BASE, BASE, "1h", 3600, "start must be earlier than end"),
        (BASE + HOUR, BASE, "1h", 3600, "start must be earlier than end"),
        (BASE + 2 * DAY, None, "1h", 3600, "earlier than end (by default now)"),
        (BASE - (MAX_SERIES_STEPS + 1) * HOUR, BASE, "1h", 3600, f"at most {MAX_SERIES_STEPS}"),
        (BASE - HOUR, BASE, "1h", 7200, "not a whole number of the storage's 7200 s"),
        (None, datetime(9999, 12, 31, 12, tzinfo=UTC), "1d", 3600, "years 1 and 9999"),
        (datetime(1, 1, 1, tzinfo=UTC), datetime(1, 1, 2, tzinfo=UTC), "1d", 3600, None),
        (None, datetime(1, 1, 2, tzinfo=UTC), "1d", 3600, "years 1 and 9999"),
        (datetime(2026, 1, 1), BASE, "1d", 3600, "must carry a time zone"),  # noqa: DTZ001
    ],
)
def test_grids_that_cannot_be_served_are_refused(
    start: datetime | None, end: datetime | None, step: Any, bucket: int, message: str | None
) -> None:
    if message is None:  # the first UTC day of year 1 is representable
        assert SeriesGrid.of(start, end, step, bucket, BASE).count == 1
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SeriesGrid.of(start, end, step, bucket, BASE)


def test_the_longest_series_is_served(api: Api) -> None:
    api.define("longest", GRR4)
    body = api.series_body(
        "longest", start=iso(BASE - MAX_SERIES_STEPS * HOUR), end=iso(BASE), step="1h"
    )
    assert len(body["steps"]) == MAX_SERIES_STEPS >= 90 * 24  # 90 days of hours fit
    assert all(step["n"] == 0 and step["estimate"] is None for step in body["steps"])


# --- steps and their estimates ---------------------------------------------------------------


def test_each_hour_is_its_windows_estimate_and_small_hours_keep_their_n(api: Api) -> None:
    version = api.define("hourly", GRR4, ["a", "b", "c", "d"])
    rng = np.random.default_rng(11)
    # Six hours: 12 reports, none, 5 (below the threshold), 10 (at it), 30 in two batches
    # (two partial rows), 3.
    sizes = {6: [12], 5: [], 4: [5], 3: [10], 2: [14, 16], 1: [3]}
    for back, batches in sizes.items():
        for size in batches:
            api.post("hourly", version, rng.integers(0, 4, size).tolist(), BASE - back * HOUR)
    body = api.series_body("hourly", start=iso(BASE - 6 * HOUR), end=iso(BASE), step="1h")
    assert (body["metric"], body["version"], body["kind"], body["step"]) == (
        "hourly",
        version,
        "categorical",
        "1h",
    )
    assert (body["start"], body["end"]) == (iso(BASE - 6 * HOUR), iso(BASE))
    assert body["min_reports"] == MIN_REPORTS
    steps = body["steps"]
    assert [step["start"] for step in steps] == [iso(BASE - k * HOUR) for k in range(6, 0, -1)]
    assert [step["end"] for step in steps] == [iso(BASE - k * HOUR) for k in range(5, -1, -1)]
    assert [step["n"] for step in steps] == [12, 0, 5, 10, 30, 3]
    released = [step["estimate"] is not None for step in steps]
    assert released == [True, False, False, True, True, False]
    assert steps[4]["estimate"]["n"] == 30 and steps[4]["estimate"]["buckets"] == 1
    assert [item["label"] for item in steps[0]["estimate"]["estimates"]] == ["a", "b", "c", "d"]
    assert_steps_are_their_windows_estimates(api, body)


def test_a_day_releases_its_buckets_not_the_day(api: Api) -> None:
    """A 1d step holds 24 hourly buckets; only those reaching the threshold enter its
    estimate (as for a day-long window of the estimate endpoint), and n counts them all."""
    version = api.define("daily", GRR4)
    today = BASE.replace(hour=0)
    yesterday, before = today - DAY, today - 2 * DAY
    for offset in (1, 2, 3):  # 9 reports over three hours: no bucket is released
        api.post("daily", version, [0, 1, 2], before + offset * HOUR)
    api.post("daily", version, [0] * 12, yesterday + HOUR)
    api.post("daily", version, [1] * 4, yesterday + 2 * HOUR)  # suppressed
    api.post("daily", version, [2] * 10, yesterday + 5 * HOUR)
    body = api.series_body("daily", start=iso(before), end=iso(today), step="1d")
    first, second = body["steps"]
    assert (first["start"], first["end"], second["end"]) == (
        iso(before),
        iso(yesterday),
        iso(today),
    )
    assert (first["n"], first["estimate"]) == (9, None)
    assert second["n"] == 26
    estimate = second["estimate"]
    assert (estimate["n"], estimate["buckets"]) == (22, 2)
    assert (estimate["suppressed_buckets"], estimate["suppressed_reports"]) == (1, 4)
    assert_steps_are_their_windows_estimates(api, body)


def test_a_version_change_inside_the_range(api: Api) -> None:
    """Reports of version 1 before and after the change, of version 2 after it: each
    version's series holds its own reports only, over the same steps."""
    first = api.define("versioned", GRR4)
    for back in (6, 5, 2):  # version-1 reports keep arriving after version 2 exists
        api.post("versioned", first, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], BASE - back * HOUR)
    second = api.define("versioned", {**GRR4, "epsilon": 2.0})
    assert second == first + 1
    for back in (3, 2):
        api.post("versioned", second, [3] * 10 + [2] * 5, BASE - back * HOUR)
    window = {"start": iso(BASE - 6 * HOUR), "end": iso(BASE), "step": "1h"}

    current = api.series_body("versioned", **window)  # the default: the current version
    assert (current["version"], current["epsilon"]) == (second, 2.0)
    assert [step["n"] for step in current["steps"]] == [0, 0, 0, 15, 15, 0]
    released = [step["estimate"] for step in current["steps"] if step["estimate"]]
    assert [(e["version"], e["epsilon"], e["n"]) for e in released] == [(second, 2.0, 15)] * 2

    old = api.series_body("versioned", version=first, **window)
    assert (old["version"], old["epsilon"]) == (first, 1.0)
    assert [step["n"] for step in old["steps"]] == [10, 10, 0, 0, 10, 0]
    assert [s["start"] for s in old["steps"]] == [s["start"] for s in current["steps"]]
    assert all(s["estimate"] is None or s["estimate"]["version"] == first for s in old["steps"])
    assert_steps_are_their_windows_estimates(api, current)
    assert_steps_are_their_windows_estimates(api, old)


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """A service with one metric of each kind (categorical, numeric, RAPPOR, an
    open-domain sketch, a memoized one), each filled with demo reports in the three hours
    up to ``BASE``."""
    database = str(tmp_path_factory.mktemp("kinds") / "kinds.sqlite3")
    with running(database) as api:
        service = api.app.state.aggregator
        service.define_missing(DEMO_METRICS)
        api.define(
            "words",
            {"mechanism": "cms", "epsilon": 3.0, "sketch_width": 64, "sketch_depth": 8},
            ["kiwi", "fig", "plum"],
        )
        api.define(
            "mood",
            {"mechanism": "lgrr", "epsilon": 4.0, "epsilon_report": 1.0, "domain_size": 3},
            ["calm", "busy", "away"],
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(demo_data, "DEMO_HOURS", 3)
            filled = fill_demo_data(service, now=BASE, rng=np.random.default_rng(3))
        assert len(filled) == len(DEMO_METRICS) + 2
        yield api


@pytest.mark.parametrize("name", [*sorted(DEMO_METRICS), "words", "mood"])
def test_every_kind_is_served_as_its_estimates_and_conforms(every_kind: Api, name: str) -> None:
    body = every_kind.series_body(name, start=iso(BASE - 2 * HOUR), end=iso(BASE + HOUR))
    assert [step["n"] for step in body["steps"]] == [demo_data.DEMO_REPORTS_PER_HOUR] * 3
    assert body["kind"] == every_kind.app.state.aggregator.catalog.get(name).mechanism.kind
    assert_steps_are_their_windows_estimates(every_kind, body)
    # Sent without validating again: the body must be exactly what its model gives.
    assert SeriesOut.model_validate(body).model_dump(mode="json") == body


def test_a_series_reads_the_storage_once(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    version = api.define("read-once", GRR4)
    for back in range(1, 25):
        api.post("read-once", version, [0] * MIN_REPORTS, BASE - back * HOUR)
    storage = api.app.state.services.repositories.reports
    calls: list[tuple[Any, ...]] = []
    read = storage.partial_rows

    def counted(*args: Any) -> Any:
        calls.append(args)
        return read(*args)

    monkeypatch.setattr(storage, "partial_rows", counted)
    start = BASE - 24 * HOUR
    body = api.series_body("read-once", start=iso(start), end=iso(BASE), step="1h")
    assert all(step["estimate"] is not None for step in body["steps"])
    window = (int(start.timestamp()), int(BASE.timestamp()))
    # the statistics once, and the profiles once (for the steps' integrity)
    assert calls == [("read-once", version, *window), ("read-once", version, *window, PROFILE)]


# --- refusals ------------------------------------------------------------------------------


def test_refusals_are_problem_documents(api: Api) -> None:
    api.define("refused", GRR4)
    window = {"start": iso(BASE - 2 * HOUR), "end": iso(BASE)}
    body = problem(api.series("refused", step="2h", **window), 422, "invalid-request")
    assert (
        body["errors"][0]["field"] == "query.step"
        and "'1h' or '1d'" in body["errors"][0]["message"]
    )
    later = {"start": iso(BASE), "end": iso(BASE - HOUR)}
    body = problem(api.series("refused", **later), 422, "invalid-request")
    assert "start must be earlier than end" in body["detail"]
    too_long = {"start": iso(BASE - (MAX_SERIES_STEPS + 1) * HOUR), "end": iso(BASE)}
    body = problem(api.series("refused", **too_long), 422, "invalid-request")
    assert f"holds {MAX_SERIES_STEPS + 1} steps of 1h" in body["detail"]
    assert f"at most {MAX_SERIES_STEPS}" in body["detail"]
    naive = {"start": "2026-01-01T00:00:00", "end": iso(BASE)}
    body = problem(api.series("refused", **naive), 422, "invalid-request")
    assert body["errors"][0]["field"] == "query.start"
    body = problem(api.series("refused", end="9999-12-31T23:30:00Z"), 422, "invalid-request")
    assert "years 1 and 9999" in body["detail"]
    problem(api.series("absent"), 404, "unknown-metric")
    problem(api.series("refused", version=2), 404, "unknown-metric")
    problem(api.client.get("/v1/metrics/refused/series"), 401, "unauthorized")
    problem(api.series("refused", role="device"), 403, "forbidden")


def test_the_number_of_values_is_bounded(api: Api) -> None:
    """A categorical step holds 2 d values (estimates and the post-processed distribution)
    when it lists its d categories."""
    d = 1000
    api.define("wide", {"mechanism": "grr", "epsilon": 1.0, "domain_size": d})
    fits = MAX_SERIES_VALUES // (2 * d)
    end = BASE - 5 * DAY
    body = api.series_body("wide", start=iso(end - fits * HOUR), end=iso(end))
    assert len(body["steps"]) == fits
    refused = api.series("wide", start=iso(end - (fits + 1) * HOUR), end=iso(end))
    detail = problem(refused, 422, "invalid-request")["detail"]
    assert f"{fits + 1} steps x {2 * d} values" in detail and f"{MAX_SERIES_VALUES:,}" in detail
    # A larger metric's steps list its DEFAULT_TOP_VALUES largest estimates by default,
    # and the bound counts what is listed, whatever the number of steps.
    huge = 2**20
    api.define("huge", {"mechanism": "grr", "epsilon": 1.0, "domain_size": huge})
    fits = MAX_SERIES_VALUES // (2 * DEFAULT_TOP_VALUES)
    body = api.series_body("huge", start=iso(end - fits * HOUR), end=iso(end))
    assert len(body["steps"]) == fits
    refused = api.series("huge", start=iso(end - (fits + 1) * HOUR), end=iso(end))
    detail = problem(refused, 422, "invalid-request")["detail"]
    assert f"{fits + 1} steps x {2 * DEFAULT_TOP_VALUES} values" in detail
    assert "values=" in detail and "limit=" in detail
    narrower = api.series("huge", start=iso(end - (fits + 1) * HOUR), end=iso(end), limit=10)
    assert narrower.status_code == 200, narrower.text


def test_a_string_metric_needs_candidates(api: Api) -> None:
    api.define(
        "sketch", {"mechanism": "cms", "epsilon": 3.0, "sketch_width": 64, "sketch_depth": 4}
    )
    body = problem(api.series("sketch"), 422, "invalid-request")
    assert "candidates=" in body["detail"]
    listed = api.series_body("sketch", candidates=["kiwi", "fig"], step="1d")
    assert listed["kind"] == "string" and len(listed["steps"]) == DEFAULT_SERIES_STEPS["1d"]


# --- the OpenAPI document ----------------------------------------------------------------------


def test_the_openapi_document_describes_the_series(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    operation = document["paths"]["/v1/metrics/{name}/series"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert set(parameters) == {
        *("name", "step", "start", "end", "version", "candidates"),
        *("values", "order", "offset", "limit", "quantiles", "range", "where", "by"),
    }
    assert parameters["step"]["schema"]["enum"] == ["1h", "1d"]
    assert parameters["step"]["schema"]["default"] == "1h"
    description = operation["description"]
    assert "version" in description and "null" in description
    assert f"{MAX_SERIES_STEPS:,}" in description and f"{MAX_SERIES_VALUES:,}" in description
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/SeriesOut"}
    step = document["components"]["schemas"]["SeriesStep"]
    estimate = step["properties"]["estimate"]
    assert {"type": "null"} in estimate["anyOf"]
    assert "409" in estimate["description"] and "min_reports" in estimate["description"]
    refs = {item.get("$ref") for item in estimate["anyOf"]}
    assert {
        "#/components/schemas/CategoricalEstimateOut",
        "#/components/schemas/NumericEstimateOut",
        "#/components/schemas/StringEstimateOut",
    } <= refs
    assert set(step["required"]) == {"start", "end", "n", "estimate"}
