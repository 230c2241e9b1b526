"""dBitFlip: Microsoft's memoized histogram (Ding, Kulkarni, Yekhanin, "Collecting
Telemetry Data Privately", NeurIPS 2017, Section 2 (dBitFlip) and Section 3 (memoization)).

Mechanism. Values are buckets 0..d-1. Each device samples ``s = bits_per_device``
distinct buckets S = {j_1 < .. < j_s} uniformly without replacement, once, and reports,
for each sampled bucket j, one bit

    b_j = 1 with probability p if v = j,  with probability q = 1 - p if v != j,
    p = e^a / (e^a + 1),  a = eps / min(2, s).

Ding et al. give every bit a = eps / 2 whatever s. With s = 1 only one reported bit can
depend on v, so eps / 2 would deliver only eps / 2; here that bit takes the whole eps
(the paper's 1-bit mechanism at budget 2 eps), so the claimed epsilon is also the one
delivered. For s >= 2 the mechanism is the paper's.

Privacy of one report (S, b):

    P(S, b | v) = C(d, s)^-1 prod_{j in S} pi_j(b_j),  pi_j(1) = p if v = j else q,
                                                       pi_j(0) = 1 - pi_j(1).

For two values v != v' the factors differ only at the sampled buckets among {v, v'}: at
most min(2, s) of them, each by a ratio at most max(p / q, (1 - q) / (1 - p)) = p / q =
e^a (p + q = 1). So the likelihood ratio is at most e^(a min(2, s)) = e^eps, and it is
reached: S holding v (and v' when s >= 2) with b_v = 1 (and b_v' = 0).

Memoization (Section 3). The sample is drawn once per (device, metric version) and the
bit of sampled bucket j once per (device, metric version, j, [v = j]): every report of
one device is the same deterministic function of its memo and of which sampled bucket,
if any, holds v. There is no instantaneous randomness, so one report reveals what the
permanent response does: ``epsilon_report = epsilon`` (the spec fills it in), and
``permanent_matrix()`` is ``transition_matrix()``. Any number of reports of one value are
one permanent response (eps for life). ``memo_keys`` is the value: the ledger charges eps
per distinct value, which over-counts for values outside the sample (they share one
response), never under-counts. What memoization does not hide: a change from v to v'
switches the report to other memoized bits exactly when v or v' is sampled.

Memo draws (``shared.memo``), exactly, so that any client can reproduce them:

* purpose ``b"dbitflip buckets"``, key 0: for i = 0..s-1, r_i is uniform on
  {0, .., d-i-1}: the next word w of the stream, masked to its low bits below the next
  power of two, ``w & (2^bitlen(d-i-1) - 1)``, rejected (and the next word read) while
  >= d - i (``MemoDraws.integers``; a word is read even when d - i = 1). Then a partial
  Fisher-Yates shuffle of A = (0, 1, .., d-1): for i = 0..s-1 swap A[i] and A[i + r_i].
  The sample is A[0..s-1], sorted.
* purpose ``b"dbitflip bits"``, key 2 j + [v = j] for each sampled bucket j: word 0 of
  that stream, w; b_j = 1 iff (w >> 11) < T_p if v = j, < T_q if v != j.

Realized probabilities: q = T_q / 2^53 with T_q rounded up from 1 / (e^a + 1) and
stepped up until the exact ((2^53 - T_q) / T_q)^min(2, s) is proven at most e^eps
(``shared.randomness.certified_threshold``); T_p = 2^53 - T_q, so p = 1 - q exactly and
the realized report is eps-LDP by the proof above. ``transition_matrix``, the estimator
and the simulation use these realized p and q.

Estimator (the paper's, unbiased). With n reports, S_j the number that sampled bucket j
and C_j the number that sampled it with bit 1,

    f^_j = (d / (n s)) (C_j - q S_j) / (p - q)
         = (d / (n s)) sum over devices that sampled j of (b_j - q) / (p - q),

which for the nominal p is the paper's (b_j (e^a + 1) - 1) / (e^a - 1). A device samples
j with probability r = s / d, independently of the others, so E[C_j - q S_j] = r N_j
(p - q) and f^_j is unbiased for the frequency f_j = N_j / n of the n devices. Its exact
variance (devices independent; the term of one device has mean r [v = j] and second
moment r (q (1 - q) / (p - q)^2 + [v = j] (1 - 2 q) / (p - q))) is

    Var[f^_j] = (d / (n s)) q (1 - q) / (p - q)^2 + f_j ((d / s) (1 - 2 q) / (p - q) - 1) / n
              = (d / (n s)) e^a / (e^a - 1)^2 + f_j (d / s - 1) / n     (p + q = 1).

``variance(n)`` is the first term (f = 0); ``Estimate.std`` the whole formula at the
estimate clipped to [0, 1]. At s = d this is SUE's (basic one-time RAPPOR).

``p`` and ``q`` (the frequency-oracle interface): P(a report supports v | value v) and
(| value u != v), where a report supports v when it sampled v with bit 1: (s / d) p and
(s / d) q; ``support_counts`` are the C_j. The generic (C_j / n - q') / (p' - q') with
these is unbiased too but replaces S_j by its mean n s / d and has the larger variance;
``estimate`` uses S_j.

Refusal rule ``"dbitflip.ones_count"`` (``shared.integrity``). A device's s bits are
independent, 1 with probability p at v's bucket (if sampled) and q elsewhere, so its count
of ones is Bernoulli(p) + Binomial(s - 1, q) when v is sampled and Binomial(s, q) when not
(s < d): stochastically between the two, both attained. The rule refuses more than U ones
(U least with the first law's P(count > U) <= 2^-41) or fewer than L (L largest with the
second's P(count < L) <= 2^-41); ``false_refusal`` is their sum, a device's chance over its
memoized draws (memoized: a device so refused stays refused for that value). E.g. epsilon
1, d = 1024, s = 64: U = 52, L = 1, false refusal 3.2e-13; at s <= 8 there is no rule.
No profile: a device sends one memoized report again and again, so a window's reports are
not independent draws.

Reports: a structured array, one row per report, fields ``buckets`` (s little-endian
uint32, strictly increasing) and ``bits`` (s booleans, bit c of bucket ``buckets[c]``).
Payload ``{"buckets": base64 of the s little-endian uint32 buckets, "bits": base64 of
numpy.packbits (big bit order, padding bits 0) of the s bits in the same order}``.
Sufficient statistics: ``CountStatistics`` of length 2 d, (S_0..S_{d-1}, C_0..C_{d-1}).
"""

