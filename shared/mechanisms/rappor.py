"""RAPPOR: strings through a Bloom filter, a memoized permanent and a fresh instantaneous response.

Erlingsson, Pihur, Korolova, "RAPPOR: Randomized Aggregatable Privacy-Preserving
Ordinal Response", CCS 2014; hashing compatible with the reference client
(google/rappor, ``client/python/rappor.py``).

Parameters (``MechanismSpec``): k = ``num_bits``, h = ``num_hashes``,
m = ``num_cohorts``, and the probabilities f, p, q (0 <= f < 1, 0 <= p < q <= 1).

Device side, for a value v (a string) of a device in cohort c with secret s:

1. **Bloom filter** B: bit ``MD5(BE32(c) || utf8(v))[i] mod k`` is set for
   i = 0..h-1 (one byte of the digest per hash, as the reference client; so only
   bits 0..255 can be set, and with k > 256 the higher bits carry noise only).
   ``bloom(values, cohorts)`` returns B as Python integers, bit i being ``1 << i``.
2. **Permanent randomized response** (PRR) B': each bit is flipped with
   probability f/2, i.e. kept with probability 1 - f and otherwise set to 1 or 0
   with probability f/2 each. It is *memoized without storing the value*: the
   flips are a deterministic function of the secret and B,

       key    = HMAC-SHA256(s, "RAPPOR PRR v1" || 0x00 || BE16(k) || bytes(B))
       stream = SHAKE-256(key), 8 bytes per Bloom bit
       flip_i = (U_i < T_f),  U_i = (little-endian uint64 i of stream) >> 11

   where bytes(B) is B as ceil(k/8) little-endian bytes. So a device answers the
   same value the same way forever by keeping only s, flips are exactly
   Bernoulli(T_f / 2^53) (T_f within a few units of f/2 * 2^53, see below) under
   the HMAC/SHAKE pseudorandomness assumption, and different secrets give
   independent PRRs. (The reference client
   derives its masks from one HMAC-SHA256 block with 7-bit thresholds, which
   limits it to k <= 32 and rounds f to a multiple of 1/128; the PRR never
   leaves the device, so the server needs no agreement on it.)
3. **Instantaneous randomized response** (IRR), fresh for every report from the
   ``RandomSource`` (``rng=None``: the OS CSPRNG): reported bit i is 1 with
   probability q if B'_i = 1 and p if B'_i = 0.

Privacy (``epsilon_one``, ``epsilon_infinity``; formulas in
``shared.schemas.rappor_epsilon_one`` / ``rappor_epsilon_infinity``): with
q* = f (p + q) / 2 + (1 - f) q and p* = f (p + q) / 2 + (1 - f) p, each reported
bit is 1 with probability q* if the Bloom bit is 1 and p* if it is 0, bits
independent, so one report is

    epsilon_one = h ln(q* (1 - p*) / (p* (1 - q*)))-LDP,

tight when k >= 2h; any number of reports of one value are post-processing of
one PRR, which is

    epsilon_infinity = 2 h ln((1 - f/2) / (f/2))-LDP.

The spec's ``epsilon`` is epsilon_one. Realized probabilities: flips, p and q are
drawn at T_f / 2^53, T_p / 2^53 and T_q / 2^53 (``thresholds``). The PRR's ratio
(1 - f/2) / (f/2) falls as f/2 grows, so T_f is rounded up; T_p is rounded up
and T_q down (towards each other, which shrinks the ratio when f = 0). The
one-report ratio falls as f/2 grows too (q* - p* = (1 - f)(q - p) shrinks, each
towards the middle), so T_f is then stepped up until both realized ratios,
computed exactly from the thresholds, are proven at most e^epsilon_infinity and
e^min(epsilon, epsilon_one) (``shared.randomness.step_until_within``): the
realized guarantees never exceed the figures reported. ``transition_matrix``
and ``prr_matrix`` give the exact distributions for the tests. Reports of the *same* device for
*different* values compose (each distinct value costs up to epsilon_infinity).

Refusal rule ``"rappor.ones_count"`` (``shared.integrity``). Given the Bloom filter and any
permanent response B' with m ones, the k reported bits are independent, 1 with probability
q (where B' is 1) or p (where it is 0), at the realized T_q / 2^53 and T_p / 2^53: a
report's count of ones is Binomial(m, q) + Binomial(k - m, p), stochastically increasing
in m since p < q. With T_f > 0 every B' has positive probability, so the count lies
between Binomial(k, p) (m = 0) and Binomial(k, q) (m = k), both attained; with f = 0
(T_f = 0) B' is the Bloom filter itself, with 1..min(h, k) bits set, and the extremes are
m = min(h, k) and m = 1. The rule refuses more than U ones (U least with the upper
extreme's P(count > U) <= 2^-41) or fewer than L (L largest with the lower extreme's
P(count < L) <= 2^-41); ``false_refusal`` is their sum. E.g. k = 256, h = 2, f = 0.5,
p = 0.5, q = 0.75: U = 236, L = 72, false refusal 6.2e-13 (f = 0: U = 185); at k = 32 there
is no rule.

Cohorts: a device keeps one cohort for life, drawn uniformly once
(``assign_cohort``, derived from the secret so the secret is all it stores).

Reports are a structured array of dtype ``report_dtype``: ``cohort`` (int64) and
``bits`` (uint8, ceil(k/8) bytes), where bit i of the report is bit ``i % 8``
(least significant first) of byte ``i // 8``: the bytes are the report integer
in little-endian order (``int.to_bytes(ceil(k/8), "little")``), i.e.
``np.packbits(bits, bitorder="little")``; padding bits are 0. ``bloom_packed``
uses the same layout, and ``to_integers`` / ``from_integers`` convert. Payload:
``{"cohort": int, "bits": base64 of those bytes}``.

Server side: sufficient statistics are a ``CountStatistics`` whose counts are an
(m, k + 1) table flattened row by row: N_j, the reports of cohort j, then c_jb,
how many of them have bit b set (the reference "counts" file layout). They merge
by addition. ``bloom_counts`` debiases them (Erlingsson et al. 2014, Section 4):

    t_jb = (c_jb - p* N_j) / (q* - p*),    q* - p* = (1 - f)(q - p),

unbiased for T_jb, the number of reports of cohort j whose Bloom bit b is set,
with Var[t_jb] = (T_jb q* (1 - q*) + (N_j - T_jb) p* (1 - p*)) / (q* - p*)^2
(one report per device: devices are independent). ``estimate(stats,
candidates=[...])`` decodes against candidate strings
(``shared.mechanisms.rappor_decode``): selection by non-negative LASSO when there
are many candidates, constrained least squares (non-negative, total at most 1),
standard errors, Bonferroni (or Benjamini-Hochberg) detection, explained and
unexplained mass, and the smallest detectable frequency.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
from collections.abc import Sequence
from fractions import Fraction
from functools import cached_property
from itertools import combinations
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from shared.hashing import keyed_stream, rappor_bloom_digests
from shared.mechanisms.abilities import (
    FRESH,
    CandidateQueries,
    DeviceContext,
    Memoized,
    Secrets,
)
from shared.mechanisms.base import (
    BASE64,
    INTEGER,
    Mechanism,
    as_index_array,
    check_packed_rows,
    decode_bits_field,
    payload_shape,
)
from shared.mechanisms.categorical import MAX_ENUMERATED_OUTPUTS, require_enumerable
from shared.mechanisms.rappor_common import (
    BloomCounts,
    RapporEstimate,
    distinct_per_row,
    factorize_strings,
)
from shared.mechanisms.registry import register
from shared.mechanisms.spec import MAX_EPSILON, MIN_EPSILON, MechanismSpec, ValueKind, fill_in
from shared.mechanisms.unary import BinomialSum, OnesCountRefusal, bit_sums
from shared.memo import Memo
from shared.randomness import (
    BITS53,
    RandomSource,
    Rng,
    as_source,
    realized_probability,
    step_until_within,
    threshold53,
)
from shared.statistics import CountStatistics

#: Least secret length: the PRR is only as unpredictable as the secret.
MIN_SECRET_BYTES = 16
#: Domain-separation labels of the two uses of a device secret.
_PRR_LABEL = b"RAPPOR PRR v1\x00"
_COHORT_LABEL = b"RAPPOR cohort v1\x00"
#: Candidate lists whose Bloom bits a mechanism keeps (``candidate_bits``).
CANDIDATE_CACHE = 4
#: Reports processed at once by ``encode`` (bounds the PRR streams held in memory).
_ENCODE_CHUNK_BITS = 1 << 22
#: Bit reversal within a byte: maps the big-endian ``np.packbits`` order to little.
_REVERSE_BITS = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], dtype=np.uint8)

Correction = Literal["bonferroni", "bh", "none"]
Selection = Literal["auto", "lasso", "none"]
#: Default ``alpha`` of each detection rule: a false discovery rate for Benjamini-Hochberg,
#: a family-wise error rate for Bonferroni, a per-candidate level without correction.
DEFAULT_ALPHA: dict[str, float] = {"bh": 0.2, "bonferroni": 0.05, "none": 0.05}


def pack_little(bits: np.ndarray) -> np.ndarray:
    """Pack (n, k) 0/1 into (n, ceil(k/8)) bytes: bit i is bit ``i % 8`` of byte ``i // 8``."""
    return np.packbits(np.asarray(bits, dtype=bool), axis=1, bitorder="little")


