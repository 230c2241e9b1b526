"""Optimized local hashing (OLH; Wang et al., USENIX Security 2017, Section 4.4).

Each user draws a hash function H from a universal family mapping the domain
into g = round(e^eps) + 1 buckets, and reports (H, y), where y is H(v) perturbed
by randomized response over the g buckets:

    P(y = H(v)) = p = e^eps / (e^eps + g - 1),  P(y = b) = (1 - p) / (g - 1) otherwise.

For a fixed H the likelihood ratio of any two inputs is at most e^eps, so the
report is eps-LDP whatever H is (H is independent of the value).

Hash family. H_{a,b}(v) = ((a v + b) mod P) mod g with P the smallest prime
>= d, a uniform on 1..P-1 and b on 0..P-1 (Carter and Wegman 1979). For u != v
the pair ((a u + b) mod P, (a v + b) mod P) is uniform over ordered pairs of
distinct residues, so the collision probability is the same for every pair:

    c = sum_r m_r (m_r - 1) / (P (P - 1)),  m_r = #{x in [0, P): x mod g = r},

which is not exactly 1/g (the "mod P mod g" bias). The estimator uses the exact

    q = P(y = H(u) ... supports v | u != v) = c p + (1 - c) (1 - p) / (g - 1),

so it is unbiased at every d; the frequency-oracle variance formula then holds
with this p and q.

Aggregation without testing every item: a report (a, b, y) supports exactly
the v = a^-1 (t - b) mod P with t = y (mod g), t < P, keeping v < d. As t steps
by g, v steps by s = a^-1 g mod P, so the supported items form an arithmetic
progression modulo P; the aggregate walks all reports in lockstep along their
progressions, one ``np.bincount`` per step: O(n P / g) integer work, in chunks
of reports so memory is bounded whatever n is.

Report: int64 rows (a, b, y). Payload: ``{"a": int, "b": int, "value": int}``.
Sufficient statistics: the support counts C_v.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared.mechanisms.base import as_index_array, check_integer_field
from shared.mechanisms.categorical import CategoricalMechanism, require_enumerable
from shared.mechanisms.grr import k_ary_response
from shared.randomness import Rng, as_source
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

#: Reports walked at once in ``aggregate``.
_AGGREGATE_CHUNK = 1 << 18


def smallest_prime_at_least(n: int) -> int:
    """The smallest prime >= max(n, 2), by trial division (n <= 2^20 here)."""
    candidate = max(n, 2)
    while any(candidate % k == 0 for k in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


class OptimizedLocalHashing(CategoricalMechanism):
    name = "olh"

    def __init__(self, spec: MechanismSpec) -> None:
        super().__init__(spec)
        self.buckets: int = round(math.exp(self.epsilon)) + 1
        self.prime: int = smallest_prime_at_least(self.domain_size)
        g, prime = self.buckets, self.prime
        per_bucket = np.bincount(np.arange(prime) % g, minlength=g).astype(np.float64)
        self.collision: float = float((per_bucket * (per_bucket - 1)).sum() / (prime * (prime - 1)))

    @property
    def p(self) -> float:
        e = math.exp(self.epsilon)
        return e / (e + self.buckets - 1)

    @property
    def q(self) -> float:
        c, p = self.collision, self.p
        return c * p + (1 - c) * (1 - p) / (self.buckets - 1)

    def hash(self, a: np.ndarray, b: np.ndarray, values: np.ndarray) -> np.ndarray:
        """H_{a,b}(v) = ((a v + b) mod P) mod g (Python ints where products could overflow)."""
        return ((a * values + b) % self.prime) % self.buckets

    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        source = as_source(rng)
        a = 1 + source.integers(self.prime - 1, values.size)
        b = source.integers(self.prime, values.size)
        hashed = self.hash(a, b, values)
        y = k_ary_response(hashed, self.buckets, self.p, source)
        return np.stack([a, b, y], axis=1)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.ndim != 2 or array.shape[1] != 3 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"OLH reports must be integer rows (a, b, y), got shape {array.shape}")
        array = array.astype(np.int64)
        bounds = np.array([[1, 0, 0], [self.prime - 1, self.prime - 1, self.buckets - 1]])
        bad_rows = np.flatnonzero(((array < bounds[0]) | (array > bounds[1])).any(axis=1))
        if bad_rows.size:
            row = bad_rows[0]
            field = int(np.flatnonzero((array[row] < bounds[0]) | (array[row] > bounds[1]))[0])
            raise ValueError(
                f"report {row}: {('a', 'b', 'value')[field]} = {array[row, field]} is outside "
                f"{bounds[0, field]}..{bounds[1, field]}"
            )
        return array

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.domain_size)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        reports = self.check_reports(reports)
        prime, g = self.prime, self.buckets
        support = np.zeros(prime, dtype=np.int64)
        for start in range(0, reports.shape[0], _AGGREGATE_CHUNK):
            a, b, y = reports[start : start + _AGGREGATE_CHUNK].T
            inverse = _inverse_mod(a, prime)
            position = inverse * ((y - b) % prime) % prime  # v for t = y
            step = inverse * (g % prime) % prime  # v advances by this when t advances by g
            terms = np.where(y < prime, (prime - 1 - y) // g + 1, 0)  # t = y, y+g, ... < P
            for k in range(int(terms.max(initial=0))):
                live = position if k < terms.min() else position[terms > k]
                support += np.bincount(live, minlength=prime)
                position += step
                position -= prime * (position >= prime)
        return CountStatistics(reports.shape[0], support[: self.domain_size])

    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        return stats.counts

    def transition_matrix(self) -> np.ndarray:
        """P[(a, b, y) | v] over every hash function and bucket: (1/((P-1)P)) P[y | H_{a,b}(v)]."""
        d, prime, g = self.domain_size, self.prime, self.buckets
        require_enumerable(d * (prime - 1) * prime * g)
        a, b, y = (
            axis.ravel()
            for axis in np.meshgrid(
                np.arange(1, prime), np.arange(prime), np.arange(g), indexing="ij"
            )
        )
        hashed = self.hash(a[None, :], b[None, :], np.arange(d)[:, None])
        bucket_probability = np.where(hashed == y[None, :], self.p, (1 - self.p) / (g - 1))
        return bucket_probability / ((prime - 1) * prime)

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [
            {"a": int(a), "b": int(b), "value": int(y)} for a, b, y in self.check_reports(reports)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        columns = [check_integer_field(payloads, field) for field in ("a", "b", "value")]
        return self.check_reports(np.stack(columns, axis=1).reshape(len(payloads), 3))


def _inverse_mod(a: np.ndarray, prime: int) -> np.ndarray:
    """a^-1 mod prime for every a in 1..prime-1: a^(prime-2) by square-and-multiply."""
    result = np.ones_like(a)
    base = a % prime
    exponent = prime - 2
    while exponent:
        if exponent & 1:
            result = result * base % prime
        base = base * base % prime
        exponent >>= 1
    return result
