"""Reports: the accepted report ids (``report_ids``) and their statistics (``partial_stats``).

Exactly once. ``ingest`` stores a batch in one transaction, shared with the other
batches waiting at that moment (group commit, ``aggregator/group_commit.py``): insert
the report ids, skipping those already stored (the ids that went in are the new ones),
aggregate only the new reports, insert their partial statistics, commit. The reply is
sent after the commit, so an acknowledged report is in both tables, and a report whose
id is in ``report_ids`` is in exactly one partial row: a retry of it is a duplicate,
however the earlier attempt ended. Ids are inserted in sorted order, so concurrent
PostgreSQL writers take row locks in one order and cannot deadlock; a writer that meets
an id another transaction is inserting waits for it and then sees it as a duplicate.

Many writers. Partial rows are only ever inserted, so concurrent batches do not contend
for a row. ``compact_group`` deletes a group's rows with DELETE ... RETURNING and
inserts their sum in the same transaction: a row is summed by exactly the one
transaction that deleted it, so two compactors (or a compactor and a reader) never
double count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Connection

from aggregator.group_commit import GroupCommitter, Submission
from aggregator.repositories.database import Database, Repository
from aggregator.repositories.schema import partial_stats, report_ids

__all__ = ["PartialRow", "ReportsRepository"]

#: Ids looked up per statement on SQLite's exact path (well under its 32,766 variables).
_LOOKUP_CHUNK = 8192


@dataclass(frozen=True)
class PartialRow:
    """Statistics of some reports of one (metric, version, bucket), serialized."""

    metric: str
    version: int
    bucket: int
    n: int
    stats: bytes


class _SeenBefore(Exception):
    """An optimistic insert of report ids met one already stored (``_insert_ids``)."""


class ReportsRepository(Repository):
    """Accepted report ids and the partial statistics of their reports."""

    def __init__(self, database: Database) -> None:
        super().__init__(database)
        self._committer = GroupCommitter(self._commit_group)

    def close(self) -> None:
        """Store the batches already submitted, then stop the group-commit thread."""
        self._committer.close()
        super().close()

    def ingest(
        self, ids: Sequence[bytes], fold: Callable[[list[bool]], list[PartialRow]]
    ) -> tuple[int, int]:
        """Record ``ids`` (distinct 16-byte report ids) and their statistics atomically.

        ``fold(new)`` gets the boolean mask of the ids not seen before and returns the
        ``PartialRow``s of those reports; both are written in one transaction (shared
        with the other batches waiting at the time, see ``aggregator/group_commit.py``),
        and this returns after its commit: ``(accepted, duplicates)``.
        """
        accepted = self._committer.submit(ids, fold)
        return accepted, len(ids) - accepted

    def _commit_group(self, group: list[Submission]) -> None:
        """One transaction for several batches: their ids, then their new reports' statistics.

        An id new to the database and listed by several batches of the group is new for
        the first of them only.
        """
        ordered = sorted({report_id for submission in group for report_id in submission.ids})
        hour = int(time.time() // 3600)
        try:
            self._write_group(group, ordered, hour, optimistic=self.database.dialect == "sqlite")
        except _SeenBefore:  # rolled back: once more, skipping the ids already stored
            self._write_group(group, ordered, hour, optimistic=False)

    def _write_group(
        self, group: list[Submission], ordered: list[bytes], hour: int, optimistic: bool
    ) -> None:
        with self.database.write() as conn:
            inserted = self._insert_ids(conn, ordered, hour, optimistic)
            rows: list[PartialRow] = []
            for submission in group:
                new = []
                for report_id in submission.ids:
                    fresh = report_id in inserted
                    if fresh:
                        inserted.discard(report_id)
                    new.append(fresh)
                submission.accepted = sum(new)
                if submission.accepted:
                    rows += submission.fold(new)
            if rows:
                conn.execute(insert(partial_stats), [row.__dict__ for row in rows])

    def _insert_ids(
        self, conn: Connection, ordered: list[bytes], hour: int, optimistic: bool
    ) -> set[bytes]:
        """Store the ids of ``ordered`` not stored yet, and return them.

        PostgreSQL: one ``INSERT ... SELECT unnest(...) ON CONFLICT DO NOTHING RETURNING``.
        SQLite: ``optimistic`` inserts every id with one prepared statement run over all
        of them (``executemany``); if any id was stored already, it raises
        ``_SeenBefore`` for the caller to roll back and come again without
        ``optimistic``: the stored ids are looked up, then the others inserted (a retried
        batch is the rare case).
        """
        if self.database.dialect == "postgresql":
            result = conn.exec_driver_sql(
                "INSERT INTO report_ids (report_id, received_hour) "
                "SELECT unnest(%(ids)s::bytea[]), %(hour)s "
                "ON CONFLICT DO NOTHING RETURNING report_id",
                {"ids": ordered, "hour": hour},
            )
            return {bytes(row[0]) for row in result}
        if optimistic:
            if _insert_sqlite(conn, ordered, hour) != len(ordered):
                raise _SeenBefore
            return set(ordered)
        stored: set[bytes] = set()
        for start in range(0, len(ordered), _LOOKUP_CHUNK):
            chunk = ordered[start : start + _LOOKUP_CHUNK]
            found = conn.execute(
                select(report_ids.c.report_id).where(report_ids.c.report_id.in_(chunk))
            )
            stored.update(row[0] for row in found)
        new = [report_id for report_id in ordered if report_id not in stored]
        _insert_sqlite(conn, new, hour)
        return set(new)

    def partial_rows(
        self, metric: str, version: int, start: int | None = None, end: int | None = None
    ) -> list[PartialRow]:
        """The partial statistics of one metric version with ``start <= bucket < end``."""
        query = (
            select(partial_stats)
            .where(partial_stats.c.metric == metric)
            .where(partial_stats.c.version == version)
        )
        if start is not None:
            query = query.where(partial_stats.c.bucket >= start)
        if end is not None:
            query = query.where(partial_stats.c.bucket < end)
        with self.database.read() as conn:
            rows = conn.execute(query).all()
        return [PartialRow(r.metric, r.version, r.bucket, r.n, bytes(r.stats)) for r in rows]

    def add_partial_rows(self, rows: Sequence[PartialRow]) -> None:
        """Insert statistics directly (loading, benchmarks); no report ids are recorded."""
        with self.database.write() as conn:
            conn.execute(insert(partial_stats), [row.__dict__ for row in rows])

    def report_count(self) -> int:
        """How many distinct report ids have been accepted."""
        with self.database.read() as conn:
            return int(conn.execute(select(func.count()).select_from(report_ids)).scalar_one())

    def groups_to_compact(self, min_rows: int = 2) -> list[tuple[str, int, int]]:
        """The (metric, version, bucket) groups holding at least ``min_rows`` partial rows."""
        key = (partial_stats.c.metric, partial_stats.c.version, partial_stats.c.bucket)
        with self.database.read() as conn:
            rows = conn.execute(select(*key).group_by(*key).having(func.count() >= min_rows)).all()
        return [(row[0], row[1], row[2]) for row in rows]

    def compact_group(
        self,
        metric: str,
        version: int,
        bucket: int,
        merge: Callable[[list[bytes]], tuple[int, bytes]],
    ) -> int:
        """Replace a group's partial rows by one row, their ``merge``; returns rows merged.

        ``merge(list of stats bytes) -> (n, stats bytes)``. DELETE ... RETURNING hands
        each row to exactly one transaction, so concurrent compactions never double count.
        """
        with self.database.write() as conn:
            deleted = conn.execute(
                delete(partial_stats)
                .where(partial_stats.c.metric == metric)
                .where(partial_stats.c.version == version)
                .where(partial_stats.c.bucket == bucket)
                .returning(partial_stats.c.stats)
            ).all()
            if len(deleted) == 0:
                return 0
            n, stats = merge([bytes(row[0]) for row in deleted])
            conn.execute(
                insert(partial_stats).values(
                    metric=metric, version=version, bucket=bucket, n=n, stats=stats
                )
            )
            return len(deleted)


def _insert_sqlite(conn: Connection, ids: list[bytes], hour: int) -> int:
    """Insert ``ids`` into SQLite's ``report_ids``, skipping stored ones; how many went in.

    One prepared statement run over every id by the driver (``executemany``): the
    statement is neither compiled nor its parameters converted per row.
    """
    if not ids:
        return 0
    result = conn.exec_driver_sql(
        "INSERT INTO report_ids (report_id, received_hour) VALUES (?, ?) ON CONFLICT DO NOTHING",
        [(report_id, hour) for report_id in ids],
    )
    return int(result.rowcount)
