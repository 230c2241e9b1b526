"""The simulation fast path draws the same statistics as encoding every user.

For every categorical mechanism, R populations of n users with fixed true counts are
run both ways, through ``encode`` + ``aggregate`` (the exact path) and through
``simulate_statistics`` (the fast path), and each path's statistics are compared with
the theory: every coordinate's mean and variance, and the variance of the sum of two
coordinates (which checks their covariance) where the fast path is exact jointly.

Theory. Every coordinate is a sum of n independent Bernoulli indicators (one per user:
"this report lands on output y" or "supports v"), with probability ``P[v, y]`` for a
user of value v: the transition matrix for index reports (grr, hr), p or q for support
counts (unary, olh). Mean ``sum N_v P``, variance ``sum N_v P (1 - P)``.

Numeric mechanisms: the fast path draws (sum, sum of squares) from the normal law
with their exact means and covariance; its moment formulas are checked against encoded
reports, and both paths' means and variances against the theory.

Tolerances. A mean is within z sigma / sqrt(R) of the truth; a sample variance s^2 of
R draws within z sqrt(Var[s^2]) with Var[s^2] = sigma^4 (2 / (R - 1) + kappa / R) and
kappa the exact excess kurtosis of a Bernoulli sum (sum of the fourth cumulants
P (1 - P)(1 - 6 P (1 - P)) over sigma^4). z = 5.5 (two-sided 3.8e-8 per comparison,
normal approximation); about 600 comparisons, so the file fails falsely with
probability below 3e-5.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.mechanisms.base import IndexReports
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.numeric import NumericMechanism
from shared.schemas import MechanismSpec
from shared.statistics import MomentStatistics

Z = 5.5
REPS = 3000
COUNTS = np.array([120, 60, 0, 30, 75, 15])  # n = 300 users over d = 6 values


def _probabilities(mech: CategoricalMechanism) -> np.ndarray:
    """P[v, j]: a user of value v lands on coordinate j of the statistics."""
    if isinstance(mech, IndexReports):
        return mech.transition_matrix()
    d = mech.domain_size
    return np.where(np.eye(d, dtype=bool), mech.p, mech.q)


def _cumulants(probabilities: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mean, variance and fourth cumulant of Bernoulli sums, per column."""
    cell = probabilities * (1 - probabilities)
    return weights @ probabilities, weights @ cell, weights @ (cell * (1 - 6 * cell))


def _check(draws: np.ndarray, mean: np.ndarray, variance: np.ndarray, fourth: np.ndarray) -> None:
    """Rows of ``draws`` against the given law of each column."""
    reps = draws.shape[0]
    got_mean = draws.mean(axis=0)
    got_var = draws.var(axis=0, ddof=1)
    live = variance > 0
    assert np.all(np.abs(got_mean - mean) <= Z * np.sqrt(variance / reps) + 1e-9)
    assert np.array_equal(got_var[~live], variance[~live])
    kurtosis = fourth[live] / variance[live] ** 2
    spread = variance[live] * np.sqrt(2 / (reps - 1) + kurtosis / reps)
    assert np.all(np.abs(got_var[live] - variance[live]) <= Z * spread)


MECHANISMS = [
    ("grr", 1.0),
    ("grr", 3.0),
    ("sue", 1.0),
    ("oue", 1.0),
    ("oue", 4.0),
    ("olh", 1.0),
    ("olh", 2.0),
    ("hr", 1.0),
    ("hr", 2.0),
]


@pytest.mark.parametrize(("name", "epsilon"), MECHANISMS, ids=[f"{n}-{e:g}" for n, e in MECHANISMS])
@pytest.mark.slow
def test_exact_and_fast_paths_follow_the_same_law(name: str, epsilon: float) -> None:
    mech = make_mechanism(MechanismSpec(mechanism=name, epsilon=epsilon, domain_size=COUNTS.size))
    assert isinstance(mech, CategoricalMechanism)
    rng = np.random.default_rng(zlib.crc32(f"{name}-{epsilon}".encode()))
    values = np.repeat(np.arange(COUNTS.size), COUNTS)
    exact = np.array([mech.aggregate(mech.encode(values, rng)).counts for _ in range(REPS)])
    fast = np.array([mech.simulate_statistics(COUNTS, rng).counts for _ in range(REPS)])
    assert all(mech.simulate_statistics(COUNTS, rng).n == COUNTS.sum() for _ in range(3))
    probabilities = _probabilities(mech)
    weights = COUNTS.astype(np.float64)
    if isinstance(mech, IndexReports):  # one report lands on output 0 or 1: one Bernoulli
        pair = _cumulants(probabilities[:, :2].sum(axis=1, keepdims=True), weights)
    else:  # two independent bits per report: their cumulants add
        pair = tuple(c[:2].sum(keepdims=True) for c in _cumulants(probabilities, weights))
    for draws in (exact, fast):
        _check(draws, *_cumulants(probabilities, weights))
        if name != "olh":  # olh's fast path is exact per item only (see its docstring)
            _check(draws[:, :2].sum(axis=1, keepdims=True), *pair)


