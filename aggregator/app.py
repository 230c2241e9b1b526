"""The HTTP application: ``create_app`` assembles the routers over the services.

``create_app(settings)`` opens the repositories and builds the services over them
(``Services.open``: the ``Aggregator``, ``Federated`` tasks and the ``KeyRing``, each
given only the repositories it uses); ``ldp-aggregator serve`` runs it under uvicorn.
The routes (``aggregator/routes/``, one module per resource, the dashboard's among them)
authenticate, validate and delegate; domain errors leave as RFC 9457 problem documents
through one table (``aggregator/errors.py``); every storage call runs in a worker thread.
Here: the lifespan and its background tasks, the middleware, the exception handlers, the
documentation pages and the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from aggregator import observability as obs
from aggregator.auth import RateLimiter
from aggregator.body_limits import BodyLimits
from aggregator.docs_pages import add_docs_pages
from aggregator.errors import add_problem_handlers
from aggregator.federated import Federated
from aggregator.problems import (
    Problem,
    ProblemError,
    handle_http,
    handle_problem,
    handle_validation,
    problem_response,
)
from aggregator.routes import ROUTERS
from aggregator.routes.ui import add_dashboard_assets
from aggregator.service import Aggregator, Services
from aggregator.settings import Settings
from shared.schemas import ReportBatch

logger = logging.getLogger("ldp.aggregator")
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {"application/problem+json": {}}}
    for status in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}


def create_app(settings: Settings, services: Services | None = None) -> FastAPI:
    """The FastAPI application over ``services`` (opened from ``settings``, and closed at
    shutdown, if None; given ones are the caller's to close)."""
    opened = services or Services.open(settings)
    service, federated = opened.aggregator, opened.federated

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
            if services is None:
                opened.close()

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
    app.state.services = opened
    app.state.aggregator = service
    app.state.federated = federated
    app.state.keys = opened.keys
    # Report batches being validated at once (aggregator/routes/reports.py).
    app.state.validations = threading.BoundedSemaphore(settings.parallel_validations)
    app.state.limiter = RateLimiter(settings.rate_limit_per_second, settings.rate_limit_burst)
    app.add_middleware(
        BodyLimits,
        limit=settings.max_other_body_bytes,
        path_limits={"/v1/reports": settings.max_body_bytes},
        budget=settings.max_body_bytes_in_flight,
    )
    app.middleware("http")(_count_requests)
    app.add_exception_handler(ProblemError, handle_problem)
    add_problem_handlers(app)
    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(StarletteHTTPException, handle_http)
    app.add_exception_handler(Exception, _handle_unexpected)
    for router in ROUTERS:
        app.include_router(router)
    add_dashboard_assets(app)
    add_docs_pages(app)
    _document_batch_schema(app)
    return app


async def _count_requests(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Count every request by route template and status (``obs.REQUESTS``)."""
    response = await call_next(request)
    route = request.scope.get("route")
    path = getattr(route, "path", "unmatched")
    obs.REQUESTS.labels(path, str(response.status_code)).inc()
    return response


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
