"""Durable state of the aggregator, through SQLAlchemy 2: SQLite (WAL) or PostgreSQL.

Tables (schema version ``SCHEMA_VERSION``, checked at start):

* ``metric_versions``: one row per (metric, version), the definition as JSON;
* ``api_keys``: SHA-256 hashes of bearer keys with their role (never the keys);
* ``report_ids``: every accepted ``report_id`` (16 bytes), the primary key that makes
  ingest idempotent;
* ``partial_stats``: append-only sufficient statistics, one row per (metric, version,
  time bucket) per ingested batch; ``compact`` merges a group's rows into one;
* ``federated_tasks``: one row per federated learning task, its state (model, clip
  norm, rounds and their privacy cost) as JSON, its status and open round's deadline;
* ``federated_updates``: every upload of each task, keyed by (task, ``update_id``) so a
  retry is a duplicate even after its round closed; the vectors of a closed round are
  erased, their ids kept.

Exactly once. ``ingest`` stores a batch in one transaction (shared with the other
batches waiting at that moment: group commit, ``aggregator/group_commit.py``): insert
the report ids with ON CONFLICT DO NOTHING RETURNING (the ids that come back are the
new ones), aggregate only the new reports, insert their partial statistics, commit. The
reply is sent after the commit, so an acknowledged report is in both tables, and a
report whose id is in ``report_ids`` is in exactly one partial row: a retry of it is a
duplicate, however the earlier attempt ended. Ids are inserted in sorted order, so
concurrent PostgreSQL writers take row locks in one order and cannot deadlock; a writer
that meets an id another transaction is inserting waits for it and then sees it as a
duplicate.

Many writers. Partial rows are only ever inserted, so concurrent batches do not
contend for a row. ``compact`` deletes a group's rows with DELETE ... RETURNING and
inserts their sum in the same transaction: a row is summed by exactly the one
transaction that deleted it, so two compactors (or a compactor and a reader) never
double count. SQLite serializes writers (``BEGIN IMMEDIATE``, and between processes a
``flock`` on ``<database>-writers.lock``); PostgreSQL runs them concurrently at READ
COMMITTED.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.engine.url import make_url

from aggregator.group_commit import GroupCommitter, Submission
from shared.schemas import MetricDefinition, MetricSpec

if sys.platform != "win32":  # the writers' lock between processes (_WritersLock)
    import fcntl

SCHEMA_VERSION = 1
#: The ``schema_info`` row whose value changes (to a new random token) with every change
#: to ``metric_versions``: what ``Storage.metrics_stamp`` reads.
METRICS_CHANGE = "metrics_change"

metadata = MetaData()

schema_info = Table(
    "schema_info",
    metadata,
    Column("key", String(32), primary_key=True),
    Column("value", String(64), nullable=False),
)

metric_versions = Table(
    "metric_versions",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("definition", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("role", String(16), nullable=False),
    Column("label", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
)

report_ids = Table(
    "report_ids",
    metadata,
    Column("report_id", LargeBinary(16), primary_key=True),
    Column("received_hour", Integer, nullable=False),
    sqlite_with_rowid=False,
)


class _SeenBefore(Exception):
    """An optimistic insert of report ids met one already stored (``Storage._insert_ids``)."""


#: One report id (SQLite's hot path; see ``Storage._insert_ids``).
_INSERT_REPORT_ID = (
    "INSERT INTO report_ids (report_id, received_hour) VALUES (?, ?) ON CONFLICT DO NOTHING"
)

partial_stats = Table(
    "partial_stats",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("metric", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("bucket", BigInteger, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("stats", LargeBinary, nullable=False),
    Index("partial_stats_group", "metric", "version", "bucket"),
)


federated_tasks = Table(
    "federated_tasks",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("status", String(24), nullable=False),
    Column("round", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("evaluation", Text, nullable=True),
    Column("deadline", Float, nullable=False),
    Column("created_at", Float, nullable=False),
)

federated_updates = Table(
    "federated_updates",
    metadata,
    Column("task", String(64), primary_key=True),
    Column("update_id", LargeBinary(16), primary_key=True),
    Column("round", Integer, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    Column("unclipped", Float, nullable=False),
    Column("num_examples", Integer, nullable=False),
    Index("federated_updates_round", "task", "round"),
)


@dataclass(frozen=True)
class TaskRow:
    """A stored federated task."""

    name: str
    status: str
    round: int
    state: str
    evaluation: str | None
    deadline: float


@dataclass(frozen=True)
class UpdateRow:
    """A stored upload of a task's open round."""

    vector: bytes
    unclipped: float
    num_examples: int


