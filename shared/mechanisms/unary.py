"""Unary encoding: symmetric (SUE, basic one-time RAPPOR) and optimized (OUE).

The value v is one-hot encoded as d bits; bit v is reported 1 with probability
p and every other bit with probability q, independently (Wang et al., USENIX
Security 2017, Section 4.2). Two inputs change two bits, so the likelihood
ratio is at most (p (1 - q)) / (q (1 - p)) = e^eps.

Realized probabilities: bit v is drawn with probability T_p / 2^53 and every
other bit with T_q / 2^53. The ratio T_p (2^53 - T_q) / (T_q (2^53 - T_p)) grows
with T_p and shrinks with T_q, so T_p is rounded down and T_q up, and T_q is
stepped further up until the exact ratio is proven at most e^eps
(``shared.randomness.certified_threshold``). ``p`` and ``q`` are the realized
values, which the estimator and ``transition_matrix`` use.

* SUE (Erlingsson et al., CCS 2014): p = e^(eps/2) / (e^(eps/2) + 1),
  q = 1 / (e^(eps/2) + 1); Var[f_v] = e^(eps/2) / (n (e^(eps/2) - 1)^2) at f_v = 0.
* OUE: p = 1/2, q = 1 / (e^eps + 1); Var[f_v] = 4 e^eps / (n (e^eps - 1)^2) at
  f_v = 0, the least over all unary encodings.

A report supports v when its bit v is 1. Reports are packed bit vectors
(``np.packbits`` layout: bit v is bit ``7 - v % 8`` of byte ``v // 8``; padding
bits are 0), payload ``{"bits": base64 of the packed bytes}``. The other d - 1
bits are drawn 64 at a time by ``RandomSource.bernoulli_bits`` (a single report: one
row of ``RandomSource.bernoulli_row``, one random byte per bit). Sufficient
statistics: the per-bit sums (``shared.bitcount.bit_sums``).

Refusal rule ``"<name>.ones_count"`` (``shared.integrity``; Cao, Jia and Gong, USENIX
Security 2021, on why a forged report's count of ones matters). Whatever the input, an
honest report's number of ones is X = Bernoulli(p) + Binomial(d - 1, q) at the realized p
and q. The rule refuses X > U or X < L, with U the least and L the largest count such
that each side's exact probability is at most 2^-41 (a side is dropped when no count
qualifies), so an honest report is refused with probability
P(X > U) + P(X < L) <= 2^-40, the rule's ``false_refusal``. For example ``oue`` at
epsilon 1, d = 1024 (mean 275.6, sd 14.2): U = 380, L = 179, false refusal 8.5e-13;
``sue`` at epsilon 1, d = 1024: U = 499, L = 279, 8.5e-13; at d = 8 no count is that
unlikely and there is no rule.

Profile (``Profiled``, ``sue`` and ``oue``): the histogram of X over the d + 1 counts,
tested against the same law by Pearson's chi-square (``fit``). The law is the same for
every input, so the p-value is uniform under no attack; Cao et al.'s maximal gain attack
sets r target bits and pads to the expected count, which piles forged reports into one
bin and fires the test.

Binomial probabilities are computed without scipy by Loader's saddle-point expansion
(C. Loader, "Fast and Accurate Computation of Binomial Probabilities", 2000): for
0 < x < n,

    P(x) = exp(-(S(x) + S(n - x) - S(n)) - D(x, n r) - D(n - x, n (1 - r)))
           * sqrt(n / (2 pi x (n - x))),

S(m) = ln m! - (m + 1/2) ln m + m - ln sqrt(2 pi) the Stirling error and
D(x, M) = x ln(x / M) + M - x the deviance, each computed without cancellation, which
keeps the relative error below 1e-12 for every n up to 2^20 (near 1e-14 at the mode;
checked exactly up to n = 2^12, and at n = 2^20 against 40-digit arithmetic: 5e-13).
"""

from __future__ import annotations

import base64
import math
from abc import abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np

