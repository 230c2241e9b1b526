"""Federated learning tasks in the service: create, serve rounds, take uploads, close rounds.

A task runs through :class:`shared.federated.task.TaskState` (the same object the
simulations use), stored as JSON in ``federated_tasks``; uploads of the open round wait
in ``federated_updates``. Everything here is a transaction on storage, so several
aggregator processes can serve one task: the task row is locked while an upload is
admitted or a round closes, and a round closes exactly once.

Round life. A round opens with a deadline ``round_timeout_seconds`` ahead. It closes
when ``max_clients`` uploads arrived (by default ``ceil(clients_per_round)``), or at its
deadline if at least ``min_clients`` did (dropouts are tolerated). With fewer, the round
is restarted: its uploads are deleted unread, its ``attempt`` goes up by one with a new
deadline, and devices, seeing a new attempt, decide afresh whether to take part (an
upload names its attempt; one for an abandoned attempt is refused as stale). Merely
moving the deadline on would stall a round that too few devices had chosen, since each
decides once; and letting devices decide again while earlier uploads stay would take a
device into a round with probability above q, past what is accounted. Closing
aggregates the uploads with the task's privacy mode, steps the model, charges the round
to the accountant, evaluates the model on the task's public evaluation set if it has
one, and opens the next round; a task whose planned rounds are done is ``completed``,
and one whose next round would exceed its privacy budget is ``budget_exhausted`` (no
such round ever runs). A round whose aggregation fails on non-finite values
(ArithmeticError or ValueError) is restarted as a short one is, logged and counted in
``ldp_federated_failed_rounds``, and the task goes on.

Uploads. An upload names its round and carries the update as base64 of little-endian
float64. It is refused, with nothing stored, when the task is unknown or finished, the
round is not the open one, the vector has the wrong length or a NaN or infinity, or (in
the local and distributed modes, where the upload carries its own noise) its L2 norm
exceeds what an honest client's clipped and noised update reaches but with probability
below exp(-50). In the central mode the server clips whatever arrives to C instead. The
unclipped bit of an adaptive-clipping task is refused in the distributed mode outside
the range an honest noisy bit leaves with probability below 2^-60
(:meth:`shared.federated.privacy.DPConfig.unclipped_range`); in the central mode the
aggregation clips it to [0, 1].
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aggregator import observability as obs
from aggregator.storage import Storage, TaskChange, TaskRow, TaskUpdate, UpdateRow
from shared.federated.messages import (
    EvaluationSet,
    RoundOut,
    RoundRecordOut,
    TaskCreate,
    TaskStatus,
    UpdateAccepted,
    UpdateUpload,
    encode_vector,
)
from shared.federated.models import evaluate, make_model
from shared.federated.task import BudgetExhaustedError, TaskConfig, TaskState

__all__ = ["Federated", "FederatedError"]

logger = logging.getLogger("ldp.aggregator")


class FederatedError(Exception):
    """A refused federated request: HTTP status, problem type and title, and why."""

    def __init__(
        self,
        status: int,
        kind: str,
        title: str,
        detail: str,
        problems: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.title, self.problems = status, kind, title, problems


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Federated:
    """The service's federated tasks, over :class:`aggregator.storage.Storage`."""

    def __init__(self, storage: Storage, clock: Callable[[], float] = time.time) -> None:
        self.storage = storage
        self.clock = clock

    # --- tasks ---------------------------------------------------------------------------

    def create(self, request: TaskCreate) -> TaskStatus:
        """Calibrate the noise (for a target epsilon) and store the task at round 0."""
        if request.evaluation is not None:
            try:
                request.evaluation.check(request.config.model)
            except ValueError as error:
                raise FederatedError(
                    422, "invalid-task", "Invalid task", str(error),
                    [{"field": "evaluation", "message": str(error)}],
                ) from None  # fmt: skip
        try:  # calibration may find no multiplier, or one the other fields do not fit
            state = TaskState.start(request.config)
            status = _status_after(state)
        except (ValueError, ArithmeticError) as error:
            raise FederatedError(
                422, "invalid-task", "Invalid task", f"cannot set the task's noise: {error}",
                [{"field": "config", "message": str(error)}],
            ) from None  # fmt: skip
        row = TaskRow(
            request.name,
            status,
            state.round,
            _dump(state),
            None if request.evaluation is None else request.evaluation.model_dump_json(),
            self.clock() + request.config.round_timeout_seconds,
        )
        if not self.storage.create_task(row):
            raise FederatedError(
                409, "task-exists", "Task exists", f"a task named {request.name!r} exists"
            )
        return self._status(row, 0)

    def tasks(self) -> list[TaskStatus]:
        return [self._status(row, self.storage.update_count(row.name, row.round)) for row in
                self.storage.tasks()]  # fmt: skip

    def status(self, name: str) -> TaskStatus:
        row = self._task(name)
        return self._status(row, self.storage.update_count(name, row.round))

    def round(self, name: str) -> RoundOut:
        """The open round of a running task (409 once the task is finished)."""
        row = self._task(name)
        if row.status != "running":
            raise _finished(row)
        state = _state(row)
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
        duplicate, even after its round closed; a new upload is checked against the
        locked task (open round, length, finiteness, norm) before anything is stored.
        """
        self._task(name)  # 404 for an unknown task; closes a round past its deadline
        try:
            raw = base64.b64decode(upload.update, validate=True)
        except (binascii.Error, ValueError):
            raise _bad_update("update", "the update is not valid base64") from None

        def admit(task: TaskRow) -> int:
            if task.status != "running":
                raise _finished(task)
            state = _state(task)
            if (upload.round, upload.attempt) != (task.round, state.attempt):
                field, expected, detail = (
                    ("round", task.round, f"round {task.round} is open")
                    if upload.round != task.round
                    else ("attempt", state.attempt, f"attempt {state.attempt} is open (restarted)")
                )
                raise FederatedError(
                    409,
                    "stale-round",
                    "Not the open round",
                    f"the upload is for round {upload.round}, attempt {upload.attempt}; {detail}",
                    [{"field": field, "message": f"expected {expected}"}],
                )
            _check_vector(state, raw)
            _check_unclipped(state, upload.unclipped)
            return task.round

        try:
            new, round_number, count = self.storage.add_update(
                name,
                upload.update_id.bytes,
                UpdateRow(raw, upload.unclipped, upload.num_examples),
                admit,
                self._closer(force=False, when_full=True),
            )
        except KeyError:
            raise _unknown(name) from None
        obs.FEDERATED_UPDATES.labels("accepted" if new else "duplicate").inc()
        return UpdateAccepted(
            accepted=new, duplicate=not new, round=round_number, updates_received=count
        )

    # --- closing rounds ------------------------------------------------------------------

    def close(self, name: str) -> TaskStatus:
        """Close the open round now (admin): 409 unless it has ``min_clients`` uploads."""
        row = self._task(name)
        if row.status != "running":
            raise _finished(row)
        closed = self._close(name, force=True)
        if closed is not None and closed.round == row.round and closed.status == "running":
            count = self.storage.update_count(name, row.round)
            minimum = _state(row).config.min_clients
            raise FederatedError(
                409,
                "not-enough-updates",
                "Not enough updates",
                f"round {row.round} has {count} updates; it closes with at least {minimum}",
            )
        return self.status(name)

    def tick(self) -> int:
        """Close (or restart) every round whose deadline passed; the number of tasks seen."""
        due = self.storage.due_tasks(self.clock())
        for name in due:
            self._close(name, force=False)
        return len(due)

    def _close(self, name: str, force: bool) -> TaskRow | None:
        """Close ``name``'s open round if it may: ``force`` (the admin asks) or its deadline
        passed; a due round short of ``min_clients`` is restarted."""
        return self.storage.change_task(name, self._closer(force=force, when_full=False))

    def _closer(
        self, force: bool, when_full: bool
    ) -> Callable[[TaskRow, list[UpdateRow]], TaskChange]:
        """The round-closing step, run by storage on the locked task and its uploads.

        It closes the round when ``force``, when ``when_full`` and the round holds
        ``max_clients`` uploads (by default ``ceil(clients_per_round)``), or when the
        deadline passed with at least ``min_clients``; a due round with fewer is restarted
        (a new attempt, its uploads discarded, one more timeout). Otherwise it changes
        nothing.
        """
        now = self.clock()

        def restart(task: TaskRow, state: TaskState) -> TaskUpdate:
            state.restart_round()
            deadline = now + state.config.round_timeout_seconds
            return TaskUpdate(task.status, task.round, _dump(state), deadline, restart=True)

        def change(task: TaskRow, uploads: list[UpdateRow]) -> TaskChange:
            if task.status != "running":
                return None
            state = _state(task)
            config = state.config
            full = len(uploads) >= (config.max_clients or math.ceil(config.clients_per_round))
            due = task.deadline <= now
            if not (force or due or (when_full and full)):
                return None
            if len(uploads) < config.min_clients:
                if force or not due:
                    return None
                obs.FEDERATED_RESTARTS.inc()
                return restart(task, state)
            updates = np.stack([np.frombuffer(u.vector, dtype="<f8") for u in uploads])
            unclipped = np.array([u.unclipped for u in uploads])
            weights = np.array([u.num_examples for u in uploads], dtype=np.float64)
            try:
                state.close_round(updates, unclipped, weights, None, _evaluator(task, config))
            except BudgetExhaustedError:
                obs.log(logger, logging.WARNING, "federated task out of budget", task=task.name)
                return TaskUpdate("budget_exhausted", task.round, task.state, task.deadline)
            except (ArithmeticError, ValueError) as error:
                obs.log(
                    logger, logging.ERROR, "federated round failed; restarted",
                    task=task.name, round=task.round, error=str(error),
                )  # fmt: skip
                obs.FEDERATED_FAILED_ROUNDS.inc()
                return restart(task, _state(task))  # the state as stored, untouched
            obs.FEDERATED_ROUNDS.inc()
            return TaskUpdate(
                _status_after(state),
                state.round,
                _dump(state),
                now + config.round_timeout_seconds,
            )

        return change

    # --- helpers -------------------------------------------------------------------------

    def _task(self, name: str) -> TaskRow:
        row = self.storage.task(name)
        if row is None:
            raise _unknown(name)
        if row.status == "running" and row.deadline <= self.clock():
            row = self._close(name, force=False) or row
        return row

    def _status(self, row: TaskRow, received: int) -> TaskStatus:
        state = _state(row)
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
            updates_received=received,
            deadline=row.deadline,
            participants=[r.participants for r in state.history],
            history=history,
            evaluation=history[-1].evaluation if history and history[-1].evaluation else None,
            config=state.config,
        )


def _state(row: TaskRow) -> TaskState:
    return TaskState.from_json(json.loads(row.state))


def _dump(state: TaskState) -> str:
    return json.dumps(state.to_json())


def _status_after(state: TaskState) -> str:
    """``running`` while another round may run; else why not."""
    if state.round >= state.config.rounds:
        return "completed"
    try:
        state.check_round()
    except BudgetExhaustedError:
        return "budget_exhausted"
    return "running"


def _evaluator(
    task: TaskRow, config: TaskConfig
) -> Callable[[np.ndarray], dict[str, float]] | None:
    if task.evaluation is None:
        return None
    data = EvaluationSet.model_validate_json(task.evaluation)
    model = make_model(config.model)
    x = np.asarray(data.x, dtype=np.float64)
    y = np.asarray(data.y, dtype=np.int64)
    return lambda params: evaluate(model, params, x, y)


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
    if norm > bound:
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


def _unknown(name: str) -> FederatedError:
    return FederatedError(404, "unknown-task", "Unknown task", f"no federated task {name!r}")


def _finished(row: TaskRow) -> FederatedError:
    reason = {
        "completed": "it has run all of its planned rounds",
        "budget_exhausted": "another round would exceed its privacy budget",
    }.get(row.status, row.status)
    return FederatedError(409, "task-finished", "Task finished", f"task {row.name!r}: {reason}")


def _bad_update(field: str, message: str) -> FederatedError:
    obs.FEDERATED_UPDATES.labels("rejected").inc()
    return FederatedError(
        422, "invalid-update", "Invalid update", message, [{"field": field, "message": message}]
    )
