"""Reports: ``POST /v1/reports`` stores a batch exactly once, all or none."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from aggregator import observability as obs
from aggregator.deps import Device, Service
from aggregator.ingest import BatchRejected
from aggregator.service import Aggregator
from shared.schemas import IngestResult, ReportBatch

router = APIRouter(tags=["reports"])


@router.post(
    "/v1/reports",
    response_model=IngestResult,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}
            },
        }
    },
)
async def post_reports(request: Request, principal: Device, service: Service) -> Response:
    """A batch of reports, stored atomically (all or none) and acknowledged after commit.
    A ``report_id`` already accepted is ignored and counted in ``duplicates``."""
    started = time.perf_counter()
    body = await request.body()
    # Validated and stored off the event loop (which goes on serving other requests
    # meanwhile), in one trip to the thread pool.
    result = await run_in_threadpool(_ingest, service, body)
    obs.INGEST_SECONDS.observe(time.perf_counter() - started)
    return Response(result.model_dump_json(), media_type="application/json")


def _ingest(service: Aggregator, body: bytes) -> IngestResult:
    """Validate ``body`` as a ``ReportBatch`` and ingest it, counting the outcome.

    A body that is not a valid batch raises ``RequestValidationError`` (located at
    ``body``, like FastAPI's own); a batch the service refuses, its ``BatchRejected``.
    """
    try:
        batch = ReportBatch.model_validate_json(body)
    except ValidationError as error:
        obs.BATCHES_REJECTED.labels("malformed").inc()
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        ) from None
    try:
        result = service.ingest(batch)
    except BatchRejected as rejected:  # counted here, answered by its problem document
        obs.REPORTS_REJECTED.labels(rejected.reason).inc(len(batch.reports))
        obs.BATCHES_REJECTED.labels(rejected.reason).inc()
        raise
    obs.REPORTS_ACCEPTED.inc(result.accepted)
    obs.REPORTS_DUPLICATE.inc(result.duplicates)
    return result
