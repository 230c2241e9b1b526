"""The service's HTTP routes, one ``APIRouter`` per resource, in the order they are served.

Each module's ``router`` carries its path prefix and the role its endpoints need (a
router-level dependency, where one role guards them all), gets the services through the
dependencies of ``aggregator/deps.py``, and raises plain domain exceptions, which
``aggregator/errors.py`` turns into problem documents. ``ui`` serves the dashboard's
pages (outside the OpenAPI document; ``create_app`` adds its assets and headers).
"""

from __future__ import annotations

from fastapi import APIRouter

from aggregator.routes import estimates, federated, keys, metrics, operations, reports, ui

__all__ = ["ROUTERS"]

#: Every router, in the order ``create_app`` includes them.
ROUTERS: tuple[APIRouter, ...] = (
    operations.router,
    metrics.router,
    reports.router,
    estimates.router,
    keys.router,
    federated.router,
    ui.router,
)