from shared.bitcount import bit_sums
from shared.integrity import (
    FALSE_REFUSAL_BOUND,
    FitTest,
    Profiled,
    RefusalRule,
    chi_square_fit,
)
from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import (
    BASE64,
    as_index_array,
    check_packed_rows,
    decode_bits_field,
    payload_shape,
)
from shared.mechanisms.categorical import (
    CategoricalMechanism,
    check_true_counts,
    require_enumerable,
)
from shared.mechanisms.registry import register
from shared.mechanisms.spec import CategoricalSpec
from shared.randomness import (
    BITS53,
    Rng,
    as_source,
    certified_threshold,
    realized_probability,
    threshold53,
)
from shared.statistics import CountStatistics

#: A sum of independent binomials: ((trials, probability), ...).
BinomialSum = tuple[tuple[int, float], ...]

#: Each side of a ones-count rule refuses an honest report with probability at most this
#: (half of ``FALSE_REFUSAL_BOUND``), shrunk by 2^-20 to absorb the floating-point error of
#: the computed tail (below 1e-9 relative), so the exact tail is within it too.
_SIDE_BOUND = FALSE_REFUSAL_BOUND / 2 * (1 - 2.0**-20)
#: ln sqrt(2 pi).
_LN_SQRT_2PI = 0.5 * math.log(2 * math.pi)
#: The Stirling error S(m) = ln m! - (m + 1/2) ln m + m - ln sqrt(2 pi) for m = 1..15, where
#: the asymptotic series is not yet accurate (m! is exact in a double up to 15!); S(0) = 0
#: is never used.
_STIRLING_SMALL = np.array(
    [0.0]
    + [
        math.log(math.factorial(m)) - (m + 0.5) * math.log(m) + m - _LN_SQRT_2PI
        for m in range(1, 16)
    ]
)


def _stirling_error(m: np.ndarray) -> np.ndarray:
    """S(m) for integers m >= 1: a table up to 15, beyond it the series
    1/(12 m) - 1/(360 m^3) + 1/(1260 m^5) - 1/(1680 m^7) + 1/(1188 m^9) (next term below
    1e-16 for m > 15), summed by Horner's rule in 1/m^2."""
    m = np.asarray(m, dtype=np.float64)
    small = m <= 15
    big = np.where(small, 16.0, m)
    inverse_square = 1.0 / (big * big)
    series = np.zeros_like(big)
    for coefficient in (1 / 1188, -1 / 1680, 1 / 1260, -1 / 360, 1 / 12):
        series = series * inverse_square + coefficient
    return np.where(small, _STIRLING_SMALL[np.where(small, m, 0).astype(np.int64)], series / big)


def _deviance(x: np.ndarray, mean: float) -> np.ndarray:
    """D(x, M) = x ln(x / M) + M - x for x > 0, M > 0. Near x = M it is summed as
    2 x sum_j v^(2j+1) / (2j + 1) - (x - M) v with v = (x - M)/(x + M), |v| < 0.1, so
    the cancellation of the direct form never happens (twelve terms: v^24 < 1e-24)."""
    x = np.asarray(x, dtype=np.float64)
    difference = x - mean
    total = x + mean
    direct = x * np.log(x / mean) + mean - x
    v = difference / total
    series = difference * v
    power = 2 * x * v
    v2 = v * v
    for j in range(1, 13):
        power = power * v2
        series = series + power / (2 * j + 1)
    return np.where(np.abs(difference) < 0.1 * total, series, direct)


def binomial_pmf(trials: int, probability: float) -> np.ndarray:
    """P(Binomial(trials, probability) = x) for x = 0..trials, by Loader's saddle-point
    expansion (module docstring): relative error below 1e-12, no scipy."""
    if trials < 0 or not 0.0 <= probability <= 1.0:
        raise ValueError(f"no Binomial({trials}, {probability})")
    pmf = np.zeros(trials + 1)
    if probability in (0.0, 1.0) or trials == 0:
        pmf[0 if probability == 0.0 else trials] = 1.0
        return pmf
    complement = 1.0 - probability
    pmf[0] = math.exp(trials * math.log1p(-probability))
    pmf[trials] = math.exp(trials * math.log(probability))
    if trials > 1:
        x = np.arange(1, trials, dtype=np.float64)
        exponent = (
            _stirling_error(np.array(trials))
            - _stirling_error(x)
            - _stirling_error(trials - x)
            - _deviance(x, trials * probability)
            - _deviance(trials - x, trials * complement)
        )
        pmf[1:trials] = np.exp(exponent) * np.sqrt(trials / (2 * math.pi * x * (trials - x)))
    return pmf


