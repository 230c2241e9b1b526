"""Fuzzing the HTTP API from its own OpenAPI document (schemathesis).

Every operation of the document gets generated requests, valid and invalid, sent with a
valid key of the role the route needs (device for reports, analyst for estimates, admin
for the rest), to an app over a SQLite file that holds the demo metrics and some reports
of each. schemathesis' default checks apply: no 5xx; status codes, content types,
headers and bodies as the document says; invalid input refused with a 4xx. Generation
is seeded and deterministic: schemathesis' example and coverage phases, then at most 25
fuzzed examples per operation.

The same document also drives a real ``ldp-aggregator serve`` process (uvicorn, its
start-up and background work): each generated request is sent with a key of every role
and with none. With the role the route needs the checks above apply; with another key
or none the answer must be a documented refusal, never a server error; and afterwards
the process still serves and has logged no traceback.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from aggregator.app import create_app
from aggregator.registry import DEMO_METRICS
from aggregator.service import Aggregator, Services
from aggregator.settings import Settings
from shared.mechanisms import DeviceContext, as_attributes, make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import ReportBatch
from simulations.server import Server, start_server

KEYS = {
    "admin": "fuzz-admin-key-0123456789",
    "analyst": "fuzz-analyst-key-0123456789",
    "device": "fuzz-device-key-0123456789",
}
#: Reports stored for each demo metric before fuzzing.
REPORTS_EACH = 50

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20_261_122,
        "generation": {"max-examples": 25, "deterministic": True, "database": "none"},
        # A batch past its maxItems is refused while it is parsed with 413 (too large),
        # like a body past the byte limit: a rejection, besides schemathesis' defaults.
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [
                    *("400", "401", "403", "404", "405", "406", "409", "413", "415"),
                    *("422", "428", "429", "5xx"),
                ]
            }
        },
    }
)

#: Operations whose valid input depends on more than a JSON schema can say: which spec
#: fields apply to which mechanism and how many labels a domain needs (``PUT`` a metric),
#: whether the metric version exists and what its mechanism's payload looks like
#: (``POST`` reports), whether the window's end follows its start (estimate). There a
#: schema-valid request may rightly get 422, so schemathesis' "schema-valid data is
#: accepted" check is wrong for them by design and is skipped; all other checks run.
CROSS_FIELD_RULES = {
    "PUT /v1/metrics/{name}",
    "POST /v1/reports",
    "GET /v1/metrics/{name}/estimate",
    # A series has the estimate's rules, and start before end.
    "GET /v1/metrics/{name}/series",
    # Heavy hitters only for discovery metrics (pem, sfp): a schema-valid k for another
    # metric is rightly a 422.
    "GET /v1/metrics/{name}/heavy-hitters",
    # A task's config has cross-field rules (clients per round within the population, a
    # noise multiplier or a target, an evaluation set that fits the model), and an update
    # must fit the task's model (base64 of num_params float64 values, finite, in norm).
    "POST /v1/federated/tasks",
    "POST /v1/federated/tasks/{name}/updates",
    # A secure aggregation message fits only its round: the roster's neighbours, the
    # ring's length and size, the shares the unmask request asked for.
    *(
        f"POST /v1/federated/tasks/{{name}}/rounds/{{round}}/secagg/{step}"
        for step in ("keys", "shares", "masked", "unmask")
    ),
}

#: The status of a secure round admits device keys as well as analyst keys.
SECAGG_STATUS = "GET /v1/federated/tasks/{name}/rounds/{round}/secagg"


def needed_role(case: schemathesis.Case) -> str | None:
    """The least privileged role the route admits (None: a public route)."""
    path, method = case.operation.path, case.operation.method.upper()
    if path in ("/healthz", "/metrics") or (
        method == "GET" and path in ("/v1/metrics", "/v1/metrics/{name}/versions")
    ):
        return None
    if path == "/v1/reports" or path.endswith(("/round", "/updates")) or "/secagg/" in path:
        return "device"
    if path.endswith(("/estimate", "/series", "/heavy-hitters")) or (
        path.startswith("/v1/federated") and method == "GET"
    ):
        return "analyst"
    return "admin"


def auth_for(case: schemathesis.Case) -> dict[str, str]:
    """A valid key of the least privileged role the route admits (admin on public ones)."""
    return {"Authorization": f"Bearer {KEYS[needed_role(case) or 'admin']}"}


def call_and_validate(case: schemathesis.Case, app: FastAPI) -> None:
    excluded: list[schemathesis.CheckFunction] = []
    if case.operation.label in CROSS_FIELD_RULES:
        excluded.append(positive_data_acceptance)
    case.call_and_validate(app=app, headers=auth_for(case), excluded_checks=excluded)


def _openapi_document() -> dict[str, Any]:
    """The app's OpenAPI document (it does not depend on the data: a scratch database)."""
    with tempfile.TemporaryDirectory() as directory:
        settings = Settings(database=str(Path(directory) / "doc.sqlite3"))
        services = Services.open(settings)
        try:
            return create_app(settings, services).openapi()
        finally:
            services.close()


# Loaded at import: schemathesis' fixture-based lazy loading does not run under pytest 9.
schema = schemathesis.openapi.from_dict(_openapi_document(), config=CONFIG)


