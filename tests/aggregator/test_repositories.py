"""The repositories alone, over one ``Database`` (no ``Storage``, no FastAPI), on SQLite
and on PostgreSQL (``database_url`` runs every test on both).

The tasks repository's compare-and-swap is checked move by move: a close commits only
over the task and uploads it was computed from (a second close of the same read, a read
that an upload has since outgrown, a task that moved on: each leaves nothing written);
uploads are admitted only at the position they were checked against and up to the
round's capacity. Also: the upgrade of a version-1 database, and every repository
working alone on one shared database.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from aggregator.repositories.database import Database
from aggregator.repositories.keys import KeysRepository
from aggregator.repositories.metrics import MetricsRepository
from aggregator.repositories.reports import PartialRow, ReportsRepository
from aggregator.repositories.schema import (
    SCHEMA_VERSION,
    federated_tasks,
    federated_updates,
    schema_info,
)
from aggregator.repositories.tasks import (
    Admission,
    TaskRow,
    TasksRepository,
    TaskUpdate,
    UpdateRow,
)
from shared.schemas import MechanismSpec, MetricDefinition

#: The repository stores a task's state as text it never parses: any text will do here.
STATE = json.dumps({"attempt": 0, "step": "initial"})


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    db = Database(database_url)
    yield db
    db.close()


@pytest.fixture
def tasks(database: Database) -> TasksRepository:
    repository = TasksRepository(database)
    assert repository.create_task(TaskRow("t", "running", 0, 0, STATE, None, 100.0))
    return repository


def upload_id(index: int) -> bytes:
    return uuid.UUID(int=index + 1).bytes


def row(value: int) -> UpdateRow:
    return UpdateRow(bytes([value]) * 8, 0.0, 1)


def fill(tasks: TasksRepository, count: int, start: int = 0) -> None:
    """``count`` uploads into the open round of task ``t``."""
    for index in range(start, start + count):
        checked = tasks.task("t")
        assert checked is not None
        stored = tasks.add_update("t", upload_id(index), row(index), checked, capacity=10)
        assert stored.admission is Admission.ADDED


def vectors(database: Database, round_number: int) -> list[bytes]:
    with database.read() as conn:
        found = conn.execute(
            select(federated_updates.c.vector)
            .where(federated_updates.c.task == "t")
            .where(federated_updates.c.round == round_number)
            .order_by(federated_updates.c.update_id)
        )
        return [bytes(value) for (value,) in found]


def test_add_update_admits_only_at_the_checked_position_and_up_to_capacity(
    tasks: TasksRepository,
) -> None:
    checked = tasks.task("t")
    assert checked is not None
    first = tasks.add_update("t", upload_id(0), row(0), checked, capacity=2)
    assert (first.admission, first.round, first.count) == (Admission.ADDED, 0, 1)
    again = tasks.add_update("t", upload_id(0), row(9), checked, capacity=2)
    assert (again.admission, again.round, again.count) == (Admission.DUPLICATE, 0, 1)
    assert tasks.find_update("t", upload_id(0)) == again
    assert tasks.find_update("t", upload_id(5)) is None
    assert tasks.add_update("t", upload_id(1), row(1), checked, capacity=2).count == 2
    full = tasks.add_update("t", upload_id(2), row(2), checked, capacity=2)
    assert (full.admission, full.count) == (Admission.FULL, 2)
    stale = TaskRow("t", "running", 0, 1, STATE, None, 100.0)  # another attempt
    moved = tasks.add_update("t", upload_id(3), row(3), stale, capacity=5)
    assert moved.admission is Admission.MOVED
    assert tasks.add_update("none", upload_id(4), row(4), stale, 5).admission is Admission.MOVED
    assert tasks.update_count("t", 0) == 2 and tasks.find_update("t", upload_id(3)) is None


def test_a_close_commits_once_and_erases_the_round_vectors(
    tasks: TasksRepository, database: Database
) -> None:
    fill(tasks, 3)
    first, second = tasks.open_round("t"), tasks.open_round("t")
    assert first is not None and second is not None
    assert first == second and len(first.uploads) == 3
    assert [u.vector[0] for u in first.uploads] == [0, 1, 2]  # by update_id
    closed = tasks.replace_round(first, TaskUpdate("running", 1, 0, "closed by first", 200.0))
    assert closed == TaskRow("t", "running", 1, 0, "closed by first", None, 200.0)
    # The second close was computed from the same read: it loses and writes nothing.
    assert tasks.replace_round(second, TaskUpdate("running", 1, 0, "second", 300.0)) is None
    assert tasks.task("t") == closed
    assert vectors(database, 0) == [b""] * 3  # erased; the ids stay, so retries are duplicates
    duplicate = tasks.find_update("t", upload_id(1))
    assert duplicate is not None and (duplicate.round, duplicate.count) == (0, 3)


def test_a_close_read_before_an_upload_writes_nothing(
    tasks: TasksRepository, database: Database
) -> None:
    fill(tasks, 2)
    read = tasks.open_round("t")
    assert read is not None
    fill(tasks, 1, start=2)  # an upload arrives while the close is computed
    assert tasks.replace_round(read, TaskUpdate("running", 1, 0, "stale", 200.0)) is None
    assert tasks.task("t") == TaskRow("t", "running", 0, 0, STATE, None, 100.0)
    assert vectors(database, 0) == [bytes([i]) * 8 for i in range(3)]
    fresh = tasks.open_round("t")
    assert fresh is not None and len(fresh.uploads) == 3
    assert tasks.replace_round(fresh, TaskUpdate("running", 1, 0, "fresh", 200.0)) is not None


def test_a_new_attempt_deletes_the_round_uploads_and_an_ended_task_erases_them(
    tasks: TasksRepository, database: Database
) -> None:
    fill(tasks, 2)
    read = tasks.open_round("t")
    assert read is not None
    restarted = tasks.replace_round(read, TaskUpdate("running", 0, 1, "attempt 1", 160.0))
    assert restarted is not None and restarted.position == ("running", 0, 1)
    assert tasks.update_count("t", 0) == 0 and tasks.find_update("t", upload_id(0)) is None
    # A close computed for attempt 0 cannot land on attempt 1.
    assert tasks.replace_round(read, TaskUpdate("running", 1, 0, "late", 200.0)) is None
    fill(tasks, 1, start=5)
    read = tasks.open_round("t")
    assert read is not None
    ended = tasks.replace_round(read, TaskUpdate("budget_exhausted", 0, 1, "attempt 1", 160.0))
    assert ended is not None and ended.status == "budget_exhausted"
    assert vectors(database, 0) == [b""] and tasks.due_tasks(1e9) == []


def test_a_version_1_database_is_upgraded(database_url: str) -> None:
    """Version 1 had no ``attempt`` column: the upgrade adds it, from each task's state."""
    database = Database(database_url)
    try:
        states = {"fresh": json.dumps({"round": 3}), "redrawn": json.dumps({"attempt": 2})}
        repository = TasksRepository(database)
        for name, state in states.items():
            assert repository.create_task(TaskRow(name, "running", 3, 0, state, None, 1.0))
        with database.write() as conn:
            conn.exec_driver_sql("ALTER TABLE federated_tasks DROP COLUMN attempt")
            conn.execute(
                update(schema_info).where(schema_info.c.key == "schema_version").values(value="1")
            )
    finally:
        database.close()
    upgraded = Database(database_url)
    try:
        with upgraded.read() as conn:
            version = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one()
            attempts = dict(
                conn.execute(select(federated_tasks.c.name, federated_tasks.c.attempt)).all()
            )
        assert version == str(SCHEMA_VERSION) and attempts == {"fresh": 0, "redrawn": 2}
    finally:
        upgraded.close()


def test_each_repository_works_alone_on_one_shared_database(database: Database) -> None:
    spec = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})
    metrics = MetricsRepository(database)
    metric, created = metrics.define_metric("m", MetricDefinition(mechanism=spec))
    assert created and [m.name for m in metrics.metrics()] == ["m"]

    keys = KeysRepository(database)
    assert keys.add_key("k", "f" * 64, "device", "label") and keys.count_keys() == 1

    reports = ReportsRepository(database)
    try:
        written = PartialRow("m", metric.version, 0, 2, b"stats")
        assert reports.ingest([upload_id(0), upload_id(1)], lambda new: [written]) == (2, 0)
        assert reports.ingest([upload_id(1)], lambda new: [written]) == (0, 1)
        assert reports.partial_rows("m", metric.version) == [written]
        assert reports.report_count() == 2
    finally:
        reports.close()

    # Other repository objects over the same database see what the first ones wrote.
    assert MetricsRepository(database).metrics_stamp() == metrics.metrics_stamp()
    assert KeysRepository(database).keys()[0]["key_id"] == "k"
