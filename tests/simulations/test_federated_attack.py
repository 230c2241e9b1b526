"""Model-poisoning clients in the federated simulation (``simulations.federated_attack``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.federated.task import TaskConfig
from simulations.federated import (
    UPLOAD_NORM_ROUNDING,
    Dataset,
    load_dataset,
    run_task,
    task_config,
    upload_bound,
)
from simulations.federated_attack import (
    MODEL_ATTACKS,
    UNBOUNDED_SCALE,
    poison_of,
    run_federated_attack,
    run_secure_aggregation_exposure,
)


@pytest.mark.parametrize("attack", MODEL_ATTACKS)
def test_a_poisoned_update_has_the_norm_of_its_attack(attack: str) -> None:
    """At the bound B to rounding, within the float allowance the aggregator's norm check
    grants (so clipping leaves it whole and the check cannot refuse it), or at
    UNBOUNDED_SCALE B for ``unbounded``."""
    poison = poison_of(attack, seed=1)
    update = np.random.default_rng(2).standard_normal(650)
    poisoned = poison(update, 0.5)
    scale = UNBOUNDED_SCALE if attack == "unbounded" else 1.0
    assert np.linalg.norm(poisoned) == pytest.approx(0.5 * scale, rel=1e-12)
    if attack != "unbounded":
        assert np.linalg.norm(poisoned) <= 0.5 * (1 + UPLOAD_NORM_ROUNDING)
    if attack == "boost":  # one direction for every client: two clients' boosts add up
        assert np.array_equal(poisoned, poison(-update, 0.5))
    else:
        assert np.dot(poisoned, update) < 0


def test_the_bound_is_the_clip_norm_in_the_user_level_modes_only() -> None:
    update = np.full(4, 2.0)  # norm 4
    assert [upload_bound(mode, 0.5, update) for mode in ("central", "local", "distributed")] == [
        0.5
    ] * 3
    assert upload_bound("silo", 0.5, update) == 4.0


def test_an_unknown_attack_or_fraction_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model attack 'scale'"):
        poison_of("scale", seed=0)
    with pytest.raises(ValueError, match=r"\[1.5\]"):
        run_federated_attack(modes=("central",), fractions=(1.5,), rounds=1, clients=10)


def _tiny(mode: str, epsilon: float, secure: bool = False) -> tuple[Dataset, TaskConfig]:
    """20 digits clients, 3 rounds: well under a second a run."""
    data = load_dataset("digits", 20, "iid", 3)
    return data, task_config(data, mode, epsilon, 3, 1e-5, "logistic", 3, secure=secure)


@pytest.mark.parametrize(
    ("mode", "epsilon", "secure"), [("central", math.inf, False), ("distributed", math.inf, True)]
)
def test_without_malicious_clients_the_attacked_run_is_the_clean_run(
    mode: str, epsilon: float, secure: bool
) -> None:
    """Exact equality, round by round, for the same seed: the hook changes nothing and
    draws nothing when no client is malicious."""
    data, config = _tiny(mode, epsilon, secure)
    clean = run_task(data, config, epsilon, 3).accuracy
    nobody = np.zeros(20, dtype=bool)
    poison = poison_of("sign-flip", 0)
    assert run_task(data, config, epsilon, 3, 0.0, nobody, poison).accuracy == clean


def test_the_central_server_clips_an_unbounded_update_to_the_sign_flip() -> None:
    """The central mode's server clips every upload to C: scaling the flip 100-fold past C
    buys nothing (same seed, exact equality)."""
    data, config = _tiny("central", math.inf)
    half = np.arange(20) < 10
    flipped = run_task(data, config, math.inf, 3, 0.0, half, poison_of("sign-flip", 0))
    unbounded = run_task(data, config, math.inf, 3, 0.0, half, poison_of("unbounded", 0))
    assert flipped.accuracy != run_task(data, config, math.inf, 3).accuracy
    assert unbounded.accuracy == flipped.accuracy


def test_only_secure_aggregation_lets_unbounded_uploads_close_a_round() -> None:
    """Every client uploading 100 C: the plain distributed server refuses each upload (its
    norm is far past ``max_upload_norm``), so no round closes and the model is never
    evaluated; under secure aggregation the masked inputs pass and every round closes."""
    everybody = np.ones(20, dtype=bool)
    poison = poison_of("unbounded", 0)
    data, plain = _tiny("distributed", math.inf)
    assert all(
        math.isnan(a) for a in run_task(data, plain, math.inf, 3, 0.0, everybody, poison).accuracy
    )
    data, secure = _tiny("distributed", math.inf, secure=True)
    accuracy = run_task(data, secure, math.inf, 3, 0.0, everybody, poison).accuracy
    assert not any(math.isnan(a) for a in accuracy)


def test_smoke_rows_of_the_attack_grid() -> None:
    rows = run_federated_attack(
        modes=("central",), fractions=(0.0, 0.5), rounds=2, clients=20, attack="boost",
        epsilon=math.inf,
    )  # fmt: skip
    assert [(row["fraction"], row["malicious"]) for row in rows] == [(0.0, 0), (0.5, 10)]
    assert rows[0]["accuracy_loss"] == 0.0
    assert rows[0]["clean_accuracy"] == rows[1]["clean_accuracy"]
    assert rows[1]["server"] == "clips to C" and rows[1]["secure"] is False
    loss = rows[1]["clean_accuracy"] - rows[1]["attacked_accuracy"]
    assert rows[1]["accuracy_loss"] == loss


@pytest.mark.slow
def test_sign_flipping_clients_cost_the_central_mode_accuracy() -> None:
    """Seeded, digits, 100 clients, 20 rounds, epsilon 4: 20% of clients flipping their
    updates at C cost the central mode well over 5 points (measured 13.1 of a clean 84.4);
    an honest run's final accuracy varies by about 1 point between seeds, so 5 points is
    far outside what chance moves. 30% cost more than 20%."""
    rows = run_federated_attack(modes=("central",), fractions=(0.2, 0.3))
    losses = [row["accuracy_loss"] for row in rows]
    assert losses[0] > 0.05 and losses[1] > losses[0]


@pytest.mark.slow
def test_secure_aggregation_lets_an_unbounded_update_through() -> None:
    """5% of 100 clients uploading 100 C (digits, 20 rounds, epsilon 4, seeded): the plain
    distributed server refuses them (measured loss 0.8 points, from rounds with fewer
    clients), the secure one cannot check them and the model collapses (loss 71 points, to
    11% accuracy: chance); asserted with 20 points between them, far beyond the 1 point
    an honest run's final accuracy varies between seeds."""
    plain, secure = (
        row
        for row in run_secure_aggregation_exposure(fractions=(0.05,), rounds=20)
        if row["fraction"] == 0.05
    )
    assert not plain["secure"] and secure["secure"]
    assert secure["accuracy_loss"] > plain["accuracy_loss"] + 0.2
