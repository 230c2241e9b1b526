"""The attack simulation against the theory of each attack (``simulations.attacks``).

Each check compares the mean gain (or shift) over ``reps`` seeded runs with its expected
value: |z| <= Z_MAX with z = (mean - theory) / standard error. For a normal mean the chance
that one correct check fails is 2 (1 - Phi(3.5)) = 4.7e-4 (seeds fixed; the standard error
is the runs' own, a t statistic with reps - 1 degrees of freedom: with 20 runs, 2.5e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

from shared.mechanisms import as_memoized, make_mechanism
from shared.schemas import MechanismSpec
from simulations import attacks
from simulations.attack import AttackConfig, categorical_mechanism, run_attacks, run_numeric_attacks
from simulations.attacks import (
    ATTACKS,
    FORGEABLE,
    expected_gain,
    fake_reports,
    numeric_fake_reports,
    supported_targets,
)

Z_MAX = 3.5


def mechanism(name: str, d: int = 256, epsilon: float = 1.0):  # type: ignore[no-untyped-def]
    return categorical_mechanism(name, AttackConfig(domain=d, epsilon=epsilon))


@pytest.mark.parametrize("name", ["grr", "oue", "olh"])
def test_the_maximal_gain_attack_moves_the_targets_as_cao_et_al_predict(name: str) -> None:
    config = AttackConfig(
        mechanisms=(name,), attacks=("mga",), betas=(0.05,), defences=("none",),
        domain=256, users=5_000, targets=10, reps=20, seed=3,
    )  # fmt: skip
    (row,) = run_attacks(config)
    assert abs(row["z"]) <= Z_MAX, row
    assert row["gain"] > 10 * row["gain_se"]  # a real gain, not noise


@pytest.mark.slow
@pytest.mark.parametrize("name", FORGEABLE)
def test_every_attack_matches_its_theory(name: str) -> None:
    config = AttackConfig(
        mechanisms=(name,), attacks=ATTACKS, betas=(0.02, 0.1), defences=("none",),
        domain=256, users=10_000, targets=8, reps=20, seed=4,
    )  # fmt: skip
    for row in run_attacks(config):
        assert abs(row["z"]) <= Z_MAX, row


@pytest.mark.parametrize("name", FORGEABLE)
@pytest.mark.parametrize("attack", ATTACKS)
def test_forged_reports_support_the_targets_they_are_said_to(name: str, attack: str) -> None:
    """S, the targets a forged report supports on average, against 4,000 forged reports:
    their support counts are sums of independent indicators (MGA: constant), so the mean is
    within 5 standard errors (sd <= sqrt(r / 4) per report)."""
    mech = mechanism(name)
    rng = np.random.default_rng(5)
    targets = np.sort(rng.choice(256, 6, replace=False))
    forged = fake_reports(mech, attack, targets, 4_000, rng)
    mech.check_reports(forged)
    supported = mech.support_counts(mech.aggregate(forged))[targets].sum() / 4_000
    expected = supported_targets(mech, attack, targets)
    assert abs(supported - expected) <= 5 * np.sqrt(6 / 4 / 4_000), (supported, expected)


def test_the_memoized_mechanisms_are_attacked_at_epsilon_per_report() -> None:
    lsue = as_memoized(categorical_mechanism("lsue", AttackConfig(domain=64, epsilon=1.0)))
    assert lsue is not None and (lsue.epsilon_report, lsue.epsilon_lifetime) == (1.0, 2.0)
    lgrr = as_memoized(categorical_mechanism("lgrr", AttackConfig(domain=64, epsilon_lifetime=3)))
    assert lgrr is not None and (lgrr.epsilon_report, lgrr.epsilon_lifetime) == (1.0, 3.0)
    with pytest.raises(ValueError, match="epsilon_lifetime"):
        AttackConfig(epsilon=2.0, epsilon_lifetime=1.0)


def _brute_force_hashes(
    prime: int, g: int, targets: np.ndarray
) -> tuple[set[tuple[int, ...]], int]:
    """Every (a, b, y) sending the most targets to bucket y, hash by hash."""
    best, rows = -1, set[tuple[int, ...]]()
    for a in range(1, prime):
        for b in range(prime):
            counts = np.bincount((a * targets + b) % prime % g, minlength=g)
            if counts.max() > best:
                best, rows = int(counts.max()), set()
            if counts.max() == best:
                rows |= {(a, b, int(y)) for y in np.flatnonzero(counts == best)}
    return rows, best


def test_the_olh_hash_search_finds_every_best_hash() -> None:
    olh = mechanism("olh", d=40)  # P = 41, g = 4: 1,640 hashes
    targets = np.array([0, 3, 7, 12, 20, 33])
    rows, best = attacks._best_hashes(olh, targets)
    assert ({tuple(row) for row in rows.tolist()}, best) == _brute_force_hashes(41, 4, targets)


def test_beyond_its_limit_the_olh_hash_search_samples_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the limit below (P - 1) P the search samples hashes; every row it returns still
    sends exactly S targets to its bucket, and no hash of the family does better. (Its
    remembered result is forgotten before and after: the limit is this test's.)"""
    monkeypatch.setattr(attacks, "HASH_SEARCH_LIMIT", 500)
    olh = mechanism("olh", d=40)
    targets = np.array([1, 4, 9, 16, 25, 36])
    attacks._hash_search.cache_clear()
    try:
        rows, best = attacks._best_hashes(olh, targets)
    finally:
        attacks._hash_search.cache_clear()
    assert attacks._candidate_hashes(41).shape == (500, 2)  # sampled, not all 1,640
    hashed = (rows[:, :1] * targets + rows[:, 1:2]) % 41 % 4
    assert ((hashed == rows[:, 2:]).sum(axis=1) == best).all()
    assert best <= _brute_force_hashes(41, 4, targets)[1]


