"""Mean estimation: the estimator every numeric mechanism shares.

A numeric mechanism clips a value to [lower, upper], maps it to
t = 2 (x - lower) / (upper - lower) - 1 in [-1, 1], and reports a randomized
value whose *debiased* form y (in the original units) satisfies E[y | x] = x.
The mean of the n debiased reports is therefore an unbiased estimate of the
mean of the clipped values, with

    Var[mean] = (1 / n^2) sum_i Var[y | x_i],

where ``report_variance(x)`` is each mechanism's analytical Var[y | x].
``variance(n)`` is the worst case over inputs, max_x Var[y | x] / n, the
figure for planning. The server does not know the x_i, so ``MeanEstimate.std``
is the plug-in sqrt(s^2 / n) with s^2 the sample variance of the debiased
reports. Its expectation is (1/n) (mean_i Var[y | x_i] + population variance of
the clipped x_i): the analytical variance plus a term at most (upper - lower)^2 / 4,
small beside the privacy noise, so the interval is exact to first order and
never anti-conservative.

Sufficient statistics: n, the sum and the sum of squares of the debiased reports.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import ClassVar

import numpy as np

from shared.estimates import MeanEstimate
from shared.mechanisms.base import Mechanism
from shared.schemas import MechanismSpec
from shared.statistics import MomentStatistics


def check_levels(levels: object, counts: object, rng: object) -> tuple[np.ndarray, np.ndarray]:
    """``(levels, counts)`` as arrays, or ValueError unless they are equally many finite
    values and non-negative integers; the fast path also insists on a seeded Generator."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("simulate_statistics needs a numpy.random.Generator (simulation only)")
    level_array = np.asarray(levels, dtype=np.float64)
    count_array = np.asarray(counts)
    if level_array.ndim != 1 or count_array.shape != level_array.shape:
        raise ValueError("levels and counts must be one-dimensional and of the same length")
    if not np.all(np.isfinite(level_array)):
        raise ValueError("levels must be finite numbers")
    if not np.issubdtype(count_array.dtype, np.integer) or np.any(count_array < 0):
        raise ValueError("counts must be non-negative integers")
    return level_array, count_array.astype(np.int64)


