"""Optimized local hashing (OLH; Wang et al., USENIX Security 2017, Section 4.4).

Each user draws a hash function H from a universal family mapping the domain
into g = round(e^eps) + 1 buckets, and reports (H, y), where y is H(v) perturbed
by randomized response over the g buckets:

    P(y = H(v)) = p = e^eps / (e^eps + g - 1),  P(y = b) = (1 - p) / (g - 1) otherwise.

For a fixed H the likelihood ratio of any two inputs is at most e^eps, so the
report is eps-LDP whatever H is (H is independent of the value). The bucket
response is GRR's over g buckets (``shared.mechanisms.grr.k_ary_response``), with
its certified keep threshold: ``p`` and ``(1 - p) / (g - 1)`` are the realized
probabilities, whose ratio is proven at most e^eps.

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
by g, v steps by s = a^-1 g mod P, so the supported items of report i form the
arithmetic progression v_ik = (v_i0 + k s_i) mod P, k < T_i = #{t < P : t = y_i
(mod g)} <= ceil(P / g). The aggregate writes these items for a chunk of reports
into a block of K consecutive k (all reports at once), filled by doubling
(v_i,k+L = v_ik + (L s_i mod P), less P if that reaches P: additions and a sign
mask, no division), and counts each block with one ``np.bincount`` of length P.
K is chosen per chunk so that a block holds about max(P, 2^16) items: a few
reports get all their items in one block, many reports a few k per block. The
work is O(n P / g + P) for any n, and the memory O(max(P, 2^16)) beside the
reports. When the reports' items are few (8 n ceil(P / g) < d) no length-P
vector is built: the items are sorted and counted (``np.unique``) into sparse
statistics, O(n P / g log(n P / g)) (one report at d = 2^20, epsilon 4: 18,725
items). For small domains it is cheaper to histogram the reports by (a, b, y)
and test each of the (P - 1) P hash functions once: O(n + P^2 d). Every path
gives the exact counts C_v = #{i : H_{a_i, b_i}(v) = y_i}.

Report: int64 rows (a, b, y). Payload: ``{"a": int, "b": int, "value": int}``.
Sufficient statistics: the support counts C_v.

Refusal rules: none (``shared.integrity``). (a, b) is uniform whatever the input, and given
(a, b) every bucket has probability at least 1 / (e^eps + g - 1) > 2^-31 under every input
(g - 1 <= e^eps + 1/2), so the only sets below 2^-40 for every input are sets of a few
particular hash functions. They say nothing about forgery: the reports a forger wants (a
hash that sends its targets to one bucket, Cao et al. 2021) are as likely as any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cached_property
from typing import Any, Literal

import numpy as np

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import (
    INTEGER,
    as_index_array,
    check_integer_field,
    check_integer_rows,
    payload_shape,
)
from shared.mechanisms.categorical import (
    CategoricalMechanism,
    check_true_counts,
    require_enumerable,
)
from shared.mechanisms.grr import k_ary_keep_threshold, k_ary_probabilities, k_ary_response
from shared.mechanisms.registry import register
from shared.mechanisms.spec import CategoricalSpec
from shared.randomness import Rng, as_source
from shared.statistics import CountStatistics

#: Reports walked at once in ``aggregate``.
_AGGREGATE_CHUNK = 1 << 16
#: Supported items written per block in ``aggregate`` (at least P, see the module docstring).
_BLOCK_ITEMS = 1 << 16
#: Largest (P - 1) P d table of hash values built for small domains.
_MAX_HASH_TABLE = 1 << 22


def smallest_prime_at_least(n: int) -> int:
    """The smallest prime >= max(n, 2), by trial division (n <= 2^20 here)."""
    candidate = max(n, 2)
    while any(candidate % k == 0 for k in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


class OlhSpec(CategoricalSpec):
    """``{"mechanism": "olh", "epsilon": 2.0, "domain_size": 1024}``."""

    mechanism: Literal["olh"]


@register
class OptimizedLocalHashing(CategoricalMechanism):
    name = "olh"
    spec_model = OlhSpec
    payload_schema = payload_shape(
        "HashPayload",
        "olh: the hash function's a and b, and the reported bucket.",
        a=INTEGER,
        b=INTEGER,
        value=INTEGER,
    )

    def __init__(self, spec: CategoricalSpec) -> None:
        super().__init__(spec)
        self.buckets: int = round(math.exp(self.epsilon)) + 1
        self.prime: int = smallest_prime_at_least(self.domain_size)
        # m_r = #{x < P : x mod g = r} is P // g + 1 for the P mod g first residues, else P // g.
        g, prime = self.buckets, self.prime
        whole, extra = divmod(prime, g)
        pairs = extra * (whole + 1) * whole + (g - extra) * whole * (whole - 1)
        self.collision: float = pairs / (prime * (prime - 1))

    @cached_property
    def keep_threshold(self) -> int:
        """T: the bucket response keeps H(v) with probability T / 2^53 (certified)."""
        return k_ary_keep_threshold(self.epsilon, self.buckets)

    @property
    def bucket_probabilities(self) -> tuple[float, float]:
        """Realized (P(y = H(v)), P(y = each other bucket)), nominally
        (e^eps / (e^eps + g - 1), 1 / (e^eps + g - 1))."""
        return k_ary_probabilities(self.keep_threshold, self.buckets)

    @property
    def p(self) -> float:
        return self.bucket_probabilities[0]

    @property
    def q(self) -> float:
        """c p + (1 - c) P(y = another bucket), c the family's collision probability."""
        p, other = self.bucket_probabilities
        return self.collision * p + (1 - self.collision) * other

    def hash(self, a: np.ndarray, b: np.ndarray, values: np.ndarray) -> np.ndarray:
        """H_{a,b}(v) = ((a v + b) mod P) mod g (Python ints where products could overflow)."""
        return ((a * values + b) % self.prime) % self.buckets

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        source = as_source(rng)
        a = 1 + source.integers(self.prime - 1, values.size)
        b = source.integers(self.prime, values.size)
        hashed = self.hash(a, b, values)
        y = k_ary_response(hashed, self.buckets, self.keep_threshold, source)
        return np.stack([a, b, y], axis=1)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        top = self.prime - 1
        return check_integer_rows(
            reports, "OLH", ("a", "b", "value"), [1, 0, 0], [top, top, self.buckets - 1]
        )

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.domain_size)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        reports = self.check_reports(reports)
        n, prime, d = reports.shape[0], self.prime, self.domain_size
        hash_table_size = (prime - 1) * prime * d
        items = n * -(-prime // self.buckets)  # at most ceil(P / g) supported items per report
        if hash_table_size <= _MAX_HASH_TABLE and hash_table_size < items:
            return CountStatistics(n, self._support_by_hash_table(reports))
        if 8 * items < d:
            return self._sparse_support(reports)
        return CountStatistics(n, self._support_by_progressions(reports))

    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Each support count's distribution exactly, their joint approximately.

        One user supports v with probability p (its own value, the realized
        P(y = H(v))) or q = c p + (1 - c)(1 - p) / (g - 1) (another value, c the
        family's collision probability), independently of other users, so
        C_v ~ Bin(N_v, p) + Bin(n - N_v, q) exactly. Across items the counts are drawn
        independently, while in the mechanism two items' supports from one report are
        slightly correlated (through the shared hash): per-item errors, variances and
        intervals are exact, statistics over several items (e.g. top-k) approximate.
        """
        counts = check_true_counts(counts, self.domain_size, rng)
        n = int(counts.sum())
        return CountStatistics(n, rng.binomial(counts, self.p) + rng.binomial(n - counts, self.q))

    def _support_by_hash_table(self, reports: np.ndarray) -> np.ndarray:
        """Small domains: histogram the reports by (a, b, y), then test every hash once.

        C_v = sum over hash functions (a, b) of #reports (a, b, H_{a,b}(v)):
        O(n + (P - 1) P d), cheaper than walking progressions when P^2 d << n P / g.
        """
        prime, g, d = self.prime, self.buckets, self.domain_size
        a, b, y = reports.T
        histogram = np.bincount(((a - 1) * prime + b) * g + y, minlength=(prime - 1) * prime * g)
        a_all, b_all = np.divmod(np.arange((prime - 1) * prime), prime)
        hashed = self.hash(a_all[:, None] + 1, b_all[:, None], np.arange(d)[None, :])
        per_hash = histogram.reshape(-1, g)
        return per_hash[np.arange(per_hash.shape[0])[:, None], hashed].sum(axis=0)

    def _support_by_progressions(self, reports: np.ndarray) -> np.ndarray:
        """Many reports: each block of supported items counted by one ``np.bincount``."""
        support = np.zeros(self.domain_size, dtype=np.int64)
        for items in self._supported_items(reports):
            support += np.bincount(items.ravel(), minlength=self.prime + 1)[: self.domain_size]
        return support

    def _sparse_support(self, reports: np.ndarray) -> CountStatistics:
        """Few reports: the distinct supported items and their counts, O(n T log(n T))."""
        d = self.domain_size
        blocks = (block[block < d] for block in self._supported_items(reports))
        items = np.concatenate([np.zeros(0, dtype=np.int64), *blocks])
        indices, counts = np.unique(items, return_counts=True)
        return CountStatistics.sparse(reports.shape[0], d, indices, counts)

    def _supported_items(self, reports: np.ndarray) -> Iterator[np.ndarray]:
        """Blocks (K, n_c) of v_ik = (v_i0 + k s_i) mod P for K consecutive k, per chunk of n_c
        reports; P where k >= T_i (past report i's progression). Each block is overwritten by
        the next: use it before advancing.

        K = max(1, max(P, ``_BLOCK_ITEMS``) // n_c), so a block holds at least P items (but
        for a chunk's last) and counting it densely costs O(K n_c + P) = O(K n_c).
        """
        prime, g = self.prime, self.buckets
        for start in range(0, reports.shape[0], _AGGREGATE_CHUNK):
            a, b, y = reports[start : start + _AGGREGATE_CHUNK].T
            inverse = inverse_mod(a, prime)
            terms = np.where(y < prime, (prime - 1 - y) // g + 1, 0)  # t = y, y+g, ... < P
            total_steps, least_steps = int(terms.max()), int(terms.min())
            width = max(1, min(total_steps, max(prime, _BLOCK_ITEMS) // a.size))
            # Jumps L s mod P - P for L = 1, 2, 4, ... < K: adding one to a residue in
            # [0, P) gives [-P, P), and adding P where the sign bit is set brings it back.
            jumps = [inverse * (g % prime) % prime - prime]
            while 1 << len(jumps) < width:
                doubled = jumps[-1] + prime + jumps[-1]  # 2 (L s mod P) - P
                doubled += prime & (doubled >> 63)
                jumps.append(doubled - prime)
            block = np.empty((width, a.size), dtype=np.int64)
            block[0] = inverse * ((y - b) % prime) % prime  # v_i0, for t = y
            for first in range(0, total_steps, width):
                filled = 1
                for jump in jumps:  # rows [L, 2 L) from rows [0, L), L = 1, 2, 4, ...
                    rows = block[filled : 2 * filled]
                    np.add(block[: rows.shape[0]], jump, out=rows)
                    rows += prime & (rows >> 63)
                    filled += rows.shape[0]
                steps = min(width, total_steps - first)
                items = block[:steps]
                if first + steps > least_steps:
                    items = items.copy()
                    items[np.arange(first, first + steps)[:, None] >= terms] = prime
                yield items
                if first + width < total_steps:  # the next block starts at k = first + K
                    np.add(block[width - 1], jumps[0], out=block[0])
                    block[0] += prime & (block[0] >> 63)

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
        own, other = self.bucket_probabilities
        bucket_probability = np.where(hashed == y[None, :], own, other)
        return bucket_probability / ((prime - 1) * prime)

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [
            {"a": int(a), "b": int(b), "value": int(y)} for a, b, y in self.check_reports(reports)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        columns = [check_integer_field(payloads, field) for field in ("a", "b", "value")]
        return self.check_reports(np.stack(columns, axis=1).reshape(len(payloads), 3))


def inverse_mod(a: np.ndarray, prime: int) -> np.ndarray:
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
