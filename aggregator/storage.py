"""Durable state of the aggregator: every repository over one database.

``Storage(url, timeout)`` opens the database (SQLite file or PostgreSQL URL,
``aggregator/repositories/database.py``; ``timeout`` bounds each wait for it) and is the
metrics, keys, reports and tasks repositories at once (``aggregator/repositories/``),
sharing its transactions: one object per process, thread-safe. The services take the
narrowest repository they use (the catalog a ``MetricsRepository``, the key ring a
``KeysRepository``, federated tasks a ``TasksRepository``), and any ``Storage`` is one.
A database that cannot serve now raises ``StorageUnavailableError`` from any of them.
"""

from __future__ import annotations

from sqlalchemy import Engine

from aggregator.repositories.database import (
    DEFAULT_TIMEOUT,
    Database,
    MissingDatabaseError,
    SchemaMismatchError,
    StorageUnavailableError,
)
from aggregator.repositories.keys import KeysRepository
from aggregator.repositories.metrics import MetricsRepository
from aggregator.repositories.reports import PartialRow, ReportsRepository
from aggregator.repositories.tasks import TasksRepository

__all__ = [
    "MissingDatabaseError",
    "PartialRow",
    "SchemaMismatchError",
    "Storage",
    "StorageUnavailableError",
]


class Storage(MetricsRepository, KeysRepository, ReportsRepository, TasksRepository):
    """The metrics, keys, reports and tasks repositories over one ``Database``."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(Database(url, timeout))

    @property
    def engine(self) -> Engine:
        return self.database.engine

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.database.dialect

    def ping(self) -> None:
        """One round trip to the database (``StorageUnavailableError`` when it fails)."""
        self.database.ping()

    def close(self) -> None:
        """Stop the repositories' work (pending batches are stored), then the database."""
        super().close()
        self.database.close()
