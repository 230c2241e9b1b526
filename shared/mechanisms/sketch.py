"""Apple's Count Mean Sketch (``cms``) and Hadamard Count Mean Sketch (``hcms``).

Apple Differential Privacy Team, "Learning with Privacy at Scale" (2017), Algorithms 1-4
and the analysis of its appendix: strings from an open domain, which nobody lists in
advance, are collected into a k x m sketch, and the server answers the frequency of any
candidate string. Parameters (``MechanismSpec``): ``epsilon``, k = ``sketch_depth`` hash
functions (the sketch's rows) and m = ``sketch_width`` columns (a power of two for
``hcms``). The hash functions h_0..h_{k-1} are the family of ``shared.hashing.SketchHash``
(its bytes are specified there), fixed by (k, m), so every client computes the same ones.

Device, for a string s, with fresh randomness for every report:

* both: a row J uniform on 0..k-1; the string's column in it is h_J(s);
* ``cms`` (Algorithm 1): the vector v in {-1, +1}^m that is +1 only at h_J(s), each
  coordinate flipped independently with probability 1/(1 + e^(eps/2)). Report: J and
  the m signs as bits (1 for +1). Two strings' vectors differ in at most two coordinates,
  so the likelihood ratio is at most ((1 - F)/F)^2 = e^eps, F the flip probability;
* ``hcms`` (Algorithm 3): a coefficient l uniform on 0..m-1 of the Hadamard transform of
  the one-hot vector of h_J(s), that is H[l, h_J(s)] = (-1)^popcount(l & h_J(s)); its
  sign flipped with probability 1/(1 + e^eps). Report: J, l and one bit (1 for +1), a
  likelihood ratio of at most (1 - F)/F = e^eps.

Realized probabilities. ``cms`` flips each bit with probability F / 2^53, F rounded up
from 1/(1 + e^(eps/2)) and stepped up until ((2^53 - F)/F)^2 is proven at most e^eps
(``shared.randomness.certified_threshold``). ``hcms`` keeps the true sign with probability
T / 2^53 and otherwise draws the bit uniformly (binary randomized response,
``shared.mechanisms.grr``), T certified so that (2^53 + T)/(2^53 - T) <= e^eps. In both,
p = P(reported bit = true bit) and q = 1 - p exactly; ``p`` and ``q`` are these realized
values, which the estimator and ``transition_matrix`` use.

Server. A report of row J adds to row J of the debiased sketch A (Apple's sketch matrix is
M = k A):

* ``cms`` (Algorithm 2): A[J, c] += (bit_c - q)/(p - q) for every column c; this is
  Apple's k (c_eps v_c / 2 + 1/2) / k with c_eps = 1/(p - q) = (e^(eps/2) + 1)/(e^(eps/2) - 1);
* ``hcms`` (Algorithm 4): row J of A is H y_J / (p - q), y_J[l] the sum of the signs
  (+1 or -1) reported for coefficient l, the transform back done for all rows at once at
  estimate time (``shared.hadamard.walsh_hadamard``).

Either way the contribution of a report of string d to A[J, c] has expectation
[h_J(d) = c]. Sufficient statistics are integer counts (``CountStatistics``, merged by
addition), debiased only when estimating:

* ``cms``: a (k, m + 1) table flattened by rows: R_j, the reports of row j, then S_jc,
  those with bit c set; A[j, c] = (S_jc - q R_j)/(p - q);
* ``hcms``: the (k, m, 2) histogram of reports (j, l, bit), flattened;
  y_j[l] = count(j, l, 1) - count(j, l, 0).

Estimate (Apple's sketch frequency, with its m/(m - 1) correction). With
Z(s) = sum_j A[j, h_j(s)] (= (1/k) sum_j M[j, h_j(s)]) and n reports,

    f^(s) = (Z(s)/n - kappa) / (1 - kappa),

kappa = P(h_j(s) = h_j(s')) for distinct strings (``SketchHash.collision_probability``):
exactly 1/m when m is a power of two, where f^(s) = (m/(m - 1)) (Z(s)/n - 1/m), the
paper's estimate divided by n. With N_u reports of string u and
pi_u = (1/k) #{j : h_j(u) = h_j(s)}, E[Z(s)] = N_s + sum_{u != s} N_u pi_u, and over the
hash family E[pi_u] = kappa: the estimate is unbiased with the hash functions modelled as
random (SHA-256 as a random function). For the fixed functions, a string's estimate is
off by its own collisions; the last term of the variance is that error's spread.

Variance. A report i of string d_i contributes Y_i to Z(s), with E[Y_i | J] = e_i =
[h_J(d_i) = h_J(s)] and E[Y_i^2 | J] = s0 + s1 e_i, where

    cms:  s0 = p q/(p - q)^2,  s1 = 1   (nominally e^(eps/2)/(e^(eps/2) - 1)^2),
    hcms: s0 = 1/(p - q)^2,    s1 = 0   (nominally ((e^eps + 1)/(e^eps - 1))^2).

Reports are independent given the hash functions; the family's rows collide pairwise
independently, so Var[pi_u] = rho = kappa (1 - kappa)/k, and the pi_u of different
strings are independent. With f = f_s and F = sum_{u != s} f_u^2,

    Var[f^(s)] = ( [s0 + s1 (f + (1 - f) kappa) - f - (1 - f)(kappa^2 + rho)] / n
                   + F rho ) / (1 - kappa)^2

(``frequency_variance``). For ``cms`` with kappa = 1/m it reads
(m/(m - 1))^2 s0/n + ((1 - f)(1 - 1/k)/n + F/k)/(m - 1): the privacy noise; the paper's
hash-collision term, every report of another string colliding with probability 1/m
(sum_{u != s} f_u = 1 - f of them); and the term of hash functions shared by all reports
of a string, which does not shrink with n.

Plug-in. ``estimate`` gives the standard error at f = f^(s) clipped to [0, 1] and
F = F2^ - f^2 clipped to [0, (1 - f)^2] (since sum_{u != s} f_u = 1 - f, F <= (1 - f)^2),
where F2^ (``second_moment``) is the sketch's own unbiased estimate of F2 = sum_u f_u^2:
per report, sum_c Var[contribution to A[J, c]] = m s0 + s1 - 1, so
X = sum_{j,c} A[j, c]^2 - n (m s0 + s1 - 1) is unbiased for
n + (1/k) (P + kappa (n (n - 1) - P)), P = sum_u N_u (N_u - 1) the ordered pairs of reports
of one string (a pair shares a row with probability 1/k, and then collides surely or
with probability kappa), whence F2^ = (P^ + n)/n^2 with
P^ = (k (X - n) - kappa n (n - 1))/(1 - kappa). ``variance(n)`` is the formula at f = 0,
F = 0: a string no device holds, among many small ones.

Queries. Z(s) for a batch of candidates costs one SHA-256 per candidate, then per group
of 8 rows (m <= 8192) four gathers and four XORs of byte tables, and per row one gather
and one add per candidate on an integer table (``SketchHash.query_sums``; int32 when
n < 2^31: |sum_j table[j, c_j]| <= sum_j R_j = n), in blocks of candidates: each block
hashed on the calling thread while up to ``shared.hashing.SKETCH_THREADS`` threads sum
the blocks hashed before (numpy releases the GIL in the gathers and adds; the result
does not depend on the number of threads).

Simulation (``simulate_statistics(strings, counts, rng)``, seeded generators only): exact
in law, each distinct string hashed once, then ``simulate_fingerprints(fingerprints,
totals, rng)``. ``cms`` draws the statistics themselves in O(k m + distinct strings x k):
each string's devices spread over the rows as a multinomial, and S_jc is a sum of two
binomials (``CountMeanSketch.simulate_fingerprints``); ``hcms`` draws every device's
report (O(n) integers).

Reports and payloads:

* ``cms``: a structured array of dtype [("row", int64), ("bits", uint8, ceil(m/8))],
  bits in ``np.packbits`` layout (bit c is bit 7 - c % 8 of byte c // 8, padding 0).
  Payload ``{"row": int, "bits": base64 of the ceil(m/8) packed bytes}``.
* ``hcms``: int64 rows (row, column, bit), column the coefficient l. Payload
  ``{"row": int, "column": int, "bit": 0 or 1}``.

``transition_matrix()`` enumerates the exact law of one report for every tuple of columns
(h_0, ..., h_{k-1}) in 0..m-1 (all a string is to the mechanism), in row-major order
(row 0's column most significant); its columns are j 2^m + o for ``cms`` (bit c of o set
iff report bit c is 1) and j 2m + 2 l + bit for ``hcms``.

Refusal rules and profiles (``shared.integrity``):

* ``cms``: ``"cms.ones_count"``. Whatever the string and row, a report's m bits are
  independent, its column's 1 with probability p = 1 - F / 2^53 and every other with
  q = F / 2^53, so its count of ones is Bernoulli(p) + Binomial(m - 1, q), as a unary
  encoding's (``shared.mechanisms.unary``): refused beyond U or below L, each side's exact
  tail at most 2^-41 (e.g. epsilon 2, m = 1024: U = 381, L = 179, false refusal 6.6e-13).
  The same law gives the ``Profiled`` ability: the histogram of the count, chi-square
  tested.
* ``hcms``: ``"hcms.zero_coefficient"`` at large epsilon only. A report (J, l, bit) has
  (J, l) uniform whatever the string, and each (J, l, bit) is the kept sign (probability
  p / (k m) >= 2^-23) for some string, except bit 0 (sign -1) at l = 0, since
  H[0, c] = +1 for every column c: every string sends it with probability exactly
  q / (k m) = (2^53 - T) / (2^54 k m). That is at most 2^-40 only when e^epsilon is about
  2^40 / (k m) or more (epsilon >= 12.5 at the largest sketch, k m = 2^22); then such
  reports are refused (a forged one lowers every estimate of its row alike), and below it
  there is no rule.
"""

