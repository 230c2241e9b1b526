"""The analyst dashboard, ``/ui/``: server-rendered pages over the JSON API.

* ``/ui/``: every metric's public privacy promise (mechanism, epsilon, domain, version;
  for memoized metrics and RAPPOR the lifetime bound) and the service's health;
* ``/ui/metrics/{name}``: one metric's promise and versions; with a key, its estimate
  over a window (bars with 95% interval whiskers and the post-processed distribution, a
  mean with its intervals, candidate strings or heavy hitters; for a distribution metric
  its histogram with the quantiles p50, p95 and p99 marked, their table and the share of
  a range of values asked in a form) and the series of that window, with its band (a
  band for each quantile of a distribution) and the reports per step. A metric with
  public dimensions lists them in its promise (said to be sent in the clear) and can be
  broken down by one of them and filtered by each (``estimate?by=NAME&where=NAME:VALUE``):
  per group the frequencies with their intervals (bars grouped by category and a table),
  the means or the quantiles p50, p95 and p99 with theirs, and the groups the release
  threshold withholds said in words. A multi-attribute metric (kind "attributes") shows
  a chart per attribute (bars with whiskers, or a mean with its interval) and per declared
  pair a heat map of the joint distribution (coloured by the post-processed share, each
  cell with the unbiased share and its interval), its cells as a table and the
  conditional shares in the direction chosen;
* ``/ui/federated`` and ``/ui/federated/{name}``: the training tasks; one task's
  evaluation and epsilon spent per round (with a key).

The pages are Jinja2 templates (``aggregator/ui/templates``, autoescaped: metric names,
labels and descriptions are admin input and are always rendered as text) that hold
only what is public; the estimates, series and tasks are fetched by the page's own
scripts (``aggregator/ui/static``) from the JSON API with the analyst key. The key is
typed into the page, kept in the tab's ``sessionStorage`` and sent as an
``Authorization: Bearer`` header: never in a URL, a cookie or a log (the key field has
no ``name``, so even a form submitted without scripts carries nothing). Every response
under ``/ui`` carries a Content-Security-Policy that admits scripts, styles and
connections from this origin only (no inline script or style, no other host), so the
dashboard works on an offline network and an injected tag could not run. Charts are
drawn by Chart.js, shipped unmodified in ``aggregator/ui/static/vendor`` (its version,
licence and checksum are in ``VERSIONS.txt`` there). Every axis is titled, with the
metric's ``unit`` where it declares one; a chart with nothing to show (no report in the
window, no round closed yet) gives way to a short message in its box.

The pages are routes of their own ``APIRouter`` (``PageRoute``), outside the OpenAPI
document, which describes the JSON API: their names and versions are typed parameters
(the API's name pattern, a positive integer), and an address that fails them, like a
metric or version that does not exist, is answered with the HTML "not found" page.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aggregator.deps import MetricName, TaskName
from aggregator.service import Aggregator, StorageUnavailableError
from shared.mechanisms import (
    Mechanism,
    as_categorical,
    as_memoized,
    as_numeric,
    make_mechanism,
)
from shared.mechanisms.spec import as_distribution_spec
from shared.schemas import MetricSpec

__all__ = ["CONTENT_SECURITY_POLICY", "UI_PREFIX", "add_dashboard_assets", "router"]

UI_PREFIX = "/ui"
STATIC_URL = f"{UI_PREFIX}/static"
#: What the dashboard's pages may load and where they may send: this origin only.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "form-action 'self'",
    )
)
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode())
    for name, value in (
        ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("X-Frame-Options", "DENY"),
        ("Cross-Origin-Opener-Policy", "same-origin"),
    )
)
_SECURITY_HEADER_NAMES = frozenset(name.lower() for name, _ in SECURITY_HEADERS)
#: Labels of a categorical metric listed in its domain before the rest are counted.
LISTED_LABELS = 12


def ui_directory() -> Path:
    """The installed ``aggregator/ui`` directory (templates and static assets)."""
    return Path(str(files("aggregator") / "ui"))


TEMPLATES = Environment(
    loader=FileSystemLoader(ui_directory() / "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class PrivacyPromise:
    """A metric version's public promise, as the pages show it."""

    name: str
    version: int
    description: str
    #: The unit of the metric's values, shown beside them (None: a plain number).
    unit: str | None
    kind: str
    mechanism: str
    #: The mechanism ``auto`` resolved to (None for the others).
    resolved: str | None
    epsilon: float
    #: What ``epsilon`` bounds: one report, or every report of one value (memoized).
    epsilon_meaning: str
    #: Memoized mechanisms: what one report reveals; RAPPOR: its one-report epsilon.
    epsilon_report: float | None
    #: Memoized mechanisms and RAPPOR: what any number of reports of one value reveal.
    lifetime: float | None
    domain: str
    labels: tuple[str, ...]
    more_labels: int
    parameters: tuple[tuple[str, object], ...]
    #: The public dimensions, in declaration order: (name, allowed values).
    dimensions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: A multi-attribute metric's attributes and declared pairs, in words.
    attributes: tuple[str, ...] = ()
    pairs: tuple[str, ...] = ()

    @classmethod
    def of(cls, metric: MetricSpec, mechanism: Mechanism[Any]) -> PrivacyPromise:
        spec = metric.mechanism
        lifetime: float | None = None
        epsilon_report: float | None = None
        meaning = "lifetime bound per distinct value" if spec.is_memoized else "per report"
        if (lifelong := as_memoized(mechanism)) is not None:
            lifetime, epsilon_report = lifelong.epsilon_lifetime, lifelong.epsilon_report
        resolved = mechanism.name
        labels = tuple(metric.labels or ())
        shown = spec.model_dump(exclude={"mechanism", "epsilon", "epsilon_report"})
        attributes, pairs = _attributes(shown) if spec.kind == "attributes" else ((), ())
        if spec.kind == "attributes":
            shown = {k: v for k, v in shown.items() if k not in ("attributes", "pairs")}
        return cls(
            name=metric.name,
            version=metric.version,
            description=metric.description,
            unit=metric.unit,
            kind=spec.kind,
            mechanism=spec.mechanism,
            resolved=resolved if resolved != spec.mechanism else None,
            epsilon=spec.epsilon,
            epsilon_meaning=meaning,
            epsilon_report=epsilon_report,
            lifetime=lifetime,
            domain=_domain(metric, mechanism),
            labels=labels[:LISTED_LABELS],
            more_labels=max(0, len(labels) - LISTED_LABELS),
            parameters=tuple(sorted(shown.items())),
            dimensions=tuple(
                (name, tuple(values)) for name, values in (metric.dimensions or {}).items()
            ),
            attributes=attributes,
            pairs=pairs,
        )


