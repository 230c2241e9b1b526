"""Distribution metrics (``hh``, ``sw``) through the HTTP API, in process (TestClient).

The reports are made by the mechanism's own ``encode`` with a seeded generator, and the
published numbers are checked against ``mech.estimate(mech.aggregate(reports))``: both
compute the same function of the same statistics, so they agree exactly. Checked: the
estimate's shape (``DistributionEstimateOut``), its histogram and CDF, the default and
requested quantiles, the range and its snapping to edges, every refusal (422, naming the
parameter, and changing nothing), quantiles asked of other kinds of metric, the series
(quantiles and range per step, no histogram), the release threshold per time bucket, and
the OpenAPI document.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
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
from aggregator.estimates import (
    CONFIDENCE,
    DEFAULT_QUANTILES,
    MAX_QUANTILES,
    EstimateView,
    series_values,
)
from aggregator.settings import Settings
from shared.distributions import DistributionEstimate
from shared.estimates import z_value
from shared.mechanisms import Mechanism, as_distribution, make_mechanism
from shared.schemas import MechanismSpec, MetricDefinition

KEYS = {
    "admin": "distribution-admin-key-0123456789",
    "analyst": "distribution-analyst-key-0123456789",
    "device": "distribution-device-key-0123456789",
}
MIN_REPORTS = 20
#: Reports per metric in the estimate tests.
REPORTS = 3000
#: A latency on a log scale (the tree's default branching, 4^4 = 256 buckets).
HH_LOG = {
    "mechanism": "hh",
    "epsilon": 2.0,
    "lower": 1.0,
    "upper": 10_000.0,
    "buckets": 256,
    "scale": "log",
}
#: A linear distribution metric of the other mechanism.
SW_LINEAR = {"mechanism": "sw", "epsilon": 2.0, "lower": 0.0, "upper": 100.0, "buckets": 64}
SPECS = [
    pytest.param(HH_LOG, id="hh-log"),
    pytest.param(SW_LINEAR, id="sw-linear"),
]
#: The start of the UTC hour the module began in: reports are stamped in earlier hours.
BASE = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
HOUR = timedelta(hours=1)


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

    def mechanism(self, name: str, spec: dict[str, Any]) -> Mechanism[Any]:
        """Define ``name`` and return the mechanism of its published spec."""
        response = self.define(name, spec, unit="ms")
        assert response.status_code in (200, 201), response.text
        return make_mechanism(MechanismSpec.model_validate(response.json()["mechanism"]))

    def post(self, name: str, payloads: list[dict[str, Any]], hour: datetime | None = None) -> None:
        batch = [
            {"report_id": str(uuid.uuid4()), "metric": name, "version": 1, "payload": payload}
            | ({"time": iso(hour)} if hour is not None else {})
            for payload in payloads
        ]
        for start in range(0, len(batch), 1000):
            response = self.client.post(
                "/v1/reports",
                json={"reports": batch[start : start + 1000]},
                headers=self.auth("device"),
            )
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


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with running(tmp_path_factory.mktemp("distribution") / "api.sqlite3") as service:
        yield service


def latencies(spec: dict[str, Any], n: int, rng: np.random.Generator) -> np.ndarray:
    """Skewed values inside the spec's range: lognormal around the range's geometric
    middle (log scale), or a Beta(2, 5) share of it (linear)."""
    lower, upper = spec["lower"], spec["upper"]
    if spec.get("scale") == "log":
        return rng.lognormal(np.log(np.sqrt(lower * upper)) - 1.0, 1.0, n)
    return lower + (upper - lower) * rng.beta(2.0, 5.0, n)


def fill(api: Api, name: str, spec: dict[str, Any], seed: int) -> tuple[Mechanism[Any], Any]:
    """Define ``name``, post ``REPORTS`` reports encoded with a seeded generator; returns
    the mechanism and the statistics of exactly those reports."""
    mech = api.mechanism(name, spec)
    rng = np.random.default_rng(seed)
    reports = mech.encode(latencies(spec, REPORTS, rng), rng=rng)
    api.post(name, mech.to_payloads(reports))
    return mech, mech.aggregate(reports)


def expected_estimate(mech: Mechanism[Any], stats: Any) -> DistributionEstimate:
    values = as_distribution(mech)
    assert values is not None
    return values.estimate(stats)


def problem(response: Response, *words: str) -> str:
    """The detail of a 422 problem document, checked to name every one of ``words``."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    detail: str = response.json()["detail"]
    for word in words:
        assert word in detail, detail
    return detail


