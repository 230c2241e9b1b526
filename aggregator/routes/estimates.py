"""Estimates over a time window: ``GET /v1/metrics/{name}/estimate`` (debiased, with std and
CI) and ``GET /v1/metrics/{name}/heavy-hitters`` (discovery metrics' most frequent strings)."""

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
from aggregator.estimates import MAX_HEAVY_HITTERS, EstimateOut, HeavyHittersOut
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


#: The window and version of an estimate (``/estimate`` and ``/heavy-hitters``).
WindowStart = Annotated[
    datetime | None,
    BeforeValidator(_date_time_text),
    Query(description="Window start: RFC 3339 date-time with offset (inclusive)."),
]
WindowEnd = Annotated[
    datetime | None,
    BeforeValidator(_date_time_text),
    Query(description="Window end: RFC 3339 date-time with offset (exclusive)."),
]
VersionQuery = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Default: latest.")]


@router.get("/v1/metrics/{name}/estimate", response_model=EstimateOut)
async def estimate(
    name: MetricName,
    principal: Analyst,
    service: Service,
    start: WindowStart = None,
    end: WindowEnd = None,
    version: VersionQuery = None,
    candidates: Annotated[
        list[CandidateString],
        Query(
            max_length=10_000,
            description="String metrics (rappor, cms, hcms, pem, sfp): candidate strings to "
            "estimate (default: the metric's labels).",
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


@router.get("/v1/metrics/{name}/heavy-hitters", response_model=HeavyHittersOut)
async def heavy_hitters(
    name: MetricName,
    principal: Analyst,
    service: Service,
    k: Annotated[
        int, Query(ge=1, le=MAX_HEAVY_HITTERS, description="How many strings to find.")
    ] = 10,
    start: WindowStart = None,
    end: WindowEnd = None,
    version: VersionQuery = None,
) -> Any:
    """The k most frequent strings of a discovery metric (pem, sfp), found without
    candidates, with std and 95% CI; the window and release threshold as for estimates."""
    started = time.perf_counter()
    result = await run_in_threadpool(service.heavy_hitters, name, k, version, start, end)
    obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
    return result
