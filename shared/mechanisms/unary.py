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
"""

from __future__ import annotations

import base64
import math
from abc import abstractmethod
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np

from shared.bitcount import bit_sums
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


class UnaryEncoding(CategoricalMechanism):
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
class SymmetricUnaryEncoding(UnaryEncoding):
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
class OptimizedUnaryEncoding(UnaryEncoding):
    name = "oue"
    spec_model = OueSpec

    def nominal_probabilities(self) -> tuple[float, float]:
        """p = 1/2, q = 1 / (e^eps + 1)."""
        return 0.5, 1.0 / (math.exp(self.epsilon) + 1)
