"""Duchi, Jordan and Wainwright's one-bit mean mechanism ("Minimax Optimal
Procedures for Locally Private Estimation", JASA 2018; one-dimensional case).

For t in [-1, 1] (the clipped, normalized value) the device reports a sign,
+1 with probability 1/2 + t (e^eps - 1) / (2 (e^eps + 1)). The debiased report
is C · sign with C = (e^eps + 1) / (e^eps - 1), so E[C · sign | t] = t and

    Var[C · sign | t] = C^2 - t^2   (normalized units; times ((upper - lower) / 2)^2).

The worst case is t = 0. The likelihood ratio is largest between t = 1 and
t = -1: (1/2 + (e^eps - 1) / (2 (e^eps + 1))) / (1/2 - ...) = e^eps, exactly.

Realized probabilities: the sign is +1 with probability T(t) / 2^53. The
thresholds of the two ends are T_lo, rounded up from 1 / (e^eps + 1) and stepped
up until (2^53 - T_lo) / T_lo is proven at most e^eps
(``shared.randomness.certified_threshold``), and T_hi = 2^53 - T_lo; every other
input's threshold, floor(P(+1 | t) 2^53), is clipped to [T_lo, T_hi]. Any two
inputs' likelihood ratios, of +1 and of -1 alike, are then at most
T_hi / T_lo <= e^eps, and each realized probability is within a few 2^-53 of
the nominal one (the estimator's bias is of that order).

Report: the sign (int8, -1 or +1), payload ``{"value": -1 | 1}``.

Refusal rules: none (``shared.integrity``). Each sign is sent with probability at least 1/2
under some input (+1 at t = 1, -1 at t = -1), so no nonempty set of outputs is below 2^-40
for every input.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import IndexReports
from shared.mechanisms.numeric import (
    NoiseVariance,
    NumericMechanism,
    bernoulli_central_moments,
    check_levels,
)
from shared.mechanisms.registry import register
from shared.mechanisms.spec import NumericSpec
from shared.randomness import BITS53, Rng, as_source, certified_threshold, threshold53
from shared.statistics import MomentStatistics


class DuchiSpec(NumericSpec):
    """``{"mechanism": "duchi", "epsilon": 1.0, "lower": 0, "upper": 100}``."""

    mechanism: Literal["duchi"]


@register
class DuchiMean(IndexReports, NumericMechanism):
    name = "duchi"
    spec_model: ClassVar[type[NumericSpec]] = DuchiSpec

    @property
    def scale(self) -> float:
        """C = (e^eps + 1) / (e^eps - 1)."""
        return (math.exp(self.epsilon) + 1) / (math.exp(self.epsilon) - 1)

    @cached_property
    def lowest_threshold(self) -> int:
        """T_lo, the threshold of P(+1 | t = -1) = 1 / (e^eps + 1): rounded up, certified
        (2^53 - T_lo) / T_lo <= e^eps. The highest is T_hi = 2^53 - T_lo."""
        return certified_threshold(
            1.0 / (math.exp(self.epsilon) + 1),
            "up",
            lambda t: Fraction(BITS53 - t, t),
            self.epsilon,
        )

    def plus_thresholds(self, values: np.ndarray) -> np.ndarray:
        """T(x): floor((1/2 + t / (2 C)) 2^53) clipped to [T_lo, T_hi] (uint64)."""
        nominal = np.clip(0.5 + self.normalize(values) / (2 * self.scale), 0.0, 1.0)
        low = self.lowest_threshold
        return np.clip(threshold53(nominal, "down"), low, BITS53 - low).astype(np.uint64)

    def plus_probability(self, values: np.ndarray) -> np.ndarray:
        """Realized P(sign = +1 | x) = T(x) / 2^53, nominally 1/2 + t / (2 C)."""
        return self.plus_thresholds(values).astype(np.float64) / BITS53

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        plus = as_source(rng).bernoulli_below(self.plus_thresholds(values))
        return np.where(plus, 1, -1).astype(np.int8)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.ndim != 1:
            raise ValueError(f"duchi reports must be a 1-d array of signs, got {array.shape}")
        bad = np.flatnonzero((array != 1) & (array != -1))
        if bad.size:
            raise ValueError(f"report {bad[0]}: sign must be -1 or +1, got {array[bad[0]]!r}")
        return array.astype(np.int8)

    def debias(self, reports: np.ndarray) -> np.ndarray:
        return self.to_original(self.scale * reports.astype(np.float64))

    def report_variance(self, values: np.ndarray) -> np.ndarray:
        t = self.normalize(values)
        return (self.scale**2 - t**2) * self.half_range**2

    def variance_model(self) -> NoiseVariance:
        """Var[y | x] = C^2 h^2 - (x - centre)^2 (h = half the range): curvature -1, so the
        users' share of it is not identifiable from the reports (``std`` is a bound)."""
        return NoiseVariance(
            self.centre, self.half_range, (self.scale * self.half_range) ** 2, -1.0, 0.0
        )

    def worst_case_inputs(self) -> np.ndarray:
        return np.array([(self.lower + self.upper) / 2])

    def report_central_moments(self, values: np.ndarray) -> np.ndarray:
        """The debiased report is a two-point law: ``2 C h`` times a Bernoulli, shifted."""
        return bernoulli_central_moments(
            self.plus_probability(values), 2 * self.scale * self.half_range
        )

    def simulate_statistics(
        self, levels: np.ndarray, counts: np.ndarray, rng: np.random.Generator
    ) -> MomentStatistics:
        """Exact: K ~ sum_j Bin(N_j, P(+1 | x_j)) reports are +1, the rest -1, so
        T = K y+ + (n - K) y- and Q = K y+^2 + (n - K) y-^2 (y+- the debiased signs)."""
        levels, counts = check_levels(levels, counts, rng)
        n = int(counts.sum())
        plus = int(rng.binomial(counts, self.plus_probability(levels)).sum())
        high, low = self.to_original(np.array([self.scale, -self.scale]))
        return MomentStatistics(
            n, float(plus * high + (n - plus) * low), float(plus * high**2 + (n - plus) * low**2)
        )

    def transition_matrix(self, values: np.ndarray) -> np.ndarray:
        """P[sign | x] with columns (-1, +1)."""
        plus = self.plus_probability(values)
        return np.stack([1 - plus, plus], axis=1)
