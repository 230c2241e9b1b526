"""Estimates: ``GET /v1/metrics/{name}/estimate``, debiased, over a time window."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import BeforeValidator, StringConstraints

from aggregator import observability as obs
from aggregator.deps import Analyst, MetricName, Service
from aggregator.estimates import EstimateOut
from shared.schemas import MAX_LABEL_LENGTH

router = APIRouter(tags=["estimates"])

#: A date and a time with seconds (fraction optional) and a UTC offset or Z.
RFC3339_DATE_TIME = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
)
CandidateString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_LENGTH)]


def _date_time_text(value: object) -> object:
    """Refuse numbers (pydantic would read them as Unix seconds): windows are date-times."""
    if isinstance(value, str) and not RFC3339_DATE_TIME.match(value):
        raise ValueError("expected an RFC 3339 date-time such as 2026-11-22T10:00:00Z")
    return value


@router.get("/v1/metrics/{name}/estimate", response_model=EstimateOut)
async def estimate(
    name: MetricName,
    principal: Analyst,
    service: Service,
    start: Annotated[
        datetime | None,
        BeforeValidator(_date_time_text),
        Query(description="Window start: RFC 3339 date-time with offset (inclusive)."),
    ] = None,
    end: Annotated[
        datetime | None,
        BeforeValidator(_date_time_text),
        Query(description="Window end: RFC 3339 date-time with offset (exclusive)."),
    ] = None,
    version: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="Default: latest.")
    ] = None,
    candidates: Annotated[
        list[CandidateString],
        Query(
            max_length=10_000,
            description="RAPPOR: candidate strings to decode (default: the metric's labels).",
        ),
    ] = [],  # noqa: B006 - FastAPI copies defaults per request
) -> Any:
    """Debiased estimate of one metric version over a time window, with std and 95% CI."""
    started = time.perf_counter()
    result = await run_in_threadpool(
        service.estimate, name, version, start, end, candidates or None
    )
    obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
    return result
