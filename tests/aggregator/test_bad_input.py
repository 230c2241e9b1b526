"""Bad input, in process: every malformed request gets a 4xx problem document and changes nothing.

A problem document has content type ``application/problem+json`` and the fields type,
title, status, detail and errors; ``errors`` names the report index and field where a
report was wrong. Each bad batch carries good reports around the bad one, and after the
refusal the test checks that nothing was written (report ids, partial statistics, metric
versions) and that the good reports, sent alone, are all accepted as new.
"""

from __future__ import annotations

import base64
import json
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
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.settings import Settings
from aggregator.storage import Repositories
from shared.mechanisms import DeviceContext, Mechanism, make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec

ADMIN_KEY = "bad-input-admin-key-0123456789"
ANALYST_KEY = "bad-input-analyst-key-0123456789"
DEVICE_KEY = "bad-input-device-key-0123456789"
PROBLEM = "application/problem+json"
MAX_BATCH = 40
MAX_BODY = 16 * 1024
#: A placeholder string replaced by raw JSON text (NaN, Infinity) after encoding.
RAW = "__raw_json__"

SPECS: dict[str, dict[str, Any]] = {
    "grr": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4},
    # 10 bits in 2 bytes: the 6 low bits of the second byte are padding (np.packbits order).
    "oue": {"mechanism": "oue", "epsilon": 1.0, "domain_size": 10},
    "sue": {"mechanism": "sue", "epsilon": 1.0, "domain_size": 12},
    # g = round(e^1) + 1 = 4 buckets, P = 11: a in 1..10, b in 0..10, value in 0..3.
    "olh": {"mechanism": "olh", "epsilon": 1.0, "domain_size": 10},
    # 8 outputs (the smallest power of two above 6).
    "hr": {"mechanism": "hr", "epsilon": 1.0, "domain_size": 6},
    "laplace": {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 10.0},
    "duchi": {"mechanism": "duchi", "epsilon": 1.0, "lower": -1.0, "upper": 1.0},
    # Cell indices 0..M-1 (M = 16 grid steps plus the window).
    "piecewise": {
        "mechanism": "piecewise",
        "epsilon": 2.0,
        "lower": 0.0,
        "upper": 120.0,
        "grid_steps": 16,
    },
    # 12 bits in 2 bytes, little-endian bit order: the 4 high bits of byte 1 are padding.
    "rappor": {
        "mechanism": "rappor",
        "num_bits": 12,
        "num_hashes": 2,
        "num_cohorts": 4,
        "f": 0.5,
        "p": 0.25,
        "q": 0.75,
    },
}
PIECEWISE_CELLS: int = make_mechanism(  # type: ignore[attr-defined]
    MechanismSpec.model_validate(SPECS["piecewise"])
).cells
RAPPOR_LABELS = ["a.example", "b.example", "c.example"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass
class Service:
    """The service under test, shared by this module's tests (each checks its own effects)."""

    client: TestClient
    app: FastAPI
    mechanisms: dict[str, Mechanism]
    rng: np.random.Generator

    @property
    def repositories(self) -> Repositories:
        return self.app.state.services.repositories  # type: ignore[no-any-return]

    def headers(self, role: str = "device") -> dict[str, str]:
        key = {"admin": ADMIN_KEY, "analyst": ANALYST_KEY, "device": DEVICE_KEY}[role]
        return {"Authorization": f"Bearer {key}"}

    def good(self, metric: str = "grr", count: int = 4) -> list[dict[str, Any]]:
        """``count`` valid reports of ``metric`` with fresh ids."""
        mech = self.mechanisms[metric]
        if isinstance(mech, Rappor):
            values = self.rng.choice(RAPPOR_LABELS, count)
            cohorts = self.rng.integers(0, 4, count)
            secrets = [self.rng.bytes(16) for _ in range(count)]
            encoded = mech.encode(
                values, rng=self.rng, context=DeviceContext(secrets=secrets, cohorts=cohorts)
            )
        elif mech.spec.kind == "categorical":
            assert mech.spec.domain_size is not None
            encoded = mech.encode(self.rng.integers(0, mech.spec.domain_size, count), rng=self.rng)
        else:
            assert mech.spec.lower is not None and mech.spec.upper is not None
            values = self.rng.uniform(mech.spec.lower, mech.spec.upper, count)
            encoded = mech.encode(values, rng=self.rng)
        return [report(metric, payload) for payload in mech.to_payloads(encoded)]

    def post(self, body: bytes | dict[str, Any], **headers: str) -> Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post(
            "/v1/reports",
            content=content,
            headers=self.headers() | {"content-type": "application/json"} | headers,
        )

    def state(self) -> tuple[Any, ...]:
        """Everything a request could change: ids, statistics per metric version, metrics."""
        metrics = self.repositories.metrics.metrics()
        stats = tuple(
            (m.name, m.version, sorted((r.bucket, r.n, r.stats) for r in rows))
            for m in metrics
            for rows in [self.repositories.reports.partial_rows(m.name, m.version)]
        )
        definitions = tuple(m.model_dump_json() for m in metrics)
        return self.repositories.reports.report_count(), stats, definitions

    def accepts_as_new(self, reports: list[dict[str, Any]]) -> None:
        """The reports are stored now, every one as new (no id of theirs was recorded)."""
        response = self.post({"reports": reports})
        assert response.status_code == 200, response.text
        assert response.json() == {"accepted": len(reports), "duplicates": 0}


def report(metric: str, payload: Any, **fields: Any) -> dict[str, Any]:
    return {
        "report_id": str(uuid.uuid4()),
        "metric": metric,
        "version": 1,
        "payload": payload,
        **fields,
    }


def with_raw(body: dict[str, Any], raw: str) -> bytes:
    """``body`` as JSON with the placeholder string replaced by ``raw`` JSON text."""
    text = json.dumps(body)
    assert text.count(json.dumps(RAW)) == 1
    return text.replace(json.dumps(RAW), raw).encode()


def assert_problem(response: Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx problem document (of ``status`` when given)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body = response.json()
    assert {"type", "title", "status", "detail", "errors"} <= set(body), body
    assert body["status"] == response.status_code
    assert body["type"].startswith("/problems/") and body["title"] and body["detail"]
    assert isinstance(body["errors"], list)
    return body


def located(body: dict[str, Any]) -> list[tuple[int | None, str | None]]:
    return [(item["report"], item["field"]) for item in body["errors"]]


@contextmanager
def start_service(database: str) -> Iterator[Service]:
    """The service over ``database`` with the module's metrics defined and a few reports."""
    settings = Settings(
        database=database,
        min_reports=1,
        compaction_interval=0,
        max_batch_reports=MAX_BATCH,
        max_body_bytes=MAX_BODY,
        rate_limit_per_second=1e6,
        rate_limit_burst=1_000_000,
    )
    app = create_app(settings)
    environment = {
        "LDP_ADMIN_KEYS": ADMIN_KEY,
        "LDP_ANALYST_KEYS": ANALYST_KEY,
        "LDP_DEVICE_KEYS": DEVICE_KEY,
    }
    bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment)
    mechanisms = {
        name: make_mechanism(MechanismSpec.model_validate(s)) for name, s in SPECS.items()
    }
    # Server errors come back as responses (500), so a test can say which request failed.
    with TestClient(app, raise_server_exceptions=False) as client:
        service = Service(client, app, mechanisms, np.random.default_rng(20261122))
        for name, spec in SPECS.items():
            body: dict[str, Any] = {"mechanism": spec}
            if name == "rappor":
                body["labels"] = RAPPOR_LABELS
            response = client.put(
                f"/v1/metrics/{name}", json=body, headers=service.headers("admin")
            )
            assert response.status_code == 201, response.text
            service.accepts_as_new(service.good(name, 3))
        yield service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with start_service(str(tmp_path_factory.mktemp("bad-input") / "agg.sqlite3")) as started:
        yield started


def refuse_batch(
    service: Service,
    bad: dict[str, Any] | None,
    *,
    metric: str = "grr",
    raw: str | None = None,
    index: int = 2,
    status: int = 422,
    field: str | set[str] | None = None,
) -> dict[str, Any]:
    """Send good reports with ``bad`` at ``index``; check the refusal and that nothing changed.

    ``raw`` replaces the placeholder ``RAW`` inside ``bad`` with raw JSON text. ``field``
    (or one of a set of acceptable fields) must be named for report ``index``.
    """
    good = service.good(metric)
    batch = {"reports": good[:index] + ([bad] if bad is not None else []) + good[index:]}
    before = service.state()
    response = service.post(with_raw(batch, raw) if raw is not None else batch)
    body = assert_problem(response, status)
    if field is not None:
        fields = {field} if isinstance(field, str) else field
        assert any(r == index and f in fields for r, f in located(body)), body
        assert all(r == index for r, _ in located(body)), body
    assert service.state() == before
    service.accepts_as_new(good)
    return body


# --- malformed bodies ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"reports": [',
        b'{"reports": [{"report_id": }]}',
        b"\xff\xfe{}",
        b"null",
        b"[]",
        b'"reports"',
        b"42",
        b"{}",
        b'{"reports": null}',
        b'{"reports": {}}',
        b'{"reports": "x"}',
        b'{"reports": [1, 2]}',
        b'{"reports": [null]}',
        b'{"reports": []}',
        b'{"reports": [], "extra": 1}',
        b'{"Reports": []}',
    ],
    ids=lambda body: repr(body)[:40],
)
def test_malformed_bodies(service: Service, body: bytes) -> None:
    before = service.state()
    problem = assert_problem(service.post(body), 422)
    assert service.state() == before
    assert problem["errors"], problem  # the document says what was wrong


