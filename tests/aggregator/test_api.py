"""The HTTP API in process (FastAPI TestClient): metrics, reports, estimates, keys, operations.

Estimates are checked against the mechanism itself: the reports a test sends are encoded
with a seeded generator, and the service's answer must equal
``mech.estimate(mech.aggregate(reports))`` exactly, since both compute the same function
of the same sufficient statistics.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys, hash_key
from aggregator.settings import Settings
from aggregator.storage import Repositories
from shared.mechanisms import DeviceContext, Mechanism, make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec

ADMIN_KEY = "api-test-admin-key-0123456789"
ANALYST_KEY = "api-test-analyst-key-0123456789"
DEVICE_KEY = "api-test-device-key-0123456789"
KEYS = {"admin": ADMIN_KEY, "analyst": ANALYST_KEY, "device": DEVICE_KEY}
PROBLEM = "application/problem+json"
MIN_REPORTS = 20


@dataclass
class Api:
    """A TestClient over a fresh service, with the three test keys imported."""

    client: TestClient
    app: FastAPI

    @property
    def repositories(self) -> Repositories:
        return self.app.state.services.repositories  # type: ignore[no-any-return]

    @staticmethod
    def auth(role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[role]}"}

    def define(
        self, name: str, spec: dict[str, Any], labels: list[str] | None = None, **extra: Any
    ) -> Response:
        body: dict[str, Any] = {"mechanism": spec, **extra}
        if labels is not None:
            body["labels"] = labels
        return self.client.put(f"/v1/metrics/{name}", json=body, headers=self.auth("admin"))

    def post(self, reports: list[dict[str, Any]], role: str = "device") -> Response:
        return self.client.post("/v1/reports", json={"reports": reports}, headers=self.auth(role))

    def estimate(self, name: str, **params: Any) -> Response:
        return self.client.get(
            f"/v1/metrics/{name}/estimate", params=params, headers=self.auth("analyst")
        )

    def n(self, name: str, **params: Any) -> int:
        response = self.estimate(name, **params)
        if response.status_code == 409:
            return 0
        assert response.status_code == 200, response.text
        return int(response.json()["n"])


@contextmanager
def running(database: str, **settings: Any) -> Iterator[Api]:
    """The service over ``database`` (background compaction off), keys imported at start."""
    options: dict[str, Any] = {"min_reports": MIN_REPORTS, "compaction_interval": 0} | settings
    app = create_app(Settings(database=database, **options))
    environment = {
        "LDP_ADMIN_KEYS": ADMIN_KEY,
        "LDP_ANALYST_KEYS": ANALYST_KEY,
        "LDP_DEVICE_KEYS": DEVICE_KEY,
    }
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Api(client, app)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    """The service on a fresh SQLite file."""
    with running(str(tmp_path / "api.sqlite3")) as service:
        yield service


@pytest.fixture
def db_api(database_url: str) -> Iterator[Api]:
    """The service on a fresh SQLite file, then on a fresh PostgreSQL schema."""
    with running(database_url) as service:
        yield service


def reports(
    metric: str,
    version: int,
    payloads: list[dict[str, Any]],
    time: str | None = None,
) -> list[dict[str, Any]]:
    """Wire reports with fresh random ids."""
    out = []
    for payload in payloads:
        report: dict[str, Any] = {
            "report_id": str(uuid.uuid4()),
            "metric": metric,
            "version": version,
            "payload": payload,
        }
        if time is not None:
            report["time"] = time
        out.append(report)
    return out


def encode(
    mech: Mechanism, n: int, rng: np.random.Generator, labels: list[str] | None = None
) -> np.ndarray:
    """``n`` reports of values drawn from a skewed distribution, encoded with ``rng``."""
    spec = mech.spec
    if isinstance(mech, Rappor):
        assert labels is not None and spec.num_cohorts is not None
        weights = np.arange(len(labels), 0, -1, dtype=np.float64)
        values = rng.choice(labels, n, p=weights / weights.sum())
        cohorts = rng.integers(0, spec.num_cohorts, n)
        secrets = [rng.bytes(16) for _ in range(n)]
        return mech.encode(values, rng=rng, context=DeviceContext(secrets=secrets, cohorts=cohorts))
    if spec.kind == "categorical":
        assert spec.domain_size is not None
        weights = np.arange(spec.domain_size, 0, -1, dtype=np.float64)
        return mech.encode(rng.choice(spec.domain_size, n, p=weights / weights.sum()), rng=rng)
    assert spec.lower is not None and spec.upper is not None
    return mech.encode(rng.uniform(spec.lower, spec.upper * 0.7, n), rng=rng)


def assert_matches(body: dict[str, Any], mech: Mechanism, stats: Any, labels: Any) -> None:
    """The published estimate equals the mechanism's estimate of ``stats`` exactly."""
    assert body["n"] == stats.n
    assert body["epsilon"] == mech.spec.epsilon
    if isinstance(mech, Rappor):
        expected = mech.estimate(stats, candidates=list(labels))
        low, high = expected.ci(0.95)
        assert body["kind"] == "string"
        assert [c["string"] for c in body["candidates"]] == list(labels)
        assert [c["frequency"] for c in body["candidates"]] == expected.frequencies.tolist()
        assert [c["std"] for c in body["candidates"]] == expected.std.tolist()
        assert [c["ci_low"] for c in body["candidates"]] == low.tolist()
        assert [c["ci_high"] for c in body["candidates"]] == high.tolist()
        assert [c["detected"] for c in body["candidates"]] == expected.detected.tolist()
        assert body["detected"] == [d.string for d in expected.detected_strings(0.95)]
        assert body["explained_mass"] == expected.explained_mass
        assert body["unexplained_mass"] == expected.unexplained_mass
        assert body["epsilon_infinity"] == mech.epsilon_infinity
        return
    expected = mech.estimate(stats)
    if mech.spec.kind == "numeric":
        low, high = expected.ci(0.95)
        assert body["kind"] == "numeric"
        assert (body["mean"], body["std"]) == (expected.mean, expected.std)
        assert (body["ci_low"], body["ci_high"]) == (low, high)
        assert body["std_method"] == expected.std_method
        assert body["population_std"] == expected.population_std
        population = (body["population_ci_low"], body["population_ci_high"])
        assert population == expected.ci(0.95, population=True)
        assert (body["lower"], body["upper"]) == (mech.spec.lower, mech.spec.upper)
        assert body["postprocessed_mean"] == expected.postprocessed()
        return
    low, high = expected.ci(0.95)
    items = body["estimates"]
    assert body["kind"] == "categorical" and body["resolved_mechanism"] == mech.name
    assert [e["index"] for e in items] == list(range(expected.frequencies.size))
    assert [e["frequency"] for e in items] == expected.frequencies.tolist()
    assert [e["std"] for e in items] == expected.std.tolist()
    assert [e["count"] for e in items] == expected.counts.tolist()
    assert [e["ci_low"] for e in items] == low.tolist()
    assert [e["ci_high"] for e in items] == high.tolist()
    assert [e["label"] for e in items] == (
        list(labels) if labels is not None else [None] * len(items)
    )
    projected = [p["frequency"] for p in body["postprocessed"]]
    assert projected == expected.postprocessed().frequencies.tolist()
    assert math.isclose(sum(projected), 1.0, rel_tol=1e-9) and min(projected) >= 0.0