# --- the estimate ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_the_estimate_lists_histogram_cdf_and_default_quantiles(
    api: Api, spec: dict[str, Any]
) -> None:
    name = f"latency.{spec['mechanism']}"
    mech, stats = fill(api, name, spec, seed=20261128)
    body = api.body(name)
    expected = expected_estimate(mech, stats)
    buckets = spec["buckets"]

    assert body["kind"] == "distribution"
    assert (body["lower"], body["upper"], body["scale"]) == (
        spec["lower"],
        spec["upper"],
        spec.get("scale", "linear"),
    )
    assert body["value_buckets"] == buckets and body["buckets"] == 1  # one time bucket
    assert body["n"] == REPORTS and body["method"] == expected.method
    assert body["confidence"] == CONFIDENCE and body["range"] is None

    z = z_value(CONFIDENCE)
    histogram, cdf = body["histogram"], body["cdf"]
    assert len(histogram) == buckets and len(cdf) == buckets + 1
    edges = expected.edges.tolist()
    assert [item["low"] for item in histogram] == edges[:-1]
    assert [item["high"] for item in histogram] == edges[1:]
    assert [item["value"] for item in cdf] == edges
    # The published numbers are the mechanism's, exactly.
    assert [item["fraction"] for item in histogram] == expected.fractions().tolist()
    assert [item["std"] for item in histogram] == expected.fraction_std().tolist()
    assert [item["postprocessed"] for item in histogram] == expected.postprocessed.tolist()
    assert [item["fraction"] for item in cdf] == expected.cdf.tolist()
    assert [item["std"] for item in cdf] == expected.cdf_std().tolist()
    assert [item["postprocessed"] for item in cdf] == expected.postprocessed_cdf().tolist()
    for item in histogram + cdf:
        half = z * item["std"]
        assert item["ci_low"] == pytest.approx(item["fraction"] - half, abs=1e-12)
        assert item["ci_high"] == pytest.approx(item["fraction"] + half, abs=1e-12)
    assert (cdf[0]["fraction"], cdf[-1]["fraction"]) == (0.0, 1.0)
    assert (cdf[0]["std"], cdf[-1]["std"]) == (0.0, 0.0)
    shares = np.array([item["postprocessed"] for item in histogram])
    assert shares.min() >= 0.0 and shares.sum() == pytest.approx(1.0, abs=1e-9)

    quantiles = body["quantiles"]
    assert [item["q"] for item in quantiles] == list(DEFAULT_QUANTILES)
    points = [item["value"] for item in quantiles]
    assert points == sorted(points)
    for item in quantiles:
        assert spec["lower"] <= item["ci_low"] < item["ci_high"] <= spec["upper"]
        assert spec["lower"] <= item["value"] <= spec["upper"]
        assert item["ci_low"] in edges and item["ci_high"] in edges  # whole buckets
        if expected.method == "consistency+isotonic":
            # The isotonic regression never rules out its own point's bucket
            # (shared.distributions); EMS (sw) carries no such guarantee.
            assert item["ci_low"] <= item["value"] <= item["ci_high"]
    assert quantiles == [
        {"q": q.q, "value": q.value, "ci_low": q.ci_low, "ci_high": q.ci_high}
        for q in expected.quantiles(DEFAULT_QUANTILES, CONFIDENCE)
    ]


def test_requested_quantiles_keep_their_order_and_a_range_snaps_to_edges(api: Api) -> None:
    name = "latency.range"
    mech, stats = fill(api, name, HH_LOG, seed=7)
    expected = expected_estimate(mech, stats)
    body = api.body(name, quantiles="0.99,0.1, 0.5", range="9.7,260")
    assert [item["q"] for item in body["quantiles"]] == [0.99, 0.1, 0.5]
    assert [item["value"] for item in body["quantiles"]] == [
        q.value for q in expected.quantiles([0.99, 0.1, 0.5], CONFIDENCE)
    ]

    # Edge k on this scale is 10^(4 k / 256): 9.7 snaps down to k = 63 (9.65, nearer by
    # ratio than 10.0), 260 up to k = 155 (264.2, nearer by ratio than 254.8).
    edges = expected.edges
    low, high = 63, 155
    assert edges[low] == pytest.approx(10 ** (4 * low / 256), rel=1e-12)
    assert edges[high] == pytest.approx(10 ** (4 * high / 256), rel=1e-12)
    chosen = body["range"]
    assert (chosen["requested_low"], chosen["requested_high"]) == (9.7, 260.0)
    assert (chosen["low"], chosen["high"]) == (edges[low], edges[high])
    cdf = body["cdf"]
    assert chosen["fraction"] == pytest.approx(cdf[high]["fraction"] - cdf[low]["fraction"])
    assert chosen["std"] == float(expected.between_std(np.array([low]), np.array([high]))[0])
    half = z_value(CONFIDENCE) * chosen["std"]
    assert chosen["ci_low"] == pytest.approx(chosen["fraction"] - half)
    assert chosen["ci_high"] == pytest.approx(chosen["fraction"] + half)

    # Ends outside [lower, upper] are clipped first: the whole range holds everything.
    whole = api.body(name, range="0,1e9")["range"]
    assert (whole["low"], whole["high"], whole["fraction"], whole["std"]) == (1.0, 1e4, 1.0, 0.0)


