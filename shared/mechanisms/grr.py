"""Generalized (k-ary) randomized response; for d = 2 it is Warner's (1965).

A user with value v reports v with probability p = e^eps / (e^eps + d - 1) and
each other value with probability q = 1 / (e^eps + d - 1). A report supports
exactly the value it names, so (Wang et al., USENIX Security 2017, Section 4.1)

    Var[f_v] = (e^eps + d - 2) / (n (e^eps - 1)^2)    at f_v = 0,

which beats the unary and hashing oracles when d < 3 e^eps + 2.
The ratio of output probabilities for any two inputs is at most p / q = e^eps.

Realized probabilities. ``encode`` keeps the value with probability
lam = T / 2^53 (T = ``keep_threshold``) and otherwise reports a uniform value, so
exactly p = lam + (1 - lam) / d and q = (1 - lam) / d, with
p / q = (T (d - 1) + 2^53) / (2^53 - T), which grows with T: T is rounded down from
lam = (e^eps - 1) / (e^eps + d - 1) and stepped down until that exact ratio is
proven at most e^eps (``shared.randomness.certified_threshold``). ``p`` and ``q``
are these realized values, so the estimator, ``transition_matrix`` and the
simulation agree with what ``encode`` draws.

Report: the reported index (int64). Payload: ``{"value": int}``.
Sufficient statistics: the histogram of reported values.

Refusal rules: none (``shared.integrity``). Every output y is the likeliest report of the
input y, with probability p >= 1/d >= 2^-20, so no nonempty set of outputs has probability
below 2^-40 under every input: a forged index is an honest report's likeliest form.
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from fractions import Fraction
from functools import cached_property
from typing import Literal

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import IndexReports, as_index_array
from shared.mechanisms.categorical import (
    CategoricalMechanism,
    check_true_counts,
    require_enumerable,
)
from shared.mechanisms.registry import register
from shared.mechanisms.spec import CategoricalSpec
from shared.randomness import (
    BITS53,
    RandomSource,
    Rng,
    as_source,
    certified_threshold,
    realized_probability,
)
from shared.statistics import CountStatistics


def k_ary_keep_threshold(epsilon: float, k: int) -> int:
    """Threshold T of the keep probability lam = (e^eps - 1) / (e^eps + k - 1), rounded
    down and certified: the realized p / q = (T (k - 1) + 2^53) / (2^53 - T) <= e^eps."""
    grown = math.expm1(epsilon)
    return certified_threshold(
        grown / (grown + k),
        "down",
        lambda t: Fraction(t * (k - 1) + BITS53, BITS53 - t),
        epsilon,
    )


@functools.lru_cache(maxsize=1024)
def k_ary_probabilities(keep_threshold: int, k: int) -> tuple[float, float]:
    """The realized (P(report = value), P(report = each other)) of ``k_ary_response``:
    ((T (k - 1) + 2^53) / (k 2^53), (2^53 - T) / (k 2^53)), correctly rounded (exact
    rationals, so computed once per (T, k))."""
    return (
        float(Fraction(keep_threshold * (k - 1) + BITS53, k * BITS53)),
        float(Fraction(BITS53 - keep_threshold, k * BITS53)),
    )


def k_ary_response(
    values: np.ndarray, k: int, keep_threshold: int, source: RandomSource
) -> np.ndarray:
    """Report each value in 0..k-1 as itself with probability p, else another value uniformly.

    Sampled in the equivalent two-step form: keep the value with probability
    lam = T / 2^53 (``keep_threshold``), otherwise report a uniform value of all k
    (itself included), so P(itself) = lam + (1 - lam) / k and every other value has
    (1 - lam) / k (``k_ary_probabilities``).
    """
    keep = source.bernoulli_below(keep_threshold, values.size)
    return np.where(keep, values, source.integers(k, values.size))


class CountedIndices(IndexReports, CategoricalMechanism):
    """A report that is a category index, the value kept with some probability and
    otherwise uniform over all d (GRR, and LGRR's composite response): the statistics
    are the report counts, each count is its category's support, and the simulation
    fast path draws them exactly. Subclasses give ``keep_fraction``."""

    @property
    @abstractmethod
    def keep_fraction(self) -> float:
        """lam: the probability that a report is the value itself by the keep step."""

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        return as_index_array(reports, self.domain_size, "reported value")

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.domain_size)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        reports = self.check_reports(reports)
        return CountStatistics(reports.size, np.bincount(reports, minlength=self.domain_size))

    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        return stats.counts

    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Exact up to lam's rounding to a double: K_v ~ Bin(N_v, lam) users keep their
        value and the other R = n - sum K_v report uniformly over all d:
        c = K + Multinomial(R, 1/d). O(d) whatever n is."""
        counts = check_true_counts(counts, self.domain_size, rng)
        d = self.domain_size
        kept = rng.binomial(counts, self.keep_fraction)
        uniform = rng.multinomial(int(counts.sum() - kept.sum()), np.full(d, 1.0 / d))
        return CountStatistics(int(counts.sum()), kept + uniform)


class GrrSpec(CategoricalSpec):
    """``{"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}``."""

    mechanism: Literal["grr"]


@register
class GeneralizedRandomizedResponse(CountedIndices):
    name = "grr"
    spec_model = GrrSpec

    @cached_property
    def keep_threshold(self) -> int:
        """T: ``encode`` keeps the value with probability T / 2^53 (``k_ary_keep_threshold``)."""
        return k_ary_keep_threshold(self.epsilon, self.domain_size)

    @property
    def p(self) -> float:
        """Realized P(report v | v), nominally e^eps / (e^eps + d - 1)."""
        return k_ary_probabilities(self.keep_threshold, self.domain_size)[0]

    @property
    def q(self) -> float:
        """Realized P(report v | u), u != v, nominally 1 / (e^eps + d - 1)."""
        return k_ary_probabilities(self.keep_threshold, self.domain_size)[1]

    @property
    def keep_fraction(self) -> float:
        """lam = T / 2^53 as realized (53 bits: exact in a double)."""
        return realized_probability(self.keep_threshold)

    def encode(
        self, values: np.ndarray, rng: Rng = None, context: DeviceContext = FRESH
    ) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        if values.size == 1:  # one device's value: the same two steps on Python ints
            return np.array([self._respond_one(int(values[0]), as_source(rng))], np.int64)
        return k_ary_response(values, self.domain_size, self.keep_threshold, as_source(rng))

    def _respond_one(self, value: int, source: RandomSource) -> int:
        """``k_ary_response`` for one value, from one 64-bit word W when it suffices: keep
        iff W's top 53 bits are below the keep threshold; otherwise W's low 11 bits, which
        are independent of the top 53 and so still uniform, masked to the next power of two
        of d (when d <= 2^11), are the first draw of ``below``'s rejection sampling."""
        d = self.domain_size
        word = source.word()
        if (word >> 11) < self.keep_threshold:
            return value
        mask = (1 << (d - 1).bit_length()) - 1
        if mask < 1 << 11 and word & mask < d:
            return word & mask
        return source.below(d)

    def transition_matrix(self) -> np.ndarray:
        d = self.domain_size
        require_enumerable(d * d)
        matrix = np.full((d, d), self.q)
        np.fill_diagonal(matrix, self.p)
        return matrix