def bernoulli_central_moments(p: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """Central moments 2..4 of ``scale * B``, B ~ Bernoulli(p), as (len(p), 3).

    From the cumulants k2 = p(1-p), k3 = k2 (1 - 2p), k4 = k2 (1 - 6 k2): m2 = k2,
    m3 = k3, m4 = k4 + 3 k2^2, each times scale^j.
    """
    k2 = p * (1 - p)
    k3 = k2 * (1 - 2 * p)
    k4 = k2 * (1 - 6 * k2)
    return np.stack([k2 * scale**2, k3 * scale**3, (k4 + 3 * k2 * k2) * scale**4], axis=1)


class NumericMechanism(Mechanism[MomentStatistics, MeanEstimate]):
    """An eps-LDP mechanism for the mean of values clipped to [lower, upper]."""

    kind: ClassVar[str] = "numeric"

    def __init__(self, spec: MechanismSpec) -> None:
        super().__init__(spec)
        assert spec.lower is not None and spec.upper is not None  # guaranteed by MechanismSpec
        self.lower: float = spec.lower
        self.upper: float = spec.upper
        self.half_range: float = (self.upper - self.lower) / 2

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Clip to [lower, upper] and map to t in [-1, 1]; NaN is refused."""
        array = np.asarray(values, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(f"values must be a one-dimensional array, got shape {array.shape}")
        bad = np.flatnonzero(np.isnan(array))
        if bad.size:
            raise ValueError(f"value at position {bad[0]} is NaN; numeric values must be numbers")
        clipped = np.clip(array, self.lower, self.upper)
        return np.clip((clipped - self.lower) / self.half_range - 1.0, -1.0, 1.0)

    def to_original(self, t: np.ndarray) -> np.ndarray:
        """Map normalized values back: x = lower + (t + 1) (upper - lower) / 2."""
        return self.lower + (np.asarray(t, dtype=np.float64) + 1.0) * self.half_range

    @abstractmethod
    def debias(self, reports: np.ndarray) -> np.ndarray:
        """The unbiased value, in original units, that each report stands for."""

    @abstractmethod
    def report_variance(self, values: np.ndarray) -> np.ndarray:
        """Analytical Var[debiased report | x] for each (clipped) input x, original units."""

    @abstractmethod
    def worst_case_inputs(self) -> np.ndarray:
        """Inputs at which ``report_variance`` is largest (for ``variance``)."""

    @abstractmethod
    def report_central_moments(self, values: np.ndarray) -> np.ndarray:
        """(len(values), 3): the 2nd, 3rd and 4th central moments of the debiased report
        given each input, in original units (the 2nd is ``report_variance``)."""

    def simulate_statistics(
        self, levels: np.ndarray, counts: np.ndarray, rng: np.random.Generator
    ) -> MomentStatistics:
        """The statistics of ``counts[j]`` users of value ``levels[j]``, drawn in O(levels).

        The sums T = sum y_i and Q = sum y_i^2 of independent reports are drawn from the
        bivariate normal with their exact means and covariance (central limit theorem):
        per user, with mean mu = clip(x) and central moments m2, m3, m4 of y,
        E[y^2] = mu^2 + m2, Var[y^2] = 4 mu^2 m2 + 4 mu m3 + m4 - m2^2 and
        Cov[y, y^2] = 2 mu m2 + m3, summed over users. So the fast path matches the
        exact path's mean and variance of (T, Q) exactly, its law to first order
        (mechanisms with two-point reports override this with the exact law).
        Simulation only: it takes a seeded numpy Generator.
        """
        levels, counts = check_levels(levels, counts, rng)
        n = int(counts.sum())
        if n == 0:
            return MomentStatistics.empty()
        mu = self.to_original(self.normalize(levels))
        m2, m3, m4 = self.report_central_moments(levels).T
        weights = counts.astype(np.float64)
        mean = np.array([weights @ mu, weights @ (mu * mu + m2)])
        var_t = weights @ m2
        var_q = weights @ (4 * mu * mu * m2 + 4 * mu * m3 + m4 - m2 * m2)
        cov = weights @ (2 * mu * m2 + m3)
        # Cholesky of [[var_t, cov], [cov, var_q]], guarded against rounding below zero.
        a = math.sqrt(max(var_t, 0.0))
        b = cov / a if a > 0 else 0.0
        c = math.sqrt(max(var_q - b * b, 0.0))
        u, v = rng.standard_normal(2)
        total = mean[0] + a * u
        squares = max(mean[1] + b * u + c * v, total * total / n)  # Cauchy-Schwarz
        return MomentStatistics(n, float(total), float(squares))

    def empty_statistics(self) -> MomentStatistics:
        return MomentStatistics.empty()

    def aggregate(self, reports: np.ndarray) -> MomentStatistics:
        return MomentStatistics.of(self.debias(self.check_reports(reports)))

    def estimate(self, stats: MomentStatistics) -> MeanEstimate:
        """Mean of the debiased reports; std = sqrt(sample variance / n)."""
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        mean = stats.total / stats.n
        spread = max(stats.total_squares - stats.n * mean * mean, 0.0)
        sample_variance = (
            spread / (stats.n - 1)
            if stats.n > 1
            else float(self.report_variance(self.worst_case_inputs()).max())
        )
        return MeanEstimate(
            mean, math.sqrt(sample_variance / stats.n), stats.n, self.lower, self.upper
        )

    def variance(self, n: int) -> float:
        """``max_x Var[y | x] / n``: the worst-case variance of the mean of n reports."""
        return float(self.report_variance(self.worst_case_inputs()).max()) / n