@pytest.mark.parametrize(
    ("parameter", "text", "words"),
    [
        ("quantiles", "", ("quantiles", "not a number")),
        ("quantiles", "0.5,abc", ("quantiles", "'abc' is not a number")),
        ("quantiles", "0.5,1", ("quantiles", "strictly between 0 and 1, got 1")),
        ("quantiles", "0,0.5", ("quantiles", "strictly between 0 and 1, got 0")),
        ("quantiles", "-0.1", ("quantiles", "strictly between 0 and 1")),
        ("quantiles", "nan", ("quantiles", "strictly between 0 and 1")),
        ("quantiles", "0.5,0.50", ("quantiles", "listed twice")),
        ("quantiles", ",".join(["0.5"] * 33), ("quantiles", f"at most {MAX_QUANTILES}")),
        ("range", "10", ("range", "LOW,HIGH")),
        ("range", "1,2,3", ("range", "LOW,HIGH")),
        ("range", "ten,20", ("range", "'ten' is not a number")),
        ("range", "20,10", ("range", "LOW < HIGH")),
        ("range", "10,10", ("range", "LOW < HIGH")),
        ("range", "10,inf", ("range", "finite")),
        ("range", "10,10.1", ("range", "narrower than one bucket")),
        ("range", "2e4,3e4", ("range", "narrower than one bucket")),  # both clip to upper
    ],
)
def test_bad_quantiles_and_ranges_are_refused_and_change_nothing(
    api: Api, parameter: str, text: str, words: tuple[str, ...]
) -> None:
    name = "latency.refusals"
    if api.get(name).status_code != 200:
        fill(api, name, HH_LOG, seed=11)
    before = api.body(name)
    problem(api.get(name, **{parameter: text}), *words)
    problem(api.get(name, "series", **{parameter: text}), *words)
    assert api.body(name) == before


def test_quantiles_and_range_apply_to_distribution_metrics_only(api: Api) -> None:
    response = api.define("colour.choice", {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})
    assert response.status_code in (200, 201), response.text
    api.post("colour.choice", [{"value": v % 3} for v in range(MIN_REPORTS)])
    minutes = api.mechanism(
        "session.minutes", {"mechanism": "piecewise", "epsilon": 1.0, "lower": 0, "upper": 60}
    )
    api.post("session.minutes", minutes.to_payloads(minutes.encode([30.0] * MIN_REPORTS)))
    for name, kind in (("colour.choice", "categorical"), ("session.minutes", "numeric")):
        for params in ({"quantiles": "0.5"}, {"range": "1,2"}):
            for what in ("estimate", "series"):
                problem(api.get(name, what, **params), "apply to distribution metrics (", kind)
    # A distribution metric refuses the categorical parameters as every other kind does.
    if api.get("latency.refusals").status_code != 200:
        fill(api, "latency.refusals", HH_LOG, seed=11)
    chosen: list[dict[str, Any]] = [{"values": "1"}, {"order": "frequency"}, {"limit": 3}]
    for params in chosen:
        problem(
            api.get("latency.refusals", **params),
            "choose categories of a categorical metric",
            "is a distribution metric",
        )


def test_a_distribution_metric_takes_no_labels(api: Api) -> None:
    detail = problem(api.define("latency.labelled", HH_LOG, labels=["fast", "slow"]))
    assert "distribution metrics take no labels (their range and buckets are in the spec)" in (
        detail
    )
    with pytest.raises(ValueError, match="distribution metrics take no labels"):
        MetricDefinition.model_validate({"mechanism": HH_LOG, "labels": ["a"]})


