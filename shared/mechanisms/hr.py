"""Hadamard response (Acharya, Sun, Zhang, "Hadamard Response: Estimating
Distributions Privately, Efficiently, and with Little Communication", AISTATS 2019).

Let K be the smallest power of two > d and H the K x K Sylvester-Hadamard
matrix, H[i, j] = (-1)^popcount(i & j). Value v owns row r = v + 1 (row 0, all
ones, is skipped) and the set S_v = {j : H[r, j] = +1} of K/2 outputs. The user
reports one index y in 0..K-1:

    P(y | v) = 2 e^eps / (K (e^eps + 1))  for y in S_v,   2 / (K (e^eps + 1))  otherwise,

so the likelihood ratio of any two inputs is at most e^eps. A report supports v
when y is in S_v: p = e^eps / (e^eps + 1), and since two distinct rows agree on
exactly K/4 of the positions in S_v, q = 1/2 for every u != v. Hence

    Var[f_v] = (e^eps + 1)^2 / (n (e^eps - 1)^2)   at f_v = 0,

within a factor (e^eps + 1)^2 / (4 e^eps) of OUE, with one log2(K)-bit index
per report instead of d bits.

Realized probabilities: y lands in S_v with probability T / 2^53, so the
realized ratio is T / (2^53 - T), which grows with T: T is rounded down from
e^eps / (e^eps + 1) and stepped down until that exact ratio is proven at most
e^eps (``shared.randomness.certified_threshold``); ``p`` is T / 2^53 and q stays
exactly 1/2.

Sampling: draw y uniformly on 0..K-1; if the parity of popcount(r & y) is not
the one wanted, flip the lowest set bit of r in y. Flipping is a bijection
between S_v and its complement, so y is uniform on the chosen half.

Aggregation: the histogram h of the reports, then one fast Walsh-Hadamard
transform (``shared.hadamard``), since (H h)[r] = #{y in S_v} - #{y not in S_v}; so
C_v = (n + (H h)[v + 1]) / 2. O(n + K log K).

Report: the index y (int64). Payload: ``{"value": int}``.
Sufficient statistics: the length-K histogram of reported indices.

Refusal rules: none (``shared.integrity``). For d >= 3 every index y lies in some S_v (one of
the rows 1, 2, 3 shares an even number of set bits with y), where its probability
is 2 e^eps / (K (e^eps + 1)) >= 1/K >= 2^-21; for d <= 2 (K <= 4) every index has
probability at least 2 / (K (e^eps + 1)) > 2^-31 under every input. So no nonempty set of
indices is below 2^-40 for every input.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np

from shared.hadamard import walsh_hadamard
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
    Rng,
    as_source,
    certified_threshold,
    realized_probability,
)
from shared.statistics import CountStatistics

#: Cells (values x outputs) of one block of ``simulate_statistics``'s multinomials.
_SIMULATION_CELLS = 1 << 22


class HrSpec(CategoricalSpec):
    """``{"mechanism": "hr", "epsilon": 4.0, "domain_size": 4096}``."""

    mechanism: Literal["hr"]


@register
class HadamardResponse(IndexReports, CategoricalMechanism):
    name = "hr"
    spec_model = HrSpec

    def __init__(self, spec: CategoricalSpec) -> None:
        super().__init__(spec)
        self.outputs: int = 1 << self.domain_size.bit_length()  # smallest power of 2 > d

    @cached_property
    def in_set_threshold(self) -> int:
        """T: y lands in S_v with probability T / 2^53, certified T / (2^53 - T) <= e^eps."""
        return certified_threshold(
            1.0 / (1.0 + math.exp(-self.epsilon)),
            "down",
            lambda t: Fraction(t, BITS53 - t),
            self.epsilon,
        )

    @property
    def p(self) -> float:
        """Realized P(y in S_v | v) = T / 2^53, nominally e^eps / (e^eps + 1)."""
        return realized_probability(self.in_set_threshold)

    @property
    def q(self) -> float:
        return 0.5

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        source = as_source(rng)
        rows = values + 1
        in_set = source.bernoulli_below(self.in_set_threshold, values.size)
        y = source.integers(self.outputs, values.size)
        parity_odd = (np.bitwise_count(rows & y) & 1).astype(bool)
        wrong = parity_odd == in_set  # in S_v means even parity
        lowest = rows & -rows
        return np.where(wrong, y ^ lowest, y)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        return as_index_array(reports, self.outputs, "reported index")

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.outputs)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        reports = self.check_reports(reports)
        return CountStatistics(reports.size, np.bincount(reports, minlength=self.outputs))

    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Exact: the report histogram drawn in the mixture form of the output law.

        A report is uniform on S_v with probability lam = 2 p' - 1 (p' the realized
        P(y in S_v)) and uniform on all K outputs otherwise: (1 + lam) / K = 2 p' / K on
        S_v and (1 - lam) / K = 2 (1 - p') / K off it, as ``encode`` draws. So A_v ~
        Bin(N_v, lam) users of value v land uniformly on S_v, the other n - sum A_v
        uniformly on all K. Uniform on S_v is drawn as ``encode`` does: uniform on K,
        then an output of the wrong parity moves to its partner ``y xor lowbit(v + 1)``.
        O(d K) for the per-value multinomials (in blocks of values), whatever n is.
        """
        counts = check_true_counts(counts, self.domain_size, rng)
        n, k = int(counts.sum()), self.outputs
        lam = 2 * self.p - 1
        in_set = rng.binomial(counts, lam)
        histogram = rng.multinomial(n - int(in_set.sum()), np.full(k, 1.0 / k))
        outputs = np.arange(k)
        block = max(1, _SIMULATION_CELLS // k)
        for start in range(0, self.domain_size, block):  # blocks of values, not users
            values = np.arange(start, min(start + block, self.domain_size))
            drawn = rng.multinomial(in_set[values], np.full(k, 1.0 / k))  # (block, K)
            rows = (values + 1)[:, None]
            odd = (np.bitwise_count(rows & outputs[None, :]) & 1).astype(bool)
            target = np.where(odd, outputs[None, :] ^ (rows & -rows), outputs[None, :])
            histogram += np.bincount(target.reshape(-1), drawn.reshape(-1), minlength=k).astype(
                np.int64
            )
        return CountStatistics(n, histogram)

    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        transformed = walsh_hadamard(stats.counts)
        return (stats.n + transformed[1 : self.domain_size + 1]) // 2

    def transition_matrix(self) -> np.ndarray:
        d, k = self.domain_size, self.outputs
        require_enumerable(d * k)
        rows = np.arange(1, d + 1)[:, None]
        in_set = (np.bitwise_count(rows & np.arange(k)[None, :]) & 1) == 0
        return np.where(in_set, 2 * self.p / k, 2 * (1 - self.p) / k)
