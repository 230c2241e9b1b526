"""Federated learning tasks in the service: create, serve rounds, take uploads, close rounds.

A task runs through :class:`shared.federated.task.TaskState` (the same object the
simulations use), stored as JSON in its row (``aggregator/repositories/tasks.py``);
uploads of the open round wait beside it. Several aggregator processes can serve one
task: an upload is admitted against the task's row, locked for the moment of its
insert, and a round's close is computed from a snapshot (the task and its round's
uploads) outside any lock or transaction, then committed by compare-and-swap on the
task's (status, round, attempt) and the round's uploads. A close that loses the swap
(another closed the round first, or an upload came in meanwhile) is discarded, never
stored, and computed again from a new snapshot if the round still needs it: so a round
closes exactly once, and report ingestion never waits on a round's accounting.

Round life. A round opens with a deadline ``round_timeout_seconds`` ahead. It closes
when ``max_clients`` uploads arrived (by default ``ceil(clients_per_round)``; the upload
that fills the round closes it before it is answered, and later ones are refused as no
longer open), or at its deadline if at least ``min_clients`` did (dropouts are
tolerated). With fewer, the round is restarted: its uploads are deleted unread, its
``attempt`` goes up by one with a new deadline, and devices, seeing a new attempt,
decide afresh whether to take part (an upload names its attempt; one for an abandoned
attempt is refused as stale). Merely moving the deadline on would stall a round that too
few devices had chosen, since each decides once; and letting devices decide again while
earlier uploads stay would take a device into a round with probability above q, past
what is accounted. Closing aggregates the uploads with the task's privacy mode, steps
the model, charges the round to the accountant, evaluates the model on the task's public
evaluation set if it has one, and opens the next round; a task whose planned rounds are
done is ``completed``, and one whose next round would exceed its privacy budget is
``budget_exhausted`` (no such round ever runs). A round whose aggregation fails on
non-finite values (ArithmeticError or ValueError) is restarted as a short one is, logged
and counted in ``ldp_federated_failed_rounds``, and the task goes on.

Silo mode (record-level DP-SGD in each silo): a round charges the ``s`` DP-SGD steps of
a silo that takes part, and the status reports the epsilon per record of a silo that took
part in every closed round (``silo_steps`` steps so far): no silo has spent more. A task
with a noise multiplier and a target epsilon runs until the next round would pass the
target, and is then ``budget_exhausted``.

Secure aggregation. A ``distributed`` task with ``secure_aggregation`` takes no plain
uploads (``AggregationModeError``, 409): each round runs in four steps through
``aggregator/secagg.py`` (``Federated.secagg``), whose last step hands the unmasked sum of
the round's lattice updates to ``TaskState.close_secure_round``. The task row's deadline
is then the open step's (``step_timeout_seconds`` after it opened), so that ``tick`` and
every request advance an overdue step by the relay's rules, never by the plain rounds'.
A secure task must be able to run a round of at least two devices.

Uploads. An upload names its round and carries the update as base64 of little-endian
float64. It is refused, with nothing stored, when the task is unknown or finished, the
round is not the open one (or is full), the vector has the wrong length or a NaN or infinity, or (in
the local and distributed modes, where the upload carries its own noise) its L2 norm
exceeds what an honest client's clipped and noised update reaches but with probability
below exp(-50). In the central mode the server clips whatever arrives to C instead; in the
silo mode an update (the outcome of DP-SGD steps) has no norm bound to check. The
unclipped bit of an adaptive-clipping task is refused in the distributed mode outside
the range an honest noisy bit leaves with probability below 2^-60
(:meth:`shared.federated.privacy.DPConfig.unclipped_range`); in the central mode the
aggregation clips it to [0, 1].
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from aggregator import observability as obs
from aggregator.federated_tasks import (
    AggregationModeError,
    ConflictingMessageError,
    FederatedError,
    InvalidMessageError,
    InvalidTaskError,
    InvalidUpdateError,
    NotEnoughUpdatesError,
    StaleRoundError,
    TaskExistsError,
    TaskFinishedError,
    TooEarlyError,
    UnknownTaskError,
    dump_state,
    finished_error,
    round_capacity,
    status_after,
    task_evaluator,
    task_state,
)
from aggregator.repositories.secagg import SecAggRepository
from aggregator.repositories.tasks import (
    Admission,
    OpenRound,
    StoredUpload,
    TaskRow,
    TasksRepository,
    TaskUpdate,
    UpdateRow,
)
from aggregator.secagg import SecAggRelay
from shared.federated.messages import (
    RoundOut,
    RoundRecordOut,
    TaskCreate,
    TaskStatus,
    UpdateAccepted,
    UpdateUpload,
    encode_vector,
)
from shared.federated.secagg import MAX_DEVICES
from shared.federated.task import BudgetExhaustedError, TaskConfig, TaskState
from shared.schemas import NAME_PATTERN

__all__ = [
    "TASK_NAME",
    "AggregationModeError",
    "ConflictingMessageError",
    "Federated",
    "FederatedError",
    "InvalidMessageError",
    "InvalidTaskError",
    "InvalidUpdateError",
    "NotEnoughUpdatesError",
    "StaleRoundError",
    "TaskExistsError",
    "TaskFinishedError",
    "TooEarlyError",
    "UnknownTaskError",
]

logger = logging.getLogger("ldp.aggregator")

#: Task names, as paths take them: today the characters of metric names (``TaskCreate``
#: checks a new task's name against the same pattern), kept apart from ``METRIC_NAME`` so
#: that either may change alone.
TASK_NAME = NAME_PATTERN


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class _Closing:
    """A round's close as computed (not yet committed): the task's next row, and what
    happened, reported only once the change is committed."""

    change: TaskUpdate
    outcome: Literal["closed", "restarted", "failed", "exhausted"]
    error: str = ""

    def report(self, task: TaskRow) -> None:
        """Count and log the committed change (a discarded one never is)."""
        if self.outcome == "closed":
            obs.FEDERATED_ROUNDS.inc()
        elif self.outcome == "restarted":
            obs.FEDERATED_RESTARTS.inc()
        elif self.outcome == "failed":
            obs.log(
                logger, logging.ERROR, "federated round failed; restarted",
                task=task.name, round=task.round, error=self.error,
            )  # fmt: skip
            obs.FEDERATED_FAILED_ROUNDS.inc()
        else:
            obs.log(logger, logging.WARNING, "federated task out of budget", task=task.name)


class Federated:
    """The service's federated tasks, over a :class:`TasksRepository`."""

    def __init__(self, repository: TasksRepository, clock: Callable[[], float] = time.time) -> None:
        self.repository = repository
        self.clock = clock
        #: The secure rounds of tasks with ``secure_aggregation`` (``aggregator/secagg.py``).
        self.secagg = SecAggRelay(self, SecAggRepository(repository.database))

    # --- tasks ---------------------------------------------------------------------------

    def create(self, request: TaskCreate) -> TaskStatus:
        """Calibrate the noise (for a target epsilon) and store the task at round 0."""
        if request.evaluation is not None:
            try:
                request.evaluation.check(request.config.model)
            except ValueError as error:
                raise InvalidTaskError(
                    str(error), [{"field": "evaluation", "message": str(error)}]
                ) from None
        try:  # calibration may find no multiplier, or one the other fields do not fit
            state = TaskState.start(request.config)
            status = status_after(state)
        except (ValueError, ArithmeticError) as error:
            raise InvalidTaskError(
                f"cannot set the task's noise: {error}",
                [{"field": "config", "message": str(error)}],
            ) from None
        _check_secure(state)
        row = TaskRow(
            request.name,
            status,
            state.round,
            state.attempt,
            dump_state(state),
            None if request.evaluation is None else request.evaluation.model_dump_json(),
            self.clock() + _timeout(request.config),
        )
        if not self.repository.create_task(row):
            raise TaskExistsError(f"a task named {request.name!r} exists")
        return self._status(row, 0)

    def tasks(self) -> list[TaskStatus]:
        return [self._status(row, self.repository.update_count(row.name, row.round)) for row in
                self.repository.tasks()]  # fmt: skip

    def status(self, name: str) -> TaskStatus:
        row = self._task(name)
        return self._status(row, self.repository.update_count(name, row.round))

    def round(self, name: str) -> RoundOut:
        """The open round of a running task (``TaskFinishedError`` once it is finished)."""
        row = self._task(name)
        if row.status != "running":
            raise finished_error(row)
        state = task_state(row)
        return RoundOut(
            task=name,
            round=row.round,
            attempt=state.attempt,
            state="running",
            config=state.config,
            noise_multiplier=state.noise_multiplier,
            clip_norm=state.clip_norm,
            sample_rate=state.config.sample_rate,
            expected_clients=state.config.clients_per_round,
            num_params=state.num_params,
            parameters=encode_vector(state.server.params),
            deadline=row.deadline,
        )

    # --- uploads -------------------------------------------------------------------------

    def upload(self, name: str, upload: UpdateUpload) -> UpdateAccepted:
        """Store one upload for the open round; the one that fills the round closes it.

        A retry of an upload already taken (same ``update_id``) is answered as a
        duplicate, even after its round closed. A new upload is checked (open round,
        length, finiteness, norm) against the task as read, outside any transaction, and
        stored only if the task is still there when its row is locked; if the task moved
        on meanwhile, it is read and checked again. A round already holding
        ``max_clients`` uploads refuses it (``StaleRoundError``: the round is closing).
        """
        task = self._task(name)  # UnknownTaskError; closes a round past its deadline
        if task_state(task).config.secure_aggregation is not None:
            raise AggregationModeError(
                f"task {name!r} aggregates securely: devices send masked inputs through "
                f"/v1/federated/tasks/{name}/rounds/{{round}}/secagg/, not plain updates",
                [{"field": "update", "message": "this task takes no plain updates"}],
            )
        try:
            raw = base64.b64decode(upload.update, validate=True)
        except (binascii.Error, ValueError):
            raise _bad_update("update", "the update is not valid base64") from None
        update_id = upload.update_id.bytes
        row = UpdateRow(raw, upload.unclipped, upload.num_examples)
        while True:
            state = task_state(task)
            stored = self.repository.find_update(name, update_id)
            if stored is None:
                _admit(task, state, upload, raw)
                stored = self.repository.add_update(
                    name, update_id, row, task, round_capacity(state.config)
                )
            if stored.admission is not Admission.MOVED:
                break
            task = self._task(name)
        if stored.admission is Admission.FULL:
            raise StaleRoundError(
                f"round {task.round} holds its {stored.count} uploads and is closing; "
                "the next round opens when it has closed",
                [{"field": "round", "message": f"round {task.round} is full"}],
            )
        new = stored.admission is Admission.ADDED
        obs.FEDERATED_UPDATES.labels("accepted" if new else "duplicate").inc()
        if _fills(task, state, stored):
            self._close(name, force=False, when_full=True)
        return UpdateAccepted(
            accepted=new, duplicate=not new, round=stored.round, updates_received=stored.count
        )

    # --- closing rounds ------------------------------------------------------------------

    def close(self, name: str) -> TaskStatus:
        """Close the open round now (admin): ``NotEnoughUpdatesError`` unless it has
        ``min_clients`` uploads."""
        row = self._task(name)
        if row.status != "running":
            raise finished_error(row)
        if task_state(row).config.secure_aggregation is not None:
            raise AggregationModeError(
                f"task {name!r} aggregates securely: its rounds close when their four steps "
                f"do (GET /v1/federated/tasks/{name}/rounds/{row.round}/secagg)"
            )
        closed = self._close(name, force=True)
        if closed is not None and closed.round == row.round and closed.status == "running":
            count = self.repository.update_count(name, row.round)
            minimum = task_state(row).config.min_clients
            raise NotEnoughUpdatesError(
                f"round {row.round} has {count} updates; it closes with at least {minimum}"
            )
        return self.status(name)

    def tick(self) -> int:
        """Close (or restart) every round whose deadline passed; the number of tasks seen."""
        due = self.repository.due_tasks(self.clock())
        for name in due:
            self._close(name, force=False)
        return len(due)

    def _close(self, name: str, force: bool, when_full: bool = False) -> TaskRow | None:
        """Close ``name``'s open round if it may (see ``_closing``), by compare-and-swap:
        computed from a snapshot outside any transaction, committed only if the task and
        its round are still as read; else discarded and computed again from a new
        snapshot. The task as it is afterwards (None if unknown)."""
        while True:
            opened = self.repository.open_round(name)
            if opened is None:
                return None
            if task_state(opened.task).config.secure_aggregation is not None:
                return self.secagg.advance(name)
            closing = self._closing(opened, force, when_full)
            if closing is None:
                return opened.task
            replaced = self.repository.replace_round(opened, closing.change)
            if replaced is not None:
                closing.report(opened.task)
                return replaced

    def _closing(self, opened: OpenRound, force: bool, when_full: bool) -> _Closing | None:
        """The change closing the round of ``opened``, computed (no I/O), or None.

        It closes the round when ``force``, when ``when_full`` and the round holds
        ``max_clients`` uploads, or when the deadline passed with at least
        ``min_clients``; a due round with fewer is restarted (a new attempt, its uploads
        discarded, one more timeout). Otherwise nothing changes.
        """
        task, uploads = opened.task, opened.uploads
        if task.status != "running":
            return None
        now = self.clock()
        state = task_state(task)
        config = state.config
        full = len(uploads) >= round_capacity(config)
        due = task.deadline <= now
        if not (force or due or (when_full and full)):
            return None
        if len(uploads) < config.min_clients:
            if force or not due:
                return None
            return _Closing(_restart(task, state, now), "restarted")
        updates = np.stack([np.frombuffer(u.vector, dtype="<f8") for u in uploads])
        unclipped = np.array([u.unclipped for u in uploads])
        weights = np.array([u.num_examples for u in uploads], dtype=np.float64)
        try:
            state.close_round(updates, unclipped, weights, None, task_evaluator(task, config))
        except BudgetExhaustedError:
            exhausted = TaskUpdate(
                "budget_exhausted", task.round, task.attempt, task.state, task.deadline
            )
            return _Closing(exhausted, "exhausted")
        except (ArithmeticError, ValueError) as error:  # the state as stored, untouched
            return _Closing(_restart(task, task_state(task), now), "failed", str(error))
        change = TaskUpdate(
            status_after(state),
            state.round,
            state.attempt,
            dump_state(state),
            now + config.round_timeout_seconds,
        )
        return _Closing(change, "closed")

    # --- helpers -------------------------------------------------------------------------

    def current(self, name: str) -> TaskRow:
        """The task's row, a round (or secure step) past its deadline advanced first."""
        return self._task(name)

    def _task(self, name: str) -> TaskRow:
        row = self.repository.task(name)
        if row is None:
            raise _unknown(name)
        if row.status == "running" and row.deadline <= self.clock():
            row = self._close(name, force=False) or row
        return row

    def _status(self, row: TaskRow, received: int) -> TaskStatus:
        state = task_state(row)
        history = [
            RoundRecordOut(
                round=r.round,
                participants=r.participants,
                clip_norm=r.clip_norm,
                epsilon=_finite_or_none(r.epsilon),
                unclipped_fraction=r.unclipped_fraction,
                evaluation=r.evaluation,
            )
            for r in state.history
        ]
        return TaskStatus(
            name=row.name,
            mode=state.config.mode,
            state=row.status,  # type: ignore[arg-type]
            round=row.round,
            attempt=state.attempt,
            rounds=state.config.rounds,
            epsilon_spent=_finite_or_none(state.epsilon()),
            budget=_finite_or_none(state.budget),
            delta=state.config.delta,
            noise_multiplier=state.noise_multiplier,
            clip_norm=state.clip_norm,
            silo_steps=(
                None if state.config.dpsgd is None else state.round * state.config.dpsgd.steps
            ),
            updates_received=received,
            deadline=row.deadline,
            participants=[r.participants for r in state.history],
            history=history,
            evaluation=history[-1].evaluation if history and history[-1].evaluation else None,
            config=state.config,
        )


