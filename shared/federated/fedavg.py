"""Plain federated averaging (FedAvg), with a server learning rate and momentum.

McMahan et al., *Communication-Efficient Learning of Deep Networks from Decentralized
Data* (AISTATS 2017): in every round each participating client starts from the global
parameters ``theta``, trains locally, and sends its *update* ``Delta_k = theta_k - theta``.
The server averages the updates, ``Delta = sum_k w_k Delta_k / sum_k w_k`` (``w_k`` the
client's example count), and moves the global model. With the server optimizer of Hsu,
Qi and Brown (*Measuring the Effects of Non-Identical Data Distribution*, 2019, FedAvgM)
that step is ``v <- beta v + Delta``, ``theta <- theta + eta_s v``; ``beta = 0`` and
``eta_s = 1`` is FedAvg itself.

Differential privacy is added around this, not inside it: :mod:`shared.federated.privacy`
wraps :meth:`FedAvg.aggregate` (clipping, noise, a fixed denominator) and hands the
result to the same :meth:`FedAvg.apply`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.federated.models import LocalTraining, Model, local_train

__all__ = ["FedAvg", "ServerState", "client_update"]


@dataclass(frozen=True)
class ServerState:
    """The global model and the server optimizer's velocity (same length)."""

    params: np.ndarray
    velocity: np.ndarray

    @classmethod
    def start(cls, params: np.ndarray) -> ServerState:
        flat = np.asarray(params, dtype=np.float64)
        if flat.ndim != 1:
            raise ValueError(f"params must be a flat vector, got shape {flat.shape}")
        return cls(flat.copy(), np.zeros_like(flat))


@dataclass(frozen=True)
class FedAvg:
    """Weighted averaging of client updates and a momentum step on the server."""

    server_learning_rate: float = 1.0
    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.server_learning_rate) and self.server_learning_rate > 0):
            raise ValueError(
                "server_learning_rate must be a finite number > 0, "
                f"got {self.server_learning_rate!r}"
            )
        if not 0.0 <= self.server_momentum < 1.0:
            raise ValueError(f"server_momentum must lie in [0, 1), got {self.server_momentum!r}")

    def aggregate(self, updates: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """``sum_k w_k Delta_k / sum_k w_k`` over the rows of ``updates`` (uniform w if None)."""
        rows = np.asarray(updates, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError(
                f"updates must be a non-empty (clients, params) array, got {rows.shape}"
            )
        if weights is None:
            return rows.mean(axis=0)
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (rows.shape[0],) or np.any(w < 0) or not w.sum() > 0:
            raise ValueError("weights must be one non-negative number per update, not all zero")
        return (w @ rows) / w.sum()

    def apply(self, state: ServerState, mean_update: np.ndarray) -> ServerState:
        """``v <- beta v + Delta``; ``theta <- theta + eta_s v``."""
        if mean_update.shape != state.params.shape:
            raise ValueError(
                f"the update has shape {mean_update.shape}, the model {state.params.shape}"
            )
        velocity = self.server_momentum * state.velocity + mean_update
        return ServerState(state.params + self.server_learning_rate * velocity, velocity)


def client_update(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    training: LocalTraining,
    rng: np.random.Generator,
) -> np.ndarray:
    """A client's FedAvg update: its locally trained parameters minus the global ones."""
    return local_train(model, params, x, y, training, rng) - params
