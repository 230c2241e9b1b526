"""``ldp-sim longitudinal`` on ``onebitmean``: its per-period error stays at the analytical
variance in every period however long the memoized bits persist, its adversary meets the
bound exactly, and the adversary's check is an exact binomial test at ``LEAK_ALPHA``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import make_mechanism
from shared.mechanisms.onebitmean import OneBitMean
from shared.memo import SimulatedMemo
from simulations.longitudinal import (
    LEAK_ALPHA,
    LEAK_Z,
    Population,
    guess_bound,
    leak_threshold,
    make_specs,
    reidentified,
    simulate,
)
from simulations.populations import parse_categorical_shape, parse_numeric_shape

#: Two-sided normal quantile for a false failure at most once in 10^6 runs.
Z = 4.8916


def population(devices: int, periods: int, change: float, seed: int = 11) -> Population:
    return Population(
        devices, periods, change, 4, parse_categorical_shape("uniform"),
        parse_numeric_shape("normal:0.4,0.2"), 0.0, 1.0, seed,
    )  # fmt: skip


@pytest.mark.parametrize("trials", [20, 50, 100, 200, 1000, 10_000, 100_000])
@pytest.mark.parametrize("bound", [0.05, 0.0625, 0.1, 0.3, 0.5, 0.8808, 0.99, 0.99995, 1.0])
def test_leak_threshold_is_the_least_count_at_the_false_alarm_rate(
    trials: int, bound: float
) -> None:
    """A mechanism whose guesses succeed with probability exactly the bound is called a leak
    with probability at most LEAK_ALPHA, and the threshold is the least with that property.
    The normal margin b + z sqrt(b (1 - b) / N) it replaces broke the first where the
    binomial's upper tail is heavy: P = 1.6e-4 at N = 50, b = 0.05."""
    scaled = leak_threshold(bound, trials) * trials
    cut = round(scaled)
    assert abs(scaled - cut) < 1e-6  # c / N times N
    assert stats.binom.sf(cut, trials, bound) <= LEAK_ALPHA
    if cut > 0:
        assert stats.binom.sf(cut - 1, trials, bound) > LEAK_ALPHA


def test_the_normal_quantile_is_the_same_level() -> None:
    assert stats.norm.sf(LEAK_Z) == pytest.approx(LEAK_ALPHA, rel=1e-9)


def test_leak_threshold_refuses_what_it_cannot_test() -> None:
    with pytest.raises(ValueError, match="trials >= 1"):
        leak_threshold(0.5, 0)
    with pytest.raises(ValueError, match="bound in"):
        leak_threshold(1.5, 10)


def test_memoized_onebitmean_meets_the_bound_exactly() -> None:
    """Without output perturbation, a device at lower or upper sends the memoized bit of grid
    point 0 or s for ever; guessing by it succeeds with probability pi(s) = e^eps / (e^eps + 1),
    the bound itself (to the realized 53-bit thresholds), so a single run lands above the
    bound about half the time. Simulated: 20,000 devices, within Z standard errors of the
    bound (two-sided 1e-6), and not a leak at 1,000 devices for a rate like 0.898."""
    epsilon, devices = 2.0, 20_000
    fleet = population(100, 5, 0.0)
    (spec,) = make_specs(["onebitmean"], epsilon, 1.0, fleet)
    mech = make_mechanism(spec)
    assert isinstance(mech, OneBitMean)
    bound = guess_bound(epsilon, 2)
    ones = mech.permanent_matrix()[:, 1]
    assert 0.5 * (1 - ones[0]) + 0.5 * ones[-1] == pytest.approx(bound, abs=1e-12)
    rng = np.random.default_rng(3)
    values = rng.choice(np.array([0.0, 1.0]), size=devices)
    (rate,) = reidentified(mech, values, [5], rng, SimulatedMemo(np.arange(devices), 3))
    assert abs(rate - bound) <= Z * math.sqrt(bound * (1 - bound) / devices)
    assert leak_threshold(bound, 1000) > 0.898


def test_rows_call_a_leak_by_the_threshold() -> None:
    """The row's threshold is ``leak_threshold`` at the run's adversary devices, and each
    leak flag is its rate above it: memoized at the bound is no leak, stateless is (T = 12
    fresh bits: success about 0.97 against a threshold of 0.93)."""
    fleet = population(500, 12, 0.1)
    specs = make_specs(["onebitmean"], 2.0, 1.0, fleet)
    (row,) = simulate(fleet, specs, adversary_devices=1000, progress=False).rows
    assert row["adversary_threshold"] == leak_threshold(row["adversary_bound"], 1000)
    assert row["leak_memoized"] == (row["adversary_memoized"] > row["adversary_threshold"])
    assert not row["leak_memoized"]
    assert row["leak_stateless"]
    (quiet,) = simulate(fleet, specs, adversary_devices=0, progress=False).rows
    assert math.isnan(quiet["adversary_threshold"]) and not quiet["leak_memoized"]


@pytest.mark.parametrize("flip", [0.0, 0.2])
def test_onebitmean_period_ratios_stay_at_one(flip: float) -> None:
    """2,000 devices over 8 periods, a fifth changing value each period, 100 repetitions:
    in every period the estimate is unbiased with the analytical variance however long the
    devices kept their memoized bits, so 100 times a period's ratio is chi-square with 100
    degrees of freedom (one normal error per repetition, central limit at n = 2,000);
    each period two-sided at 1e-6 / 8 (false failure below 1e-6 for the test). A drift of
    the error over periods (a memo biased by the values' history) fails the last periods
    first."""
    reps, periods = 100, 8
    drifting = population(2000, periods, 0.2)
    specs = make_specs(["onebitmean"], 2.0, 1.0, drifting, flip_probability=flip)
    run = simulate(drifting, specs, reps=reps, adversary_devices=0, progress=False)
    assert [row["period"] for row in run.periods] == list(range(periods))
    alpha = 1e-6 / periods
    for row in run.periods:
        level = stats.chi2.cdf(reps * row["ratio"], reps)
        assert alpha / 2 < level < 1 - alpha / 2, row


def test_period_standard_errors_come_from_the_repetitions() -> None:
    """One period: the row's ratio and standard error are the period's. One repetition:
    no standard error, in the row or per period."""
    single = population(500, 1, 0.0)
    specs = make_specs(["onebitmean", "duchi"], 2.0, 1.0, single)
    run = simulate(single, specs, reps=5, adversary_devices=0, progress=False)
    for row, period in zip(run.rows, run.periods, strict=True):
        assert period["ratio"] == pytest.approx(row["ratio"], rel=1e-12)
        assert period["ratio_se"] == pytest.approx(row["ratio_se"], rel=1e-12)
        assert period["ratio_se"] > 0
    once = simulate(population(500, 3, 0.5), specs, adversary_devices=0, progress=False)
    assert all(math.isnan(r["ratio_se"]) for r in once.rows + once.periods)
