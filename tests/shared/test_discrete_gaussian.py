"""The exact discrete Gaussian sampler: its law, its tails, its exact trials, its inputs.

Every statistical test has a fixed seed (or the OS CSPRNG where that is the point) and
fails, when the sampler is right, with probability at most ALPHA = 1e-6: chi-square and
binomial tests at that level, the chi-square's bins pooled so that each expects at least
5 draws (the chi-square approximation's usual condition).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from shared.discrete_gaussian import (
    MAX_VARIANCE,
    _bernoulli_rational,
    bernoulli_exp_ratio,
    discrete_gaussian,
    discrete_gaussian_pmf,
    exact_variance,
)
from shared.randomness import RandomSource

ALPHA = 1e-6


def exact_pmf(values: np.ndarray, variance: Fraction) -> np.ndarray:
    """``exp(-y^2 / (2 sigma^2)) / Z`` with ``Z`` summed term by term by ``math.fsum`` over
    ``|y| <= 40 sigma + 40`` (the rest is below exp(-800) relative): within 1e-15 relative
    of the exact pmf, computed here independently of the module's own helper."""
    sigma2 = float(variance)
    reach = math.ceil(40 * math.sqrt(sigma2)) + 40
    normalizer = math.fsum(math.exp(-(y * y) / (2 * sigma2)) for y in range(-reach, reach + 1))
    return np.exp(-(values.astype(np.float64) ** 2) / (2 * sigma2)) / normalizer


def chi_square_pvalue(draws: np.ndarray, variance: Fraction) -> float:
    """Pearson's chi-square of ``draws`` against the exact pmf: one bin per integer within
    6 sigma, one pooled bin for each tail beyond (its expected mass included), and bins
    expecting fewer than 5 draws merged into their tail."""
    sigma = math.sqrt(float(variance))
    edge = max(1, math.floor(6 * sigma))
    inner = np.arange(-edge, edge + 1)
    inner_mass = exact_pmf(inner, variance)
    tail_mass = (1.0 - math.fsum(inner_mass.tolist())) / 2  # each side, by symmetry
    expected = inner_mass * draws.size
    keep = expected >= 5
    kept = inner[keep]
    low, high = kept.min(), kept.max()
    inside = (draws >= low) & (draws <= high)
    observed = np.bincount(draws[inside] - low, minlength=high - low + 1)
    below, above = int(np.sum(draws < low)), int(np.sum(draws > high))
    left = (tail_mass + math.fsum(inner_mass[inner < low].tolist())) * draws.size
    right = (tail_mass + math.fsum(inner_mass[inner > high].tolist())) * draws.size
    cells = np.append(observed, [below, above])
    means = np.append(exact_pmf(np.arange(low, high + 1), variance) * draws.size, [left, right])
    if left < 5 or right < 5:  # too rare to test as bins: fold into the outermost ones
        cells = np.concatenate([[cells[0] + below], cells[1:-3], [cells[-3] + above]])
        means = np.concatenate([[means[0] + left], means[1:-3], [means[-3] + right]])
    return float(stats.chisquare(cells, means * cells.sum() / means.sum()).pvalue)


VARIANCES = [Fraction(1, 4), Fraction(1), Fraction(61, 2), Fraction(10_000), Fraction(2, 7)]


@pytest.mark.parametrize("variance", VARIANCES, ids=str)
def test_the_law_is_the_discrete_gaussian(variance: Fraction) -> None:
    """200,000 draws against the exact pmf (chi-square, every integer within 6 sigma and
    the pooled tails beyond): rational variances, integer and not, below and above 1."""
    draws = discrete_gaussian(variance, 200_000, np.random.default_rng(11))
    assert draws.dtype == np.int64
    assert chi_square_pvalue(draws, variance) > ALPHA


def test_the_operating_systems_randomness_gives_the_same_law() -> None:
    draws = discrete_gaussian(Fraction(9, 2), 100_000)
    assert chi_square_pvalue(draws, Fraction(9, 2)) > ALPHA


def test_the_tail_beyond_four_sigma_has_its_mass() -> None:
    """sigma = 10: P(|Y| > 40) = 6.7e-5 by the exact pmf; 10^6 draws put a binomial count
    there (two-sided test at ALPHA). Those candidates pass the acceptance trial with
    gamma above 4, through its whole part (four trials at gamma = 1) and its fraction."""
    variance = Fraction(100)
    inner = np.arange(-40, 41)
    tail = 1.0 - math.fsum(exact_pmf(inner, variance).tolist())
    draws = discrete_gaussian(variance, 1_000_000, np.random.default_rng(12))
    beyond = int(np.sum(np.abs(draws) > 40))
    assert stats.binomtest(beyond, draws.size, tail).pvalue > ALPHA


