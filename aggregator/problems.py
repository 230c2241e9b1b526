"""Errors as RFC 9457 problem documents (``application/problem+json``).

Every error the service returns is ``{"type", "title", "status", "detail", "instance"}``,
plus ``errors``: a list of ``{"report", "field", "message"}`` saying where the request
was wrong (``report`` is the index in the batch, or null). ``type`` is a stable URI
per kind of problem, relative to ``/problems/``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from shared.schemas import error_location

try:
    from fastapi.routing import iter_route_contexts
except ImportError:  # FastAPI before 0.137.2 copies included routes into app.routes

    def iter_route_contexts(  # type: ignore[no-redef,misc]
        routes: Sequence[BaseRoute],
    ) -> Iterator[BaseRoute]:
        return iter(routes)


MEDIA_TYPE = "application/problem+json"


class ProblemItem(BaseModel):
    report: int | None = Field(default=None, description="Index of the report in the batch.")
    field: str | None = None
    message: str
    rule: str | None = Field(
        default=None,
        description="The refusal rule the report breaks (a report no honest device sends "
        "but with probability at most 2^-40); only on such problems.",
    )

    @model_serializer(mode="wrap")
    def _rule_only_when_broken(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("rule") is None:
            data.pop("rule", None)
        return data


class Problem(BaseModel):
    """An RFC 9457 problem document."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[ProblemItem] = Field(default_factory=list)


class ProblemError(Exception):
    """Raise to answer with a problem document."""

    def __init__(
        self,
        status: int,
        kind: str,
        title: str,
        detail: str,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.title, self.detail = status, kind, title, detail
        self.errors = errors or []
        self.headers = headers or {}


def problem_response(
    request: Request,
    status: int,
    kind: str,
    title: str,
    detail: str,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = Problem(
        type=f"/problems/{kind}",
        title=title,
        status=status,
        detail=detail,
        instance=request.url.path,
        errors=[ProblemItem.model_validate(e) for e in errors or []],
    )
    return JSONResponse(
        body.model_dump(), status_code=status, media_type=MEDIA_TYPE, headers=headers
    )


async def handle_problem(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ProblemError)
    return problem_response(
        request, error.status, error.kind, error.title, error.detail, error.errors, error.headers
    )


async def handle_validation(request: Request, error: Exception) -> JSONResponse:
    """Pydantic's errors, located: ``body.reports.3.payload`` becomes report 3, field payload."""
    assert isinstance(error, RequestValidationError)
    items: list[dict[str, Any]] = []
    for item in error.errors():
        located = _located(item)
        if located not in items:  # a payload value's union alternatives read as one problem
            items.append(located)
    detail = "; ".join(
        (f"report {i['report']}: " if i["report"] is not None else "")
        + (f"{i['field']}: " if i["field"] else "")
        + i["message"]
        for i in items[:5]
    )
    if len(items) > 5:
        detail += f"; and {len(items) - 5} more"
    return problem_response(
        request, 422, "invalid-request", "The request is invalid", detail, items
    )


def _located(item: dict[str, Any]) -> dict[str, Any]:
    location = error_location(item.get("loc", ()))
    report = None
    if len(location) >= 3 and location[:2] == ["body", "reports"] and location[2].isdigit():
        report = int(location[2])
        location = location[3:]
    elif location and location[0] in ("body", "query", "path", "header"):
        location = location[1:] if location[0] == "body" else location
    message = str(item.get("msg", "invalid"))
    if report is not None and len(location) >= 3 and location[0] == "payload":
        # [payload, key, union member]: one message for the value, whatever the member.
        value = item.get("input")
        message = (
            f"payload field {location[1]!r} must be an integer, a finite number or a string, "
            f"got {value!r}"
        )
        location = location[:1]
    return {"report": report, "field": ".".join(location) or None, "message": message}


async def handle_http(request: Request, error: Exception) -> JSONResponse:
    """Framework errors (404 no such route, 405 wrong method, ...) as problem documents."""
    assert isinstance(error, StarletteHTTPException)
    detail = error.detail if isinstance(error.detail, str) else "request failed"
    kind = {404: "not-found", 405: "method-not-allowed"}.get(error.status_code, "http-error")
    headers = dict(error.headers or {})
    if error.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request))
    return problem_response(request, error.status_code, kind, detail, detail, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (one route per method here)."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):  # included routers, flattened
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(request.url.path):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)