def test_fast_path_cost_does_not_grow_with_n() -> None:
    """A billion users, d = 1024: the statistics are drawn, not the users."""
    counts = np.full(1024, 1_000_000_000 // 1024)
    rng = np.random.default_rng(7)
    for name in ("grr", "oue", "sue", "olh", "hr"):
        mech = make_mechanism(MechanismSpec(mechanism=name, epsilon=1.0, domain_size=1024))
        assert isinstance(mech, CategoricalMechanism)
        stats = mech.simulate_statistics(counts, rng)
        estimate = mech.estimate(stats)
        assert stats.n == counts.sum()
        # Unbiased at this n to within 6 standard errors per item (false-failure ~1e-6).
        assert np.all(np.abs(estimate.frequencies - 1 / 1024) < 6 * estimate.std)


@pytest.mark.parametrize(
    ("counts", "error"),
    [
        (np.array([1, 2, 3]), ValueError),
        (np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), ValueError),
        (np.array([1, 2, -3, 4, 5, 6]), ValueError),
    ],
)
def test_fast_path_refuses_bad_counts(counts: np.ndarray, error: type[Exception]) -> None:
    mech = make_mechanism(MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=6))
    assert isinstance(mech, CategoricalMechanism)
    with pytest.raises(error, match="counts"):
        mech.simulate_statistics(counts, np.random.default_rng(0))
    with pytest.raises(TypeError, match="Generator"):
        mech.simulate_statistics(COUNTS, None)  # type: ignore[arg-type]


# --- numeric mechanisms ---------------------------------------------------------------

LEVELS = np.array([0.0, 1.3, 5.0, 9.99, 10.0, 14.0])  # 14 is clipped to the upper bound 10
LEVEL_COUNTS = np.array([40, 70, 0, 90, 60, 40])
NUMERIC = [
    ("laplace", 1.0),
    ("laplace", 4.0),
    ("duchi", 1.0),
    ("piecewise", 1.0),
    ("piecewise", 3.0),
]


def _numeric(name: str, epsilon: float) -> NumericMechanism:
    mech = make_mechanism(MechanismSpec(mechanism=name, epsilon=epsilon, lower=0, upper=10))
    assert isinstance(mech, NumericMechanism)
    return mech


@pytest.mark.parametrize(("name", "epsilon"), NUMERIC, ids=[f"{n}-{e:g}" for n, e in NUMERIC])
@pytest.mark.slow
def test_report_central_moments_match_the_reports(name: str, epsilon: float) -> None:
    """m2 is ``report_variance``; m3 and m4 agree with 400,000 encoded reports per level
    (sample moments within 6 plug-in standard errors: false-failure ~1e-8 each)."""
    mech = _numeric(name, epsilon)
    moments = mech.report_central_moments(LEVELS)
    np.testing.assert_allclose(moments[:, 0], mech.report_variance(LEVELS), rtol=1e-9)
    rng = np.random.default_rng(zlib.crc32(f"moments-{name}-{epsilon}".encode()))
    for level, expected in zip(LEVELS, moments, strict=True):
        reports = mech.debias(mech.encode(np.full(400_000, level), rng))
        errors = reports - mech.to_original(mech.normalize(np.array([level])))[0]
        for j, target in zip((2, 3, 4), expected, strict=True):
            powers = errors**j
            standard_error = powers.std() / math.sqrt(powers.size)
            assert abs(powers.mean() - target) <= 6 * standard_error + 1e-12 * abs(target)


@pytest.mark.parametrize(("name", "epsilon"), NUMERIC, ids=[f"{n}-{e:g}" for n, e in NUMERIC])
def test_numeric_paths_have_the_same_mean_and_variance(name: str, epsilon: float) -> None:
    """(T, Q) over R populations: each path's means within z standard errors of the
    theory, its variances within z standard errors of the sample variance (normal
    approximation of T and Q, sums of 300 independent reports)."""
    mech = _numeric(name, epsilon)
    rng = np.random.default_rng(zlib.crc32(f"paths-{name}-{epsilon}".encode()))
    values = np.repeat(LEVELS, LEVEL_COUNTS)
    reps = 2000

    def pair(stats: MomentStatistics) -> tuple[float, float]:
        assert stats.n == values.size
        return stats.total, stats.total_squares

    # The R populations' users in one encode call (every user is independent), then the
    # statistics of each population from its own reports.
    reports = np.split(mech.encode(np.tile(values, reps), rng), reps)
    exact = np.array([pair(mech.aggregate(population)) for population in reports])
    fast = np.array(
        [pair(mech.simulate_statistics(LEVELS, LEVEL_COUNTS, rng)) for _ in range(reps)]
    )
    mu = mech.to_original(mech.normalize(LEVELS))
    m2, m3, m4 = mech.report_central_moments(LEVELS).T
    w = LEVEL_COUNTS.astype(np.float64)
    mean = np.array([w @ mu, w @ (mu * mu + m2)])
    variance = np.array([w @ m2, w @ (4 * mu * mu * m2 + 4 * mu * m3 + m4 - m2 * m2)])
    for draws in (exact, fast):
        assert np.all(np.abs(draws.mean(axis=0) - mean) <= Z * np.sqrt(variance / reps))
        # Var[s^2] ~ 2 sigma^4 / (R - 1) for near-normal sums.
        spread = variance * math.sqrt(2 / (reps - 1))
        assert np.all(np.abs(draws.var(axis=0, ddof=1) - variance) <= Z * spread)
