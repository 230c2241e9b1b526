"""The parts that turn a database that cannot serve into prompt 503s, one by one.

* ``storage_failure``: which driver errors mean "unavailable now" (503) and which are
  defects (500);
* ``postgresql_connect_args``: every libpq wait bounded, the URL's own settings kept;
* ``Watchdog``: a connection silent past its limit is shut down, one that keeps
  receiving is not;
* ``GroupCommitter``: unavailable storage fails a whole group at once (no retry per
  batch), a submitter's wait is bounded, and ``trouble`` reports a failed writer until
  a commit succeeds.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import exc
from sqlalchemy.engine import make_url

from aggregator.group_commit import WAIT_FACTOR, GroupCommitter, Submission
from aggregator.repositories.availability import StorageUnavailableError, storage_failure
from aggregator.repositories.database import SERVER_LIMIT_FACTOR, postgresql_connect_args
from aggregator.repositories.watchdog import Watchdog


def sqlite_error(code: int, message: str) -> exc.OperationalError:
    original = sqlite3.OperationalError(message)
    original.sqlite_errorcode = code
    return exc.OperationalError("INSERT ...", {}, original)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (sqlite_error(13, "database or disk is full"), "the database is full"),
        (sqlite_error(5, "database is locked"), "the database is busy"),
        (sqlite_error(10 | (3 << 8), "disk I/O error"), "the database's disk failed (I/O error)"),
        (
            exc.OperationalError("COMMIT", {}, psycopg.errors.QueryCanceled("timeout")),
            "the database did not finish the statement in time",
        ),
        (
            exc.OperationalError("SELECT", {}, psycopg.errors.DiskFull("no space")),
            "the database is full",
        ),
        (
            exc.OperationalError("SELECT", {}, psycopg.errors.AdminShutdown("bye")),
            "the database refused the request (SQLSTATE 57P01)",
        ),
        (
            exc.OperationalError("SELECT", {}, psycopg.OperationalError("connection lost")),
            "the database did not answer, or the connection to it was lost",
        ),
        (exc.TimeoutError("pool"), "no database connection became free in time"),
    ],
    ids=[
        "sqlite-full",
        "sqlite-busy",
        "sqlite-ioerr",
        "pg-timeout",
        "pg-full",
        "pg-shutdown",
        "pg-lost",
        "pool",
    ],  # fmt: skip
)
def test_failures_that_mean_unavailable(error: Exception, reason: str) -> None:
    assert storage_failure(error) == reason


@pytest.mark.parametrize(
    "error",
    [
        sqlite_error(1, "no such table: report_ids"),
        exc.ProgrammingError("SELECT", {}, psycopg.errors.UndefinedTable("no table")),
        exc.IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate")),
        ValueError("not a database error"),
    ],
    ids=["sqlite-missing-table", "pg-missing-table", "pg-unique", "other"],
)
def test_defects_stay_defects(error: Exception) -> None:
    assert storage_failure(error) is None


def test_the_error_says_why_and_when_to_retry() -> None:
    error = StorageUnavailableError("the database is full", retry_after=2.2, advice="send again")
    assert str(error) == "the database is full; send again"
    assert error.retry_after == 3
    copy = error.again("later")
    assert copy is not error and str(copy) == "the database is full; later"
    assert copy.retry_after == 3


def test_every_libpq_wait_is_bounded_and_the_url_wins() -> None:
    args = postgresql_connect_args(make_url("postgresql+psycopg://u@h/db"), 2.5)
    assert args["connect_timeout"] == 3 and args["tcp_user_timeout"] == 2500
    assert args["keepalives"] == 1 and args["keepalives_idle"] == 3
    server = round(SERVER_LIMIT_FACTOR * 2.5 * 1000)
    assert args["options"] == (
        f"-c statement_timeout={server} -c idle_in_transaction_session_timeout={server}"
    )
    given = make_url(
        "postgresql+psycopg://u@h/db?connect_timeout=30&options=-c statement_timeout=0"
    )
    args = postgresql_connect_args(given, 2.5)
    assert "connect_timeout" not in args  # the URL's value is used
    assert args["options"].endswith("-c statement_timeout=0")  # last: it wins
    assert postgresql_connect_args(make_url("postgresql://h/db"), 0.5)["connect_timeout"] == 2


# --- the watchdog -----------------------------------------------------------------------


class FakeConnection:
    """What the watchdog needs of a DBAPI connection: its socket's descriptor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def test_a_silent_connection_is_shut_down_and_its_waiter_freed(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _ = tcp_pair
    watchdog = Watchdog(0.3)
    try:
        connection = FakeConnection(client)
        with watchdog.waiting(connection):
            client.settimeout(30)
            assert client.recv(1) == b""  # the watchdog ended the wait: end of stream
        assert watchdog.dropped == 1
    finally:
        watchdog.close()