def assert_problem(response: Response, status: int, kind: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body = response.json()
    assert {"type", "title", "status", "detail", "errors"} <= set(body)
    assert body["status"] == status and body["title"] and body["detail"]
    if kind is not None:
        assert body["type"] == f"/problems/{kind}"
    return body


def hour(offset: int = 0) -> datetime:
    """The start of the current UTC hour plus ``offset`` hours."""
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return now + timedelta(hours=offset)


def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- metrics -------------------------------------------------------------------------

GRR3 = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}
LABELS3 = ["red", "green", "blue"]


def test_metrics_are_public_and_versioned(api: Api) -> None:
    assert api.client.get("/v1/metrics").json() == []
    created = api.define("colour", GRR3, LABELS3, description="first")
    assert created.status_code == 201
    assert created.json() == {
        "name": "colour",
        "version": 1,
        "description": "first",
        "mechanism": GRR3,
        "labels": LABELS3,
        "unit": None,
        "dimensions": None,
    }
    # The same spec with another description: the same version, updated (200).
    same = api.define("colour", GRR3, LABELS3, description="second")
    assert same.status_code == 200 and same.json()["version"] == 1
    # Changed epsilon, then changed mechanism, then changed labels: new versions (201).
    changes = [
        ({**GRR3, "epsilon": 2.0}, LABELS3),
        ({**GRR3, "epsilon": 2.0, "mechanism": "oue"}, LABELS3),
        ({**GRR3, "epsilon": 2.0, "mechanism": "oue"}, ["r", "g", "b"]),
    ]
    for version, (spec, labels) in enumerate(changes, start=2):
        response = api.define("colour", spec, labels)
        assert response.status_code == 201 and response.json()["version"] == version

    listed = api.client.get("/v1/metrics")  # no key: public
    assert listed.status_code == 200
    assert [(m["name"], m["version"]) for m in listed.json()] == [("colour", 4)]
    versions = api.client.get("/v1/metrics/colour/versions").json()
    assert [v["version"] for v in versions] == [1, 2, 3, 4]
    assert versions[0]["description"] == "second" and versions[0]["mechanism"] == GRR3
    assert versions[1]["mechanism"]["epsilon"] == 2.0
    assert versions[2]["mechanism"]["mechanism"] == "oue"
    assert versions[3]["labels"] == ["r", "g", "b"]
    assert_problem(api.client.get("/v1/metrics/none/versions"), 404, "unknown-metric")


