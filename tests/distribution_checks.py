"""Statistical checks the distribution mechanisms' tests share (``hh``, ``lhh``).

Imported as ``tests.distribution_checks`` (the repository root is on the path). Every
bound is two-sided at ``ALPHA`` per check, Bonferroni over the ``tests`` quantities one
assertion covers, so one assertion fails falsely with probability at most ``ALPHA``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

#: False-failure rate of one assertion.
ALPHA = 1e-6


def normal_bound(tests: int) -> float:
    """Two-sided z at ALPHA / tests."""
    return float(stats.norm.isf(ALPHA / (2 * tests)))


def variance_ratio_bounds(runs: int, tests: int) -> tuple[float, float]:
    """The ALPHA / (2 tests) and 1 - ALPHA / (2 tests) quantiles of s^2 / V for the sample
    variance of ``runs`` normal estimates (chi2(R - 1) / (R - 1))."""
    df = runs - 1
    tail = ALPHA / (2 * tests)
    return float(stats.chi2.ppf(tail, df) / df), float(stats.chi2.isf(tail, df) / df)


def skewed(buckets: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n users over the buckets, exponentially fewer towards the top (a latency's shape)."""
    weights = np.exp(-np.arange(buckets) / (buckets / 6))
    return rng.multinomial(n, weights / weights.sum())


def assert_cdf_unbiased_with_stated_variance(
    mech: Any, counts: np.ndarray, runs: int, rng: np.random.Generator
) -> None:
    """Over ``runs`` fast-path estimates of the users ``counts`` (per bucket), every inner
    edge's CDF mean is the truth within ``normal_bound`` standard errors, and its
    empirical variance over the mean stated variance lies in ``variance_ratio_bounds``."""
    buckets = counts.size
    truth = np.concatenate([[0], np.cumsum(counts)]) / counts.sum()
    cdfs, variances = np.empty((runs, buckets + 1)), np.empty((runs, buckets + 1))
    for run in range(runs):
        estimate = mech.estimate(mech.simulate_statistics(counts, rng))
        cdfs[run], variances[run] = estimate.cdf, estimate.cdf_variance()
    inner = slice(1, buckets)
    variance = variances.mean(axis=0)[inner]
    z = (cdfs.mean(axis=0)[inner] - truth[inner]) / np.sqrt(variance / runs)
    assert np.abs(z).max() < normal_bound(buckets - 1)
    low, high = variance_ratio_bounds(runs, buckets - 1)
    ratio = cdfs.var(axis=0, ddof=1)[inner] / variance
    assert low < ratio.min() and ratio.max() < high, (ratio.min(), ratio.max())


def assert_same_law(encoded: np.ndarray, simulated: np.ndarray, alpha: float) -> None:
    """Two samples of one integer statistic come from one law: a chi-square test of
    homogeneity of their counts, the values with fewer than 40 observations in all pooled
    into one cell, failing falsely with probability ``alpha``."""
    top = int(max(encoded.max(), simulated.max())) + 1
    table = np.array([np.bincount(encoded, minlength=top), np.bincount(simulated, minlength=top)])
    keep = table.sum(axis=0) >= 40
    table = np.column_stack([table[:, keep], table[:, ~keep].sum(axis=1)])
    table = table[:, table.sum(axis=0) > 0]
    assert stats.chi2_contingency(table).pvalue > alpha
