"""Bounds on request bodies: the size of one, and the bytes of all of them in progress.

``BodyLimits`` is ASGI middleware in front of every route. For a request that carries a
body (a ``Content-Length`` above zero, or chunked) it

* refuses a body over its path's limit (``path_limits``, else ``limit``) with 413, from
  its declared length before anything is read, or as soon as the bytes received pass it;
* reserves the body's bytes (its declared length, or the limit when chunked) against a
  budget of ``budget`` bytes in progress, and refuses at once with 503 and
  ``Retry-After`` a body that would pass it, before reading it. Nothing is queued: a
  flood of bodies costs the service at most ``budget`` bytes of bodies (and what parsing
  them makes, proportional to their size), and every client hears at once whether to
  come back later. The reservation is released when the request's response is sent.

Requests without a body (``GET /healthz``, estimates) are never held back by the budget.
When the last body in progress is done after at least ``trim_after`` bytes of bodies,
the C allocator is asked to return its free memory to the system (``release_memory``),
so that the process shrinks back after a burst of large batches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aggregator import observability as obs
from aggregator.memory import release_memory
from aggregator.problems import problem_response

logger = logging.getLogger("ldp.aggregator")

__all__ = ["RETRY_AFTER_SECONDS", "BodyLimits"]

#: What a client refused for lack of room is told to wait, in seconds.
RETRY_AFTER_SECONDS = 1


class _TooLarge(Exception):
    pass


class BodyLimits:
    """ASGI middleware: 413 past a path's limit of bytes per body (``path_limits``, else
    ``limit``), 503 past ``budget`` bytes at once."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        budget: int,
        path_limits: Mapping[str, int] | None = None,
        trim_after: int | None = None,
    ) -> None:
        self.path_limits = dict(path_limits or {})
        largest = max([limit, *self.path_limits.values()])
        if budget < largest:
            raise ValueError(f"the budget ({budget}) must hold one body of {largest} bytes")
        self.app, self.limit, self.budget = app, limit, budget
        self.trim_after = (
            min([limit, *self.path_limits.values()]) if trim_after is None else trim_after
        )
        #: Bytes reserved by the bodies in progress, and received since the last trim.
        self.in_flight = 0
        self._since_trim = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        declared = _declared_length(headers)
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if not declared and not chunked:
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.limit)
        if declared is not None and declared > limit:
            await self._too_large(scope, receive, send, limit)
            return
        reserved = limit if declared is None else declared
        if self.in_flight + reserved > self.budget:
            obs.BODIES_REFUSED.inc()
            await self._busy(scope, receive, send)
            return
        self.in_flight += reserved
        obs.BODY_BYTES_IN_FLIGHT.set(self.in_flight)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send, limit)
        finally:
            self.in_flight -= reserved
            obs.BODY_BYTES_IN_FLIGHT.set(self.in_flight)
            self._since_trim += seen
            if self.in_flight == 0 and self._since_trim >= self.trim_after:
                self._since_trim = 0
                await run_in_threadpool(release_memory)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = problem_response(
            Request(scope, receive),
            413,
            "too-large",
            "Request body too large",
            f"the body exceeds {limit} bytes; send a smaller request (fewer reports)",
        )
        await response(scope, receive, send)

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(
            Request(scope, receive),
            503,
            "overloaded",
            "Too many request bodies in progress",
            f"the service is receiving or processing {self.in_flight} bytes of request "
            f"bodies, its limit is {self.budget}; send the same request again after "
            f"{RETRY_AFTER_SECONDS} s",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
        await response(scope, receive, send)


def _declared_length(headers: dict[bytes, bytes]) -> int | None:
    """The ``Content-Length`` as a number (None when absent or not a number)."""
    value = headers.get(b"content-length")
    return int(value) if value is not None and value.isdigit() else None