from __future__ import annotations

import base64
import math
from abc import abstractmethod
from collections.abc import Sequence
from fractions import Fraction
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from shared.bitcount import bit_sums
from shared.estimates import Estimate
from shared.hadamard import walsh_hadamard
from shared.hashing import SketchHash
from shared.integrity import FALSE_REFUSAL_BOUND, RefusalRule
from shared.mechanisms.abilities import FRESH, DeviceContext
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
from shared.mechanisms.categorical import (
    MAX_ENUMERATED_OUTPUTS,
    check_true_counts,
    require_enumerable,
)
from shared.mechanisms.grr import k_ary_keep_threshold, k_ary_probabilities, k_ary_response
from shared.mechanisms.registry import register
from shared.mechanisms.strings import (
    OpenStringMechanism,
    StringSpec,
    factorize_utf8,
    require_candidates,
    string_population,
    utf8_values,
)
from shared.mechanisms.unary import (
    BinomialSum,
    OnesCountProfile,
    OnesCountRefusal,
    ones_count_test_of,
)
from shared.randomness import (
    BITS53,
    RandomSource,
    Rng,
    as_source,
    certified_threshold,
    realized_probability,
)
from shared.statistics import CountStatistics

__all__ = ["CountMeanSketch", "HadamardCountMeanSketch", "SketchMechanism"]

