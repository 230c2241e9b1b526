"""Piecewise mechanism on a grid: the law of Wang et al., made discrete and exact.

The continuous piecewise mechanism (Wang, Xiao, Yang, Zhao, Hong, Lin, Yu,
"Collecting and Analyzing Multidimensional Data with Local Differential
Privacy", ICDE 2019, Algorithm 2) reports y in [-C, C], uniform on a window
[l(t), r(t)] of width C - 1 that slides with the input t with probability
e^(eps/2) / (e^(eps/2) + 1), else uniform on the rest. Drawn as the double
``l(t) + u (C - 1)``, the set of reachable outputs depends on t: some outputs
of one input are impossible under another, an infinite likelihood ratio
(Mironov, "On Significance of the Least Significant Bits for Differential
Privacy", CCS 2012). So this module reports a *cell index* instead, drawn with
exact integer sampling. With K = ``grid_steps`` (default 1024) and a window of
w cells (1 <= w <= K), there are M = K + w cells:

1. Clip x, write p = (x - lower) K / (upper - lower) = k + phi (0 <= phi < 1)
   and round randomly to the grid index i = k + 1 with probability phi, else
   i = k (i in 0..K, E[i] = p).
2. With probability p_in report a cell uniform on the window [i, i + w),
   otherwise a cell uniform on the M - w cells outside it. So
   P(m | i) = H = p_in / w inside the window, L = (1 - p_in) / (M - w) outside.

Privacy. For any grid indices i, j and cell m, P(m | i) / P(m | j) is one of
H / L, 1, L / H; rounding mixes over indices, which keeps the bound, so the
mechanism is eps-LDP iff H / L = p_in (M - w) / ((1 - p_in) w) <= e^eps. The
ideal p_in = w e^eps / (w e^eps + M - w) makes it equal. The Bernoulli realizes
p_in = T / 2^53 for the integer T = floor(2^53 p_in), lowered further (rarely, by
a unit or two) until the exact rational T (M - w) / ((2^53 - T) w) is proven at
most e^eps (``shared.randomness.certified_threshold``): the realized ratio never
exceeds e^eps, and ``effective_epsilon`` (its log) is below eps by about
2^-53 / (1 - p_in), relative. Inputs at lower and upper round to i = 0 and
i = K, whose windows are disjoint (w <= K): the bound is tight. Every input
reaches every cell 0..M-1 with probability at least L > 0, so no output has an
infinite likelihood ratio. (Of the other numeric mechanisms, ``duchi`` reports a
sign and ``laplace`` an integer drawn by exact integer sampling: neither output
set depends on the input through floating point either.)

Estimation. E[m | i] = (M - 1) / 2 + beta (i - K / 2) with
beta = (H - L) w = p_in - (1 - p_in) w / (M - w), so the debiased report

    t_hat = (2 m - (M - 1)) / (beta K),   y = lower + (t_hat + 1) (upper - lower) / 2

has E[y | x] = clip(x). The window of index i is centred at (M - 1) / 2 + (i - K / 2),
so summing (m - E[m | i])^2 against L on all M cells and H - L on the window gives

    Var[m | i] = V0 + beta (1 - beta) (i - K/2)^2,
    V0 = (L M (M^2 - 1) + (H - L) w (w^2 - 1)) / 12,

and adding the rounding (E_i Var[m | i] + Var_i E[m | i], with Var[i] = phi (1 - phi)),
with u = p - K/2,

    Var[m | x] = V0 + beta (1 - beta) u^2 + beta phi (1 - phi),
    Var[y | x] = (upper - lower)^2 / (beta K)^2 Var[m | x].

Worst case: on each grid interval the variance is concave in p and it grows
towards the ends, so the maximum is at p = s* or K - s* with
s* = clip((1 - (1 - beta) K) / (2 beta), 0, 1) (s* = 0, the ends, unless K is tiny).

Window. w minimizes this worst-case variance over 1..K (ideal p_in). With
w = K e^(-eps/2), the continuous law's window fraction (C - 1) / (2 C), the
variance tends to Wang et al.'s t^2 / (z - 1) + (z + 3) / (3 (z - 1)^2)
(z = e^(eps/2)) as K grows; the optimized window is wider and its worst case
lower (about 5.07 against 5.22 at eps = 1, 0.162 against 0.241 at eps = 4, in
normalized units). At the default K = 1024 the worst case differs from
that at K = 65536 by under 2e-6 (relative) for eps <= 4; a coarse grid costs
variance (rounding, and a window of whole cells), never privacy.

Report: the cell index (int64), payload ``{"value": int}`` in 0..M-1.

Refusal rules: none (``shared.integrity``). Each cell m lies in the window of some grid
index (the windows [i, i + w), i = 0..K, cover 0..M - 1), where its probability is
H = p_in / w > 1/M >= 2^-17 (H > L and w H + (M - w) L = 1), so no nonempty set of cells
is below 2^-40 for every input.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, TypeAlias

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import IndexReports
from shared.mechanisms.numeric import NoiseVariance, NumericMechanism
from shared.mechanisms.registry import register
from shared.mechanisms.spec import GridNumericSpec
from shared.mechanisms.window import check_cell_reports, draw_window_cells, window_ratio
from shared.randomness import (
    BITS53,
    Rng,
    as_source,
    certified_threshold,
    realized_probability,
    threshold53,
)

Real: TypeAlias = float | np.ndarray

DEFAULT_GRID_STEPS = 1024


def worst_case_offset(beta: Real, grid_steps: int) -> np.ndarray:
    """s* = clip((1 - (1 - beta) K) / (2 beta), 0, 1): the grid position of the largest
    variance within the first grid interval (and K - s* within the last)."""
    return np.clip((1 - (1 - beta) * grid_steps) / (2 * beta), 0.0, 1.0)


def cell_variance(
    high: Real, low: Real, window: Real, cells: Real, u: np.ndarray, phi: np.ndarray
) -> np.ndarray:
    """Var[m | x] = V0 + beta (1 - beta) u^2 + beta phi (1 - phi) (see the module docstring)."""
    beta = (high - low) * window
    v0 = (low * cells * (cells**2 - 1) + (high - low) * window * (window**2 - 1)) / 12
    return v0 + beta * (1 - beta) * u**2 + beta * phi * (1 - phi)


@lru_cache(maxsize=256)
def best_window(epsilon: float, grid_steps: int) -> int:
    """The window w in 1..K of least worst-case Var[y | x] (ideal probabilities)."""
    w = np.arange(1, grid_steps + 1, dtype=np.float64)
    cells = grid_steps + w
    growth = math.exp(epsilon)
    p_in = w * growth / (w * growth + cells - w)
    high, low = p_in / w, (1 - p_in) / (cells - w)
    beta = (high - low) * w
    s = worst_case_offset(beta, grid_steps)
    worst = cell_variance(high, low, w, cells, s - grid_steps / 2, s) / beta**2
    return int(np.argmin(worst)) + 1


def _block_moments(start: np.ndarray, size: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Sums over the cells start..start+size-1 of (m - mean)^j, j = 2, 3, 4, as (n, 3).

    With c the block's centre minus mean and d the cells' offsets from the centre
    (symmetric: odd sums vanish), sum d^2 = n (n^2 - 1) / 12 and
    sum d^4 = n (n^2 - 1) (3 n^2 - 7) / 240, so the sums are n c^2 + D2,
    n c^3 + 3 c D2 and n c^4 + 6 c^2 D2 + D4.
    """
    n = size.astype(np.float64)
    c = start + (n - 1) / 2 - mean
    d2 = n * (n * n - 1) / 12
    d4 = n * (n * n - 1) * (3 * n * n - 7) / 240
    return np.stack([n * c**2 + d2, n * c**3 + 3 * c * d2, n * c**4 + 6 * c**2 * d2 + d4], axis=1)


