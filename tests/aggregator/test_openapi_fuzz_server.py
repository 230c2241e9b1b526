"""Fuzzing a real ``ldp-aggregator serve`` process from its own OpenAPI document.

The in-process fuzz (``test_openapi_fuzz.py``) checks the app; this one checks what a
client meets over the network: uvicorn, the process's start-up, its background work
(compaction, the federated ticker) and the demo metrics it defines. Every operation of
the served document gets seeded, generated requests, each sent once with a key of every
role (admin, analyst, device) and once with none. With the role the route needs,
schemathesis' checks apply (no 5xx; status codes, content types, headers and bodies as
documented); with any other key or none, the answer must be a documented refusal, never
a server error. At the end the process must still be serving and its log free of
tracebacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from simulations.server import Server, start_server

ROLES = ("admin", "analyst", "device")
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20_261_124,
        "generation": {"max-examples": 8, "deterministic": True, "database": "none"},
    }
)
#: Operations with cross-field rules a JSON schema cannot state (see test_openapi_fuzz.py):
#: a schema-valid request may rightly get 422 there.
CROSS_FIELD_RULES = {
    "PUT /v1/metrics/{name}",
    "POST /v1/reports",
    "GET /v1/metrics/{name}/estimate",
    "POST /v1/federated/tasks",
    "POST /v1/federated/tasks/{name}/updates",
}


def _serve(directory: Path) -> Server:
    return start_server(str(directory / "fuzz.sqlite3"), directory)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = _serve(tmp_path_factory.mktemp("fuzz-server"))
    yield running
    running.stop()


def _document() -> dict[str, object]:
    """The served document, read from a short-lived process (it depends on no data)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory, _serve(Path(directory)) as scratch:
        return httpx.get(f"{scratch.url}/openapi.json", timeout=10).json()


# Loaded at import: schemathesis' fixture-based lazy loading does not run under pytest 9.
schema = schemathesis.openapi.from_dict(_document(), config=CONFIG)


def needed_role(case: schemathesis.Case) -> str | None:
    """The least privileged role the route admits (None: a public route)."""
    path, method = case.operation.path, case.operation.method.upper()
    if path in ("/healthz", "/metrics", "/openapi.json") or (
        method == "GET" and path in ("/v1/metrics", "/v1/metrics/{name}/versions")
    ):
        return None
    if path == "/v1/reports" or path.endswith(("/round", "/updates")):
        return "device"
    if path.endswith("/estimate") or (path.startswith("/v1/federated") and method == "GET"):
        return "analyst"
    return "admin"


def refused_by_the_http_server(response: Any) -> bool:
    """uvicorn's own answer to a request line it will not parse (generated queries can run
    to megabytes): a plain-text 400 sent before the application sees the request."""
    return (
        response.status_code == 400
        and response.headers.get("content-type", [""])[0].startswith("text/plain")
        and response.text == "Invalid HTTP request received."
    )


@schema.parametrize()
def test_every_operation_with_every_role(case: schemathesis.Case, server: Server) -> None:
    needed = needed_role(case)
    excluded = [positive_data_acceptance] if case.operation.label in CROSS_FIELD_RULES else []
    for role in (*ROLES, None):
        headers = server.headers(role) if role else {}
        response = case.call(base_url=server.url, headers=headers)
        assert response.status_code < 500, (role, case.operation.label, response.text[:500])
        if refused_by_the_http_server(response):
            continue
        if needed is None or role == needed:
            case.validate_response(response, excluded_checks=excluded)
            continue
        # No key: 401; a key of another role (an admin key is admitted everywhere): 403.
        # A method the route does not have is 405, and a body that does not parse (400) or
        # validate (422) may be refused before authentication.
        if role != "admin":
            refusals = (401 if role is None else 403, 400, 405, 422)
            assert response.status_code in refusals, (role, case.operation.label, response.text)


def test_the_process_survives_and_logs_no_traceback(server: Server) -> None:
    """Runs after the fuzzing (file order): the process still answers, no traceback."""
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_tail(60)
