"""The HTTP layer's assembly: routers per resource, domain errors through one table.

Checks what the split into ``aggregator/routes/`` must keep: the 405 ``Allow`` header and
the request counter see the routes of included routers; each domain error leaves as its
problem document (status, type, title, located field); the table resolves subclasses,
and gives each kind of refused batch or federated request the answer it always had.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from aggregator import federated as fl
from aggregator.app import create_app
from aggregator.auth import ENVIRONMENT_LABELS, bootstrap_keys
from aggregator.errors import PROBLEMS, problem_of
from aggregator.ingest import BatchRejected, BatchTooLargeError, InvalidBatchError
from aggregator.service import InvalidMetricError, UnknownMetricError
from aggregator.settings import Settings

ADMIN_KEY = "routes-test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(database=str(tmp_path / "routes.sqlite3"), compaction_interval=0))
    storage = app.state.services.repositories.keys
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
    storage = client.app.state.services.repositories.database  # type: ignore[attr-defined]

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


#: Each kind of refused batch or federated request: its status, problem type and title.
REFUSALS: list[tuple[type[Exception], int, str, str]] = [
    (InvalidBatchError, 422, "invalid-batch", "The batch has invalid reports; none was stored"),
    (BatchTooLargeError, 413, "too-large", "Batch too large"),
    (fl.UnknownTaskError, 404, "unknown-task", "Unknown task"),
    (fl.InvalidTaskError, 422, "invalid-task", "Invalid task"),
    (fl.TaskExistsError, 409, "task-exists", "Task exists"),
    (fl.TaskFinishedError, 409, "task-finished", "Task finished"),
    (fl.StaleRoundError, 409, "stale-round", "Not the open round"),
    (fl.NotEnoughUpdatesError, 409, "not-enough-updates", "Not enough updates"),
    (fl.InvalidUpdateError, 422, "invalid-update", "Invalid update"),
    (fl.AggregationModeError, 409, "aggregation-mode", "Other aggregation"),
    (fl.TooEarlyError, 425, "too-early", "Step still collecting"),
    (fl.ConflictingMessageError, 409, "conflicting-message", "Conflicting message"),
    (fl.InvalidMessageError, 422, "invalid-message", "Invalid secure aggregation message"),
]


@pytest.mark.parametrize(("kind", "status", "problem_type", "title"), REFUSALS)
def test_refusals_carry_no_status_and_map_to_their_problem(
    kind: type[Exception], status: int, problem_type: str, title: str
) -> None:
    located: list[dict[str, Any]] = [{"field": "round", "message": "expected 2"}]
    if issubclass(kind, BatchRejected):
        located = [{"report": 3, "field": "payload", "message": "bad bits"}]
        error: Exception = kind(located)
        detail = f"{title}: report 3: bad bits"
    else:
        error = kind("why it was refused", located)
        detail = "why it was refused"
    assert not hasattr(error, "status") and not hasattr(error, "title")
    found = problem_of(error)
    assert (found.status, found.kind, found.title) == (status, problem_type, title)
    assert (found.detail, found.errors) == (detail, located)


def test_every_refusal_kind_is_in_the_table() -> None:
    kinds = {kind for kind, *_ in REFUSALS}
    for base in (BatchRejected, fl.FederatedError):
        assert set(base.__subclasses__()) <= kinds and base not in PROBLEMS
