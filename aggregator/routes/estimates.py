"""Estimates over a time window: ``GET /v1/metrics/{name}/estimate`` (debiased, with std and
CI), ``GET /v1/metrics/{name}/series`` (one estimate per hour or day) and
``GET /v1/metrics/{name}/heavy-hitters`` (discovery metrics' most frequent strings).

Each request's work and memory are bounded: a categorical estimate lists a bounded
selection of its categories (``aggregator.value_listing``), a series a bounded number of
values in all, heavy hitters a bounded k; the answer is computed and serialized to JSON
in a worker thread, at most ``Settings.max_concurrent_estimates`` at once (the others
wait their turn, holding nothing), so analyst requests take at most that many times the
memory of one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator, StringConstraints
from pydantic_core import to_json

from aggregator import observability as obs
from aggregator.deps import MetricName, Service, require_analyst
from aggregator.estimates import (
    DEFAULT_QUANTILES,
    DEFAULT_SERIES_STEPS,
    MAX_HEAVY_HITTERS,
    MAX_QUANTILES,
    EstimateOut,
    EstimateView,
    HeavyHittersOut,
    SeriesOut,
    SeriesStepName,
    parse_quantiles,
    parse_range,
)
from aggregator.value_listing import (
    DEFAULT_TOP_VALUES,
    FULL_LIST_DOMAIN,
    MAX_LISTED_VALUES,
    EstimateFormat,
    ValueOrder,
)
from shared.dimensions import MAX_DIMENSIONS, MAX_VALUE_LENGTH
from shared.schemas import MAX_DOMAIN_SIZE, MAX_LABEL_LENGTH

#: Longest dimension name (``shared.dimensions.DIMENSION_NAME``).
DIMENSION_NAME_LENGTH = 32

router = APIRouter(
    prefix="/v1/metrics", tags=["estimates"], dependencies=[Depends(require_analyst)]
)

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


Values = Annotated[
    list[CandidateString],
    Query(
        max_length=MAX_LISTED_VALUES,
        description="Categorical metrics: list exactly these categories, in this order, each "
        "a label of the metric or an index 0..domain_size-1 (a label wins over an index "
        f"it spells); at most {MAX_LISTED_VALUES:,}, no repeats. Not with order, offset, "
        "limit or format=vectors.",
    ),
]
Order = Annotated[
    ValueOrder | None,
    Query(
        description="Categorical metrics: list a page of the categories in 'index' order, "
        "or by 'frequency': the largest unbiased estimates first (ties by index). Default: "
        f"index up to {FULL_LIST_DOMAIN:,} categories (and for format=vectors), else "
        "frequency."
    ),
]
Offset = Annotated[
    int,
    Query(
        ge=0,
        le=MAX_DOMAIN_SIZE,
        description="Categorical metrics: the page's first position in that order, below "
        "domain_size (each answer gives the next page's as next_offset).",
    ),
]
Limit = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_DOMAIN_SIZE,
        description=f"Categorical metrics: the most categories listed, at most "
        f"{MAX_LISTED_VALUES:,} for format=json. Default: every one up to "
        f"{FULL_LIST_DOMAIN:,} categories (and for format=vectors), else the "
        f"{DEFAULT_TOP_VALUES:,} largest estimates (the answer then says partial=true).",
    ),
]
Format = Annotated[
    EstimateFormat,
    Query(
        description="Categorical metrics: 'json' lists an object per category; 'vectors' "
        "answers a page in index order (default: the whole vector, up to 2^20 categories) "
        "as base64 float32 vectors in the field vectors, estimates and postprocessed "
        "empty: 16 bytes per category instead of about 230."
    ),
]

Quantiles = Annotated[
    str | None,
    Query(
        description="Distribution metrics (hh, sw): the quantile levels to estimate, "
        f"comma-separated, e.g. 0.5,0.95; at most {MAX_QUANTILES}, each strictly between 0 "
        f"and 1, no repeats. Default: {','.join(f'{q:g}' for q in DEFAULT_QUANTILES)}.",
    ),
]
Range = Annotated[
    str | None,
    Query(
        alias="range",
        description="Distribution metrics (hh, sw): LOW,HIGH in value units, e.g. 10,250: "
        "the share of values in [LOW, HIGH), its ends snapped to the nearest bucket edges "
        "(they must snap to different edges).",
    ),
]


Where = Annotated[
    list[Annotated[str, StringConstraints(min_length=3, max_length=MAX_VALUE_LENGTH + 33)]],
    Query(
        max_length=MAX_DIMENSIONS,
        description="Metrics with dimensions: keep only the reports whose dimension NAME has "
        "VALUE, as NAME:VALUE (split at the first ':'); repeatable, one per dimension "
        "(where=platform:ios&where=version:2.0: cells matching all). The answer echoes them "
        "in where.",
    ),
]
By = Annotated[
    str | None,
    Query(
        max_length=(DIMENSION_NAME_LENGTH + 1) * MAX_DIMENSIONS,
        description="Metrics with dimensions: NAME or NAME1,NAME2 (distinct dimensions, not "
        "also in where): add one estimate per combination of their values (groups, each "
        "exactly what where=<its values> answers; withheld_groups counts those holding "
        "reports but no time bucket at the release threshold).",
    ),
]


def _parsed(parameter: str, text: str | None, parse: Callable[[str], object]) -> Any:
    """``parse(text)`` (None for None), or a 422 naming the query ``parameter`` and what
    was wrong, as for any other invalid parameter."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as error:
        problem = {"type": "value_error", "loc": ("query", parameter), "msg": str(error)}
        raise RequestValidationError([problem | {"input": text}]) from None