#: ``cms`` aggregation sums each row's packed reports with ``bit_sums`` when rows average
#: at least this many reports; rows of fewer reports are unpacked and summed by segment.
_ROW_REPORTS = 64
#: Bits unpacked at once by the segment sums.
_UNPACK_BITS = 1 << 24
#: Strings x rows of one block of ``CountMeanSketch.simulate_fingerprints``'s multinomials.
_SIMULATION_CELLS = 1 << 22


#: Largest count sketch: sketch_depth * sketch_width counts (32 MiB of int64).
MAX_SKETCH_CELLS = 1 << 22


class SketchSpec(StringSpec):
    """A count sketch of ``sketch_depth`` (k) rows of ``sketch_width`` (m) columns."""

    sketch_width: int = Field(
        ge=2,
        le=MAX_SKETCH_CELLS,
        description="cms, hcms, sfp: columns m of the count sketch (hcms: a power of two).",
    )
    sketch_depth: int = Field(
        ge=1,
        le=MAX_SKETCH_CELLS,
        description="cms, hcms, sfp: hash functions k, the rows of the count sketch.",
    )

    @model_validator(mode="after")
    def _sketch_fits(self) -> SketchSpec:
        cells = self.sketch_width * self.sketch_depth
        if cells > MAX_SKETCH_CELLS:
            raise ValueError(
                f"sketch_depth * sketch_width = {cells} counts exceeds {MAX_SKETCH_CELLS}; "
                "use a smaller sketch"
            )
        return self

    def require_power_of_two_width(self) -> None:
        """ValueError unless ``sketch_width`` is a power of two (a Hadamard transform's size)."""
        if self.sketch_width & (self.sketch_width - 1):
            raise ValueError(
                f"sketch_width must be a power of two for {self.mechanism!r} (a Hadamard "
                f"transform's size), got {self.sketch_width}"
            )


class CmsSpec(SketchSpec):
    """``{"mechanism": "cms", "epsilon": 4.0, "sketch_width": 1024, "sketch_depth": 64}``."""

    mechanism: Literal["cms"]


class HcmsSpec(SketchSpec):
    """``{"mechanism": "hcms", "epsilon": 4.0, "sketch_width": 1024, "sketch_depth": 64}``
    (``sketch_width`` a power of two)."""

    mechanism: Literal["hcms"]

    @model_validator(mode="after")
    def _hadamard_width(self) -> HcmsSpec:
        self.require_power_of_two_width()
        return self


