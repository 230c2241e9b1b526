"""The wire messages of federated learning, shared by the service and the devices.

The JSON of ``/v1/federated/...``: what an admin sends to create a task
(:class:`TaskCreate`), what a device fetches (:class:`RoundOut`) and uploads
(:class:`UpdateUpload`, answered by :class:`UpdateAccepted`), and a task's status
(:class:`TaskStatus`). Vectors travel as base64 of little-endian float64
(:mod:`shared.federated.vectors`, whose codec is re-exported here).
"""

from __future__ import annotations

from typing import Literal
from uuid import UUID

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.federated.models import ModelSpec
from shared.federated.task import TaskConfig
from shared.federated.vectors import decode_vector, encode_vector
from shared.schemas import NAME_PATTERN

__all__ = [
    "EvaluationSet",
    "RoundOut",
    "RoundRecordOut",
    "TaskCreate",
    "TaskStatus",
    "TaskStatusName",
    "UpdateAccepted",
    "UpdateUpload",
    "decode_vector",
    "encode_vector",
]

TaskStatusName = Literal["running", "completed", "budget_exhausted"]
#: Largest public evaluation set a task may carry (rows).
MAX_EVALUATION_ROWS = 100_000


class EvaluationSet(BaseModel):
    """A public evaluation set: the server reports the global model's accuracy on it."""

    model_config = ConfigDict(extra="forbid")

    x: list[list[float]] = Field(min_length=1, max_length=MAX_EVALUATION_ROWS)
    y: list[int] = Field(min_length=1, max_length=MAX_EVALUATION_ROWS)

    @model_validator(mode="after")
    def _same_rows(self) -> EvaluationSet:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)} labels")
        if len({len(row) for row in self.x}) != 1:
            raise ValueError("every row of x must have the same number of features")
        return self

    def check(self, model: ModelSpec) -> None:
        if len(self.x[0]) != model.num_features:
            raise ValueError(
                f"evaluation rows have {len(self.x[0])} features; the model takes "
                f"{model.num_features}"
            )
        if min(self.y) < 0 or max(self.y) >= model.num_classes:
            raise ValueError(f"evaluation labels must lie in 0..{model.num_classes - 1}")
        if not np.all(np.isfinite(np.asarray(self.x, dtype=np.float64))):
            raise ValueError("evaluation features must be finite numbers")


class TaskCreate(BaseModel):
    """``POST /v1/federated/tasks``: a name, the task's configuration, an evaluation set."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN.pattern, max_length=64)
    config: TaskConfig
    evaluation: EvaluationSet | None = None


class RoundRecordOut(BaseModel):
    round: int
    participants: int
    clip_norm: float
    epsilon: float | None = Field(description="spent after the round; null when unbounded")
    unclipped_fraction: float | None
    evaluation: dict[str, float]


class TaskStatus(BaseModel):
    """What a task has done and spent."""

    name: str
    mode: str
    state: TaskStatusName
    round: int = Field(description="rounds closed so far (the open round's number)")
    attempt: int = Field(
        default=0, description="the open round's draw (one more each time it was restarted)"
    )
    rounds: int = Field(description="rounds planned")
    epsilon_spent: float | None = Field(
        description="at delta; null when unbounded (no noise). Silo mode: per record, of a "
        "silo that took part in every closed round (no silo has spent more)"
    )
    budget: float | None = Field(description="the task's epsilon budget; null when unbounded")
    delta: float
    noise_multiplier: float
    clip_norm: float
    silo_steps: int | None = Field(
        default=None,
        description="silo mode: the DP-SGD steps of a silo that took part in every closed "
        "round (null in the other modes)",
    )
    updates_received: int = Field(description="uploads in the open round")
    deadline: float = Field(description="the open round's deadline (Unix seconds)")
    participants: list[int]
    history: list[RoundRecordOut]
    evaluation: dict[str, float] | None = Field(description="the latest round's evaluation")
    config: TaskConfig


class RoundOut(BaseModel):
    """``GET .../round``: what a device needs to take part in the open round."""

    task: str
    round: int
    attempt: int = Field(
        default=0,
        description="the round's draw: a round short of min_clients at its deadline is "
        "restarted, its uploads discarded, and every device decides anew to take part",
    )
    state: TaskStatusName
    config: TaskConfig
    noise_multiplier: float
    clip_norm: float
    sample_rate: float
    expected_clients: float
    num_params: int
    parameters: str = Field(description="base64 of the parameters as little-endian float64")
    deadline: float


class UpdateUpload(BaseModel):
    """``POST .../updates``: one device's privatized update for one round."""

    model_config = ConfigDict(extra="forbid")

    update_id: UUID
    round: int = Field(ge=0)
    attempt: int = Field(default=0, ge=0, description="the attempt of the round it is for")
    update: str = Field(description="base64 of little-endian float64, num_params values")
    unclipped: float = Field(default=0.0, allow_inf_nan=False, ge=-1e6, le=1e6)
    num_examples: int = Field(default=1, ge=1, le=2**31 - 1)


class UpdateAccepted(BaseModel):
    accepted: bool
    duplicate: bool
    round: int
    updates_received: int
