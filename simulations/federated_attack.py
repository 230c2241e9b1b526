"""Model poisoning in federated learning: what a share of malicious clients costs each mode.

A malicious client trains like the others and then replaces its update u before it is
privatized (:func:`simulations.federated.run_task`'s ``malicious`` and ``poison``). With
``B`` the mode's bound on an upload (:func:`simulations.federated.upload_bound`: the clip
norm ``C`` in the user-level modes ``local``, ``central`` and ``distributed``; the honest
update's own norm in the ``silo`` mode, where nothing bounds an upload):

* ``sign-flip``: ``-B u / ||u||``, the update turned against the descent direction at the
  largest norm allowed: a Byzantine update (Blanchard, El Mhamdi, Guerraoui and Stainer,
  *Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent*, NeurIPS 2017,
  show that one such client controls a plain average);
* ``boost``: ``B w``, ``w`` one fixed unit direction shared by every malicious client and
  round (seeded): coordinated updates that add up instead of cancelling, the explicit
  boosting of Bhagoji, Chakraborty, Mittal and Calo (*Analyzing Federated Learning through
  an Adversarial Lens*, ICML 2019) capped at the bound.

Both stay within the bound, so neither clipping nor a norm check removes them: their cost
is what the bound itself concedes. Each malicious client replaces an update of norm at
most ``B`` by another, moving the round's sum by at most ``2 B``; a share ``beta`` of
clients is about ``beta q W`` of the ``q W`` expected in a round, so the mean update (the
sum over ``q W``) moves by at most ``2 beta B`` in expectation over the sampling.

* ``unbounded``: the sign-flip scaled to ``UNBOUNDED_SCALE B``, a client that skips its own
  clipping. What it achieves is what the server lets through (read from
  ``aggregator.federated._check_vector`` and ``PrivateAggregation.aggregate``):
  ``central`` clips every upload to ``C`` itself (the attack is the sign-flip again);
  ``local`` and plain ``distributed`` refuse an upload whose norm exceeds
  ``DPConfig.max_upload_norm`` (422: the attack is dropped); the ``silo`` server has no
  bound to check and takes it whole; and in ``distributed`` with secure aggregation the
  server sees only the unmasked sum, so a masked input is never checked and any ring
  vector passes (:func:`run_secure_aggregation_exposure` measures that row kind).

Each mode is run clean (no client malicious) and attacked with the same seed; the
poisoning draws nothing from the run's generator, so both runs sample the same clients and
noise and the accuracy loss is the attack's alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from simulations.federated import Poison, load_dataset, run_task, task_config

__all__ = [
    "FEDERATED_ATTACK_MODES",
    "MODEL_ATTACKS",
    "SERVER_TREATMENT",
    "UNBOUNDED_SCALE",
    "poison_of",
    "run_federated_attack",
    "run_secure_aggregation_exposure",
]

MODEL_ATTACKS = ("sign-flip", "boost", "unbounded")
FEDERATED_ATTACK_MODES = ("central", "local", "distributed", "silo")

#: How far beyond the bound the ``unbounded`` attack scales its update (``100 B``).
UNBOUNDED_SCALE = 100.0

#: What the server does with an upload beyond the mode's bound (the ``server`` column).
SERVER_TREATMENT = {
    "central": "clips to C",
    "local": "refuses norm > bound",
    "distributed": "refuses norm > bound",
    "distributed+secure": "sees only the sum",
    "silo": "no bound",
}


def poison_of(attack: str, seed: int) -> Poison:
    """The update replacement of ``attack``: norm exactly the bound ``B`` it is given
    (``UNBOUNDED_SCALE B`` for ``unbounded``), or the zero update left as it is (it has no
    direction to flip)."""
    if attack in ("sign-flip", "unbounded"):
        scale = UNBOUNDED_SCALE if attack == "unbounded" else 1.0

        def flip(update: np.ndarray, bound: float) -> np.ndarray:
            norm = float(np.linalg.norm(update))
            return -scale * bound * update / norm if norm > 0 else update

        return flip
    if attack == "boost":

        def boost(update: np.ndarray, bound: float) -> np.ndarray:
            # the same unit direction for every client and round: drawn from ``seed`` alone
            direction = np.random.default_rng(seed).standard_normal(update.size)
            return (bound * direction / np.linalg.norm(direction)).astype(update.dtype)

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
    loss (clean - attacked, in accuracy points of 1). ``fractions`` are the shares of
    malicious clients (the first ``round(f W)`` of a seeded permutation, the same clients
    in every mode); ``secure``: the distributed mode through secure aggregation."""
    if attack not in MODEL_ATTACKS:
        raise ValueError(f"unknown model attack {attack!r}; expected one of {MODEL_ATTACKS}")
    bad = [f for f in fractions if not 0.0 <= f <= 1.0]
    if bad:
        raise ValueError(f"fractions of malicious clients must lie in [0, 1], got {bad}")
    data = load_dataset(dataset, clients, "iid", seed)
    order = np.random.default_rng(seed + 1).permutation(clients)
    poison = poison_of(attack, seed + 2)
    rows = []
    for mode in modes:
        config = task_config(data, mode, epsilon, rounds, 1e-5, "logistic", seed, secure=secure)
        through_secagg = config.secure_aggregation is not None
        clean_accuracy = run_task(data, config, epsilon, seed).accuracy[-1]
        for fraction in fractions:
            malicious = np.zeros(clients, dtype=bool)
            malicious[order[: round(fraction * clients)]] = True
            attacked_accuracy = clean_accuracy  # no malicious client: the clean run itself
            if malicious.any():
                run = run_task(data, config, epsilon, seed, 0.0, malicious, poison)
                attacked_accuracy = run.accuracy[-1]
            rows.append(
                {
                    "mode": mode,
                    "secure": through_secagg,
                    "server": SERVER_TREATMENT[f"{mode}+secure" if through_secagg else mode],
                    "fraction": fraction,
                    "malicious": int(malicious.sum()),
                    "attack": attack,
                    "epsilon": epsilon,
                    "rounds": rounds,
                    "clean_accuracy": clean_accuracy,
                    "attacked_accuracy": attacked_accuracy,
                    "accuracy_loss": clean_accuracy - attacked_accuracy,
                }
            )
    return rows


def run_secure_aggregation_exposure(
    *,
    fractions: Sequence[float] = (0.0, 0.01, 0.05),
    epsilon: float = 4.0,
    rounds: int = 20,
    clients: int = 100,
    dataset: str = "digits",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """What secure aggregation changes: the ``unbounded`` attack against the distributed
    mode without it (the server refuses each over-norm upload) and with it (the masked
    upload passes unchecked), the same clients and seed; rows as
    :func:`run_federated_attack`'s."""
    return [
        row
        for secure in (False, True)
        for row in run_federated_attack(
            modes=("distributed",),
            fractions=fractions,
            attack="unbounded",
            epsilon=epsilon,
            rounds=rounds,
            clients=clients,
            dataset=dataset,
            seed=seed,
            secure=secure,
        )  # fmt: skip
    ]
