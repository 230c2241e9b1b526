"""Breakdowns through the HTTP API, in process (TestClient): metrics with public dimensions,
reports carrying them, ``estimate?by=`` and ``where=``, series, and the release threshold
per (time bucket, cell).

Statistical checks: each assertion compares every estimated quantity it covers with the
per-cell truth (the simulated devices' own values) within ``z std``, z two-sided at
``ALPHA = 1e-6`` Bonferroni over the quantities (``tests.distribution_checks``), so one
assertion fails falsely with probability at most 1e-6 (normal approximation of sums of
thousands of bounded terms). Fixed seeds.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.estimates import MAX_SERIES_VALUES
from aggregator.settings import Settings
from shared.mechanisms import DeviceContext, Mechanism, make_mechanism
from shared.schemas import MechanismSpec
from tests.distribution_checks import normal_bound

KEYS = {
    "admin": "dimensions-admin-key-0123456789",
    "analyst": "dimensions-analyst-key-0123456789",
    "device": "dimensions-device-key-0123456789",
}
MIN_REPORTS = 10
BASE = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
HOUR = timedelta(hours=1)
DIMS = {"platform": ["android", "ios"], "version": ["1.0", "2.0"]}
CELLS = [dict(zip(DIMS, combo, strict=True)) for combo in itertools.product(*DIMS.values())]
GRR4 = {"mechanism": "grr", "epsilon": 2.0, "domain_size": 4}
PIECEWISE = {"mechanism": "piecewise", "epsilon": 1.0, "lower": 0.0, "upper": 10.0}
HH = {"mechanism": "hh", "epsilon": 2.0, "lower": 0.0, "upper": 100.0, "buckets": 16}
#: Reports per cell in the statistical checks.
PER_CELL = 1500
#: Fields describing the window, what it left out and the breakdown, not the estimate.
CONTEXT_FIELDS = {"window", "buckets", "suppressed_buckets", "suppressed_reports"} | {
    "pending_reports",
    "where",
    "by",
    "groups",
    "withheld_groups",
}


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Api:
    client: TestClient

    @staticmethod
    def auth(role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[role]}"}

    def define(self, name: str, spec: dict[str, Any], **extra: Any) -> Response:
        body = {"mechanism": spec, **extra}
        return self.client.put(f"/v1/metrics/{name}", json=body, headers=self.auth("admin"))

    def send(self, reports: list[dict[str, Any]]) -> Response:
        return self.client.post(
            "/v1/reports", json={"reports": reports}, headers=self.auth("device")
        )

    def post(
        self,
        name: str,
        payloads: list[dict[str, Any]],
        dimensions: Sequence[dict[str, str] | None],
        hour: datetime,
        version: int = 1,
    ) -> None:
        reports = [
            {
                "report_id": str(uuid.uuid4()),
                "metric": name,
                "version": version,
                "payload": payload,
                "time": iso(hour),
            }
            | ({"dimensions": given} if given is not None else {})
            for payload, given in zip(payloads, dimensions, strict=True)
        ]
        for start in range(0, len(reports), 5000):
            response = self.send(reports[start : start + 5000])
            assert response.status_code == 200, response.text

    def get(self, name: str, what: str = "estimate", **params: Any) -> Response:
        return self.client.get(
            f"/v1/metrics/{name}/{what}", params=params, headers=self.auth("analyst")
        )

    def body(self, name: str, what: str = "estimate", **params: Any) -> dict[str, Any]:
        response = self.get(name, what, **params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


@contextmanager
def running(database: Path) -> Iterator[Api]:
    settings = Settings(database=str(database), min_reports=MIN_REPORTS, compaction_interval=0)
    app = create_app(settings)
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Api(client)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with running(tmp_path / "dimensions.sqlite3") as service:
        yield service


def grr_payloads(values: list[int]) -> list[dict[str, Any]]:
    """GRR reports as sent, without noise (the tests of counting need none)."""
    return [{"value": value} for value in values]


def define(api: Api, name: str, spec: dict[str, Any], dims: Any = DIMS) -> Mechanism[Any]:
    response = api.define(name, spec, dimensions=dims)
    assert response.status_code in (200, 201), response.text
    return make_mechanism(MechanismSpec.model_validate(response.json()["mechanism"]))


def problem(response: Response, *words: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    body: dict[str, Any] = response.json()
    for word in words:
        assert word in body["detail"], body
    return body


def estimate_only(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in CONTEXT_FIELDS}


# --- definitions -----------------------------------------------------------------------


def without_integrity(estimate: dict[str, Any]) -> dict[str, Any]:
    """An estimate but for its window's ``integrity`` (and ``robust``), which a breakdown
    gives once for the whole selection, not per group (refused reports are not counted by
    cell)."""
    return {key: value for key, value in estimate.items() if key not in ("integrity", "robust")}


def test_dimensions_are_published_and_a_change_makes_a_new_version(api: Api) -> None:
    assert api.define("m", GRR4, dimensions=DIMS).status_code == 201
    listed = api.client.get("/v1/metrics").json()
    assert [item["dimensions"] for item in listed if item["name"] == "m"] == [DIMS]
    assert api.define("m", GRR4, dimensions=DIMS, description="same").status_code == 200
    changed = api.define("m", GRR4, dimensions={"platform": ["android", "ios", "web"]})
    assert changed.status_code == 201 and changed.json()["version"] == 2
    dropped = api.define("m", GRR4)
    assert dropped.status_code == 201 and dropped.json()["version"] == 3


def test_a_definition_past_the_bounds_is_refused_naming_the_dimension(api: Api) -> None:
    too_many = {"platform": [f"p{i}" for i in range(65)]}
    body = api.define("m", GRR4, dimensions=too_many).json()
    assert "dimensions.platform" in body["detail"] and "1..64" in body["detail"]
    cells = {"a": [str(i) for i in range(64)], "b": [str(i) for i in range(64)], "c": ["x", "y"]}
    body = api.define("m", GRR4, dimensions=cells).json()
    assert "8,192 cells" in body["detail"] and "4,096" in body["detail"]
    assert api.client.get("/v1/metrics").json() == []


# --- ingest ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"platform": "ios"}, "dimensions.version"),
        ({"platform": "tv", "version": "1.0"}, "dimensions.platform"),
        ({"platform": "ios", "version": "1.0", "os": "x"}, "dimensions.os"),
        (None, "dimensions.platform"),
    ],
)
def test_a_bad_report_refuses_the_batch_naming_the_field_and_stores_nothing(
    api: Api, given: dict[str, str] | None, field: str
) -> None:
    define(api, "m", GRR4)
    good = [
        {
            "report_id": str(uuid.uuid4()),
            "metric": "m",
            "version": 1,
            "payload": {"value": 1},
            "dimensions": CELLS[0],
        }
        for _ in range(MIN_REPORTS)
    ]
    bad = {"report_id": str(uuid.uuid4()), "metric": "m", "version": 1, "payload": {"value": 0}}
    if given is not None:
        bad["dimensions"] = given
    response = api.send([*good, bad])
    assert response.status_code == 422
    errors = response.json()["errors"]
    assert errors == [{"report": MIN_REPORTS, "field": field, "message": errors[0]["message"]}]
    assert field.split(".")[1] in errors[0]["message"]
    assert api.get("m").status_code == 409  # nothing of the batch was stored
    assert api.send(good).json() == {"accepted": MIN_REPORTS, "duplicates": 0}


def test_dimensions_sent_to_a_metric_without_dimensions_are_refused(api: Api) -> None:
    define(api, "plain", GRR4, dims=None)
    report = {
        "report_id": str(uuid.uuid4()),
        "metric": "plain",
        "version": 1,
        "payload": {"value": 1},
        "dimensions": {"platform": "ios"},
    }
    response = api.send([report])
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "dimensions"


# --- the release threshold per (bucket, cell) ------------------------------------------


def test_a_small_cell_is_withheld_and_differencing_reveals_nothing(api: Api) -> None:
    """Hour h-2: android 1.0 holds 20 reports, ios 1.0 holds 3 (min_reports 10). The unit
    (h-2, ios 1.0) enters no estimate: the whole metric's estimate equals the android
    one, so neither by= nor where= nor the difference of two of them tells its values."""
    define(api, "m", GRR4)
    android, ios = CELLS[0], CELLS[2]
    api.post("m", grr_payloads([0, 1, 2, 3] * 5), [android] * 20, BASE - 2 * HOUR)
    api.post("m", grr_payloads([3, 3, 3]), [ios] * 3, BASE - 2 * HOUR)

    whole = api.body("m")
    assert (whole["n"], whole["buckets"], whole["suppressed_buckets"]) == (20, 1, 1)
    assert whole["suppressed_reports"] == 3 and whole["where"] == {} and whole["by"] is None
    assert whole["groups"] is None and whole["withheld_groups"] == 0
    only_android = api.body("m", where="platform:android")
    assert estimate_only(only_android) == estimate_only(whole)  # nothing to difference
    assert only_android["where"] == {"platform": "android"}
    alone = api.get("m", where=["platform:ios", "version:1.0"])
    assert alone.status_code == 409 and "holds 3 reports" in alone.json()["detail"]

    by = api.body("m", by="platform")
    assert [group["dimensions"] for group in by["groups"]] == [{"platform": "android"}]
    assert by["withheld_groups"] == 1 and estimate_only(by) == estimate_only(whole)
    # Windows with and without the small unit's hour agree too.
    later = api.body("m", start=iso(BASE - 3 * HOUR), end=iso(BASE - HOUR))
    assert estimate_only(later) == estimate_only(whole)

    # Once ios 1.0 reaches the threshold in an hour, that unit is released (and the small
    # one still is not).
    api.post("m", grr_payloads([2] * 10), [ios] * 10, BASE - HOUR)
    released = api.body("m", by="platform")
    assert released["n"] == 30 and released["withheld_groups"] == 0
    (_, ios_group) = released["groups"]
    assert ios_group["n"] == 10 and ios_group["suppressed_reports"] == 3
    assert ios_group["buckets"] == 1 and ios_group["suppressed_buckets"] == 1


def test_each_group_is_exactly_what_where_answers(api: Api) -> None:
    define(api, "m", GRR4)
    rng = np.random.default_rng(5)
    for hour in (2, 1):
        cells = rng.integers(0, 4, 200)
        api.post(
            "m",
            grr_payloads(rng.integers(0, 4, 200).tolist()),
            [CELLS[c] for c in cells.tolist()],
            BASE - hour * HOUR,
        )
    body = api.body("m", by="version,platform")
    assert body["by"] == ["version", "platform"] and body["withheld_groups"] == 0
    expected = [{"version": v, "platform": p} for v in DIMS["version"] for p in DIMS["platform"]]
    assert [group["dimensions"] for group in body["groups"]] == expected
    assert sum(group["n"] for group in body["groups"]) == body["n"] == 400
    for group in body["groups"]:
        values = group.pop("dimensions")
        where = [f"{name}:{value}" for name, value in values.items()]
        assert group == without_integrity(api.body("m", where=where))
    filtered = api.body("m", where="platform:ios", by="version")
    assert filtered["where"] == {"platform": "ios"}
    for group in filtered["groups"]:
        assert group["where"] == {"platform": "ios"} | group["dimensions"]


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"where": "os:linux"}, ("where", "unknown dimension 'os'")),
        ({"where": "platform:tv"}, ("where", "'tv' is not a value of dimension 'platform'")),
        ({"where": "platform"}, ("where", "NAME:VALUE")),
        ({"where": ["platform:ios", "platform:android"]}, ("where", "'platform'", "twice")),
        ({"by": "os"}, ("by", "unknown dimension 'os'")),
        ({"by": "platform,platform"}, ("by", "twice")),
        ({"by": "platform", "where": "platform:ios"}, ("by", "'platform'", "also in where")),
    ],
)
def test_bad_breakdowns_are_refused_naming_the_parameter_and_dimension(
    api: Api, params: dict[str, Any], words: tuple[str, ...]
) -> None:
    define(api, "m", GRR4)
    api.post("m", grr_payloads([1] * 10), [CELLS[0]] * 10, BASE - HOUR)
    for what in ("estimate", "series"):
        problem(api.get("m", what, **params), *words)


def test_by_and_where_on_a_metric_without_dimensions_are_refused(api: Api) -> None:
    define(api, "plain", GRR4, dims=None)
    api.post("plain", grr_payloads([1] * 10), [None] * 10, BASE - HOUR)
    assert api.body("plain")["where"] == {}
    problem(api.get("plain", by="platform"), "by", "declares no dimensions")
    problem(api.get("plain", where="platform:ios"), "where", "declares no dimensions")
    problem(api.get("plain", "series", by="platform"), "by", "declares no dimensions")


def test_a_breakdown_s_values_are_bounded(api: Api) -> None:
    """groups x values per estimate at most MAX_SERIES_VALUES, in an estimate and a series."""
    wide = {"mechanism": "grr", "epsilon": 2.0, "domain_size": 1000}
    define(api, "wide", wide, dims={"build": [f"b{i}" for i in range(64)]})
    api.post("wide", grr_payloads([1] * 10), [{"build": "b0"}] * 10, BASE - HOUR)
    assert 64 * 2000 > MAX_SERIES_VALUES
    problem(api.get("wide", by="build"), "by=build", "64 groups", "where=")
    problem(api.get("wide", "series", by="build"), "by=")
    narrowed = api.body("wide", by="build", limit=10)  # fewer listed categories fit
    assert [group["dimensions"] for group in narrowed["groups"]] == [{"build": "b0"}]
    # A series holds at most MAX_SERIES_STEPS group estimates (steps x groups).
    start, end = iso(BASE - 40 * HOUR), iso(BASE)
    problem(api.get("wide", "series", by="build", limit=1, start=start, end=end), "2,560")
    fits = api.body("wide", "series", by="build", limit=1, start=iso(BASE - 30 * HOUR), end=end)
    assert len(fits["steps"]) == 30


# --- series ----------------------------------------------------------------------------


def test_a_series_breaks_each_step_down(api: Api) -> None:
    define(api, "m", GRR4)
    for hour, cells in ((3, [0, 0, 1]), (2, [2, 3, 3]), (1, [0, 3])):
        for cell in cells:
            api.post("m", grr_payloads([cell] * 10), [CELLS[cell]] * 10, BASE - hour * HOUR)
    series = api.body("m", "series", by="platform", start=iso(BASE - 3 * HOUR), end=iso(BASE))
    assert series["by"] == ["platform"] and series["where"] == {}
    steps = series["steps"]
    assert [step["n"] for step in steps] == [30, 30, 20]
    assert [[g["dimensions"]["platform"] for g in s["estimate"]["groups"]] for s in steps] == [
        ["android"],
        ["ios"],
        ["android", "ios"],
    ]
    for step in steps:
        groups = step["estimate"]["groups"]
        for group in groups:
            values = group.pop("dimensions")
            alone = api.body(
                "m", where=f"platform:{values['platform']}", start=step["start"], end=step["end"]
            )
            assert group == without_integrity(alone)
    only = api.body("m", "series", where="version:2.0", start=iso(BASE - 3 * HOUR), end=iso(BASE))
    assert [step["n"] for step in only["steps"]] == [10, 20, 10]
    assert only["where"] == {"version": "2.0"} and only["by"] is None


# --- heavy hitters ---------------------------------------------------------------------


def test_heavy_hitters_take_where(api: Api) -> None:
    pem = {"mechanism": "pem", "epsilon": 4.0, "max_length": 2}
    define(api, "words", pem, dims={"platform": ["android", "ios"]})
    problem(api.get("words", "heavy-hitters", where="platform:tv"), "where", "'tv'")
    problem(api.get("words", "heavy-hitters", where="os:x"), "where", "unknown dimension")
    missing = api.get("words", "heavy-hitters", where="platform:ios")
    assert missing.status_code == 409


# --- agreement with the per-cell truth -------------------------------------------------


def encoded(mechanism: Mechanism[Any], values: np.ndarray, rng: np.random.Generator) -> Any:
    return mechanism.to_payloads(mechanism.encode(values, rng, DeviceContext()))


def test_categorical_groups_agree_with_each_cell_s_truth(api: Api) -> None:
    mechanism = define(api, "colour", GRR4)
    rng = np.random.default_rng(2027)
    shares = [
        [0.7, 0.1, 0.1, 0.1],
        [0.1, 0.6, 0.2, 0.1],
        [0.25, 0.25, 0.25, 0.25],
        [0, 0, 0.3, 0.7],
    ]
    truths, payloads, dims = [], [], []
    for cell, share in enumerate(shares):
        values = rng.choice(4, size=PER_CELL, p=share)
        truths.append(np.bincount(values, minlength=4) / PER_CELL)
        payloads += encoded(mechanism, values, rng)
        dims += [CELLS[cell]] * PER_CELL
    api.post("colour", payloads, dims, BASE - HOUR)
    body = api.body("colour", by="platform,version")
    z = normal_bound(4 * 4)
    assert [group["dimensions"] for group in body["groups"]] == CELLS
    for group, truth in zip(body["groups"], truths, strict=True):
        assert group["n"] == PER_CELL
        for item, true in zip(group["estimates"], truth.tolist(), strict=True):
            assert abs(item["frequency"] - true) <= z * item["std"], (group["dimensions"], item)
    by_platform = api.body("colour", by="platform")
    z = normal_bound(2 * 4)
    for p, group in enumerate(by_platform["groups"]):
        truth = (truths[2 * p] + truths[2 * p + 1]) / 2
        for item, true in zip(group["estimates"], truth.tolist(), strict=True):
            assert abs(item["frequency"] - true) <= z * item["std"], (group["dimensions"], item)


def test_numeric_groups_agree_with_each_cell_s_truth(api: Api) -> None:
    mechanism = define(api, "minutes", PIECEWISE)
    rng = np.random.default_rng(2028)
    truths, payloads, dims = [], [], []
    for cell, (a, b) in enumerate([(2, 5), (5, 2), (1, 1), (8, 1)]):
        values = 10.0 * rng.beta(a, b, PER_CELL)
        truths.append(float(values.mean()))
        payloads += encoded(mechanism, values, rng)
        dims += [CELLS[cell]] * PER_CELL
    api.post("minutes", payloads, dims, BASE - HOUR)
    body = api.body("minutes", by="platform,version")
    z = normal_bound(4)
    for group, truth in zip(body["groups"], truths, strict=True):
        assert group["kind"] == "numeric" and group["n"] == PER_CELL
        assert abs(group["mean"] - truth) <= z * group["std"], (group["dimensions"], truth)


def test_distribution_groups_agree_with_each_cell_s_truth(api: Api) -> None:
    mechanism = define(api, "latency", HH)
    rng = np.random.default_rng(2029)
    edges = np.linspace(0.0, 100.0, 16 + 1)  # HH's buckets
    truths, payloads, dims = [], [], []
    for cell, (a, b) in enumerate([(2, 5), (5, 2), (1, 1), (2, 2)]):
        values = 100.0 * rng.beta(a, b, PER_CELL)
        truths.append((values[None, :] < edges[:, None]).mean(axis=1))
        payloads += encoded(mechanism, values, rng)
        dims += [CELLS[cell]] * PER_CELL
    api.post("latency", payloads, dims, BASE - HOUR)
    body = api.body("latency", by="platform,version")
    z = normal_bound(4 * (len(edges) - 2))  # the inner edges (0 and 1 at the ends are exact)
    for group, truth in zip(body["groups"], truths, strict=True):
        assert group["kind"] == "distribution" and group["n"] == PER_CELL
        cdf = group["cdf"]
        for item, true in zip(cdf[1:-1], truth[1:-1].tolist(), strict=True):
            assert abs(item["fraction"] - true) <= z * item["std"], (group["dimensions"], item)