def _admit(task: TaskRow, state: TaskState, upload: UpdateUpload, raw: bytes) -> None:
    """Refuse an upload the task as read does not take: finished, another round or
    attempt, or a vector or unclipped bit out of bounds."""
    if task.status != "running":
        raise finished_error(task)
    if (upload.round, upload.attempt) != (task.round, task.attempt):
        field, expected, detail = (
            ("round", task.round, f"round {task.round} is open")
            if upload.round != task.round
            else ("attempt", task.attempt, f"attempt {task.attempt} is open (restarted)")
        )
        raise StaleRoundError(
            f"the upload is for round {upload.round}, attempt {upload.attempt}; {detail}",
            [{"field": field, "message": f"expected {expected}"}],
        )
    _check_vector(state, raw)
    _check_unclipped(state, upload.unclipped)


def _fills(task: TaskRow, state: TaskState, stored: StoredUpload) -> bool:
    """Whether the upload just answered (added, or a duplicate) leaves the task's open
    round full: then it closes the round, in case the upload that filled it could not."""
    return (
        task.status == "running"
        and stored.round == task.round
        and stored.count >= round_capacity(state.config)
    )


def _timeout(config: TaskConfig) -> float:
    """Seconds until the open round's deadline: ``round_timeout_seconds``, or with secure
    aggregation the first step's ``step_timeout_seconds`` (each step then sets its own)."""
    spec = config.secure_aggregation
    return config.round_timeout_seconds if spec is None else spec.step_timeout_seconds


