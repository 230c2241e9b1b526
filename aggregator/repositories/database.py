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

Failures. A database failure that means "unavailable now" (unreachable, silent, full,
shutting down: ``aggregator/repositories/availability.py``) leaves ``read()`` and
``write()`` as ``StorageUnavailableError``, which the service answers 503 with
``Retry-After``. Every wait on PostgreSQL is bounded by ``timeout`` (default
``DEFAULT_TIMEOUT`` seconds): the connection attempt (``connect_timeout``), a send the
peer does not acknowledge (``tcp_user_timeout``), an idle connection's peer (TCP
keepalives), a free pooled connection (``pool_timeout``), and each round trip, which a
``Watchdog`` drops when the connection has waited that long in silence
(``aggregator/repositories/watchdog.py``). A pooled connection is pinged, under the
watchdog, before it is used again, and replaced when the ping fails. The server is told
to cancel a statement, and to end a session idle inside a transaction, after
``SERVER_LIMIT_FACTOR`` times ``timeout`` (``statement_timeout``,
``idle_in_transaction_session_timeout``), so that a client partitioned away releases its
locks. Options given in the URL's query win over these.

A SQLite file is checked before it is opened (``aggregator/repositories/marker.py``): a
missing, empty or table-less file where a database was created before is refused with
``MissingDatabaseError``, never started afresh. Tools that only make sense against a
database the service already uses (``ldp-aggregator create-key``, ``compact``) open it with
``create=False``: where no aggregator database exists yet they get
``DatabaseNotFoundError`` instead of a new, empty one.
"""

from __future__ import annotations

import logging
import math
import secrets
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc, func, insert, inspect, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.engine.url import URL, make_url

from aggregator.repositories import marker
from aggregator.repositories.availability import StorageUnavailableError, storage_failure
from aggregator.repositories.schema import (
    METRICS_CHANGE,
    SCHEMA_VERSION,
    UPGRADES,
    metadata,
    schema_info,
)
from aggregator.repositories.watchdog import Watchdog

if sys.platform != "win32":  # the writers' lock between processes (_WritersLock)
    import fcntl

__all__ = [
    "DEFAULT_TIMEOUT",
    "SERVER_LIMIT_FACTOR",
    "Database",
    "DatabaseNotFoundError",
    "MissingDatabaseError",
    "Repository",
    "SchemaMismatchError",
    "StorageUnavailableError",
    "create_storage_engine",
    "postgresql_connect_args",
]

logger = logging.getLogger("ldp.aggregator")

#: The PostgreSQL advisory lock that serializes aggregators starting on one database.
_SCHEMA_LOCK = 0x4C44505F53434845
#: Seconds the service waits for the database (a connection, a round trip) by default.
DEFAULT_TIMEOUT = 5.0
#: PostgreSQL cancels a statement, and ends a session idle in a transaction, after this
#: many times the timeout.
SERVER_LIMIT_FACTOR = 6
#: ``Connection.info`` key of a connection not used since it was opened (no ping needed).
_FRESH = "ldp_fresh"


class SchemaMismatchError(RuntimeError):
    """The database has a schema version this aggregator cannot use or upgrade from."""


class MissingDatabaseError(SchemaMismatchError):
    """A database was created at this SQLite path before, and the file is missing, empty
    or without its tables (``aggregator/repositories/marker.py``)."""


class DatabaseNotFoundError(LookupError):
    """No aggregator database exists at the URL, and the caller asked not to create one."""


def create_storage_engine(url: str, timeout: float = DEFAULT_TIMEOUT) -> Engine:
    """An engine for ``url``: a file path or ``sqlite:///...`` (WAL), or ``postgresql+psycopg://``.

    A bare path means SQLite (``Database`` creates its directory on a first start).
    PostgreSQL connections get the time limits of ``postgresql_connect_args(url, timeout)``.
    """
    if not timeout > 0:
        raise ValueError(f"the database timeout must be positive, got {timeout!r}")
    parsed = _sqlite_url(url) if "://" not in url else make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise ValueError("the aggregator needs a SQLite file, not an in-memory database")
        engine = create_engine(parsed, connect_args={"timeout": 30.0, "check_same_thread": False})
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(
            parsed,
            connect_args=postgresql_connect_args(parsed, timeout),
            pool_size=8,
            max_overflow=8,
            pool_timeout=timeout,
        )
    raise ValueError(
        f"unsupported database {parsed.get_backend_name()!r}: use SQLite or PostgreSQL"
    )


def _sqlite_url(path: str) -> URL:
    """The ``sqlite:///`` URL of a file path."""
    return make_url(f"sqlite:///{Path(path).expanduser()}")


