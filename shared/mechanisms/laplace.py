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

Report: the noisy grid index (int64), payload ``{"value": int}``. Debiased
value: lower + w m.
"""

from __future__ import annotations

import math

import numpy as np

from shared.mechanisms.base import IndexReports
from shared.mechanisms.numeric import NumericMechanism, bernoulli_central_moments
from shared.randomness import (
    Rng,
    as_source,
    discrete_laplace_pmf,
    discrete_laplace_variance,
)
from shared.schemas import MechanismSpec

DEFAULT_GRID_STEPS = 1024
#: Denominator of the rational epsilon the exact sampler works with.
EPSILON_RESOLUTION = 1 << 20
#: Reports beyond this many grid steps are refused (far past any noise tail).
_MAX_REPORT = 1 << 52


class DiscreteLaplace(IndexReports, NumericMechanism):
    name = "laplace"

    def __init__(self, spec: MechanismSpec) -> None:
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

    @property
    def effective_epsilon(self) -> float:
        """The epsilon the sampler delivers: floor(eps 2^20) / 2^20 <= eps."""
        return self.noise_s / EPSILON_RESOLUTION

    def grid_position(self, values: np.ndarray) -> np.ndarray:
        """(clip(x) - lower) / w in [0, K]."""
        return (self.normalize(values) + 1.0) * (self.grid_steps / 2)

    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
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
        bad = np.flatnonzero(np.abs(array) > _MAX_REPORT)
        if bad.size:
            raise ValueError(f"report {bad[0]}: grid index {array[bad[0]]} is implausibly large")
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
