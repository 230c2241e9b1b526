"""What the plain and the secure rounds of federated tasks share: the refusals a request
may get, and a stored task's state (read, written, judged).

:mod:`aggregator.federated` serves tasks and their plain rounds; :mod:`aggregator.secagg`
the steps of their secure rounds. Both build on this module, which imports neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from aggregator.repositories.tasks import TaskRow
from shared.federated.messages import EvaluationSet
from shared.federated.models import evaluate, make_model
from shared.federated.task import BudgetExhaustedError, TaskConfig, TaskState

__all__ = [
    "AggregationModeError",
    "ConflictingMessageError",
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
    "dump_state",
    "finished_error",
    "round_capacity",
    "status_after",
    "task_evaluator",
    "task_state",
]


class FederatedError(Exception):
    """A refused federated request: why (the message), and the fields at fault (``problems``:
    ``{"field", "message"}`` items, or None)."""

    def __init__(self, detail: str, problems: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.problems = problems


class UnknownTaskError(FederatedError):
    """No federated task has that name."""


class InvalidTaskError(FederatedError):
    """A task that cannot run as asked: its noise cannot be set, or its evaluation set does
    not fit its model."""


class TaskExistsError(FederatedError):
    """A task of that name exists already."""


class TaskFinishedError(FederatedError):
    """The task has run all of its planned rounds, or stopped at its privacy budget."""


class StaleRoundError(FederatedError):
    """An upload for a round, or an attempt of it, that is not open to uploads."""


class NotEnoughUpdatesError(FederatedError):
    """A round asked to close with fewer than ``min_clients`` uploads."""


class InvalidUpdateError(FederatedError):
    """An upload refused for what it carries: not base64, a wrong length, a NaN or
    infinity, a norm or an unclipped bit that no honest device sends."""


class AggregationModeError(FederatedError):
    """A request of the other aggregation: a plain upload (or an admin's close) to a task
    with secure aggregation, or a secure aggregation step of a task without it."""


class TooEarlyError(FederatedError):
    """A secure aggregation step asked for before the step it needs has closed: ask
    again after ``retry_after`` seconds."""

    def __init__(
        self, detail: str, problems: list[dict[str, Any]] | None = None, retry_after: int = 1
    ) -> None:
        super().__init__(detail, problems)
        self.retry_after = retry_after


class ConflictingMessageError(FederatedError):
    """A secure aggregation session sent other content at a step it had answered."""


class InvalidMessageError(FederatedError):
    """A secure aggregation message refused for what it carries (malformed keys, shares
    not for exactly the device's neighbours, a masked input of the wrong size or out of
    the ring, a share the unmask request did not ask for)."""


def round_capacity(config: TaskConfig) -> int:
    """The uploads a round takes: ``max_clients``, by default ``ceil(clients_per_round)``."""
    return config.max_clients or math.ceil(config.clients_per_round)


def task_state(row: TaskRow) -> TaskState:
    """The task's state as stored in its row."""
    return TaskState.from_json(json.loads(row.state))


def dump_state(state: TaskState) -> str:
    """The task's state as its row stores it (JSON)."""
    return json.dumps(state.to_json())


def status_after(state: TaskState) -> str:
    """``running`` while another round may run; else why not."""
    if state.round >= state.config.rounds:
        return "completed"
    try:
        state.check_round()
    except BudgetExhaustedError:
        return "budget_exhausted"
    return "running"


def task_evaluator(
    task: TaskRow, config: TaskConfig
) -> Callable[[np.ndarray], dict[str, float]] | None:
    """The model's metrics on the task's public evaluation set (None without one)."""
    if task.evaluation is None:
        return None
    data = EvaluationSet.model_validate_json(task.evaluation)
    model = make_model(config.model)
    x = np.asarray(data.x, dtype=np.float64)
    y = np.asarray(data.y, dtype=np.int64)
    return lambda params: evaluate(model, params, x, y)


def finished_error(row: TaskRow) -> TaskFinishedError:
    """The refusal of a request to a task that no longer runs, saying why."""
    reason = {
        "completed": "it has run all of its planned rounds",
        "budget_exhausted": "another round would exceed its privacy budget",
    }.get(row.status, row.status)
    return TaskFinishedError(f"task {row.name!r}: {reason}")
