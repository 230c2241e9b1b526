"""Model-poisoning clients in the federated simulation (``simulations.federated_attack``)."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.federated_attack import MODEL_ATTACKS, poison_of, run_federated_attack


@pytest.mark.parametrize("attack", MODEL_ATTACKS)
def test_a_poisoned_update_stays_within_the_norm_bound(attack: str) -> None:
    """Exactly at C (to rounding): clipping leaves it whole, a norm check cannot refuse it."""
    poison = poison_of(attack, seed=1)
    update = np.random.default_rng(2).standard_normal(650)
    poisoned = poison(update, 0.5)
    assert np.linalg.norm(poisoned) == pytest.approx(0.5, rel=1e-12)
    if attack == "sign-flip":
        assert np.dot(poisoned, update) < 0
    else:  # one direction for every client: two clients' boosts add up
        assert np.array_equal(poisoned, poison(-update, 0.5))


def test_without_malicious_clients_the_attacked_run_is_the_clean_run() -> None:
    (row,) = run_federated_attack(
        modes=("central",), fractions=(0.0,), rounds=2, clients=30, epsilon=4.0
    )
    assert row["malicious"] == 0 and row["accuracy_loss"] == 0.0


@pytest.mark.slow
def test_sign_flipping_clients_cost_the_central_mode_accuracy() -> None:
    """Seeded: 30% of 100 clients flipping their updates at the norm bound cost the central
    mode (epsilon 4, 20 rounds) well over 5 points (measured 36); 10% cost less than 30%."""
    rows = run_federated_attack(
        modes=("central",), fractions=(0.1, 0.3), rounds=20, clients=100, epsilon=4.0
    )
    losses = [row["accuracy_loss"] for row in rows]
    assert losses[1] > 0.05 and losses[1] > losses[0]
