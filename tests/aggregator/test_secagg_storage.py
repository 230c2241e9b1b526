"""The secure aggregation repository alone, on SQLite and on PostgreSQL (``database_url``).

Admission move by move (indices handed out once each under concurrent devices, retries,
conflicts, a step not yet open or closed, a task that moved), and the compare-and-swap
that closes a step or ends a round (a snapshot outgrown by a message commits nothing; an
end deletes every secure row of the round).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from aggregator.repositories.database import Database
from aggregator.repositories.schema import SECAGG_TABLES
from aggregator.repositories.secagg import Admission, Counts, SecAggRepository
from aggregator.repositories.tasks import TaskRow, TasksRepository, TaskUpdate

STATE = json.dumps({"attempt": 0})
NOW = 50.0


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    db = Database(database_url)
    yield db
    db.close()


@pytest.fixture
def repository(database: Database) -> SecAggRepository:
    assert TasksRepository(database).create_task(TaskRow("t", "running", 0, 0, STATE, None, 100.0))
    return SecAggRepository(database)


def task(repository: SecAggRepository) -> TaskRow:
    row = TasksRepository(repository.database).task("t")
    assert row is not None
    return row


def keys(index: int) -> tuple[bytes, bytes]:
    return bytes([index]) * 32, bytes([index + 100]) * 32


def session(index: int) -> bytes:
    return bytes([index]) * 32


def rows(repository: SecAggRepository) -> int:
    with repository.database.read() as conn:
        return sum(
            int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            for table in SECAGG_TABLES
        )


def test_concurrent_devices_get_each_index_once_up_to_capacity(
    repository: SecAggRepository,
) -> None:
    checked = task(repository)

    def join(index: int) -> tuple[Admission, int]:
        admitted = repository.add_participant(checked, session(index), keys(index), 6, NOW)
        return admitted.admission, admitted.participant

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(join, range(10)))
    added = sorted(index for admission, index in outcomes if admission is Admission.ADDED)
    assert added == list(range(6))
    assert [a for a, _ in outcomes].count(Admission.CLOSED) == 4
    assert repository.progress("t", 0, 0).counts == Counts(advertised=6)
    assert len(repository.public_keys("t", 0, 0)) == 6


def test_admission_of_keys_retries_conflicts_and_a_moved_task(
    repository: SecAggRepository,
) -> None:
    checked = task(repository)
    first = repository.add_participant(checked, session(1), keys(1), 5, NOW)
    assert (first.admission, first.participant) == (Admission.ADDED, 0)
    again = repository.add_participant(checked, session(1), keys(1), 5, NOW)
    assert (again.admission, again.participant) == (Admission.DUPLICATE, 0)
    other = repository.add_participant(checked, session(1), keys(2), 5, NOW)
    assert other.admission is Admission.CONFLICT
    late = repository.add_participant(checked, session(2), keys(2), 5, now=100.0)
    assert late.admission is Admission.CLOSED  # at the deadline
    moved = TaskRow("t", "running", 0, 1, STATE, None, 100.0)
    assert repository.add_participant(moved, session(3), keys(3), 5, NOW).admission is (
        Admission.MOVED
    )
    found = repository.participant("t", 0, 0, session(1))
    assert found is not None and found.index == 0 and found.encryption_key == keys(1)[0]


def test_messages_wait_for_the_step_before_and_stop_when_theirs_closes(
    repository: SecAggRepository,
) -> None:
    checked = task(repository)
    for index in range(3):
        repository.add_participant(checked, session(index), keys(index), 3, NOW)
    shares = [(1, b"to 1"), (2, b"to 2")]
    early = repository.add_shares(checked, 0, b"d" * 32, shares, NOW)
    assert early is Admission.EARLY and repository.inbox("t", 0, 0, 1) == []
    snapshot = repository.progress("t", 0, 0)
    assert repository.close_step(checked, "keys", (0, 1, 2), "{}", snapshot.counts, 200.0)
    assert not repository.close_step(checked, "keys", (0, 1, 2), "{}", snapshot.counts, 200.0)
    checked = task(repository)
    assert checked.deadline == 200.0  # the shares step's
    assert repository.add_shares(checked, 0, b"d" * 32, shares, NOW) is Admission.ADDED
    assert repository.add_shares(checked, 0, b"d" * 32, shares, NOW) is Admission.DUPLICATE
    assert repository.add_shares(checked, 0, b"e" * 32, shares, NOW) is Admission.CONFLICT
    assert repository.inbox("t", 0, 0, 2) == [(0, b"to 2")]
    # A close computed before another device's shares arrived commits nothing.
    stale = repository.progress("t", 0, 0)
    assert repository.add_shares(checked, 1, b"f" * 32, [(0, b"to 0")], NOW) is Admission.ADDED
    assert not repository.close_step(checked, "shares", (0,), None, stale.counts, 300.0)
    fresh = repository.progress("t", 0, 0)
    assert repository.senders("t", 0, 0, "shares") == [0, 1]
    assert repository.close_step(checked, "shares", (0, 1), None, fresh.counts, 300.0)
    closed = repository.add_shares(task(repository), 2, b"g" * 32, [(0, b"x")], NOW)
    assert closed is Admission.CLOSED
    progress = repository.progress("t", 0, 0)
    assert progress.step == "masked" and progress.closed["shares"].members == (0, 1)


def test_an_end_commits_once_and_deletes_the_round_rows(repository: SecAggRepository) -> None:
    checked = task(repository)
    for index in range(2):
        repository.add_participant(checked, session(index), keys(index), 2, NOW)
    snapshot = repository.snapshot("t")
    assert snapshot is not None and snapshot[0] == checked
    read = snapshot[1]
    assert read.step == "keys" and rows(repository) == 2
    # An end computed before another closed the keys step commits nothing.
    assert repository.close_step(checked, "keys", (0, 1), "{}", read.counts, 90.0)
    stale = repository.end_round(checked, read, TaskUpdate("running", 0, 1, STATE, 160.0))
    assert stale is None and task(repository).attempt == 0
    checked, read = task(repository), repository.progress("t", 0, 0)
    ended = repository.end_round(checked, read, TaskUpdate("running", 0, 1, STATE, 160.0))
    assert ended is not None and ended.position == ("running", 0, 1)
    assert rows(repository) == 0
    # The same end, computed from the same read, finds the task moved on.
    assert repository.end_round(checked, read, TaskUpdate("running", 1, 0, "x", 1.0)) is None
    assert task(repository).position == ("running", 0, 1)
