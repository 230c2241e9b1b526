"""Generalized (k-ary) randomized response; for d = 2 it is Warner's (1965).

A user with value v reports v with probability p = e^eps / (e^eps + d - 1) and
each other value with probability q = 1 / (e^eps + d - 1). A report supports
exactly the value it names, so (Wang et al., USENIX Security 2017, Section 4.1)

    Var[f_v] = (e^eps + d - 2) / (n (e^eps - 1)^2)    at f_v = 0,

which beats the unary and hashing oracles when d < 3 e^eps + 2.
The ratio of output probabilities for any two inputs is at most p / q = e^eps.

Report: the reported index (int64). Payload: ``{"value": int}``.
Sufficient statistics: the histogram of reported values.
"""

from __future__ import annotations

import math
from functools import cached_property

import numpy as np

from shared.mechanisms.base import IndexReports, as_index_array
from shared.mechanisms.categorical import (
    CategoricalMechanism,
    check_true_counts,
    require_enumerable,
)
from shared.randomness import RandomSource, Rng, as_source, exact_probability, threshold53
from shared.statistics import CountStatistics


def k_ary_response(values: np.ndarray, k: int, p: float, source: RandomSource) -> np.ndarray:
    """Report each value in 0..k-1 as itself with probability p, else another value uniformly.

    Sampled in the equivalent two-step form: keep the value with probability
    lam = (p k - 1) / (k - 1), otherwise report a uniform value of all k (itself
    included), so P(itself) = lam + (1 - lam) / k = p and every other value has
    (1 - p) / (k - 1).
    """
    keep = source.bernoulli((p * k - 1) / (k - 1), values.size)
    return np.where(keep, values, source.integers(k, values.size))


class GeneralizedRandomizedResponse(IndexReports, CategoricalMechanism):
    name = "grr"

    @property
    def p(self) -> float:
        return math.exp(self.epsilon) / (math.exp(self.epsilon) + self.domain_size - 1)

    @property
    def q(self) -> float:
        return 1.0 / (math.exp(self.epsilon) + self.domain_size - 1)

    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        if values.size == 1:  # one device's value: the same two steps on Python ints
            return np.array([self._respond_one(int(values[0]), as_source(rng))], np.int64)
        return k_ary_response(values, self.domain_size, self.p, as_source(rng))

    def _respond_one(self, value: int, source: RandomSource) -> int:
        """``k_ary_response`` for one value, from one 64-bit word W when it suffices: keep
        iff W's top 53 bits are below the keep threshold; otherwise W's low 11 bits, which
        are independent of the top 53 and so still uniform, masked to the next power of two
        of d (when d <= 2^11), are the first draw of ``below``'s rejection sampling."""
        d = self.domain_size
        word = source.word()
        if (word >> 11) < self._keep_threshold:
            return value
        mask = (1 << (d - 1).bit_length()) - 1
        if mask < 1 << 11 and word & mask < d:
            return word & mask
        return source.below(d)

    @cached_property
    def _keep_threshold(self) -> int:
        """``threshold53`` of k_ary_response's keep probability (p d - 1) / (d - 1)."""
        d = self.domain_size
        return int(threshold53((self.p * d - 1) / (d - 1)))

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
        """Exact: in ``k_ary_response``'s two-step form, K_v ~ Bin(N_v, lam) users keep their
        value (lam the keep probability as realized, 53 bits) and the other R = n - sum K_v
        report uniformly over all d: c = K + Multinomial(R, 1/d). O(d) whatever n is."""
        counts = check_true_counts(counts, self.domain_size, rng)
        d = self.domain_size
        keep = exact_probability((self.p * d - 1) / (d - 1))
        kept = rng.binomial(counts, keep)
        uniform = rng.multinomial(int(counts.sum() - kept.sum()), np.full(d, 1.0 / d))
        return CountStatistics(int(counts.sum()), kept + uniform)

    def transition_matrix(self) -> np.ndarray:
        d = self.domain_size
        require_enumerable(d * d)
        matrix = np.full((d, d), self.q)
        np.fill_diagonal(matrix, self.p)
        return matrix
