"""Reports: ``POST /v1/reports`` stores a batch exactly once, all or none.

The body is read into one buffer (its declared length allocated once) and validated off
the event loop against ``ReportBatch`` with the service's own ``max_batch_reports`` as
the list's ``max_length``: validation stops at the first report past the limit, so a
body stuffed with reports costs no more than a full batch before it is refused (413).
Validation holds the interpreter lock, so at most ``parallel_validations`` batches are
validated at once (storing them is not limited here). How many bytes a body may have,
and how many may be in progress at once, is ``aggregator/body_limits.py``'s.
"""

from __future__ import annotations

import functools
import threading
import time

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError, create_model

from aggregator import observability as obs
from aggregator.deps import Device, Service, require_device
from aggregator.ingest import BatchRejected, BatchTooLargeError, ReportsRefusedError
from aggregator.quotas import QuotaExceededError
from aggregator.service import Aggregator
from shared.schemas import IngestResult, Report, ReportBatch

router = APIRouter(prefix="/v1/reports", tags=["reports"], dependencies=[Depends(require_device)])


@router.post(
    "",
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
async def post_reports(request: Request, service: Service, device: Device) -> Response:
    """A batch of reports, stored atomically (all or none) and acknowledged after commit.
    A ``report_id`` already accepted is ignored and counted in ``duplicates``."""
    # Async, where the other endpoints are plain functions: it reads the raw body as it
    # streams in (FastAPI's way to get it), into one buffer, on the event loop, and then
    # hands validation and storage to a worker thread itself.
    started = time.perf_counter()
    body = await _read_body(request)
    # Validated and stored off the event loop (which goes on serving other requests
    # meanwhile), in one trip to the thread pool.
    validations = request.app.state.validations
    result = await run_in_threadpool(_ingest, service, body, validations, device.key_id)
    obs.INGEST_SECONDS.observe(time.perf_counter() - started)
    return Response(result.model_dump_json(), media_type="application/json")


async def _read_body(request: Request) -> bytearray:
    """The request body in one buffer: allocated once at its declared length (the body
    limits have checked it), grown as it comes when the body is chunked."""
    declared = request.headers.get("content-length", "")
    body = bytearray(int(declared)) if declared.isdigit() else bytearray()
    filled = 0
    async for chunk in request.stream():
        if filled + len(chunk) <= len(body):
            body[filled : filled + len(chunk)] = chunk
        else:
            del body[filled:]
            body += chunk
        filled += len(chunk)
    del body[filled:]  # a body shorter than declared (the server refuses those first)
    return body


@functools.cache
def batch_model(limit: int) -> type[ReportBatch]:
    """``ReportBatch`` with at most ``limit`` reports, checked while the list is validated."""
    return create_model(
        "ReportBatch",
        __base__=ReportBatch,
        reports=(list[Report], Field(min_length=1, max_length=limit)),
    )


def _ingest(
    service: Aggregator, body: bytearray, validations: threading.BoundedSemaphore, key_id: str
) -> IngestResult:
    """Validate ``body`` as a ``ReportBatch`` and ingest it for the device key ``key_id``,
    counting the outcome (per key too, and refusals per rule and quota).

    A batch over ``max_batch_reports`` raises ``BatchTooLargeError``; a body that is not
    a valid batch, ``RequestValidationError`` (located at ``body``, like FastAPI's own);
    a batch the service refuses, its ``BatchRejected``. The validation waits for one of
    the ``validations`` slots (it holds the interpreter lock throughout; storing does not).
    """
    limit = service.settings.max_batch_reports
    try:
        with validations:
            batch = batch_model(limit).model_validate_json(body)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        too_long = next((e for e in errors if e["type"] == "too_long"), None)
        if too_long is not None and tuple(too_long["loc"]) == ("reports",):
            count = (too_long.get("ctx") or {}).get("actual_length") or f"more than {limit}"
            obs.BATCHES_REJECTED.labels(BatchTooLargeError.reason).inc()
            raise BatchTooLargeError(
                [
                    {
                        "report": None,
                        "field": "reports",
                        "message": f"{count} reports; at most {limit} per batch",
                    }
                ]
            ) from None
        obs.BATCHES_REJECTED.labels("malformed").inc()
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
    try:
        result = service.ingest(batch, key_id=key_id)
    except BatchRejected as rejected:  # counted here, answered by its problem document
        obs.REPORTS_REJECTED.labels(rejected.reason).inc(len(batch.reports))
        obs.BATCHES_REJECTED.labels(rejected.reason).inc()
        if isinstance(rejected, ReportsRefusedError):
            for (metric, rule), reports in rejected.by_rule.items():
                obs.REPORTS_REFUSED_BY_RULE.labels(metric, rule).inc(reports)
        raise
    except QuotaExceededError as over:
        obs.QUOTA_REFUSALS.labels(key_id, over.metric).inc()
        obs.BATCHES_REJECTED.labels("quota").inc()
        raise
    obs.REPORTS_BY_KEY.labels(key_id).inc(result.accepted + result.duplicates)
    obs.REPORTS_ACCEPTED.inc(result.accepted)
    obs.REPORTS_DUPLICATE.inc(result.duplicates)
    return result
