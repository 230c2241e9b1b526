"""The database the repositories share: its engine, its schema, its transactions.

SQLAlchemy 2 over SQLite (WAL) or PostgreSQL. ``Database(url)`` creates the tables on
a first start (``aggregator/repositories/schema.py``), upgrades a database of an
earlier schema version, and refuses one of a later version. Repositories run every
statement inside one of two transactions:

* ``write()`` may write. SQLite has one writer at a time: within a process the writers
  queue on a lock (rather than in SQLite's busy handler, which sleeps and polls);
  between processes sharing the file they take turns on an exclusive ``flock`` of
  ``<database>-writers.lock``, which wakes the next writer as soon as it is released;
  and they all write through one connection, whose page cache stays warm (SQLite drops
  a connection's cache when another connection wrote since). ``BEGIN IMMEDIATE`` takes
  SQLite's write lock at the start, so a writer never fails to upgrade a read lock.
  PostgreSQL runs writers concurrently, at READ COMMITTED.
* ``read()`` only reads, from one snapshot (SQLite ``BEGIN DEFERRED`` in WAL mode,
  PostgreSQL REPEATABLE READ), and never waits for the writers.

Hold a transaction for statements only: what takes time is computed before ``write()``
and committed after, so that a writer never waits on another's computation.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.engine.url import make_url

from aggregator.repositories.schema import (
    METRICS_CHANGE,
    SCHEMA_VERSION,
    UPGRADES,
    metadata,
    schema_info,
)

if sys.platform != "win32":  # the writers' lock between processes (_WritersLock)
    import fcntl

__all__ = ["Database", "Repository", "SchemaMismatchError", "create_storage_engine"]

#: The PostgreSQL advisory lock that serializes aggregators starting on one database.
_SCHEMA_LOCK = 0x4C44505F53434845


class SchemaMismatchError(RuntimeError):
    """The database has a schema version this aggregator cannot use or upgrade from."""


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
        # Checkpoint past ~160 MiB of WAL rather than 4 MiB: a random-key index dirties pages
        # all over the file, and a page changed by many commits is copied back once.
        cursor.execute("PRAGMA wal_autocheckpoint=40000")
        # Statement journals (the pages a multi-row insert changes, kept until it ends) in
        # memory: in a temporary file they double the cost of inserting a batch's ids.
        cursor.execute("PRAGMA temp_store=MEMORY")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")


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


class Database:
    """One database: the engine, the schema, and the read and write transactions
    (thread-safe; one per process, shared by its repositories)."""

    def __init__(self, url: str) -> None:
        self.engine = create_storage_engine(url)
        self.dialect = self.engine.dialect.name
        sqlite_file = self.dialect == "sqlite"
        self._write_lock = threading.Lock() if sqlite_file else None
        self._writers_lock = (
            _WritersLock(Path(str(self.engine.url.database) + "-writers.lock"))
            if sqlite_file
            else None
        )
        self._writer: Connection | None = None
        self._initialize()

    def _initialize(self) -> None:
        """Create the tables, or upgrade them to ``SCHEMA_VERSION``; refuse a later version."""
        with self.engine.begin() as conn:
            if self.dialect == "postgresql":  # concurrent starts take turns
                conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK)))
            metadata.create_all(conn)
            found = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one_or_none()
            if found is None:
                conn.execute(
                    insert(schema_info).values(key="schema_version", value=str(SCHEMA_VERSION))
                )
            elif found != str(SCHEMA_VERSION):
                self._upgrade(conn, found)
            dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
            conn.execute(  # a database from before the change token gets one
                dialect_insert(schema_info)
                .values(key=METRICS_CHANGE, value=secrets.token_hex(8))
                .on_conflict_do_nothing()
            )

    @staticmethod
    def _upgrade(conn: Connection, found: str) -> None:
        """Bring a database of schema version ``found`` to ``SCHEMA_VERSION``, or refuse it."""
        steps = range(int(found), SCHEMA_VERSION) if found.isdigit() else None
        if not steps or any(version not in UPGRADES for version in steps):
            raise SchemaMismatchError(
                f"the database has schema version {found}; this aggregator needs {SCHEMA_VERSION}"
            )
        for version in steps:
            UPGRADES[version](conn)
        conn.execute(
            update(schema_info)
            .where(schema_info.c.key == "schema_version")
            .values(value=str(SCHEMA_VERSION))
        )

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A transaction that may write, committed on leaving (rolled back on an exception)."""
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
    def read(self) -> Iterator[Connection]:
        """A read-only transaction on one snapshot; it never waits for the writers."""
        with self.engine.connect() as conn:
            if self.dialect == "sqlite":
                conn = conn.execution_options(sqlite_begin="DEFERRED")
            else:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    def ping(self) -> None:
        """One round trip to the database (raises whatever the driver raises)."""
        with self.read() as conn:
            conn.execute(select(1)).scalar_one()

    def close(self) -> None:
        if self._write_lock is not None:
            with self._write_lock:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
        if self._writers_lock is not None:
            self._writers_lock.close()
        self.engine.dispose()


class Repository:
    """The base of the repositories: the ``Database`` whose transactions they run.

    Repositories combine by inheritance over one database (``aggregator.storage.Storage``),
    so ``__init__`` and ``close`` cooperate along the method resolution order.
    """

    def __init__(self, database: Database) -> None:
        self.database = database

    def close(self) -> None:
        """Stop what the repository runs beside the database (the database stays open)."""