def test_defining_a_metric_needs_an_admin_key(api: Api) -> None:
    body = {"mechanism": GRR3}
    assert_problem(api.client.put("/v1/metrics/m", json=body), 401, "unauthorized")
    for role, given in (("device", "a device key"), ("analyst", "an analyst key")):
        response = api.client.put("/v1/metrics/m", json=body, headers=api.auth(role))
        problem = assert_problem(response, 403, "forbidden")
        assert problem["detail"] == f"this needs an admin key; the key given is {given}"
    assert api.client.get("/v1/metrics").json() == []
    assert api.client.put("/v1/metrics/m", json=body, headers=api.auth("admin")).status_code == 201


# --- every mechanism, end to end -----------------------------------------------------

RAPPOR_SPEC = {
    "mechanism": "rappor",
    "num_bits": 16,
    "num_hashes": 2,
    "num_cohorts": 4,
    "f": 0.25,
    "p": 0.25,
    "q": 0.75,
}
MECHANISM_CASES: dict[str, tuple[dict[str, Any], list[str] | None]] = {
    "grr": ({"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}, ["a", "b", "c", "d"]),
    "oue": ({"mechanism": "oue", "epsilon": 1.0, "domain_size": 12}, None),
    "olh": ({"mechanism": "olh", "epsilon": 1.5, "domain_size": 10}, None),
    "hr": ({"mechanism": "hr", "epsilon": 1.0, "domain_size": 6}, None),
    "sue": ({"mechanism": "sue", "epsilon": 2.0, "domain_size": 9}, None),
    "auto": ({"mechanism": "auto", "epsilon": 1.0, "domain_size": 8}, None),
    "laplace": (
        {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 10.0, "grid_steps": 64},
        None,
    ),
    "duchi": ({"mechanism": "duchi", "epsilon": 1.0, "lower": -1.0, "upper": 1.0}, None),
    "piecewise": (
        {"mechanism": "piecewise", "epsilon": 2.0, "lower": 0.0, "upper": 120.0},
        None,
    ),
    "rappor": (RAPPOR_SPEC, ["alpha.example", "beta.example", "gamma.example", "delta.example"]),
}


@pytest.mark.parametrize("name", list(MECHANISM_CASES))
def test_every_mechanism_round_trips(api: Api, name: str) -> None:
    spec, labels = MECHANISM_CASES[name]
    assert api.define(name, spec, labels).status_code == 201
    mech = make_mechanism(MechanismSpec.model_validate(spec))
    rng = np.random.default_rng(sum(map(ord, name)))
    encoded = encode(mech, 300, rng, labels)
    # Two batches, so the estimate merges two partial rows.
    payloads = mech.to_payloads(encoded)
    for chunk in (payloads[:120], payloads[120:]):
        reply = api.post(reports(name, 1, chunk))
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"accepted": len(chunk), "duplicates": 0}

    response = api.estimate(name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["metric"], body["version"], body["mechanism"]) == (name, 1, spec["mechanism"])
    if mech.spec.kind == "numeric":
        # Moment statistics are float sums: merge the same two partial sums the server
        # keeps (float addition is commutative, so the order of two rows cannot matter).
        stats = mech.empty_statistics()
        for part in (encoded[:120], encoded[120:]):
            stats = stats.merge(mech.aggregate(part))
    else:
        stats = mech.aggregate(encoded)
    assert_matches(body, mech, stats, labels)


def test_numeric_estimate_equals_the_mechanisms_exactly(api: Api) -> None:
    """One batch of piecewise reports: the mean is exactly mech.estimate(mech.aggregate(r))."""
    spec, _ = MECHANISM_CASES["piecewise"]
    api.define("minutes", spec)
    mech = make_mechanism(MechanismSpec.model_validate(spec))
    encoded = encode(mech, 200, np.random.default_rng(5))
    assert api.post(reports("minutes", 1, mech.to_payloads(encoded))).status_code == 200
    body = api.estimate("minutes").json()
    expected = mech.estimate(mech.aggregate(encoded))
    assert (body["n"], body["mean"], body["std"]) == (200, expected.mean, expected.std)


def test_rappor_estimate_decodes_candidates(api: Api) -> None:
    spec, labels = MECHANISM_CASES["rappor"]
    assert labels is not None
    api.define("home", spec, labels)
    mech = make_mechanism(MechanismSpec.model_validate(spec))
    encoded = encode(mech, 400, np.random.default_rng(21), labels)
    assert api.post(reports("home", 1, mech.to_payloads(encoded))).status_code == 200
    body = api.estimate("home").json()
    assert {"candidates", "detected", "explained_mass"} <= set(body)
    assert set(body["detected"]) <= set(labels)
    assert 0.0 <= body["explained_mass"] <= 1.0 + 1e-9
    # Candidates given in the request replace the metric's.
    asked = [labels[0], "unlisted.example"]
    response = api.estimate("home", candidates=asked)
    assert response.status_code == 200, response.text
    assert [c["string"] for c in response.json()["candidates"]] == asked
    assert_matches(response.json(), mech, mech.aggregate(encoded), asked)


# --- versions, thresholds, windows ----------------------------------------------------


def test_reports_aggregate_under_their_own_version(db_api: Api) -> None:
    api = db_api
    api.define("colour", GRR3, LABELS3)
    v1 = make_mechanism(MechanismSpec.model_validate(GRR3))
    rng = np.random.default_rng(31)
    old = encode(v1, 40, rng)
    assert api.post(reports("colour", 1, v1.to_payloads(old))).status_code == 200

    spec2 = {**GRR3, "epsilon": 3.0}
    assert api.define("colour", spec2, LABELS3).json()["version"] == 2
    v2 = make_mechanism(MechanismSpec.model_validate(spec2))
    new = encode(v2, 30, rng)
    assert api.post(reports("colour", 2, v2.to_payloads(new))).status_code == 200
    # Devices that have not heard of version 2 still report under version 1.
    late = encode(v1, 25, rng)
    assert api.post(reports("colour", 1, v1.to_payloads(late))).status_code == 200

    latest = api.estimate("colour").json()
    assert (latest["version"], latest["epsilon"], latest["n"]) == (2, 3.0, 30)
    assert_matches(latest, v2, v2.aggregate(new), LABELS3)
    first = api.estimate("colour", version=1).json()
    assert (first["version"], first["epsilon"], first["n"]) == (1, 1.0, 65)
    assert_matches(first, v1, v1.aggregate(np.concatenate([old, late])), LABELS3)
    assert_problem(api.estimate("colour", version=3), 404, "unknown-metric")


def test_estimates_are_withheld_below_min_reports(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    body = assert_problem(api.estimate("colour"), 409, "not-enough-reports")
    assert str(MIN_REPORTS) in body["detail"]
    mech = make_mechanism(MechanismSpec.model_validate(GRR3))
    payloads = mech.to_payloads(encode(mech, MIN_REPORTS, np.random.default_rng(41)))
    assert api.post(reports("colour", 1, payloads[:-1])).status_code == 200
    body = assert_problem(api.estimate("colour"), 409, "not-enough-reports")
    assert f"holds {MIN_REPORTS - 1} reports" in body["detail"]
    assert api.post(reports("colour", 1, payloads[-1:])).status_code == 200
    assert api.estimate("colour").json()["n"] == MIN_REPORTS


def test_time_windows_select_buckets(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    mech = make_mechanism(MechanismSpec.model_validate(GRR3))
    rng = np.random.default_rng(51)
    sizes = {-3: 21, -2: 32, -1: 43}
    encoded = {offset: encode(mech, size, rng) for offset, size in sizes.items()}
    # One batch holding all three hours, then one more report at each end.
    batch = [
        report
        for offset, rows in encoded.items()
        for report in reports("colour", 1, mech.to_payloads(rows), iso(hour(offset)))
    ]
    assert api.post(batch).json() == {"accepted": 96, "duplicates": 0}

    def window(start: int | None, end: int | None) -> dict[str, Any]:
        params = {}
        if start is not None:
            params["start"] = iso(hour(start))
        if end is not None:
            params["end"] = iso(hour(end))
        response = api.estimate("colour", **params)
        assert response.status_code == 200, response.text
        return response.json()

    middle = window(-2, -1)
    assert middle["window"] == {"start": iso(hour(-2)), "end": iso(hour(-1))}
    assert_matches(middle, mech, mech.aggregate(encoded[-2]), LABELS3)
    assert window(-2, None)["n"] == 32 + 43
    assert window(None, -2)["n"] == 21
    assert window(-3, 0)["n"] == 96
    assert window(None, None)["n"] == 96
    assert_matches(
        window(-3, -1), mech, mech.aggregate(np.concatenate([encoded[-3], encoded[-2]])), LABELS3
    )
    # A start inside an hour begins at the next bucket (a bucket is all or nothing).
    assert api.estimate("colour", start=iso(hour(-3) + timedelta(minutes=1))).json()["n"] == 75
    assert_problem(api.estimate("colour", start=iso(hour(0)), end=iso(hour(1))), 409)
    assert_problem(api.estimate("colour", start=iso(hour(-1)), end=iso(hour(-2))), 422)


# --- exactly once ----------------------------------------------------------------------


def test_retries_are_idempotent(db_api: Api) -> None:
    api = db_api
    api.define("colour", GRR3, LABELS3)
    mech = make_mechanism(MechanismSpec.model_validate(GRR3))
    batch = reports("colour", 1, mech.to_payloads(encode(mech, 30, np.random.default_rng(61))))
    assert api.post(batch).json() == {"accepted": 30, "duplicates": 0}
    assert api.post(batch).json() == {"accepted": 0, "duplicates": 30}
    assert api.n("colour") == 30
    assert api.repositories.reports.report_count() == 30

    # Half old, half new: only the new half counts.
    fresh = reports("colour", 1, mech.to_payloads(encode(mech, 10, np.random.default_rng(62))))
    assert api.post(batch[:10] + fresh).json() == {"accepted": 10, "duplicates": 10}
    # The same report twice in one batch counts once.
    twice = reports("colour", 1, [{"value": 2}])
    assert api.post(twice + twice).json() == {"accepted": 1, "duplicates": 1}
    assert api.n("colour") == 41
    assert api.repositories.reports.report_count() == 41


def test_a_batch_with_one_bad_report_stores_nothing(db_api: Api) -> None:
    api = db_api
    api.define("colour", GRR3, LABELS3)
    api.define("other", {"mechanism": "oue", "epsilon": 1.0, "domain_size": 4})
    mech = make_mechanism(MechanismSpec.model_validate(GRR3))
    assert api.post(reports("colour", 1, [{"value": 0}] * MIN_REPORTS)).status_code == 200
    good = reports("colour", 1, mech.to_payloads(encode(mech, 25, np.random.default_rng(71))))
    good_other = reports("other", 1, [{"bits": "wA=="}] * 5)
    bad = reports("colour", 1, [{"value": 3}])  # outside 0..2
    body = assert_problem(api.post(good[:12] + good_other + bad + good[12:]), 422)
    assert body["errors"][0]["report"] == 17 and body["errors"][0]["field"] == "payload"
    assert api.n("colour") == MIN_REPORTS
    assert api.n("other") == 0
    assert api.repositories.reports.report_count() == MIN_REPORTS
    # None of the good ids was recorded: they are all accepted now.
    assert api.post(good + good_other).json() == {"accepted": 30, "duplicates": 0}
    assert api.n("colour") == MIN_REPORTS + 25


def test_compaction_keeps_estimates_exact(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    mech = make_mechanism(MechanismSpec.model_validate(GRR3))
    encoded = encode(mech, 60, np.random.default_rng(81))
    for part in np.array_split(np.arange(60), 4):
        assert api.post(reports("colour", 1, mech.to_payloads(encoded[part]))).status_code == 200
    before = api.estimate("colour").json()
    assert len(api.repositories.reports.partial_rows("colour", 1)) == 4
    response = api.client.post("/v1/admin/compact", headers=api.auth("admin"))
    assert response.json() == {"groups": 1, "rows_merged": 4}
    assert len(api.repositories.reports.partial_rows("colour", 1)) == 1
    assert api.estimate("colour").json() == before
    assert_problem(api.client.post("/v1/admin/compact", headers=api.auth("device")), 403)


# --- keys and auth -----------------------------------------------------------------------


def test_key_management(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    created = api.client.post(
        "/v1/keys", json={"role": "device", "label": "phone"}, headers=api.auth("admin")
    )
    assert created.status_code == 201
    info = created.json()
    key, key_id = info["key"], info["key_id"]
    assert (info["role"], info["label"]) == ("device", "phone") and key.startswith("ldp_")
    phone = {"Authorization": f"Bearer {key}"}
    batch = {"reports": reports("colour", 1, [{"value": 1}])}
    assert api.client.post("/v1/reports", json=batch, headers=phone).status_code == 200

    listed = api.client.get("/v1/keys", headers=api.auth("admin"))
    assert listed.status_code == 200
    assert key not in listed.text and hash_key(key) not in listed.text
    assert hash_key(ADMIN_KEY) not in listed.text and ADMIN_KEY not in listed.text
    for entry in listed.json():
        assert set(entry) == {"key_id", "role", "label", "created_at", "revoked_at"}
    by_id = {entry["key_id"]: entry for entry in listed.json()}
    assert by_id[key_id]["role"] == "device" and by_id[key_id]["revoked_at"] is None
    assert sorted(e["role"] for e in listed.json()) == ["admin", "analyst", "device", "device"]

    assert api.client.delete(f"/v1/keys/{key_id}", headers=api.auth("admin")).status_code == 204
    batch = {"reports": reports("colour", 1, [{"value": 1}])}
    assert_problem(api.client.post("/v1/reports", json=batch, headers=phone), 401)
    assert api.repositories.reports.report_count() == 1
    revoked = {e["key_id"]: e for e in api.client.get("/v1/keys", headers=api.auth("admin")).json()}
    assert revoked[key_id]["revoked_at"] is not None
    again = api.client.delete(f"/v1/keys/{key_id}", headers=api.auth("admin"))
    assert_problem(again, 404, "unknown-key")

    # Only admins manage keys; roles are checked.
    for role in ("device", "analyst"):
        assert_problem(api.client.get("/v1/keys", headers=api.auth(role)), 403)
        refused = api.client.post("/v1/keys", json={"role": "admin"}, headers=api.auth(role))
        assert_problem(refused, 403)
    bad_role = api.client.post("/v1/keys", json={"role": "root"}, headers=api.auth("admin"))
    assert_problem(bad_role, 422)
    assert len(api.repositories.keys.keys()) == 4


def test_revocation_elsewhere_reaches_the_key_cache(api: Api) -> None:
    """A key revoked in storage (by another process) is refused once the cache reloads."""
    created = api.client.post("/v1/keys", json={"role": "analyst"}, headers=api.auth("admin"))
    key, key_id = created.json()["key"], created.json()["key_id"]
    headers = {"Authorization": f"Bearer {key}"}
    assert api.client.get("/v1/metrics/x/estimate", headers=headers).status_code == 404
    assert api.repositories.keys.revoke_key(key_id)
    api.app.state.keys.reload()  # what the 2 s cache expiry does
    assert_problem(api.client.get("/v1/metrics/x/estimate", headers=headers), 401)


def test_first_start_creates_one_admin_key(tmp_path: Path) -> None:
    app = create_app(Settings(database=str(tmp_path / "fresh.sqlite3"), compaction_interval=0))
    storage = app.state.services.repositories.keys
    key = bootstrap_keys(app.state.keys, storage, {})
    assert key is not None and key.startswith("ldp_")
    assert bootstrap_keys(app.state.keys, storage, {}) is None
    rows = storage.keys()
    assert [(r["role"], r["key_hash"]) for r in rows] == [("admin", hash_key(key))]
    with TestClient(app) as client:
        response = client.get("/v1/keys", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200 and len(response.json()) == 1


def test_authentication_and_roles(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    batch = {"reports": reports("colour", 1, [{"value": 0}] * 3)}

    missing = api.client.post("/v1/reports", json=batch)
    assert_problem(missing, 401, "unauthorized")
    assert missing.headers["www-authenticate"] == "Bearer"
    for header in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer   ", DEVICE_KEY):
        response = api.client.post("/v1/reports", json=batch, headers={"Authorization": header})
        assert_problem(response, 401, "unauthorized")
        assert response.headers["www-authenticate"].startswith("Bearer")
    wrong = api.client.post(
        "/v1/reports", json=batch, headers={"Authorization": "Bearer " + DEVICE_KEY + "x"}
    )
    assert_problem(wrong, 401, "unauthorized")
    assert "invalid_token" in wrong.headers["www-authenticate"]
    refused_batch = assert_problem(api.post(batch["reports"], role="analyst"), 403, "forbidden")
    assert refused_batch["detail"] == "this needs a device key; the key given is an analyst key"
    # A refused batch is not stored: the device's send afterwards is wholly new.
    assert api.repositories.reports.report_count() == 0
    assert api.post(batch["reports"]).json() == {"accepted": 3, "duplicates": 0}

    by_device = api.client.get("/v1/metrics/colour/estimate", headers=api.auth("device"))
    assert assert_problem(by_device, 403)["detail"] == (
        "this needs an analyst key; the key given is a device key"
    )
    assert_problem(api.client.get("/v1/metrics/colour/estimate"), 401)
    # The admin may do what the other roles do.
    assert api.post(reports("colour", 1, [{"value": 1}]), role="admin").status_code == 200
    admin_estimate = api.client.get("/v1/metrics/colour/estimate", headers=api.auth("admin"))
    assert admin_estimate.status_code == 409  # authorized; only 4 reports so far
    # A refused definition changes nothing.
    refused = api.client.put(
        "/v1/metrics/colour",
        json={"mechanism": {**GRR3, "epsilon": 5.0}},
        headers=api.auth("device"),
    )
    assert_problem(refused, 403)
    assert [v["version"] for v in api.client.get("/v1/metrics/colour/versions").json()] == [1]


def test_rate_limit_answers_429_with_retry_after(tmp_path: Path) -> None:
    rate = 0.01
    with running(
        str(tmp_path / "limited.sqlite3"), rate_limit_per_second=rate, rate_limit_burst=2
    ) as api:
        api.define("colour", GRR3, LABELS3)  # the admin key's first request
        first = reports("colour", 1, [{"value": 0}] * 2)
        second = reports("colour", 1, [{"value": 1}] * 2)
        third = reports("colour", 1, [{"value": 2}] * 2)
        assert api.post(first).status_code == 200
        assert api.post(second).status_code == 200
        limited = api.post(third)
        body = assert_problem(limited, 429, "rate-limited")
        assert "per second" in body["detail"]
        wait = int(limited.headers["retry-after"])
        assert 1 <= wait <= math.ceil(1 / rate)
        assert api.repositories.reports.report_count() == 4  # the refused batch was not stored
        # Limits are per key: the others are not affected.
        assert api.estimate("colour").status_code == 409
        assert api.client.get("/v1/keys", headers=api.auth("admin")).status_code == 200
        # Public routes need no key and are not limited by any.
        for _ in range(3):
            assert api.client.get("/v1/metrics").status_code == 200


# --- operations ---------------------------------------------------------------------------


def sample(api: Api, series: str) -> float:
    """The value of one Prometheus series (0 when it has no sample yet)."""
    response = api.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    match = re.search(rf"^{re.escape(series)} (\S+)$", response.text, re.MULTILINE)
    return float(match.group(1)) if match is not None else 0.0


def test_prometheus_metrics(api: Api) -> None:
    api.define("colour", GRR3, LABELS3)
    assert "ldp_reports_accepted_total" in api.client.get("/metrics").text
    accepted = sample(api, "ldp_reports_accepted_total")
    duplicates = sample(api, "ldp_reports_duplicate_total")
    rejected = 'ldp_reports_rejected_total{reason="invalid"}'
    invalid = sample(api, rejected)
    batch = reports("colour", 1, [{"value": 0}] * 7)
    api.post(batch)
    api.post(batch)
    assert sample(api, "ldp_reports_accepted_total") == accepted + 7
    assert sample(api, "ldp_reports_duplicate_total") == duplicates + 7
    # A refused batch counts its reports as rejected.
    assert api.post(reports("colour", 1, [{"value": 0}, {"value": 5}, {"value": 1}])).is_error
    assert sample(api, rejected) == invalid + 3
    assert sample(api, "ldp_reports_accepted_total") == accepted + 7
    text = api.client.get("/metrics").text
    for name in (
        "ldp_reports_duplicate_total",
        "ldp_reports_rejected_total",
        "ldp_ingest_seconds_bucket",
        "ldp_http_requests_total",
    ):
        assert name in text


def test_healthz(db_api: Api) -> None:
    response = db_api.client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "storage": db_api.repositories.database.dialect}


def test_openapi_document(api: Api) -> None:
    response = api.client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    schemas = document["components"]["schemas"]
    assert "ReportBatch" in schemas and "Report" in schemas
    assert schemas["ReportBatch"]["properties"]["reports"]["items"] == {
        "$ref": "#/components/schemas/Report"
    }
    assert set(schemas["Report"]["required"]) == {"report_id", "metric", "version", "payload"}
    body = document["paths"]["/v1/reports"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ReportBatch"
    }
    expected = {
        "/healthz",
        "/metrics",
        "/v1/metrics",
        "/v1/metrics/{name}",
        "/v1/metrics/{name}/versions",
        "/v1/metrics/{name}/estimate",
        "/v1/reports",
        "/v1/keys",
        "/v1/keys/{key_id}",
        "/v1/admin/compact",
    }
    routes = {
        route.path
        for route in iter_route_contexts(api.app.routes)
        if isinstance(route.original_route, APIRoute) and route.original_route.include_in_schema
    }
    assert expected <= routes
    assert set(document["paths"]) == routes
    # Every $ref resolves.
    refs = set(re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', response.text))
    assert refs <= set(schemas)
