"""Reports: the accepted report ids (``report_ids``) and their statistics (``partial_stats``).

Exactly once. ``ingest`` stores a batch in one transaction, shared with the other
batches waiting at that moment (group commit, ``aggregator/group_commit.py``): insert
the report ids, skipping those already stored (the ids that went in are the new ones),
aggregate only the new reports, insert their partial statistics, commit. The reply is
sent after the commit, so an acknowledged report is in both tables, and a report whose
id is in ``report_ids`` is in exactly one partial row: a retry of it is a duplicate,
however the earlier attempt ended. PostgreSQL gets the ids in sorted order, so concurrent
writers take row locks in one order and cannot deadlock; a writer that meets an id
another transaction is inserting waits for it and then sees it as a duplicate.

Few statements per group. On SQLite the group's ids go in as one blob (16 bytes each,
each batch's sorted) that a single ``INSERT ... SELECT`` cuts into rows, so the driver
makes one call for them all and takes Python's GIL back once, not once per row (the
request threads, which parse and validate the next batches, need it meanwhile); the
partial rows go in by one multi-row ``INSERT``. The ids' insert is optimistic: when
fewer rows went in than ids were given, some id was stored before (a retry) or repeated
across the group's batches, and the transaction is rolled back and run once more with
``RETURNING``, which names the ids that went in. PostgreSQL always uses ``RETURNING``.
When every id went in, each batch's reports are all new and no id is looked at again.

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

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection

from aggregator.group_commit import GroupCommitter, Submission
from aggregator.repositories.database import Database, Repository, StorageUnavailableError
from aggregator.repositories.schema import (
    partial_stats,
    refused_reports,
    report_ids,
    report_profiles,
)

__all__ = ["PROFILE", "STATS", "UNIT_RADIX", "PartialRow", "ReportsRepository"]

#: Report ids per SQLite insert statement: a statement that may fail midway keeps the
#: pages it changes in a statement journal (in memory) until it ends; this bounds it.
_IDS_PER_STATEMENT = 8192
_ID_BYTES = 16
#: Partial rows per multi-row insert (6 parameters each; SQLite takes up to 32,766).
_ROWS_PER_STATEMENT = 1000
_ROW_COLUMNS = ("metric", "version", "bucket", "cell", "n", "stats")
#: A partial row's kind: the reports' statistics (``partial_stats``) or their profile
#: (``report_profiles``, ``shared.integrity``); both tables have the same columns.
STATS, PROFILE = "stats", "profile"
_TABLES = {STATS: partial_stats, PROFILE: report_profiles}

#: SQLite: insert the ids cut from ``:ids`` (``:count`` of them), skipping stored ones.
#: ``WHERE true`` tells the parser that ``ON CONFLICT`` is the upsert clause.
_INSERT_SQLITE = (
    "INSERT INTO report_ids (report_id, received_hour) "
    "WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i + 1 < :count) "
    f"SELECT substr(:ids, {_ID_BYTES} * i + 1, {_ID_BYTES}), :hour FROM k WHERE true "
    "ON CONFLICT DO NOTHING"
)
_INSERT_POSTGRESQL = (
    "INSERT INTO report_ids (report_id, received_hour) "
    "SELECT unnest(%(ids)s::bytea[]), %(hour)s "
    "ON CONFLICT DO NOTHING RETURNING report_id"
)


#: A (bucket, cell) unit as one sortable integer key, ``bucket * UNIT_RADIX + cell``: cells
#: are below 2^13 (``shared.dimensions.MAX_CELLS`` is 4,096) and buckets Unix seconds below
#: 2^38, so keys stay below 2^51.
UNIT_RADIX = 1 << 13


@dataclass(frozen=True)
class PartialRow:
    """Statistics of some reports of one (metric, version, bucket, cell), serialized.

    ``cell``: the reports' combination of public dimension values (``shared.dimensions``);
    0 for a metric without dimensions. ``kind``: ``STATS`` (the mechanism's statistics) or
    ``PROFILE`` (the reports' profile, ``shared.integrity.Profiled``).
    """

    metric: str
    version: int
    bucket: int
    n: int
    stats: bytes
    cell: int = 0
    kind: str = STATS


@dataclass(eq=False)
class _Batch(Submission):
    """A batch as the writer takes it: also its ids sorted and joined (SQLite's parameter)."""

    joined: bytes = b""


class _SeenBefore(Exception):
    """An optimistic insert of report ids met one already stored or repeated in the group."""


class ReportsRepository(Repository):
    """Accepted report ids and the partial statistics of their reports."""

    def __init__(self, database: Database) -> None:
        super().__init__(database)
        self._committer: GroupCommitter[_Batch] = GroupCommitter(
            self._commit_group, timeout=database.timeout
        )

    def close(self) -> None:
        """Store the batches already submitted, then stop the group-commit thread."""
        self._committer.close()

    def ingest(
        self, ids: Sequence[bytes], fold: Callable[[list[bool]], list[PartialRow]]
    ) -> tuple[int, int]:
        """Record ``ids`` (distinct 16-byte report ids) and their statistics atomically.

        ``fold(new)`` gets the boolean mask of the ids not seen before and returns the
        ``PartialRow``s of those reports (it is not called when none is new); both are
        written in one transaction (shared with the other batches waiting at the time,
        see ``aggregator/group_commit.py``), and this returns after its commit:
        ``(accepted, duplicates)``. The ids are sorted here, on the caller's thread.

        ``StorageUnavailableError`` when the database cannot commit now: nothing of the
        batch is acknowledged, though its commit may have happened (a lost answer), so its
        message tells the client to send the batch again, which its ids make safe.
        """
        joined = b"".join(sorted(ids)) if self.database.dialect == "sqlite" else b""
        try:
            accepted = self._committer.submit(_Batch(ids, fold, joined))
        except StorageUnavailableError as error:
            raise error.again(
                f"the batch is not known to be stored: send it again after {error.retry_after} "
                "s (a report already stored is counted once, by its report_id)"
            ) from error.__cause__
        return accepted, len(ids) - accepted

    def writer_trouble(self) -> str | None:
        """Why the group-commit writer cannot commit now, or None (``GroupCommitter.trouble``)."""
        return self._committer.trouble()

    def _commit_group(self, group: list[_Batch]) -> None:
        """One transaction for several batches: their ids, then their new reports' statistics.

        An id new to the database and listed by several batches of the group is new for
        the first of them only.
        """
        hour = int(time.time() // 3600)
        if self.database.dialect == "sqlite":
            try:
                with self.database.write() as conn:
                    joined = b"".join(batch.joined for batch in group)
                    if _insert_sqlite(conn, joined, hour) != len(joined) // _ID_BYTES:
                        raise _SeenBefore
                    _store_rows(conn, group, None)
                return
            except _SeenBefore:  # rolled back: once more, learning which ids went in
                pass
        with self.database.write() as conn:
            _store_rows(conn, group, self._insert_returning(conn, group, hour))

    def _insert_returning(self, conn: Connection, group: list[_Batch], hour: int) -> set[bytes]:
        """Insert the group's ids not stored yet (in sorted order) and return them."""
        ordered = sorted({report_id for batch in group for report_id in batch.ids})
        if self.database.dialect == "postgresql":
            result = conn.exec_driver_sql(_INSERT_POSTGRESQL, {"ids": ordered, "hour": hour})
            return {bytes(row[0]) for row in result}
        inserted: set[bytes] = set()
        for start in range(0, len(ordered), _IDS_PER_STATEMENT):
            chunk = b"".join(ordered[start : start + _IDS_PER_STATEMENT])
            result = conn.exec_driver_sql(
                _INSERT_SQLITE + " RETURNING report_id",
                {"count": len(chunk) // _ID_BYTES, "ids": chunk, "hour": hour},
            )
            inserted.update(row[0] for row in result)
        return inserted

    def partial_rows(
        self,
        metric: str,
        version: int,
        start: int | None = None,
        end: int | None = None,
        kind: str = STATS,
    ) -> list[PartialRow]:
        """The partial statistics (or with ``kind=PROFILE`` the profiles) of one metric
        version with ``start <= bucket < end``."""
        table = _TABLES[kind]
        query = select(table).where(table.c.metric == metric).where(table.c.version == version)
        if start is not None:
            query = query.where(table.c.bucket >= start)
        if end is not None:
            query = query.where(table.c.bucket < end)
        with self.database.read() as conn:
            rows = conn.execute(query).all()
        return [
            PartialRow(r.metric, r.version, r.bucket, r.n, bytes(r.stats), r.cell, kind)
            for r in rows
        ]

    def record_refusals(self, refused: dict[tuple[str, int, int, str], int]) -> None:
        """Add reports refused by a mechanism's rules, by (metric, version, bucket, rule).

        Each count is added by one conditional UPDATE, or inserted when the row is new;
        a concurrent insert of the same row is retried as an update (one retry suffices:
        the row then exists)."""
        with self.database.write() as conn:
            for (metric, version, bucket, rule), reports in sorted(refused.items()):
                key = (
                    (refused_reports.c.metric == metric)
                    & (refused_reports.c.version == version)
                    & (refused_reports.c.bucket == bucket)
                    & (refused_reports.c.rule == rule)
                )
                changed = conn.execute(
                    update(refused_reports)
                    .where(key)
                    .values(reports=refused_reports.c.reports + reports)
                ).rowcount
                if not changed:
                    conn.execute(
                        insert(refused_reports).values(
                            metric=metric,
                            version=version,
                            bucket=bucket,
                            rule=rule,
                            reports=reports,
                        )  # fmt: skip
                    )

    def refused_counts(
        self, metric: str, version: int, start: int | None = None, end: int | None = None
    ) -> dict[int, dict[str, int]]:
        """Reports of one metric version refused by each rule, by bucket (``start <= bucket
        < end``): {bucket: {rule: reports}}."""
        query = (
            select(refused_reports.c.bucket, refused_reports.c.rule, refused_reports.c.reports)
            .where(refused_reports.c.metric == metric)
            .where(refused_reports.c.version == version)
        )
        if start is not None:
            query = query.where(refused_reports.c.bucket >= start)
        if end is not None:
            query = query.where(refused_reports.c.bucket < end)
        counts: dict[int, dict[str, int]] = {}
        with self.database.read() as conn:
            for bucket, rule, reports in conn.execute(query).all():
                counts.setdefault(int(bucket), {})[rule] = int(reports)
        return counts

    def add_partial_rows(self, rows: Sequence[PartialRow]) -> None:
        """Insert statistics directly (loading, benchmarks); no report ids are recorded."""
        with self.database.write() as conn:
            _insert_rows(conn, rows)

    def holds_statistics(self) -> bool:
        """Whether any partial statistics are stored (of any metric)."""
        with self.database.read() as conn:
            return conn.execute(select(partial_stats.c.metric).limit(1)).first() is not None

    def report_count(self) -> int:
        """How many distinct report ids have been accepted."""
        with self.database.read() as conn:
            return int(conn.execute(select(func.count()).select_from(report_ids)).scalar_one())

    def groups_to_compact(
        self, min_rows: int = 2, kind: str = STATS
    ) -> list[tuple[str, int, int, int]]:
        """The (metric, version, bucket, cell) groups holding at least ``min_rows`` partial
        rows (of statistics, or with ``kind=PROFILE`` of profiles)."""
        table = _TABLES[kind]
        key = (table.c.metric, table.c.version, table.c.bucket, table.c.cell)
        with self.database.read() as conn:
            rows = conn.execute(select(*key).group_by(*key).having(func.count() >= min_rows)).all()
        return [(row[0], row[1], row[2], row[3]) for row in rows]

    def compact_group(
        self,
        metric: str,
        version: int,
        bucket: int,
        cell: int,
        merge: Callable[[list[bytes]], tuple[int, bytes]],
        kind: str = STATS,
    ) -> int:
        """Replace a group's partial rows (one metric, version, bucket and cell; of
        statistics or profiles by ``kind``) by one row, their ``merge``; returns rows merged.

        ``merge(list of stats bytes) -> (n, stats bytes)``. DELETE ... RETURNING hands
        each row to exactly one transaction, so concurrent compactions never double count.
        """
        table = _TABLES[kind]
        with self.database.write() as conn:
            deleted = conn.execute(
                delete(table)
                .where(table.c.metric == metric)
                .where(table.c.version == version)
                .where(table.c.bucket == bucket)
                .where(table.c.cell == cell)
                .returning(table.c.stats)
            ).all()
            if len(deleted) == 0:
                return 0
            n, stats = merge([bytes(row[0]) for row in deleted])
            conn.execute(
                insert(table).values(
                    metric=metric, version=version, bucket=bucket, cell=cell, n=n, stats=stats
                )
            )
            return len(deleted)


def _insert_sqlite(conn: Connection, joined: bytes, hour: int) -> int:
    """Insert the ids of ``joined`` (16 bytes each) into SQLite's ``report_ids``, skipping
    stored ones; how many went in. One statement per ``_IDS_PER_STATEMENT`` ids."""
    inserted = 0
    step = _IDS_PER_STATEMENT * _ID_BYTES
    for start in range(0, len(joined), step):
        chunk = joined[start : start + step]
        result = conn.exec_driver_sql(
            _INSERT_SQLITE, {"count": len(chunk) // _ID_BYTES, "ids": chunk, "hour": hour}
        )
        inserted += int(result.rowcount)
    return inserted


def _store_rows(conn: Connection, group: list[_Batch], inserted: set[bytes] | None) -> None:
    """Set each batch's ``accepted`` and insert the statistics of its new reports.

    ``inserted``: the ids that went in, or None when every id of the group did (and no
    id is in two of its batches), which is also the case when there are as many of them
    as the group has ids. Otherwise an id is new for the first batch that lists it.
    """
    if inserted is not None and len(inserted) == sum(len(batch.ids) for batch in group):
        inserted = None
    rows: list[PartialRow] = []
    for batch in group:
        if inserted is None:
            new = [True] * len(batch.ids)
        else:
            new = [report_id in inserted for report_id in batch.ids]
            inserted.difference_update(batch.ids)
        batch.accepted = sum(new)
        if batch.accepted:
            rows += batch.fold(new)
    _insert_rows(conn, rows)


def _insert_rows(conn: Connection, rows: Sequence[PartialRow]) -> None:
    """Insert partial rows, each into its kind's table, ``_ROWS_PER_STATEMENT`` by each
    multi-row statement (one driver call, where ``executemany`` makes one per row)."""
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    values = "(" + ", ".join([mark] * len(_ROW_COLUMNS)) + ")"
    for kind, table in _TABLES.items():
        of_kind = [row for row in rows if row.kind == kind]
        for start in range(0, len(of_kind), _ROWS_PER_STATEMENT):
            chunk = of_kind[start : start + _ROWS_PER_STATEMENT]
            conn.exec_driver_sql(
                f"INSERT INTO {table.name} ({', '.join(_ROW_COLUMNS)}) VALUES "
                + ", ".join([values] * len(chunk)),
                tuple(getattr(row, column) for row in chunk for column in _ROW_COLUMNS),
            )