def binomial_sum_pmf(terms: BinomialSum) -> np.ndarray:
    """The law of a sum of independent binomials (convolution; meant for terms of which at
    most one is long, as every ones-count law here)."""
    pmf = np.ones(1)
    for trials, probability in terms:
        pmf = np.convolve(pmf, binomial_pmf(trials, probability))
    return pmf


def count_ones(rows: np.ndarray) -> np.ndarray:
    """The number of set bits of each packed row (padding bits are 0), int64."""
    return np.bitwise_count(np.asarray(rows, dtype=np.uint8)).sum(axis=1, dtype=np.int64)


@dataclass(frozen=True)
class OnesCountBounds:
    """Refuse a report with more than ``high`` or fewer than ``low`` of its ``bits`` set.

    ``upper_tail`` = P(X > high) under the stochastically largest honest law of the count
    X, ``lower_tail`` = P(X < low) under the smallest; ``high`` is the least and ``low`` the
    largest count whose tail is within ``_SIDE_BOUND`` (shared when several rules test one
    report; ``high = bits``, ``low = 0``: that side refuses nothing).
    """

    bits: int
    low: int
    high: int
    lower_tail: float
    upper_tail: float

    @classmethod
    def from_laws(
        cls, largest: np.ndarray, smallest: np.ndarray, share: int = 1
    ) -> OnesCountBounds:
        """Bounds from the pmfs (over 0..bits) of the largest and smallest honest laws, each
        side within ``_SIDE_BOUND / share`` (``share`` rules test one report: their union
        stays within 2^-40)."""
        bits = largest.size - 1
        side = _SIDE_BOUND / share
        # above[x] = P(X >= x), summed from the top (small terms first); above[bits + 1] = 0
        above = np.append(np.cumsum(largest[::-1])[::-1], 0.0)
        high = int(np.flatnonzero(above[1:] <= side)[0])
        # below[x] = P(X < x), summed from the bottom; below[0] = 0
        below = np.concatenate([[0.0], np.cumsum(smallest)])
        low = int(np.flatnonzero(below[: bits + 1] <= side)[-1])
        return cls(bits, low, high, float(below[low]), float(above[high + 1]))

    @property
    def refuses(self) -> bool:
        """Whether either side refuses some count."""
        return self.low > 0 or self.high < self.bits

    def describe(self) -> str:
        """The rule in words, e.g. ``"more than 408 or fewer than 2 of the 1024 bits set"``."""
        sides = ([f"more than {self.high}"] if self.high < self.bits else []) + (
            [f"fewer than {self.low}"] if self.low > 0 else []
        )
        return f"{' or '.join(sides)} of the {self.bits} bits set"

    def breaks(self, ones: np.ndarray) -> np.ndarray:
        """Whether each count of ones is refused."""
        return (ones > self.high) | (ones < self.low)


class OnesCountRefusal:
    """Refusal rule ``"<name>.ones_count"`` of a bit-vector mechanism (mixed in before the
    ``Mechanism`` base): a report is refused when its count of ones lies beyond
    ``OnesCountBounds`` of the honest laws ``ones_count_laws`` gives.

    Sound when, for every input and device state, the honest count is stochastically
    between the two laws, and tight when both are attained by some input and state.
    """

    name: ClassVar[str]

    @abstractmethod
    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """(largest, smallest): the honest count laws that are stochastically largest and
        smallest over every input and device state."""

    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The packed bit rows of checked reports (the reports themselves by default)."""
        return reports

    @cached_property
    def ones_count_bounds(self) -> OnesCountBounds:
        largest, smallest = self.ones_count_laws()
        return OnesCountBounds.from_laws(binomial_sum_pmf(largest), binomial_sum_pmf(smallest))

    @cached_property
    def _rules(self) -> tuple[RefusalRule, ...]:
        bounds = self.ones_count_bounds
        if not bounds.refuses:
            return ()
        return (
            RefusalRule(
                f"{self.name}.ones_count",
                bounds.describe(),
                bounds.upper_tail + bounds.lower_tail,
            ),
        )

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """The ones-count rule, or none when no count is that unlikely (small d)."""
        return self._rules

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        """0 (the ones-count rule) for each report whose count of ones is refused, else -1."""
        ones = count_ones(self.report_bit_rows(reports))
        broken = self.ones_count_bounds.breaks(ones) if self._rules else np.zeros(ones.size, bool)
        return np.where(broken, 0, -1).astype(np.int8)

    def refusal_detail(self, report: np.ndarray) -> str:
        """``"412 of the 1024 bits set"``."""
        ones = int(count_ones(self.report_bit_rows(np.asarray(report)[np.newaxis]))[0])
        return f"{ones} of the {self.ones_count_bounds.bits} bits set"


def ones_count_test_of(law: BinomialSum) -> str:
    """``FitTest.test`` of a count of ones with law ``law``: "ones per report against
    Bernoulli(p) + Binomial(m, q)"."""
    terms = [
        f"Bernoulli({p:.6g})" if trials == 1 else f"Binomial({trials}, {p:.6g})"
        for trials, p in law
    ]
    return "ones per report against " + " + ".join(terms)