@dataclass(frozen=True)
class TaskUpdate:
    """A task's new status, round, state and deadline; ``restart`` discards the uploads
    of its open round (the round is drawn again, under the same number)."""

    status: str
    round: int
    state: str
    deadline: float
    restart: bool = False


#: What a round-closing function returns: the task's update, or None to leave it as it is.
TaskChange = TaskUpdate | None


class _WritersLock:
    """An exclusive ``flock`` on a file, held while a transaction writes (on Windows,
    which has no ``flock``, SQLite's own locking alone serializes the writers)."""

    def __init__(self, path: Path) -> None:
        self._file = None if sys.platform == "win32" else open(path, "ab")  # noqa: SIM115

    def __enter__(self) -> None:
        if sys.platform != "win32" and self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        if sys.platform != "win32" and self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SchemaMismatchError(RuntimeError):
    """The database was created by an aggregator with another schema version."""


@dataclass(frozen=True)
class PartialRow:
    """Statistics of some reports of one (metric, version, bucket), serialized."""

    metric: str
    version: int
    bucket: int
    n: int
    stats: bytes


def create_storage_engine(url: str) -> Engine:
    """An engine for ``url``: a file path or ``sqlite:///...`` (WAL), or ``postgresql+psycopg://``.

    A bare path means SQLite; its directory is created on first start.
    """
    if "://" not in url:
        path = Path(url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{path}"
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise ValueError("the aggregator needs a SQLite file, not an in-memory database")
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": 30.0, "check_same_thread": False})
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=8)
    raise ValueError(
        f"unsupported database {parsed.get_backend_name()!r}: use SQLite or PostgreSQL"
    )


