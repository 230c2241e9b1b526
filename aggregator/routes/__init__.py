"""The service's HTTP routes, one ``APIRouter`` per resource, in the order they are served.

Each module's ``router`` gets the services through the dependencies of
``aggregator/deps.py`` and raises plain domain exceptions, which ``aggregator/errors.py``
turns into problem documents.
"""

from __future__ import annotations

from fastapi import APIRouter

from aggregator.routes import estimates, federated, keys, metrics, operations, reports

__all__ = ["ROUTERS"]

#: Every router, in the order ``create_app`` includes them.
ROUTERS: tuple[APIRouter, ...] = (
    operations.router,
    metrics.router,
    reports.router,
    estimates.router,
    keys.router,
    federated.router,
)