def test_empty_batch_names_the_reports_field(service: Service) -> None:
    problem = assert_problem(service.post({"reports": []}), 422)
    assert located(problem) == [(None, "reports")]


def test_missing_reports_field(service: Service) -> None:
    problem = assert_problem(service.post({"batch": []}), 422)
    assert (None, "reports") in located(problem)


def test_extra_top_level_field(service: Service) -> None:
    reports = service.good()
    before = service.state()
    problem = assert_problem(service.post({"reports": reports, "device": "phone-1"}), 422)
    assert (None, "device") in located(problem)
    assert service.state() == before
    service.accepts_as_new(reports)


# --- the report envelope ----------------------------------------------------------------

ENVELOPE_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "report_id number": ({"report_id": 123}, "report_id"),
    "report_id null": ({"report_id": None}, "report_id"),
    "report_id empty": ({"report_id": ""}, "report_id"),
    "report_id not a uuid": ({"report_id": "not-a-uuid"}, "report_id"),
    "report_id short": ({"report_id": "1234"}, "report_id"),
    "report_id bad hex": ({"report_id": "00000000-0000-0000-0000-00000000000g"}, "report_id"),
    "report_id too long": ({"report_id": str(uuid.uuid4()) + "0"}, "report_id"),
    "metric number": ({"metric": 5}, "metric"),
    "metric null": ({"metric": None}, "metric"),
    "metric empty": ({"metric": ""}, "metric"),
    "metric too long": ({"metric": "m" * 65}, "metric"),
    "version 0": ({"version": 0}, "version"),
    "version negative": ({"version": -1}, "version"),
    "version 2^31": ({"version": 2**31}, "version"),
    "version huge": ({"version": 10**30}, "version"),
    "version word": ({"version": "two"}, "version"),
    "version empty string": ({"version": ""}, "version"),
    "version fraction": ({"version": 1.5}, "version"),
    "version null": ({"version": None}, "version"),
    "version list": ({"version": [1]}, "version"),
    "payload string": ({"payload": "AAE="}, "payload"),
    "payload list": ({"payload": [1]}, "payload"),
    "payload number": ({"payload": 1}, "payload"),
    "payload null": ({"payload": None}, "payload"),
    "time word": ({"time": "yesterday"}, "time"),
    "time boolean": ({"time": True}, "time"),
    "time list": ({"time": []}, "time"),
    "time no zone": ({"time": "2026-01-01T10:00:00"}, "time"),
    "time not UTC": ({"time": "2026-01-01T10:00:00+02:00"}, "time"),
    "time minutes": ({"time": "2026-01-01T10:30:00Z"}, "time"),
    "time seconds": ({"time": "2026-01-01T10:00:01Z"}, "time"),
    "time microseconds": ({"time": "2026-01-01T10:00:00.000001Z"}, "time"),
    "time bad date": ({"time": "2026-02-30T10:00:00Z"}, "time"),
    "extra field device_id": ({"device_id": "phone-1"}, "device_id"),
    "extra field ip": ({"ip": "192.0.2.1"}, "ip"),
}