def postgresql_connect_args(url: URL, timeout: float) -> dict[str, Any]:
    """libpq parameters that bound every wait of a connection by about ``timeout`` seconds.

    ``connect_timeout`` (whole seconds, at least 2, libpq's minimum), TCP keepalives (an
    idle connection's dead peer is found after ``timeout`` + 3 probes 1 s apart),
    ``tcp_user_timeout`` (a send unacknowledged for ``timeout``), and the server's
    ``statement_timeout`` and ``idle_in_transaction_session_timeout`` at
    ``SERVER_LIMIT_FACTOR * timeout``. A parameter in the URL's query is left as given;
    ``options`` in the URL come after these, so theirs win.
    """
    query: Mapping[str, Any] = url.query
    seconds = math.ceil(timeout)
    limits = {
        "connect_timeout": max(2, seconds),
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": math.ceil(timeout * 1000),
    }
    args: dict[str, Any] = {name: value for name, value in limits.items() if name not in query}
    server = round(SERVER_LIMIT_FACTOR * timeout * 1000)
    options = f"-c statement_timeout={server} -c idle_in_transaction_session_timeout={server}"
    given = query.get("options")
    given = " ".join(given) if isinstance(given, tuple) else given
    args["options"] = f"{options} {given}" if given else options
    return args


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


def _watch_round_trips(engine: Engine, watchdog: Watchdog) -> None:
    """Arm ``watchdog`` for each statement, and for a new connection until its first checkout
    (the driver's and the dialect's set-up queries); mark new connections fresh."""

    @event.listens_for(engine, "first_connect", insert=True)
    @event.listens_for(engine, "connect", insert=True)
    def _opened(dbapi_connection: Any, record: Any) -> None:
        record.info[_FRESH] = True
        watchdog.arm(dbapi_connection)

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        watchdog.disarm(dbapi_connection)

    @event.listens_for(engine, "before_cursor_execute")
    def _sending(_conn: Connection, cursor: Any, *_: Any) -> None:
        watchdog.arm(cursor.connection)

    @event.listens_for(engine, "after_cursor_execute")
    def _answered(_conn: Connection, cursor: Any, *_: Any) -> None:
        watchdog.disarm(cursor.connection)

    @event.listens_for(engine, "handle_error")
    def _failed(context: Any) -> None:
        cursor = getattr(context.execution_context, "cursor", None)
        if cursor is not None:
            watchdog.disarm(cursor.connection)


