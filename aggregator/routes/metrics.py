"""Metric specs: the public catalog (``GET /v1/metrics``, versions) and ``PUT`` to define.

The public documents are served from bytes serialized once per catalog state, with an
``ETag``; any cache may keep them but must revalidate (a cheap 304), so a new version is
seen at once.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from aggregator import observability as obs
from aggregator.catalog import Published
from aggregator.deps import Admin, MetricName, Service
from aggregator.service import UnknownMetricError
from shared.schemas import MetricDocument, MetricSpec

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(tags=["metrics"])

PUBLIC_CACHE_CONTROL = "public, no-cache"
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not modified: the ETag given in If-None-Match is current."}
}


@router.get("/v1/metrics", response_model=list[MetricSpec], responses=NOT_MODIFIED)
async def list_metrics(request: Request, service: Service) -> Any:
    """The current version of every metric: public, so anyone can audit the privacy promise.

    Served from bytes serialized once per catalog state, with an ``ETag``; a request
    whose ``If-None-Match`` names the current tag gets 304. There is no key to rate
    limit by, and no per-address limit (devices behind one NAT or proxy share an
    address, and the service keeps no client addresses): each request costs a
    comparison and a send, as ``/healthz`` does.
    """
    document = await run_in_threadpool(service.catalog.published_latest)
    return _published(request, document)


@router.get("/v1/metrics/{name}/versions", response_model=list[MetricSpec], responses=NOT_MODIFIED)
async def metric_versions(request: Request, name: MetricName, service: Service) -> Any:
    """Every version of one metric, oldest first (public; cached as ``/v1/metrics`` is)."""
    document = await run_in_threadpool(service.catalog.published_versions, name)
    if document is None:
        raise UnknownMetricError(f"no metric {name!r}")
    return _published(request, document)


@router.put(
    "/v1/metrics/{name}",
    response_model=MetricSpec,
    status_code=200,
    responses={201: {"model": MetricSpec, "description": "A new version was created."}},
)
async def define_metric(
    name: MetricName,
    document: MetricDocument,
    response: Response,
    principal: Admin,
    service: Service,
) -> Any:
    """Define a metric. A new spec or new labels make a new version (201); the same spec
    with another description updates the current version (200).

    The body may be a ``GET /v1/metrics`` item as it is: its ``name`` must be the
    path's, and its ``version`` is ignored (the server assigns versions)."""
    metric, created = await run_in_threadpool(service.define_document, name, document)
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