@pytest.mark.parametrize("case", list(ENVELOPE_CASES))
def test_bad_report_envelope(service: Service, case: str) -> None:
    change, field = ENVELOPE_CASES[case]
    bad = report("grr", {"value": 1}) | change
    refuse_batch(service, bad, field=field)


@pytest.mark.parametrize("missing", ["report_id", "metric", "version", "payload"])
def test_missing_report_field(service: Service, missing: str) -> None:
    bad = report("grr", {"value": 1})
    del bad[missing]
    refuse_batch(service, bad, field=missing)


def test_unknown_metric(service: Service) -> None:
    body = refuse_batch(service, report("no.such.metric", {"value": 1}), field="metric")
    assert "no.such.metric" in body["detail"]


def test_unknown_version(service: Service) -> None:
    bad = report("grr", {"value": 1}, version=99)
    body = refuse_batch(service, bad, field={"metric", "version"})
    assert "99" in body["detail"]


def hour(offset: int) -> str:
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return (start + timedelta(hours=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_time_in_the_future(service: Service) -> None:
    refuse_batch(service, report("grr", {"value": 1}, time=hour(3)), field="time")
    refuse_batch(service, report("grr", {"value": 1}, time="9999-12-31T23:00:00Z"), field="time")
    # The next hour is within the one hour allowed for clock skew.
    service.accepts_as_new([report("grr", {"value": 1}, time=hour(1))])


def test_time_older_than_retention(service: Service) -> None:
    retention = Settings().dedupe_retention_hours
    old = report("grr", {"value": 1}, time=hour(-retention - 2))
    refuse_batch(service, old, field="time")
    refuse_batch(service, report("grr", {"value": 1}, time="0001-01-01T00:00:00Z"), field="time")
    # The recent past is fine, back to nearly the retention.
    service.accepts_as_new(
        [
            report("grr", {"value": 1}, time=hour(-2)),
            report("grr", {"value": 1}, time=hour(-retention + 2)),
        ]
    )


# --- payloads of each mechanism -------------------------------------------------------

#: B: laplace accepts grid indices -B..K+B (the grid plus the noise tail bound).
#: The farthest a laplace index may lie past the grid: the refusal rule's noise tail.
LAPLACE_TAIL_BOUND = make_mechanism(MechanismSpec.model_validate(SPECS["laplace"])).refusal_bound

PAYLOAD_CASES: list[tuple[str, str, Any]] = [
    ("grr", "value too large", {"value": 4}),
    ("grr", "value negative", {"value": -1}),
    ("grr", "value string", {"value": "1"}),
    ("grr", "value fraction", {"value": 1.5}),
    ("grr", "value boolean", {"value": True}),
    ("grr", "value null", {"value": None}),
    ("grr", "value beyond int64", {"value": 2**70}),
    ("grr", "no value", {}),
    ("grr", "unexpected field", {"value": 1, "device": "x"}),
    ("grr", "another mechanism's payload", {"bits": "AA=="}),
    ("oue", "bits too short", {"bits": b64(b"\x00")}),
    ("oue", "bits too long", {"bits": b64(b"\x00\x00\x00")}),
    ("oue", "bits empty", {"bits": ""}),
    ("oue", "bits not base64", {"bits": "!!!!"}),
    ("oue", "bits base64 without padding", {"bits": "AAA"}),
    ("oue", "bits padding set", {"bits": b64(b"\x00\x01")}),
    ("oue", "bits as list", {"bits": [0, 1]}),
    ("oue", "bits as number", {"bits": 3}),
    ("oue", "no bits", {}),
    ("oue", "a value instead of bits", {"value": 1}),
    ("sue", "bits too short", {"bits": b64(b"\x00")}),
    ("sue", "bits padding set", {"bits": b64(b"\x00\x08")}),
    ("sue", "bits not base64", {"bits": "AA=*"}),
    ("olh", "a zero", {"a": 0, "b": 0, "value": 0}),
    ("olh", "a = P", {"a": 11, "b": 0, "value": 0}),
    ("olh", "b = P", {"a": 1, "b": 11, "value": 0}),
    ("olh", "b negative", {"a": 1, "b": -1, "value": 0}),
    ("olh", "value = g", {"a": 1, "b": 0, "value": 4}),
    ("olh", "value negative", {"a": 1, "b": 0, "value": -1}),
    ("olh", "a missing", {"b": 0, "value": 0}),
    ("olh", "a string", {"a": "1", "b": 0, "value": 0}),
    ("hr", "value = outputs", {"value": 8}),
    ("hr", "value negative", {"value": -1}),
    ("laplace", "value implausibly large", {"value": 2**60}),
    ("laplace", "value fraction", {"value": 1.5}),
    ("laplace", "value string", {"value": "3"}),
    ("duchi", "value zero", {"value": 0}),
    ("duchi", "value two", {"value": 2}),
    ("duchi", "value fraction", {"value": 0.5}),
    ("piecewise", "value = M", {"value": PIECEWISE_CELLS}),
    ("piecewise", "value negative", {"value": -1}),
    ("piecewise", "value fraction", {"value": 1.5}),
    ("piecewise", "value string", {"value": "1"}),
    ("piecewise", "value null", {"value": None}),
    ("rappor", "cohort = num_cohorts", {"cohort": 4, "bits": b64(b"\x00\x00")}),
    ("rappor", "cohort negative", {"cohort": -1, "bits": b64(b"\x00\x00")}),
    ("rappor", "cohort string", {"cohort": "1", "bits": b64(b"\x00\x00")}),
    ("rappor", "cohort missing", {"bits": b64(b"\x00\x00")}),
    ("rappor", "bits too short", {"cohort": 0, "bits": b64(b"\x00")}),
    ("rappor", "bits too long", {"cohort": 0, "bits": b64(b"\x00\x00\x00")}),
    ("rappor", "bits padding set", {"cohort": 0, "bits": b64(b"\x00\x10")}),
    ("rappor", "bits not base64", {"cohort": 0, "bits": "@@@@"}),
    ("rappor", "unexpected field", {"cohort": 0, "bits": b64(b"\x00\x00"), "secret": "x"}),
]


@pytest.mark.parametrize(
    ("metric", "payload"),
    [(metric, payload) for metric, _, payload in PAYLOAD_CASES],
    ids=[f"{metric}: {name}" for metric, name, _ in PAYLOAD_CASES],
)
def test_bad_payload(service: Service, metric: str, payload: Any) -> None:
    refuse_batch(service, report(metric, payload), metric=metric, field="payload")


def test_edge_payloads_are_valid(service: Service) -> None:
    """The refusals above are at the edges: the values just inside them are accepted."""
    service.accepts_as_new(
        [
            report("grr", {"value": 3}),
            report("oue", {"bits": b64(b"\xff\xc0")}),
            report("sue", {"bits": b64(b"\xff\xf0")}),
            report("olh", {"a": 10, "b": 10, "value": 3}),
            report("hr", {"value": 7}),
            report("laplace", {"value": -LAPLACE_TAIL_BOUND}),  # grid start minus the noise tail
            report("duchi", {"value": -1}),
            report("piecewise", {"value": 0}),
            report("piecewise", {"value": PIECEWISE_CELLS - 1}),
            report("rappor", {"cohort": 3, "bits": b64(b"\xff\x0f")}),
        ]
    )


# --- NaN and infinities ---------------------------------------------------------------

NON_FINITE_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("piecewise", {"payload": {"value": RAW}}, "NaN", "payload"),
    ("piecewise", {"payload": {"value": RAW}}, "Infinity", "payload"),
    ("piecewise", {"payload": {"value": RAW}}, "-Infinity", "payload"),
    ("piecewise", {"payload": {"value": RAW}}, "1e999", "payload"),
    ("grr", {"payload": {"value": RAW}}, "NaN", "payload"),
    ("laplace", {"payload": {"value": RAW}}, "Infinity", "payload"),
    ("duchi", {"payload": {"value": RAW}}, "-Infinity", "payload"),
    ("olh", {"payload": {"a": RAW, "b": 0, "value": 0}}, "NaN", "payload"),
    ("rappor", {"payload": {"cohort": RAW, "bits": "AAA="}}, "NaN", "payload"),
    ("piecewise", {"payload": {"value": [RAW]}}, "NaN", "payload"),
    ("grr", {"version": RAW}, "NaN", "version"),
    ("grr", {"version": RAW}, "Infinity", "version"),
    ("grr", {"time": RAW}, "NaN", "time"),
]


@pytest.mark.parametrize(
    ("metric", "change", "raw", "field"),
    NON_FINITE_CASES,
    ids=[f"{m}: {next(iter(c))} {r}" for m, c, r, _ in NON_FINITE_CASES],
)
def test_non_finite_numbers(
    service: Service, metric: str, change: dict[str, Any], raw: str, field: str
) -> None:
    bad = report(metric, {"value": 0}) | change
    refuse_batch(service, bad, metric=metric, raw=raw, field=field)


# --- where the errors are -------------------------------------------------------------


def test_errors_name_every_bad_report_and_field(service: Service) -> None:
    good = service.good("grr", 6)
    bad_version = report("grr", {"value": 1}, version=0)
    no_payload = report("grr", {"value": 1})
    del no_payload["payload"]
    batch = {"reports": [good[0], bad_version, good[1], no_payload, *good[2:]]}
    before = service.state()
    body = assert_problem(service.post(batch), 422)
    assert located(body) == [(1, "version"), (3, "payload")]
    assert "report 1" in body["detail"] and "report 3" in body["detail"]
    assert service.state() == before

    # Checks against the metrics name each bad report too, in batch order.
    unknown = report("nope", {"value": 1})
    future = report("grr", {"value": 1}, time=hour(5))
    bad_bits = report("oue", {"bits": "AA=="})
    bad_value = report("grr", {"value": 9})
    batch = {"reports": [good[0], bad_bits, unknown, good[1], future, bad_value]}
    body = assert_problem(service.post(batch), 422)
    assert located(body) == [(1, "payload"), (2, "metric"), (4, "time"), (5, "payload")]
    assert service.state() == before
    service.accepts_as_new(good)


def test_a_repeated_id_with_a_bad_payload_is_still_refused(service: Service) -> None:
    """A report is checked even if its id repeats an earlier one in the batch."""
    good = service.good("grr", 3)
    clash = {**good[0], "payload": {"value": 99}}
    before = service.state()
    body = assert_problem(service.post({"reports": [*good, clash]}), 422)
    assert (3, "payload") in located(body)
    assert service.state() == before
    service.accepts_as_new(good)


# --- size limits ------------------------------------------------------------------------


def test_batch_over_max_batch_reports(service: Service) -> None:
    reports = service.good("grr", MAX_BATCH + 1)
    before = service.state()
    body = assert_problem(service.post({"reports": reports}), 413)
    assert (None, "reports") in located(body)
    assert str(MAX_BATCH) in body["detail"]
    assert service.state() == before
    service.accepts_as_new(reports[:MAX_BATCH])


def oversize_body(service: Service) -> tuple[bytes, list[dict[str, Any]]]:
    reports = service.good("grr", 5)
    body = json.dumps({"reports": reports}).encode()
    body = body[:-1] + b" " * (MAX_BODY + 1 - len(body)) + b"}"
    assert len(body) == MAX_BODY + 1
    return body, reports


def test_body_over_max_body_bytes(service: Service) -> None:
    body, reports = oversize_body(service)
    before = service.state()
    response = service.post(body)
    assert response.request.headers["content-length"] == str(MAX_BODY + 1)
    assert_problem(response, 413)
    assert service.state() == before
    # The same reports in a body of an allowed size are accepted.
    service.accepts_as_new(reports)


def test_body_over_max_body_bytes_without_content_length(service: Service) -> None:
    body, reports = oversize_body(service)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    before = service.state()
    response = service.client.post(
        "/v1/reports",
        content=chunks(),
        headers=service.headers() | {"content-type": "application/json"},
    )
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_problem(response, 413)
    assert service.state() == before
    service.accepts_as_new(reports)


def test_a_false_content_length_is_not_trusted(service: Service) -> None:
    """A body longer than its declared length is cut or refused, never stored past the limit."""
    body, _ = oversize_body(service)
    before = service.state()
    response = service.client.post(
        "/v1/reports",
        content=iter([body]),
        headers=service.headers() | {"content-type": "application/json", "content-length": "10"},
    )
    assert_problem(response)
    assert service.state() == before


# --- estimate queries -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/v1/metrics/grr/estimate", {"version": 0}, 422),
        ("/v1/metrics/grr/estimate", {"version": "two"}, 422),
        ("/v1/metrics/grr/estimate", {"version": 2**31}, 422),
        ("/v1/metrics/grr/estimate", {"version": 5}, 404),
        ("/v1/metrics/grr/estimate", {"start": "yesterday"}, 422),
        ("/v1/metrics/grr/estimate", {"start": "2026-11-22T00:00:00"}, 422),
        ("/v1/metrics/grr/estimate", {"end": "2026-13-01T00:00:00Z"}, 422),
        (
            "/v1/metrics/grr/estimate",
            {"start": "2026-11-22T05:00:00Z", "end": "2026-11-22T05:00:00Z"},
            422,
        ),
        (
            "/v1/metrics/grr/estimate",
            {"start": "2026-11-22T05:00:00Z", "end": "2026-11-22T01:00:00Z"},
            422,
        ),
        ("/v1/metrics/grr/estimate", {"end": "9999-12-31T23:59:59-12:00"}, None),
        ("/v1/metrics/nope/estimate", {}, 404),
        ("/v1/metrics/rappor/estimate", {"candidates": ["a.example", "a.example"]}, 422),
    ],
    ids=lambda value: str(value)[:50],
)
def test_bad_estimate_queries(
    service: Service, path: str, params: dict[str, Any], status: int | None
) -> None:
    before = service.state()
    response = service.client.get(path, params=params, headers=service.headers("analyst"))
    assert_problem(response, status)
    assert service.state() == before


