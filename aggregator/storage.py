"""Durable state of the aggregator: the four repositories over one database, side by side.

``Repositories.open(url, timeout)`` opens the database (SQLite file or PostgreSQL URL,
``aggregator/repositories/database.py``; ``timeout`` bounds each wait for it) and builds
the metrics, keys, reports and tasks repositories over it (``aggregator/repositories/``):
one set per process, thread-safe. ``create_app`` hands each service the repositories it
uses and no more (the catalog the metrics repository, the key ring the keys repository,
federated tasks the tasks repository, ``StorageHealth`` the database and the reports
repository). A database that cannot serve now raises ``StorageUnavailableError`` from any
of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aggregator import observability as obs
from aggregator.repositories.database import (
    DEFAULT_TIMEOUT,
    Database,
    DatabaseNotFoundError,
    MissingDatabaseError,
    SchemaMismatchError,
    StorageUnavailableError,
)
from aggregator.repositories.keys import KeysRepository
from aggregator.repositories.metrics import MetricsRepository
from aggregator.repositories.quotas import KeyUsageRepository
from aggregator.repositories.reports import PartialRow, ReportsRepository
from aggregator.repositories.tasks import TasksRepository

__all__ = [
    "DatabaseNotFoundError",
    "MissingDatabaseError",
    "PartialRow",
    "Repositories",
    "SchemaMismatchError",
    "StorageHealth",
    "StorageUnavailableError",
]

logger = logging.getLogger("ldp.aggregator")


@dataclass(frozen=True)
class Repositories:
    """The metrics, keys, reports, tasks and key usage repositories over one ``Database``."""

    database: Database
    metrics: MetricsRepository
    keys: KeysRepository
    reports: ReportsRepository
    tasks: TasksRepository
    key_usage: KeyUsageRepository

    @classmethod
    def open(cls, url: str, timeout: float = DEFAULT_TIMEOUT, create: bool = True) -> Repositories:
        """The repositories over the database at ``url``; with ``create=False`` a database
        that does not exist yet is refused (``DatabaseNotFoundError``), not created."""
        database = Database(url, timeout, create=create)
        return cls(
            database,
            MetricsRepository(database),
            KeysRepository(database),
            ReportsRepository(database),
            TasksRepository(database),
            KeyUsageRepository(database),
        )

    def close(self) -> None:
        """Store the batches already submitted, then close the database."""
        self.reports.close()
        self.database.close()


class StorageHealth:
    """Whether the storage can serve now: the database answers, and the reports' writer
    can commit (``GET /healthz`` and the dashboard ask)."""

    def __init__(self, database: Database, reports: ReportsRepository) -> None:
        self._database = database
        self._reports = reports

    def check(self) -> str:
        """The storage dialect's name, once the database answers and nothing says the
        group-commit writer cannot commit; ``StorageUnavailableError`` otherwise (any
        failure of the round trip counts as unreachable)."""
        timeout = self._database.timeout
        try:
            self._database.ping()
        except StorageUnavailableError:
            raise
        except Exception as error:  # noqa: BLE001 - any storage failure is "unreachable"
            obs.log(logger, logging.WARNING, "storage unreachable", error=type(error).__name__)
            raise StorageUnavailableError("the database did not answer", timeout) from None
        trouble = self._reports.writer_trouble()
        if trouble is not None:
            raise StorageUnavailableError(
                f"the database answers, but the writer cannot commit: {trouble}", timeout
            )
        return self._database.dialect