def _never_created(file: Path) -> bool:
    """Whether no aggregator database was ever at ``file`` (neither the file nor its marker:
    a marker without its file is ``MissingDatabaseError``'s to explain)."""
    return not file.exists() and not marker.marker_of(file).exists()


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
    (thread-safe; one per process, shared by its repositories).

    ``timeout``: the longest, in seconds, the service waits for the database at a time
    (see the module's docstring); a ``StorageUnavailableError`` says when to retry by it.
    ``create``: whether a database without the aggregator's tables (a new SQLite file, an
    empty PostgreSQL database) gets them; if not, it is refused with
    ``DatabaseNotFoundError`` and left as it was.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, create: bool = True) -> None:
        self.engine = create_storage_engine(url, timeout)
        self.timeout = timeout
        self.dialect = self.engine.dialect.name
        sqlite_file = self.dialect == "sqlite"
        self._file = Path(str(self.engine.url.database)).expanduser() if sqlite_file else None
        if not create and self._file is not None and _never_created(self._file):
            self.engine.dispose()  # before anything is written beside the file
            raise DatabaseNotFoundError("the file does not exist")
        if self._file is not None:
            self._file.parent.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock() if sqlite_file else None
        self._writers_lock = (
            _WritersLock(Path(str(self.engine.url.database) + "-writers.lock"))
            if sqlite_file
            else None
        )
        self._writer: Connection | None = None
        self._create = create
        self._watchdog = Watchdog(timeout) if self.dialect == "postgresql" else None
        if self._watchdog is not None:
            _watch_round_trips(self.engine, self._watchdog)
        try:
            if self._writers_lock is not None:  # starts on one file take turns
                with self._writers_lock:
                    self._initialize()
            else:
                self._initialize()
        except BaseException:
            self.close()
            raise

    def _initialize(self) -> None:
        """Create the tables (unless told not to), or upgrade them to ``SCHEMA_VERSION``;
        refuse a later version, and a SQLite file that lost its database."""
        if self._file is not None and (reason := marker.refusal(self._file)) is not None:
            raise MissingDatabaseError(reason)
        with self.engine.begin() as conn:
            if self.dialect == "postgresql":  # concurrent starts take turns
                conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK)))
            if (
                self._file is not None
                and marker.marker_of(self._file).exists()
                and not inspect(conn).has_table(schema_info.name)
            ):
                raise MissingDatabaseError(marker.schema_lost(self._file))
            if not self._create and not inspect(conn).has_table(schema_info.name):
                raise DatabaseNotFoundError("it holds none of the aggregator's tables")
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
        if self._file is not None:
            marker.mark(self._file)

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
        with self._available():
            if self._write_lock is None or self._writers_lock is None:
                with self._connect() as conn, self._transaction(conn):
                    yield conn
                return
            with self._write_lock, self._writers_lock:
                if self._writer is None or self._writer.invalidated:
                    if self._writer is not None:
                        self._writer.close()
                    self._writer = self.engine.connect()
                with self._transaction(self._writer):
                    yield self._writer

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction on one snapshot; it never waits for the writers."""
        with self._available(), self._connect() as conn:
            if self.dialect == "sqlite":
                conn = conn.execution_options(sqlite_begin="DEFERRED")
            else:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with self._transaction(conn):
                yield conn

    def ping(self) -> None:
        """One round trip to the database (``StorageUnavailableError`` when it fails)."""
        with self.read() as conn:
            conn.execute(select(1)).scalar_one()

    @contextmanager
    def _available(self) -> Iterator[None]:
        """Raise a database failure that means "unavailable now" as ``StorageUnavailableError``."""
        try:
            yield
        except (exc.DBAPIError, exc.TimeoutError) as error:
            reason = storage_failure(error)
            if reason is None:
                raise
            cause = getattr(error, "orig", None) or error
            logger.warning(
                "storage unavailable: %s (%s: %s)",
                reason,
                type(cause).__name__,
                " ".join(str(cause).split())[:200],
            )
            raise StorageUnavailableError(reason, self.timeout) from error

    def _connect(self) -> Connection:
        """A pooled connection; on PostgreSQL one used before is pinged first (under the
        watchdog). When the ping fails at once (the server closed or reset the connection)
        a new connection replaces it; when it went unanswered until the watchdog dropped
        it, the database is away, and waiting once more to connect would only double the
        wait: ``StorageUnavailableError``."""
        conn = self.engine.connect()
        if self._watchdog is None or conn.info.pop(_FRESH, False):
            return conn
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None  # checked out, not invalidated
        try:
            with self._watchdog.waiting(dbapi_connection) as wait:
                self.engine.dialect.do_ping(dbapi_connection)
        except self.engine.dialect.loaded_dbapi.Error as error:
            conn.invalidate()
            conn.close()
            if wait.dropped:
                reason = f"the database did not answer within {self.timeout:g} s"
                logger.warning("storage unavailable: %s (a ping)", reason)
                raise StorageUnavailableError(reason, self.timeout) from error
            conn = self.engine.connect()
            conn.info.pop(_FRESH, None)
        return conn

    @contextmanager
    def _transaction(self, conn: Connection) -> Iterator[None]:
        """Begin on ``conn``; commit on leaving, roll back on an exception (the commit and the
        rollback under the watchdog, like every statement)."""
        transaction = conn.begin()
        try:
            yield
        except BaseException:
            with self._watching(conn):
                transaction.rollback()
            raise
        with self._watching(conn):
            transaction.commit()

    def _watching(self, conn: Connection) -> Any:
        """The watchdog armed on ``conn``'s DBAPI connection (nothing to watch on SQLite, or
        once the connection was invalidated)."""
        if self._watchdog is None or conn.invalidated or conn.closed:
            return nullcontext()
        return self._watchdog.waiting(conn.connection.dbapi_connection)

    def close(self) -> None:
        if self._write_lock is not None:
            with self._write_lock:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
        if self._writers_lock is not None:
            self._writers_lock.close()
        if self._watchdog is not None:
            self._watchdog.close()
        self.engine.dispose()


class Repository:
    """The base of the repositories: the ``Database`` whose transactions they run.

    Several repositories share one database (``aggregator.storage.Repositories``); each
    is built over it alone, and none closes it.
    """

    def __init__(self, database: Database) -> None:
        self.database = database