class OnesCountProfile:
    """The ``Profiled`` ability of a bit-vector mechanism whose count of ones has one law
    for every input and device state (``ones_count_law``): the profile is the histogram of
    the count over 0..bits, tested against that law by Pearson's chi-square. Mixed in
    after the mechanism's class, which gives the abstract methods."""

    provides: ClassVar[tuple[type, ...]] = (Profiled,)

    @abstractmethod
    def ones_count_law(self) -> BinomialSum:
        """The honest law of a report's count of ones (the same for every input and state)."""

    @abstractmethod
    def ones_count_test(self) -> str:
        """The law in words, for ``FitTest.test``."""

    @abstractmethod
    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The packed bit rows of checked reports."""

    @cached_property
    def ones_count_pmf(self) -> np.ndarray:
        """P(X = x), x = 0..bits, for the count X of ones in an honest report."""
        return binomial_sum_pmf(self.ones_count_law())

    @property
    def profile_length(self) -> int:
        """bits + 1 counts: how many reports had 0, 1, ..., bits ones."""
        return int(self.ones_count_pmf.size)

    def profile(self, reports: np.ndarray) -> CountStatistics:
        """The histogram of the count of ones of checked reports."""
        ones = count_ones(self.report_bit_rows(reports))
        return CountStatistics(ones.size, np.bincount(ones, minlength=self.profile_length))

    def fit(self, profile: CountStatistics) -> FitTest | None:
        """Pearson's chi-square of the histogram against the honest law (``chi_square_fit``;
        None below ``MIN_FIT_REPORTS`` reports). Exact-asymptotic: uniform under no attack."""
        if profile.length != self.profile_length:
            raise ValueError(
                f"a profile of {profile.length} counts; this mechanism's has {self.profile_length}"
            )
        return chi_square_fit(profile.counts, self.ones_count_pmf, self.ones_count_test())


class UnaryEncoding(OnesCountRefusal, CategoricalMechanism):
    """Shared body of SUE and OUE; subclasses give the nominal p and q."""

    payload_schema = payload_shape(
        "BitsPayload",
        "sue, oue, lsue, loue, losue: base64 of numpy.packbits bytes of the d bits.",
        bits=BASE64,
    )

    @abstractmethod
    def nominal_probabilities(self) -> tuple[float, float]:
        """The paper's (p, q) for this epsilon, before rounding to 53-bit thresholds."""

    @cached_property
    def thresholds(self) -> tuple[int, int]:
        """(T_p, T_q): T_p rounded down, T_q rounded up and certified, so that the realized
        p (1 - q) / (q (1 - p)) = T_p (2^53 - T_q) / (T_q (2^53 - T_p)) <= e^eps."""
        p, q = self.nominal_probabilities()
        p_threshold = int(threshold53(p, "down"))
        q_threshold = certified_threshold(
            q,
            "up",
            lambda t: Fraction(p_threshold * (BITS53 - t), t * (BITS53 - p_threshold)),
            self.epsilon,
        )
        return p_threshold, q_threshold

    @property
    def p(self) -> float:
        return realized_probability(self.thresholds[0])

    @property
    def q(self) -> float:
        return realized_probability(self.thresholds[1])

    @property
    def row_bytes(self) -> int:
        return (self.domain_size + 7) // 8

    def ones_count_law(self) -> BinomialSum:
        """Bernoulli(p) + Binomial(d - 1, q): bit v and the d - 1 others, whatever v."""
        return (1, self.p), (self.domain_size - 1, self.q)

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """The one law of every input, twice: the rule's tails are exact."""
        return self.ones_count_law(), self.ones_count_law()

    def ones_count_test(self) -> str:
        return ones_count_test_of(self.ones_count_law())

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        source = as_source(rng)
        if values.size == 1:  # one device's report: one random byte per bit, in one buffer
            p_threshold, q_threshold = self.thresholds
            row = source.bernoulli_row(q_threshold, self.domain_size, int(values[0]), p_threshold)
            return row.reshape(1, self.row_bytes)
        p_threshold, q_threshold = self.thresholds
        reports = source.bernoulli_bits(q_threshold, values.size, self.domain_size)
        true_bits = source.bernoulli_below(p_threshold, values.size)
        flat = reports.reshape(-1)
        index = np.arange(0, values.size * self.row_bytes, self.row_bytes) + (values >> 3)
        mask = np.right_shift(0x80, values & 7).astype(np.uint8)
        current = flat[index]
        flat[index] = np.where(true_bits, current | mask, current & ~mask)
        return reports

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        return check_packed_rows(reports, self.domain_size, "big", "unary-encoding report")

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.domain_size)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        reports = self.check_reports(reports)
        return CountStatistics(reports.shape[0], bit_sums(reports, self.domain_size))

    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        return stats.counts

    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Exact: bits are independent given the value, so bit v's sum is
        Bin(N_v, p) + Bin(n - N_v, q) at the realized (53-bit) p and q. O(d)."""
        counts = check_true_counts(counts, self.domain_size, rng)
        n = int(counts.sum())
        sums = rng.binomial(counts, self.p) + rng.binomial(n - counts, self.q)
        return CountStatistics(n, sums)

    def transition_matrix(self) -> np.ndarray:
        d = self.domain_size
        require_enumerable(d * 2**d)
        outputs = (np.arange(2**d)[:, None] >> np.arange(d)[None, :]) & 1  # (2^d, d) bits
        ones = outputs.sum(axis=1)
        matrix = np.empty((d, 2**d))
        for v in range(d):  # d <= 16 here: a loop over inputs of a tiny enumeration
            own = outputs[:, v]
            others_on = ones - own
            matrix[v] = (
                np.where(own == 1, self.p, 1 - self.p)
                * self.q**others_on
                * (1 - self.q) ** (d - 1 - others_on)
            )
        return matrix

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        reports = self.check_reports(reports)
        return [{"bits": base64.b64encode(row.tobytes()).decode("ascii")} for row in reports]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        rows = np.empty((len(payloads), self.row_bytes), dtype=np.uint8)
        for i, payload in enumerate(payloads):
            rows[i] = np.frombuffer(decode_bits_field(payload, i, self.row_bytes), np.uint8)
        return self.check_reports(rows)


class SueSpec(CategoricalSpec):
    """``{"mechanism": "sue", "epsilon": 1.0, "domain_size": 64}``."""

    mechanism: Literal["sue"]


@register
class SymmetricUnaryEncoding(UnaryEncoding, OnesCountProfile):
    name = "sue"
    spec_model = SueSpec

    def nominal_probabilities(self) -> tuple[float, float]:
        """p = e^(eps/2) / (e^(eps/2) + 1), q = 1 / (e^(eps/2) + 1)."""
        half = math.exp(self.epsilon / 2)
        return half / (half + 1), 1.0 / (half + 1)


class OueSpec(CategoricalSpec):
    """``{"mechanism": "oue", "epsilon": 1.0, "domain_size": 64}``."""

    mechanism: Literal["oue"]


@register
class OptimizedUnaryEncoding(UnaryEncoding, OnesCountProfile):
    name = "oue"
    spec_model = OueSpec

    def nominal_probabilities(self) -> tuple[float, float]:
        """p = 1/2, q = 1 / (e^eps + 1)."""
        return 0.5, 1.0 / (math.exp(self.epsilon) + 1)