# --- metric definitions, keys, routes ------------------------------------------------------

GRR = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}
BAD_DEFINITIONS: list[tuple[str, str, bytes | dict[str, Any]]] = [
    ("upper-case name", "Bad", {"mechanism": GRR}),
    ("name too long", "m" * 65, {"mechanism": GRR}),
    ("name starts with a dot", ".m", {"mechanism": GRR}),
    ("no mechanism", "m", {"description": "x"}),
    ("unknown mechanism", "m", {"mechanism": {**GRR, "mechanism": "magic"}}),
    ("epsilon zero", "m", {"mechanism": {**GRR, "epsilon": 0}}),
    ("epsilon negative", "m", {"mechanism": {**GRR, "epsilon": -1}}),
    ("epsilon too large", "m", {"mechanism": {**GRR, "epsilon": 21}}),
    ("epsilon string", "m", {"mechanism": {**GRR, "epsilon": "one"}}),
    ("epsilon NaN", "m", b'{"mechanism": {"mechanism": "grr", "epsilon": NaN, "domain_size": 3}}'),
    (
        "epsilon Infinity",
        "m",
        b'{"mechanism": {"mechanism": "grr", "epsilon": Infinity, "domain_size": 3}}',
    ),
    ("no domain_size", "m", {"mechanism": {"mechanism": "grr", "epsilon": 1.0}}),
    ("domain_size 1", "m", {"mechanism": {**GRR, "domain_size": 1}}),
    ("bounds on a categorical", "m", {"mechanism": {**GRR, "lower": 0.0}}),
    ("labels too few", "m", {"mechanism": GRR, "labels": ["a", "b"]}),
    ("labels repeated", "m", {"mechanism": GRR, "labels": ["a", "b", "a"]}),
    ("label empty", "m", {"mechanism": GRR, "labels": ["a", "b", ""]}),
    (
        "labels on a numeric",
        "m",
        {
            "mechanism": {"mechanism": "duchi", "epsilon": 1.0, "lower": 0.0, "upper": 1.0},
            "labels": ["a"],
        },
    ),
    (
        "lower above upper",
        "m",
        {"mechanism": {"mechanism": "duchi", "epsilon": 1.0, "lower": 1.0, "upper": 0.0}},
    ),
    (
        "rappor epsilon disagrees",
        "m",
        {"mechanism": {**SPECS["rappor"], "epsilon": 1.0}},
    ),
    ("rappor p above q", "m", {"mechanism": {**SPECS["rappor"], "p": 0.8}}),
    ("extra field", "m", {"mechanism": GRR, "owner": "team"}),
    ("name disagrees with the path", "m", {"name": "n", "mechanism": GRR}),
    ("version zero", "m", {"name": "m", "version": 0, "mechanism": GRR}),
    ("malformed JSON", "m", b'{"mechanism": '),
    ("not an object", "m", b"[]"),
]


