"""How a group's report ids and partial rows are stored: few statements, each id once.

On SQLite a group's ids go in by one statement per ``_IDS_PER_STATEMENT`` ids, and only
when some id was stored before (or repeated across the group's batches) does the group
run again with ``RETURNING``; PostgreSQL always uses ``RETURNING``. Either way each id is
new for the first batch that lists it, and the fold sees exactly that mask. The partial
rows go in by multi-row statements.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from aggregator.repositories import reports as reports_module
from aggregator.repositories.database import Database
from aggregator.repositories.reports import PartialRow, ReportsRepository


@pytest.fixture
def repository(database_url: str) -> Iterator[ReportsRepository]:
    database = Database(database_url)
    repository = ReportsRepository(database)
    yield repository
    repository.close()
    database.close()


def ids(count: int, start: int = 0) -> list[bytes]:
    """``count`` distinct 16-byte ids (the UUIDs with integers ``start + 1 ..``)."""
    return [uuid.UUID(int=start + i + 1).bytes for i in range(count)]


def recording_fold(
    masks: dict[str, list[bool]], tag: str
) -> Callable[[list[bool]], list[PartialRow]]:
    """A fold that keeps the mask it was given and stores one row of n = the new ids."""

    def fold(new: list[bool]) -> list[PartialRow]:
        masks[tag] = list(new)
        return [PartialRow("m", 1, 0, sum(new), b"")]

    return fold


def wait_for(count: Callable[[], int], at_least: int, what: str, timeout: float = 20.0) -> None:
    """Wait until ``count()`` reaches ``at_least``."""
    deadline = time.monotonic() + timeout
    while count() < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def stored_n(repository: ReportsRepository) -> int:
    return sum(row.n for row in repository.partial_rows("m", 1))


def test_an_id_in_two_batches_of_one_group_is_new_for_the_first_only(
    repository: ReportsRepository,
) -> None:
    """Two overlapping batches wait behind a commit, so they share the next transaction;
    on SQLite the optimistic insert meets the repeated id and the group runs again."""
    entered, release = threading.Event(), threading.Event()
    replies: dict[str, tuple[int, int]] = {}
    masks: dict[str, list[bool]] = {}

    def blocking_fold(new: list[bool]) -> list[PartialRow]:
        entered.set()
        assert release.wait(20)
        return [PartialRow("m", 1, 0, sum(new), b"")]

    def send(tag: str, batch: list[bytes], fold: Callable[[list[bool]], Any]) -> None:
        replies[tag] = repository.ingest(batch, fold)

    queue = repository._committer._queue
    threads = [threading.Thread(target=send, args=("first", ids(1, 1000), blocking_fold))]
    threads[0].start()
    assert entered.wait(20)  # the writer holds the first batch's transaction open
    for tag, start in (("a", 0), ("b", 5)):  # ids 1..10 and 6..15: five in both
        threads.append(
            threading.Thread(target=send, args=(tag, ids(10, start), recording_fold(masks, tag)))
        )
        threads[-1].start()
        wait_for(queue.qsize, len(threads) - 1, f"batch {tag} to queue")
    release.set()
    for thread in threads:
        thread.join()

    assert replies == {"first": (1, 0), "a": (10, 0), "b": (5, 5)}
    assert masks == {"a": [True] * 10, "b": [False] * 5 + [True] * 5}
    assert repository.report_count() == 16
    assert stored_n(repository) == 16


def record_statements(database: Database, table: str) -> list[tuple[str, bool]]:
    """``(statement, executemany)`` of every statement on ``table`` from now on."""
    statements: list[tuple[str, bool]] = []

    @event.listens_for(database.engine, "before_cursor_execute")
    def record(*args: Any) -> None:
        statement, executemany = args[2], args[5]
        if table in statement:
            statements.append((statement, executemany))

    return statements


def test_sqlite_stores_a_group_by_one_statement_per_chunk_of_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One statement (not one per id) per ``_IDS_PER_STATEMENT`` ids, and a retry that
    overlaps stored ids is told apart id by id across the chunks."""
    monkeypatch.setattr(reports_module, "_IDS_PER_STATEMENT", 3)
    database = Database(str(tmp_path / "ids.sqlite3"))
    repository = ReportsRepository(database)
    statements = record_statements(database, "report_ids")

    masks: dict[str, list[bool]] = {}
    try:
        assert repository.ingest(ids(10), recording_fold(masks, "new")) == (10, 0)
        assert len(statements) == 4  # ceil(10 / 3) statements
        assert not any(many for _, many in statements)
        assert not any("RETURNING" in statement for statement, _ in statements)

        statements.clear()
        retry = [*ids(3, 20), *ids(4, 6), *ids(3, 30)]  # ids 7..10 were stored above
        assert repository.ingest(retry, recording_fold(masks, "retry")) == (6, 4)
        assert masks["retry"] == [True] * 3 + [False] * 4 + [True] * 3
        returning = [statement for statement, _ in statements if "RETURNING" in statement]
        assert len(returning) == 4  # the optimistic statements rolled back, then these
        assert repository.report_count() == 16
        assert stored_n(repository) == 16
    finally:
        repository.close()
        database.close()


def test_partial_rows_go_in_by_multi_row_statements(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reports_module, "_ROWS_PER_STATEMENT", 2)
    database = Database(database_url)
    repository = ReportsRepository(database)
    statements = record_statements(database, "INSERT INTO partial_stats")
    rows = [PartialRow("m", 1, 3600 * hour, hour + 1, bytes([hour])) for hour in range(5)]
    try:
        assert repository.ingest(ids(15), lambda new: rows) == (15, 0)
        assert len(statements) == 3  # ceil(5 / 2), each one driver call
        assert not any(many for _, many in statements)
        assert sorted(repository.partial_rows("m", 1), key=lambda row: row.bucket) == rows
    finally:
        repository.close()
        database.close()
