"""The HTTP service: thin FastAPI routes over ``Aggregator`` (``aggregator/service.py``).

``create_app(settings)`` builds the application; ``ldp-aggregator serve`` runs it under
uvicorn. Routes authenticate, validate and delegate; errors leave as RFC 9457 problem
documents (``aggregator/problems.py``); every storage call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, BeforeValidator, Field, StringConstraints, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aggregator import observability as obs
from aggregator.auth import KeyRing, RateLimiter, Role
from aggregator.catalog import Published
from aggregator.deps import Admin, Analyst, Device
from aggregator.docs_pages import add_docs_pages
from aggregator.estimates import EstimateOut
from aggregator.federated import Federated
from aggregator.federated_api import add_federated_routes
from aggregator.ingest import BatchRejected
from aggregator.problems import (
    Problem,
    ProblemError,
    handle_http,
    handle_problem,
    handle_validation,
    problem_response,
)
from aggregator.registry import METRIC_NAME
from aggregator.service import Aggregator, NotEnoughReportsError, UnknownMetricError
from aggregator.settings import Settings
from shared.schemas import (
    MAX_LABEL_LENGTH,
    IngestResult,
    MetricDocument,
    MetricSpec,
    ReportBatch,
)

logger = logging.getLogger("ldp.aggregator")
#: A date and a time with seconds (fraction optional) and a UTC offset or Z.
RFC3339_DATE_TIME = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
)

PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {"application/problem+json": {}}}
    for status in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}
#: The public metric documents: any cache may keep them but must revalidate (a cheap 304
#: by ETag), so a new version is seen at once.
PUBLIC_CACHE_CONTROL = "public, no-cache"
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not modified: the ETag given in If-None-Match is current."}
}


class KeyRequest(BaseModel):
    role: Role
    label: str = Field(default="", max_length=200)


class KeyCreated(BaseModel):
    key_id: str
    role: Role
    label: str
    key: str = Field(description="The bearer key. Shown once: only its hash is stored.")


class KeyInfo(BaseModel):
    key_id: str
    role: Role
    label: str
    created_at: float
    revoked_at: float | None


class Health(BaseModel):
    status: str
    storage: str


class Compaction(BaseModel):
    groups: int
    rows_merged: int


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413, before parsing."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        response = problem_response(
            request,
            413,
            "too-large",
            "Request body too large",
            f"the body exceeds {self.limit} bytes; send smaller batches",
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


CandidateString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_LENGTH)]
MetricName = Annotated[str, Path(pattern=METRIC_NAME.pattern, description="Metric name.")]


def _date_time_text(value: object) -> object:
    """Refuse numbers (pydantic would read them as Unix seconds): windows are date-times."""
    if isinstance(value, str) and not RFC3339_DATE_TIME.match(value):
        raise ValueError("expected an RFC 3339 date-time such as 2026-11-22T10:00:00Z")
    return value


def create_app(settings: Settings, aggregator: Aggregator | None = None) -> FastAPI:
    """The FastAPI application over ``aggregator`` (one is built from ``settings`` if None)."""
    service = aggregator or Aggregator(settings)
    keys = KeyRing(service.storage)
    federated = Federated(service.storage)
    limiter = RateLimiter(settings.rate_limit_per_second, settings.rate_limit_burst)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Long-lived objects (modules, the app) leave the collector's view, and young
        # collections run less often: each batch allocates thousands of short-lived objects.
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        tasks = [asyncio.create_task(_close_due_rounds(federated))]
        if settings.compaction_interval > 0:
            tasks.append(
                asyncio.create_task(_compact_periodically(service, settings.compaction_interval))
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if aggregator is None:
                service.close()

    app = FastAPI(
        title="LDP telemetry aggregator",
        version="1",
        description=(
            "Ingests locally differentially private reports exactly once and publishes "
            "debiased estimates with standard errors. Metric specs (the privacy promise) "
            "are public at GET /v1/metrics."
        ),
        lifespan=lifespan,
        responses=PROBLEM_RESPONSES,
        docs_url=None,  # /docs and /redoc are added by add_docs_pages, with local assets
        redoc_url=None,
        # One schema per model: MechanismSpec serializes without its unused (null) fields,
        # which its validation schema describes better than a generic object.
        separate_input_output_schemas=False,
    )
    app.state.aggregator = service
    app.state.federated = federated
    app.state.keys = keys
    app.state.limiter = limiter
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_exception_handler(ProblemError, handle_problem)
    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(StarletteHTTPException, handle_http)
    app.add_exception_handler(Exception, _handle_unexpected)

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        obs.REQUESTS.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/healthz", response_model=Health, tags=["operations"])
    async def healthz() -> Any:
        """Liveness and storage reachability (503 when the database cannot be reached)."""
        try:
            await run_in_threadpool(service.storage.ping)
        except Exception as error:  # noqa: BLE001 - any storage failure is "unreachable"
            obs.log(logger, logging.WARNING, "storage unreachable", error=type(error).__name__)
            raise ProblemError(
                503, "storage-unavailable", "Storage unreachable", "the database did not answer"
            ) from None
        return {"status": "ok", "storage": service.storage.dialect}

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus() -> Response:
        """Prometheus metrics: reports accepted, duplicates, rejected by reason, latencies."""
        body, content_type = obs.exposition()
        return Response(body, media_type=content_type)

    @app.get(
        "/v1/metrics", response_model=list[MetricSpec], tags=["metrics"], responses=NOT_MODIFIED
    )
    async def list_metrics(request: Request) -> Any:
        """The current version of every metric: public, so anyone can audit the privacy promise.

        Served from bytes serialized once per catalog state, with an ``ETag``; a request
        whose ``If-None-Match`` names the current tag gets 304. There is no key to rate
        limit by, and no per-address limit (devices behind one NAT or proxy share an
        address, and the service keeps no client addresses): each request costs a
        comparison and a send, as ``/healthz`` does.
        """
        document = await run_in_threadpool(service.catalog.published_latest)
        return _published(request, document)

    @app.get(
        "/v1/metrics/{name}/versions",
        response_model=list[MetricSpec],
        tags=["metrics"],
        responses=NOT_MODIFIED,
    )
    async def metric_versions(request: Request, name: MetricName) -> Any:
        """Every version of one metric, oldest first (public; cached as ``/v1/metrics`` is)."""
        document = await run_in_threadpool(service.catalog.published_versions, name)
        if document is None:
            raise ProblemError(404, "unknown-metric", "Unknown metric", f"no metric {name!r}")
        return _published(request, document)

    @app.put(
        "/v1/metrics/{name}",
        response_model=MetricSpec,
        status_code=200,
        tags=["metrics"],
        responses={201: {"model": MetricSpec, "description": "A new version was created."}},
    )
    async def define_metric(
        name: MetricName, document: MetricDocument, response: Response, principal: Admin
    ) -> Any:
        """Define a metric. A new spec or new labels make a new version (201); the same spec
        with another description updates the current version (200).

        The body may be a ``GET /v1/metrics`` item as it is: its ``name`` must be the
        path's, and its ``version`` is ignored (the server assigns versions)."""
        if document.name is not None and document.name != name:
            message = (
                f"the body names metric {document.name!r} but the path names {name!r}; "
                "they must agree (omit name from the body, or PUT to its own path)"
            )
            raise ProblemError(
                422,
                "invalid-metric",
                "Invalid metric",
                message,
                [{"field": "name", "message": message}],
            )
        try:
            metric, created = await run_in_threadpool(service.define, name, document.definition())
        except ValueError as error:
            raise ProblemError(
                422,
                "invalid-metric",
                "Invalid metric",
                str(error),
                [{"field": "name", "message": str(error)}],
            ) from None
        response.status_code = 201 if created else 200
        obs.log(
            logger,
            logging.INFO,
            "metric defined",
            metric=name,
            version=metric.version,
            created=created,
            key_id=principal.key_id,
        )
        return metric

    @app.post(
        "/v1/reports",
        response_model=IngestResult,
        tags=["reports"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}
                },
            }
        },
    )
    async def post_reports(request: Request, principal: Device) -> Any:
        """A batch of reports, stored atomically (all or none) and acknowledged after commit.
        A ``report_id`` already accepted is ignored and counted in ``duplicates``."""
        started = time.perf_counter()
        body = await request.body()
        try:  # parsed off the event loop, which goes on serving other requests meanwhile
            batch = await run_in_threadpool(ReportBatch.model_validate_json, body)
        except ValidationError as error:
            obs.BATCHES_REJECTED.labels("malformed").inc()
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
            ) from None
        try:
            result = await run_in_threadpool(service.ingest, batch)
        except BatchRejected as rejected:
            obs.REPORTS_REJECTED.labels(rejected.reason).inc(len(batch.reports))
            obs.BATCHES_REJECTED.labels(rejected.reason).inc()
            raise ProblemError(
                rejected.status,
                "invalid-batch" if rejected.status == 422 else "too-large",
                rejected.title,
                str(rejected),
                rejected.problems,
            ) from None
        obs.REPORTS_ACCEPTED.inc(result.accepted)
        obs.REPORTS_DUPLICATE.inc(result.duplicates)
        obs.INGEST_SECONDS.observe(time.perf_counter() - started)
        return result

    @app.get(
        "/v1/metrics/{name}/estimate",
        response_model=EstimateOut,
        tags=["estimates"],
    )
    async def estimate(
        name: MetricName,
        principal: Analyst,
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
        try:
            result = await run_in_threadpool(
                service.estimate, name, version, start, end, candidates or None
            )
        except UnknownMetricError as error:
            raise ProblemError(404, "unknown-metric", "Unknown metric", str(error)) from None
        except NotEnoughReportsError as error:
            raise ProblemError(
                409, "not-enough-reports", "Not enough reports", str(error)
            ) from None
        except ValueError as error:
            raise ProblemError(
                422, "invalid-request", "Invalid estimate request", str(error)
            ) from None
        obs.ESTIMATE_SECONDS.observe(time.perf_counter() - started)
        return result

    @app.post("/v1/keys", response_model=KeyCreated, status_code=201, tags=["keys"])
    async def create_key(request_body: KeyRequest, principal: Admin) -> Any:
        """Create an API key; the reply is the only time the key is shown."""
        try:
            key_id, key = await run_in_threadpool(
                keys.create, request_body.role, request_body.label
            )
        except ValueError as error:
            raise ProblemError(
                422,
                "invalid-key-request",
                "Invalid key request",
                str(error),
                [{"field": "label", "message": str(error)}],
            ) from None
        obs.log(
            logger,
            logging.INFO,
            "key created",
            key_id=key_id,
            role=request_body.role,
            by=principal.key_id,
        )
        return {
            "key_id": key_id,
            "role": request_body.role,
            "label": request_body.label,
            "key": key,
        }

    @app.get("/v1/keys", response_model=list[KeyInfo], tags=["keys"])
    async def list_keys(principal: Admin) -> Any:
        """Every key's id, role, label and state (never the key or its hash)."""
        rows = await run_in_threadpool(service.storage.keys)
        return [{k: row[k] for k in KeyInfo.model_fields} for row in rows]

    @app.delete("/v1/keys/{key_id}", status_code=204, tags=["keys"])
    async def revoke_key(key_id: str, principal: Admin) -> Response:
        """Revoke a key (effective in every process within seconds)."""
        if not await run_in_threadpool(keys.revoke, key_id):
            raise ProblemError(404, "unknown-key", "Unknown key", f"no active key {key_id!r}")
        obs.log(logger, logging.INFO, "key revoked", key_id=key_id, by=principal.key_id)
        return Response(status_code=204)

    @app.post("/v1/admin/compact", response_model=Compaction, tags=["operations"])
    async def compact(principal: Admin) -> Any:
        """Merge the partial statistics now (it also runs in the background)."""
        result = await run_in_threadpool(service.compact)
        return {"groups": result.groups, "rows_merged": result.rows_merged}

    add_federated_routes(app)
    add_docs_pages(app)
    _document_batch_schema(app)
    return app


def _published(request: Request, document: Published) -> Response:
    """``document`` with its ``ETag``, or 304 when ``If-None-Match`` names that tag.

    ``If-None-Match`` is ``*`` or a list of tags compared weakly (RFC 9110, 13.1.2: a
    ``W/`` prefix is ignored).
    """
    headers = {"ETag": document.etag, "Cache-Control": PUBLIC_CACHE_CONTROL}
    wanted = request.headers.get("if-none-match")
    if wanted is not None:
        tags = {tag.strip().removeprefix("W/") for tag in wanted.split(",")}
        if "*" in tags or document.etag in tags:
            return Response(status_code=304, headers=headers)
    return Response(document.body, media_type="application/json", headers=headers)


def _document_batch_schema(app: FastAPI) -> None:
    """Put ``ReportBatch`` (parsed from the raw body for speed) into the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            defs = ReportBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.pop("$defs", {}))
            components["ReportBatch"] = defs
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _handle_unexpected(request: Request, error: Exception) -> Response:
    obs.log(logger, logging.ERROR, "unexpected error", path=request.url.path, error=repr(error))
    return problem_response(
        request, 500, "internal", "Internal error", "the server failed; see its log"
    )


async def _close_due_rounds(federated: Federated, interval: float = 0.5) -> None:
    """Close (or extend) federated rounds whose deadline passed, every ``interval`` s."""
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(federated.tick)
        except Exception as error:  # noqa: BLE001 - keep ticking after a transient failure
            obs.log(logger, logging.WARNING, "closing federated rounds failed", error=repr(error))


async def _compact_periodically(service: Aggregator, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            result = await run_in_threadpool(service.compact)
            if result.rows_merged:
                obs.log(
                    logger, logging.INFO, "compacted", groups=result.groups, rows=result.rows_merged
                )
        except Exception as error:  # noqa: BLE001 - keep compacting after a transient failure
            obs.log(logger, logging.WARNING, "compaction failed", error=repr(error))


def app_from_environment() -> FastAPI:
    """The application configured by ``LDP_*`` variables (what each uvicorn worker builds)."""
    return create_app(Settings.from_environment())