def _view(
    values: list[str],
    order: ValueOrder | None,
    offset: int,
    limit: int | None,
    format: EstimateFormat,
    quantiles: str | None,
    value_range: str | None,
) -> EstimateView:
    """The request's ``EstimateView``: its categories, quantile levels and range."""
    return EstimateView(
        tuple(values),
        order,
        offset,
        limit,
        format,
        quantiles=_parsed("quantiles", quantiles, parse_quantiles),
        range=_parsed("range", value_range, parse_range),
    )


async def _bounded(request: Request, work: Callable[[], dict[str, object]]) -> Response:
    """``work``'s answer as JSON (non-finite numbers as null), computed and serialized in a
    worker thread, at most ``max_concurrent_estimates`` at once (the others wait).

    This is why the endpoints here are async where the others are plain functions: a
    request waiting its turn waits on the event loop, holding no worker thread, and
    FastAPI's own thread pool has no such bound.
    """
    state = request.app.state
    if getattr(state, "estimate_limiter", None) is None:
        settings = state.aggregator.settings
        state.estimate_limiter = anyio.CapacityLimiter(settings.max_concurrent_estimates)

    def answer() -> bytes:
        return to_json(work(), inf_nan_mode="null")

    started = time.perf_counter()
    body = await anyio.to_thread.run_sync(answer, limiter=state.estimate_limiter)
    obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
    return Response(body, media_type="application/json")


@router.get("/{name}/estimate", response_model=EstimateOut)
async def estimate(
    request: Request,
    name: MetricName,
    service: Service,
    start: WindowStart = None,
    end: WindowEnd = None,
    version: VersionQuery = None,
    candidates: Candidates = [],  # noqa: B006 - FastAPI copies defaults per request
    values: Values = [],  # noqa: B006
    order: Order = None,
    offset: Offset = 0,
    limit: Limit = None,
    format: Format = "json",
    quantiles: Quantiles = None,
    value_range: Range = None,
    where: Where = [],  # noqa: B006
    by: By = None,
) -> Response:
    """Debiased estimate of one metric version over a time window, with std and 95% CI.

    For a metric with dimensions, ``where=NAME:VALUE`` (repeatable) keeps the matching
    cells and ``by=NAME[,NAME2]`` adds ``groups``: one estimate per combination of those
    dimensions' values, each exactly what ``where=`` its values answers. The release
    threshold applies per time bucket and cell. An unknown dimension or value, a repeat,
    or either parameter on a metric without dimensions is refused (422, naming the
    parameter and the dimension).

    A categorical metric of up to 4,096 categories lists every one, in index order. A
    larger one lists its 1,000 largest unbiased estimates by default, largest first
    (``partial`` is then true, and ``domain_size`` says how many categories there are);
    ``values`` lists chosen categories, ``order`` with ``offset`` and ``limit`` pages
    through them (at most 10,000 per answer), and ``format=vectors`` answers a page in
    index order, by default the whole vector, as base64 float32 vectors. The estimate is
    always of the whole domain: the post-processed distribution is the projection of the
    whole vector, whatever is listed. A combination that cannot be served is refused (422)
    and says what to change.

    A distribution metric (hh, sw) lists its histogram (one item per value bucket) and CDF
    (one per edge), with unbiased shares, std, 95% intervals and the post-processed valid
    distribution; the ``quantiles`` levels asked for (default 0.5, 0.9, 0.95, 0.99), each
    a point from the post-processed CDF and an interval by test inversion of the CDF's
    pointwise one-sided bounds at the edges, in whole buckets; and with ``range=LOW,HIGH``
    the share of values between the edges nearest LOW and HIGH.
    """
    view = _view(values, order, offset, limit, format, quantiles, value_range)
    return await _bounded(
        request,
        lambda: service.estimate(
            name, version, start, end, candidates or None, view, where=where, by=by
        ),
    )


