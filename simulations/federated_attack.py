"""Model poisoning in federated learning: what a share of malicious clients costs each mode.

A malicious client trains like the others and then replaces its update u before it is
privatized, staying within the norm bound C that every mode enforces (so clipping does not
remove the attack, and a server checking norms cannot tell):

* ``sign-flip``: -C u / ||u||, the update turned against the descent direction at the
  largest norm allowed (a Byzantine update within the bound; Blanchard et al., NeurIPS
  2017, show plain averaging has no defence against such updates);
* ``boost``: C u / ||u|| scaled the other way round is harmless, so ``boost`` sends C w,
  w a fixed unit direction shared by every malicious client (seeded): coordinated updates
  that add up instead of cancelling (the explicit boosting of Bhagoji et al., ICML 2019,
  capped at the norm bound).

Each mode is run twice with the same seed, clean (no client malicious) and attacked; the
poisoning draws nothing at random, so both runs sample the same clients and noise and the
accuracy loss is the attack's alone. In the ``distributed`` mode with secure aggregation
the server sees only the sum; a device that skipped its own clipping could add any vector
of the ring (masked inputs are not validated: the README's threat model), which this
simulation does not model: every malicious update here stays within C.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from simulations.federated import Poison, load_dataset, run_task, task_config

__all__ = ["MODEL_ATTACKS", "poison_of", "run_federated_attack"]

MODEL_ATTACKS = ("sign-flip", "boost")
FEDERATED_ATTACK_MODES = ("central", "local", "distributed")


def poison_of(attack: str, seed: int) -> Poison:
    """The update replacement of ``attack`` (norm exactly C, or 0 for a zero update)."""
    if attack == "sign-flip":

        def flip(update: np.ndarray, clip_norm: float) -> np.ndarray:
            norm = float(np.linalg.norm(update))
            return -clip_norm * update / norm if norm > 0 else update

        return flip
    if attack == "boost":

        def boost(update: np.ndarray, clip_norm: float) -> np.ndarray:
            # the same unit direction for every client and round: drawn from ``seed`` alone
            direction = np.random.default_rng(seed).standard_normal(update.size)
            return (clip_norm * direction / np.linalg.norm(direction)).astype(update.dtype)

        return boost
    raise ValueError(f"unknown model attack {attack!r}; expected one of {', '.join(MODEL_ATTACKS)}")


def run_federated_attack(
    *,
    modes: Sequence[str] = FEDERATED_ATTACK_MODES,
    fractions: Sequence[float] = (0.0, 0.1, 0.2),
    attack: str = "sign-flip",
    epsilon: float = 4.0,
    rounds: int = 20,
    clients: int = 100,
    dataset: str = "digits",
    seed: int = 0,
    secure: bool = False,
) -> list[dict[str, Any]]:
    """One row per (mode, fraction): the final test accuracy clean and attacked, and the
    loss. ``fractions`` are the shares of malicious clients (the first ``round(f W)`` of a
    seeded permutation); ``secure``: the distributed mode through secure aggregation."""
    data = load_dataset(dataset, clients, "iid", seed)
    order = np.random.default_rng(seed + 1).permutation(clients)
    rows = []
    for mode in modes:
        config = task_config(data, mode, epsilon, rounds, 1e-5, "logistic", seed, secure=secure)
        clean = run_task(data, config, epsilon, seed)
        clean_accuracy = clean.accuracy[-1]
        for fraction in fractions:
            malicious = np.zeros(clients, dtype=bool)
            malicious[order[: round(fraction * clients)]] = True
            attacked = clean
            if malicious.any():
                poison = poison_of(attack, seed + 2)
                attacked = run_task(data, config, epsilon, seed, 0.0, malicious, poison)
            rows.append(
                {
                    "mode": mode,
                    "secure": secure and mode == "distributed",
                    "fraction": fraction,
                    "malicious": int(malicious.sum()),
                    "attack": attack,
                    "epsilon": epsilon,
                    "rounds": rounds,
                    "clean_accuracy": clean_accuracy,
                    "attacked_accuracy": attacked.accuracy[-1],
                    "accuracy_loss": clean_accuracy - attacked.accuracy[-1],
                }
            )
    return rows
