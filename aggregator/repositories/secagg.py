"""Secure aggregation's messages, stored per round attempt (the ``secagg_*`` tables).

A secure round (``aggregator/secagg.py``) runs four steps over one attempt of a task's
open round: devices advertise keys (``secagg_participants``), send encrypted shares
(``secagg_shares``), masked inputs (``secagg_masked``) and revealed shares
(``secagg_reveals``). A step is closed by a row of ``secagg_steps`` that freezes its
members (who advertised keys, who sent shares, who sent a masked input).

Every message is admitted with the task's row locked (``FOR UPDATE`` on PostgreSQL, the
one writer on SQLite), and only while the task is still at the position it was checked
against, the step is open (the one before it closed, it has not, its deadline, the task
row's ``deadline``, is ahead) and the device has sent nothing else at this step: so a
step's messages only grow until it closes, and none is added after. A device's message
at a step is kept with its SHA-256 (``*_digest``): a retry with the same content is a
``DUPLICATE``, one with other content a ``CONFLICT``, whatever the step has become since.

A step's close and a round's end are compare-and-swap, like ``TasksRepository``'s: the
caller computes them from a snapshot (``progress``), and ``close_step`` or ``end_round``
commits only if the task and the attempt's message counts are still as read. Ending a
round (closed, restarted, or the task ended) deletes every secure row of that round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from sqlalchemy import and_, delete, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from aggregator.repositories.database import Repository
from aggregator.repositories.schema import (
    SECAGG_TABLES,
    federated_tasks,
    secagg_masked,
    secagg_participants,
    secagg_reveals,
    secagg_shares,
    secagg_steps,
)
from aggregator.repositories.tasks import TaskRow, TaskUpdate

__all__ = [
    "STEPS",
    "Admission",
    "Admitted",
    "ClosedStep",
    "Counts",
    "Participant",
    "Progress",
    "SecAggRepository",
    "Step",
]

Step = Literal["keys", "shares", "masked", "unmask"]
#: The steps of a secure round, in order.
STEPS: tuple[Step, ...] = ("keys", "shares", "masked", "unmask")
#: The participant column holding the digest of each later step's message.
_DIGEST = {
    "shares": secagg_participants.c.shares_digest,
    "masked": secagg_participants.c.masked_digest,
    "unmask": secagg_participants.c.unmask_digest,
}
#: Rows of masked inputs fetched at a time when they are summed (bounded memory).
MASKED_BATCH = 8


@dataclass(frozen=True)
class Counts:
    """The messages of an attempt: devices that advertised keys, sent shares, masked
    inputs, answered the unmask request."""

    advertised: int = 0
    shared: int = 0
    masked: int = 0
    unmasked: int = 0

    def of(self, step: Step) -> int:
        """The messages received at ``step``."""
        return {
            "keys": self.advertised,
            "shares": self.shared,
            "masked": self.masked,
            "unmask": self.unmasked,
        }[step]


@dataclass(frozen=True)
class ClosedStep:
    """A closed step: the participants it froze (sorted), the round's public parameters
    (JSON, the keys step only), when it closed."""

    members: tuple[int, ...]
    parameters: str | None
    closed_at: float


@dataclass(frozen=True)
class Progress:
    """An attempt as read in one snapshot: its closed steps and its message counts."""

    closed: dict[str, ClosedStep] = field(default_factory=dict)
    counts: Counts = Counts()

    @property
    def step(self) -> Step:
        """The step collecting messages now (``unmask`` until the round ends)."""
        return next((step for step in STEPS if step not in self.closed), "unmask")


@dataclass(frozen=True)
class Participant:
    """A device of an attempt: its index, public keys and the digests of its messages."""

    index: int
    encryption_key: bytes
    masking_key: bytes
    digests: dict[str, bytes | None]


class Admission(Enum):
    """What became of a message."""

    ADDED = "added"
    #: The device sent the same at this step before; nothing stored.
    DUPLICATE = "duplicate"
    #: The device sent other content at this step before; nothing stored.
    CONFLICT = "conflict"
    #: The task is no longer at the position the message was checked against.
    MOVED = "moved"
    #: The step is not open: not yet (``EARLY``), or no longer (``CLOSED``).
    EARLY = "early"
    CLOSED = "closed"


@dataclass(frozen=True)
class Admitted:
    """A message's admission, and the device's index (keys)."""

    admission: Admission
    participant: int = -1


class SecAggRepository(Repository):
    """The secure aggregation tables: admission of each step's messages, their reads, and
    the compare-and-swap that closes a step or ends a round."""

    # --- reads ---------------------------------------------------------------------------

    def progress(self, task: str, round_number: int, attempt: int) -> Progress:
        """The attempt's closed steps and message counts, from one snapshot."""
        with self.database.read() as conn:
            return _progress(conn, task, round_number, attempt)

    def snapshot(self, name: str) -> tuple[TaskRow, Progress] | None:
        """The task and its open attempt's progress, read in one snapshot (None if there
        is no such task): a step's deadline (the task's) and the step agree."""
        with self.database.read() as conn:
            row = conn.execute(_task_columns().where(federated_tasks.c.name == name)).first()
            if row is None:
                return None
            task = TaskRow(*row)
            return task, _progress(conn, task.name, task.round, task.attempt)

    def participant(
        self, task: str, round_number: int, attempt: int, session_hash: bytes
    ) -> Participant | None:
        """The attempt's device of that session, or None."""
        with self.database.read() as conn:
            row = conn.execute(
                _participant_columns()
                .where(_attempt(secagg_participants, task, round_number, attempt))
                .where(secagg_participants.c.session_hash == session_hash)
            ).first()
        return None if row is None else _participant(row)

    def public_keys(self, task: str, round_number: int, attempt: int) -> list[tuple[bytes, bytes]]:
        """Every device's (encryption key, masking key), by index."""
        with self.database.read() as conn:
            rows = conn.execute(
                select(secagg_participants.c.encryption_key, secagg_participants.c.masking_key)
                .where(_attempt(secagg_participants, task, round_number, attempt))
                .order_by(secagg_participants.c.participant)
            ).all()
        return [(bytes(encryption), bytes(masking)) for encryption, masking in rows]

    def senders(self, task: str, round_number: int, attempt: int, step: Step) -> list[int]:
        """The devices that sent their ``step`` message (shares, masked, unmask), sorted."""
        column = _DIGEST[step]
        with self.database.read() as conn:
            rows = conn.execute(
                select(secagg_participants.c.participant)
                .where(_attempt(secagg_participants, task, round_number, attempt))
                .where(column.is_not(None))
                .order_by(secagg_participants.c.participant)
            ).all()
        return [int(index) for (index,) in rows]

    def inbox(
        self, task: str, round_number: int, attempt: int, recipient: int
    ) -> list[tuple[int, bytes]]:
        """The (sender, ciphertext) of every share addressed to ``recipient``, by sender."""
        with self.database.read() as conn:
            rows = conn.execute(
                select(secagg_shares.c.sender, secagg_shares.c.ciphertext)
                .where(_attempt(secagg_shares, task, round_number, attempt))
                .where(secagg_shares.c.recipient == recipient)
                .order_by(secagg_shares.c.sender)
            ).all()
        return [(int(sender), bytes(ciphertext)) for sender, ciphertext in rows]

    def masked_inputs(self, task: str, round_number: int, attempt: int) -> Iterator[bytes]:
        """The attempt's masked inputs, by participant, fetched ``MASKED_BATCH`` at a time
        (one snapshot, streamed: the caller holds a few at once)."""
        with self.database.read() as conn:
            result = conn.execution_options(stream_results=True, yield_per=MASKED_BATCH).execute(
                select(secagg_masked.c.vector)
                .where(_attempt(secagg_masked, task, round_number, attempt))
                .order_by(secagg_masked.c.participant)
            )
            for (vector,) in result:
                yield bytes(vector)

    def reveals(
        self, task: str, round_number: int, attempt: int
    ) -> list[tuple[int, int, str, bytes]]:
        """Every revealed share of the attempt: (holder, owner, kind, share)."""
        with self.database.read() as conn:
            rows = conn.execute(
                select(
                    secagg_reveals.c.holder,
                    secagg_reveals.c.owner,
                    secagg_reveals.c.kind,
                    secagg_reveals.c.share,
                ).where(_attempt(secagg_reveals, task, round_number, attempt))
            ).all()
        return [(int(h), int(o), str(k), bytes(s)) for h, o, k, s in rows]

    # --- messages ------------------------------------------------------------------------

    def add_participant(
        self,
        checked: TaskRow,
        session_hash: bytes,
        keys: tuple[bytes, bytes],
        capacity: int,
        now: float,
    ) -> Admitted:
        """Admit a device into the attempt of ``checked`` with its (encryption, masking)
        keys, as the next index; exactly once per session.

        A session seen before is a ``DUPLICATE`` (same keys: its index) or a
        ``CONFLICT``; a task no longer at ``checked``'s position is ``MOVED``; a keys step
        closed, past its deadline or holding ``capacity`` devices is ``CLOSED``.
        """
        with self.database.write() as conn:
            task = self._lock_task(conn, checked.name)
            if task is None or task.position != checked.position:
                return Admitted(Admission.MOVED)
            where = _attempt(secagg_participants, task.name, task.round, task.attempt)
            seen = conn.execute(
                _participant_columns()
                .where(where)
                .where(secagg_participants.c.session_hash == session_hash)
            ).first()
            if seen is not None:
                known = _participant(seen)
                same = (known.encryption_key, known.masking_key) == keys
                return Admitted(Admission.DUPLICATE if same else Admission.CONFLICT, known.index)
            closed = _closed_steps(conn, task.name, task.round, task.attempt)
            count = _count(conn, where)
            if "keys" in closed or task.deadline <= now or count >= capacity:
                return Admitted(Admission.CLOSED)
            conn.execute(
                insert(secagg_participants).values(
                    task=task.name, round=task.round, attempt=task.attempt, participant=count,
                    session_hash=session_hash, encryption_key=keys[0], masking_key=keys[1],
                )
            )  # fmt: skip
            return Admitted(Admission.ADDED, count)

    def add_shares(
        self,
        checked: TaskRow,
        participant: int,
        digest: bytes,
        shares: Sequence[tuple[int, bytes]],
        now: float,
    ) -> Admission:
        """Store ``participant``'s encrypted shares, (recipient, ciphertext) each."""
        rows = [{"recipient": r, "sender": participant, "ciphertext": c} for r, c in shares]
        return self._add_message(checked, "shares", participant, digest, secagg_shares, rows, now)

    def add_masked(
        self, checked: TaskRow, participant: int, digest: bytes, vector: bytes, now: float
    ) -> Admission:
        """Store ``participant``'s masked input."""
        rows = [{"participant": participant, "vector": vector}]
        return self._add_message(checked, "masked", participant, digest, secagg_masked, rows, now)

    def add_reveals(
        self,
        checked: TaskRow,
        participant: int,
        digest: bytes,
        reveals: Sequence[tuple[int, str, bytes]],
        now: float,
    ) -> Admission:
        """Store ``participant``'s revealed shares, (owner, kind, share) each."""
        rows = [{"holder": participant, "owner": o, "kind": k, "share": s} for o, k, s in reveals]
        return self._add_message(checked, "unmask", participant, digest, secagg_reveals, rows, now)

    def _add_message(
        self,
        checked: TaskRow,
        step: Step,
        participant: int,
        digest: bytes,
        table: Any,
        rows: list[dict[str, Any]],
        now: float,
    ) -> Admission:
        """Store one device's message at ``step`` (its rows in ``table`` and its digest),
        with the task's row locked: a ``DUPLICATE`` or ``CONFLICT`` of what it sent before;
        ``MOVED`` if the task is not at ``checked``'s position; ``EARLY`` before the step
        before it closed, ``CLOSED`` once the step closed or passed its deadline."""
        column = _DIGEST[step]
        with self.database.write() as conn:
            task = self._lock_task(conn, checked.name)
            if task is None or task.position != checked.position:
                return Admission.MOVED
            where = _attempt(secagg_participants, task.name, task.round, task.attempt)
            sent = conn.execute(
                select(column).where(where).where(secagg_participants.c.participant == participant)
            ).first()
            if sent is None:
                return Admission.MOVED
            if sent[0] is not None:
                return Admission.DUPLICATE if bytes(sent[0]) == digest else Admission.CONFLICT
            closed = _closed_steps(conn, task.name, task.round, task.attempt)
            before = STEPS[STEPS.index(step) - 1]
            if before not in closed:
                return Admission.EARLY
            if step in closed or task.deadline <= now:
                return Admission.CLOSED
            attempt = {"task": task.name, "round": task.round, "attempt": task.attempt}
            conn.execute(insert(table), [attempt | row for row in rows])
            conn.execute(
                update(secagg_participants)
                .where(where)
                .where(secagg_participants.c.participant == participant)
                .values({column.name: digest})
            )
            return Admission.ADDED

    # --- closing -------------------------------------------------------------------------

    def close_step(
        self,
        checked: TaskRow,
        step: Step,
        members: Sequence[int],
        parameters: str | None,
        counts: Counts,
        deadline: float,
    ) -> bool:
        """Close ``step`` of the attempt of ``checked`` with ``members`` frozen, and move the
        task's deadline to the next step's; only if the task and the attempt's counts are
        still as read (``counts``). Whether it was committed."""
        with self.database.write() as conn:
            task = self._lock_task(conn, checked.name)
            if task is None or task.position != checked.position:
                return False
            if step in _closed_steps(conn, task.name, task.round, task.attempt):
                return False
            if _counts(conn, task.name, task.round, task.attempt) != counts:
                return False
            conn.execute(
                insert(secagg_steps).values(
                    task=task.name, round=task.round, attempt=task.attempt, step=step,
                    members=json.dumps(sorted(members)), parameters=parameters,
                    closed_at=time.time(),
                )
            )  # fmt: skip
            conn.execute(
                update(federated_tasks)
                .where(federated_tasks.c.name == task.name)
                .values(deadline=deadline)
            )
            return True

    def end_round(self, checked: TaskRow, read: Progress, change: TaskUpdate) -> TaskRow | None:
        """Commit ``change`` (the round closed, restarted, or the task ended) if the task,
        the attempt's closed steps and its counts are still as ``read``, and delete every
        secure row of the round left; the task as it is then, or None (nothing written)."""
        with self.database.write() as conn:
            task = self._lock_task(conn, checked.name)
            if task is None or task.position != checked.position:
                return None
            if _progress(conn, task.name, task.round, task.attempt) != read:
                return None
            conn.execute(
                update(federated_tasks)
                .where(federated_tasks.c.name == task.name)
                .values(
                    status=change.status, round=change.round, attempt=change.attempt,
                    state=change.state, deadline=change.deadline,
                )
            )  # fmt: skip
            for table in SECAGG_TABLES:
                conn.execute(
                    delete(table)
                    .where(table.c.task == task.name)
                    .where(table.c.round == task.round)
                )
        return TaskRow(
            task.name, change.status, change.round, change.attempt, change.state,
            task.evaluation, change.deadline,
        )  # fmt: skip

    def _lock_task(self, conn: Connection, name: str) -> TaskRow | None:
        query = _task_columns().where(federated_tasks.c.name == name)
        if self.database.dialect == "postgresql":
            query = query.with_for_update()
        row = conn.execute(query).first()
        return None if row is None else TaskRow(*row)