@router.get("/{name}/series", response_model=SeriesOut)
async def series(
    request: Request,
    name: MetricName,
    service: Service,
    step: Annotated[
        SeriesStepName, Query(description="Step: one hour (1h) or one UTC day (1d).")
    ] = "1h",
    start: SeriesStart = None,
    end: SeriesEnd = None,
    version: VersionQuery = None,
    candidates: Candidates = [],  # noqa: B006 - FastAPI copies defaults per request
    values: Values = [],  # noqa: B006
    order: Order = None,
    offset: Offset = 0,
    limit: Limit = None,
    quantiles: Quantiles = None,
    value_range: Range = None,
    where: Where = [],  # noqa: B006
    by: By = None,
) -> Response:
    """One estimate per step (a UTC hour or day) of one metric version over a range.

    ``where`` and ``by`` as for the estimate: each step's estimate carries its groups; the
    100,000 values below count each group's values too, and with ``by`` steps times groups
    is at most 2,400.

    The range is widened to whole steps on the UTC grid; every step of it is listed,
    oldest first, with its report count ``n`` and ``estimate``: exactly what
    ``GET /v1/metrics/{name}/estimate`` answers for that step's window, version and
    categories (``values``, ``order``, ``offset``, ``limit``: by default every one of up
    to 4,096 categories, else each step's 1,000 largest), or null when no time bucket of
    the step holds ``min_reports`` reports (the release threshold, as for estimates). A
    series is of one version (``version=``; default the current one): steps before the
    version existed, or after another replaced it, hold none of its reports (n = 0), and
    the reports of other versions are never mixed in.

    At most 2,400 steps, and at most 100,000 listed values in all (steps times listed
    categories, counted twice for the post-processed distribution, candidate strings,
    quantiles (plus one for a range), or one mean), whatever the number of steps; a larger
    request is refused (422) and says what to narrow. The stored statistics of the range
    are read once: the cost grows with the steps and time buckets, not with the reports.

    A distribution metric's steps carry its quantiles (``quantiles``) and range share
    (``range``), with the histogram and CDF left empty: ask the estimate endpoint for one
    step's histogram.
    """
    view = _view(values, order, offset, limit, "json", quantiles, value_range)
    # Sent as built: the series holds every field of SeriesOut already, and validating
    # thousands of estimates again would take longer than computing them.
    return await _bounded(
        request,
        lambda: service.series(
            name, step, version, start, end, candidates or None, view=view, where=where, by=by
        ),
    )


@router.get("/{name}/heavy-hitters", response_model=HeavyHittersOut)
async def heavy_hitters(
    request: Request,
    name: MetricName,
    service: Service,
    k: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_HEAVY_HITTERS,
            description=f"How many strings to find (at most {MAX_HEAVY_HITTERS}).",
        ),
    ] = 10,
    start: WindowStart = None,
    end: WindowEnd = None,
    version: VersionQuery = None,
    where: Where = [],  # noqa: B006
) -> Response:
    """The k most frequent strings of a discovery metric (pem, sfp), found without
    candidates, with std and 95% CI; the window, release threshold and ``where`` filters
    as for estimates."""
    return await _bounded(
        request, lambda: service.heavy_hitters(name, k, version, start, end, where=where)
    )
