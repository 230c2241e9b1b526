"""Estimates over a time window: ``GET /v1/metrics/{name}/estimate`` (debiased, with std and
CI), ``GET /v1/metrics/{name}/series`` (one estimate per hour or day) and
``GET /v1/metrics/{name}/heavy-hitters`` (discovery metrics' most frequent strings)."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BeforeValidator, StringConstraints
from pydantic_core import to_json

from aggregator import observability as obs
from aggregator.deps import Analyst, MetricName, Service
from aggregator.estimates import (
    DEFAULT_SERIES_STEPS,
    MAX_HEAVY_HITTERS,
    EstimateOut,
    HeavyHittersOut,
    SeriesOut,
    SeriesStepName,
)
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
#: The range of a series: widened to whole steps.
SeriesStart = Annotated[
    datetime | None,
    BeforeValidator(_date_time_text),
    Query(
        description="Range start: RFC 3339 date-time with offset, rounded down to its step "
        f"(default: {DEFAULT_SERIES_STEPS['1h']} steps of 1h, or "
        f"{DEFAULT_SERIES_STEPS['1d']} of 1d, before the end)."
    ),
]
SeriesEnd = Annotated[
    datetime | None,
    BeforeValidator(_date_time_text),
    Query(
        description="Range end: RFC 3339 date-time with offset, rounded up to its step "
        "(exclusive; default: now, so the current step is the last)."
    ),
]
Candidates = Annotated[
    list[CandidateString],
    Query(
        max_length=10_000,
        description="String metrics (rappor, cms, hcms, pem, sfp): candidate strings to "
        "estimate (default: the metric's labels).",
    ),
]


@router.get("/v1/metrics/{name}/estimate", response_model=EstimateOut)
async def estimate(
    name: MetricName,
    principal: Analyst,
    service: Service,
    start: WindowStart = None,
    end: WindowEnd = None,
    version: VersionQuery = None,
    candidates: Candidates = [],  # noqa: B006 - FastAPI copies defaults per request
) -> Any:
    """Debiased estimate of one metric version over a time window, with std and 95% CI."""
    started = time.perf_counter()
    result = await run_in_threadpool(
        service.estimate, name, version, start, end, candidates or None
    )
    obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
    return result


@router.get("/v1/metrics/{name}/series", response_model=SeriesOut)
async def series(
    name: MetricName,
    principal: Analyst,
    service: Service,
    step: Annotated[
        SeriesStepName, Query(description="Step: one hour (1h) or one UTC day (1d).")
    ] = "1h",
    start: SeriesStart = None,
    end: SeriesEnd = None,
    version: VersionQuery = None,
    candidates: Candidates = [],  # noqa: B006 - FastAPI copies defaults per request
) -> Any:
    """One estimate per step (a UTC hour or day) of one metric version over a range.

    The range is widened to whole steps on the UTC grid; every step of it is listed,
    oldest first, with its report count ``n`` and ``estimate``: exactly what
    ``GET /v1/metrics/{name}/estimate`` answers for that step's window and version, or
    null when no time bucket of the step holds ``min_reports`` reports (the release
    threshold, as for estimates). A series is of one version (``version=``; default the
    current one): steps before the version existed, or after another replaced it, hold
    none of its reports (n = 0), and the reports of other versions are never mixed in.

    At most 2,400 steps, and at most 100,000 estimated values (steps times categories,
    counted twice for the post-processed distribution, candidate strings, or one mean)
    unless the range is one step; a larger request is refused (422) and says so. The
    stored statistics of the range are read once: the cost grows with the steps and
    time buckets, not with the reports.
    """
    started = time.perf_counter()
    result = await run_in_threadpool(
        service.series, name, step, version, start, end, candidates or None
    )
    obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
    # Sent as built: the series holds every field of SeriesOut already, and validating
    # thousands of estimates again would take longer than computing them.
    return Response(to_json(result, inf_nan_mode="null"), media_type="application/json")


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