def test_the_most_buckets_are_all_listed(api: Api) -> None:
    """D = 4096 (the most buckets): 4096 histogram items, 4097 CDF items, 32 quantiles
    (about 70 ms to compute and serialize: every column is a vector over the buckets)."""
    spec = HH_LOG | {"buckets": 4096}
    mech = api.mechanism("latency.fine", spec)
    rng = np.random.default_rng(3)
    api.post("latency.fine", mech.to_payloads(mech.encode(latencies(spec, 500, rng), rng=rng)))
    body = api.body("latency.fine", quantiles=",".join(f"{q / 33:.6f}" for q in range(1, 33)))
    assert (len(body["histogram"]), len(body["cdf"]), len(body["quantiles"])) == (4096, 4097, 32)


# --- series and the release threshold -----------------------------------------------------------


def test_a_series_carries_quantiles_and_range_per_step(api: Api) -> None:
    """Three hours: 400 reports, 5 (below min_reports: suppressed), 300. Each released step
    is the estimate of its window without histogram and CDF; the small hour has none, and
    adding it to a window changes nothing."""
    name = "latency.series"
    mech = api.mechanism(name, HH_LOG)
    rng = np.random.default_rng(5)
    hours = [BASE - 3 * HOUR, BASE - 2 * HOUR, BASE - HOUR]
    for hour, count in zip(hours, (400, 5, 300), strict=True):
        api.post(name, mech.to_payloads(mech.encode(latencies(HH_LOG, count, rng), rng=rng)), hour)
    params = {"quantiles": "0.5,0.9", "range": "10,100"}
    body = api.body(name, "series", start=iso(hours[0]), end=iso(BASE), **params)
    assert body["kind"] == "distribution"
    steps = body["steps"]
    assert [step["n"] for step in steps] == [400, 5, 300]
    assert [step["estimate"] is not None for step in steps] == [True, False, True]
    for step in steps:
        window = {"start": step["start"], "end": step["end"]}
        if step["estimate"] is None:
            assert api.get(name, **window, **params).status_code == 409
            continue
        estimate = step["estimate"]
        assert estimate["histogram"] == [] and estimate["cdf"] == []
        assert [item["q"] for item in estimate["quantiles"]] == [0.5, 0.9]
        assert estimate["range"] is not None
        alone = api.body(name, **window, **params)
        assert (alone["quantiles"], alone["range"]) == (estimate["quantiles"], estimate["range"])
        assert len(alone["histogram"]) == HH_LOG["buckets"]
    # The release threshold is per time bucket: the 5 reports never enter.
    with_small = api.body(name, start=iso(hours[0]), end=iso(BASE), **params)
    without = api.body(name, start=iso(hours[0]), end=iso(hours[1]), **params)
    assert with_small["n"] == 400 + 300 and with_small["suppressed_reports"] == 5
    first_two = api.body(name, start=iso(hours[0]), end=iso(hours[2]), **params)
    assert first_two["n"] == without["n"] == 400
    assert first_two["histogram"] == without["histogram"]
    assert first_two["quantiles"] == without["quantiles"]


def test_series_values_count_quantiles_and_the_range() -> None:
    mech = make_mechanism(MechanismSpec.model_validate(HH_LOG))
    assert series_values(mech, None) == len(DEFAULT_QUANTILES)
    assert series_values(mech, None, EstimateView(quantiles=(0.5,))) == 1
    assert series_values(mech, None, EstimateView(quantiles=(0.5, 0.9), range=(1, 2))) == 3


# --- the OpenAPI document -------------------------------------------------------------------------


def test_the_openapi_document_describes_distribution_estimates(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert "DistributionEstimateOut" in schemas
    model = schemas["DistributionEstimateOut"]["properties"]
    for field in ("histogram", "cdf", "quantiles", "range", "value_buckets", "method", "scale"):
        assert model[field].get("description"), field
    assert "test inversion" in model["quantiles"]["description"]
    assert "Empty in a series" in model["histogram"]["description"]
    for item in ("HistogramItem", "CdfItem", "QuantileItem", "RangeOut"):
        for field, schema in schemas[item]["properties"].items():
            assert schema.get("description"), (item, field)
    for path in ("estimate", "series"):
        operation = document["paths"][f"/v1/metrics/{{name}}/{path}"]["get"]
        parameters = {p["name"]: p for p in operation["parameters"]}
        assert "quantiles" in parameters and "range" in parameters
        assert "0.5,0.9,0.95,0.99" in parameters["quantiles"]["description"]
    estimate = document["paths"]["/v1/metrics/{name}/estimate"]["get"]
    refs = str(estimate["responses"]["200"]["content"]["application/json"]["schema"])
    assert "DistributionEstimateOut" in refs
    assert "distribution" in schemas["SeriesOut"]["properties"]["kind"]["enum"]