class SketchMechanism(OpenStringMechanism, Mechanism[CountStatistics]):
    """What ``cms`` and ``hcms`` share: hashing, the estimate and its variance, the
    second moment, the exact transition matrix (see the module docstring)."""

    spec: SketchSpec

    def __init__(self, spec: SketchSpec) -> None:
        super().__init__(spec)
        self.depth: int = spec.sketch_depth
        self.width: int = spec.sketch_width
        self.hash = SketchHash(self.depth, self.width)
        #: kappa: the probability that two distinct strings share a row's column.
        self.kappa: float = float(self.hash.collision_probability)

    # --- the subclass's randomizer and statistics -----------------------------------------

    @property
    @abstractmethod
    def p(self) -> float:
        """Realized P(reported bit = true bit)."""

    @property
    @abstractmethod
    def q(self) -> float:
        """Realized P(reported bit = the other bit), exactly 1 - p."""

    @property
    @abstractmethod
    def report_moments(self) -> tuple[float, float]:
        """(s0, s1): a report's contribution Y to a column has E[Y^2 | row] = s0 + s1 e,
        e = 1 if the report's string has that column in its row, else 0."""

    @abstractmethod
    def _perturb(self, rows: np.ndarray, columns: np.ndarray, source: RandomSource) -> np.ndarray:
        """Reports of strings whose column in row ``rows[i]`` is ``columns[i]``."""

    @abstractmethod
    def sketch_table(self, stats: CountStatistics) -> tuple[np.ndarray, float, np.ndarray]:
        """(G, scale, offsets): an integer (k, m) table G with the debiased sketch
        A = scale G + offsets[:, None] (module docstring, "Server")."""

    @abstractmethod
    def _row_output_matrix(self) -> np.ndarray:
        """P[output of a report of row j | the string's column in row j], (m, outputs)."""

    # --- device side ------------------------------------------------------------------

    def encode(
        self, values: Sequence[str] | np.ndarray, rng: Rng = None, context: DeviceContext = FRESH
    ) -> np.ndarray:
        """Reports of ``values`` (strings, one per device), each string hashed once.

        ``context`` is not used: nothing about a device is permanent here, every report
        draws its row and its noise afresh from ``rng`` (``None``: the OS CSPRNG).
        """
        raw, codes = factorize_utf8(values)
        return self.encode_fingerprints(self.hash.fingerprints(raw)[codes], rng)

    def encode_fingerprints(
        self, fingerprints: np.ndarray, rng: Rng | RandomSource = None
    ) -> np.ndarray:
        """Reports of strings given by their fingerprints ((n, 2) int64, ``SketchHash``):
        a uniform row each, then the randomizer of the string's column there."""
        source = as_source(rng)
        rows = source.integers(self.depth, fingerprints.shape[0])
        return self._perturb(rows, self.hash.positions(fingerprints, rows), source)

    # --- server side ------------------------------------------------------------------

    def estimate(
        self, stats: CountStatistics, candidates: Sequence[str] | np.ndarray | None = None
    ) -> Estimate:
        """Unbiased frequencies of ``candidates`` (entry i is ``candidates[i]``) with their
        plug-in standard errors (module docstring: "Estimate", "Variance", "Plug-in")."""
        candidates = require_candidates(self.name, candidates)
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        n = stats.n
        table, scale, offsets = self.sketch_table(stats)
        sums = scale * self._query_sums(table, utf8_values(candidates), n) + float(offsets.sum())
        frequencies = (sums / n - self.kappa) / (1.0 - self.kappa)
        at = np.clip(frequencies, 0.0, 1.0)
        others = np.clip(self._second_moment(table, scale, offsets, n) - at**2, 0.0, (1 - at) ** 2)
        std = np.sqrt(self.frequency_variance(n, at, others))
        return Estimate(frequencies, std, n)

    def _query_sums(self, table: np.ndarray, values: list[bytes], n: int) -> np.ndarray:
        """sum_j table[j, h_j(s)] for every UTF-8 string (int64), summed in int32 when
        n < 2^31 (|sum_j table[j, c_j]| <= sum_j R_j = n)."""
        dtype = np.int32 if n < 2**31 else np.int64
        return self.hash.query_sums(np.asarray(table, dtype=dtype), values)

    def second_moment(self, stats: CountStatistics) -> float:
        """F2^, unbiased for sum_u f_u^2 over all strings (module docstring, "Plug-in")."""
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        table, scale, offsets = self.sketch_table(stats)
        return self._second_moment(table, scale, offsets, stats.n)

    def _second_moment(self, table: np.ndarray, scale: float, offsets: np.ndarray, n: int) -> float:
        s0, s1 = self.report_moments
        debiased = scale * table + offsets[:, None]
        excess = float(np.einsum("jc,jc->", debiased, debiased)) - n * (self.width * s0 + s1 - 1)
        same = (self.depth * (excess - n) - self.kappa * n * (n - 1)) / (1.0 - self.kappa)
        return (same + n) / n**2

    def frequency_variance(
        self, n: int, frequency: float | np.ndarray, others_second_moment: float | np.ndarray
    ) -> np.ndarray:
        """Var[f^(s)] at f_s = ``frequency`` and sum_{u != s} f_u^2 = ``others_second_moment``
        (module docstring, "Variance")."""
        s0, s1 = self.report_moments
        kappa = self.kappa
        rho = kappa * (1.0 - kappa) / self.depth
        f = np.asarray(frequency, dtype=np.float64)
        others = np.asarray(others_second_moment, dtype=np.float64)
        per_report = s0 + s1 * (f + (1 - f) * kappa) - f - (1 - f) * (kappa**2 + rho)
        return (per_report / n + others * rho) / (1.0 - kappa) ** 2

    def variance(self, n: int) -> float:
        """Var[f^(s)] of a string no device holds, among many small ones (f = 0, F = 0)."""
        return float(self.frequency_variance(n, 0.0, 0.0))

    # --- simulation fast path -----------------------------------------------------------

    def simulate_statistics(
        self, values: Sequence[str], counts: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """The statistics of ``counts[i]`` devices reporting ``values[i]`` once each, every
        distinct string hashed once (``simulate_fingerprints``). Simulation only: it takes
        a seeded numpy Generator."""
        raw, totals = string_population(values, counts, rng)
        return self.simulate_fingerprints(self.hash.fingerprints(raw), totals, rng)

    def simulate_fingerprints(
        self, fingerprints: np.ndarray, totals: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """The statistics of ``totals[i]`` devices whose strings have ``fingerprints[i]``,
        each reporting once: their reports drawn as ``encode`` draws them (exact, O(n))."""
        totals = check_true_counts(totals, fingerprints.shape[0], rng)
        repeated = np.repeat(fingerprints, totals, axis=0)
        return self.aggregate(self.encode_fingerprints(repeated, rng))

    # --- exact law, for the privacy tests ----------------------------------------------

    def transition_matrix(self) -> np.ndarray:
        """Exact P[report | the string's columns (h_0, ..., h_{k-1})] over all m^k tuples
        (layout in the module docstring); refused for large k, m."""
        per_row = self._row_output_matrix()
        outputs = self.depth * per_row.shape[1]
        require_enumerable(outputs)
        if self.width**self.depth * outputs > MAX_ENUMERATED_OUTPUTS * 64:
            raise ValueError(
                f"{self.width}^{self.depth} column tuples by {outputs} reports is too many "
                "to enumerate; use a smaller sketch"
            )
        tuples = np.indices((self.width,) * self.depth).reshape(self.depth, -1)
        blocks = [per_row[tuples[row]] for row in range(self.depth)]
        return np.concatenate(blocks, axis=1) / self.depth


@register
class CountMeanSketch(OnesCountRefusal, SketchMechanism, OnesCountProfile):
    """Apple's Count Mean Sketch: m noisy sign bits per report (module docstring)."""

    name = "cms"
    spec_model = CmsSpec
    payload_schema = payload_shape(
        "SketchBitsPayload",
        "cms: the sketch row, and base64 of the sketch_width signs as numpy.packbits "
        "bytes, 1 for +1.",
        row=INTEGER,
        bits=BASE64,
    )

    def __init__(self, spec: SketchSpec) -> None:
        super().__init__(spec)
        self.row_bytes: int = (self.width + 7) // 8
        self.report_dtype = np.dtype([("row", "<i8"), ("bits", np.uint8, (self.row_bytes,))])

    @cached_property
    def flip_threshold(self) -> int:
        """F: each bit flips with probability F / 2^53, F rounded up from 1/(1 + e^(eps/2))
        and certified: ((2^53 - F)/F)^2 <= e^eps."""
        return certified_threshold(
            1.0 / (1.0 + math.exp(self.epsilon / 2)),
            "up",
            lambda t: Fraction(BITS53 - t, t) ** 2,
            self.epsilon,
        )

    @property
    def p(self) -> float:
        """Realized P(bit kept) = 1 - F / 2^53, nominally e^(eps/2)/(1 + e^(eps/2))."""
        return realized_probability(BITS53 - self.flip_threshold)

    @property
    def q(self) -> float:
        return realized_probability(self.flip_threshold)

    @property
    def report_moments(self) -> tuple[float, float]:
        """s0 = p q/(p - q)^2, s1 = 1."""
        gap = realized_probability(BITS53 - 2 * self.flip_threshold)  # p - q, exactly
        return self.p * self.q / gap**2, 1.0

    def _perturb(self, rows: np.ndarray, columns: np.ndarray, source: RandomSource) -> np.ndarray:
        """Flip noise for every bit, XOR the one-hot bit of each report's column."""
        size = rows.size
        bits = source.bernoulli_bits(self.flip_threshold, size, self.width)
        index = np.arange(size) * self.row_bytes + (columns >> 3)
        bits.reshape(-1)[index] ^= (0x80 >> (columns & 7)).astype(np.uint8)
        reports = np.empty(size, dtype=self.report_dtype)
        reports["row"] = rows
        reports["bits"] = bits
        return reports

    def ones_count_law(self) -> BinomialSum:
        """Bernoulli(p) + Binomial(m - 1, q): the report's column and the m - 1 others."""
        return (1, self.p), (self.width - 1, self.q)

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """The one law of every string and row, twice: the rule's tails are exact."""
        return self.ones_count_law(), self.ones_count_law()

    def ones_count_test(self) -> str:
        return ones_count_test_of(self.ones_count_law())

    def report_bit_rows(self, reports: np.ndarray) -> np.ndarray:
        """The reports' packed sign bits."""
        return reports["bits"]

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.dtype != self.report_dtype or array.ndim != 1:
            raise ValueError(
                f"cms reports must be a one-dimensional array of dtype {self.report_dtype}, "
                f"got {array.dtype} {array.shape}"
            )
        as_index_array(array["row"], self.depth, "report row")
        check_packed_rows(array["bits"], self.width, "big", "cms report")
        return array

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        reports = self.check_reports(reports)
        return [
            {"row": row, "bits": base64.b64encode(bits.tobytes()).decode("ascii")}
            for row, bits in zip(reports["row"].tolist(), reports["bits"], strict=True)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        reports = np.empty(len(payloads), dtype=self.report_dtype)
        reports["row"] = check_integer_field(payloads, "row")
        for i, payload in enumerate(payloads):
            reports["bits"][i] = np.frombuffer(decode_bits_field(payload, i, self.row_bytes), "u1")
        return self.check_reports(reports)

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.depth * (self.width + 1))

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Per row present: R_j and the bit sums S_jc (sparse over the rows present)."""
        reports = self.check_reports(reports)
        rows, bits = reports["row"], np.ascontiguousarray(reports["bits"])
        counts = np.bincount(rows, minlength=self.depth)
        present = np.flatnonzero(counts)
        per_row = counts[present]
        narrow = np.uint16 if self.depth <= 1 << 16 else np.uint32  # rows < k <= 2^24
        order = np.argsort(rows.astype(narrow), kind="stable")  # 16 bits: a radix sort
        table = np.zeros((present.size, self.width + 1), dtype=np.int64)
        table[:, 0] = per_row
        if present.size * _ROW_REPORTS <= rows.size:  # a loop over rows, not reports
            gathered = np.empty((int(per_row.max(initial=0)), self.row_bytes), dtype=np.uint8)
            start = 0
            for i, count in enumerate(per_row.tolist()):  # a row's reports, gathered in cache
                mine = gathered[:count]
                np.take(bits, order[start : start + count], axis=0, out=mine, mode="clip")
                table[i, 1:] = bit_sums(mine, self.width)
                start += count
        else:
            segments = np.repeat(np.arange(present.size), per_row)
            self._segment_sums(np.take(bits, order, axis=0), segments, table[:, 1:])
        cells = present[:, None] * (self.width + 1) + np.arange(self.width + 1)
        return CountStatistics.sparse(
            rows.size, self.depth * (self.width + 1), cells.reshape(-1), table.reshape(-1)
        )

    def _segment_sums(self, bits: np.ndarray, segments: np.ndarray, out: np.ndarray) -> None:
        """out[segments[i]] += the unpacked bits of report i (segments non-decreasing), a
        block of reports at a time."""
        block = max(1, _UNPACK_BITS // self.width)
        for start in range(0, segments.size, block):
            unpacked = np.unpackbits(bits[start : start + block], axis=1, count=self.width)
            owner = segments[start : start + block]
            starts = np.flatnonzero(np.diff(owner, prepend=-1))
            out[owner[starts]] += np.add.reduceat(unpacked, starts, axis=0, dtype=np.int64)

    def statistics_from_bytes(self, data: bytes) -> CountStatistics:
        """Deserialize, refusing tables no reports could produce (row counts that do not sum
        to n, a bit count above its row's reports); O(nonzero + k)."""
        stats = super().statistics_from_bytes(data)
        cells, values = stats.nonzero()
        row, column = np.divmod(cells, self.width + 1)
        heads = column == 0
        per_row = np.zeros(self.depth, dtype=np.int64)
        per_row[row[heads]] = values[heads]
        if int(per_row.sum()) != stats.n:
            raise ValueError(
                f"corrupt cms statistics: row counts sum to {int(per_row.sum())}, n = {stats.n}"
            )
        if np.any(values[~heads] > per_row[row[~heads]]):
            raise ValueError("corrupt cms statistics: a bit count exceeds its row's reports")
        return stats

    def sketch_table(self, stats: CountStatistics) -> tuple[np.ndarray, float, np.ndarray]:
        """A[j, c] = (S_jc - q R_j)/(p - q): G = S, scale 1/(p - q), offsets -q R_j/(p - q)."""
        table = stats.counts.reshape(self.depth, self.width + 1)
        flip = self.flip_threshold
        scale = BITS53 / (BITS53 - 2 * flip)
        return table[:, 1:], scale, -(flip / (BITS53 - 2 * flip)) * table[:, 0]

    def simulate_fingerprints(
        self, fingerprints: np.ndarray, totals: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """Exact, in O(k m + len(totals) k) whatever n is: each string's devices spread over
        the rows as a multinomial; H_jc devices of row j have column c there, so
        S_jc ~ Bin(H_jc, p) + Bin(R_j - H_jc, q) (independent bits, realized p and q)."""
        totals = check_true_counts(totals, fingerprints.shape[0], rng)
        k, m = self.depth, self.width
        per_row = np.zeros(k, dtype=np.int64)
        hits = np.zeros((k, m), dtype=np.int64)
        block = max(1, _SIMULATION_CELLS // k)
        for start in range(0, totals.size, block):
            assigned = rng.multinomial(totals[start : start + block], np.full(k, 1.0 / k))
            per_row += assigned.sum(axis=0)
            walk = self.hash.walk(fingerprints[start : start + block])
            for row, columns in enumerate(walk):
                hits[row] += np.bincount(columns, assigned[:, row], minlength=m).astype(np.int64)
        ones = rng.binomial(hits, self.p) + rng.binomial(per_row[:, None] - hits, self.q)
        table = np.concatenate([per_row[:, None], ones], axis=1)
        return CountStatistics(int(totals.sum()), table.reshape(-1))

    def _row_output_matrix(self) -> np.ndarray:
        """p^a q^(m - a), a = how many of the m bits of output o agree with the one-hot
        vector of the column."""
        m = self.width
        require_enumerable(2**m)
        bits = (np.arange(2**m)[None, :] >> np.arange(m)[:, None]) & 1  # (cell, output)
        agree = (np.eye(m, dtype=np.int64)[:, :, None] == bits[None, :, :]).sum(axis=1)
        return self.p**agree * self.q ** (m - agree)


@register
class HadamardCountMeanSketch(SketchMechanism):
    """Apple's Hadamard Count Mean Sketch: one noisy Hadamard coefficient per report."""

    name = "hcms"
    spec_model = HcmsSpec
    payload_schema = payload_shape(
        "SketchSignPayload",
        "hcms: the sketch row, the Hadamard coefficient's column, and its sign bit, 0 or 1.",
        row=INTEGER,
        column=INTEGER,
        bit=INTEGER,
    )

    @cached_property
    def keep_threshold(self) -> int:
        """T: the true sign is kept with probability T / 2^53, else drawn uniformly
        (``k_ary_keep_threshold`` for 2 values: (2^53 + T)/(2^53 - T) <= e^eps)."""
        return k_ary_keep_threshold(self.epsilon, 2)

    @property
    def p(self) -> float:
        """Realized (2^53 + T)/2^54, nominally e^eps/(1 + e^eps)."""
        return k_ary_probabilities(self.keep_threshold, 2)[0]

    @property
    def q(self) -> float:
        """Realized (2^53 - T)/2^54, nominally 1/(1 + e^eps)."""
        return k_ary_probabilities(self.keep_threshold, 2)[1]

    @cached_property
    def _zero_coefficient_rule(self) -> RefusalRule | None:
        """The rule refusing sign -1 at coefficient 0, when its honest probability
        q / (k m) = (2^53 - T) / (2^54 k m) is at most 2^-40 (module docstring)."""
        chance = Fraction(BITS53 - self.keep_threshold, 2 * BITS53 * self.depth * self.width)
        if chance > Fraction(FALSE_REFUSAL_BOUND):
            return None
        return RefusalRule(
            "hcms.zero_coefficient",
            "sign -1 (bit 0) at coefficient 0, where every string's sign is +1",
            float(chance),
        )

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """``"hcms.zero_coefficient"`` at large epsilon, else none."""
        rule = self._zero_coefficient_rule
        return () if rule is None else (rule,)

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        """0 for a report of bit 0 at coefficient 0 while the rule holds, else -1."""
        reports = np.asarray(reports)
        broken = (reports[:, 1] == 0) & (reports[:, 2] == 0)
        if self._zero_coefficient_rule is None:
            broken[:] = False
        return np.where(broken, 0, -1).astype(np.int8)

    def refusal_detail(self, report: np.ndarray) -> str:
        row, column, bit = (int(x) for x in report)
        return f"row {row}, coefficient {column}, sign {'+1' if bit else '-1'}"

    @property
    def report_moments(self) -> tuple[float, float]:
        """s0 = 1/(p - q)^2 = (2^53 / T)^2, s1 = 0."""
        return (BITS53 / self.keep_threshold) ** 2, 0.0

    def _perturb(self, rows: np.ndarray, columns: np.ndarray, source: RandomSource) -> np.ndarray:
        """A uniform coefficient l; bit 1 iff H[l, column] = +1; binary randomized response."""
        coefficients = source.integers(self.width, rows.size)
        true_bits = ((np.bitwise_count(coefficients & columns) & 1) ^ 1).astype(np.int64)
        bits = k_ary_response(true_bits, 2, self.keep_threshold, source)
        return np.stack([rows, coefficients, bits], axis=1)

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array = np.asarray(reports)
        if array.ndim != 2 or array.shape[1] != 3:
            raise ValueError(
                f"hcms reports must be rows (row, column, bit), got shape {array.shape}"
            )
        as_index_array(array[:, 0], self.depth, "report row")
        as_index_array(array[:, 1], self.width, "report column")
        as_index_array(array[:, 2], 2, "report bit")
        return array.astype(np.int64)

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [
            {"row": row, "column": column, "bit": bit}
            for row, column, bit in self.check_reports(reports).tolist()
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        fields = [check_integer_field(payloads, field) for field in ("row", "column", "bit")]
        return self.check_reports(np.stack(fields, axis=1))

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(2 * self.depth * self.width)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """The histogram of (row, column, bit): sparse for few reports, else dense."""
        reports = self.check_reports(reports)
        cells = (reports[:, 0] * self.width + reports[:, 1]) * 2 + reports[:, 2]
        length = 2 * self.depth * self.width
        if 8 * cells.size < length:
            present, counts = np.unique(cells, return_counts=True)
            return CountStatistics.sparse(cells.size, length, present, counts)
        return CountStatistics(cells.size, np.bincount(cells, minlength=length))

    def statistics_from_bytes(self, data: bytes) -> CountStatistics:
        """Deserialize, refusing histograms whose counts do not sum to n."""
        stats = super().statistics_from_bytes(data)
        total = int(stats.nonzero()[1].sum())
        if total != stats.n:
            raise ValueError(f"corrupt hcms statistics: counts sum to {total}, n = {stats.n}")
        return stats

    def sketch_table(self, stats: CountStatistics) -> tuple[np.ndarray, float, np.ndarray]:
        """A = H y / (p - q) per row: G = H y (exact integers), scale 2^53 / T, no offsets."""
        histogram = stats.counts.reshape(self.depth, self.width, 2)
        signs = histogram[:, :, 1] - histogram[:, :, 0]
        return walsh_hadamard(signs), BITS53 / self.keep_threshold, np.zeros(self.depth)

    def _row_output_matrix(self) -> np.ndarray:
        """P[(l, bit) | column] = (p if bit is H[l, column]'s sign bit else q) / m."""
        m = self.width
        columns = np.arange(m)
        true_bit = (np.bitwise_count(columns[:, None] & columns[None, :]) & 1) ^ 1  # (col, l)
        law = np.empty((m, m, 2))
        law[:, :, 1] = np.where(true_bit == 1, self.p, self.q)
        law[:, :, 0] = np.where(true_bit == 0, self.p, self.q)
        return law.reshape(m, 2 * m) / m
