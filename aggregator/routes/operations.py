"""Operations: liveness (``/healthz``), Prometheus metrics (``/metrics``), compaction now."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from aggregator import observability as obs
from aggregator.deps import Admin, Service

router = APIRouter(tags=["operations"])


class Health(BaseModel):
    status: str
    storage: str


class Compaction(BaseModel):
    groups: int
    rows_merged: int


@router.get("/healthz")
def healthz(service: Service) -> Health:
    """Liveness, storage reachability and the writer's ability to commit.

    503 (``storage-unavailable``, with ``Retry-After``) when the database does not answer
    within the database timeout, when a commit has been waiting for it more than twice
    that, or when a commit failed on unavailable storage (unreachable, full) in the last
    30 s and none has succeeded since; the detail says which.
    """
    return Health(status="ok", storage=service.ping())


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def prometheus() -> Response:
    """Prometheus metrics: reports accepted, duplicates, rejected by reason, latencies."""
    body, content_type = obs.exposition()
    return Response(body, media_type=content_type)


@router.post("/v1/admin/compact")
def compact(principal: Admin, service: Service) -> Compaction:
    """Merge the partial statistics now (it also runs in the background)."""
    result = service.compact()
    return Compaction(groups=result.groups, rows_merged=result.rows_merged)
