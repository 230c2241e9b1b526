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
outside [-B, K + B] only if |Z| > B, where for P(Z = z) = (1 - a) / (1 + a) a^|z|

    P(|Z| > B) = 2 sum_{z > B} (1 - a) / (1 + a) a^z = 2 a^(B + 1) / (1 + a),  a = e^-g.

``noise_tail_bound(s, t, bits)`` is the smallest B with P(|Z| > B) < 2^-bits, i.e. the
least integer B > ((bits + 1) ln 2 - ln(1 + e^-g)) / g - 1 (about 0.69 (bits + 1) K / eps).
Two bounds come from it:

* ``check_reports`` (bits = 60, ``tail_bound``, about 42.3 K / eps): an index outside is
  not a laplace report at all (a 2^-60 event); aggregation relies on it.
* The refusal rule ``laplace.noise_tail`` (bits = 40, ``refusal_bound``, about 27.7 K / eps,
  ``shared.integrity``): an index outside [-B, K + B] is refused at ingest. Its honest
  false-refusal probability, the largest over every input, is exactly

      max_i [P(Z > K + B - i) + P(Z < -B - i)] = a^(B + 1) (1 + a^K) / (1 + a)

  (convex in i, so taken at i = 0 or K, where a device at ``lower`` or ``upper`` sits;
  a value between grid points is a mixture of two indices and does no worse), below
  P(|Z| > B) < 2^-40 (``worst_false_refusal``). At eps = 1, K = 1024: B = 28391 steps
  (27.7 noise scales 1 / g), false refusal 6.2e-13 = 2^-40.5. A forged report that passes
  the rule moves a mean of n reports by at most (K / 2 + B) w / n from the middle of the
  range, 28.2 (upper - lower) / n at eps = 1 (2^-60: 42.1), while an honest report's noise
  has scale (upper - lower) / eps.

Profile (``Profiled``). Per report, its excess beyond the grid above, e+ = max(m - K, 0),
and below, e- = max(-m, 0). At the edges c_j = ceil(j t / (4 s)) (every quarter of the
noise scale 1 / g = t / s steps, from 0 up to below B; J of them, 111 for every K when
eps / K is small), the profile keeps the tail counts #{e+ > c_j}, #{e- > c_j} and the tail
sums sum (e+ - c_j)_+, sum (e- - c_j)_+: 4 J int64 counts that merge by addition. A sum
is at most n B, in int64 while n B < 2^63 (at eps = 1, K = 1024: n < 3.2e14 reports).
``fit`` tests the tail counts against the honest bound: for every input, P(e > c) <=
P(Z > c) = a^(c + 1) / (1 + a), so each count is stochastically at most Binomial(n,
P(Z > c)); one-sided binomial p-values, Bonferroni over the 2 J tests (conservative:
under no attack the p-value is super-uniform).

Bounded influence (``BoundedInfluence``). ``robust_mean`` winsorizes every index to
[-c, K + c], c the smallest edge with n P(|Z| > c) <= 1 (at most one honest report
expected to be moved; the last edge if none is, n beyond about 2^40). From the profile,
exactly, sum_m clip(m, -c, K + c) = sum_m m - S+_c + S-_c, so the robust mean is the
plain mean plus w (S-_c - S+_c) / n.

* Bias. For an input at index i, E[clip(m)] - E[m] = E[(-c - i - Z)_+] -
  E[(i + Z - K - c)_+] = h(c + i) - h(c + K - i) by the symmetry of Z, with
  h(u) = E[(Z - u)_+] = a^(u + 1) / ((1 + a) (1 - a)) for integers u >= 0
  (sum_{z > u} (z - u) (1 - a) / (1 + a) a^z = (1 - a) / (1 + a) a^u sum_{k >= 1} k a^k,
  ``mean_excess``). As i runs over 0..K the difference moves monotonically
  between h(c + K) - h(c) and h(c) - h(c + K), so the winsorized mean of any inputs in
  [lower, upper] (rounding mixes two indices) is biased by at most
  ``bias_bound`` = w h(c) (1 - a^K), attained with every input at ``lower`` or ``upper``.
  At eps = 1, K = 1024 on [0, 100]: c = 7168 steps and a bias bound of 0.029 for
  n = 1000 (std 4.47); c = 12032, bound 2.5e-4 for n = 10^5 (std 0.45).
