"""The two standard errors of a mean: around the users' own mean, and the population's.

``MeanEstimate.std`` is sqrt(sum_i Var[y_i | x_i]) / n, the error of the estimate around
the mean of the reporting users' clipped values; ``population_std`` = sqrt(s^2 / n) the
error around the mean of the population the users were drawn from
(``shared.mechanisms.numeric``). Checked here:

* exactly: the noise variance estimator ``NoiseVariance.total`` evaluated at the expected
  statistics (it is linear in them) equals sum_i ``report_variance(x_i)`` plus the stated
  rounding slack (zero at half-steps of the grid, step^2 / 4 per report at grid points);
  duchi's bound is at least the true sum and tight for one value held by many users;
  a variance estimate below the data-independent minimum is raised to it;
* statistically, with encoded reports: the mean over runs of n^2 std^2 is that expectation
  (piecewise, whose std is estimated from the reports);
* coverage, at epsilon 0.5, 2 and 8 for laplace, piecewise and duchi, over R runs of
  n = 20,000 users drawn from a fixed population (simulation fast path,
  ``simulate_statistics``; exact for duchi, the exact first two moments of the sum and
  sum of squares otherwise): the interval ``ci(0.95)`` covers the users' own mean in
  95% of runs (duchi: at least 95%, its std is an upper bound), and
  ``ci(0.95, population=True)`` covers the population mean in 95% of runs; plus the
  users' interval through ``encode`` at a smaller n.

Tolerances. Coverage counts are Bin(R, 0.95) (normal approximation of the estimate,
accurate at these n: every mechanism's report is bounded); each count is accepted in its
exact binomial interval of false-failure probability ``ALPHA = 1e-6`` (one-sided for
duchi's upper bound). Means over runs are within z(1e-6) = 4.89 estimated standard
errors. About 30 assertions: the file fails falsely with probability below 3e-5; with
the fixed seeds it is deterministic.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
from scipy import stats

from shared.estimates import MeanEstimate
from shared.mechanisms import make_mechanism
from shared.mechanisms.laplace import DiscreteLaplace
from shared.mechanisms.numeric import NoiseVariance, NumericMechanism
from shared.mechanisms.piecewise import PiecewiseMechanism
from shared.schemas import MechanismSpec
from shared.statistics import MomentStatistics

ALPHA = 1e-6
LEVEL = 0.95
LOWER, UPPER = 0.0, 10.0
#: A fixed population: clipped values (12 counts as 10), off and on the grid.
LEVELS = np.array([0.0, 0.7, 2.35, 5.0, 6.1, 9.42, 10.0, 12.0])
SHARES = np.array([0.1, 0.15, 0.2, 0.15, 0.15, 0.1, 0.1, 0.05])
USERS = 20_000
RUNS = 4000
NAMES = ("laplace", "piecewise", "duchi")
EPSILONS = (0.5, 2.0, 8.0)
CASES = [(name, eps) for name in NAMES for eps in EPSILONS]


def mechanism(name: str, epsilon: float, grid_steps: int | None = None) -> NumericMechanism:
    spec = MechanismSpec.model_validate(
        {
            "mechanism": name,
            "epsilon": epsilon,
            "lower": LOWER,
            "upper": UPPER,
            "grid_steps": grid_steps,
        }
    )
    mech = make_mechanism(spec)
    assert isinstance(mech, NumericMechanism)
    return mech


def rng_for(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def z_two_sided(alpha: float) -> float:
    return float(stats.norm.isf(alpha / 2))


def binomial_bounds(trials: int, probability: float) -> tuple[int, int]:
    """[lo, hi] with P(X < lo), P(X > hi) <= ALPHA / 2 for X ~ Bin(trials, probability)."""
    return (
        int(stats.binom.ppf(ALPHA / 2, trials, probability)),
        int(stats.binom.isf(ALPHA / 2, trials, probability)),
    )


def gridded(mech: NumericMechanism) -> DiscreteLaplace | PiecewiseMechanism:
    """``mech`` as a mechanism that rounds to a grid (``grid_steps``, ``step``)."""
    assert isinstance(mech, DiscreteLaplace | PiecewiseMechanism)
    return mech


def expected_statistics(mech: NumericMechanism, values: np.ndarray) -> MomentStatistics:
    """(n, E[T], E[Q]) with E[y | x] = clip(x) and E[y^2 | x] = clip(x)^2 + Var[y | x]."""
    mu = mech.to_original(mech.normalize(values))
    variance = mech.report_central_moments(values)[:, 0]
    return MomentStatistics(values.size, float(mu.sum()), float((mu * mu + variance).sum()))


# --- the estimator's expectation, exactly -------------------------------------------------

GRIDDED = [
    (name, eps, steps)
    for name in ("laplace", "piecewise")
    for eps in EPSILONS
    for steps in (4, None)
]


@pytest.mark.parametrize(("name", "epsilon", "steps"), GRIDDED)
def test_noise_variance_estimate_is_unbiased_but_for_the_rounding_bound(
    name: str, epsilon: float, steps: int | None
) -> None:
    """E[V] = sum_i Var[y | x_i] + sum_i step^2 (1/4 - phi_i (1 - phi_i)): exact at half-steps
    of the grid (phi = 1/2), step^2 / 4 above it per report at grid points (phi = 0)."""
    mech = gridded(mechanism(name, epsilon, steps))
    model = mech.variance_model()
    grid, step = mech.grid_steps, mech.step
    counts = np.arange(1, grid + 1)
    half_steps = np.repeat(LOWER + step * (np.arange(grid) + 0.5), counts)
    points = np.repeat(LOWER + step * np.arange(1, grid + 1), counts)
    for values, slack in ((half_steps, 0.0), (points, step**2 / 4)):
        total, method = model.total(expected_statistics(mech, values))
        truth = float(mech.report_variance(values).sum())
        assert method == ("known" if name == "laplace" else "estimated")
        np.testing.assert_allclose(total, truth + values.size * slack, rtol=1e-9)


def test_piecewise_noise_variance_follows_the_values() -> None:
    """The estimate tracks sum Var[y | x_i], which for piecewise grows with |x - centre|:
    users at the ends get a larger std than users at the centre, from their reports alone
    (these values are grid points: the rounding bound adds step^2 / 4 per report)."""
    mech = gridded(mechanism("piecewise", 4.0))
    model = mech.variance_model()
    totals = []
    for value in (0.0, 5.0, 10.0):
        values = np.full(1000, value)
        total, _ = model.total(expected_statistics(mech, values))
        truth = mech.report_variance(values).sum() + values.size * mech.step**2 / 4
        np.testing.assert_allclose(total, truth, rtol=1e-9)
        totals.append(total)
    assert totals[0] > 1.8 * totals[1] and totals[2] > 1.8 * totals[1]


def test_a_variance_estimate_below_the_minimum_is_raised_to_it() -> None:
    """Reports all at the centre (S = 0) make the unbiased piecewise estimate fall below
    n base, the least possible sum of noise variances: it is raised to that."""
    mech = mechanism("piecewise", 2.0)
    model = mech.variance_model()
    n = 50
    centre = (LOWER + UPPER) / 2
    unbiased = n * (model.base + model.rounding) / (1 + model.curvature)
    assert unbiased < n * model.least() == n * model.base
    estimate = mech.estimate(MomentStatistics(n, n * centre, n * centre**2))
    assert estimate.std == math.sqrt(n * model.base) / n
    assert estimate.population_std == 0.0


def test_duchi_bound_is_conservative_and_tight_for_one_value() -> None:
    """At ybar = xbar the bound n (W - d^2) is at least sum Var[y | x_i] (Cauchy-Schwarz);
    for 10^12 users at one value the slack vanishes and it is the true sum."""
    mech = mechanism("duchi", 2.0)
    model = mech.variance_model()
    rng = rng_for("duchi-bound")
    for _ in range(20):
        values = rng.uniform(LOWER - 1, UPPER + 1, 500)
        total, method = model.total(expected_statistics(mech, values))
        assert method == "upper-bound"
        assert mech.report_variance(values).sum() <= total <= 500 * model.base
    n = 10**12
    x = 9.0
    mean = float(mech.to_original(mech.normalize(np.array([x])))[0])
    total, _ = model.total(MomentStatistics(n, n * mean, n * (mean * mean + 1.0)))
    truth = n * float(mech.report_variance(np.array([x]))[0])
    assert truth <= total <= truth * (1 + 1e-4)
    # Far outside the range the distance is capped at half the range: the least variance.
    far = model.total(MomentStatistics(10, 10 * 1e6, 10 * 1e12))[0]
    assert far == 10 * model.least() > 0


def test_duchi_bound_holds_for_errors_up_to_its_slack() -> None:
    """Users at 9.9 of [0, 10] at epsilon 8 (Var[y | x] small, the Cauchy-Schwarz bound
    tight): for every error ybar - xbar up to z* sqrt(W / n) the bound is at least the true
    sum, whereas the plug-in n (W - (ybar - c)^2) falls below it once the error moves ybar
    away from the centre (by 2 true standard errors: a 2.3% event)."""
    mech = mechanism("duchi", 8.0)
    model = mech.variance_model()
    n = 1000
    truth = n * float(mech.report_variance(np.array([9.9]))[0])
    slack = float(stats.norm.isf((1 - 0.999999) / 2)) * math.sqrt(model.base / n)
    centre = (LOWER + UPPER) / 2
    for error in np.linspace(-slack, slack, 101):
        ybar = 9.9 + error
        total, _ = model.total(MomentStatistics(n, n * ybar, n * (ybar * ybar + 1.0)))
        assert total >= truth * (1 - 1e-9), (error, total, truth)  # equal at +slack
    ybar = 9.9 + 2 * math.sqrt(truth) / n
    assert n * (model.base - (ybar - centre) ** 2) < 0.8 * truth


def test_noise_variance_refuses_impossible_parameters() -> None:
    for base, curvature, rounding in ((-1.0, 0.0, 0.0), (1.0, -1.5, 0.0), (1.0, 0.0, -0.1)):
        with pytest.raises(ValueError, match="base >= 0, rounding >= 0 and curvature >= -1"):
            NoiseVariance(5.0, 5.0, base, curvature, rounding)


# --- the estimator's expectation, from encoded reports -----------------------------------


@pytest.mark.parametrize(("epsilon", "steps"), [(2.0, 4), (1.0, None), (8.0, None)])
def test_piecewise_std_is_unbiased_from_encoded_reports(epsilon: float, steps: int | None) -> None:
    """mean over R runs of n^2 std^2 = sum_i Var[y | x_i] + sum_i step^2 (1/4 - phi(1 - phi)),
    within z(1e-6) standard errors of the mean of R runs (sd estimated from the runs)."""
    mech = gridded(mechanism("piecewise", epsilon, steps))
    model = mech.variance_model()
    n, runs = 300, 2000
    values = rng_for(f"values-{epsilon}-{steps}").uniform(LOWER - 1, UPPER + 1, n)
    reports = mech.encode(np.tile(values, runs), rng_for(f"encode-{epsilon}-{steps}"))
    estimates = [mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])) for r in range(runs)]
    totals = np.array([(est.std * n) ** 2 for est in estimates])
    assert np.all(totals > n * model.least())  # the floor never applied: no clipping bias
    position = (np.clip(values, LOWER, UPPER) - LOWER) / mech.step
    phi = position - np.floor(position)
    slack = mech.step**2 * (0.25 - phi * (1 - phi))
    expected = float(mech.report_variance(values).sum() + slack.sum())
    error = totals.mean() - expected
    limit = z_two_sided(ALPHA) * totals.std(ddof=1) / math.sqrt(runs)
    assert abs(error) <= limit, f"mean n^2 std^2 {totals.mean():.6g}, expected {expected:.6g}"


# --- coverage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Coverage:
    users: int  # runs whose ci(LEVEL) held the users' own mean
    population: int  # runs whose ci(LEVEL, population=True) held the population mean


@cache
def coverage(name: str, epsilon: float) -> Coverage:
    """R runs: n users drawn from the population (multinomial counts), their statistics
    drawn by the fast path, both intervals checked against their targets."""
    mech = mechanism(name, epsilon)
    rng = rng_for(f"coverage-{name}-{epsilon}")
    clipped = np.clip(LEVELS, LOWER, UPPER)
    population_mean = float(SHARES @ clipped)
    users = population = 0
    for _ in range(RUNS):
        counts = rng.multinomial(USERS, SHARES)
        estimate = mech.estimate(mech.simulate_statistics(LEVELS, counts, rng))
        users += covers(estimate.ci(LEVEL), float(counts @ clipped) / USERS)
        population += covers(estimate.ci(LEVEL, population=True), population_mean)
    return Coverage(users, population)


def covers(interval: tuple[float, float], target: float) -> bool:
    return interval[0] <= target <= interval[1]


@pytest.mark.parametrize(("name", "epsilon"), CASES)
@pytest.mark.slow
def test_std_interval_covers_the_users_own_mean(name: str, epsilon: float) -> None:
    """95% (laplace, piecewise) or at least 95% (duchi, whose std is an upper bound)."""
    covered = coverage(name, epsilon).users
    if name == "duchi":
        low = int(stats.binom.ppf(ALPHA, RUNS, LEVEL))
        assert covered >= low, f"{covered}/{RUNS} covered the users' mean, accepted >= {low}"
        return
    low, high = binomial_bounds(RUNS, LEVEL)
    assert low <= covered <= high, f"{covered}/{RUNS} covered the users' mean, not {low}..{high}"


@pytest.mark.parametrize(("name", "epsilon"), CASES)
@pytest.mark.slow
def test_population_interval_covers_the_population_mean(name: str, epsilon: float) -> None:
    covered = coverage(name, epsilon).population
    low, high = binomial_bounds(RUNS, LEVEL)
    assert low <= covered <= high, (
        f"{covered}/{RUNS} covered the population mean, not {low}..{high}"
    )


@pytest.mark.parametrize("name", ["laplace", "piecewise"])
@pytest.mark.slow
def test_std_interval_coverage_through_encode(name: str) -> None:
    """The users' interval at epsilon 8 (where the spread of the values dominates the
    population interval) with every report encoded: 95% of R = 1000 runs of n = 2000."""
    mech = mechanism(name, 8.0)
    n, runs = 2000, 1000
    values = np.repeat(LEVELS, np.round(SHARES * n).astype(np.int64))
    truth = float(np.clip(values, LOWER, UPPER).mean())
    reports = mech.encode(np.tile(values, runs), rng_for(f"encode-coverage-{name}"))
    estimates: list[MeanEstimate] = [
        mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])) for r in range(runs)
    ]
    covered = sum(covers(est.ci(LEVEL), truth) for est in estimates)
    low, high = binomial_bounds(runs, LEVEL)
    assert low <= covered <= high, f"{covered}/{runs} covered the users' mean, not {low}..{high}"
    assert all(est.std < est.population_std for est in estimates)
