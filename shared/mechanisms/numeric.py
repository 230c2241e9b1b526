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