from __future__ import annotations

import base64
import itertools
import math
from collections.abc import Sequence
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from shared.estimates import Estimate
from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import (
    BASE64,
    as_index_array,
    check_packed_rows,
    decode_base64_field,
    decode_bits_field,
    payload_shape,
)
from shared.mechanisms.categorical import (
    CategoricalMechanism,
    check_true_counts,
    require_enumerable,
    row_estimates,
)
from shared.mechanisms.memoized import MemoizedMechanism, MemoizedSpec
from shared.mechanisms.registry import register
from shared.mechanisms.spec import MAX_DOMAIN_SIZE, CategoricalSpec, fill_in
from shared.mechanisms.unary import BinomialSum, OnesCountRefusal
from shared.memo import Memo
from shared.randomness import BITS53, Rng, certified_threshold, realized_probability
from shared.statistics import CountStatistics

#: Memo purposes (module docstring): the per-device bucket sample and the per-bucket bits.
BUCKETS_PURPOSE = b"dbitflip buckets"
BITS_PURPOSE = b"dbitflip bits"
#: Largest permutation block (rows times d positions) the dense shuffle holds at once.
DENSE_BLOCK_POSITIONS = 1 << 22


def bit_threshold(epsilon: float, bits_per_device: int) -> int:
    """T_q: ``q = T_q / 2^53`` rounded up from 1 / (e^a + 1), a = eps / min(2, s), and
    certified: the realized report ratio ((2^53 - T_q) / T_q)^min(2, s) <= e^eps."""
    changed = min(2, bits_per_device)
    return certified_threshold(
        1.0 / (math.exp(epsilon / changed) + 1.0),
        "up",
        lambda t: Fraction(BITS53 - t, t) ** changed,
        epsilon,
    )