#: Most devices a secure round may hold (every device fetches the whole roster).
MAX_SECURE_DEVICES = MAX_DEVICES


def _check_secure(state: TaskState) -> None:
    """Refuse a secure task whose rounds cannot run: fewer than 2 devices a round (the
    sum of one device's input is that input), more than ``MAX_SECURE_DEVICES``, or a ring
    past 64 bits for a full round."""
    config = state.config
    if config.secure_aggregation is None:
        return
    capacity, minimum = round_capacity(config), max(config.min_clients, 2)
    if capacity > MAX_SECURE_DEVICES:
        message = (
            f"a secure round would take up to {capacity} devices (max_clients, or "
            f"ceil(clients_per_round)); at most {MAX_SECURE_DEVICES} may share one round: "
            "set max_clients"
        )
        raise InvalidTaskError(message, [{"field": "config.max_clients", "message": message}])
    if capacity < minimum:
        message = (
            f"a secure round takes at most {capacity} devices (max_clients, or "
            f"ceil(clients_per_round)) and closes with no fewer than {minimum} "
            "(min_clients, and never below 2): raise max_clients or clients_per_round"
        )
        raise InvalidTaskError(message, [{"field": "config.max_clients", "message": message}])
    try:
        state.dp.secure_modulus_bits(state.clip_norm, state.num_params, capacity)
    except ValueError as error:
        raise InvalidTaskError(
            f"cannot plan the secure aggregation ring: {error}",
            [{"field": "config.secure_aggregation", "message": str(error)}],
        ) from None