class PiecewiseSpec(GridNumericSpec):
    """``{"mechanism": "piecewise", "epsilon": 1.0, "lower": 0, "upper": 100}``;
    ``grid_steps`` defaults to 1024."""

    mechanism: Literal["piecewise"]


@register
class PiecewiseMechanism(IndexReports, NumericMechanism):
    name = "piecewise"
    spec_model = PiecewiseSpec

    def __init__(self, spec: PiecewiseSpec) -> None:
        super().__init__(spec)
        self.grid_steps: int = spec.grid_steps or DEFAULT_GRID_STEPS
        self.step: float = (self.upper - self.lower) / self.grid_steps
        self.window: int = best_window(self.epsilon, self.grid_steps)
        self.cells: int = self.grid_steps + self.window
        weight = self.window * math.exp(self.epsilon)  # M - w = K cells outside the window
        self.threshold: int = certified_threshold(
            weight / (weight + self.grid_steps), "down", self.window_ratio, self.epsilon
        )
        p_in = realized_probability(self.threshold)
        self.high: float = p_in / self.window
        self.low: float = (1 - p_in) / (self.cells - self.window)
        self.beta: float = p_in - (1 - p_in) * self.window / (self.cells - self.window)

    def window_ratio(self, threshold: int) -> Fraction:
        """H / L = T (M - w) / ((2^53 - T) w) exactly, for P(window) = T / 2^53."""
        return window_ratio(threshold, self.window, self.cells - self.window)

    @property
    def effective_epsilon(self) -> float:
        """log(H / L), the epsilon delivered. The exact ratio is proven at most e^eps
        (``certified_threshold``); ``min`` only absorbs the last ulp of the float log."""
        ratio = self.window_ratio(self.threshold)
        return min(math.log(ratio.numerator) - math.log(ratio.denominator), self.epsilon)

    @property
    def bound(self) -> float:
        """(M - 1) / (beta K): the debiased normalized reports t_hat lie in [-bound, bound]."""
        return (self.cells - 1) / (self.beta * self.grid_steps)

    def grid_position(self, values: np.ndarray) -> np.ndarray:
        """p = (clip(x) - lower) / step in [0, K]."""
        return (self.normalize(values) + 1.0) * (self.grid_steps / 2)

    def rounding(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k, phi'): the grid index below p and the probability ``bernoulli(phi)``
        realizes of rounding up to k + 1."""
        position = self.grid_position(values)
        below = np.minimum(np.floor(position), self.grid_steps)
        phi = threshold53(position - below, "down").astype(np.float64) / BITS53
        return below.astype(np.int64), phi

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        position = self.grid_position(values)
        source = as_source(rng)
        below = np.floor(position)
        index = below + source.bernoulli(position - below)
        index = np.minimum(index, self.grid_steps).astype(np.int64)
        return draw_window_cells(index, self.window, self.cells, self.threshold, source)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        return check_cell_reports(reports, self.cells, self.name)

    def debias(self, reports: np.ndarray) -> np.ndarray:
        t_hat = (2 * reports.astype(np.float64) - (self.cells - 1)) / (self.beta * self.grid_steps)
        return self.to_original(t_hat)

    def _scale(self) -> float:
        """Original units per cell of the debiased report: step / beta."""
        return self.step / self.beta

    def report_variance(self, values: np.ndarray) -> np.ndarray:
        """(step / beta)^2 (V0 + beta (1 - beta) u^2 + beta phi (1 - phi)), u = p - K/2."""
        below, phi = self.rounding(values)
        u = below + phi - self.grid_steps / 2
        variance = cell_variance(self.high, self.low, self.window, self.cells, u, phi)
        return variance * self._scale() ** 2

    def variance_model(self) -> NoiseVariance:
        """With u = (x - centre) / step and scale = step / beta, Var[y | x] is
        scale^2 V0 + ((1 - beta) / beta) (x - centre)^2 + (step^2 / beta) phi (1 - phi):
        base scale^2 V0, curvature (1 - beta) / beta, rounding at most step^2 / (4 beta)."""
        zero = np.zeros(1)
        v0 = float(cell_variance(self.high, self.low, self.window, self.cells, zero, zero)[0])
        return NoiseVariance(
            self.centre,
            self.half_range,
            v0 * self._scale() ** 2,
            (1 - self.beta) / self.beta,
            self.step**2 / (4 * self.beta),
        )

    def worst_case_inputs(self) -> np.ndarray:
        s = float(worst_case_offset(np.float64(self.beta), self.grid_steps))
        return np.array([self.lower + self.step * s, self.upper - self.step * s])

    def report_central_moments(self, values: np.ndarray) -> np.ndarray:
        """Exact central moments 2..4 of y: the pmf of m is L everywhere plus H - L on the
        window, mixed over the two rounded indices, and each uniform block of cells
        contributes its closed-form power sums (``_block_moments``) about
        E[m | x] = (M - 1) / 2 + beta (p - K / 2)."""
        below, phi = self.rounding(values)
        mean = (self.cells - 1) / 2 + self.beta * (below + phi - self.grid_steps / 2)
        everything = _block_moments(np.zeros_like(mean), np.full(mean.shape, self.cells), mean)
        total = self.low * everything
        for weight, index in ((1 - phi, below), (phi, np.minimum(below + 1, self.grid_steps))):
            window = _block_moments(index, np.full(mean.shape, self.window), mean)
            total = total + (weight * (self.high - self.low))[:, None] * window
        return total * self._scale() ** np.array([2, 3, 4])

    def transition_matrix(self, values: np.ndarray) -> np.ndarray:
        """P[m | x] for every cell m = 0..M-1, from the realized probabilities: T / 2^53
        for the window and ``threshold53(phi) / 2^53`` for rounding up."""
        below, phi = self.rounding(values)
        cells = np.arange(self.cells)[None, :]

        def row(index: np.ndarray) -> np.ndarray:
            start = index[:, None]
            inside = (cells >= start) & (cells < start + self.window)
            return np.where(inside, self.high, self.low)

        above = np.minimum(below + 1, self.grid_steps)
        return (1 - phi)[:, None] * row(below) + phi[:, None] * row(above)