def _attributes(spec: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A multi-attribute spec's attributes ("theme: 3 categories (light, dark, auto)",
    "minutes: numbers in [0, 120]") and declared pairs ("theme × font"), in words."""
    described = []
    for attribute in spec.get("attributes") or ():
        name, size = attribute["name"], attribute.get("domain_size")
        if size is None:
            lower, upper = attribute["lower"], attribute["upper"]
            described.append(f"{name}: numbers in [{lower:g}, {upper:g}]")
            continue
        labels = list(attribute.get("labels") or ())
        listed = ", ".join(labels[:LISTED_LABELS]) + (", …" if len(labels) > LISTED_LABELS else "")
        described.append(f"{name}: {size} categories" + (f" ({listed})" if labels else ""))
    pairs = tuple(f"{first} × {second}" for first, second in spec.get("pairs") or ())
    return tuple(described), pairs


def _domain(metric: MetricSpec, mechanism: Mechanism[Any]) -> str:
    """The values a metric takes, in words."""
    if metric.mechanism.kind == "attributes":
        count = len(metric.mechanism.model_dump().get("attributes") or ())
        return f"{count} private attributes in one report"
    if (categories := as_categorical(mechanism)) is not None:
        return f"{categories.domain_size} categories"
    unit = f" {metric.unit}" if metric.unit else ""
    if (numbers := as_numeric(mechanism)) is not None:
        return f"numbers clipped to [{numbers.lower:g}, {numbers.upper:g}]{unit}"
    if (spec := as_distribution_spec(metric.mechanism)) is not None:
        return (
            f"numbers clipped to [{spec.lower:g}, {spec.upper:g}]{unit}, "
            f"in {spec.bucket_count} buckets ({spec.scale} scale)"
        )
    count = len(metric.labels or ())
    candidates = f"{count or 'no'} candidate string{'s' * (count != 1)}"
    longest = getattr(metric.mechanism, "max_length", None)  # pem, sfp: the longest string
    if longest is not None:
        return f"strings of up to {longest} bytes; {candidates}"
    return f"strings; {candidates}"


def _epsilon(value: float | None) -> str:
    """An epsilon for people: ``1.5``, ``0.693``, or ``∞``."""
    if value is None:
        return ""
    return "∞" if math.isinf(value) else f"{value:.4g}"


TEMPLATES.filters["epsilon"] = _epsilon


@dataclass(frozen=True)
class Health:
    status: str
    storage: str
    metrics: int
    checked_at: str


def _health(service: Aggregator) -> Health:
    """The storage's answer (never raising: unreachable is a state to show)."""
    try:
        status, storage = "ok", service.ping()
    except StorageUnavailableError:
        status, storage = "unreachable", "did not answer"
    return Health(
        status=status,
        storage=storage,
        metrics=len(service.catalog.latest()),
        checked_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )


def _render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    base = str(request.scope.get("root_path", "")).rstrip("/")
    page = TEMPLATES.get_template(template).render(
        base=base, static=f"{base}{STATIC_URL}", **context
    )
    return HTMLResponse(page, status_code=status, headers={"Cache-Control": "no-cache"})


def _service(request: Request) -> Aggregator:
    service: Aggregator = request.app.state.aggregator
    return service


def _promises(service: Aggregator, metrics: list[MetricSpec]) -> list[PrivacyPromise]:
    promises = []
    for metric in metrics:
        mechanism = service.catalog.mechanism(metric.name, metric.version)
        promises.append(PrivacyPromise.of(metric, mechanism or make_mechanism(metric.mechanism)))
    return promises


class PageRoute(APIRoute):
    """A dashboard page: a path or query parameter that fails its type names a page that
    does not exist, so it is answered with the "not found" page (404, HTML), not with the
    JSON API's problem document. The route's ``name`` says what the page shows ("metric",
    "task")."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        subject = self.name

        async def page_or_missing(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                return await _missing(request, _named(subject, request))

        return page_or_missing


router = APIRouter(prefix=UI_PREFIX, route_class=PageRoute, include_in_schema=False)

#: A metric version in a page's query; absent: the current version.
PageVersion = Annotated[int | None, Query(ge=1, le=2**31 - 1)]


def _named(subject: str, request: Request) -> str:
    """What a page's address asks for, in words: "metric colour version 7"."""
    what = f"{subject} {request.path_params.get('name', '')}".rstrip()
    version = request.query_params.get("version")
    return what if version is None else f"{what} version {version}"


async def _missing(request: Request, what: str) -> HTMLResponse:
    health = await run_in_threadpool(_health, _service(request))
    return _render(request, "missing.html", 404, page="missing", what=what, health=health)


@router.get("/", name="overview", response_class=HTMLResponse)
async def overview(request: Request) -> HTMLResponse:
    """Every metric's privacy promise, and the service's health."""
    service = _service(request)

    def gather() -> tuple[list[PrivacyPromise], Health]:
        return _promises(service, service.catalog.latest()), _health(service)

    promises, health = await run_in_threadpool(gather)
    return _render(request, "overview.html", page="overview", metrics=promises, health=health)


@router.get("/metrics/{name}", name="metric", response_class=HTMLResponse)
async def metric_page(
    request: Request, name: MetricName, version: PageVersion = None
) -> HTMLResponse:
    """One metric version's promise and versions; the page's script adds its estimates."""
    service = _service(request)

    def gather() -> tuple[list[PrivacyPromise], Health]:
        return _promises(service, service.catalog.versions(name)), _health(service)

    versions, health = await run_in_threadpool(gather)
    wanted = versions[-1:] if version is None else [p for p in versions if p.version == version]
    if not wanted:
        return await _missing(request, _named("metric", request))
    return _render(
        request,
        "metric.html",
        page="metric",
        metric=wanted[0],
        versions=versions,
        latest=versions[-1].version,
        health=health,
    )


@router.get("/federated", name="federated", response_class=HTMLResponse)
async def federated_page(request: Request) -> HTMLResponse:
    """The federated tasks; the page's script lists them with the analyst key."""
    health = await run_in_threadpool(_health, _service(request))
    return _render(request, "federated.html", page="federated", health=health)


@router.get("/federated/{name}", name="task", response_class=HTMLResponse)
async def task_page(request: Request, name: TaskName) -> HTMLResponse:
    """One federated task; its status is fetched by the page's script with the key (a
    task's existence is not public, so the page is the same for any well-formed name)."""
    health = await run_in_threadpool(_health, _service(request))
    return _render(request, "task.html", page="task", task=name, health=health)


class DashboardHeaders:
    """ASGI middleware: the security headers (``SECURITY_HEADERS``) on every response
    under ``/ui``, pages, assets and errors alike, and ``Cache-Control: no-cache`` where
    none is set (assets are revalidated by their ``ETag``, so a new version is used at
    once)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != UI_PREFIX and not path.startswith(f"{UI_PREFIX}/"):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() not in _SECURITY_HEADER_NAMES
                ]
                if not any(name.lower() == b"cache-control" for name, _ in kept):
                    kept.append((b"cache-control", b"no-cache"))
                message["headers"] = [*kept, *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def add_dashboard_assets(app: FastAPI) -> None:
    """Serve the dashboard's assets under ``/ui/static`` and give its pages their security
    headers (the pages themselves are ``router``, included with the others)."""
    app.mount(STATIC_URL, StaticFiles(directory=ui_directory() / "static"), name="ui-static")
    app.add_middleware(DashboardHeaders)
