"""Federated tasks: ``federated_tasks`` (one row per task) and ``federated_updates`` (uploads).

A task's row carries its state as JSON (``shared.federated.task.TaskState``) and, as
columns, its status and the ``(round, attempt)`` of its open round. An upload is
stored under its (task, ``update_id``), so a retry is a duplicate whatever became of
its round.

Closing a round is compare-and-swap, so that its computation (aggregation, noise, the
model's step, privacy accounting) holds no lock and no transaction:

1. ``open_round`` reads the task and its open round's uploads (one snapshot);
2. the caller computes the task's next state from them, outside any transaction;
3. ``replace_round`` commits it in a short write transaction with
   ``UPDATE ... WHERE name = ? AND status = ? AND round = ? AND attempt = ?``, which
   must change one row, and only if the round still holds the uploads that were read.
   Otherwise the transaction is rolled back, the result is discarded (never stored), and
   the caller reads again.

Uploads are added to a round only while the task is at that round and attempt
(``add_update`` checks it with the task's row locked: ``FOR UPDATE`` on PostgreSQL,
the one writer on SQLite), and are deleted only by a new attempt of the round, so a
round's uploads only grow until the round's close is committed: their number tells
whether a close was computed from all of them. A committed close that moves the task
to another round (or ends it) erases the vectors of the round it left, keeping their
ids; a new attempt of the same round deletes its uploads, ids and all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import Select

from aggregator.repositories.database import Repository
from aggregator.repositories.schema import federated_tasks, federated_updates

__all__ = [
    "Admission",
    "OpenRound",
    "StoredUpload",
    "TaskRow",
    "TaskUpdate",
    "TasksRepository",
    "UpdateRow",
]


@dataclass(frozen=True)
class TaskRow:
    """A stored federated task; ``attempt`` is the open round's draw (its state's too)."""

    name: str
    status: str
    round: int
    attempt: int
    state: str
    evaluation: str | None
    deadline: float

    @property
    def position(self) -> tuple[str, int, int]:
        """``(status, round, attempt)``: what changes whenever the task's state does."""
        return self.status, self.round, self.attempt


@dataclass(frozen=True)
class UpdateRow:
    """A stored upload of a task's open round."""

    vector: bytes
    unclipped: float
    num_examples: int


@dataclass(frozen=True)
class OpenRound:
    """A task as read, with the uploads of its open round (by ``update_id``)."""

    task: TaskRow
    uploads: list[UpdateRow]


@dataclass(frozen=True)
class TaskUpdate:
    """A task's next status, round, attempt, state and deadline."""

    status: str
    round: int
    attempt: int
    state: str
    deadline: float


class Admission(Enum):
    """What ``add_update`` did with an upload."""

    ADDED = "added"
    #: The task has this ``update_id`` already (in ``StoredUpload.round``); nothing stored.
    DUPLICATE = "duplicate"
    #: The task is no longer at the position the upload was checked against.
    MOVED = "moved"
    #: The open round holds as many uploads as it takes; nothing stored.
    FULL = "full"


@dataclass(frozen=True)
class StoredUpload:
    """``add_update``'s answer: what it did, the round concerned and its uploads then."""

    admission: Admission
    round: int
    count: int


class _Superseded(Exception):
    """A round's close lost its compare-and-swap (``replace_round``)."""


