"""laplace against forged reports: the refusal rule, the tail profile and its fit, and the
winsorized (bounded-influence) mean (``shared.mechanisms.laplace``, ``shared.integrity``).

Exact quantities are checked against 60-digit decimals or against sums of the discrete
Laplace pmf; statistical checks use fixed seeds and state their false-failure rates.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal, localcontext
from typing import Any

import numpy as np
import pytest
from scipy.stats import binom

from shared.integrity import (
    FALSE_REFUSAL_BOUND,
    MIN_FIT_REPORTS,
    as_bounded_influence,
    as_profiled,
)
from shared.mechanisms import make_mechanism
from shared.mechanisms.laplace import DiscreteLaplace, mean_excess, upper_tail
from shared.randomness import discrete_laplace_pmf
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

EPSILONS = (0.5, 1.0, 2.0, 4.0)


def laplace(epsilon: float = 1.0, grid_steps: int | None = None) -> DiscreteLaplace:
    fields: dict[str, Any] = {"mechanism": "laplace", "epsilon": epsilon, "lower": 0.0}
    fields |= {"upper": 100.0} | ({"grid_steps": grid_steps} if grid_steps else {})
    mech = make_mechanism(MechanismSpec.model_validate(fields))
    assert isinstance(mech, DiscreteLaplace)
    return mech


def decimal_a(mech: DiscreteLaplace) -> Decimal:
    """a = e^-g, g = s / t, in the current decimal context."""
    return (-(Decimal(mech.noise_s) / Decimal(mech.noise_t))).exp()


def pmf_window(mech: DiscreteLaplace, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """z in -reach..reach and P(Z = z); the mass left out is 2 a^(reach + 1) / (1 + a)."""
    z = np.arange(-reach, reach + 1)
    return z, discrete_laplace_pmf(z, mech.noise_s, mech.noise_t)


def negligible_reach(mech: DiscreteLaplace, past: int = 0) -> int:
    """A reach past ``past`` + 2K whose left-out mass, relative to the tail beyond
    ``past`` (and the mean excess likewise), is below e^-80."""
    return past + 80 * mech.noise_t // mech.noise_s + 2 * mech.grid_steps


# --- the refusal rule -----------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("grid_steps", [16, 1024])
def test_false_refusal_is_exact_within_the_bound_and_the_bound_minimal(
    epsilon: float, grid_steps: int
) -> None:
    """max over every grid index i of P(i + Z outside -B..K+B), each term in 60-digit
    decimals, is the rule's false_refusal (to 1e-9 relative) and is reached at i = 0 and
    i = K; it is at most 2^-40, and B is the least with P(|Z| > B) < 2^-40."""
    mech = laplace(epsilon, grid_steps)
    (rule,) = mech.refusal_rules()
    bound, k = mech.refusal_bound, mech.grid_steps
    with localcontext(Context(prec=60)):
        a = decimal_a(mech)
        per_index = [
            (a ** (k + bound + 1 - i) + a ** (bound + 1 + i)) / (1 + a) for i in range(k + 1)
        ]
        worst = max(per_index)
        assert per_index[0] == worst == per_index[k]
        assert abs(Decimal(rule.false_refusal) - worst) <= Decimal("1e-9") * worst
        assert worst <= Decimal(2) ** -40 and rule.false_refusal <= FALSE_REFUSAL_BOUND
        both_tails = 2 * a ** (bound + 1) / (1 + a)  # P(|Z| > B)
        assert both_tails < Decimal(2) ** -40 <= 2 * a**bound / (1 + a)  # B - 1 fails
    assert rule.name == "laplace.noise_tail"
    assert f"{-bound}..{k + bound}" in rule.description
    assert bound < mech.tail_bound  # the 2^-60 structural bound stays the wider one


def test_tail_formulas_match_sums_of_the_pmf() -> None:
    """P(Z > c) = a^(c + 1) / (1 + a) and E[(Z - c)_+] = a^(c + 1) / ((1 + a) (1 - a)), the
    closed forms the fit and the bias bound use, against the pmf summed over a window
    whose left-out mass, relative to each tail, is below e^-80."""
    mech = laplace(2.0, 64)
    edges = (0, 1, 31, 500, 2000)
    z, pmf = pmf_window(mech, negligible_reach(mech, max(edges)))
    for edge in edges:
        beyond = z > edge
        tail = math.fsum(pmf[beyond])
        excess = math.fsum((z[beyond] - edge) * pmf[beyond])
        assert math.isclose(upper_tail(np.array([edge]), mech.noise_s, mech.noise_t)[0], tail)
        assert math.isclose(mean_excess(edge, mech.noise_s, mech.noise_t), excess)


def test_honest_reports_are_never_refused_and_the_first_index_past_the_tail_is() -> None:
    """10^5 honest reports (a third at each end of the range, where the rule is tightest):
    an honest one breaks the rule with probability < 2^-40 each, so none is refused but
    with probability < 10^5 2^-40 < 1e-7."""
    mech = laplace()
    rng = np.random.default_rng(29)
    values = np.concatenate([np.zeros(33_000), np.full(33_000, 100.0), rng.uniform(0, 100, 34_000)])
    reports = mech.encode(values, rng=rng)
    assert (mech.refusals(reports) == -1).all()
    assert mech.first_refusal(reports) is None
    k, bound = mech.grid_steps, mech.refusal_bound
    edges = np.array([-bound, k + bound, -bound - 1, k + bound + 1])
    np.testing.assert_array_equal(mech.refusals(mech.check_reports(edges)), [-1, -1, 0, 0])
    error = mech.first_refusal(np.concatenate([reports[:3], [k + bound + 1]]))
    assert error is not None and error.report == 3
    assert error.rule.name == "laplace.noise_tail"
    assert error.detail == f"index {k + bound + 1} is {bound + 1} steps past the grid's end"
    assert mech.refusal_detail(np.array(30_000)) == "index 30000 is 28976 steps past the grid's end"
    assert mech.refusal_detail(np.array(-bound - 1)) == (
        f"index {-bound - 1} is {bound + 1} steps before the grid's start"
    )


# --- the profile ----------------------------------------------------------------------------


def test_profile_edges_are_quarter_noise_scales_below_the_refusal_bound() -> None:
    mech = laplace()
    edges = mech.profile_edges
    quarter = mech.noise_t / (4 * mech.noise_s)
    expected = [
        math.ceil(j * quarter) for j in range(10**4) if math.ceil(j * quarter) < mech.refusal_bound
    ]
    assert edges.tolist() == expected
    assert mech.profile_length == 4 * edges.size
    assert as_profiled(mech) is mech and as_bounded_influence(mech) is mech


def test_profile_counts_and_sums_every_tail_exactly_and_merges_by_addition() -> None:
    mech = laplace(2.0, 64)
    rng = np.random.default_rng(1)
    reports = mech.encode(rng.uniform(0, 100, 3000), rng=rng)
    reports[:5] = [mech.grid_steps + mech.refusal_bound, -mech.refusal_bound, 0, 64, 65]
    profile = mech.profile(reports)
    above = np.maximum(reports - mech.grid_steps, 0)[:, None]
    below = np.maximum(-reports, 0)[:, None]
    edges = mech.profile_edges[None, :]
    expected = np.concatenate(
        [
            (above > edges).sum(axis=0),
            (below > edges).sum(axis=0),
            np.maximum(above - edges, 0).sum(axis=0),
            np.maximum(below - edges, 0).sum(axis=0),
        ]
    )
    assert profile.n == reports.size
    np.testing.assert_array_equal(profile.counts, expected)
    merged = mech.profile(reports[:1000]).merge(mech.profile(reports[1000:]))
    assert merged.n == profile.n
    np.testing.assert_array_equal(merged.counts, profile.counts)


# --- the robust mean ------------------------------------------------------------------------


def winsorizing_edge(mech: DiscreteLaplace, n: int) -> int:
    """The smallest profile edge c with n P(|Z| > c) <= 1, in 60-digit decimals."""
    with localcontext(Context(prec=60)):
        a = decimal_a(mech)
        return next(int(c) for c in mech.profile_edges if n * 2 * a ** (int(c) + 1) / (1 + a) <= 1)


def test_robust_mean_is_the_winsorized_mean_of_the_reports() -> None:
    """2000 honest reports and 40 forged at the refusal bound's ends: the robust mean is
    the mean of the grid indices clipped to [-c, K + c] (the integer sum exactly)."""
    mech = laplace()
    rng = np.random.default_rng(2)
    honest = mech.encode(rng.uniform(0, 100, 2000), rng=rng)
    k, bound = mech.grid_steps, mech.refusal_bound
    reports = np.concatenate([honest, np.full(30, k + bound), np.full(10, -bound)])
    n = reports.size
    robust = mech.robust_mean(mech.aggregate(reports), mech.profile(reports))
    c = winsorizing_edge(mech, n)
    assert math.isclose(robust.low, mech.lower - c * mech.step)
    assert math.isclose(robust.high, mech.upper + c * mech.step)
    clipped = np.clip(reports, -c, k + c)
    parts = mech.profile(reports).counts.reshape(4, -1)
    j = int(np.flatnonzero(mech.profile_edges == c)[0])
    assert int(clipped.sum()) == int(reports.sum()) - int(parts[2, j]) + int(parts[3, j])
    assert robust.winsorized == int((clipped != reports).sum()) >= 40
    direct = mech.lower + mech.step * float(clipped.sum()) / n
    assert math.isclose(robust.mean, direct, rel_tol=1e-12)
    assert robust.std == mech.estimate(mech.aggregate(reports)).std
    assert math.isclose(robust.influence, (k + 2 * c) * mech.step / n)


def test_robust_mean_without_reports_beyond_the_edge_is_the_plain_mean() -> None:
    mech = laplace()
    rng = np.random.default_rng(3)
    reports = mech.encode(rng.uniform(0, 100, 200), rng=rng)
    stats = mech.aggregate(reports)
    robust = mech.robust_mean(stats, mech.profile(reports))
    assert robust.winsorized == 0
    assert robust.mean == mech.estimate(stats).mean


def test_one_forged_report_moves_the_robust_mean_at_most_its_influence() -> None:
    """Replacing one honest report by a forged one at either end of the refusal range
    moves the robust mean by at most (K + 2 c) w / n; the plain mean moves about twice
    as far (K + B against K + c)."""
    mech = laplace()
    rng = np.random.default_rng(4)
    honest = mech.encode(rng.uniform(0, 100, 1000), rng=rng)
    base = mech.robust_mean(mech.aggregate(honest), mech.profile(honest))
    for forged in (mech.grid_steps + mech.refusal_bound, -mech.refusal_bound):
        attacked = honest.copy()
        attacked[0] = forged
        moved = mech.robust_mean(mech.aggregate(attacked), mech.profile(attacked))
        assert abs(moved.mean - base.mean) <= base.influence * (1 + 1e-12)
        plain_shift = abs(
            mech.estimate(mech.aggregate(attacked)).mean
            - mech.estimate(mech.aggregate(honest)).mean
        )
        assert plain_shift > 1.5 * abs(moved.mean - base.mean)


def test_robust_mean_refuses_a_profile_of_other_reports() -> None:
    mech = laplace()
    reports = mech.encode(np.full(60, 50.0), rng=np.random.default_rng(5))
    with pytest.raises(ValueError, match="same n"):
        mech.robust_mean(mech.aggregate(reports), mech.profile(reports[:30]))
    with pytest.raises(ValueError, match="counts"):
        mech.robust_mean(mech.aggregate(reports), CountStatistics.empty(3))


@pytest.mark.parametrize(("epsilon", "grid_steps", "n"), [(1.0, 1024, 1000), (2.0, 16, 50)])
def test_bias_bound_holds_for_every_input_and_is_attained_at_the_ends(
    epsilon: float, grid_steps: int, n: int
) -> None:
    """E[clip(i + Z, -c, K + c)] - i, summed over the pmf (left-out mass below e^-80), for
    inputs at the ends, the middle and between grid points (a mixture of two indices):
    within the bias bound, and equal to it (to 1e-9) at the ends."""
    mech = laplace(epsilon, grid_steps)
    k = mech.grid_steps
    rng = np.random.default_rng(6)
    reports = mech.encode(np.full(n, 50.0), rng=rng)
    robust = mech.robust_mean(mech.aggregate(reports), mech.profile(reports))
    c = winsorizing_edge(mech, n)
    z, pmf = pmf_window(mech, negligible_reach(mech, c))

    def index_bias(i: int) -> float:
        return math.fsum((np.clip(i + z, -c, k + c) - (i + z)) * pmf)

    bound = robust.bias_bound / mech.step
    assert bound > 0
    assert math.isclose(index_bias(0), bound, rel_tol=1e-9)
    assert math.isclose(index_bias(k), -bound, rel_tol=1e-9)
    for position in (k / 2, 0.3, k - 0.7, k / 3):
        low = math.floor(position)
        phi = position - low
        mixture = (1 - phi) * index_bias(low) + phi * index_bias(min(low + 1, k))
        assert abs(mixture) <= bound


def test_robust_mean_costs_honest_data_no_accuracy() -> None:
    """MSE of the robust against the plain mean, n = 1000, eps = 1, values uniform on
    [0, 100], 400 windows: at most 1.05 (the issue's target).

    Basis: per report, winsorizing moves m by D toward its input's index, never past it
    (i lies inside [-c, K + c]), so D (m - i) <= -D^2 and E[MSE_robust - MSE_plain] <=
    bias^2 <= 0.029^2, against MSE_plain = 20: the expected ratio is at most 1.00005.
    The estimated ratio's spread over 400 windows is about 0.002 (measured over 10 seeds:
    0.991 to 0.999, sd 0.0022), so 1.05 is more than 20 standard deviations away: false
    failure below 1e-80 (normal approximation).
    """
    mech = laplace()
    rng = np.random.default_rng(7)
    windows, n = 400, 1000
    values = rng.uniform(0, 100, (windows, n))
    reports = mech.encode(values.ravel(), rng=rng).reshape(windows, n)
    plain_errors, robust_errors = [], []
    for window_values, window in zip(values, reports, strict=True):
        truth = float(window_values.mean())
        stats = mech.aggregate(window)
        plain_errors.append(mech.estimate(stats).mean - truth)
        robust_errors.append(mech.robust_mean(stats, mech.profile(window)).mean - truth)
    ratio = float(np.mean(np.square(robust_errors)) / np.mean(np.square(plain_errors)))
    assert ratio <= 1.05


# --- the fit --------------------------------------------------------------------------------


def test_fit_p_values_under_honest_reports_are_super_uniform() -> None:
    """200 honest windows of 1000 reports, every input at ``upper`` (there the upper tail
    counts are exactly Binomial(n, P(Z > c)), the test's bound, so it is tightest):
    P(p <= 0.05) <= 0.05. The share at or below 0.05 is checked against 0.05 + 3 sd,
    sd = sqrt(0.05 * 0.95 / 200): a false failure has probability
    P(Binomial(200, 0.05) >= 20) = 0.0078 at most."""
    mech = laplace()
    rng = np.random.default_rng(8)
    windows, n = 200, 1000
    reports = mech.encode(np.full(windows * n, 100.0), rng=rng).reshape(windows, n)
    p_values = []
    for window in reports:
        fit = mech.fit(mech.profile(window))
        assert fit is not None and fit.reports == n
        assert fit.degrees_of_freedom == 2 * mech.profile_edges.size
        p_values.append(fit.p_value)
    share = float(np.mean(np.array(p_values) <= 0.05))
    limit = 0.05 + 3 * math.sqrt(0.05 * 0.95 / windows)
    assert share <= limit
    assert binom.sf(math.ceil(limit * windows) - 1, windows, 0.05) < 0.01


def test_fit_flags_one_percent_of_reports_at_the_refusal_edge() -> None:
    mech = laplace()
    rng = np.random.default_rng(9)
    honest = mech.encode(rng.uniform(0, 100, 990), rng=rng)
    forged = np.full(10, mech.grid_steps + mech.refusal_bound)
    fit = mech.fit(mech.profile(np.concatenate([honest, forged])))
    assert fit is not None and fit.p_value < 1e-6
    assert "conservative" in fit.test and fit.statistic > 1e6


def test_fit_needs_enough_reports_and_a_profile_of_this_spec() -> None:
    mech = laplace()
    reports = mech.encode(np.full(MIN_FIT_REPORTS, 50.0), rng=np.random.default_rng(10))
    assert mech.fit(mech.profile(reports[:-1])) is None
    assert mech.fit(mech.profile(reports)) is not None
    with pytest.raises(ValueError, match="counts"):
        mech.fit(CountStatistics(MIN_FIT_REPORTS, np.zeros(8, dtype=np.int64)))
