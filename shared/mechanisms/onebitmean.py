"""Microsoft's 1BitMean with alpha-point rounding, memoization and output perturbation.

Ding, Kulkarni and Yekhanin, "Collecting Telemetry Data Privately" (NeurIPS 2017):
1BitMean (Section 2.1), alpha-point rounding and memoization (Section 3.1), output
perturbation (Section 3.2). For numbers reported again and again (a daily counter), so
that any number of reports of one (rounded) value reveal at most ``epsilon``.

The device. With s = ``grid_steps``, the clipped range [lower, upper] is cut into s
cells of width w = (upper - lower) / s, whose s + 1 ends are the grid points
g = 0..s. A device

1. draws a rounding offset U, uniform on {0, .., 2^53 - 1}, once per metric version
   (memoized: the same for every value and every report);
2. rounds x to a grid point: with t = s (clip(x) - lower) / (upper - lower),
   k = floor(t) and phi = t - k, it reports g = k + [U < floor(phi 2^53)]. The same U
   for every value is alpha-point rounding (alpha = U / 2^53): x rounds up iff its
   position in its cell exceeds alpha, so over U, P(g = k + 1) = floor(phi 2^53) / 2^53
   and E[g] = t up to 2^-53, while one device maps all values of a cell to at most two
   grid points, in order;
3. answers g with its *memoized bit*, drawn once per (device, metric version, g):
   1 with probability pi(g), linear in g from pi(0) = 1 / (e^eps + 1) to
   pi(s) = e^eps / (e^eps + 1): 1BitMean of the grid point (``permanent_matrix``), so
   any number of reports of one grid point, post-processing of one bit, are
   ``epsilon``-LDP (likelihood ratio pi(s) / pi(0) = e^eps);
4. sends the bit flipped with probability gamma = ``flip_probability`` (output
   perturbation, fresh for each report; gamma = 0 sends the memoized bit itself).

One report. Flipping maps pi to gamma + (1 - 2 gamma) pi, so P(b = 1 | x) stays linear
in x, between q' = gamma + (1 - 2 gamma) pi(0) at x = lower and p' = 1 - q' at x = upper:
one report is Duchi et al.'s one-bit law (``shared.mechanisms.duchi``) at
``epsilon_report`` = ln(p' / q') = ln((e^eps (1 - gamma) + gamma) / (e^eps gamma + 1 - gamma))
(``shared.schemas.onebitmean_epsilon_report``), with p' - q' = (1 - 2 gamma)(e^eps - 1) /
(e^eps + 1) = (e^eps_r - 1) / (e^eps_r + 1). Rounding leaves the law linear (it mixes the
laws of two neighbouring grid points with weights that average to t), so the debiased
report

    y = lower + (upper - lower) (b - q') / (p' - q'),   E[y | x] = clip(x),

has Duchi's variance with C = 1 / (p' - q') (h = (upper - lower) / 2, t in [-1, 1]):

    Var[y | x] = h^2 (C^2 - t^2),   worst case C^2 h^2 at the centre.

The mean of one period's reports is unbiased, with this variance per device, however
many periods the devices reported before: devices, their offsets and their memoized bits
are independent. Estimates of different periods from the same devices are correlated
through the memo (averaging periods does not average the memoized bits away: the point).

The cost and the use of output perturbation. C grows by 1 / (1 - 2 gamma), so the
worst-case variance grows by 1 / (1 - 2 gamma)^2, and one report reveals
epsilon_report < epsilon; any number of reports of one rounded value still reveal at
most epsilon (each is the memoized bit XOR a fresh flip: post-processing of the bit).
What gamma hides: with gamma = 0 the reports of one grid point are identical, so two
reports that differ prove that the device's rounded value changed; with gamma > 0 two
reports of an unchanged value differ with probability 2 gamma (1 - gamma), and one
change of report is no longer proof of a change of value. Many reports still show the
pattern: which periods share a memoized bit depends on the values (and on U).

Lifetime. The ledger charges ``epsilon`` once per distinct memo key, the grid point g
(``memo_keys``): a device reporting an unchanged value keeps one key for life; values
that stay within one cell use at most two.

The grid (``grid_steps``, default 8). One report's variance does not depend on s: by
the law of total variance, rounding is a share of the bit's variance, not an addition
to it. That share, w^2 phi (1 - phi) <= w^2 / 4 = ((upper - lower) / s)^2 / 4 = h^2 / s^2,
is what a device's offset U fixes for good; at s = 8 it is below 1/64 of the worst-case
variance C^2 h^2. A coarse grid keeps the number of distinct memoized values, and so
the lifetime epsilon of a device whose value drifts, small: hence 8.

Realized probabilities. Every coin is a uniform 53-bit integer below a threshold. The
memoized bit of g is 1 with probability T(g) / 2^53, T(g) = T_lo + g D / s, D = 2^53 -
2 T_lo: exactly linear, and T(s) = 2^53 - T(0). T_lo is 1 / (e^eps + 1) rounded up and
stepped up until (2^53 - T_lo) / T_lo is proven at most e^eps (as ``duchi``; with
gamma = 0, where one report is the memoized bit, also at most e^epsilon_report), then up
to the next T_lo that makes D divisible by s: the permanent ratio T(s) / T(0) is at most
e^eps and below it by at most (s + 2)(e^eps + 1) 2^-52, relative. The flip threshold F
is gamma 2^53 rounded up and stepped up until the exact one-report ratio
(1 - q') / q', q' = (F 2^53 + (2^53 - 2 F) T_lo) / 2^106, is proven at most
e^epsilon_report. q', p' = 1 - q' and C are these exact values, so E[y | x] is exactly
the grid position lower + w E[g]: exactly x at grid points, up to 2^-53 w elsewhere.

Memo draws (what a client in another language must reproduce; ``shared.memo``: scope =
``spec_scope(spec_hash)``, words little-endian uint64 w0, w1, ... of a stream):

* the offset: purpose ``b"onebitmean alpha"``, key 0, U = w0 >> 11 (the top 53 bits);
  t = (clip((clip(x, lower, upper) - lower) / h - 1, -1, 1) + 1) (s / 2) in IEEE-754
  double arithmetic (h = (upper - lower) / 2), k = min(floor(t), s), and
  g = k + [U < floor((t - k) 2^53)];
* the memoized bit of g: purpose ``b"onebitmean bit"``, key g, bit = [(w0 >> 11) < T(g)];
* the flip is fresh, not memoized: [V < F] for a fresh uniform 53-bit V; the report is
  the bit XOR the flip.

Report: the sent bit (int8, 0 or 1), payload ``{"value": 0 | 1}``. Sufficient
statistics and estimates: ``shared.mechanisms.numeric``, with Duchi's noise model
(curvature -1: ``std`` is an upper bound) and Duchi's exact two-point fast path.

Refusal rules: none (``shared.integrity``). A report is one bit, and a device whose memoized
bit is b sends b with probability 1 - gamma >= 1/2, so each output is likely under some
input and device state: no nonempty set of outputs is below 2^-40 for all of them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.duchi import DuchiMean
from shared.mechanisms.memoized import MemoizedMechanism, MemoizedSpec
from shared.mechanisms.registry import register
from shared.mechanisms.spec import MIN_EPSILON, GridNumericSpec
from shared.memo import Memo
from shared.randomness import BITS53, Rng, as_source, certified_threshold, threshold53

#: Grid intervals of [lower, upper] when the spec leaves ``grid_steps`` out (see the
#: module docstring: rounding costs no variance, few grid points keep lifetime epsilon small).
DEFAULT_GRID_STEPS = 8
#: Memo purpose of the device's rounding offset U (key 0).
OFFSET_PURPOSE = b"onebitmean alpha"
#: Memo purpose of the memoized bit of a grid point (keyed by the grid point).
BIT_PURPOSE = b"onebitmean bit"


def onebitmean_epsilon_report(epsilon: float, flip_probability: float) -> float:
    """Epsilon of one ``onebitmean`` report with output perturbation ``gamma``.

    The memoized bit is 1 with probability between 1 / (e^eps + 1) and e^eps / (e^eps + 1)
    (Ding, Kulkarni and Yekhanin, NeurIPS 2017, 1BitMean); flipping it with probability
    gamma before it is sent moves each probability pi to gamma + (1 - 2 gamma) pi, so one
    report is ``ln((e^eps (1 - gamma) + gamma) / (e^eps gamma + 1 - gamma))``-LDP (equal to
    eps at gamma = 0), while any number of reports stay post-processing of the memoized
    bits (eps per distinct rounded value).
    """
    grown = math.exp(epsilon)
    gamma = flip_probability
    return math.log((grown * (1 - gamma) + gamma) / (grown * gamma + 1 - gamma))


class OneBitMeanSpec(MemoizedSpec, GridNumericSpec):
    """``{"mechanism": "onebitmean", "epsilon": 1.0, "lower": 0, "upper": 100}``, with
    ``grid_steps`` (the rounding grid, default 8) and ``flip_probability`` (default 0);
    ``epsilon_report`` is filled in from them (``onebitmean_epsilon_report``)."""

    mechanism: Literal["onebitmean"]
    flip_probability: float | None = Field(
        default=None,
        ge=0.0,
        lt=0.5,
        allow_inf_nan=False,
        description=(
            "onebitmean: output perturbation, the probability that each report's memoized "
            "bit is flipped before it is sent (default 0); hides when a memoized value changes."
        ),
    )

    @model_validator(mode="after")
    def _derived_report_epsilon(self) -> OneBitMeanSpec:
        derived = onebitmean_epsilon_report(self.epsilon, self.flip_probability or 0.0)
        if derived < MIN_EPSILON:
            raise ValueError(
                f"flip_probability = {self.flip_probability} leaves one report "
                f"epsilon_report = {derived:.3g}, below {MIN_EPSILON}: lower it"
            )
        self.check_derived_report_epsilon(derived)
        return self


@register
class OneBitMean(MemoizedMechanism, DuchiMean):
    """1BitMean of the alpha-rounded value, memoized per grid point, then flipped with
    probability ``flip_probability`` (module docstring).

    From ``DuchiMean``, at the realized C = 1 / (p' - q'): ``report_variance``,
    ``variance_model``, ``report_central_moments``, the exact two-point
    ``simulate_statistics`` and ``transition_matrix(values)``, one report's law with
    columns (0, 1).
    """

    name = "onebitmean"
    spec_model = OneBitMeanSpec
    spec: OneBitMeanSpec

    def __init__(self, spec: OneBitMeanSpec) -> None:
        super().__init__(spec)
        self.grid_steps: int = spec.grid_steps or DEFAULT_GRID_STEPS
        self.flip_probability: float = spec.flip_probability or 0.0

    @cached_property
    def lowest_threshold(self) -> int:
        """T_lo = T(0): certified (2^53 - T_lo) / T_lo <= e^eps (and <= e^epsilon_report when
        nothing is flipped), then raised to the next value with s | 2^53 - 2 T_lo."""
        bound = self.epsilon_lifetime
        if self.flip_probability == 0:
            bound = min(bound, self.epsilon_report)  # the spec's ln(e^eps) may be an ulp below
        start = certified_threshold(
            1.0 / (math.exp(self.epsilon_lifetime) + 1),
            "up",
            lambda t: Fraction(BITS53 - t, t),
            bound,
        )
        s = self.grid_steps
        # s | 2^53 - 2 T  <=>  T = 2^52 (mod s / 2) for even s, (mod s) for odd s.
        return start + (BITS53 // 2 - start) % (s // 2 if s % 2 == 0 else s)

    @cached_property
    def bit_thresholds(self) -> np.ndarray:
        """T(g) = T_lo + g (2^53 - 2 T_lo) / s for g = 0..s (uint64): the memoized bit of
        grid point g is 1 with probability T(g) / 2^53."""
        low = self.lowest_threshold
        step = (BITS53 - 2 * low) // self.grid_steps
        return np.uint64(low) + np.uint64(step) * np.arange(self.grid_steps + 1, dtype=np.uint64)

    @cached_property
    def flip_threshold(self) -> int:
        """F: each report flips the memoized bit with probability F / 2^53 (0 for gamma = 0),
        gamma rounded up until the exact one-report ratio is proven <= e^epsilon_report."""
        if self.flip_probability == 0:
            return 0
        return certified_threshold(
            self.flip_probability,
            "up",
            lambda f: (1 - self._lowest_report(f)) / self._lowest_report(f),
            self.epsilon_report,
        )

    def _lowest_report(self, flip: int) -> Fraction:
        """q' = P(report 1 | x = lower) for flip threshold ``flip``, exactly:
        (F 2^53 + (2^53 - 2 F) T_lo) / 2^106."""
        return Fraction(flip * BITS53 + (BITS53 - 2 * flip) * self.lowest_threshold, BITS53**2)

    @property
    def lowest_report(self) -> Fraction:
        """q' = P(report 1 | x = lower), exactly; P(report 1 | x = upper) is p' = 1 - q'."""
        return self._lowest_report(self.flip_threshold)

    @property
    def scale(self) -> float:
        """C = 1 / (p' - q') = 1 / (1 - 2 q'), realized; nominally (e^eps_r + 1) / (e^eps_r - 1)
        with eps_r = epsilon_report."""
        return float(1 / (1 - 2 * self.lowest_report))

    def grid_rounding(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k, T_up) per value: the grid point below t = s (clip(x) - lower) / (upper - lower),
        k = min(floor(t), s) (int64), and the threshold floor((t - k) 2^53) below which the
        device's offset U rounds up to k + 1 (uint64)."""
        position = (self.normalize(values) + 1.0) * (self.grid_steps / 2)
        below = np.minimum(np.floor(position), self.grid_steps)
        return below.astype(np.int64), threshold53(position - below, "down")

    def plus_probability(self, values: np.ndarray) -> np.ndarray:
        """Realized P(report 1 | x) = q' + (p' - q') E[g] / s, E[g] = k + T_up / 2^53."""
        below, up = self.grid_rounding(values)
        low = float(self.lowest_report)
        position = below + up.astype(np.float64) / BITS53
        return low + (1 - 2 * low) * (position / self.grid_steps)

    def plus_thresholds(self, values: np.ndarray) -> np.ndarray:
        """Refused: one report's P(1 | x) mixes two grid points' bits and a flip, so it is no
        single 53-bit threshold; ``plus_probability`` is the exact law."""
        raise TypeError(
            "onebitmean's P(report 1 | x) is not one 53-bit threshold: use plus_probability, "
            "bit_thresholds and flip_threshold"
        )

    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The grid point g each value rounds to with its device's offset U (int64)."""
        below, up = self.grid_rounding(values)
        return self._round(below, up, self.memo_for(below, None, memo))

    def _round(self, below: np.ndarray, up: np.ndarray, memo: Memo) -> np.ndarray:
        """g = k + [U < T_up], U the top 53 bits of word 0 of each device's offset stream."""
        rounds_up = memo.draws(OFFSET_PURPOSE).bernoulli_below(up[:, None])[:, 0]
        return below + rounds_up

    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The memoized bit (int8) of the grid point each value rounds to."""
        below, up = self.grid_rounding(values)
        return self._permanent(below, up, self.memo_for(below, None, memo))

    def _permanent(self, below: np.ndarray, up: np.ndarray, memo: Memo) -> np.ndarray:
        """bit = [(w0 >> 11) < T(g)], w0 the first word of the stream keyed by g."""
        keys = self._round(below, up, memo)
        bits = memo.draws(BIT_PURPOSE, keys).bernoulli_below(self.bit_thresholds[keys][:, None])
        return bits[:, 0].astype(np.int8)

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """One report per value: the memoized bit (``memo`` row i = value i's device;
        ``None``: offset and bit drawn fresh from ``rng``), flipped with probability
        F / 2^53 fresh from ``rng``. O(1) memory per value."""
        below, up = self.grid_rounding(values)
        bits = self._permanent(below, up, self.memo_for(below, rng, context.memo))
        if self.flip_threshold:
            bits ^= as_source(rng).bernoulli_below(self.flip_threshold, bits.size)
        return bits

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.ndim != 1:
            raise ValueError(f"onebitmean reports must be a 1-d array of bits, got {array.shape}")
        bad = np.flatnonzero((array != 0) & (array != 1))
        if bad.size:
            raise ValueError(
                f"report {bad[0]}: the bit must be 0 or 1, got {array[bad[0]].item()!r}"
            )
        return array.astype(np.int8)

    def debias(self, reports: np.ndarray) -> np.ndarray:
        """y = lower + (upper - lower) (b - q') / (p' - q') = Duchi's C (2 b - 1), mapped back."""
        return super().debias(2 * reports.astype(np.int8) - 1)

    def permanent_matrix(self) -> np.ndarray:
        """P[memoized bit | grid point g] for g = 0..s, columns (0, 1): ratio e^eps at the ends."""
        ones = self.bit_thresholds.astype(np.float64) / BITS53
        return np.stack([1 - ones, ones], axis=1)