def unpack_little(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of ``pack_little``: an (n, bits) uint8 array of 0/1."""
    return np.unpackbits(packed, axis=1, count=bits, bitorder="little")


def to_integers(packed: np.ndarray) -> np.ndarray:
    """Packed rows as Python integers (object array): bit i of the integer is report bit i."""
    rows = np.asarray(packed, dtype=np.uint8)
    out = np.empty(rows.shape[0], dtype=object)
    out[:] = [int.from_bytes(row.tobytes(), "little") for row in rows]
    return out


def from_integers(values: Sequence[int] | np.ndarray, bits: int) -> np.ndarray:
    """Python integers in [0, 2^bits) as packed rows (the inverse of ``to_integers``)."""
    row_bytes = (bits + 7) // 8
    out = np.zeros((len(values), row_bytes), dtype=np.uint8)
    for i, value in enumerate(values):  # one bignum per row: conversion, not bit work
        number = int(value)
        if not 0 <= number < 1 << bits:
            raise ValueError(f"integer at position {i} does not fit in {bits} bits")
        out[i] = np.frombuffer(number.to_bytes(row_bytes, "little"), dtype=np.uint8)
    return out


#: Largest Bloom filter (bits per report).
MAX_NUM_BITS = 4096
#: Most hash functions: each is one byte of an MD5 digest (16 bytes).
MAX_NUM_HASHES = 16
#: Most cohorts.
MAX_NUM_COHORTS = 1 << 16
#: Largest statistics: num_cohorts * (num_bits + 1) counts (32 MiB of int64).
MAX_RAPPOR_CELLS = 1 << 22


def rappor_report_probabilities(f: float, p: float, q: float) -> tuple[float, float]:
    """``(p*, q*)``: P(reported bit = 1) when the Bloom bit is 0, and when it is 1.

    The permanent randomized response keeps a Bloom bit with probability 1 - f
    and otherwise sets it to 1 or 0 with probability f/2 each; the instantaneous
    one reports 1 with probability q if the permanent bit is 1, p if it is 0.
    So (Erlingsson, Pihur, Korolova, CCS 2014, Section 3)

        q* = f (p + q) / 2 + (1 - f) q,    p* = f (p + q) / 2 + (1 - f) p.
    """
    shared = f * (p + q) / 2
    return shared + (1 - f) * p, shared + (1 - f) * q


def rappor_epsilon_one(num_hashes: int, f: float, p: float, q: float) -> float:
    """Epsilon of one RAPPOR report: ``h ln(q* (1 - p*) / (p* (1 - q*)))``.

    Two values' Bloom filters differ in at most h bits set in one and h in the
    other; each reported bit is an independent randomized response with
    P(1 | bit 1) = q*, P(1 | bit 0) = p*, so the likelihood ratio is at most
    (q* / p*)^h ((1 - p*) / (1 - q*))^h (tight when num_bits >= 2 h). Infinite
    when p* = 0 or q* = 1.
    """
    p_star, q_star = rappor_report_probabilities(f, p, q)
    if p_star <= 0.0 or q_star >= 1.0:
        return math.inf
    return num_hashes * math.log(q_star * (1 - p_star) / (p_star * (1 - q_star)))


def rappor_epsilon_infinity(num_hashes: int, f: float) -> float:
    """Lifetime epsilon of one value: ``2 h ln((1 - f/2) / (f/2))`` (infinite for f = 0).

    The permanent randomized response is memoized, so any number of reports of
    the same value are post-processing of one PRR, whose per-bit likelihood
    ratio is (1 - f/2) / (f/2) over at most 2 h differing Bloom bits.
    """
    if f <= 0.0:
        return math.inf
    return 2 * num_hashes * math.log((1 - f / 2) / (f / 2))


class RapporSpec(MechanismSpec):
    """``{"mechanism": "rappor", "num_bits": 32, "num_hashes": 1, "num_cohorts": 64,
    "f": 0.5, "p": 0.25, "q": 0.75}``: the Bloom filter (k bits, h hashes, m cohorts) and
    the randomized-response probabilities, all required. ``epsilon`` is the per-report
    epsilon_one they imply (``rappor_epsilon_one``): omit it and it is filled in; give it
    and it must agree (relative 1e-9)."""

    kind: ClassVar[ValueKind] = "string"

    mechanism: Literal["rappor"]
    # Typed float for every caller: the validator fills it in when it is omitted.
    epsilon: float = Field(  # type: ignore[assignment]
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description="Epsilon of one report, derived from num_hashes, f, p and q (may be omitted).",
    )
    num_bits: int = Field(ge=1, le=MAX_NUM_BITS, description="Bloom filter bits k.")
    num_hashes: int = Field(
        ge=1, le=MAX_NUM_HASHES, description="Hash functions h (bits set per value)."
    )
    num_cohorts: int = Field(ge=1, le=MAX_NUM_COHORTS, description="Cohorts m.")
    f: float = Field(
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="Probability that the permanent response replaces a Bloom bit.",
    )
    p: float = Field(
        ge=0.0, le=1.0, allow_inf_nan=False, description="P(reported 1 | permanent bit 0)."
    )
    q: float = Field(
        ge=0.0, le=1.0, allow_inf_nan=False, description="P(reported 1 | permanent bit 1)."
    )

    @model_validator(mode="after")
    def _derived_epsilon(self) -> RapporSpec:
        if not self.p < self.q:
            raise ValueError(f"p must be < q, got p={self.p}, q={self.q}")
        cells = self.num_cohorts * (self.num_bits + 1)
        if cells > MAX_RAPPOR_CELLS:
            raise ValueError(
                f"num_cohorts * (num_bits + 1) = {cells} counts exceeds {MAX_RAPPOR_CELLS}; "
                "use fewer cohorts or bits"
            )
        derived = rappor_epsilon_one(self.num_hashes, self.f, self.p, self.q)
        implied = f"num_hashes={self.num_hashes}, f={self.f}, p={self.p}, q={self.q}"
        if not derived <= MAX_EPSILON:
            raise ValueError(
                f"epsilon_one = {derived} implied by {implied} exceeds {MAX_EPSILON}; raise f "
                "or bring p and q closer"
            )
        if derived < MIN_EPSILON:
            raise ValueError(
                f"epsilon_one = {derived} implied by {implied} is below {MIN_EPSILON}: the "
                "reports would carry no signal; lower f or move p and q apart"
            )
        if self.epsilon is None:
            fill_in(self, "epsilon", derived)
        elif not math.isclose(self.epsilon, derived, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"epsilon = {self.epsilon} disagrees with epsilon_one = {derived!r} implied by "
                f"{implied}; omit epsilon or give that value"
            )
        return self


@register
class Rappor(OnesCountRefusal, Mechanism[CountStatistics]):
    """RAPPOR over strings: Bloom filter, cohorts, memoized PRR, fresh IRR, candidate decoding."""

    payload_schema = payload_shape(
        "RapporPayload",
        "rappor: the cohort, and base64 of the reported bits (bit i is bit i % 8 of byte i // 8).",
        cohort=INTEGER,
        bits=BASE64,
    )
    provides: ClassVar[tuple[type, ...]] = (CandidateQueries, Memoized)
    stateful: ClassVar[bool] = True

    name = "rappor"
    spec_model = RapporSpec
    spec: RapporSpec

    def __init__(self, spec: RapporSpec) -> None:
        super().__init__(spec)
        self.num_bits: int = spec.num_bits
        self.num_hashes: int = spec.num_hashes
        self.num_cohorts: int = spec.num_cohorts
        self.f: float = spec.f
        self.p: float = spec.p
        self.q: float = spec.q
        self.row_bytes: int = (self.num_bits + 7) // 8
        self.report_dtype = np.dtype([("cohort", "<i8"), ("bits", np.uint8, (self.row_bytes,))])
        self._bits_cache: dict[tuple[str, ...], np.ndarray] = {}

    # --- parameters and guarantees ---------------------------------------------------

    @property
    def p_star(self) -> float:
        """P(reported bit = 1 | Bloom bit 0) = f (p + q) / 2 + (1 - f) p, realized."""
        flip, p, q = self.realized_probabilities
        return rappor_report_probabilities(2 * flip, p, q)[0]

    @property
    def q_star(self) -> float:
        """P(reported bit = 1 | Bloom bit 1) = f (p + q) / 2 + (1 - f) q, realized."""
        flip, p, q = self.realized_probabilities
        return rappor_report_probabilities(2 * flip, p, q)[1]

    @property
    def epsilon_one(self) -> float:
        """Epsilon of one report: h ln(q* (1 - p*) / (p* (1 - q*))) (the spec's epsilon)."""
        return rappor_epsilon_one(self.num_hashes, self.f, self.p, self.q)

    @property
    def epsilon_infinity(self) -> float:
        """Epsilon of any number of reports of one value: 2 h ln((1 - f/2) / (f/2))."""
        return rappor_epsilon_infinity(self.num_hashes, self.f)

    @property
    def epsilon_report(self) -> float:
        """What one report reveals: ``epsilon_one``."""
        return self.epsilon_one

    @property
    def epsilon_lifetime(self) -> float:
        """What any number of reports of one value reveal: ``epsilon_infinity``."""
        return self.epsilon_infinity

    def memo_keys(self, values: Any, memo: Memo | None = None) -> np.ndarray:
        """Each string's key as int64: the first 8 bytes of SHA-256 of its UTF-8 (distinct
        strings collide with probability 2^-64 a pair); ``memo`` is not used, the PRR is
        memoized per (secret, Bloom filter)."""
        return np.array(
            [
                int.from_bytes(hashlib.sha256(key).digest()[:8], "big", signed=True)
                for key in self.ledger_keys(values, FRESH)
            ],
            dtype=np.int64,
        )

    def ledger_keys(self, values: Any, context: DeviceContext) -> list[bytes]:
        """The value itself (UTF-8): the permanent response is memoized per value."""
        distinct, codes = factorize_strings(values)
        raw = [text.encode("utf-8") for text in distinct]
        return [raw[int(code)] for code in codes]

    @cached_property
    def thresholds(self) -> tuple[int, int, int]:
        """(T_f, T_p, T_q): flip (f/2) rounded up, p up, q down; then T_f stepped up until
        the realized ratios are proven within epsilon_infinity and epsilon_one."""
        p_threshold, q_threshold = int(threshold53(self.p, "up")), int(threshold53(self.q, "down"))
        h = self.num_hashes
        square = BITS53 * BITS53

        def one_report(flip: int) -> Fraction:
            """(q* (1 - p*) / (p* (1 - q*)))^h, with q*, p* in units of 2^-106."""
            q_star = (BITS53 - flip) * q_threshold + flip * p_threshold
            p_star = flip * q_threshold + (BITS53 - flip) * p_threshold
            return Fraction(q_star * (square - p_star), p_star * (square - q_star)) ** h

        flip = int(threshold53(self.f / 2, "up"))
        if self.f > 0:
            flip = step_until_within(
                flip, "up", lambda t: Fraction(BITS53 - t, t) ** (2 * h), self.epsilon_infinity
            )
        bound = min(self.epsilon, self.epsilon_one)
        return step_until_within(flip, "up", one_report, bound), p_threshold, q_threshold

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """Binomial(m, q) + Binomial(k - m, p) at the most and the fewest permanent ones m
        an honest device can hold: k and 0 when T_f > 0, min(h, k) and 1 when f = 0
        (module docstring)."""
        flip, p, q = self.realized_probabilities
        k = self.num_bits
        most, fewest = (k, 0) if flip > 0 else (min(self.num_hashes, k), 1)
        return ((most, q), (k - most, p)), ((fewest, q), (k - fewest, p))

    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The reports' packed bits (little-endian layout; counting ones ignores order)."""
        return reports["bits"]

    @property
    def realized_probabilities(self) -> tuple[float, float, float]:
        """(flip, p, q) as sampled: T / 2^53 for each of ``thresholds`` (flip is nominally f/2)."""
        flip, p, q = self.thresholds
        return realized_probability(flip), realized_probability(p), realized_probability(q)

    # --- device side -----------------------------------------------------------------

    @staticmethod
    def new_secret() -> bytes:
        """A fresh 32-byte device secret from the OS CSPRNG (keep it for the device's life)."""
        return os.urandom(32)

    def assign_cohort(self, secret: bytes) -> int:
        """The device's cohort, uniform on 0..m-1 and stable: derived from its secret.

        Rejection sampling on 64-bit words of SHAKE-256(HMAC-SHA256(secret, label ||
        BE32(m))), so the cohort is exactly uniform (under the PRF assumption).
        """
        secret = _check_secret(secret, 0)
        m = self.num_cohorts
        limit = (1 << 64) - (1 << 64) % m
        stream = keyed_stream(secret, _COHORT_LABEL + m.to_bytes(4, "big"), 8 * 64)
        for start in range(0, len(stream), 8):  # P(64 rejections) < 2^-64
            word = int.from_bytes(stream[start : start + 8], "little")
            if word < limit:
                return word % m
        raise RuntimeError("cohort rejection sampling did not terminate")  # pragma: no cover

    def bloom_bit_indices(self, values: Any, cohorts: Any) -> np.ndarray:
        """(n, h) int64: the Bloom bit each hash of each value sets in its cohort."""
        distinct, codes = factorize_strings(values)
        cohorts = self._check_cohorts(cohorts, codes.size)
        return self._bit_indices(distinct, codes, cohorts)

    def bloom(self, values: Any, cohorts: Any) -> np.ndarray:
        """Bloom filters as Python integers (object array): bit i of value v is ``1 << i``."""
        return to_integers(self.bloom_packed(values, cohorts))

    def bloom_packed(self, values: Any, cohorts: Any) -> np.ndarray:
        """Bloom filters as packed rows (the report layout): (n, ceil(k/8)) uint8."""
        return self._pack_indices(self.bloom_bit_indices(values, cohorts))

    def permanent_response(self, blooms: np.ndarray, secrets: Secrets) -> np.ndarray:
        """The memoized PRR of packed Bloom filters, one secret per row (or one for all)."""
        packed = check_packed_rows(blooms, self.num_bits, "little", "Bloom filter")
        secret_list = _secret_list(secrets, packed.shape[0])
        return self._prr(packed, secret_list)

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """Reports of n values (strings), from the devices' ``context.secrets`` and
        ``context.cohorts`` (ints, one per value; None derives each from its secret with
        ``assign_cohort``).

        The secrets are one bytes object (every value from one device), a sequence of
        n bytes objects, or a uint8 array of shape (n, L); each at least 16 bytes.
        The Bloom filters are hashed once per distinct (value, cohort), the PRR
        derived once per distinct (secret, Bloom filter), and the IRR drawn fresh
        from ``rng`` (``None``: the OS CSPRNG) for every report.
        """
        if context.secrets is None:
            raise ValueError(
                "rappor reports derive from per-device secrets: pass "
                "context=DeviceContext(secrets=...)"
            )
        source = as_source(rng)
        distinct, codes = factorize_strings(values)
        n = codes.size
        secret_list = _secret_list(context.secrets, n)
        cohorts = self._check_cohorts(
            self._cohorts_of(secret_list, n) if context.cohorts is None else context.cohorts, n
        )
        reports = np.zeros(n, dtype=self.report_dtype)
        if n == 0:
            return reports
        reports["cohort"] = cohorts
        pairs, pair_of = np.unique(codes * self.num_cohorts + cohorts, return_inverse=True)
        pair_values = [distinct[int(c)] for c in pairs // self.num_cohorts]
        pair_blooms = self._pack_indices(
            self._bit_indices(pair_values, np.arange(pairs.size), pairs % self.num_cohorts)
        )
        chunk = max(1, _ENCODE_CHUNK_BITS // (64 * self.num_bits))
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            prr = self._prr_of_pairs(pair_blooms, pair_of[start:stop], secret_list, start)
            reports["bits"][start:stop] = self._irr(prr, source)
        return reports

    def _cohorts_of(self, secrets: list[bytes], n: int) -> np.ndarray:
        """Each value's cohort from its device's secret (one secret: the same for all),
        derived once per distinct secret."""
        known: dict[bytes, int] = {}
        for secret in secrets:
            if secret not in known:
                known[secret] = self.assign_cohort(secret)
        cohorts = np.array([known[secret] for secret in secrets], dtype=np.int64)
        return np.broadcast_to(cohorts, n) if cohorts.size == 1 else cohorts

    def _irr(self, prr: np.ndarray, source: RandomSource) -> np.ndarray:
        """Fresh instantaneous response: bit 1 w.p. q where the PRR is 1, p where it is 0."""
        rows = prr.shape[0]
        _, p_threshold, q_threshold = self.thresholds
        ones = _REVERSE_BITS[source.bernoulli_bits(q_threshold, rows, self.num_bits)]
        zeros = _REVERSE_BITS[source.bernoulli_bits(p_threshold, rows, self.num_bits)]
        return (ones & prr) | (zeros & ~prr)

    def _prr(self, packed: np.ndarray, secrets: list[bytes]) -> np.ndarray:
        pairs, pair_of = np.unique(packed, axis=0, return_inverse=True)
        return self._prr_of_pairs(pairs, pair_of.reshape(-1), secrets, 0)

    def _prr_of_pairs(
        self, blooms: np.ndarray, which: np.ndarray, secrets: list[bytes], offset: int
    ) -> np.ndarray:
        """PRRs of rows ``blooms[which]``, row i keyed by ``secrets[offset + i]`` (or the one)."""
        k = self.num_bits
        messages = [_PRR_LABEL + k.to_bytes(2, "big") + row.tobytes() for row in blooms]
        single = len(secrets) == 1
        cache: dict[tuple[bytes, int], int] = {}
        streams: list[bytes] = []
        slots = np.empty(which.size, dtype=np.int64)
        stream_bytes = 8 * k
        for i, bloom in enumerate(which.tolist()):  # one HMAC per distinct (secret, filter)
            secret = secrets[0] if single else secrets[offset + i]
            key = (secret, bloom)
            slot = cache.get(key)
            if slot is None:
                slot = cache[key] = len(streams)
                streams.append(keyed_stream(secret, messages[bloom], stream_bytes))
            slots[i] = slot
        words = np.frombuffer(b"".join(streams), dtype="<u8").reshape(len(streams), k)
        flips = pack_little((words >> np.uint64(11)) < np.uint64(self.thresholds[0]))
        return blooms[which] ^ flips[slots]

    def _check_cohorts(self, cohorts: Any, n: int) -> np.ndarray:
        array = as_index_array(np.asarray(cohorts), self.num_cohorts, "cohort")
        if array.size != n:
            raise ValueError(f"got {n} values but {array.size} cohorts; give one cohort per value")
        return array

    def _bit_indices(
        self, distinct: list[str], codes: np.ndarray, cohorts: np.ndarray
    ) -> np.ndarray:
        """MD5 once per distinct (value, cohort): (n, h) bit indices."""
        n, h, k = codes.size, self.num_hashes, self.num_bits
        if n == 0:
            return np.zeros((0, h), dtype=np.int64)
        pairs, pair_of = np.unique(codes * self.num_cohorts + cohorts, return_inverse=True)
        encoded = [text.encode("utf-8") for text in distinct]
        digests = rappor_bloom_digests(
            (pair % self.num_cohorts, encoded[pair // self.num_cohorts]) for pair in pairs.tolist()
        )
        table = np.frombuffer(digests, dtype=np.uint8).reshape(pairs.size, 16)[:, :h]
        return (table.astype(np.int64) % k)[pair_of.reshape(-1)]

    def _pack_indices(self, indices: np.ndarray) -> np.ndarray:
        """Rows with the given bit indices set, packed (little bit order)."""
        packed = np.zeros((indices.shape[0], self.row_bytes), dtype=np.uint8)
        if indices.size:
            rows = np.repeat(np.arange(indices.shape[0]), indices.shape[1])
            flat = indices.reshape(-1)
            masks = (np.uint8(1) << (flat & 7).astype(np.uint8)).astype(np.uint8)
            np.bitwise_or.at(packed, (rows, flat >> 3), masks)
        return packed

    def candidate_bits(self, candidates: Sequence[str]) -> np.ndarray:
        """(C, m, h) Bloom bit indices of every candidate in every cohort (read-only).

        The server decodes the same dictionary again and again: the last few lists'
        bits are kept (``CANDIDATE_CACHE`` entries per mechanism).
        """
        distinct, codes = factorize_strings(candidates, "candidate")
        key = tuple(distinct)
        cached = self._bits_cache.get(key)
        if cached is None:
            m = self.num_cohorts
            count = len(distinct)
            indices = self._bit_indices(
                distinct, np.repeat(np.arange(count), m), np.tile(np.arange(m), count)
            )
            cached = indices.reshape(count, m, self.num_hashes)
            cached.flags.writeable = False
            if len(self._bits_cache) >= CANDIDATE_CACHE:
                self._bits_cache.pop(next(iter(self._bits_cache)))
            self._bits_cache[key] = cached
        return cached[codes]

    # --- reports -------------------------------------------------------------------

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.dtype != self.report_dtype or array.ndim != 1:
            raise ValueError(
                f"RAPPOR reports must be a one-dimensional array of dtype {self.report_dtype}, "
                f"got {array.dtype} {array.shape}"
            )
        as_index_array(array["cohort"], self.num_cohorts, "report cohort")
        check_packed_rows(array["bits"], self.num_bits, "little")
        return array

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """``{"cohort": int, "bits": base64 of the little-endian report bytes}`` per report."""
        reports = self.check_reports(reports)
        return [
            {"cohort": int(cohort), "bits": base64.b64encode(bits.tobytes()).decode("ascii")}
            for cohort, bits in zip(reports["cohort"].tolist(), reports["bits"], strict=True)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        reports = np.zeros(len(payloads), dtype=self.report_dtype)
        for i, payload in enumerate(payloads):
            if not isinstance(payload, dict):
                raise ValueError(f"report {i}: payload must be an object, got {payload!r}")
            cohort = payload.get("cohort")
            if isinstance(cohort, bool) or not isinstance(cohort, int):
                raise ValueError(f"report {i}: payload needs an integer 'cohort', got {payload!r}")
            if not 0 <= cohort < self.num_cohorts:
                raise ValueError(
                    f"report {i}: cohort {cohort} is outside 0..{self.num_cohorts - 1}"
                )
            raw = decode_bits_field(payload, i, self.row_bytes)
            spare = self.row_bytes * 8 - self.num_bits
            if spare and raw[-1] >> (8 - spare):
                raise ValueError(
                    f"report {i}: 'bits' sets padding bits past bit {self.num_bits - 1}"
                )
            reports[i]["cohort"] = cohort
            reports[i]["bits"] = np.frombuffer(raw, dtype=np.uint8)
        return reports

    # --- sufficient statistics -----------------------------------------------------

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.num_cohorts * (self.num_bits + 1))

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Per cohort: N_j and the bit sums c_jb (``bit_sums`` over each cohort's rows).

        Sparse: only the rows of the cohorts present are built, so a batch of r reports
        costs O(min(r, m) k) memory, not the whole m (k + 1) table.
        """
        reports = self.check_reports(reports)
        m, k = self.num_cohorts, self.num_bits
        cohorts = reports["cohort"]
        order = np.argsort(cohorts, kind="stable")
        per_cohort = np.bincount(cohorts, minlength=m)
        present = np.flatnonzero(per_cohort)
        table = np.zeros((present.size, k + 1), dtype=np.int64)
        table[:, 0] = per_cohort[present]
        rows = reports["bits"][order]
        ends = np.cumsum(per_cohort)
        for row, j in enumerate(present):  # a loop over cohorts, not reports
            block = rows[ends[j] - per_cohort[j] : ends[j]]
            big = bit_sums(block, self.row_bytes * 8)  # column c = bit 7 - c % 8 of byte c // 8
            table[row, 1:] = big.reshape(self.row_bytes, 8)[:, ::-1].reshape(-1)[:k]
        cells = present[:, None] * (k + 1) + np.arange(k + 1)
        return CountStatistics.sparse(
            reports.size, m * (k + 1), cells.reshape(-1), table.reshape(-1)
        )

    def statistics_from_bytes(self, data: bytes) -> CountStatistics:
        """Deserialize, and refuse tables that no set of reports could produce.

        Checked on the nonzero cells only (O(nonzero + m)), so sparse statistics of a few
        reports are never expanded to the whole table here.
        """
        stats = super().statistics_from_bytes(data)
        cells, values = stats.nonzero()
        cohort, column = np.divmod(cells, self.num_bits + 1)
        heads = column == 0
        per_cohort = np.zeros(self.num_cohorts, dtype=np.int64)
        per_cohort[cohort[heads]] = values[heads]
        if int(per_cohort.sum()) != stats.n:
            raise ValueError(
                f"corrupt RAPPOR statistics: cohort counts sum to {int(per_cohort.sum())}, "
                f"n = {stats.n}"
            )
        if np.any(values[~heads] > per_cohort[cohort[~heads]]):
            raise ValueError("corrupt RAPPOR statistics: a bit count exceeds its cohort's reports")
        return stats

    def bloom_counts(self, stats: CountStatistics) -> BloomCounts:
        """Debiased t_jb = (c_jb - p* N_j) / (q* - p*), unbiased, with its plug-in std."""
        table = stats.counts.reshape(self.num_cohorts, self.num_bits + 1).astype(np.float64)
        reports, ones = table[:, 0], table[:, 1:]
        p_star, q_star = self.p_star, self.q_star
        gap = q_star - p_star
        counts = (ones - p_star * reports[:, None]) / gap
        true_ones = np.clip(counts, 0.0, reports[:, None])
        variance = (
            true_ones * q_star * (1 - q_star)
            + (reports[:, None] - true_ones) * p_star * (1 - p_star)
        ) / gap**2
        return BloomCounts(counts, np.sqrt(variance), reports)

    # --- estimation -----------------------------------------------------------------

    def estimate(
        self,
        stats: CountStatistics,
        candidates: Sequence[str] | None = None,
        *,
        alpha: float | None = None,
        correction: Correction = "bh",
        selection: Selection = "auto",
        background: bool = True,
    ) -> RapporEstimate:
        """Decode the candidates' frequencies (see ``shared.mechanisms.rappor_decode``).

        ``alpha`` is the false discovery rate of the detection rule
        (``correction="bh"``, Benjamini-Hochberg, the default, at ``alpha = 0.2``),
        its family-wise false-positive rate (``"bonferroni"``, default 0.05), or the
        level of each candidate's test (``"none"``, no multiple-testing correction,
        default 0.05); ``DEFAULT_ALPHA`` holds the defaults. BH at 0.2 is the default
        because on the reference RAPPOR regression setups it detects as many true
        strings as the reference decoder with fewer false positives and a smaller
        total variation distance (``simulations/benchmarks/rappor.py``); Bonferroni
        at 0.05 is the choice when any false positive is costly;
        ``selection`` runs the non-negative LASSO always, never, or (``"auto"``)
        when the candidates are many compared with the m k equations;
        ``background`` also fits the mass of strings outside the candidates as a
        uniform background over the Bloom bits (without it, that mass leaks into
        the candidates).
        """
        from shared.mechanisms.rappor_decode import decode  # scipy: server side only

        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        if candidates is None:
            raise ValueError(
                "RAPPOR decodes against candidate strings: call estimate(stats, candidates=[...])"
            )
        return decode(
            self,
            stats,
            candidates,
            alpha=DEFAULT_ALPHA.get(correction, 0.05) if alpha is None else alpha,
            correction=correction,
            selection=selection,
            background=background,
        )

    @property
    def noise_per_report(self) -> float:
        """s0 = p* (1 - p*) / (q* - p*)^2: variance of t_jb per report of a cohort (bit 0)."""
        p_star, q_star = self.p_star, self.q_star
        return p_star * (1 - p_star) / (q_star - p_star) ** 2

    def variance(self, n: int) -> float:
        """``s0 / (h n)``: variance of a candidate's frequency estimate at frequency 0 when its
        h bits are distinct and shared with no other candidate (s0 = ``noise_per_report``)."""
        return self.noise_per_report / (self.num_hashes * n)

    def smallest_detectable_frequency(
        self, n: int, num_candidates: int, alpha: float = 0.05
    ) -> float:
        """Planning figure: z_(1 - alpha / C) sqrt(variance(n)), the frequency a collision-free
        candidate needs to be detected (Bonferroni over C candidates) with probability 1/2."""
        from statistics import NormalDist

        if not 0 < alpha < 1 or num_candidates < 1 or n < 1:
            raise ValueError("need 0 < alpha < 1, num_candidates >= 1 and n >= 1")
        z = NormalDist().inv_cdf(1 - alpha / num_candidates)
        return z * math.sqrt(self.variance(n))

    # --- exact distributions (tests) ------------------------------------------------

    def bloom_filters(self) -> np.ndarray:
        """Every Bloom filter a value can have: 1..h bits set, as (rows, k) 0/1 (small k)."""
        k, h = self.num_bits, self.num_hashes
        rows = [
            np.isin(np.arange(k), subset).astype(np.int64)
            for size in range(1, min(h, k) + 1)
            for subset in combinations(range(k), size)
        ]
        return np.array(rows)

    def _outputs(self) -> np.ndarray:
        k = self.num_bits
        require_enumerable(2**k)
        return (np.arange(2**k)[:, None] >> np.arange(k)[None, :]) & 1  # column o: integer o

    def prr_matrix(self) -> np.ndarray:
        """Exact ``P[PRR = o | Bloom filter]``: rows ``bloom_filters()``, columns integers o."""
        flip = self.realized_probabilities[0]
        blooms = self.bloom_filters()
        outputs = self._outputs()
        differ = (blooms[:, None, :] != outputs[None, :, :]).sum(axis=2)
        return flip**differ * (1 - flip) ** (self.num_bits - differ)

    def transition_matrix(self) -> np.ndarray:
        """Exact ``P[report bits = o | Bloom filter]`` of one report (PRR marginalized).

        Rows are ``bloom_filters()``, columns the 2^k reports as integers o (bit i of o
        is report bit i). Each bit is independently 1 with probability q* (Bloom bit 1)
        or p* (Bloom bit 0), computed from the realized sampling probabilities.
        """
        flip, p, q = self.realized_probabilities
        one_if_set = (1 - flip) * q + flip * p
        one_if_clear = flip * q + (1 - flip) * p
        blooms = self.bloom_filters()
        outputs = self._outputs()
        if blooms.shape[0] * outputs.shape[0] > MAX_ENUMERATED_OUTPUTS * 64:
            raise ValueError("too many Bloom filters to enumerate; use smaller k and h")
        prob_one = np.where(blooms == 1, one_if_set, one_if_clear)[:, None, :]
        per_bit = np.where(outputs[None, :, :] == 1, prob_one, 1 - prob_one)
        return per_bit.prod(axis=2)

    # --- simulation fast path -------------------------------------------------------

    def simulate_statistics(
        self,
        values: Sequence[str],
        counts: Sequence[int] | np.ndarray,
        rng: np.random.Generator,
        *,
        bits: np.ndarray | None = None,
    ) -> CountStatistics:
        """Draw the statistics of ``counts[i]`` devices reporting ``values[i]`` once each.

        Exact in distribution for one report per device (independent devices): the
        devices of each value are spread over the cohorts uniformly (multinomial),
        T_jb counts those whose Bloom bit b is set, and c_jb ~ Bin(T_jb, q*) +
        Bin(N_j - T_jb, p*) with the realized sampling probabilities. O(V m h + m k)
        whatever n is. Simulation only: it takes a seeded numpy Generator, never
        the secure default, and is not a device path. ``bits`` may pass
        ``candidate_bits(values)`` computed once for repeated simulations.
        """
        if not isinstance(rng, np.random.Generator):
            raise TypeError("simulate_statistics needs a numpy.random.Generator")
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 1 or counts.size != len(values) or np.any(counts < 0):
            raise ValueError("counts must be one non-negative integer per value")
        m, k = self.num_cohorts, self.num_bits
        if bits is None:
            bits = self.candidate_bits(values)  # (V, m, h)
        if bits.shape != (len(values), m, self.num_hashes):
            raise ValueError("bits must be candidate_bits(values)")
        spread = rng.multinomial(counts, np.full(m, 1.0 / m))  # (V, m)
        cells = bits + (np.arange(m) * k)[None, :, None]
        cells = distinct_per_row(cells.reshape(-1, self.num_hashes))  # a Bloom bit is set once
        weights = np.repeat(spread.reshape(-1), self.num_hashes)
        valid = cells.reshape(-1) >= 0
        true_ones = np.bincount(cells.reshape(-1)[valid], weights[valid], minlength=m * k)
        true_ones = true_ones.astype(np.int64).reshape(m, k)
        per_cohort = spread.sum(axis=0)
        flip, p, q = self.realized_probabilities
        one_if_set = (1 - flip) * q + flip * p
        one_if_clear = flip * q + (1 - flip) * p
        ones = rng.binomial(true_ones, one_if_set) + rng.binomial(
            per_cohort[:, None] - true_ones, one_if_clear
        )
        table = np.concatenate([per_cohort[:, None], ones], axis=1)
        return CountStatistics(int(counts.sum()), table.reshape(-1))


def _check_secret(secret: Any, position: int) -> bytes:
    if not isinstance(secret, bytes | bytearray | memoryview):
        raise ValueError(
            f"secret at position {position} must be bytes, got {type(secret).__name__}"
        )
    secret = bytes(secret)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"secret at position {position} has {len(secret)} bytes; a device secret needs at "
            f"least {MIN_SECRET_BYTES} unpredictable bytes (use Rappor.new_secret())"
        )
    return secret


def _secret_list(secrets: Secrets, n: int) -> list[bytes]:
    """One secret for all (a list of one) or n secrets, each checked."""
    if isinstance(secrets, bytes | bytearray | memoryview):
        return [_check_secret(secrets, 0)]
    if isinstance(secrets, np.ndarray) and secrets.dtype == np.uint8:
        if secrets.ndim != 2 or secrets.shape[0] != n:
            raise ValueError(
                f"a secrets array must have shape (n, length) with n = {n}, got {secrets.shape}"
            )
        if secrets.shape[1] < MIN_SECRET_BYTES:
            raise ValueError(
                f"secrets have {secrets.shape[1]} bytes; a device secret needs at least "
                f"{MIN_SECRET_BYTES}"
            )
        return [row.tobytes() for row in secrets]
    listed = list(secrets)
    if len(listed) != n:
        raise ValueError(f"got {n} values but {len(listed)} secrets; give one per value")
    return [_check_secret(secret, i) for i, secret in enumerate(listed)]