def shuffle_prefix(offsets: np.ndarray, domain_size: int) -> np.ndarray:
    """A[0..s-1] of the partial Fisher-Yates shuffle of A = (0..d-1) that swaps A[i] and
    A[i + offsets[:, i]] for i = 0..s-1, per row of the (n, s) ``offsets``.

    Two evaluations of the same shuffle, by cost: when s^2 <= d, only the moved positions
    are tracked (O(n s^2) time, O(n s) memory); otherwise the rows' permutations are held
    in blocks of at most ``DENSE_BLOCK_POSITIONS`` positions (O(n d) time)."""
    count = offsets.shape[1]
    if count * count <= domain_size:
        return _shuffle_moves(offsets)
    return _shuffle_dense(offsets, domain_size)


def _shuffle_moves(offsets: np.ndarray) -> np.ndarray:
    """``shuffle_prefix`` from the moves alone: step i takes the value at k_i = i + r_i and
    moves the value at i there; a position holds the value of its last move, or itself."""
    rows, count = offsets.shape
    targets = np.empty((rows, count), dtype=np.int64)
    moved = np.empty((rows, count), dtype=np.int64)
    out = np.empty((rows, count), dtype=np.int64)
    for i in range(count):
        k = i + offsets[:, i]
        taken, held = k, np.full(rows, i, dtype=np.int64)  # the values at k and at i
        for j in range(i):  # replay the earlier moves, later ones overriding
            taken = np.where(targets[:, j] == k, moved[:, j], taken)
            held = np.where(targets[:, j] == i, moved[:, j], held)
        out[:, i], moved[:, i], targets[:, i] = taken, held, k
    return out


