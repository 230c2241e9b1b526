"""Which database failures mean "storage is unavailable now, retry later".

A request that meets one of them is answered 503 with ``Retry-After``
(``StorageUnavailableError``), not 500: the database cannot be reached or did not answer
in time, it is full, its disk failed, it is shutting down, or it cancelled the statement
(a timeout, a deadlock, a serialization failure). Nothing of such a request is known to
be stored, so its client sends it again; a batch sent again is counted once, by its
report ids. Every other database error (a constraint, a missing table) is a defect and
stays a 500.

* SQLite: the primary result codes BUSY, LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN
  and PROTOCOL (``sqlite3.Error.sqlite_errorcode``, low byte).
* PostgreSQL: the SQLSTATE classes 08 (connection), 40 (transaction rollback), 53
  (insufficient resources: disk full, out of memory), 57 (operator intervention: query
  cancelled by ``statement_timeout``, shutdown) and 58 (system error), and 55P03 (lock not
  available); and every driver error without a SQLSTATE (the connection was lost, or
  the connection attempt timed out).
* Any error SQLAlchemy saw invalidate the connection, and the pool's own timeout.
"""

from __future__ import annotations

import math

from sqlalchemy import exc

__all__ = ["StorageUnavailableError", "storage_failure"]

#: SQLite primary result codes of a database that cannot serve now, and what they mean.
_SQLITE_UNAVAILABLE = {
    5: "the database is busy",
    6: "the database is locked",
    7: "the database ran out of memory",
    8: "the database is read-only",
    10: "the database's disk failed (I/O error)",
    13: "the database is full",
    14: "the database file cannot be opened",
    15: "the database's file locks failed",
}
#: PostgreSQL SQLSTATE classes (first two characters) of a database that cannot serve now.
_POSTGRESQL_CLASSES = {"08", "40", "53", "57", "58"}
_POSTGRESQL_CODES = {"55P03"}
_POSTGRESQL_FULL = "53100"
_POSTGRESQL_TIMEOUT = "57014"


class StorageUnavailableError(Exception):
    """The database cannot serve now (unreachable, silent, full, shutting down).

    ``reason`` says why in a few words; ``retry_after`` is when to try again, in whole
    seconds (the ``Retry-After`` header); ``advice``, if any, what the client should do.
    The message is the reason, then the advice.
    """

    def __init__(self, reason: str, retry_after: float = 5.0, advice: str = "") -> None:
        self.reason = reason
        self.retry_after = max(1, math.ceil(retry_after))
        self.advice = advice
        super().__init__(f"{reason}; {advice}" if advice else reason)

    def again(self, advice: str | None = None) -> StorageUnavailableError:
        """A new error for the same failure (one per request: an exception raised in several
        threads at once would share one traceback), with ``advice`` in place of its own."""
        fresh = StorageUnavailableError(
            self.reason, self.retry_after, self.advice if advice is None else advice
        )
        fresh.__cause__ = self.__cause__
        return fresh


def storage_failure(error: BaseException) -> str | None:
    """Why ``error`` means the storage is unavailable now (a few words), or None when it
    is a defect to report as such."""
    if isinstance(error, exc.TimeoutError):
        return "no database connection became free in time"
    if not isinstance(error, exc.DBAPIError):
        return None
    original = error.orig
    code = getattr(original, "sqlite_errorcode", None)
    if isinstance(code, int):
        return _SQLITE_UNAVAILABLE.get(code & 0xFF)
    state = getattr(original, "sqlstate", None)
    if isinstance(state, str) and state:
        if state == _POSTGRESQL_FULL:
            return "the database is full"
        if state == _POSTGRESQL_TIMEOUT:
            return "the database did not finish the statement in time"
        if state[:2] in _POSTGRESQL_CLASSES or state in _POSTGRESQL_CODES:
            return f"the database refused the request (SQLSTATE {state})"
        return "the connection to the database was lost" if error.connection_invalidated else None
    if error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError):
        return "the database did not answer, or the connection to it was lost"
    return None