def test_maximal_gain_unary_reports_look_honest_to_the_ones_count_rule() -> None:
    mech = mechanism("oue", d=1024)
    targets = np.arange(10)
    forged = fake_reports(mech, "mga", targets, 200, np.random.default_rng(6))
    ones = np.unpackbits(forged, axis=1).sum(axis=1)
    assert (ones == round(mech.p + 1023 * mech.q)).all()
    assert (mech.refusals(forged) == -1).all()
    assert np.unpackbits(forged, axis=1)[:, targets].all()


def test_the_gain_formula_is_linear_in_beta_and_falls_with_the_targets_share() -> None:
    mech = mechanism("oue")
    targets = np.arange(5)
    flat = np.full(256, 1 / 256)
    assert expected_gain(mech, "mga", targets, 0.1, flat) == pytest.approx(
        2 * expected_gain(mech, "mga", targets, 0.05, flat), rel=1e-12
    )
    p, q = mech.p, mech.q
    assert expected_gain(mech, "mga", targets, 0.05, flat) == pytest.approx(
        0.05 * (5 * (1 - q) / (p - q) - 5 / 256), rel=1e-12
    )


def test_detection_cuts_the_maximal_gain_on_oue_and_olh() -> None:
    config = AttackConfig(
        mechanisms=("oue", "olh"), attacks=("mga",), betas=(0.05,),
        defences=("none", "detection"), domain=256, users=10_000, targets=10, reps=3, seed=7,
    )  # fmt: skip
    rows = {(r["mechanism"], r["defence"]): r for r in run_attacks(config)}
    for name in ("oue", "olh"):
        assert rows[(name, "detection")]["gain_ratio"] <= 0.5, rows[(name, "detection")]
        assert rows[(name, "detection")]["honest_mse_ratio"] <= 1.05


@pytest.mark.parametrize("name", ["laplace", "duchi", "piecewise"])
def test_the_mean_moves_as_the_forged_reports_predict(name: str) -> None:
    config = AttackConfig(
        numeric=(name,), numeric_attacks=("mean-max", "variance"), betas=(0.05,),
        numeric_defences=("none", "refusal"), users=4_000, reps=20, seed=8,
    )  # fmt: skip
    for row in run_numeric_attacks(config):
        assert abs(row["z"]) <= Z_MAX, row


def test_the_robust_laplace_mean_bounds_what_forged_reports_do() -> None:
    config = AttackConfig(
        numeric=("laplace",), numeric_attacks=("mean-max",), betas=(0.01,), users=4_000,
        reps=10, seed=9,
    )  # fmt: skip
    rows = {r["defence"]: r for r in run_numeric_attacks(config)}
    assert rows["refusal"]["shift"] < rows["none"]["shift"]
    assert rows["robust"]["shift"] < 0.5 * rows["refusal"]["shift"]
    assert rows["robust"]["honest_mse_ratio"] <= 1.05


def test_numeric_forged_reports_are_the_extremes_the_service_accepts() -> None:
    mech = make_mechanism(
        MechanismSpec.model_validate(
            {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 100.0}
        )
    )
    kept = numeric_fake_reports(mech, "mean-max", 3, refusal=True)
    assert (mech.refusals(kept) == -1).all()
    assert (mech.refusals(kept + 1) >= 0).all()
    structural = numeric_fake_reports(mech, "mean-max", 3, refusal=False)
    mech.check_reports(structural)
    with pytest.raises(ValueError):
        mech.check_reports(structural + 1)