* Variance. Clipping is 1-Lipschitz, so Var[clip(m)] = E[(clip(m) - clip(m'))^2] / 2 <=
  E[(m - m')^2] / 2 = Var[m] (m' an independent copy): ``std`` is the plain estimate's,
  conservative.
* Influence. One report, forged or not, moves the robust mean by at most (K + 2 c) w / n
  (``RobustMean.influence``): at eps = 1 on [0, 100], 15.0 (upper - lower) / n for
  n = 1000 and 24.5 for n = 10^5, against (K + 2 B) w / n = 56.5 (upper - lower) / n for
  the plain mean under the refusal rule. An honest report's own reach, from the middle
  of the range, is typically up to about (K / 2 + c) w / n.

Report: the noisy grid index (int64), payload ``{"value": int}``. Debiased
value: lower + w m.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal, localcontext
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np

from shared.integrity import (
    MIN_FIT_REPORTS,
    REFUSAL_BITS,
    BoundedInfluence,
    FitTest,
    Profiled,
    RefusalRule,
    RobustMean,
)
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
from shared.statistics import CountStatistics, MomentStatistics

DEFAULT_GRID_STEPS = 1024
#: Denominator of the rational epsilon the exact sampler works with.
EPSILON_RESOLUTION = 1 << 20
#: An honest report falls outside the accepted range with probability below 2^-TAIL_BITS.
TAIL_BITS = 60
#: The profile's edges lie every 1 / EDGES_PER_SCALE of the noise scale 1 / g.
EDGES_PER_SCALE = 4


def noise_tail_bound(s: int, t: int, bits: int = TAIL_BITS) -> int:
    """The smallest B >= 0 with P(|Z| > B) = 2 e^(-g (B + 1)) / (1 + e^-g) < 2^-bits, g = s / t.

    Solved in floating point, B = floor(((bits + 1) ln 2 - ln(1 + e^-g)) / g - 1) + 1, then
    moved by single steps until the inequality holds at B and fails at B - 1, both
    evaluated in 50-digit decimal arithmetic (``_tail_below``). ``bits`` = 60 gives the
    structural bound of ``check_reports``, 40 the refusal rule's.
    """
    g = s / t
    bound = max(0, math.floor(((bits + 1) * math.log(2) - math.log1p(math.exp(-g))) / g))
    while not _tail_below(bound, s, t, bits):
        bound += 1
    while bound > 0 and _tail_below(bound - 1, s, t, bits):
        bound -= 1
    return bound


def _tail_below(bound: int, s: int, t: int, bits: int) -> bool:
    """Whether 2 e^(-g (B + 1)) < 2^-bits (1 + e^-g), g = s / t, in 50-digit decimals."""
    with localcontext(Context(prec=50)):
        g = Decimal(s) / Decimal(t)
        tail = 2 * (-g * (bound + 1)).exp()
        return tail < (1 + (-g).exp()) / Decimal(2) ** bits


def worst_false_refusal(bound: int, grid_steps: int, s: int, t: int) -> float:
    """max over grid indices i in 0..K of P(i + Z outside -B..K+B), g = s / t, a = e^-g:

        P(Z > K + B - i) + P(Z < -B - i) = (a^(K + B + 1 - i) + a^(B + 1 + i)) / (1 + a),

    convex in i, so largest at i = 0 and i = K (equal there): a^(B + 1) (1 + a^K) / (1 + a),
    evaluated in 50-digit decimals and rounded to the nearest float.
    """
    with localcontext(Context(prec=50)):
        a = (-(Decimal(s) / Decimal(t))).exp()
        return float(a ** (bound + 1) * (1 + a**grid_steps) / (1 + a))


def upper_tail(edges: np.ndarray, s: int, t: int) -> np.ndarray:
    """P(Z > c) = sum_(z > c) (1 - a) / (1 + a) a^z = a^(c + 1) / (1 + a) for integers
    c >= 0, a = e^-g, g = s / t (by symmetry also P(Z < -c))."""
    g = s / t
    return np.exp(-g * (np.asarray(edges, dtype=np.float64) + 1)) / (1 + math.exp(-g))


def mean_excess(edge: int, s: int, t: int) -> float:
    """E[(Z - c)_+] for an integer c >= 0, a = e^-g:

    sum_(z > c) (z - c) (1 - a) / (1 + a) a^z = (1 - a) / (1 + a) a^c sum_(k >= 1) k a^k
                                              = a^(c + 1) / ((1 + a) (1 - a)).
    """
    g = s / t
    return math.exp(-g * (edge + 1)) / ((1 + math.exp(-g)) * -math.expm1(-g))


def _tail_counts_and_sums(excess: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """For each edge c: #{e > c} and sum_(e > c) (e - c), as one int64 vector of both
    (counts first), from the sorted positive excesses and their suffix sums (O(n log n))."""
    beyond = np.sort(excess[excess > 0])
    suffix = np.zeros(beyond.size + 1, dtype=np.int64)
    suffix[:-1] = np.cumsum(beyond[::-1])[::-1]
    position = np.searchsorted(beyond, edges, side="right")
    counts = beyond.size - position
    return np.concatenate([counts, suffix[position] - edges * counts])


class LaplaceSpec(GridNumericSpec):
    """``{"mechanism": "laplace", "epsilon": 1.0, "lower": 0, "upper": 100}``;
    ``grid_steps`` defaults to 1024."""

    mechanism: Literal["laplace"]


@register
class DiscreteLaplace(IndexReports, NumericMechanism):
    name = "laplace"
    spec_model = LaplaceSpec
    provides: ClassVar[tuple[type, ...]] = (Profiled, BoundedInfluence)

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
        #: B60: reports outside -B60..K+B60 are not laplace reports (``check_reports``).
        self.tail_bound: int = noise_tail_bound(self.noise_s, self.noise_t)
        #: B: reports outside -B..K+B break the rule ``laplace.noise_tail``.
        self.refusal_bound: int = noise_tail_bound(self.noise_s, self.noise_t, REFUSAL_BITS)
        #: The profile's edges c_j = ceil(j t / (4 s)) below B (j >= 0), distinct.
        per_edge = EDGES_PER_SCALE * self.noise_s
        last = max(0, per_edge * (self.refusal_bound - 1) // self.noise_t)
        quarters = np.arange(last + 1, dtype=np.int64)
        self.profile_edges: np.ndarray = np.unique(-((-quarters * self.noise_t) // per_edge))
        self.profile_edges.flags.writeable = False

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

    @cached_property
    def _noise_tail_rule(self) -> RefusalRule:
        low, high = -self.refusal_bound, self.grid_steps + self.refusal_bound
        return RefusalRule(
            "laplace.noise_tail",
            f"grid index outside {low}..{high}: the grid 0..{self.grid_steps} plus "
            f"{self.refusal_bound} steps of noise tail",
            worst_false_refusal(self.refusal_bound, self.grid_steps, self.noise_s, self.noise_t),
        )

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """``laplace.noise_tail``: a grid index outside -B..K+B (module docstring)."""
        return (self._noise_tail_rule,)

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        outside = (array < -self.refusal_bound) | (array > self.grid_steps + self.refusal_bound)
        return np.where(outside, 0, -1).astype(np.int8)

    def refusal_detail(self, report: np.ndarray) -> str:
        index = int(report)
        if index > self.grid_steps:
            return f"index {index} is {index - self.grid_steps} steps past the grid's end"
        if index < 0:
            return f"index {index} is {-index} steps before the grid's start"
        return f"index {index} is on the grid 0..{self.grid_steps}"

    @property
    def profile_length(self) -> int:
        """4 J for the J edges: tail counts above, below, then tail sums above, below."""
        return 4 * self.profile_edges.size

    def profile(self, reports: np.ndarray) -> CountStatistics:
        """Per edge c_j, the count of reports with e+ > c_j, then with e- > c_j, then
        sum (e+ - c_j)_+, then sum (e- - c_j)_+, where e+ = max(m - K, 0), e- = max(-m, 0)."""
        array = self.check_reports(reports)
        edges = self.profile_edges
        above = _tail_counts_and_sums(array - self.grid_steps, edges)
        below = _tail_counts_and_sums(-array, edges)
        size = edges.size
        vector = np.concatenate([above[:size], below[:size], above[size:], below[size:]])
        return CountStatistics(array.size, vector)

    def _profile_parts(self, profile: CountStatistics) -> np.ndarray:
        """The profile as a (4, J) matrix (rows: counts above, below; sums above, below)."""
        if profile.length != self.profile_length:
            raise ValueError(
                f"a laplace profile of this spec has {self.profile_length} counts, "
                f"got {profile.length}"
            )
        return profile.counts.reshape(4, self.profile_edges.size)

    def fit(self, profile: CountStatistics) -> FitTest | None:
        """One-sided binomial tests of the tail counts, Bonferroni over both sides and the J
        edges; conservative (super-uniform p-value under no attack).

        For every input index i in 0..K, e+ > c means Z > c + K - i >= c, and e- > c means
        Z < -c - i <= -c, so P(e > c) <= P(Z > c) = a^(c + 1) / (1 + a) =: t_c
        (``upper_tail``). Reports are independent, so the count N_c of a side is
        stochastically at most Binomial(n, t_c) and P(Bin(n, t_c) >= N_c) is a valid
        p-value for that edge; the window's is min(1, 2 J min_c P(Bin(n, t_c) >= N_c)).
        ``statistic`` is the largest N_c / (n t_c), how many times its honest bound's
        expectation the most over-full tail holds; ``degrees_of_freedom`` the number of tests,
        2 J. None below ``MIN_FIT_REPORTS`` reports.
        """
        parts = self._profile_parts(profile)
        n = profile.n
        if n < MIN_FIT_REPORTS:
            return None
        from scipy.stats import binom  # server side only: the device never tests fits

        observed = parts[:2].ravel()
        bounds = np.tile(upper_tail(self.profile_edges, self.noise_s, self.noise_t), 2)
        tests = observed.size
        p_value = min(1.0, tests * float(binom.sf(observed - 1, n, bounds).min()))
        return FitTest(
            "reports beyond the honest noise quantiles, one-sided binomial with Bonferroni; "
            "conservative",
            float((observed / (n * bounds)).max()),
            tests,
            p_value,
            n,
        )

    def robust_mean(self, stats: MomentStatistics, profile: CountStatistics) -> RobustMean:
        """Every report's grid index winsorized to [-c, K + c] (module docstring, "Bounded
        influence"): mean = plain mean + w (S-_c - S+_c) / n from the profile's tail sums."""
        parts = self._profile_parts(profile)
        n = stats.n
        if n <= 0 or profile.n != n:
            raise ValueError(
                f"a robust mean needs the profile of the same n >= 1 reports as the "
                f"statistics, got {profile.n} and {n}"
            )
        edges = self.profile_edges
        s, t = self.noise_s, self.noise_t
        covering = np.flatnonzero(n * 2 * upper_tail(edges, s, t) <= 1)
        j = int(covering[0]) if covering.size else edges.size - 1
        edge = int(edges[j])
        moved = int(parts[0, j] + parts[1, j])
        shift = self.step * (int(parts[3, j]) - int(parts[2, j])) / n
        plain = self.estimate(stats)
        spread = -math.expm1(-s / t * self.grid_steps)  # 1 - a^K
        return RobustMean(
            mean=plain.mean + shift,
            std=plain.std,
            n=n,
            low=self.lower - edge * self.step,
            high=self.upper + edge * self.step,
            bias_bound=self.step * mean_excess(edge, s, t) * spread,
            winsorized=moved,
        )

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
