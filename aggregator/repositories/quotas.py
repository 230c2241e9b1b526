"""Device keys' report counts per metric and hour (``key_usage``), reserved atomically.

``reserve`` adds a batch's reports to its key's counts for the hour, all metrics of the
batch or none: each count is raised by one conditional ``UPDATE ... SET reports = reports
+ k WHERE ... AND reports + k <= limit`` (or inserted when the hour has no row yet), and the
transaction is rolled back at the first metric that would pass the limit. The row lock the
update takes orders concurrent writers, so two batches of one key never both fit where
only one does, on SQLite (one writer at a time) and on PostgreSQL alike; an insert that
meets a row another transaction inserted first is retried as an update.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from aggregator.repositories.database import Repository
from aggregator.repositories.schema import key_usage

__all__ = ["KeyUsageRepository", "QuotaVerdict"]


@dataclass(frozen=True)
class QuotaVerdict:
    """A reservation's outcome: ``None`` fields when every count fit, else the first
    metric that did not, the reports its key had sent that hour, and the limit."""

    metric: str | None = None
    used: int = 0
    limit: int = 0

    @property
    def fits(self) -> bool:
        return self.metric is None


class _OverQuota(Exception):
    def __init__(self, verdict: QuotaVerdict) -> None:
        self.verdict = verdict


class KeyUsageRepository(Repository):
    """How many reports each device key sent per metric and hour."""

    def reserve(self, key_id: str, counts: dict[str, int], hour: int, limit: int) -> QuotaVerdict:
        """Add ``counts`` (metric -> reports) to ``key_id``'s hour if every one fits within
        ``limit``; else change nothing and say which did not."""
        try:
            with self.database.write() as conn:
                for metric, reports in sorted(counts.items()):
                    verdict = _add(conn, key_id, metric, hour, reports, limit)
                    if not verdict.fits:
                        raise _OverQuota(verdict)  # rolls the transaction back
        except _OverQuota as over:
            return over.verdict
        return QuotaVerdict()

    def refund(self, key_id: str, counts: dict[str, int], hour: int) -> None:
        """Take back a reservation whose batch was not stored."""
        with self.database.write() as conn:
            for metric, reports in sorted(counts.items()):
                conn.execute(
                    update(key_usage)
                    .where(_row(key_id, metric, hour))
                    .values(reports=key_usage.c.reports - reports)
                )

    def usage(self, key_id: str, hour: int) -> dict[str, int]:
        """The reports ``key_id`` sent per metric in ``hour``."""
        query = select(key_usage.c.metric, key_usage.c.reports).where(
            (key_usage.c.key_id == key_id) & (key_usage.c.hour == hour)
        )
        with self.database.read() as conn:
            return {metric: int(reports) for metric, reports in conn.execute(query).all()}

    def purge(self, before_hour: int) -> int:
        """Drop the counts of hours before ``before_hour`` (they no longer limit anything)."""
        with self.database.write() as conn:
            return int(
                conn.execute(delete(key_usage).where(key_usage.c.hour < before_hour)).rowcount
            )


def _row(key_id: str, metric: str, hour: int) -> ColumnElement[bool]:
    return (
        (key_usage.c.key_id == key_id) & (key_usage.c.metric == metric) & (key_usage.c.hour == hour)
    )


def _add(
    conn: Connection, key_id: str, metric: str, hour: int, reports: int, limit: int
) -> QuotaVerdict:
    """Raise one count within the limit, inserting its row when the hour has none."""
    if reports > limit:
        return QuotaVerdict(metric, _used(conn, key_id, metric, hour) or 0, limit)
    for _ in range(2):
        changed = conn.execute(
            update(key_usage)
            .where(_row(key_id, metric, hour) & (key_usage.c.reports + reports <= limit))
            .values(reports=key_usage.c.reports + reports)
        ).rowcount
        if changed:
            return QuotaVerdict()
        used = _used(conn, key_id, metric, hour)
        if used is not None:
            return QuotaVerdict(metric, used, limit)
        try:
            with conn.begin_nested():  # a savepoint: a concurrent insert fails only this
                conn.execute(
                    insert(key_usage).values(
                        key_id=key_id, metric=metric, hour=hour, reports=reports
                    )
                )
            return QuotaVerdict()
        except IntegrityError:
            continue  # another transaction inserted the row: update it
    raise RuntimeError("key usage row neither updatable nor insertable")


def _used(conn: Connection, key_id: str, metric: str, hour: int) -> int | None:
    found = conn.execute(select(key_usage.c.reports).where(_row(key_id, metric, hour))).first()
    return None if found is None else int(found[0])