def _configure_sqlite(engine: Engine) -> None:
    """WAL, full fsync at commit, a busy timeout, and ``BEGIN IMMEDIATE`` for writes.

    Python's sqlite3 begins transactions lazily (DEFERRED), so two writers could both
    read and then fail to upgrade their locks; taking the write lock at BEGIN makes a
    writer wait (busy timeout) instead. Reads pass ``sqlite_begin="DEFERRED"``.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA cache_size=-262144")  # 256 MiB: the report-id index stays hot
        # Checkpoint every ~40 MiB of WAL rather than every 4 MiB: fewer, larger copies back
        # into the database file (a random-key index dirties pages all over it).
        cursor.execute("PRAGMA wal_autocheckpoint=10000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")


class Storage:
    """Everything the service keeps, behind one object (thread-safe; one per process)."""

    def __init__(self, url: str) -> None:
        self.engine = create_storage_engine(url)
        self.dialect = self.engine.dialect.name
        # SQLite has one writer at a time: queue this process's writers on a lock rather
        # than in SQLite's busy handler (which sleeps); other processes still wait there.
        self._write_lock = threading.Lock() if self.dialect == "sqlite" else None
        # Between processes (several workers on one file), an exclusive lock on a file
        # beside the database: a waiting writer wakes when the lock is released, where
        # SQLite's busy handler sleeps and polls, which puts a tail of sleeps on the
        # slowest batches (the ingest benchmark shows the p99 with and without it).
        self._writers_lock = (
            _WritersLock(Path(str(self.engine.url.database) + "-writers.lock"))
            if self.dialect == "sqlite"
            else None
        )
        # ... and write on one connection (under that lock): SQLite drops a connection's
        # page cache when another connection wrote since, so writers taking turns from the
        # pool read the report-id index back from the OS (the ingest benchmark measures
        # the difference).
        self._writer: Connection | None = None
        self._committer = GroupCommitter(self._commit_group)
        self._initialize()

    # --- schema ------------------------------------------------------------------

    def _initialize(self) -> None:
        with self.engine.begin() as conn:
            metadata.create_all(conn)
            found = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one_or_none()
            if found is None:
                conn.execute(
                    insert(schema_info).values(key="schema_version", value=str(SCHEMA_VERSION))
                )
            elif found != str(SCHEMA_VERSION):
                raise SchemaMismatchError(
                    f"the database has schema version {found}; this aggregator needs "
                    f"{SCHEMA_VERSION}"
                )
            dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
            conn.execute(  # databases from before the change token get one; concurrent starts agree
                dialect_insert(schema_info)
                .values(key=METRICS_CHANGE, value=secrets.token_hex(8))
                .on_conflict_do_nothing()
            )

    def close(self) -> None:
        self._committer.close()
        if self._write_lock is not None:
            with self._write_lock:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
        if self._writers_lock is not None:
            self._writers_lock.close()
        self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        if self._write_lock is None or self._writers_lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._write_lock, self._writers_lock:
            if self._writer is None or self._writer.invalidated:
                self._writer = self.engine.connect()
            with self._writer.begin():
                yield self._writer

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            if self.dialect == "sqlite":
                conn = conn.execution_options(sqlite_begin="DEFERRED")
            with conn.begin():
                yield conn

    def ping(self) -> None:
        with self._read() as conn:
            conn.execute(select(1)).scalar_one()

    # --- metrics -----------------------------------------------------------------

    def metrics(self) -> list[MetricSpec]:
        """Every version of every metric, by name then version."""
        with self._read() as conn:
            rows = conn.execute(
                select(
                    metric_versions.c.name, metric_versions.c.version, metric_versions.c.definition
                ).order_by(metric_versions.c.name, metric_versions.c.version)
            ).all()
        return [_metric(row.name, row.version, row.definition) for row in rows]

    def metrics_stamp(self) -> tuple[str, int]:
        """A cheap token that differs after any change to the metric versions.

        ``(change token, number of versions)``: ``define_metric`` writes a new random
        token whenever it adds a version or changes a definition; the count also catches
        versions added by a writer that does not (an older aggregator). One indexed read,
        where ``metrics()`` parses every definition.
        """
        token = select(schema_info.c.value).where(schema_info.c.key == METRICS_CHANGE)
        count = select(func.count()).select_from(metric_versions)
        with self._read() as conn:
            row = conn.execute(select(token.scalar_subquery(), count.scalar_subquery())).one()
        return str(row[0]), int(row[1])

    def _metrics_changed(self, conn: Connection) -> None:
        conn.execute(
            update(schema_info)
            .where(schema_info.c.key == METRICS_CHANGE)
            .values(value=secrets.token_hex(8))
        )

    def define_metric(self, name: str, definition: MetricDefinition) -> tuple[MetricSpec, bool]:
        """Store ``definition`` as ``name``'s current version; ``(metric, created)``.

        A new version when the spec or labels differ from the current version's (or
        there is none); otherwise the description is updated in place.
        """
        with self._write() as conn:
            if self.dialect == "postgresql":  # serialize definers of one name
                conn.exec_driver_sql(
                    "SELECT pg_advisory_xact_lock(hashtext(%(name)s))", {"name": name}
                )
            row = conn.execute(
                select(metric_versions.c.version, metric_versions.c.definition)
                .where(metric_versions.c.name == name)
                .order_by(metric_versions.c.version.desc())
                .limit(1)
            ).first()
            document = definition.model_dump_json(exclude_none=True)
            if row is not None:
                current = _metric(name, row.version, row.definition)
                if current.same_spec(definition):
                    if document != row.definition:
                        conn.execute(
                            update(metric_versions)
                            .where(metric_versions.c.name == name)
                            .where(metric_versions.c.version == row.version)
                            .values(definition=document)
                        )
                        self._metrics_changed(conn)
                    return _metric(name, row.version, document), False
            version = 1 if row is None else row.version + 1
            conn.execute(
                insert(metric_versions).values(
                    name=name, version=version, definition=document, created_at=time.time()
                )
            )
            self._metrics_changed(conn)
            return _metric(name, version, document), True

    # --- API keys ----------------------------------------------------------------

    def add_key(self, key_id: str, key_hash: str, role: str, label: str) -> bool:
        """Store a key's hash; False (and nothing changes) when that hash is already stored."""
        with self._write() as conn:
            exists = conn.execute(
                select(api_keys.c.key_id).where(api_keys.c.key_hash == key_hash)
            ).first()
            if exists is not None:
                return False
            conn.execute(
                insert(api_keys).values(
                    key_id=key_id,
                    key_hash=key_hash,
                    role=role,
                    label=label,
                    created_at=time.time(),
                    revoked_at=None,
                )
            )
            return True

    def keys(self) -> list[dict[str, Any]]:
        with self._read() as conn:
            rows = conn.execute(select(api_keys).order_by(api_keys.c.created_at)).mappings().all()
        return [dict(row) for row in rows]

    def revoke_key(self, key_id: str, label: str | None = None) -> bool:
        """Revoke an active key (and relabel it, when ``label`` is given); False if none."""
        changes: dict[str, Any] = {"revoked_at": time.time()}
        if label is not None:
            changes["label"] = label
        with self._write() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id)
                .where(api_keys.c.revoked_at.is_(None))
                .values(**changes)
            )
            return result.rowcount == 1

    def restore_key(self, key_id: str, label: str) -> bool:
        """Make a revoked key active again, relabelled; False if no revoked key has that id."""
        with self._write() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id)
                .where(api_keys.c.revoked_at.is_not(None))
                .values(revoked_at=None, label=label)
            )
            return result.rowcount == 1

    def count_keys(self) -> int:
        with self._read() as conn:
            return int(conn.execute(select(func.count()).select_from(api_keys)).scalar_one())

    # --- reports -----------------------------------------------------------------

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
            self._write_group(group, ordered, hour, optimistic=self.dialect == "sqlite")
        except _SeenBefore:  # rolled back: once more, skipping the ids already stored
            self._write_group(group, ordered, hour, optimistic=False)

    def _write_group(
        self, group: list[Submission], ordered: list[bytes], hour: int, optimistic: bool
    ) -> None:
        with self._write() as conn:
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

        SQLite: ``optimistic`` inserts every id with one prepared statement run over all
        of them (faster than one many-row ``VALUES`` list with ``RETURNING``, or a
        savepoint to undo a partial insert, as the ingest benchmark shows); if any id was
        already stored, it raises ``_SeenBefore`` for the caller to roll back and come
        again without ``optimistic``: the stored ids are looked up, then the others
        inserted (a retried batch is the rare case).
        """
        if self.dialect == "postgresql":
            result = conn.exec_driver_sql(
                "INSERT INTO report_ids (report_id, received_hour) "
                "SELECT unnest(%(ids)s::bytea[]), %(hour)s "
                "ON CONFLICT DO NOTHING RETURNING report_id",
                {"ids": ordered, "hour": hour},
            )
            return {bytes(row[0]) for row in result}
        # The sqlite3 cursor itself: this is the hot path, and rows need no wrapping.
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            if optimistic:
                cursor.executemany(_INSERT_REPORT_ID, [(report_id, hour) for report_id in ordered])
                if cursor.rowcount != len(ordered):
                    raise _SeenBefore
                return set(ordered)
            stored: set[bytes] = set()
            for start in range(0, len(ordered), 8192):  # well under SQLite's 32766 variables
                chunk = ordered[start : start + 8192]
                cursor.execute(
                    "SELECT report_id FROM report_ids WHERE report_id IN "
                    f"({','.join('?' * len(chunk))})",
                    chunk,
                )
                stored.update(row[0] for row in cursor.fetchall())
            new = [report_id for report_id in ordered if report_id not in stored]
            cursor.executemany(_INSERT_REPORT_ID, [(report_id, hour) for report_id in new])
            return set(new)
        finally:
            cursor.close()

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
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [PartialRow(r.metric, r.version, r.bucket, r.n, bytes(r.stats)) for r in rows]

    def add_partial_rows(self, rows: Sequence[PartialRow]) -> None:
        """Insert statistics directly (loading, benchmarks); no report ids are recorded."""
        with self._write() as conn:
            conn.execute(insert(partial_stats), [row.__dict__ for row in rows])

    def report_count(self) -> int:
        """How many distinct report ids have been accepted."""
        with self._read() as conn:
            return int(conn.execute(select(func.count()).select_from(report_ids)).scalar_one())

    def groups_to_compact(self, min_rows: int = 2) -> list[tuple[str, int, int]]:
        """The (metric, version, bucket) groups holding at least ``min_rows`` partial rows."""
        key = (partial_stats.c.metric, partial_stats.c.version, partial_stats.c.bucket)
        with self._read() as conn:
            rows = conn.execute(select(*key).group_by(*key).having(func.count() >= min_rows)).all()
        return [(row[0], row[1], row[2]) for row in rows]

    def compact_group(self, metric: str, version: int, bucket: int, merge: Any) -> int:
        """Replace a group's partial rows by one row, their ``merge``; returns rows merged.

        ``merge(list of stats bytes) -> (n, stats bytes)``. DELETE ... RETURNING hands
        each row to exactly one transaction, so concurrent compactions never double count.
        """
        with self._write() as conn:
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

    # --- federated tasks ----------------------------------------------------------------

    def create_task(self, row: TaskRow) -> bool:
        """Store a new task; False (and nothing written) if the name is taken."""
        with self._write() as conn:
            taken = conn.execute(
                select(federated_tasks.c.name).where(federated_tasks.c.name == row.name)
            ).first()
            if taken is not None:
                return False
            conn.execute(
                insert(federated_tasks).values(
                    name=row.name, status=row.status, round=row.round, state=row.state,
                    evaluation=row.evaluation, deadline=row.deadline, created_at=time.time(),
                )
            )  # fmt: skip
            return True

    def tasks(self) -> list[TaskRow]:
        """Every federated task, by name."""
        with self._read() as conn:
            rows = conn.execute(_task_columns().order_by(federated_tasks.c.name)).all()
        return [TaskRow(*row) for row in rows]

    def task(self, name: str) -> TaskRow | None:
        with self._read() as conn:
            row = conn.execute(_task_columns().where(federated_tasks.c.name == name)).first()
        return None if row is None else TaskRow(*row)

    def update_count(self, name: str, round_number: int) -> int:
        """Uploads stored for a task's round."""
        with self._read() as conn:
            return self._round_size(conn, name, round_number)

    def add_update(
        self,
        name: str,
        update_id: bytes,
        row: UpdateRow,
        admit: Callable[[TaskRow], int],
        close: Callable[[TaskRow, list[UpdateRow]], TaskChange],
    ) -> tuple[bool, int, int]:
        """Store one upload for the task's open round: ``(new, its round, uploads in it)``.

        The task row is locked first (``FOR UPDATE`` on PostgreSQL; SQLite has one writer),
        so uploads and a round's closing never interleave. An ``update_id`` the task has
        already seen is a duplicate, whatever round it came in (a retry of an upload whose
        answer was lost): nothing is stored and its round is answered. Otherwise ``admit``
        sees the locked task and returns the round the upload is for, or raises to refuse
        it (nothing is written). After a new upload, ``close`` sees the round's uploads and
        may close the round in the same transaction: the upload that completes a round
        closes it, exactly once.
        """
        with self._write() as conn:
            task = self._lock_task(conn, name)
            if task is None:
                raise KeyError(name)
            seen = conn.execute(
                select(federated_updates.c.round)
                .where(federated_updates.c.task == name)
                .where(federated_updates.c.update_id == update_id)
            ).scalar_one_or_none()
            if seen is not None:
                return False, int(seen), self._round_size(conn, name, int(seen))
            round_number = admit(task)
            conn.execute(
                insert(federated_updates).values(
                    update_id=update_id, task=name, round=round_number, vector=row.vector,
                    unclipped=row.unclipped, num_examples=row.num_examples,
                )
            )  # fmt: skip
            uploads = self._round_uploads(conn, task)
            self._apply(conn, task, close(task, uploads))
            return True, round_number, len(uploads)

    def _round_size(self, conn: Connection, name: str, round_number: int) -> int:
        return int(
            conn.execute(
                select(func.count())
                .select_from(federated_updates)
                .where(federated_updates.c.task == name)
                .where(federated_updates.c.round == round_number)
            ).scalar_one()
        )

    def change_task(
        self, name: str, change: Callable[[TaskRow, list[UpdateRow]], TaskChange]
    ) -> TaskRow | None:
        """Apply ``change`` to a locked task and its open round's uploads, atomically.

        When ``change`` returns a ``TaskUpdate`` the task row is rewritten and, if the
        round moved on, the closed round's vectors are erased (its ids kept), or on a
        restart the open round's uploads deleted, in the same transaction. Returns the
        task as it is afterwards (None if unknown).
        """
        with self._write() as conn:
            task = self._lock_task(conn, name)
            if task is None:
                return None
            return self._apply(conn, task, change(task, self._round_uploads(conn, task)))

    def _round_uploads(self, conn: Connection, task: TaskRow) -> list[UpdateRow]:
        rows = conn.execute(
            select(
                federated_updates.c.vector,
                federated_updates.c.unclipped,
                federated_updates.c.num_examples,
            )
            .where(federated_updates.c.task == task.name)
            .where(federated_updates.c.round == task.round)
            .order_by(federated_updates.c.update_id)
        )
        return [UpdateRow(bytes(r.vector), float(r.unclipped), int(r.num_examples)) for r in rows]

    def _apply(self, conn: Connection, task: TaskRow, changed: TaskChange) -> TaskRow:
        if changed is None:
            return task
        conn.execute(
            update(federated_tasks)
            .where(federated_tasks.c.name == task.name)
            .values(
                status=changed.status,
                round=changed.round,
                state=changed.state,
                deadline=changed.deadline,
            )
        )
        open_round = (federated_updates.c.task == task.name) & (
            federated_updates.c.round == task.round
        )
        if changed.restart:  # the uploads are discarded unread, ids and all
            conn.execute(delete(federated_updates).where(open_round))
        elif changed.round != task.round:  # the round closed: erase its vectors, keep the ids
            conn.execute(update(federated_updates).where(open_round).values(vector=b""))
        return TaskRow(
            task.name, changed.status, changed.round, changed.state, task.evaluation,
            changed.deadline,
        )  # fmt: skip

    def due_tasks(self, now: float) -> list[str]:
        """Running tasks whose open round's deadline has passed."""
        with self._read() as conn:
            rows = conn.execute(
                select(federated_tasks.c.name)
                .where(federated_tasks.c.status == "running")
                .where(federated_tasks.c.deadline <= now)
            ).all()
        return [row[0] for row in rows]

    def _lock_task(self, conn: Connection, name: str) -> TaskRow | None:
        query = _task_columns().where(federated_tasks.c.name == name)
        if self.dialect == "postgresql":
            query = query.with_for_update()
        row = conn.execute(query).first()
        return None if row is None else TaskRow(*row)


def _task_columns() -> Any:
    return select(
        federated_tasks.c.name,
        federated_tasks.c.status,
        federated_tasks.c.round,
        federated_tasks.c.state,
        federated_tasks.c.evaluation,
        federated_tasks.c.deadline,
    )


def _metric(name: str, version: int, document: str) -> MetricSpec:
    return MetricSpec.model_validate({**json.loads(document), "name": name, "version": version})
