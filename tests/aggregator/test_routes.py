"""The HTTP layer's assembly: routers per resource, domain errors through one table.

Checks what the split into ``aggregator/routes/`` must keep: the 405 ``Allow`` header and
the request counter see the routes of included routers; each domain error leaves as its
problem document (status, type, title, located field); the table resolves subclasses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator.app import create_app
from aggregator.auth import ENVIRONMENT_LABELS, bootstrap_keys
from aggregator.errors import PROBLEMS, problem_of
from aggregator.service import InvalidMetricError, UnknownMetricError
from aggregator.settings import Settings

ADMIN_KEY = "routes-test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(database=str(tmp_path / "routes.sqlite3"), compaction_interval=0))
    storage = app.state.aggregator.storage
    assert bootstrap_keys(app.state.keys, storage, {"LDP_ADMIN_KEYS": ADMIN_KEY}) is None
    with TestClient(app) as test_client:
        yield test_client


def problem(response: Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{kind}" and body["status"] == status
    return body


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/keys", "GET, POST"),
        ("PUT", "/v1/federated/tasks/demo/round", "GET"),
        ("GET", "/v1/admin/compact", "POST"),
    ],
)
def test_wrong_method_lists_the_methods_of_included_routes(
    client: TestClient, method: str, path: str, allowed: str
) -> None:
    response = client.request(method, path, headers=ADMIN)
    problem(response, 405, "method-not-allowed")
    assert response.headers["allow"] == allowed


def test_request_counter_labels_the_full_route_template(client: TestClient) -> None:
    problem(client.get("/v1/federated/tasks/counted-task"), 401, "unauthorized")
    text = client.get("/metrics").text
    line = re.search(
        r'^ldp_http_requests_total\{route="/v1/federated/tasks/\{name\}",status="401"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    assert line is not None and float(line.group(1)) >= 1


def test_healthz_answers_503_when_storage_is_unreachable(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = client.app.state.aggregator.storage  # type: ignore[attr-defined]

    def unreachable() -> None:
        raise ConnectionError("database down")

    monkeypatch.setattr(storage, "ping", unreachable)
    body = problem(client.get("/healthz"), 503, "storage-unavailable")
    assert body["title"] == "Storage unreachable"
    assert body["detail"] == "the database did not answer"


def test_reserved_key_label_is_refused_and_located(client: TestClient) -> None:
    label = ENVIRONMENT_LABELS["device"]
    response = client.post("/v1/keys", json={"role": "device", "label": label}, headers=ADMIN)
    body = problem(response, 422, "invalid-key-request")
    assert [item["field"] for item in body["errors"]] == ["label"]
    listed = client.get("/v1/keys", headers=ADMIN).json()
    assert all(key["label"] != label or key["role"] == "admin" for key in listed)


def test_metric_body_naming_another_metric_is_refused(client: TestClient) -> None:
    spec = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}
    body_document = {"name": "other", "mechanism": spec}
    response = client.put("/v1/metrics/colour", json=body_document, headers=ADMIN)
    body = problem(response, 422, "invalid-metric")
    assert [item["field"] for item in body["errors"]] == ["name"]
    assert "'other'" in body["detail"] and "'colour'" in body["detail"]
    assert client.get("/v1/metrics").json() == []


def test_unknown_versions_and_unknown_key_are_404(client: TestClient) -> None:
    problem(client.get("/v1/metrics/absent/versions"), 404, "unknown-metric")
    problem(client.delete("/v1/keys/absent", headers=ADMIN), 404, "unknown-key")


def test_problem_table_resolves_subclasses_by_their_nearest_entry() -> None:
    class NarrowerMetricError(InvalidMetricError):
        pass

    found = problem_of(NarrowerMetricError("bad labels"))
    assert (found.status, found.kind, found.errors) == (
        422,
        "invalid-metric",
        [{"field": "name", "message": "bad labels"}],
    )
    assert problem_of(UnknownMetricError("no metric 'x'")).status == 404
    assert ValueError not in PROBLEMS and LookupError not in PROBLEMS
    with pytest.raises(LookupError, match="ValueError"):
        problem_of(ValueError("not a domain error"))
