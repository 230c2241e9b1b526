"""FastAPI dependencies shared by the routes: the services, and bearer-key authentication.

``Service``, ``FederatedService`` and ``Keys`` hand a route the application's
``Aggregator``, ``Federated`` and ``KeyRing`` (kept on ``app.state`` by ``create_app``).
``require_device``, ``require_analyst`` and ``require_admin`` admit a request bearing a
valid key of that role (an admin key is admitted everywhere; ``require_observer`` an
analyst's or a device's), answer 401 without one, 403
with a key of another role, and 429 with ``Retry-After`` when the key's rate limit is
spent. A router whose endpoints all need one role lists it in its ``dependencies``; an
endpoint that needs the key's identity (to log it) takes ``Device``, ``Analyst`` or
``Admin``, the ``Annotated`` aliases of the same dependencies, which FastAPI runs once
per request however often they are named.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.concurrency import run_in_threadpool

from aggregator.auth import KEY_OF_ROLE, KeyRing, Principal, RateLimiter, Role
from aggregator.federated import TASK_NAME, Federated
from aggregator.problems import ProblemError
from aggregator.registry import METRIC_NAME
from aggregator.service import Aggregator

__all__ = [
    "Admin",
    "Analyst",
    "Device",
    "FederatedService",
    "Keys",
    "MetricName",
    "Observer",
    "Service",
    "TaskName",
    "authorized",
    "get_federated",
    "get_keys",
    "get_service",
    "require_admin",
    "require_analyst",
    "require_device",
    "require_observer",
]

#: A metric's name in a path.
MetricName = Annotated[str, Path(pattern=METRIC_NAME.pattern, description="Metric name.")]
#: A federated task's name in a path.
TaskName = Annotated[str, Path(pattern=TASK_NAME.pattern, description="Task name.")]


def get_service(request: Request) -> Aggregator:
    """The application's ``Aggregator``."""
    service: Aggregator = request.app.state.aggregator
    return service


def get_federated(request: Request) -> Federated:
    """The application's ``Federated`` tasks."""
    federated: Federated = request.app.state.federated
    return federated


def get_keys(request: Request) -> KeyRing:
    """The application's ``KeyRing``."""
    keys: KeyRing = request.app.state.keys
    return keys


Service = Annotated[Aggregator, Depends(get_service)]
FederatedService = Annotated[Federated, Depends(get_federated)]
Keys = Annotated[KeyRing, Depends(get_keys)]


def authorized(*roles: Role) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency that admits requests bearing a valid key of one of ``roles`` (or admin)."""

    async def dependency(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ProblemError(
                401,
                "unauthorized",
                "Authentication required",
                "send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        keys = get_keys(request)
        principal = await run_in_threadpool(keys.authenticate, token.strip())
        if principal is None:
            raise ProblemError(
                401,
                "unauthorized",
                "Invalid API key",
                "the key is unknown or revoked",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        if not any(principal.may(role) for role in roles):
            needed = " or ".join(KEY_OF_ROLE[role] for role in roles)
            raise ProblemError(
                403,
                "forbidden",
                "Not allowed",
                f"this needs {needed}; the key given is {KEY_OF_ROLE[principal.role]}",
            )
        limiter: RateLimiter = request.app.state.limiter
        wait = limiter.acquire(principal.key_id)
        if wait > 0:
            raise ProblemError(
                429,
                "rate-limited",
                "Too many requests",
                f"this key may make {limiter.rate:g} requests per second",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return principal

    return dependency


require_device = authorized("device")
require_analyst = authorized("analyst")
require_admin = authorized("admin")
require_observer = authorized("analyst", "device")

Device = Annotated[Principal, Depends(require_device)]
Analyst = Annotated[Principal, Depends(require_analyst)]
Admin = Annotated[Principal, Depends(require_admin)]
#: An analyst's or a device's key (what both may read, e.g. a secure round's progress).
Observer = Annotated[Principal, Depends(require_observer)]
