"""Mean estimation: the estimator every numeric mechanism shares.

A numeric mechanism clips a value to [lower, upper], maps it to
t = 2 (x - lower) / (upper - lower) - 1 in [-1, 1], and reports a randomized
value whose *debiased* form y (in the original units) satisfies E[y | x] = x.
The mean of the n debiased reports is therefore an unbiased estimate of the
mean of the clipped values, with

    Var[mean | x_1..x_n] = (1 / n^2) sum_i Var[y | x_i],

where ``report_variance(x)`` is each mechanism's analytical Var[y | x].
``variance(n)`` is the worst case over inputs, max_x Var[y | x] / n, the
figure for planning.

Two standard errors. An analyst asks how far the estimate is from the mean of
*these* users' values: ``MeanEstimate.std`` is sqrt(sum_i Var[y | x_i]) / n, the
noise alone. Asking instead about the mean of the population the users were drawn
from (independently) adds the spread of their values: Var[mean] =
(E Var[y | x] + Var[x]) / n, which the sample variance s^2 of the debiased reports
estimates unbiasedly (E[s^2] = Var[y]), so ``MeanEstimate.population_std`` is
sqrt(s^2 / n) (for n = 1, the worst case max_x Var[y | x]).

The noise's variance from the statistics. Every mechanism here has, with
c = (lower + upper) / 2 (``variance_model``, a ``NoiseVariance``),

    Var[y | x] = base + curvature (x - c)^2 + r(x),   0 <= r(x) <= rounding,

where r is the variance of randomized rounding to a grid (w^2 phi (1 - phi) for a
step w and fractional position phi: not a function of (x - c)^2, hence bounded).
Then E[(y - c)^2 | x] = base + r(x) + (1 + curvature) (x - c)^2, and with
S = sum_i (y_i - c)^2 = Q - 2 c T + n c^2 (T, Q the sum and sum of squares):

* curvature > -1 (``laplace``: 0; ``piecewise``: (1 - beta) / beta > 0): eliminating
  sum (x_i - c)^2,

      V = (n (base + rounding) + curvature S) / (1 + curvature)

  has E[V] = sum_i Var[y | x_i] + sum_i (rounding - r(x_i)) / (1 + curvature): unbiased
  but for the rounding term, which is taken at its upper bound (conservative by at most
  n rounding / (1 + curvature); at the default 1024-step grid below 1e-6 of the noise).
  For curvature = 0 it is the data-independent n (base + rounding) (``std_method``
  "known"), otherwise "estimated". An unbiased V can fall below the least possible
  value, so it is raised to n (base + min(curvature, 0) (upper - lower)^2 / 4), the
  data-independent minimum of sum_i Var[y | x_i] (positive for every mechanism here).
* curvature = -1 (``duchi``: the reports have constant magnitude, E[(y - c)^2 | x] =
  base whatever x): sum (x_i - c)^2 is not identifiable, and ``std`` is an upper bound
  (``std_method`` "upper-bound"). By Cauchy-Schwarz, sum (x_i - c)^2 >= n (xbar - c)^2,
  so sum_i Var[y | x_i] <= n (base + rounding) - n (xbar - c)^2 =: B(xbar). Plugging in
  the estimate ybar for xbar is *not* safe: where the bound is nearly tight the errors
  ybar - xbar that move ybar away from c shrink the interval on exactly the side they
  fall (coverage well below nominal for values near the ends at large epsilon). So
  the bound uses the distance d = clip(|ybar - c| - z* sqrt(W / n), 0, (upper - lower) / 2),
  with W = base + rounding >= Var[y | x] for every x and z* = z_{(1 + L*)/2},
  L* = ``BOUND_LEVEL``: V = n (W - d^2). Then for an interval ybar ± z s (z <= z*,
  s = sqrt(V) / n), a miss needs |ybar - xbar| > z sigma (sigma the true std): if
  V >= sum Var that is the nominal event; if not, |xbar - c| < d, so
  |ybar - xbar| > z* sqrt(W / n) >= z sigma. Coverage is at least nominal for every
  level up to L*.

Sufficient statistics: n, the sum and the sum of squares of the debiased reports
(``MomentStatistics``): all the two standard errors need.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from shared.estimates import MeanEstimate, StdMethod, z_value
from shared.mechanisms.abilities import NumericValues
from shared.mechanisms.base import Mechanism
from shared.mechanisms.spec import NumericSpec
from shared.statistics import MomentStatistics

#: The upper bound on a non-identifiable noise variance keeps every interval of level up
#: to this one at or above its nominal coverage (module docstring, curvature = -1).
BOUND_LEVEL = 1 - 1e-6


@dataclass(frozen=True)
class NoiseVariance:
    """Var[y | x] = base + curvature (x - centre)^2 + r(x), 0 <= r(x) <= rounding.

    Original units; ``centre`` is (lower + upper) / 2 and every clipped x lies within
    ``half_range`` of it. ``total`` estimates sum_i Var[y | x_i] from the statistics of
    n reports (the module docstring derives it).
    """

    centre: float
    half_range: float
    base: float
    curvature: float
    rounding: float

    def __post_init__(self) -> None:
        if not (self.base >= 0 and self.rounding >= 0 and self.curvature >= -1):
            raise ValueError(
                f"a noise variance needs base >= 0, rounding >= 0 and curvature >= -1, got "
                f"{self.base}, {self.rounding} and {self.curvature}"
            )

    def least(self) -> float:
        """min_x Var[y | x] >= base + min(curvature, 0) half_range^2 (r >= 0)."""
        return self.base + min(self.curvature, 0.0) * self.half_range**2

    def total(self, stats: MomentStatistics) -> tuple[float, StdMethod]:
        """(V, method): V estimates sum_i Var[y | x_i] from n >= 1 reports' statistics.

        curvature > -1: V = max((n (base + rounding) + curvature S) / (1 + curvature),
        n least), S = sum (y_i - centre)^2, unbiased but for the rounding term at its
        bound. curvature = -1: V = n (W - d^2), an upper bound with W = base + rounding
        and d = clip(|ybar - centre| - z* sqrt(W / n), 0, half_range).
        """
        n = stats.n
        mean = stats.total / n
        ceiling = self.base + self.rounding
        if self.curvature > -1:
            if self.curvature == 0:
                return n * ceiling, "known"
            spread = max(stats.total_squares - stats.total * mean, 0.0)
            squares = spread + n * (mean - self.centre) ** 2
            unbiased = (n * ceiling + self.curvature * squares) / (1 + self.curvature)
            return max(unbiased, n * self.least()), "estimated"
        slack = z_value(BOUND_LEVEL) * math.sqrt(ceiling / n)
        distance = min(max(abs(mean - self.centre) - slack, 0.0), self.half_range)
        return n * (ceiling - distance**2), "upper-bound"


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


class NumericMechanism(Mechanism[MomentStatistics]):
    """An eps-LDP mechanism for the mean of values clipped to [lower, upper]."""

    provides: ClassVar[tuple[type, ...]] = (NumericValues,)
    spec: NumericSpec

    def __init__(self, spec: NumericSpec) -> None:
        super().__init__(spec)
        self.lower: float = spec.lower
        self.upper: float = spec.upper
        self.half_range: float = (self.upper - self.lower) / 2
        self.centre: float = (self.lower + self.upper) / 2

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Clip to [lower, upper] and map to t in [-1, 1]; NaN is refused."""
        clipped = self.spec.clip(values)
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
    def variance_model(self) -> NoiseVariance:
        """Var[y | x] as base + curvature (x - centre)^2 plus a bounded rounding term."""

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
        """Mean of the debiased reports; ``std`` the noise's error around the users' own
        mean (``NoiseVariance.total``), ``population_std`` = sqrt(s^2 / n)."""
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        mean = stats.total / stats.n
        spread = max(stats.total_squares - stats.n * mean * mean, 0.0)
        sample_variance = (
            spread / (stats.n - 1)
            if stats.n > 1
            else float(self.report_variance(self.worst_case_inputs()).max())
        )
        noise, method = self.variance_model().total(stats)
        return MeanEstimate(
            mean=mean,
            std=math.sqrt(noise) / stats.n,
            n=stats.n,
            lower=self.lower,
            upper=self.upper,
            population_std=math.sqrt(sample_variance / stats.n),
            std_method=method,
        )

    def variance(self, n: int) -> float:
        """``max_x Var[y | x] / n``: the worst-case variance of the mean of n reports."""
        return float(self.report_variance(self.worst_case_inputs()).max()) / n