@pytest.mark.slow
def test_a_connection_that_keeps_receiving_is_left_alone(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    watchdog = Watchdog(0.3)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.05):
            server.sendall(b".")

    sender = threading.Thread(target=trickle)
    try:
        connection = FakeConnection(client)
        sender.start()
        with watchdog.waiting(connection):
            received = 0
            while received < 30:  # about 1.5 s, five times the limit, never silent long
                received += len(client.recv(64))
        assert watchdog.dropped == 0
    finally:
        stop.set()
        sender.join()
        watchdog.close()


def test_a_disarmed_connection_is_never_shut_down(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    watchdog = Watchdog(0.1)
    try:
        with watchdog.waiting(FakeConnection(client)):
            pass
        time.sleep(0.4)
        server.sendall(b"x")
        assert client.recv(1) == b"x"
        assert watchdog.dropped == 0
    finally:
        watchdog.close()


# --- the group-commit writer ------------------------------------------------------------


def fold(new: list[bool]) -> list[Any]:
    return []


def test_unavailable_storage_fails_the_whole_group_without_retrying_each_batch() -> None:
    gate = threading.Event()
    calls: list[int] = []

    def commit(group: list[Submission]) -> None:
        calls.append(len(group))
        gate.wait(10)
        raise StorageUnavailableError("the database is full", 1.0)

    committer: GroupCommitter[Submission] = GroupCommitter(commit, timeout=5.0)
    errors: list[BaseException] = []

    def send(index: int) -> None:
        try:
            committer.submit(Submission([bytes([index])], fold))
        except StorageUnavailableError as error:
            errors.append(error)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    threads[0].start()
    while not calls:
        time.sleep(0.001)
    for thread in threads[1:]:
        thread.start()
    while committer._queue.qsize() < 5:
        time.sleep(0.001)
    gate.set()
    for thread in threads:
        thread.join()
    assert calls == [1, 5]  # each group tried once, not once more per batch
    assert len(errors) == 6 and len({id(error) for error in errors}) == 6
    assert all(str(error) == "the database is full" for error in errors)
    trouble = committer.trouble()
    assert trouble is not None and "the database is full" in trouble
    gate.clear()
    committer._commit = lambda group: None  # the database has room again
    assert committer.submit(Submission([b"x"], fold)) == 0
    assert committer.trouble() is None
    committer.close()


def test_a_submitter_waits_a_bounded_time_and_its_batch_is_dropped_unless_taken() -> None:
    release = threading.Event()
    committed: list[list[bytes]] = []

    def commit(group: list[Submission]) -> None:
        release.wait(30)  # a writer stuck on the database
        committed.extend(list(submission.ids) for submission in group)

    timeout = 0.05
    committer: GroupCommitter[Submission] = GroupCommitter(commit, timeout=timeout)
    stuck = threading.Thread(target=lambda: pytest.raises(
        StorageUnavailableError, committer.submit, Submission([b"taken"], fold)
    ))  # fmt: skip
    stuck.start()
    while committer._committing_since is None:
        time.sleep(0.001)
    with pytest.raises(StorageUnavailableError, match=f"within {WAIT_FACTOR * timeout:g} s"):
        committer.submit(Submission([b"queued"], fold))
    while committer.trouble() is None:  # past twice the timeout the commit is stalled
        time.sleep(0.01)
    assert "waiting" in committer.trouble()  # type: ignore[operator]
    release.set()
    stuck.join()
    committer.close()
    assert committed == [[b"taken"]]  # the abandoned queued batch was never committed