def _shuffle_dense(offsets: np.ndarray, domain_size: int) -> np.ndarray:
    """``shuffle_prefix`` on explicit permutations, a block of rows at a time."""
    rows, count = offsets.shape
    out = np.empty((rows, count), dtype=np.int64)
    block = max(1, DENSE_BLOCK_POSITIONS // domain_size)
    for start in range(0, rows, block):
        part = offsets[start : start + block]
        perm = np.tile(np.arange(domain_size, dtype=np.int64), (part.shape[0], 1))
        every = np.arange(part.shape[0])
        for i in range(count):
            k = i + part[:, i]
            chosen = perm[every, k]
            perm[every, k] = perm[:, i]
            out[start : start + part.shape[0], i] = chosen
    return out


class DBitFlipSpec(MemoizedSpec, CategoricalSpec):
    """``{"mechanism": "dbitflip", "epsilon": 1.0, "domain_size": 1024, "bits_per_device": 4}``:
    ``bits_per_device`` (default 1) is filled in, and ``epsilon_report`` = ``epsilon``
    (every report is the memoized response itself)."""

    mechanism: Literal["dbitflip"]
    bits_per_device: int | None = Field(
        default=None,
        ge=1,
        le=MAX_DOMAIN_SIZE,
        description="dbitflip: buckets each device samples once and reports (default 1).",
    )

    @model_validator(mode="after")
    def _derived_fields(self) -> DBitFlipSpec:
        if self.bits_per_device is None:
            fill_in(self, "bits_per_device", 1)
        elif self.bits_per_device > self.domain_size:
            raise ValueError(
                f"bits_per_device = {self.bits_per_device} exceeds domain_size = "
                f"{self.domain_size}: a device samples at most every bucket once"
            )
        self.check_derived_report_epsilon(self.epsilon)
        return self


@register
class DBitFlip(OnesCountRefusal, MemoizedMechanism, CategoricalMechanism):
    """Ding et al.'s dBitFlip with memoized buckets and bits (see the module docstring)."""

    name = "dbitflip"
    spec_model = DBitFlipSpec
    spec: DBitFlipSpec
    payload_schema = payload_shape(
        "BucketBitsPayload",
        "dbitflip: base64 of the sampled buckets as little-endian uint32, and base64 of "
        "numpy.packbits bytes, one bit per bucket.",
        buckets=BASE64,
        bits=BASE64,
    )

    def __init__(self, spec: DBitFlipSpec) -> None:
        super().__init__(spec)
        assert spec.bits_per_device is not None  # filled in by DBitFlipSpec
        self.bits_per_device: int = spec.bits_per_device

    @cached_property
    def thresholds(self) -> tuple[int, int]:
        """(T_p, T_q): a sampled bit is 1 with probability T_p / 2^53 in v's bucket and
        T_q / 2^53 elsewhere; T_q from ``bit_threshold``, T_p = 2^53 - T_q."""
        q_threshold = bit_threshold(self.epsilon, self.bits_per_device)
        return BITS53 - q_threshold, q_threshold

    @property
    def bit_p(self) -> float:
        """Realized P(b_j = 1 | v = j), nominally e^a / (e^a + 1)."""
        return realized_probability(self.thresholds[0])

    @property
    def bit_q(self) -> float:
        """Realized P(b_j = 1 | v != j) = 1 - ``bit_p``, nominally 1 / (e^a + 1)."""
        return realized_probability(self.thresholds[1])

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """Bernoulli(p) + Binomial(s - 1, q) (v sampled) and Binomial(s, q) (v not sampled,
        possible when s < d), at the realized bit probabilities (module docstring)."""
        s, p, q = self.bits_per_device, self.bit_p, self.bit_q
        sampled: BinomialSum = ((1, p), (s - 1, q))
        return sampled, (((s, q),) if s < self.domain_size else sampled)

    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The reports' s bits (booleans: counting ones counts the true ones)."""
        return reports["bits"]

    @property
    def sampling_rate(self) -> float:
        """s / d: the probability that a device samples a given bucket."""
        return self.bits_per_device / self.domain_size

    @property
    def p(self) -> float:
        """P(report samples v with bit 1 | value v) = (s / d) ``bit_p``."""
        return self.sampling_rate * self.bit_p

    @property
    def q(self) -> float:
        """P(report samples v with bit 1 | value u != v) = (s / d) ``bit_q``."""
        return self.sampling_rate * self.bit_q

    @cached_property
    def report_dtype(self) -> np.dtype:
        """One report: ``buckets`` (s little-endian uint32) and ``bits`` (s booleans)."""
        s = self.bits_per_device
        return np.dtype([("buckets", "<u4", (s,)), ("bits", np.bool_, (s,))])

    # --- device side --------------------------------------------------------------------

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """The permanent responses of ``values`` (there is no instantaneous response):
        from ``context.memo``, or fresh from ``rng`` when it is None."""
        values = as_index_array(values, self.domain_size)
        return self._respond(values, self.memo_for(values, rng, context.memo))

    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        values = as_index_array(values, self.domain_size)
        return self._respond(values, self.memo_for(values, None, memo))

    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The value itself (module docstring)."""
        return as_index_array(values, self.domain_size)

    def sample_buckets(self, memo: Memo) -> np.ndarray:
        """Each row's s sampled buckets, sorted: (rows, s) int64 (module docstring)."""
        draws = memo.draws(BUCKETS_PURPOSE)
        d, s = self.domain_size, self.bits_per_device
        offsets = np.empty((memo.size, s), dtype=np.int64)
        for i in range(s):
            offsets[:, i] = draws.integers(d - i)
        return np.sort(shuffle_prefix(offsets, d), axis=1)

    def _respond(self, values: np.ndarray, memo: Memo) -> np.ndarray:
        buckets = self.sample_buckets(memo)
        own = buckets == values[:, None]
        p_threshold, q_threshold = self.thresholds
        reports = np.empty(values.size, dtype=self.report_dtype)
        reports["buckets"] = buckets
        for c in range(self.bits_per_device):  # one memo stream per (bucket, v in bucket)
            draws = memo.draws(BITS_PURPOSE, 2 * buckets[:, c] + own[:, c])
            limits = np.where(own[:, c], p_threshold, q_threshold).astype(np.uint64)
            reports["bits"][:, c] = draws.bernoulli_below(limits[:, None], 1)[:, 0]
        return reports

    # --- server side --------------------------------------------------------------------

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.dtype != self.report_dtype or array.ndim != 1:
            raise ValueError(
                f"dbitflip reports must be a one-dimensional array of dtype "
                f"{self.report_dtype}, got {array.dtype} {array.shape}"
            )
        buckets = array["buckets"].astype(np.int64)
        d = self.domain_size
        bad = np.flatnonzero(buckets.max(axis=1, initial=0) >= d)
        if bad.size:
            raise ValueError(
                f"report {bad[0]}: bucket {buckets[bad[0]].max()} is outside 0..{d - 1}"
            )
        bad = np.flatnonzero(np.any(np.diff(buckets, axis=1) <= 0, axis=1))
        if bad.size:
            raise ValueError(
                f"report {bad[0]}: buckets {buckets[bad[0]].tolist()} are not strictly increasing"
            )
        return array

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(2 * self.domain_size)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """(S_j, C_j): how many reports sampled bucket j, and how many with bit 1."""
        reports = self.check_reports(reports)
        buckets = reports["buckets"].astype(np.int64)
        d = self.domain_size
        sampled = np.bincount(buckets.ravel(), minlength=d)
        ones = np.bincount(buckets[reports["bits"]], minlength=d)
        return CountStatistics(reports.size, np.concatenate([sampled, ones]))

    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        """C_j: the reports that sampled bucket j with bit 1."""
        return self._split(stats)[1]

    def _split(self, stats: CountStatistics) -> tuple[np.ndarray, np.ndarray]:
        """(S, C) from statistics of length 2 d."""
        d = self.domain_size
        if stats.length != 2 * d:
            raise ValueError(f"dbitflip statistics have 2 d = {2 * d} counts, got {stats.length}")
        counts = stats.counts
        return counts[:d], counts[d:]

    def estimate_many(self, stats: Sequence[CountStatistics]) -> list[Estimate]:
        """f^_j = (d / (n s)) (C_j - q S_j) / (p - q) for each statistics (one row each),
        with ``frequency_variance`` at the estimate clipped to [0, 1] as its std."""
        n = np.array([part.n for part in stats], dtype=np.float64)
        if np.any(n <= 0):
            raise ValueError("cannot estimate from zero reports")
        split = [self._split(part) for part in stats]
        sampled = np.stack([counts[0] for counts in split]).astype(np.float64)
        ones = np.stack([counts[1] for counts in split]).astype(np.float64)
        p, q = self.bit_p, self.bit_q
        frequencies = (ones - q * sampled) / ((p - q) * n[:, None] * self.sampling_rate)
        variance = self.frequency_variance(np.clip(frequencies, 0.0, 1.0), n[:, None])
        return row_estimates(frequencies, np.sqrt(variance), n)

    def frequency_variance(
        self, frequencies: np.ndarray | float, n: int | np.ndarray
    ) -> np.ndarray:
        """Var[f^_j] = (q (1 - q) / (p - q)^2 + f_j (1 - 2 q) / (p - q)) / (n r) - f_j / n,
        r = s / d (module docstring), at the true frequencies f_j."""
        p, q, r = self.bit_p, self.bit_q, self.sampling_rate
        f = np.asarray(frequencies, dtype=np.float64)
        return (q * (1 - q) / (p - q) ** 2 + f * (1 - 2 * q) / (p - q)) / (n * r) - f / n

    def variance(self, n: int) -> float:
        """(d / (n s)) q (1 - q) / (p - q)^2, nominally (d / (n s)) e^a / (e^a - 1)^2:
        the variance of a frequency whose truth is 0."""
        return float(self.frequency_variance(0.0, n))

    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Exact for each bucket, independent across buckets: of the N_j devices of value j,
        A_j ~ Bin(N_j, s / d) sample j, and of the other n - N_j, B_j ~ Bin(n - N_j, s / d);
        S_j = A_j + B_j and C_j = Bin(A_j, p) + Bin(B_j, q) at the realized p, q. Each
        (S_j, C_j) has its exact joint law (up to numpy's binomial sampler at the double
        s / d), so each f_j does; across buckets the true S_j are slightly negatively
        correlated (they sum to n s), which the draws ignore (exact jointly when s = d,
        where S_j = n). O(d) whatever n is."""
        counts = check_true_counts(counts, self.domain_size, rng)
        n = int(counts.sum())
        own = rng.binomial(counts, self.sampling_rate)
        other = rng.binomial(n - counts, self.sampling_rate)
        ones = rng.binomial(own, self.bit_p) + rng.binomial(other, self.bit_q)
        return CountStatistics(n, np.concatenate([own + other, ones]))

    # --- exact laws ---------------------------------------------------------------------

    def transition_matrix(self) -> np.ndarray:
        """Exact P[report | value], (d, C(d, s) 2^s): column ``c 2^s + sum_k b_k 2^k`` is
        the c-th sample in ``itertools.combinations(range(d), s)`` order with bit b_k on its
        k-th (sorted) bucket."""
        d, s = self.domain_size, self.bits_per_device
        require_enumerable(d * math.comb(d, s) * 2**s)
        samples = np.array(list(itertools.combinations(range(d), s)), dtype=np.int64)
        patterns = (np.arange(2**s)[:, None] >> np.arange(s)) & 1  # (2^s, s)
        matrix = np.empty((d, samples.shape[0], 2**s))
        for v in range(d):  # a loop over the inputs of a small enumeration
            ones = np.where(samples == v, self.bit_p, self.bit_q)[:, None, :]  # (C, 1, s)
            matrix[v] = np.where(patterns[None] == 1, ones, 1 - ones).prod(axis=2)
        return matrix.reshape(d, -1) / samples.shape[0]

    def permanent_matrix(self) -> np.ndarray:
        """``transition_matrix()``: a report is its permanent response (no instantaneous
        randomness), so the law of any number of reports of one value is this one's."""
        return self.transition_matrix()

    # --- wire ---------------------------------------------------------------------------

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        reports = self.check_reports(reports)
        buckets = reports["buckets"].astype("<u4")
        bits = np.packbits(reports["bits"], axis=1)
        return [
            {
                "buckets": base64.b64encode(row.tobytes()).decode("ascii"),
                "bits": base64.b64encode(packed.tobytes()).decode("ascii"),
            }
            for row, packed in zip(buckets, bits, strict=True)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        s = self.bits_per_device
        row_bytes = (s + 7) // 8
        buckets = bytearray()
        packed = np.empty((len(payloads), row_bytes), dtype=np.uint8)
        for i, payload in enumerate(payloads):
            extra = set(payload) - self.payload_fields if isinstance(payload, dict) else set()
            if extra:
                raise ValueError(f"report {i}: unexpected payload keys {sorted(extra)}")
            buckets += decode_base64_field(
                payload, i, "buckets", 4 * s, f"{s} little-endian uint32"
            )
            packed[i] = np.frombuffer(decode_bits_field(payload, i, row_bytes), np.uint8)
        check_packed_rows(packed, s, "big", "dbitflip report")
        reports = np.empty(len(payloads), dtype=self.report_dtype)
        reports["buckets"] = np.frombuffer(bytes(buckets), dtype="<u4").reshape(-1, s)
        reports["bits"] = np.unpackbits(packed, axis=1, count=s).astype(bool)
        return self.check_reports(reports)