def test_every_integer_can_be_drawn() -> None:
    """No truncation. The sampler returns a discrete Laplace candidate y (a geometric,
    unbounded: here 9 sigma and more appear about once in 72 candidates at sigma = 1)
    accepted with probability exp(-gamma(y)) > 0, for every y: gamma is a finite rational
    (a Box-Muller draw from 53-bit uniforms never exceeds sqrt(2 ln 2^53) = 8.57 sigma)."""
    candidates = RandomSource(np.random.default_rng(13)).discrete_laplace(1, 2, 10_000)
    assert np.sum(np.abs(candidates) >= 9) > 50  # expected 138; P(<= 50) < 1e-15
    y, sigma2, t = 10**6, Fraction(1), 2  # a million sigma: gamma about 5e11
    numerator = (y * sigma2.denominator * t - sigma2.numerator) ** 2
    denominator = 2 * sigma2.numerator * sigma2.denominator * t * t
    assert 0 < numerator / denominator < math.inf  # exp(-gamma) > 0: y has positive mass


@pytest.mark.parametrize(
    "gamma", [Fraction(0), Fraction(3, 10), Fraction(1), Fraction(11, 4), Fraction(19, 2)]
)
@pytest.mark.slow
def test_the_acceptance_trial_is_exactly_exp_minus_gamma(gamma: Fraction) -> None:
    """Bernoulli(exp(-gamma)) with gamma = n / D written over a 93-bit denominator (the
    big-integer path of large variances): a binomial test at ALPHA, 400,000 trials (2
    million at gamma = 9.5, where exp(-gamma) = 7.5e-5)."""
    denominator = 3 * 2**91 + 7
    numerator = gamma.numerator * denominator // gamma.denominator
    exact = math.exp(-numerator / denominator)
    trials = 2_000_000 if gamma > 5 else 400_000
    numerators = np.full(trials, numerator, dtype=object)
    source = RandomSource(np.random.default_rng(14))
    hits = int(np.sum(bernoulli_exp_ratio(numerators, denominator, source)))
    if gamma == 0:
        assert hits == trials
    else:
        assert stats.binomtest(hits, trials, exact).pvalue > ALPHA


@pytest.mark.parametrize(("numerator", "denominator"), [(1, 3), (2**70, 3 * 2**70 + 1)])
def test_a_tie_is_settled_with_the_exact_remainder(numerator: int, denominator: int) -> None:
    """The path a 64-bit tie takes (chance 2^-64 in use): Bernoulli(r / D) digit by digit,
    here called directly, 200,000 times, binomial test at ALPHA."""
    source = RandomSource(np.random.default_rng(15))
    hits = sum(_bernoulli_rational(numerator, denominator, source) for _ in range(200_000))
    assert stats.binomtest(hits, 200_000, numerator / denominator).pvalue > ALPHA


def test_a_float_variance_is_its_exact_rational() -> None:
    assert exact_variance(0.1) == Fraction(0.1) != Fraction(1, 10)
    assert exact_variance(3) == Fraction(3) and exact_variance(Fraction(5, 3)) == Fraction(5, 3)


def test_the_pmf_sums_to_one_and_matches_the_direct_sum() -> None:
    for variance in (Fraction(1, 4), Fraction(7), 2.5e9):
        sigma = math.sqrt(float(variance))
        reach = math.ceil(12 * sigma)
        values = np.arange(-reach, reach + 1)
        total = math.fsum(discrete_gaussian_pmf(values, variance).tolist())
        assert total == pytest.approx(1.0, abs=1e-12)
    values = np.arange(-30, 31)
    np.testing.assert_allclose(
        discrete_gaussian_pmf(values, Fraction(7)), exact_pmf(values, Fraction(7)), rtol=1e-14
    )


def test_shapes_and_the_largest_variance() -> None:
    rng = np.random.default_rng(16)
    assert discrete_gaussian(2.0, (3, 4), rng).shape == (3, 4)
    assert discrete_gaussian(2.0, 0, rng).shape == (0,)
    huge = discrete_gaussian(MAX_VARIANCE, 2_000, rng)  # sigma = 2^40: int64 throughout
    assert np.abs(huge).max() < 2**40 * 8  # P(any beyond 8 sigma) < 2000 * 2e-15


@pytest.mark.parametrize(
    "variance", [0, -1.0, math.nan, math.inf, True, "1", MAX_VARIANCE + 1, Fraction(-1, 2)]
)
def test_bad_variances_are_refused(variance: object) -> None:
    with pytest.raises(ValueError, match="variance"):
        discrete_gaussian(variance, 3)  # type: ignore[arg-type]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        discrete_gaussian(1.0, -1)
    with pytest.raises(ValueError, match="size"):
        discrete_gaussian(1.0, (2, 1.5))  # type: ignore[arg-type]