@pytest.mark.parametrize(
    ("name", "body"),
    [(name, body) for _, name, body in BAD_DEFINITIONS],
    ids=[case for case, _, _ in BAD_DEFINITIONS],
)
def test_bad_metric_definitions(service: Service, name: str, body: bytes | dict[str, Any]) -> None:
    before = service.state()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = service.client.put(
        f"/v1/metrics/{name}",
        content=content,
        headers=service.headers("admin") | {"content-type": "application/json"},
    )
    assert_problem(response, 422)
    assert service.state() == before
    assert service.client.get("/v1/metrics").status_code == 200


#: A well-formed report for each mechanism of the degenerate specs (``auto``: none, since
#: the concrete mechanism it resolves to decides the payload).
DEGENERATE_PAYLOADS: dict[str, dict[str, Any]] = {
    "grr": {"value": 0},
    "oue": {"bits": b64(b"\x80")},
    "duchi": {"value": 1},
    "piecewise": {"value": 0},
    "laplace": {"value": 0},
}


@pytest.mark.parametrize(
    "spec",
    [
        {"mechanism": "grr", "epsilon": 1e-300, "domain_size": 2},
        {"mechanism": "oue", "epsilon": 1e-300, "domain_size": 2},
        {"mechanism": "auto", "epsilon": 1e-300, "domain_size": 2},
        {"mechanism": "duchi", "epsilon": 1e-300, "lower": 0.0, "upper": 1.0},
        {"mechanism": "piecewise", "epsilon": 1e-300, "lower": 0.0, "upper": 1.0},
        {"mechanism": "laplace", "epsilon": 1e-9, "lower": 0.0, "upper": 1.0},
    ],
    ids=lambda spec: f"{spec['mechanism']} epsilon {spec['epsilon']}",
)
def test_degenerate_epsilon_is_never_a_server_error(tmp_path: Path, spec: dict[str, Any]) -> None:
    """A spec the schema admits but the mechanism cannot use: 4xx, or a working metric.

    Whichever the service chooses, defining it, sending it a well-formed report,
    asking for its estimate and listing the metrics must not fail with a 5xx, and a
    refused definition must not be stored.
    """
    with start_service(str(tmp_path / "degenerate.sqlite3")) as service:
        client, admin = service.client, service.headers("admin")
        before = service.state()
        defined = client.put("/v1/metrics/tiny", json={"mechanism": spec}, headers=admin)
        assert defined.status_code < 500, defined.text
        if defined.status_code >= 400:
            assert_problem(defined)
            stored = [(m.name, m.version) for m in service.repositories.metrics.metrics()]
            assert ("tiny", 1) not in stored, "a refused definition was stored"
            assert service.state() == before
        else:
            payload = DEGENERATE_PAYLOADS.get(spec["mechanism"])
            if payload is not None:
                batch = {"reports": [report("tiny", payload)]}
                sent = client.post("/v1/reports", json=batch, headers=admin)
                assert sent.status_code < 500, sent.text
            estimate = client.get("/v1/metrics/tiny/estimate", headers=admin)
            assert estimate.status_code < 500, estimate.text
        listed = client.get("/v1/metrics")
        assert listed.status_code == 200, listed.text
        # The service still works for the other metrics.
        assert client.get("/v1/metrics/grr/estimate", headers=admin).status_code == 200
        again = client.put("/v1/metrics/after", json={"mechanism": GRR}, headers=admin)
        assert again.status_code == 201, again.text


def test_bad_key_requests(service: Service) -> None:
    admin = service.headers("admin")
    keys_before = service.repositories.keys.keys()
    for body in ({"role": "root"}, {"role": None}, {}, {"role": "device", "label": "x" * 201}):
        assert_problem(service.client.post("/v1/keys", json=body, headers=admin), 422)
    assert_problem(service.client.delete("/v1/keys/no-such-key", headers=admin), 404)
    assert service.repositories.keys.keys() == keys_before


def test_unknown_routes_and_methods(service: Service) -> None:
    assert_problem(service.client.get("/v1/nothing"), 404)
    assert_problem(service.client.delete("/v1/metrics", headers=service.headers("admin")), 405)
    assert_problem(service.client.get("/v1/reports", headers=service.headers("device")), 405)