def _store_reports(aggregator: Aggregator, rng: np.random.Generator) -> None:
    """``REPORTS_EACH`` reports for the current version of every metric."""
    for metric in aggregator.catalog.latest():
        spec, count = metric.mechanism, REPORTS_EACH
        mechanism = make_mechanism(spec)
        if spec.kind == "categorical":
            reports = mechanism.encode(rng.integers(0, spec.domain_size or 2, count), rng=rng)
        elif spec.kind in ("numeric", "distribution"):
            values = rng.uniform(spec.lower or 0.0, spec.upper or 1.0, count)
            reports = mechanism.encode(values, rng=rng)
        elif (attributes := as_attributes(mechanism)) is not None:
            records = [
                {name: 0 for name in attributes.attribute_names} for _ in range(count)
            ]  # every attribute's first category, or its range's lower end (clipped)
            reports = mechanism.encode(attributes.rows(records), rng=rng)
        else:
            assert isinstance(mechanism, Rappor) and metric.labels is not None
            strings = [metric.labels[i] for i in rng.integers(0, len(metric.labels), count)]
            cohorts = rng.integers(0, spec.num_cohorts or 1, count)
            secrets = [rng.bytes(16) for _ in range(count)]
            reports = mechanism.encode(
                strings, rng=rng, context=DeviceContext(secrets=secrets, cohorts=cohorts)
            )
        dimensions = metric.dimension_set  # a metric with dimensions: cells in turn
        items = [
            {
                "report_id": str(uuid.uuid4()),
                "metric": metric.name,
                "version": metric.version,
                "payload": payload,
            }
            | (
                {"dimensions": dimensions.values_of(i % dimensions.cell_count)}
                if dimensions
                else {}
            )
            for i, payload in enumerate(mechanism.to_payloads(reports))
        ]
        aggregator.ingest(ReportBatch.model_validate({"reports": items}))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    """The app over a SQLite file with the demo metrics, the keys and some reports."""
    settings = Settings(
        database=str(tmp_path_factory.mktemp("fuzz") / "fuzz.sqlite3"),
        min_reports=1,
        compaction_interval=0,
        rate_limit_per_second=1e9,
        rate_limit_burst=10**9,
    )
    services = Services.open(settings)
    services.aggregator.define_missing(DEMO_METRICS)
    for role, key in KEYS.items():
        services.keys.import_key(key, role, "fuzz")  # type: ignore[arg-type]
    _store_reports(services.aggregator, np.random.default_rng(5))
    yield create_app(settings, services)
    services.close()


@schema.parametrize()
@pytest.mark.slow
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case, service: FastAPI) -> None:
    call_and_validate(case, service)


# The routes of one metric again, aimed at the metrics that exist (one of each kind, with
# reports), so that their successful answers are generated and checked as well.
existing = schema.include(path_regex=r"^/v1/metrics/\{name\}/(estimate|versions)$")


@existing.parametrize()
@existing.given(name=st.sampled_from(sorted(DEMO_METRICS)))
def test_routes_of_existing_metrics_conform(
    case: schemathesis.Case, name: str, service: FastAPI
) -> None:
    case.path_parameters = {**(case.path_parameters or {}), "name": name}
    call_and_validate(case, service)


@pytest.mark.parametrize("name", sorted(DEMO_METRICS))
def test_every_kind_of_estimate_conforms(name: str, service: FastAPI) -> None:
    """A categorical, a numeric and a RAPPOR estimate, each checked against the document."""
    response = TestClient(service).get(
        f"/v1/metrics/{name}/estimate",
        params={"version": 1},  # the version the reports were stored under
        headers={"Authorization": f"Bearer {KEYS['analyst']}"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["kind"] == DEMO_METRICS[name].mechanism.kind
    assert body["n"] == REPORTS_EACH
    schema["/v1/metrics/{name}/estimate"]["GET"].validate_response(response)


# --- a real server process, every role -------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("fuzz-server")
    running = start_server(str(directory / "fuzz.sqlite3"), directory)
    yield running
    running.stop()


def refused_by_the_http_server(response: Any) -> bool:
    """uvicorn's own answer to a request line it will not parse (generated queries can run
    to megabytes): a plain-text 400 sent before the application sees the request."""
    return (
        response.status_code == 400
        and response.headers.get("content-type", [""])[0].startswith("text/plain")
        and response.text == "Invalid HTTP request received."
    )


@pytest.mark.slow
@schema.parametrize()
def test_a_served_process_with_every_role(case: schemathesis.Case, server: Server) -> None:
    needed = needed_role(case)
    excluded = [positive_data_acceptance] if case.operation.label in CROSS_FIELD_RULES else []
    for role in ("admin", "analyst", "device", None):
        headers = server.headers(role) if role else {}
        response = case.call(base_url=server.url, headers=headers)
        assert response.status_code < 500, (role, case.operation.label, response.text[:500])
        if refused_by_the_http_server(response):
            continue
        if (
            needed is None
            or role == needed
            or (role == "device" and case.operation.label == SECAGG_STATUS)
        ):
            case.validate_response(response, excluded_checks=excluded)
        elif role != "admin":
            # No key: 401; a key of another role (an admin key is admitted everywhere): 403.
            # A method the route does not have is 405, and a body that does not parse (400)
            # or validate (422) may be refused before authentication.
            # A body past the size limit (413) is refused before authentication too.
            refusals = (401 if role is None else 403, 400, 405, 413, 422)
            assert response.status_code in refusals, (role, case.operation.label, response.text)


def test_the_served_process_survives_and_logs_no_traceback(server: Server) -> None:
    """Runs after the fuzzing (file order): the process still answers, no traceback."""
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_tail(60)