def _restart(task: TaskRow, state: TaskState, now: float) -> TaskUpdate:
    """The round drawn again: a new attempt, one more timeout (its uploads are deleted)."""
    state.restart_round()
    deadline = now + state.config.round_timeout_seconds
    return TaskUpdate(task.status, task.round, state.attempt, dump_state(state), deadline)


#: Relative float rounding allowed on an upload's norm bound (a norm is a sum of P squares
#: and a square root: its relative error is below (P + 2) 2^-53, far below this for every
#: model a task may have).
NORM_ROUNDING = 1e-9


def _check_vector(state: TaskState, raw: bytes) -> None:
    """Refuse an update of the wrong length, with a NaN or infinity, or a norm that no
    honest clipped and noised update reaches (local and distributed modes)."""
    expected = state.num_params * 8
    if len(raw) != expected:
        raise _bad_update(
            "update",
            f"the update has {len(raw)} bytes ({len(raw) / 8:g} float64 values); the model "
            f"has {state.num_params} parameters ({expected} bytes)",
        )
    vector = np.frombuffer(raw, dtype="<f8")
    bad = np.flatnonzero(~np.isfinite(vector))
    if bad.size:
        raise _bad_update(
            "update", f"value {int(bad[0])} of the update is {vector[bad[0]]!r}: not finite"
        )
    bound = state.dp.max_upload_norm(state.clip_norm, state.num_params)
    norm = float(np.linalg.norm(vector))
    # Clipping x to C / ||x|| x in floating point can land a few ulps above C (and without
    # noise the bound is C itself): allow float rounding, never more.
    if norm > bound * (1 + NORM_ROUNDING):
        raise _bad_update(
            "update",
            f"the update's L2 norm {norm:.6g} exceeds {bound:.6g}, the most a clipped "
            f"(C = {state.clip_norm:.6g}) and noised update reaches in mode "
            f"{state.config.mode!r}",
        )


def _check_unclipped(state: TaskState, unclipped: float) -> None:
    """Refuse, in the distributed mode with adaptive clipping, an unclipped bit outside
    ``[-t s, 1 + t s]``: an honest one (0 or 1 plus its ``N(0, s^2)`` share of the count's
    noise) lies outside with probability below ``exp(-t^2 / 2)`` < 2^-60 (``t = 10``)."""
    dp = state.dp
    if dp.mode != "distributed" or dp.adaptive is None:
        return
    low, high = dp.unclipped_range()
    if not low <= unclipped <= high:
        raise _bad_update(
            "unclipped",
            f"unclipped is {unclipped!r}; an honest device's bit (0 or 1) plus its share of "
            f"the count's noise (std {dp.unclipped_noise_std:.6g}) lies in "
            f"[{low:.6g}, {high:.6g}] but for a chance below 2^-60",
        )


def _unknown(name: str) -> UnknownTaskError:
    return UnknownTaskError(f"no federated task {name!r}")


def _bad_update(field: str, message: str) -> InvalidUpdateError:
    obs.FEDERATED_UPDATES.labels("rejected").inc()
    return InvalidUpdateError(message, [{"field": field, "message": message}])