class TasksRepository(Repository):
    """Federated tasks, their uploads, and the compare-and-swap that closes their rounds."""

    def create_task(self, row: TaskRow) -> bool:
        """Store a new task; False (and nothing written) if the name is taken."""
        with self.database.write() as conn:
            taken = conn.execute(
                select(federated_tasks.c.name).where(federated_tasks.c.name == row.name)
            ).first()
            if taken is not None:
                return False
            conn.execute(
                insert(federated_tasks).values(
                    name=row.name, status=row.status, round=row.round, attempt=row.attempt,
                    state=row.state, evaluation=row.evaluation, deadline=row.deadline,
                    created_at=time.time(),
                )
            )  # fmt: skip
            return True

    def tasks(self) -> list[TaskRow]:
        """Every federated task, by name."""
        with self.database.read() as conn:
            rows = conn.execute(_task_columns().order_by(federated_tasks.c.name)).all()
        return [TaskRow(*row) for row in rows]

    def task(self, name: str) -> TaskRow | None:
        with self.database.read() as conn:
            row = conn.execute(_task_columns().where(federated_tasks.c.name == name)).first()
        return None if row is None else TaskRow(*row)

    def update_count(self, name: str, round_number: int) -> int:
        """Uploads stored for a task's round."""
        with self.database.read() as conn:
            return _round_size(conn, name, round_number)

    def find_update(self, name: str, update_id: bytes) -> StoredUpload | None:
        """The task's upload ``update_id`` as a ``DUPLICATE`` (its round, that round's
        uploads), or None when the task has no such upload."""
        with self.database.read() as conn:
            return _duplicate(conn, name, update_id)

    def add_update(
        self, name: str, update_id: bytes, row: UpdateRow, checked: TaskRow, capacity: int
    ) -> StoredUpload:
        """Store one upload in the open round of the task as ``checked`` saw it.

        With the task's row locked: an ``update_id`` the task has already is a
        ``DUPLICATE``, whatever round it came in; a task no longer at ``checked``'s
        position (another round, attempt or status; or gone) is ``MOVED``; an open round
        already holding ``capacity`` uploads is ``FULL``. Only an ``ADDED`` upload is
        written; ``count`` then includes it.
        """
        with self.database.write() as conn:
            task = self._lock_task(conn, name)
            duplicate = _duplicate(conn, name, update_id)
            if duplicate is not None:
                return duplicate
            if task is None or task.position != checked.position:
                return StoredUpload(Admission.MOVED, checked.round, 0)
            count = _round_size(conn, name, task.round)
            if count >= capacity:
                return StoredUpload(Admission.FULL, task.round, count)
            conn.execute(
                insert(federated_updates).values(
                    update_id=update_id, task=name, round=task.round, vector=row.vector,
                    unclipped=row.unclipped, num_examples=row.num_examples,
                )
            )  # fmt: skip
            return StoredUpload(Admission.ADDED, task.round, count + 1)

    def open_round(self, name: str) -> OpenRound | None:
        """The task and its open round's uploads, read in one snapshot (None if unknown)."""
        with self.database.read() as conn:
            row = conn.execute(_task_columns().where(federated_tasks.c.name == name)).first()
            if row is None:
                return None
            task = TaskRow(*row)
            uploads = conn.execute(
                select(
                    federated_updates.c.vector,
                    federated_updates.c.unclipped,
                    federated_updates.c.num_examples,
                )
                .where(federated_updates.c.task == name)
                .where(federated_updates.c.round == task.round)
                .order_by(federated_updates.c.update_id)
            ).all()
        return OpenRound(
            task,
            [UpdateRow(bytes(u.vector), float(u.unclipped), int(u.num_examples)) for u in uploads],
        )

    def replace_round(self, read: OpenRound, change: TaskUpdate) -> TaskRow | None:
        """Commit ``change``, computed from ``read``, if the task and its open round are
        still as read; the task as it is then, or None (nothing written) when they are not.

        Compare-and-swap on (name, status, round, attempt), which must update one row,
        and on the number of the round's uploads. A new attempt of the same round deletes
        that round's uploads; any other change erases their vectors (ids kept).
        """
        task = read.task
        try:
            with self.database.write() as conn:
                swapped = conn.execute(
                    update(federated_tasks)
                    .where(federated_tasks.c.name == task.name)
                    .where(federated_tasks.c.status == task.status)
                    .where(federated_tasks.c.round == task.round)
                    .where(federated_tasks.c.attempt == task.attempt)
                    .values(
                        status=change.status, round=change.round, attempt=change.attempt,
                        state=change.state, deadline=change.deadline,
                    )
                )  # fmt: skip
                if swapped.rowcount != 1:
                    return None
                if _round_size(conn, task.name, task.round) != len(read.uploads):
                    raise _Superseded  # an upload came in after the read: roll back
                left = (federated_updates.c.task == task.name) & (
                    federated_updates.c.round == task.round
                )
                if change.round == task.round and change.attempt != task.attempt:
                    conn.execute(delete(federated_updates).where(left))
                else:
                    conn.execute(update(federated_updates).where(left).values(vector=b""))
        except _Superseded:
            return None
        return TaskRow(
            task.name, change.status, change.round, change.attempt, change.state,
            task.evaluation, change.deadline,
        )  # fmt: skip

    def due_tasks(self, now: float) -> list[str]:
        """Running tasks whose open round's deadline has passed."""
        with self.database.read() as conn:
            rows = conn.execute(
                select(federated_tasks.c.name)
                .where(federated_tasks.c.status == "running")
                .where(federated_tasks.c.deadline <= now)
            ).all()
        return [row[0] for row in rows]

    def _lock_task(self, conn: Connection, name: str) -> TaskRow | None:
        query = _task_columns().where(federated_tasks.c.name == name)
        if self.database.dialect == "postgresql":
            query = query.with_for_update()
        row = conn.execute(query).first()
        return None if row is None else TaskRow(*row)


def _task_columns() -> Select[Any]:
    return select(
        federated_tasks.c.name,
        federated_tasks.c.status,
        federated_tasks.c.round,
        federated_tasks.c.attempt,
        federated_tasks.c.state,
        federated_tasks.c.evaluation,
        federated_tasks.c.deadline,
    )


def _round_size(conn: Connection, name: str, round_number: int) -> int:
    return int(
        conn.execute(
            select(func.count())
            .select_from(federated_updates)
            .where(federated_updates.c.task == name)
            .where(federated_updates.c.round == round_number)
        ).scalar_one()
    )


def _duplicate(conn: Connection, name: str, update_id: bytes) -> StoredUpload | None:
    seen = conn.execute(
        select(federated_updates.c.round)
        .where(federated_updates.c.task == name)
        .where(federated_updates.c.update_id == update_id)
    ).scalar_one_or_none()
    if seen is None:
        return None
    return StoredUpload(Admission.DUPLICATE, int(seen), _round_size(conn, name, int(seen)))
