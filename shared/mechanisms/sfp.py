"""Apple's Sequence Fragment Puzzle (``sfp``): frequent open-domain strings found without
candidates, from fragments that carry a short hash of their whole string.

Apple Differential Privacy Team, "Learning with Privacy at Scale" (2017), the Sequence
Fragment Puzzle (SFP) for discovering new words: a device privatizes a two-character
fragment of its word together with an 8-bit hash of the whole word, and the word itself,
each into a Count Mean Sketch (CMS); the server finds the frequent (hash, fragment) pairs
at every position, fits fragments that share a hash together like a puzzle, and looks the
assembled words up in the whole-word sketch. Here the sketch is ``cms``
(``shared.mechanisms.sketch.CountMeanSketch``, its hash family ``shared.hashing.SketchHash``)
at the spec's ``epsilon``, k = ``sketch_depth`` and m = ``sketch_width`` (a power of two).

Values. A string is its UTF-8 bytes padded with 0xFF (a byte UTF-8 never uses, so the
padding is unambiguous) to 2P bytes, P = ceil(max_length / 2) fragment positions;
position l (0..P-1) holds bytes 2l and 2l + 1. Its tag is

    t(s) = byte 0 of SHA-256("LDP sfp tag v1" || 0x00 || UTF-8(s)),

and its fragment key at position l is the 24-bit x = t(s) 2^16 + b_{2l} 2^8 + b_{2l+1}.

Device, one report per value with fresh randomness. A slot is drawn uniformly from the
P + 1 sketches: slot 0 (probability 1/(P + 1)) sends the whole string into the whole-string
sketch, slot 1 + l the fragment key at position l into that position's fragment sketch.
Either way the report is one ``cms`` report (a row J uniform on 0..k-1 and the m bits of
the one-hot vector of the key's column in row J, each flipped with probability
1/(1 + e^(eps/2))) together with the slot, as (kind, position): kind 0 for the whole
string (position 0), kind 1 for a fragment at ``position``.

Privacy budget. Apple's device sends both the fragment and the word, each at eps/2, eps
in all by composition. Here a report is either one or the other, at the full eps: the
slot is drawn independently of the value and is public, and given the slot the report is
a ``cms`` report, eps-LDP whatever its key (two keys' one-hot vectors differ in at most two
coordinates: the ratio is ((1 - F)/F)^2 = e^eps, F the certified flip probability). So
each report is eps-LDP, tightly (``transition_matrix``). Splitting devices instead of
the budget is also the more accurate choice at the epsilons SFP is used at: a ``cms``
estimate from N reports has variance about s0(eps)/N, s0 = e^(eps/2)/(e^(eps/2) - 1)^2,
which at eps = 4 is 0.18/N for N = n/(P + 1) reports at eps against 0.92/N for N = n at
eps/2 (fragments always gain; the whole string too while P <= 4).

Fragment fingerprints. The whole string enters its sketch as ``cms`` hashes it: a
SHA-256 fingerprint (a, b) and row j's column from a XOR b G_j in GF(2^32), G_j the
family's row multipliers. A fragment key x enters its sketch with the fingerprint

    a(x) = a0 XOR (XOR of A_i over the bits i set in x),
    b(x) = b0 XOR (XOR of B_i over the bits i set in x),

a0, b0, A_0..A_23, B_0..B_23 the 50 big-endian 32-bit words of
SHAKE-256("LDP sfp fragment v1" || 0x00) (200 bytes, in that order), and then the same
rows: column h_j(x) = top w bits of a(x) XOR b(x) G_j, m = 2^w. Modelling the words as
uniform, the maps x -> (a(x), b(x)) are uniform random affine maps, so for distinct keys
x, x', x'' the differences (a(x) XOR a(x'), b(x) XOR b(x')) and (a(x) XOR a(x''),
b(x) XOR b(x'')) are independent and uniform (x XOR x' and x XOR x'' are distinct and
nonzero, hence linearly independent): collisions are pairwise independent across rows,
each with probability kappa = 1/m, and independent across the other keys, which is all
the ``cms`` estimate and its variance rest on. Multiplying by G_j is GF(2)-linear, so
every row's a(x) XOR b(x) G_j is affine in x as well, which makes decoding cheap.

Server. The sufficient statistics are the P + 1 ``cms`` statistics (k (m + 1) counts
each: per row its reports R_j and bit sums S_jc) concatenated, whole string first, then
positions 0..P-1: a ``CountStatistics`` of (P + 1) k (m + 1) counts whatever n is, merged
by addition. A sketch's reports are its R_j summed.

Fragment decoding, all 2^24 keys of a position at once. With the debiased sketch
A[j, c] = scale S_jc + o_j (``cms``), a key's sum is Z(x) = sum_j A[j, h_j(x)] and its
share of the position's n_l reports phi(x) = (Z(x)/n_l - kappa)/(1 - kappa), the ``cms``
estimate. Since h_j(x) = e_j XOR C_j x for a w x 24 matrix C_j over GF(2), writing row j
of S through its Walsh-Hadamard transform S^_j(omega) = sum_c S_jc (-1)^(omega.c) gives

    sum_j S[j, h_j(x)] = (1/m) sum_z Gamma(z) (-1)^(z.x),
    Gamma(z) = sum over (j, omega) with C_j^T omega = z of S^_j(omega) (-1)^(omega.e_j),

one scatter of the k m transformed counts and one Walsh-Hadamard transform of length 2^24
(``shared.hadamard``): O(k m log m + 24 2^24) per position, whatever k, instead of k 2^24
lookups (float64, exact up to rounding far below one count; the transform runs a
cache-sized block at a time, ``shared.hadamard``).

Selection, by peeling. Among 2^24 keys many share their column, in some rows, with a much
heavier key (about 1/m of them in each row), and their sums carry a share of its reports.
So keys are confirmed greedily, heaviest first, and each key confirmed is peeled off the
sketch: its estimated reports, n_l phi(x)/k in each row, are subtracted from its k cells,
which takes its share out of every key sharing them. With keys of total share P peeled, a
key's estimate is phi(x) = (Z'(x)/n_l - kappa (1 - P))/(1 - kappa), Z' its sum in the
peeled sketch (the kappa term counts only the reports left), unbiased as before. A key is
confirmed when phi(x) exceeds z sigma, sigma the ``cms`` standard error at f = 0 with the
collision term of the mass not yet confirmed (F = F2^ - sum of the confirmed phi^2, F2^
the sketch's second-moment estimate) and z the normal quantile that lets about
``FALSE_FRAGMENTS`` of the 2^24 null keys through. Peeling only removes reports, so after
further peeling of a share dP a key's phi can grow only through the kappa term, by at most
kappa dP/(1 - kappa); this bound tells which keys can still pass.

Per position: all keys are decoded; the pool is those above z sigma_p - kappa/(1 - kappa)
(sigma_p the standard error without the collision term: no key below can ever pass), at
most ``MAX_POOL``, the largest. It is judged by decreasing phi in batches of 1, 2, 4, ...
up to ``_CONFIRM_BATCH`` keys: each key's phi is recomputed from the peeled sketch (k
lookups); those above the threshold that share no cell with a key passed before them in
the batch are confirmed and peeled, the others that passed are judged again first. When
a batch confirms nothing although keys were peeled since the pool's values were computed,
those values are all recomputed (``SketchHash.row_sums``) and sorted again. Keys that
failed are judged again in another pass while confirmations lower the threshold; and when
the pool was cut at ``MAX_POOL`` while a key left out could still pass, the peeled sketch
is decoded again (at most ``MAX_ROUNDS`` decodings). At most ``MAX_FRAGMENTS`` keys per
position are kept. Keys x, x' share every cell when C_j (x XOR x') = 0 for all j: each key
has 2^(24 - r) - 1 such twins, r the rank of the C_j stacked, so none once r = 24, as it
is for random row maps with k w well above 24; a twin of a key confirmed is left at about
0 by its peeling. Apple thresholds the fragment sketches likewise; the domain is not
shrunk to an alphabet, every byte pair is tested.

Sketch size. Whatever n is, a key's collision error has a standard deviation of about
sqrt(F2 / (m k)), F2 the sum of the squared shares of the fragments (about that of the
strings), so a string is found only when its frequency exceeds about z sqrt(F2 / (m k)):
with F2 = 0.05 and the 10th string at 1.4% (Zipf(1.1) over a thousand words) that asks
for m k of at least 10^4 (pure-ldp's own experiments use k x m from 32 x 1024 to
1024 x 2048). Peeling takes out what the heaviest keys add, not the noise of the many
small ones: there a 64 x 8 sketch finds only the strings above about 4%, at any n.

Puzzle. For each tag t kept at every position, every choice of one kept fragment with
tag t per position is a candidate (when there are more than ``MAX_COMBINATIONS``, the
best fragments of each position are kept, as many per position as fit). A candidate
stays if its bytes are well-formed UTF-8 followed only by padding
(``shared.mechanisms.strings.well_formed_prefixes``) and its own tag is t (a wrong assembly
passes with probability 1/256). The survivors are estimated in the whole-string sketch,
and only those whose estimate exceeds z_s sigma_0 are kept: sigma_0 the standard error of
a string no device holds (the ``cms`` std at f = 0 with the collision term of all the
mass, F2^ of the whole-string sketch) and z_s the normal quantile at 1 - ``FALSE_STRINGS``
/ c for c candidates (Bonferroni), so that a string no device holds (fragments of two
strings that share a tag assembled across, whose own tag matches by chance; or a false
fragment) is reported with probability at most ``FALSE_STRINGS``. The k largest estimates
kept are the heavy hitters (``heavy_hitters``).

Estimates. ``estimate(stats, candidates)`` is the ``cms`` estimate from the n_0
whole-string reports. Each device is in slot 0 independently with probability
1/(P + 1), so given n_0 the slot-0 devices are a uniform sample of the n, and the estimate
is unbiased for the frequency among all n devices, with variance

    Var = Var_cms(n_0, f, F) + f (1 - f) (n - n_0) / (n_0 (n - 1)),

the ``cms`` variance at n_0 reports (privacy noise and hash collisions, see
``shared.mechanisms.sketch``) plus that of the sample (``std`` evaluates it at the
estimate clipped to [0, 1]). ``variance(n)`` is the first term at f = 0, F = 0 and
n_0 = n/(P + 1). Discovery and estimation use disjoint reports (fragments, whole
strings), so given the set of candidates found, each candidate's estimate is unbiased with
this std; the top k are chosen by these same estimates, so a string near the cut tends to
be overestimated (the winner's curse), which ``std`` does not include.

Simulation fast path: ``simulate_statistics(strings, counts, rng)``: the devices of each
string are split over the slots multinomially, then each sketch is drawn by
``CountMeanSketch.simulate_fingerprints`` from its strings' or fragment keys'
fingerprints and device counts: the law of ``aggregate(encode(...))`` exactly, in
O((P + 1) (k m + distinct strings x k)) whatever n is.

Refusal rule ``"sfp.ones_count"`` and profile (``Profiled``): a report's bits are a ``cms``
report's, whatever the slot and string, so ``cms``'s ones-count rule and chi-square
profile apply unchanged (``shared.mechanisms.sketch``; e.g. epsilon 4, m = 1024: more than
203 or fewer than 56 ones refused, false refusal 6.3e-13).

Report: a structured array of dtype [("kind", int64), ("position", int64), ("row",
int64), ("bits", uint8, ceil(m/8))], bits in ``np.packbits`` layout (bit c is bit
7 - c % 8 of byte c // 8, padding 0). Payload ``{"kind": 0 or 1, "position": int,
"row": int, "bits": base64 of the ceil(m/8) packed bytes}``: kind 0 (whole string) has
position 0, kind 1 (fragment) a position in 0..P-1; row in 0..k-1.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from functools import cached_property
from statistics import NormalDist
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import model_validator

from shared.estimates import Estimate, HeavyHitters
from shared.hadamard import walsh_hadamard
from shared.hashing import gf32_multiply
from shared.mechanisms.abilities import FRESH, DeviceContext, Discovery
from shared.mechanisms.base import (
    BASE64,
    INTEGER,
    Mechanism,
    as_index_array,
    check_integer_field,
    check_packed_rows,
    decode_bits_field,
    payload_shape,
)
from shared.mechanisms.categorical import require_enumerable
from shared.mechanisms.registry import register
from shared.mechanisms.sketch import MAX_SKETCH_CELLS, CmsSpec, CountMeanSketch, SketchSpec
from shared.mechanisms.strings import (
    PAD,
    MaxLength,
    OpenStringMechanism,
    factorize_utf8,
    padded_matrix,
    require_candidates,
    string_population,
    well_formed_prefixes,
)
from shared.mechanisms.unary import BinomialSum, OnesCountProfile, OnesCountRefusal
from shared.randomness import Rng, as_source
from shared.statistics import CountStatistics

__all__ = [
    "FRAGMENT_BITS",
    "SequenceFragmentPuzzle",
    "fragment_fingerprints",
    "string_tags",
]

#: Domain separation of the tag hash and of the fragment fingerprint words.
TAG_LABEL = b"LDP sfp tag v1\x00"
FRAGMENT_LABEL = b"LDP sfp fragment v1\x00"
#: Bits of a fragment key: an 8-bit tag and two bytes.
FRAGMENT_BITS = 24
#: Null keys (frequency 0) expected to pass a position's threshold by privacy noise alone.
FALSE_FRAGMENTS = 16
#: Most keys judged per round, and most kept per position.
MAX_POOL = 1 << 20
MAX_FRAGMENTS = 4096
#: Most rounds of decoding a position's 2^24 keys (each with the keys confirmed peeled off).
MAX_ROUNDS = 4
#: Most candidates assembled for one tag.
MAX_COMBINATIONS = 4096
#: Chance that some assembled string no device holds passes the whole-string check.
FALSE_STRINGS = 0.01
#: Most strings ``heavy_hitters`` returns.
MAX_HEAVY_HITTERS = 256
#: Largest batch of keys confirmed together.
_CONFIRM_BATCH = 256


def _fragment_words() -> tuple[int, int, np.ndarray, np.ndarray]:
    """(a0, b0, A, B): the 50 words of SHAKE-256(FRAGMENT_LABEL), A and B 24 words each."""
    words = np.frombuffer(
        hashlib.shake_256(FRAGMENT_LABEL).digest(4 * (2 + 2 * FRAGMENT_BITS)), dtype=">u4"
    ).astype(np.int64)
    return int(words[0]), int(words[1]), words[2 : 2 + FRAGMENT_BITS], words[2 + FRAGMENT_BITS :]


A0, B0, A_WORDS, B_WORDS = _fragment_words()


def _byte_tables(words: np.ndarray) -> np.ndarray:
    """(3, 256): entry [i, v] is the XOR of words[8 i + bit] over the bits set in v."""
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1  # (value, bit)
    tables = np.zeros((3, 256), dtype=np.int64)
    for byte in range(3):
        for bit in range(8):
            tables[byte] ^= bits[:, bit] * words[8 * byte + bit]
    return tables


_A_TABLES = _byte_tables(A_WORDS)
_B_TABLES = _byte_tables(B_WORDS)


def fragment_fingerprints(keys: np.ndarray) -> np.ndarray:
    """(n, 2) int64: the fingerprints (a(x), b(x)) of 24-bit fragment keys (module
    docstring, "Fragment fingerprints"), by byte tables."""
    keys = np.asarray(keys, dtype=np.int64)
    out = np.empty((keys.size, 2), dtype=np.int64)
    for column, (start, tables) in enumerate(((A0, _A_TABLES), (B0, _B_TABLES))):
        out[:, column] = (
            start
            ^ tables[0][keys & 0xFF]
            ^ tables[1][(keys >> 8) & 0xFF]
            ^ tables[2][(keys >> 16) & 0xFF]
        )
    return out


def string_tags(raw: Sequence[bytes]) -> np.ndarray:
    """t(s) = byte 0 of SHA-256(TAG_LABEL || s) for each UTF-8 string, as int64."""
    return np.fromiter(
        (hashlib.sha256(TAG_LABEL + value).digest()[0] for value in raw),
        dtype=np.int64,
        count=len(raw),
    )


class SfpSpec(SketchSpec):
    """``{"mechanism": "sfp", "epsilon": 4.0, "sketch_width": 1024, "sketch_depth": 16,
    "max_length": 16}``: ``sketch_width`` a power of two (fragments are decoded by a
    Walsh-Hadamard transform), and ceil(max_length / 2) + 1 sketches in all."""

    mechanism: Literal["sfp"]
    max_length: MaxLength

    @model_validator(mode="after")
    def _sketches_fit(self) -> SfpSpec:
        self.require_power_of_two_width()
        cells = self.sketch_width * self.sketch_depth
        sketches = (self.max_length + 1) // 2 + 1
        if sketches * cells > MAX_SKETCH_CELLS:
            raise ValueError(
                f"sfp keeps ceil(max_length / 2) + 1 = {sketches} sketches of "
                f"sketch_depth * sketch_width = {cells} counts: {sketches * cells} "
                f"exceeds {MAX_SKETCH_CELLS}; use a smaller sketch or max_length"
            )
        return self


@register
class SequenceFragmentPuzzle(
    OnesCountRefusal, OpenStringMechanism, Mechanism[CountStatistics], OnesCountProfile
):
    """Apple's SFP over ``cms`` sketches: one report per device, fragment or whole string."""

    name = "sfp"
    spec_model = SfpSpec
    provides: ClassVar[tuple[type, ...]] = (Discovery,)
    payload_schema = payload_shape(
        "FragmentPayload",
        "sfp: a cms report of the whole string (kind 0, position 0) or of the fragment at "
        "a position (kind 1).",
        kind=INTEGER,
        position=INTEGER,
        row=INTEGER,
        bits=BASE64,
    )

    def __init__(self, spec: SfpSpec) -> None:
        super().__init__(spec)
        width, depth = spec.sketch_width, spec.sketch_depth
        self.max_length: int = spec.max_length
        self.positions: int = (spec.max_length + 1) // 2
        self.sketch = CountMeanSketch(
            CmsSpec(mechanism="cms", epsilon=spec.epsilon, sketch_width=width, sketch_depth=depth)
        )
        self.depth, self.width = depth, width
        #: Counts of one sketch's statistics, k (m + 1).
        self.block: int = depth * (width + 1)
        self.report_dtype = np.dtype(
            [
                ("kind", "<i8"),
                ("position", "<i8"),
                ("row", "<i8"),
                ("bits", np.uint8, (self.sketch.row_bytes,)),
            ]
        )

    @property
    def slots(self) -> int:
        """P + 1: the whole-string sketch and one per fragment position."""
        return self.positions + 1

    @property
    def cells(self) -> int:
        """Length of the statistics: (P + 1) k (m + 1) counts."""
        return self.slots * self.block

    # -- device side -------------------------------------------------------------------

    def encode(
        self, values: Sequence[str] | np.ndarray, rng: Rng = None, context: DeviceContext = FRESH
    ) -> np.ndarray:
        """One report per value (module docstring, "Device"). ``context`` is not used: nothing
        about a device is permanent here, every report draws its slot, row and noise afresh
        from ``rng`` (``None``: the OS CSPRNG)."""
        raw, codes = factorize_utf8(values, self.max_length)
        source = as_source(rng)
        slots = source.integers(self.slots, codes.size)
        fragment = slots > 0
        fingerprints = np.empty((codes.size, 2), dtype=np.int64)
        if not fragment.all():
            fingerprints[~fragment] = self.sketch.hash.fingerprints(raw)[codes[~fragment]]
        if fragment.any():
            keys = self.fragment_keys(raw)[codes[fragment], slots[fragment] - 1]
            fingerprints[fragment] = fragment_fingerprints(keys)
        inner = self.sketch.encode_fingerprints(fingerprints, source)
        reports = np.empty(codes.size, dtype=self.report_dtype)
        reports["kind"] = fragment
        reports["position"] = np.maximum(slots - 1, 0)
        reports["row"] = inner["row"]
        reports["bits"] = inner["bits"]
        return reports

    def fragment_keys(self, raw: Sequence[bytes]) -> np.ndarray:
        """(len(raw), P) int64: x = t 2^16 + b_2l 2^8 + b_2l+1 of each string at each l."""
        padded = padded_matrix(raw, 2 * self.positions).astype(np.int64)
        return (string_tags(raw)[:, None] << 16) | (padded[:, 0::2] << 8) | padded[:, 1::2]

    # -- refusal rule and profile: the inner cms report's ----------------------------------

    def ones_count_law(self) -> BinomialSum:
        """The ``cms`` law: Bernoulli(p) + Binomial(m - 1, q), whatever the slot and value."""
        return self.sketch.ones_count_law()

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        return self.sketch.ones_count_laws()

    def ones_count_test(self) -> str:
        return self.sketch.ones_count_test()

    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The reports' packed sign bits."""
        return reports["bits"]

    # -- reports and statistics --------------------------------------------------------

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.dtype != self.report_dtype or array.ndim != 1:
            raise ValueError(
                f"sfp reports must be a one-dimensional array of dtype {self.report_dtype}, "
                f"got {array.dtype} {array.shape}"
            )
        kinds = as_index_array(array["kind"], 2, "report kind")
        positions = array["position"]
        bad = np.flatnonzero(
            np.where(kinds == 1, (positions < 0) | (positions >= self.positions), positions != 0)
        )
        if bad.size:
            row = int(bad[0])
            raise ValueError(
                f"report {row}: position {int(positions[row])} is invalid for kind "
                f"{int(kinds[row])} (a whole string, kind 0, has position 0; a fragment, "
                f"kind 1, a position in 0..{self.positions - 1})"
            )
        as_index_array(array["row"], self.depth, "report row")
        check_packed_rows(array["bits"], self.width, "big", "sfp report")
        return array

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        reports = self.check_reports(reports)
        return [
            {
                "kind": kind,
                "position": position,
                "row": row,
                "bits": base64.b64encode(bits.tobytes()).decode("ascii"),
            }
            for kind, position, row, bits in zip(
                reports["kind"].tolist(),
                reports["position"].tolist(),
                reports["row"].tolist(),
                reports["bits"],
                strict=True,
            )
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        reports = np.empty(len(payloads), dtype=self.report_dtype)
        for field in ("kind", "position", "row"):
            reports[field] = check_integer_field(payloads, field)
        row_bytes = self.sketch.row_bytes
        for i, payload in enumerate(payloads):
            reports["bits"][i] = np.frombuffer(decode_bits_field(payload, i, row_bytes), "u1")
        return self.check_reports(reports)

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.cells)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Each slot's reports aggregated by ``cms``, the P + 1 statistics concatenated."""
        reports = self.check_reports(reports)
        slots = np.where(reports["kind"] == 1, reports["position"] + 1, 0)
        order = np.argsort(slots, kind="stable")
        inner = np.empty(slots.size, dtype=self.sketch.report_dtype)
        inner["row"] = reports["row"][order]
        inner["bits"] = reports["bits"][order]
        bounds = np.searchsorted(slots[order], np.arange(self.slots + 1))
        indices: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for slot in range(self.slots):
            start, stop = int(bounds[slot]), int(bounds[slot + 1])
            if stop > start:
                cells, counts = self.sketch.aggregate(inner[start:stop]).nonzero()
                indices.append(cells + slot * self.block)
                values.append(counts)
        empty = np.zeros(0, dtype=np.int64)
        return CountStatistics.sparse(
            slots.size,
            self.cells,
            np.concatenate([empty, *indices]),
            np.concatenate([empty, *values]),
        )

    def blocks(self, stats: CountStatistics) -> list[CountStatistics]:
        """The P + 1 ``cms`` statistics in ``stats`` (whole string, then positions 0..P-1),
        each with its own report count; ValueError if ``stats`` is not this mechanism's."""
        if not isinstance(stats, CountStatistics) or stats.length != self.cells:
            raise ValueError(f"sfp statistics must be a CountStatistics of {self.cells} counts")
        indices, values = stats.nonzero()
        bounds = np.searchsorted(indices, np.arange(self.slots + 1) * self.block)
        parts = []
        for slot in range(self.slots):
            start, stop = int(bounds[slot]), int(bounds[slot + 1])
            cells, counts = indices[start:stop] - slot * self.block, values[start:stop]
            reports = int(counts[cells % (self.width + 1) == 0].sum())
            parts.append(CountStatistics.sparse(reports, self.block, cells, counts))
        if sum(part.n for part in parts) != stats.n:
            raise ValueError(
                f"corrupt sfp statistics: the sketches hold {sum(part.n for part in parts)} "
                f"reports, n = {stats.n}"
            )
        return parts

    def statistics_from_bytes(self, data: bytes) -> CountStatistics:
        """Deserialize, refusing statistics no reports could produce (each sketch checked as
        ``cms`` checks its own, and their reports summing to n)."""
        stats = super().statistics_from_bytes(data)
        for part in self.blocks(stats):
            self.sketch.statistics_from_bytes(part.to_bytes())
        return stats

    def simulate_statistics(
        self, values: Sequence[str], counts: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """The statistics of ``counts[i]`` devices reporting ``values[i]`` once each, with the
        law of ``aggregate(encode(...))`` (module docstring, "Simulation fast path").
        Simulation only: it takes a seeded numpy Generator."""
        raw, totals = string_population(values, counts, rng, self.max_length)
        per_slot = rng.multinomial(totals, np.full(self.slots, 1.0 / self.slots))
        keys = self.fragment_keys(raw)
        prints = [self.sketch.hash.fingerprints(raw)] + [
            fragment_fingerprints(keys[:, position]) for position in range(self.positions)
        ]
        return self._concatenate(
            [
                self.sketch.simulate_fingerprints(fingerprints, per_slot[:, slot], rng)
                for slot, fingerprints in enumerate(prints)
            ]
        )

    def _concatenate(self, parts: Sequence[CountStatistics]) -> CountStatistics:
        """One statistics of the P + 1 sketches' statistics, in slot order."""
        indices = [part.nonzero()[0] + slot * self.block for slot, part in enumerate(parts)]
        values = [part.nonzero()[1] for part in parts]
        return CountStatistics.sparse(
            sum(part.n for part in parts),
            self.cells,
            np.concatenate(indices),
            np.concatenate(values),
        )

    # -- estimation --------------------------------------------------------------------

    def estimate(
        self, stats: CountStatistics, candidates: Sequence[str] | np.ndarray | None = None
    ) -> Estimate:
        """Unbiased frequencies of ``candidates`` (entry i is ``candidates[i]``) among all n
        devices, from the whole-string sketch, with their std (module docstring)."""
        candidates = require_candidates(self.name, candidates)
        factorize_utf8(candidates, self.max_length)
        return self._whole_estimate(self.blocks(stats)[0], stats.n, candidates)

    def _whole_estimate(
        self, whole: CountStatistics, n: int, candidates: Sequence[str] | np.ndarray
    ) -> Estimate:
        """The ``cms`` estimate from the n_0 whole-string reports, its variance plus the
        sample's f (1 - f) (n - n_0) / (n_0 (n - 1))."""
        self._require_reports(whole, "the whole-string sketch")
        inner = self.sketch.estimate(whole, candidates)
        f = np.clip(inner.frequencies, 0.0, 1.0)
        outside = (n - whole.n) / (whole.n * (n - 1)) if n > 1 else 0.0
        std = np.sqrt(inner.std**2 + f * (1 - f) * outside)
        return Estimate(inner.frequencies, std, n)

    def _require_reports(self, part: CountStatistics, what: str) -> None:
        """ValueError unless the sketch ``what`` names holds reports."""
        if part.n <= 0:
            raise ValueError(
                f"{what} has no reports yet; sfp needs reports in "
                f"each of its {self.slots} sketches (a device reports into one, at random)"
            )

    @cached_property
    def _decoder(self) -> tuple[np.ndarray, np.ndarray]:
        """(z, signs), both (k, m): z[j, omega] = C_j^T omega as a 24-bit key and
        signs[j, omega] = (-1)^(omega . e_j), for h_j(x) = e_j XOR C_j x (module docstring,
        "Fragment decoding")."""
        multipliers = self.sketch.hash.multipliers[:, None]  # G_j
        shift = 33 - self.width.bit_length()  # 32 - w: the top w bits are the column
        # coefficient[j, i] = h_j(2^i) XOR e_j: the column change when key bit i is set.
        coefficient = (A_WORDS[None, :] ^ gf32_multiply(B_WORDS[None, :], multipliers)) >> shift
        offset = (A0 ^ gf32_multiply(np.array([B0]), multipliers[:, 0])) >> shift
        w = self.width.bit_length() - 1
        # images[j, b]: the key bits i whose column change has bit b set, i.e. C_j^T e_b.
        column_bits = (coefficient[:, :, None] >> np.arange(w)[None, None, :]) & 1
        images = (column_bits << np.arange(FRAGMENT_BITS)[None, :, None]).sum(axis=1)
        z = np.zeros((self.depth, 1), dtype=np.int64)
        for b in range(w):  # omega's bit b set: XOR its image (columns ordered by omega)
            z = np.concatenate([z, z ^ images[:, b : b + 1]], axis=1)
        parity = np.bitwise_count(np.arange(self.width)[None, :] & offset[:, None]) & 1
        return z, 1 - 2 * parity.astype(np.int64)

    def fragment_frequencies(self, position_stats: CountStatistics) -> np.ndarray:
        """phi(x) for all 2^24 keys x of one position's ``cms`` statistics: the share of its
        reports holding x, estimated as ``cms`` does, by one Walsh-Hadamard transform
        (module docstring, "Fragment decoding")."""
        n = position_stats.n
        if n <= 0:
            raise ValueError("cannot estimate fragments from zero reports")
        return self._decode(self._debiased(position_stats), n, 0.0)

    def _debiased(self, position_stats: CountStatistics) -> np.ndarray:
        """The debiased sketch A = scale S + o of a position, (k, m) float64."""
        table, scale, offsets = self.sketch.sketch_table(position_stats)
        return scale * table + offsets[:, None]

    def _decode(self, sketch: np.ndarray, n: int, peeled: float) -> np.ndarray:
        """(Z(x)/n - kappa (1 - P))/(1 - kappa) for all 2^24 keys x, Z(x) = sum_j
        sketch[j, h_j(x)] by one transform, P = ``peeled`` (module docstring, "Fragment
        decoding" and "Selection")."""
        z, signs = self._decoder
        spectrum = walsh_hadamard(sketch) * signs
        sums: np.ndarray = np.bincount(
            z.reshape(-1), spectrum.reshape(-1), minlength=1 << FRAGMENT_BITS
        )  # float64 (weighted counts)
        walsh_hadamard(sums, out=sums)
        kappa = self.sketch.kappa
        sums *= 1.0 / (self.width * n * (1.0 - kappa))  # the transform's 1/m, then phi's
        sums -= kappa * (1.0 - peeled) / (1.0 - kappa)
        return sums

    def frequent_fragments(self, position_stats: CountStatistics) -> tuple[np.ndarray, np.ndarray]:
        """(keys, phi) of one position's confirmed fragments, at most ``MAX_FRAGMENTS``, in
        the order confirmed (module docstring, "Selection")."""
        n = position_stats.n
        sketch = self._debiased(position_stats)
        z = NormalDist().inv_cdf(1.0 - FALSE_FRAGMENTS / (1 << FRAGMENT_BITS))
        null = float(np.sqrt(self.sketch.frequency_variance(n, 0.0, 0.0)))
        selection = _Selection(float(np.clip(self.sketch.second_moment(position_stats), 0, 1)))
        for _ in range(MAX_ROUNDS):
            decoded_at = selection.peeled
            phi = self._decode(sketch, n, decoded_at)
            phi[selection.keys()] = -np.inf
            pool = np.flatnonzero(phi > z * null - self._drift(1.0))  # none below can pass
            cut = -np.inf  # the largest phi left out of the pool
            if pool.size > MAX_POOL:
                parts = np.argpartition(-phi[pool], MAX_POOL)
                cut = float(phi[pool[parts[MAX_POOL]]])
                pool = pool[parts[:MAX_POOL]]
            self._confirm(sketch, n, pool, phi[pool], z, selection)
            if selection.count >= MAX_FRAGMENTS:
                break
            sigma = np.sqrt(self.sketch.frequency_variance(n, 0.0, selection.rest))
            if cut + self._drift(selection.peeled - decoded_at) <= z * sigma:
                break
        return selection.keys(), selection.values()

    def _drift(self, peeled: float) -> float:
        """The most a key's phi can grow when keys of total phi ``peeled`` are peeled off:
        only the kappa term moves (peeling subtracts reports)."""
        kappa = self.sketch.kappa
        return kappa * peeled / (1.0 - kappa)

    def _phi(self, sketch: np.ndarray, n: int, keys: np.ndarray, peeled: float) -> np.ndarray:
        """phi of ``keys`` from ``sketch`` with a share ``peeled`` of the reports peeled off:
        (Z(x)/n - kappa (1 - P))/(1 - kappa), Z(x) = sum_j sketch[j, h_j(x)]."""
        kappa = self.sketch.kappa
        sums = self.sketch.hash.row_sums(sketch, fragment_fingerprints(keys))
        return (sums / n - kappa * (1.0 - peeled)) / (1.0 - kappa)

    def _confirm(
        self,
        sketch: np.ndarray,
        n: int,
        keys: np.ndarray,
        values: np.ndarray,
        z: float,
        selection: _Selection,
    ) -> None:
        """Judge a pool of ``keys`` whose phi, exact now, are ``values``, peeling each key
        confirmed off ``sketch`` in place; then judge again those that failed while the
        threshold was higher, for as long as keys are confirmed (module docstring,
        "Selection")."""
        floor = z * np.sqrt(self.sketch.frequency_variance(n, 0.0, 0.0))
        while keys.size and selection.count < MAX_FRAGMENTS:
            before = selection.count
            keys, values = self._sweep(sketch, n, keys, values, z, selection)
            if selection.count == before:  # the threshold has not moved
                break
            possible = values > floor - self._drift(1.0 - selection.peeled)
            keys, values = keys[possible], values[possible]

    def _sweep(
        self,
        sketch: np.ndarray,
        n: int,
        keys: np.ndarray,
        bounds: np.ndarray,
        z: float,
        selection: _Selection,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One pass over ``keys`` (phi at most ``bounds`` now), by decreasing bound, in
        batches: each key's phi recomputed from ``sketch``, confirmed above z sigma and
        peeled off ``sketch``. Returns the keys not confirmed with bounds of their phi
        at the end."""
        k, m, kappa = self.depth, self.width, self.sketch.kappa
        rows = np.arange(k)[:, None]
        failed: list[tuple[np.ndarray, np.ndarray, float]] = []  # (keys, phi, at P)
        threshold = z * np.sqrt(self.sketch.frequency_variance(n, 0.0, selection.rest))
        queue, bounds = _sorted_above(keys, bounds, threshold, failed, selection.peeled)
        exact_at, fresh = selection.peeled, True  # bounds hold at P = exact_at; no peel since
        first = np.zeros(0, dtype=np.int64)  # keys judged again first (deferred)
        size = 1
        while selection.count < MAX_FRAGMENTS:
            threshold = z * np.sqrt(self.sketch.frequency_variance(n, 0.0, selection.rest))
            limit = threshold - self._drift(selection.peeled - exact_at)
            live = int(np.searchsorted(-bounds, -limit, side="left"))  # bounds above limit
            if not (first.size or live):
                break
            taken = min(max(size - first.size, 0), live)
            batch = np.concatenate([first, queue[:taken]])
            queue, bounds = queue[taken:], bounds[taken:]
            columns = self.sketch.hash.columns(fragment_fingerprints(batch))  # (k, batch)
            sums = sketch[rows, columns].sum(axis=0)
            phi = (sums / n - kappa * (1.0 - selection.peeled)) / (1.0 - kappa)
            passed = phi > threshold
            failed.append((batch[~passed], phi[~passed], selection.peeled))
            if not passed.any():
                if fresh:  # the best keys left fail: so do the others
                    break
                exact = self._phi(sketch, n, queue, selection.peeled)
                queue, bounds = _sorted_above(queue, exact, threshold, failed, selection.peeled)
                exact_at, fresh, first = selection.peeled, True, first[:0]
                continue
            passed = np.flatnonzero(passed)
            cells = (rows * m + columns[:, passed]).T  # (passed, k)
            clear = _first_claims(cells)  # sharing no cell with a key passed before it
            ok = passed[clear][: MAX_FRAGMENTS - selection.count]
            share = np.repeat(n * phi[ok] / k, k)  # a key's reports, a k-th in each row
            np.subtract.at(sketch.reshape(-1), cells[clear][: ok.size].reshape(-1), share)
            selection.add(batch[ok], phi[ok])
            first = batch[passed[~clear]]  # judged again once the keys before are peeled
            fresh = False
            size = min(2 * size, _CONFIRM_BATCH)
        failed.append((queue, bounds, exact_at))
        left = np.concatenate([keys for keys, _, _ in failed])
        drifted = [phi + self._drift(selection.peeled - at) for _, phi, at in failed]
        return left, np.concatenate(drifted)

    def candidates(self, found: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[str]:
        """The puzzle: strings assembled from one kept fragment per position sharing a tag,
        kept if well-formed and of that tag (module docstring, "Puzzle"). ``found[l]`` is
        (keys, phi) of position l's kept fragments."""
        tags = [keys >> 16 for keys, _ in found]
        common = tags[0]
        for other in tags[1:]:
            common = np.intersect1d(common, other)
        assembled: list[np.ndarray] = []
        wanted: list[np.ndarray] = []
        for tag in np.unique(common).tolist():
            pieces = []
            for (keys, phi), position_tags in zip(found, tags, strict=True):
                mine = np.flatnonzero(position_tags == tag)
                pieces.append(keys[mine[np.argsort(-phi[mine], kind="stable")]] & 0xFFFF)
            kept = _fitting(np.array([piece.size for piece in pieces]), MAX_COMBINATIONS)
            grids = np.meshgrid(*[piece[:kept] for piece in pieces], indexing="ij")
            fragments = np.stack([grid.reshape(-1) for grid in grids], axis=1)
            rows = np.empty((fragments.shape[0], 2 * self.positions), dtype=np.uint8)
            rows[:, 0::2] = fragments >> 8
            rows[:, 1::2] = fragments & 0xFF
            assembled.append(rows)
            wanted.append(np.full(rows.shape[0], tag))
        if not assembled:
            return []
        rows, tag_of = np.concatenate(assembled), np.concatenate(wanted)
        length = self.max_length
        valid = well_formed_prefixes(rows[:, :length], length) & (rows[:, length:] == PAD).all(1)
        raw = [row.tobytes().rstrip(bytes([PAD])) for row in rows[valid]]
        matching = string_tags(raw) == tag_of[valid]
        return [value.decode("utf-8") for value, ok in zip(raw, matching, strict=True) if ok]

    def heavy_hitters(self, stats: CountStatistics, k: int) -> HeavyHitters:
        """The k largest whole-string estimates among the assembled candidates that pass the
        whole-string check (module docstring, "Fragment decoding", "Puzzle"), most frequent
        first; fewer when fewer pass."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_HEAVY_HITTERS:
            raise ValueError(f"k must be an integer in 1..{MAX_HEAVY_HITTERS}, got {k!r}")
        parts = self.blocks(stats)
        names = ["the whole-string sketch"]
        names += [f"the sketch of fragment position {p}" for p in range(self.positions)]
        for part, what in zip(parts, names, strict=True):
            self._require_reports(part, what)
        strings = self.candidates([self.frequent_fragments(part) for part in parts[1:]])
        if not strings:
            return HeavyHitters(np.zeros(0), np.zeros(0), stats.n, strings=())
        found = self._whole_estimate(parts[0], stats.n, strings)
        order = np.argsort(-found.frequencies, kind="stable")
        order = order[found.frequencies[order] > self._whole_threshold(parts[0], len(strings))]
        order = order[:k]
        return HeavyHitters(
            found.frequencies[order],
            found.std[order],
            stats.n,
            strings=tuple(strings[i] for i in order.tolist()),
        )

    def _whole_threshold(self, whole: CountStatistics, candidates: int) -> float:
        """z sigma_0: sigma_0 the std of the whole-string estimate of a string no device
        holds (the ``cms`` std at f = 0, with the collision term of all the mass, F2^), z
        the normal quantile that lets such a string through with probability
        ``FALSE_STRINGS`` / candidates (module docstring, "Puzzle")."""
        second = float(np.clip(self.sketch.second_moment(whole), 0.0, 1.0))
        null = float(np.sqrt(self.sketch.frequency_variance(whole.n, 0.0, second)))
        return NormalDist().inv_cdf(1.0 - FALSE_STRINGS / candidates) * null

    def variance(self, n: int) -> float:
        """Var_cms at f = 0, F = 0 from n / (P + 1) whole-string reports: (P + 1) times the
        ``cms`` variance at n (at F = 0 it is inversely proportional to the reports)."""
        return self.slots * float(self.sketch.frequency_variance(n, 0.0, 0.0))

    # -- exact law, for the privacy tests ----------------------------------------------

    def transition_matrix(self) -> np.ndarray:
        """Exact P[report | the key's columns in every sketch]: inputs are the tuples
        (tau_0, ..., tau_P) of ``cms`` column tuples (tau_0 the whole string's, tau_{1+l}
        the fragment key's at position l; tau_0 most significant), outputs the columns
        slot * (k 2^m) + j 2^m + o (slot 0 the whole string, 1 + l position l; o the bits,
        bit c of o set iff report bit c is 1): the ``cms`` law over 1/(P + 1)."""
        per_sketch = self.sketch.transition_matrix()
        tuples, outputs = per_sketch.shape
        require_enumerable(self.slots * outputs)
        if tuples**self.slots * self.slots * outputs > (1 << 22):
            raise ValueError(
                f"{tuples}^{self.slots} inputs by {self.slots * outputs} reports is too many "
                "to enumerate; use a smaller sketch or max_length"
            )
        inputs = np.indices((tuples,) * self.slots).reshape(self.slots, -1)
        return np.concatenate([per_sketch[inputs[s]] for s in range(self.slots)], 1) / self.slots

    def report_probabilities(self, values: Sequence[str]) -> np.ndarray:
        """Exact P[report | value] for chosen strings, a (len(values), (P + 1) k 2^m) matrix
        with ``transition_matrix``'s columns: each value's row of it, its columns computed
        with the real hashes."""
        raw, codes = factorize_utf8(values, self.max_length)
        per_sketch = self.sketch.transition_matrix()
        keys = self.fragment_keys(raw)
        prints = [self.sketch.hash.fingerprints(raw)] + [
            fragment_fingerprints(keys[:, position]) for position in range(self.positions)
        ]
        rows: list[np.ndarray] = []
        for fingerprints in prints:
            index = np.zeros(len(raw), dtype=np.int64)
            for columns in self.sketch.hash.columns(fingerprints):  # row 0 most significant
                index = index * self.width + columns
            rows.append(per_sketch[index])
        return (np.concatenate(rows, axis=1) / self.slots)[codes]


def _sorted_above(
    keys: np.ndarray,
    values: np.ndarray,
    threshold: float,
    below: list[tuple[np.ndarray, np.ndarray, float]],
    peeled: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The keys whose value exceeds ``threshold``, by decreasing value, with their values;
    the others are added to ``below`` as (keys, values, ``peeled``)."""
    above = values > threshold
    below.append((keys[~above], values[~above], peeled))
    keys, values = keys[above], values[above]
    order = np.argsort(-values, kind="stable")
    return keys[order], values[order]


def _first_claims(cells: np.ndarray) -> np.ndarray:
    """For each row of a (keys, k) matrix of cells: whether none of its cells is in an
    earlier row."""
    owner = np.repeat(np.arange(cells.shape[0]), cells.shape[1])
    _, first, inverse = np.unique(cells.reshape(-1), return_index=True, return_inverse=True)
    mine = (owner[first][inverse] == owner).reshape(cells.shape)
    return np.asarray(mine.all(axis=1))


class _Selection:
    """The keys a position has confirmed so far, their phi, the share of reports peeled off
    (P, the sum of their phi) and the collision mass not yet confirmed (F2^ - sum phi^2)."""

    def __init__(self, second_moment: float) -> None:
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.count = 0
        self.peeled = 0.0
        self.rest = second_moment

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._keys.append(keys)
        self._values.append(values)
        self.count += keys.size
        self.peeled += float(values.sum())
        self.rest = max(self.rest - float(np.sum(values**2)), 0.0)

    def keys(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.int64), *self._keys])

    def values(self) -> np.ndarray:
        return np.concatenate([np.zeros(0), *self._values])


def _fitting(sizes: np.ndarray, limit: int) -> int:
    """The largest r >= 1 with prod(min(sizes, r)) <= limit (r = max(sizes) if all fit)."""
    low, high = 1, int(sizes.max())
    while low < high:
        middle = (low + high + 1) // 2
        if np.prod(np.minimum(sizes, middle).astype(float)) <= limit:
            low = middle
        else:
            high = middle - 1
    return low