def _task_columns() -> Any:
    c = federated_tasks.c
    return select(c.name, c.status, c.round, c.attempt, c.state, c.evaluation, c.deadline)


def _attempt(table: Any, task: str, round_number: int, attempt: int) -> ColumnElement[bool]:
    return and_(table.c.task == task, table.c.round == round_number, table.c.attempt == attempt)


def _participant_columns() -> Any:
    c = secagg_participants.c
    return select(
        c.participant, c.encryption_key, c.masking_key,
        c.shares_digest, c.masked_digest, c.unmask_digest,
    )  # fmt: skip


def _participant(row: Any) -> Participant:
    digests = {
        step: None if value is None else bytes(value)
        for step, value in zip(("shares", "masked", "unmask"), row[3:], strict=True)
    }
    return Participant(int(row[0]), bytes(row[1]), bytes(row[2]), digests)


def _count(conn: Connection, where: ColumnElement[bool]) -> int:
    return int(
        conn.execute(
            select(func.count()).select_from(secagg_participants).where(where)
        ).scalar_one()
    )


def _counts(conn: Connection, task: str, round_number: int, attempt: int) -> Counts:
    c = secagg_participants.c
    row = conn.execute(
        select(
            func.count(),
            func.count(c.shares_digest),
            func.count(c.masked_digest),
            func.count(c.unmask_digest),
        ).where(_attempt(secagg_participants, task, round_number, attempt))
    ).one()
    return Counts(*(int(value) for value in row))


def _closed_steps(
    conn: Connection, task: str, round_number: int, attempt: int
) -> dict[str, ClosedStep]:
    rows = conn.execute(
        select(
            secagg_steps.c.step,
            secagg_steps.c.members,
            secagg_steps.c.parameters,
            secagg_steps.c.closed_at,
        ).where(_attempt(secagg_steps, task, round_number, attempt))
    ).all()
    return {
        str(step): ClosedStep(tuple(json.loads(members)), parameters, float(closed_at))
        for step, members, parameters, closed_at in rows
    }


def _progress(conn: Connection, task: str, round_number: int, attempt: int) -> Progress:
    return Progress(
        _closed_steps(conn, task, round_number, attempt),
        _counts(conn, task, round_number, attempt),
    )
