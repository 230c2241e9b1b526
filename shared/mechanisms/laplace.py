"""Local Laplace on a grid: randomized rounding plus exact discrete Laplace noise.

Floating-point Laplace noise leaks the input through the low-order bits of its
output (Mironov, "On Significance of the Least Significant Bits for
Differential Privacy", CCS 2012). This mechanism never adds floating-point
noise. With K = ``grid_steps`` (default 1024) and step w = (upper - lower) / K:

1. Clip x to [lower, upper] and write (x - lower) / w = k + phi, 0 <= phi < 1.
   Round *randomly*: report grid index k + 1 with probability phi, else k, so
   E[index] = (x - lower) / w exactly (unbiased rounding).
2. Add Z ~ discrete Laplace, P(Z = z) ∝ exp(-g |z|), sampled exactly from
   random integers (Canonne, Kamath, Steinke, NeurIPS 2020; see
   ``shared.randomness``).

Privacy. Grid indices lie in 0..K, so two inputs' indices differ by at most K
and for every output m, P(m | i) / P(m | j) = exp(g (|m - j| - |m - i|)) <=
exp(g K). Rounding is a mixture over indices, which keeps the bound. Setting
g = eps / K gives eps-LDP. The sampler needs g as a ratio of integers:
g = s / t with s = floor(eps 2^20) and t = K 2^20, so the guarantee actually
delivered is ``effective_epsilon`` = s / 2^20, at most eps and within 2^-20 of
it (exactly eps for the dyadic epsilons 0.5, 1, 2, 4, 8).

Granularity. The noise in original units has variance
w^2 2 e^-g / (1 - e^-g)^2 ~ 2 ((upper - lower) / eps)^2 whatever K is, while
rounding adds at most w^2 / 4 = ((upper - lower) / (2K))^2. At K = 1024 the
rounding term is below 1e-6 of the noise for every eps <= 20, and the sampler's
cost does not grow with K, so the default keeps rounding negligible; a smaller
K only shortens the reports.

The rounding Bernoulli (step 1) draws at floor(phi 2^53) / 2^53: privacy does
not depend on it (any mixture over indices in 0..K keeps the bound), only the
unbiasedness, to within 2^-53 of a step.

Accepted reports. An honest report is m = i + Z with i in 0..K, so it falls
outside [-B, K + B] only if |Z| > B, where for P(Z = z) ∝ e^(-g |z|)

    P(|Z| > B) = 2 sum_{z > B} (1 - a) / (1 + a) a^z = 2 a^(B + 1) / (1 + a),  a = e^-g.

``noise_tail_bound`` is the smallest B with P(|Z| > B) < 2^-60, i.e. the least
integer B > (61 ln 2 - ln(1 + e^-g)) / g - 1 (about 42.3 K / eps). Reports
outside [-B, K + B] are refused: an honest device sends one with probability
below 2^-60, and a hostile one can then move a mean of n reports by at most
(K + B) w / n, a few noise scales over n, instead of arbitrarily far.

Report: the noisy grid index (int64), payload ``{"value": int}``. Debiased
value: lower + w m.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal, localcontext
from typing import Any, Literal

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import IndexReports
from shared.mechanisms.numeric import NoiseVariance, NumericMechanism, bernoulli_central_moments
from shared.mechanisms.registry import register
from shared.mechanisms.spec import GridNumericSpec
from shared.randomness import (
    Rng,
    as_source,
    discrete_laplace_pmf,
    discrete_laplace_variance,
)

DEFAULT_GRID_STEPS = 1024
#: Denominator of the rational epsilon the exact sampler works with.
EPSILON_RESOLUTION = 1 << 20
#: An honest report falls outside the accepted range with probability below 2^-TAIL_BITS.
TAIL_BITS = 60


def noise_tail_bound(s: int, t: int) -> int:
    """The smallest B >= 0 with P(|Z| > B) = 2 e^(-g (B + 1)) / (1 + e^-g) < 2^-60, g = s / t.

    Solved in floating point, B = floor((61 ln 2 - ln(1 + e^-g)) / g - 1) + 1, then moved
    by single steps until the inequality holds at B and fails at B - 1, both evaluated
    in 50-digit decimal arithmetic (``_tail_below``).
    """
    g = s / t
    bound = max(0, math.floor(((TAIL_BITS + 1) * math.log(2) - math.log1p(math.exp(-g))) / g))
    while not _tail_below(bound, s, t):
        bound += 1
    while bound > 0 and _tail_below(bound - 1, s, t):
        bound -= 1
    return bound


def _tail_below(bound: int, s: int, t: int) -> bool:
    """Whether 2 e^(-g (B + 1)) < 2^-60 (1 + e^-g), g = s / t, in 50-digit decimals."""
    with localcontext(Context(prec=50)):
        g = Decimal(s) / Decimal(t)
        tail = 2 * (-g * (bound + 1)).exp()
        return tail < (1 + (-g).exp()) / Decimal(2) ** TAIL_BITS


class LaplaceSpec(GridNumericSpec):
    """``{"mechanism": "laplace", "epsilon": 1.0, "lower": 0, "upper": 100}``;
    ``grid_steps`` defaults to 1024."""

    mechanism: Literal["laplace"]


@register
class DiscreteLaplace(IndexReports, NumericMechanism):
    name = "laplace"
    spec_model = LaplaceSpec

    def __init__(self, spec: LaplaceSpec) -> None:
        super().__init__(spec)
        self.grid_steps: int = spec.grid_steps or DEFAULT_GRID_STEPS
        self.step: float = (self.upper - self.lower) / self.grid_steps
        self.noise_s: int = int(self.epsilon * EPSILON_RESOLUTION)
        self.noise_t: int = self.grid_steps * EPSILON_RESOLUTION
        if self.noise_s < 1:
            raise ValueError(
                f"epsilon={self.epsilon} is below the laplace mechanism's resolution "
                f"2^-20 ({1 / EPSILON_RESOLUTION:.2e})"
            )
        #: B: reports outside -B..K+B are refused (``noise_tail_bound``).
        self.tail_bound: int = noise_tail_bound(self.noise_s, self.noise_t)

    @property
    def effective_epsilon(self) -> float:
        """The epsilon the sampler delivers: floor(eps 2^20) / 2^20 <= eps."""
        return self.noise_s / EPSILON_RESOLUTION

    def grid_position(self, values: np.ndarray) -> np.ndarray:
        """(clip(x) - lower) / w in [0, K]."""
        return (self.normalize(values) + 1.0) * (self.grid_steps / 2)

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        position = self.grid_position(values)
        source = as_source(rng)
        index = np.floor(position)
        index = index + source.bernoulli(position - index)
        index = np.minimum(index, self.grid_steps).astype(np.int64)
        return index + source.discrete_laplace(self.noise_s, self.noise_t, index.size)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"laplace reports must be a 1-d integer array, got {array.dtype}")
        low, high = -self.tail_bound, self.grid_steps + self.tail_bound
        bad = np.flatnonzero((array < low) | (array > high))
        if bad.size:
            raise ValueError(
                f"report {bad[0]}: grid index {array[bad[0]]} is outside {low}..{high}, the "
                f"grid 0..{self.grid_steps} plus {self.tail_bound} steps of noise tail (an honest "
                f"report falls outside with probability below 2^-{TAIL_BITS})"
            )
        return array.astype(np.int64)

    def debias(self, reports: np.ndarray) -> np.ndarray:
        return self.lower + self.step * reports.astype(np.float64)

    def noise_variance(self) -> float:
        """Var[Z] w^2 = w^2 2 e^-g / (1 - e^-g)^2, in original units."""
        return self.step**2 * discrete_laplace_variance(self.noise_s, self.noise_t)

    def report_variance(self, values: np.ndarray) -> np.ndarray:
        """w^2 (phi (1 - phi) + Var[Z]): rounding plus noise."""
        position = self.grid_position(values)
        phi = position - np.floor(position)
        return self.step**2 * phi * (1 - phi) + self.noise_variance()

    def variance_model(self) -> NoiseVariance:
        """The noise w^2 Var[Z] does not depend on x; rounding adds w^2 phi (1 - phi) <= w^2 / 4,
        taken at that bound (so ``std`` is conservative by at most w^2 / 4 per report)."""
        return NoiseVariance(
            self.centre, self.half_range, self.noise_variance(), 0.0, self.step**2 / 4
        )

    def worst_case_inputs(self) -> np.ndarray:
        return np.array([self.lower + self.step / 2])

    def report_central_moments(self, values: np.ndarray) -> np.ndarray:
        """Rounding (w times a Bernoulli(phi)) plus independent noise w Z: cumulants add.

        Z, the discrete Laplace with a = e^-g, has k2 = 2a / (1 - a)^2, k3 = 0 and
        E[Z^4] = 2a (1 + 10a + a^2) / (1 - a)^4, so k4 = E[Z^4] - 3 k2^2.
        """
        position = self.grid_position(values)
        phi = position - np.floor(position)
        rounding = bernoulli_central_moments(phi, self.step)
        a = math.exp(-self.noise_s / self.noise_t)
        k2 = 2 * a / (1 - a) ** 2
        k4 = 2 * a * (1 + 10 * a + a * a) / (1 - a) ** 4 - 3 * k2 * k2
        r2, r3 = rounding[:, 0], rounding[:, 1]
        r4_cumulant = rounding[:, 2] - 3 * r2 * r2
        m2 = r2 + k2 * self.step**2
        m4 = r4_cumulant + k4 * self.step**4 + 3 * m2 * m2
        return np.stack([m2, r3, m4], axis=1)

    def transition_matrix(self, values: np.ndarray) -> np.ndarray:
        """P[m | x] for m = -1..K+1, beyond which every likelihood ratio is that at -1 or K+1."""
        position = self.grid_position(values)
        low = np.floor(position)
        phi = (position - low)[:, None]
        outputs = np.arange(-1, self.grid_steps + 2)[None, :]
        pmf = discrete_laplace_pmf
        s, t = self.noise_s, self.noise_t
        return (1 - phi) * pmf(outputs - low[:, None], s, t) + phi * pmf(
            outputs - low[:, None] - 1, s, t
        )
