"""Count Mean Sketch (``cms``) and Hadamard Count Mean Sketch (``hcms``):
``shared.mechanisms.sketch`` and the sketch hash family of ``shared.hashing``.

* Hashing: published test vectors, an independent bit-by-bit reference of the family (its
  row multipliers the distinct words of the SHAKE-256 stream, repeats skipped), the
  field's modulus irreducible (Rabin's test), the row walk and the row sums of a table (a
  query) equal to direct evaluation for every lane layout, the collision probability
  kappa exact, rows colliding pairwise independently, and the number of rows pairs of
  strings share binomial, tail included (no twins beyond chance).
* Privacy, exactly: for small (k, m) every report of every tuple of columns is enumerated
  as Fractions built from the realized 53-bit thresholds; the largest likelihood ratio is
  proven at most e^epsilon (``ratio_within_epsilon``, 60-digit exponentials) and lies
  within 1e-9 of it; the float ``transition_matrix`` agrees, and OpenDP's check holds at
  epsilon and fails just below.
* Samplers: chi-square goodness of fit of ``encode`` against ``transition_matrix`` rows
  (batches and single small batches), and binomial tests of every bit of a padded row.
* Estimator: over populations of fresh strings (so hash collisions vary as the estimator's
  analysis assumes), the frequency estimate is unbiased with the variance of
  ``frequency_variance`` (noise, collision and shared-hash terms: small m makes the
  collision terms large), the second moment F2^ is unbiased, and the simulation fast path
  draws the exact law of the sketch cells (from strings, and from fingerprints given with
  repeats); the variance formula equals its closed forms.
* Statistics: aggregation paths equal a direct count, merging is associative and
  commutative and equals aggregating the union, bytes round trip, corrupt tables refused.
* Wire: payload round trips and every kind of bad payload, bad reports and bad specs.

Tolerances. Every statistical assertion has a false-failure rate of at most ALPHA = 1e-6
(Bonferroni where one test makes several; mean and variance checks use the normal
approximation of sums of over a thousand independent terms at |z| <= 5, two-sided
5.7e-7). Seeds are fixed, so outcomes are deterministic; the 15 statistical items (the
estimator and cell-law ones at most 9e-6 each, the others 1e-6) make a false failure of
the file below 5e-5 for a random seed.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import threading
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from itertools import product
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared import hashing
from shared.hashing import GF32_REDUCTION, SketchHash, gf32_multiply, sketch_key
from shared.mechanisms import as_discovery, sketch
from shared.mechanisms.sketch import CountMeanSketch, HadamardCountMeanSketch
from shared.randomness import BITS53, ratio_within_epsilon
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
#: |z| beyond which a normal-approximation check fails: P(|Z| > 5) = 5.7e-7 < ALPHA.
Z_LIMIT = 5.0
#: Relative distance from e^epsilon within which the enumerated ratio must lie (tightness).
TIGHT = 1e-9
#: Relative slack of float matrices against the exact bound (products of a few doubles).
RATIO_RTOL = 1e-12
CLASSES: dict[str, Any] = {"cms": CountMeanSketch, "hcms": HadamardCountMeanSketch}


def build(name: str, epsilon: float, width: int, depth: int) -> Any:
    spec = MechanismSpec.model_validate(
        {"mechanism": name, "epsilon": epsilon, "sketch_width": width, "sketch_depth": depth}
    )
    return CLASSES[name](spec)


# ---------------------------------------------------------------------------------------
# The hash family
# ---------------------------------------------------------------------------------------


def reference_multiply(left: int, right: int) -> int:
    """Carry-less product in GF(2)[x] / (x^32 + x^7 + x^3 + x^2 + 1), bit by bit."""
    result = 0
    for bit in range(32):
        if right >> bit & 1:
            result ^= left
        left <<= 1
        if left >> 32:
            left ^= (1 << 32) | 0x8D
    return result


def reference_key(depth: int, width: int) -> bytes:
    return b"LDP sketch v1\x00" + depth.to_bytes(4, "big") + width.to_bytes(4, "big")


def reference_multipliers(depth: int, width: int) -> tuple[list[int], int]:
    """G_0..G_{k-1}: the big-endian 32-bit words of SHAKE-256(key) in order, a word equal to
    an earlier one skipped; and how many were skipped."""
    stream = hashlib.shake_256(reference_key(depth, width)).digest(4 * depth + 256)
    kept: list[int] = []
    seen: set[int] = set()
    position = 0
    while len(kept) < depth:
        word = int.from_bytes(stream[position : position + 4], "big")
        position += 4
        if word not in seen:
            seen.add(word)
            kept.append(word)
    return kept, position // 4 - depth


def reference_columns(text: str, depth: int, width: int) -> list[int]:
    """h_0..h_{k-1} of ``text`` straight from the specification in ``shared.hashing``."""
    digest = hashlib.sha256(reference_key(depth, width) + text.encode("utf-8")).digest()
    a, b = int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:8], "big")
    multipliers, _ = reference_multipliers(depth, width)
    return [((a ^ reference_multiply(b, g)) * width) >> 32 for g in multipliers]


#: (string, k, m, columns h_0..h_{k-1}): for clients in other languages to match.
TEST_VECTORS = [
    ("abc", 4, 2048, [69, 1922, 1137, 1402]),
    ("", 3, 1000, [796, 513, 890]),
    ("héllo wörld", 5, 7, [2, 5, 4, 2, 3]),
    ("emoji 😀", 6, 2, [1, 0, 1, 0, 0, 1]),
]
#: The row multipliers G_0..G_3 of k = 4, m = 2048.
MULTIPLIERS_4_2048 = [0xBC5815A6, 0xA27B502F, 0xE0EAE960, 0xC69E7D97]


def walked(family: SketchHash, fingerprints: np.ndarray) -> np.ndarray:
    """(k, n): every row's columns from ``walk`` (copied: it reuses one buffer)."""
    return np.array([columns.copy() for columns in family.walk(fingerprints)])


@pytest.mark.parametrize(("text", "depth", "width", "expected"), TEST_VECTORS)
def test_sketch_hash_test_vectors(text: str, depth: int, width: int, expected: list[int]) -> None:
    family = SketchHash(depth, width)
    assert (
        family.key
        == sketch_key(depth, width)
        == b"LDP sketch v1\x00" + bytes([0, 0, 0, depth, *width.to_bytes(4, "big")])
    )
    assert reference_columns(text, depth, width) == expected
    fingerprints = family.fingerprints([text.encode("utf-8")])
    assert walked(family, fingerprints)[:, 0].tolist() == expected
    assert family.columns(fingerprints)[:, 0].tolist() == expected
    rows = np.arange(depth)
    assert family.positions(np.repeat(fingerprints, depth, axis=0), rows).tolist() == expected


def test_row_multipliers_are_the_distinct_words_of_the_stream() -> None:
    """The published multipliers of k = 4, m = 2048; and at k = 2^17, m = 2, where the stream
    repeats two words among its first k, the repeats are skipped."""
    assert SketchHash(4, 2048).multipliers.tolist() == MULTIPLIERS_4_2048
    assert reference_multipliers(4, 2048) == (MULTIPLIERS_4_2048, 0)
    depth = 1 << 17
    expected, skipped = reference_multipliers(depth, 2)
    assert skipped == 2
    multipliers = SketchHash(depth, 2).multipliers
    assert multipliers.tolist() == expected and np.unique(multipliers).size == depth


@pytest.mark.parametrize(
    ("depth", "width"),
    [
        (1, 2),
        (37, 5),
        (16, 1000),
        (9, 4096),
        (3, 3),
        (2, 1 << 22),
        (19, 256),
        (7, 1 << 16),
        (2, 1 << 31),
    ],
)
def test_walk_and_positions_match_the_reference(
    depth: int, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows beyond m (k > m), odd and power-of-two widths, the largest width (2^31, whose
    31 bits leave no room for a lane index: all 32 kept and scaled); lanes of 8, 16 and 32
    bits, the last group of rows partly filled; the byte tables kept or built anew on each
    walk, 8 rows at a time rounded up to whole groups."""
    monkeypatch.setattr(hashing, "_TABLE_ROWS", 8)
    if depth == 19:
        monkeypatch.setattr(hashing, "_KEPT_TABLE_WORDS", 0)
    texts = [f"s{i}" for i in range(25)] + ["", "naïve", "\x00"]
    family = SketchHash(depth, width)
    fingerprints = family.fingerprints([text.encode("utf-8") for text in texts])
    expected = np.array([reference_columns(text, depth, width) for text in texts]).T
    np.testing.assert_array_equal(walked(family, fingerprints), expected)
    for row in range(depth):
        rows = np.full(len(texts), row)
        np.testing.assert_array_equal(family.positions(fingerprints, rows), expected[row])


@pytest.mark.parametrize(
    ("depth", "width", "dtype"),
    [
        (19, 2, np.int32),
        (5, 16, np.float64),
        (37, 32, np.int32),
        (9, 8192, np.int64),
        (3, 1 << 14, np.float64),
        (6, 1000, np.int32),
        (4, 3, np.float64),
    ],
)
def test_row_sums_match_the_reference(
    depth: int, width: int, dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sum_j table[j, h_j(s)] against the reference columns: lanes of 8 bits (m = 2, the
    narrowest, and m = 16, the widest with room for a lane index among 16), of 16 bits
    (m = 32 and 8192) and of 32 bits (m = 2^14), m not a power of two (all 32 bits kept
    and scaled), the last group of rows partly filled, integer and real tables, several
    blocks of strings and one partial (blocks of 4), tables kept or built anew."""
    monkeypatch.setattr(hashing, "_SUM_BLOCK", 4)
    if depth == 37:
        monkeypatch.setattr(hashing, "_KEPT_TABLE_WORDS", 0)
    texts = [f"t{i}" for i in range(13)] + ["", "naïve"]
    family = SketchHash(depth, width)
    rng = np.random.default_rng(depth * width)
    table: np.ndarray = rng.integers(-1000, 1000, (depth, width)).astype(dtype)
    if dtype is np.float64:
        table += rng.random((depth, width))
    expected = [
        sum(table[row, column] for row, column in enumerate(reference_columns(t, depth, width)))
        for t in texts
    ]
    sums = family.row_sums(table, family.fingerprints([t.encode() for t in texts]))
    assert sums.dtype == (np.float64 if dtype is np.float64 else np.int64)
    np.testing.assert_allclose(sums, expected, rtol=1e-12)
    with pytest.raises(ValueError, match="table"):
        family.row_sums(table[:, :1], family.fingerprints([b"x"]))


def test_field_modulus_is_irreducible_and_multiplication_matches() -> None:
    """Rabin's test for degree 32 (its only prime divisor is 2): x^(2^32) = x mod f and
    gcd(x^(2^16) - x, f) = 1; then the vectorized product equals the bitwise reference."""
    modulus = (1 << 32) | GF32_REDUCTION

    def frobenius(times: int) -> int:  # x^(2^times) mod f
        value = 2
        for _ in range(times):
            value = reference_multiply(value, value)
        return value

    def gcd(left: int, right: int) -> int:
        while right:
            while left and left.bit_length() >= right.bit_length():
                left ^= right << (left.bit_length() - right.bit_length())
            left, right = right, left
        return left

    assert frobenius(32) == 2
    assert gcd(modulus, frobenius(16) ^ 2) == 1
    rng = np.random.default_rng(3)
    left, right = rng.integers(0, 1 << 32, (2, 500))
    expected = [reference_multiply(int(a), int(b)) for a, b in zip(left, right, strict=True)]
    assert gf32_multiply(left, right).tolist() == expected


@pytest.mark.parametrize("width", [2, 3, 1000, 2048, (1 << 22) - 1])
def test_collision_probability(width: int) -> None:
    """kappa = sum_c (|C_c| / 2^32)^2 with |C_c| = ceil((c + 1) 2^32 / m) - ceil(c 2^32 / m):
    1/m for powers of two, within a relative m^2 / 2^66 of it otherwise."""
    kappa = SketchHash(1, width).collision_probability
    edges = [-((-c << 32) // width) for c in range(width + 1)] if width < 5000 else None
    if edges is not None:
        sizes = [high - low for low, high in zip(edges, edges[1:], strict=False)]
        assert sum(sizes) == 1 << 32
        assert kappa == Fraction(sum(size * size for size in sizes), 1 << 64)
    if width & (width - 1) == 0:
        assert kappa == Fraction(1, width)
    assert abs(kappa * width - 1) <= Fraction(width * width, 1 << 66)


@pytest.mark.parametrize("width", [4, 3])
def test_rows_collide_pairwise_independently(width: int) -> None:
    """For 30,000 pairs of distinct strings, each pair of rows' collision indicators follows
    the product law (kappa, 1 - kappa)^2: a 4-cell chi-square per row pair (3 pairs,
    Bonferroni ALPHA / 3)."""
    depth, pairs = 3, 30_000
    family = SketchHash(depth, width)
    left = walked(family, family.fingerprints([f"L{i}".encode() for i in range(pairs)]))
    right = walked(family, family.fingerprints([f"R{i}".encode() for i in range(pairs)]))
    collide = (left == right).astype(np.int64)  # (k, pairs)
    kappa = float(family.collision_probability)
    law = np.array([(1 - kappa) ** 2, (1 - kappa) * kappa, kappa * (1 - kappa), kappa**2])
    for first, second in ((0, 1), (0, 2), (1, 2)):
        observed = np.bincount(2 * collide[first] + collide[second], minlength=4)
        assert stats.chisquare(observed, pairs * law).pvalue > ALPHA / 3


def test_pairs_of_strings_share_a_binomial_number_of_rows() -> None:
    """For 2^17 pairs of distinct strings at k = 32, m = 256, the number of rows a pair
    shares is Binomial(k, 1/m), as over independent rows: a chi-square on 0, 1, 2 and >= 3
    shared rows, and an exact binomial test of the pairs sharing >= 4 (expected 1.0),
    ALPHA / 2 each. Multipliers G_j = j would fail both: every set of shared rows would be
    an affine subspace of row indices (1, 2, 4, 8, ... rows, never 3), and pairs sharing 4 or
    more rows some 60 times too common."""
    depth, width, pairs = 32, 256, 1 << 17
    family = SketchHash(depth, width)
    left = family.columns(family.fingerprints([f"L{i}".encode() for i in range(pairs)]))
    right = family.columns(family.fingerprints([f"R{i}".encode() for i in range(pairs)]))
    shared = np.bincount((left == right).sum(axis=0), minlength=depth + 1)
    law = stats.binom.pmf(np.arange(depth + 1), depth, 1 / width)
    observed = np.array([*shared[:3], shared[3:].sum()])
    expected = pairs * np.array([*law[:3], law[3:].sum()])
    assert stats.chisquare(observed, expected).pvalue > ALPHA / 2
    assert stats.binomtest(int(shared[4:].sum()), pairs, float(law[4:].sum())).pvalue > ALPHA / 2


def test_sketch_hash_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="width"):
        SketchHash(2, 1)
    with pytest.raises(ValueError, match="depth"):
        SketchHash(0, 4)
    with pytest.raises(ValueError, match="depth"):
        SketchHash((1 << 24) + 1, 4)
    with pytest.raises(TypeError, match="depth"):
        SketchHash(2.0, 4)  # type: ignore[arg-type]
    family = SketchHash(3, 8)
    with pytest.raises(ValueError, match="rows"):
        family.positions(family.fingerprints([b"x"]), np.array([3]))


# ---------------------------------------------------------------------------------------
# Exact privacy
# ---------------------------------------------------------------------------------------

#: (mechanism, epsilon, k, m): small enough to enumerate every tuple and every report.
PRIVACY_CASES = [
    ("cms", 0.5, 2, 3),
    ("cms", 2.3, 2, 4),
    ("cms", 5.0, 3, 2),
    ("cms", 1.0, 1, 5),
    ("hcms", 0.5, 2, 4),
    ("hcms", 2.3, 3, 2),
    ("hcms", 5.0, 2, 8),
    ("hcms", 1.0, 1, 16),
]


def exact_row_law(mech: Any) -> list[list[Fraction]]:
    """P[output | column] of one row as Fractions, from the thresholds and the module
    docstring's description (independently of ``_row_output_matrix``)."""
    m = mech.width
    if mech.name == "cms":
        flip = Fraction(mech.flip_threshold, BITS53)
        law = []
        for column in range(m):
            row = []
            for output in range(2**m):
                agree = sum((output >> c & 1) == (c == column) for c in range(m))
                row.append((1 - flip) ** agree * flip ** (m - agree))
            law.append(row)
        return law
    keep = Fraction(mech.keep_threshold, BITS53)
    p = keep + (1 - keep) / 2
    law = []
    for column in range(m):
        row = []
        for coefficient in range(m):
            sign_bit = 1 - bin(column & coefficient).count("1") % 2
            row += [(p if bit == sign_bit else 1 - p) / m for bit in (0, 1)]
        law.append(row)
    return law


def exp_decimal(epsilon: float) -> Decimal:
    with localcontext(Context(prec=60)):
        return Decimal(epsilon).exp()


@pytest.mark.parametrize(("name", "epsilon", "depth", "width"), PRIVACY_CASES)
def test_exact_likelihood_ratio_is_epsilon(
    name: str, epsilon: float, depth: int, width: int
) -> None:
    mech = build(name, epsilon, width, depth)
    law = exact_row_law(mech)
    tuples = list(product(range(width), repeat=depth))  # row-major, row 0 most significant
    exact = [
        [law[cols[j]][o] / depth for j in range(depth) for o in range(len(law[0]))]
        for cols in tuples
    ]
    assert all(sum(row) == 1 for row in exact)
    worst = max(
        max(column) / min(column) for column in zip(*exact, strict=True)
    )  # every probability is positive
    assert ratio_within_epsilon(worst, epsilon)
    with localcontext(Context(prec=60)):
        bound = exp_decimal(epsilon)
        assert Decimal(worst.numerator) / Decimal(worst.denominator) >= bound * (1 - Decimal(TIGHT))

    matrix = mech.transition_matrix()
    assert matrix.shape == (len(tuples), len(exact[0]))
    np.testing.assert_allclose(matrix, np.array(exact, dtype=np.float64), rtol=1e-13, atol=0)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12)
    ratio = float((matrix.max(axis=0) / matrix.min(axis=0)).max())
    assert ratio <= math.exp(epsilon) * (1 + RATIO_RTOL)  # OpenDP's check(eps) holds ...
    assert ratio > math.exp(epsilon - 1e-6)  # ... and fails just below


def test_transition_matrix_refuses_large_sketches() -> None:
    with pytest.raises(ValueError, match="enumerate"):
        build("cms", 1.0, 16, 2).transition_matrix()
    with pytest.raises(ValueError, match="too many"):
        build("hcms", 1.0, 64, 4).transition_matrix()


# ---------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------

SAMPLES = 200_000
MIN_EXPECTED = 100.0


def assert_fits(observed: np.ndarray, probabilities: np.ndarray, alpha: float = ALPHA) -> None:
    """Pearson chi-square at ``alpha``; every cell expects at least 100 counts."""
    expected = observed.sum() * probabilities
    assert expected.min() >= MIN_EXPECTED
    assert stats.chisquare(observed, expected).pvalue > alpha


def output_index(mech: Any, reports: np.ndarray) -> np.ndarray:
    """Each report's column of ``transition_matrix``."""
    if mech.name == "cms":
        bits = np.unpackbits(reports["bits"], axis=1, count=mech.width).astype(np.int64)
        return reports["row"] * 2**mech.width + bits @ (1 << np.arange(mech.width))
    return reports[:, 0] * 2 * mech.width + 2 * reports[:, 1] + reports[:, 2]


def tuple_index(mech: Any, text: str) -> int:
    """The ``transition_matrix`` row of a string: its columns, row 0 most significant."""
    index = 0
    for column in reference_columns(text, mech.depth, mech.width):
        index = index * mech.width + column
    return index


@pytest.mark.parametrize(
    ("name", "epsilon", "depth", "width"), [("cms", 2.3, 2, 3), ("hcms", 1.0, 2, 4)]
)
def test_reports_match_the_transition_matrix(
    name: str, epsilon: float, depth: int, width: int
) -> None:
    """200,000 reports of one string in one batch (16 cells), and 48,000 drawn 40 at a time
    (a report batch small enough for the byte-wise bit sampler); ALPHA / 2 each."""
    mech = build(name, epsilon, width, depth)
    law = mech.transition_matrix()[tuple_index(mech, "abc")]
    rng = np.random.default_rng(17)
    batch = mech.encode(["abc"] * SAMPLES, rng=rng)
    assert_fits(np.bincount(output_index(mech, batch), minlength=law.size), law, ALPHA / 2)
    small = np.concatenate([mech.encode(["abc"] * 40, rng=rng) for _ in range(1200)])
    assert_fits(np.bincount(output_index(mech, small), minlength=law.size), law, ALPHA / 2)


def test_cms_bit_frequencies_in_a_padded_row() -> None:
    """m = 37 (five bytes, three padding bits), k = 2: in row j's reports, bit h_j is 1 with
    probability p and every other bit with q (74 binomial tests at ALPHA / 74)."""
    mech = build("cms", 0.5, 37, 2)
    reports = mech.encode(["padded"] * SAMPLES, rng=np.random.default_rng(19))
    assert not np.any(reports["bits"][:, -1] & np.uint8(0b111))
    columns = reference_columns("padded", 2, 37)
    for row in range(2):
        own = reports["bits"][reports["row"] == row]
        ones = np.unpackbits(own, axis=1, count=37).sum(axis=0)
        for bit in range(37):
            expected = mech.p if bit == columns[row] else mech.q
            assert stats.binomtest(int(ones[bit]), own.shape[0], expected).pvalue > ALPHA / 74


def test_rows_are_uniform() -> None:
    mech = build("hcms", 2.0, 8, 5)
    reports = mech.encode(["x"] * 50_000, rng=np.random.default_rng(23))
    assert_fits(np.bincount(reports[:, 0], minlength=5), np.full(5, 0.2))


# ---------------------------------------------------------------------------------------
# Estimator
# ---------------------------------------------------------------------------------------

#: (mechanism, epsilon, k, m, counts of the population's strings), all with small m where
#: hash collisions matter: a few frequent strings, where the term of hash functions shared by
#: a string's reports dominates (m = 8) or the noise does (m = 16); and 250 strings of one
#: device each at a large epsilon and m = 2, where the collisions of single reports (the
#: paper's term, (1 - f) kappa per report) are most of the variance.
ESTIMATOR_CASES = [
    pytest.param("cms", 2.0, 4, 8, (400, 250, 150, 100, 60, 40), id="cms-shared-hashes"),
    pytest.param("hcms", 2.0, 4, 8, (400, 250, 150, 100, 60, 40), id="hcms-shared-hashes"),
    pytest.param("cms", 1.0, 2, 16, (200, 125, 75, 50, 30, 20), id="cms-noise"),
    pytest.param("hcms", 3.0, 2, 16, (200, 125, 75, 50, 30, 20), id="hcms-noise"),
    pytest.param("cms", 8.0, 8, 2, (1,) * 250, id="cms-single-collisions"),
    pytest.param("hcms", 8.0, 8, 2, (1,) * 250, id="hcms-single-collisions"),
]
TRIALS = 1200


def assert_mean(sample: np.ndarray, mean: float, std: float) -> None:
    """|sample mean - mean| <= 5 std / sqrt(T)."""
    assert abs(sample.mean() - mean) <= Z_LIMIT * std / math.sqrt(sample.size), (
        sample.mean(),
        mean,
    )


def assert_variance(sample: np.ndarray, variance: float) -> None:
    """The sample variance within 5 standard errors of ``variance``; the standard error of
    a sample variance is sqrt((mu4 - s^4)/T), mu4 the sample fourth central moment."""
    centered = sample - sample.mean()
    s2 = centered.var(ddof=1)
    error = math.sqrt((np.mean(centered**4) - s2**2) / sample.size)
    assert abs(s2 - variance) <= Z_LIMIT * error, (s2, variance, error)


@pytest.mark.parametrize(("name", "epsilon", "depth", "width", "counts"), ESTIMATOR_CASES)
@pytest.mark.slow
def test_estimates_are_unbiased_with_the_stated_variance(
    name: str, epsilon: float, depth: int, width: int, counts: tuple[int, ...]
) -> None:
    """T populations, each of fresh strings (the hash collisions differ between trials, as
    over random hash functions): the most frequent string, a middle one and an absent one.
    Per string, the mean and the variance of the estimate, and the mean of F2^ (7
    assertions at |z| <= 5: 4e-6 in all)."""
    mech = build(name, epsilon, width, depth)
    rng = np.random.default_rng(29)
    n = sum(counts)
    truth = np.array(counts) / n
    picked = [0, 3]
    estimates = np.empty((TRIALS, 3))
    moments = np.empty(TRIALS)
    for trial in range(TRIALS):
        strings = [f"{trial}/{i}" for i in range(len(counts))]
        statistics = mech.simulate_statistics(strings, np.array(counts), rng)
        queried = [strings[i] for i in picked] + [f"absent/{trial}"]
        estimates[trial] = mech.estimate(statistics, queried).frequencies
        moments[trial] = mech.second_moment(statistics)
    for column, frequency in enumerate([*truth[picked], 0.0]):
        others = float((truth**2).sum()) - frequency**2
        variance = float(mech.frequency_variance(n, frequency, others))
        assert_mean(estimates[:, column], frequency, math.sqrt(variance))
        assert_variance(estimates[:, column], variance)
    centered = moments - moments.mean()
    assert abs(moments.mean() - (truth**2).sum()) <= Z_LIMIT * centered.std() / math.sqrt(TRIALS)


@pytest.mark.parametrize("name", ["cms", "hcms"])
@pytest.mark.parametrize(("epsilon", "depth", "width"), [(0.7, 3, 8), (4.0, 16, 1024)])
def test_variance_formula_closed_forms(name: str, epsilon: float, depth: int, width: int) -> None:
    """With kappa = 1/m the formula is (m/(m-1))^2 s0/n plus the collision terms; for cms
    ((1 - f)(1 - 1/k)/n + F/k)/(m - 1), for hcms s0 - f - (1 - f)(1/m^2 + (1/m)(1 - 1/m)/k)
    in place of s0, plus F/(k (m - 1)); s0 at the nominal probabilities."""
    mech = build(name, epsilon, width, depth)
    n, f, others = 5000, 0.3, 0.04
    k, m = depth, width
    correction = (m / (m - 1)) ** 2
    if name == "cms":
        half = math.exp(epsilon / 2)
        s0 = half / (half - 1) ** 2
        expected = correction * s0 / n + ((1 - f) * (1 - 1 / k) / n + others / k) / (m - 1)
    else:
        s0 = ((math.exp(epsilon) + 1) / (math.exp(epsilon) - 1)) ** 2
        noise = s0 - f - (1 - f) * (1 / m**2 + (1 / m) * (1 - 1 / m) / k)
        expected = correction * noise / n + others / (k * (m - 1))
    assert float(mech.frequency_variance(n, f, others)) == pytest.approx(expected, rel=1e-9)
    assert mech.variance(n) == pytest.approx(float(mech.frequency_variance(n, 0.0, 0.0)))


@pytest.mark.parametrize("name", ["cms", "hcms"])
def test_estimate_reports_the_plug_in_std(name: str) -> None:
    """``std`` is the formula at the clipped estimate and the clipped F2^ - f^2; candidates
    keep their order, repeats agree, and an empty list gives empty arrays."""
    mech = build(name, 2.0, 64, 8)
    rng = np.random.default_rng(31)
    strings = ["a", "b", "c", "d"]
    statistics = mech.simulate_statistics(strings, np.array([500, 300, 150, 50]), rng)
    candidates = ["b", "zzz", "a", "b"]
    estimate = mech.estimate(statistics, candidates)
    assert estimate.n == 1000 and estimate.frequencies.shape == (4,)
    assert estimate.frequencies[0] == estimate.frequencies[3]
    at = np.clip(estimate.frequencies, 0, 1)
    others = np.clip(mech.second_moment(statistics) - at**2, 0, (1 - at) ** 2)
    expected = np.sqrt(mech.frequency_variance(1000, at, others))
    np.testing.assert_allclose(estimate.std, expected, rtol=1e-12)
    empty = mech.estimate(statistics, [])
    assert empty.frequencies.shape == empty.std.shape == (0,)
    assert np.array_equal(
        mech.estimate(statistics, np.array(candidates)).frequencies, estimate.frequencies
    )


@pytest.mark.parametrize("path", ["strings", "repeated fingerprints"])
def test_cms_simulation_draws_the_exact_cell_law(path: str) -> None:
    """The fast path's cells against their exact law: R_j ~ Bin(n, 1/k) and S_jc a sum of
    independent Bernoulli((1/k)(p if h_j(s) = c else q)) over devices; mean and variance of
    each of the 8 cells over 2,000 draws (16 assertions, 9e-6 in all). From the strings, and
    from fingerprints given with repeats (the devices of "u" split over two entries)."""
    mech = build("cms", 1.5, 3, 2)
    strings, counts = ["u", "v"], np.array([30, 20])
    rng = np.random.default_rng(37)
    prints = mech.hash.fingerprints([b"u", b"v", b"u"])

    def draw() -> CountStatistics:
        if path == "strings":
            return mech.simulate_statistics(strings, counts, rng)
        return mech.simulate_fingerprints(prints, np.array([12, 20, 18]), rng)

    draws = np.array([draw().counts for _ in range(2000)], float)
    columns = [reference_columns(text, 2, 3) for text in strings]
    n = int(counts.sum())
    mean, variance = np.empty(8), np.empty(8)
    for row in range(2):
        mean[4 * row], variance[4 * row] = n / 2, n / 4
        for cell in range(3):
            chance = np.array(
                [(mech.p if columns[s][row] == cell else mech.q) / 2 for s in range(2)]
            )
            mean[4 * row + 1 + cell] = float(counts @ chance)
            variance[4 * row + 1 + cell] = float(counts @ (chance * (1 - chance)))
    for cell in range(8):
        assert_mean(draws[:, cell], mean[cell], math.sqrt(variance[cell]))
        assert_variance(draws[:, cell], variance[cell])


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------


def direct_statistics(mech: Any, reports: np.ndarray) -> np.ndarray:
    """The statistics' dense counts, counted one report at a time."""
    if mech.name == "cms":
        table = np.zeros((mech.depth, mech.width + 1), dtype=np.int64)
        bits = np.unpackbits(reports["bits"], axis=1, count=mech.width)
        for row, line in zip(reports["row"], bits, strict=True):
            table[row, 0] += 1
            table[row, 1:] += line
        return table.reshape(-1)
    histogram = np.zeros((mech.depth, mech.width, 2), dtype=np.int64)
    for row, column, bit in reports:
        histogram[row, column, bit] += 1
    return histogram.reshape(-1)


@pytest.mark.parametrize(
    ("name", "depth", "width", "size"),
    [("cms", 2, 37, 500), ("cms", 512, 37, 300), ("hcms", 4, 8, 400), ("hcms", 64, 32, 50)],
)
def test_aggregate_equals_a_direct_count(
    name: str, depth: int, width: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both cms paths (rows of many reports through ``bit_sums``; rows of few unpacked,
    in blocks of 7 reports that split rows) and both hcms forms (dense, sparse)."""
    monkeypatch.setattr(sketch, "_UNPACK_BITS", 7 * width)
    mech = build(name, 1.0, width, depth)
    rng = np.random.default_rng(41)
    values = rng.choice(["x", "y", "zz", "ωmega"], size=size).tolist()
    reports = mech.encode(values, rng=rng)
    statistics = mech.aggregate(reports)
    assert statistics.n == size
    np.testing.assert_array_equal(statistics.counts, direct_statistics(mech, reports))


@pytest.mark.parametrize(("name", "width"), [("cms", 1000), ("hcms", 1024)])
def test_queries_equal_direct_sums(name: str, width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocked row walk against sum_j A[j, h_j(s)] from the reference columns, with
    blocks of 3 candidates (several blocks, one partial)."""
    monkeypatch.setattr(hashing, "_SUM_BLOCK", 3)
    mech = build(name, 1.0, width, 6)
    rng = np.random.default_rng(43)
    statistics = mech.aggregate(mech.encode(["p", "q", "r", "p"] * 300, rng=rng))
    table, scale, offsets = mech.sketch_table(statistics)
    debiased = scale * table + offsets[:, None]
    candidates = ["p", "q", "r", "s", "", "tt", "p"]
    direct = np.array(
        [
            sum(debiased[j, c] for j, c in enumerate(reference_columns(s, 6, width)))
            for s in candidates
        ]
    )
    kappa = mech.kappa
    expected = (direct / statistics.n - kappa) / (1 - kappa)
    estimate = mech.estimate(statistics, candidates)
    np.testing.assert_allclose(estimate.frequencies, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("name", "width"), [("cms", 1000), ("hcms", 1024)])
@pytest.mark.parametrize("count", [0, 1, 4, 13])
def test_threaded_queries_are_bitwise_the_single_threaded_ones(
    name: str, width: int, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Estimates, row sums (integer and real tables) and query sums (hashing overlapped)
    with blocks of 4 candidates on 3 threads equal those on one thread bit for bit, and
    query sums equal row sums: no candidates, one, exactly one block, and 13 (three blocks
    and a partial one, more blocks than threads); widths with all 32 bits kept (m = 1000)
    and with indexed lanes (m = 1024)."""
    monkeypatch.setattr(hashing, "_SUM_BLOCK", 4)
    mech = build(name, 1.0, width, 11)
    statistics = mech.aggregate(
        mech.encode(["p", "q", "r", "p"] * 50, rng=np.random.default_rng(5))
    )
    candidates = ["p", "q", "", "naïve"] + [f"c{i}" for i in range(9)]
    candidates = candidates[:count]
    raw = [c.encode() for c in candidates]
    fingerprints = mech.hash.fingerprints(raw)
    table = mech.sketch_table(statistics)[0]
    real = np.random.default_rng(7).standard_normal(table.shape)
    results = {}
    for threads in (1, 3):
        monkeypatch.setattr(hashing, "SKETCH_THREADS", threads)
        estimate = mech.estimate(statistics, candidates)
        results[threads] = (
            estimate.frequencies,
            estimate.std,
            mech.hash.row_sums(table, fingerprints),
            mech.hash.row_sums(real, fingerprints, threads=threads),
            mech.hash.query_sums(real, raw, threads=threads),
        )
    for single, threaded in zip(results[1], results[3], strict=True):
        assert single.shape == (count,)
        assert single.dtype == threaded.dtype
        assert single.tobytes() == threaded.tobytes()
    assert results[1][3].tobytes() == results[1][4].tobytes()


def test_row_sums_run_blocks_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 threads, two blocks are summed at the same time: each of the first two waits
    at a barrier for the other (a serial run would time out there), and the sums still
    equal the single-threaded ones."""
    monkeypatch.setattr(hashing, "_SUM_BLOCK", 4)
    family = SketchHash(5, 64)
    table = np.arange(5 * 64, dtype=np.int64).reshape(5, 64)
    fingerprints = family.fingerprints([f"s{i}".encode() for i in range(10)])
    expected = family.row_sums(table, fingerprints, threads=1)
    barrier = threading.Barrier(2, timeout=10)
    calls = itertools.count()
    idents: set[int] = set()
    block_sums = SketchHash._block_sums

    def meeting(self: SketchHash, *args: Any) -> np.ndarray:
        idents.add(threading.get_ident())
        if next(calls) < 2:  # the first two blocks meet
            barrier.wait()
        return block_sums(self, *args)

    monkeypatch.setattr(SketchHash, "_block_sums", meeting)
    np.testing.assert_array_equal(family.row_sums(table, fingerprints, threads=2), expected)
    assert len(idents) == 2


@pytest.mark.parametrize(
    ("threads", "error", "message"),
    [
        (0, ValueError, "at least 1"),
        (-2, ValueError, "at least 1"),
        (2.0, TypeError, "int"),
        (True, TypeError, "int"),
    ],
)
def test_sums_refuse_bad_thread_counts(threads: Any, error: type, message: str) -> None:
    family = SketchHash(3, 16)
    with pytest.raises(error, match=message):
        family.row_sums(np.zeros((3, 16)), family.fingerprints([b"x"]), threads=threads)
    with pytest.raises(error, match=message):
        family.query_sums(np.zeros((3, 16)), [b"x"], threads=threads)


@pytest.mark.parametrize("name", ["cms", "hcms"])
def test_merge_is_associative_commutative_and_serializes(name: str) -> None:
    mech = build(name, 1.0, 16, 4)
    rng = np.random.default_rng(47)
    batches = [mech.encode([f"v{i % 5}" for i in range(size)], rng=rng) for size in (3, 40, 200)]
    first, second, third = (mech.aggregate(batch) for batch in batches)
    union = mech.aggregate(np.concatenate(batches))
    assert (first + second) + third == first + (second + third) == union
    assert first + second == second + first
    assert mech.empty_statistics() + first == first
    for statistics in (first, union, mech.empty_statistics()):
        assert mech.statistics_from_bytes(statistics.to_bytes()) == statistics


def test_corrupt_statistics_are_refused() -> None:
    cms = build("cms", 1.0, 4, 2)
    table = np.zeros((2, 5), dtype=np.int64)
    table[0, 0], table[0, 2] = 3, 4  # 4 bits set among 3 reports
    with pytest.raises(ValueError, match="exceeds"):
        cms.statistics_from_bytes(CountStatistics(3, table.reshape(-1)).to_bytes())
    table[0, 2] = 2  # consistent with 3 reports, but n says 5
    with pytest.raises(ValueError, match="sum to 3"):
        cms.statistics_from_bytes(CountStatistics(5, table.reshape(-1)).to_bytes())
    hcms = build("hcms", 1.0, 4, 2)
    with pytest.raises(ValueError, match="sum to 2"):
        hcms.statistics_from_bytes(CountStatistics(3, np.eye(1, 16, 5, int)[0] * 2).to_bytes())
    with pytest.raises(ValueError, match="counts"):
        hcms.statistics_from_bytes(CountStatistics(0, np.zeros(15, np.int64)).to_bytes())
    with pytest.raises(ValueError, match="zero reports"):
        hcms.estimate(hcms.empty_statistics(), ["a"])
    with pytest.raises(ValueError, match="candidate strings"):
        hcms.estimate(hcms.empty_statistics())


# ---------------------------------------------------------------------------------------
# Wire format and bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cms", "hcms"])
def test_payload_round_trip(name: str) -> None:
    mech = build(name, 1.0, 32 if name == "hcms" else 37, 3)
    reports = mech.encode(["a", "β", "a", ""], rng=np.random.default_rng(53))
    payloads = mech.to_payloads(reports)
    assert all(set(payload) == mech.payload_fields for payload in payloads)
    assert all(
        type(value) in (int, str) and len(key) <= 32
        for payload in payloads
        for key, value in payload.items()
    )
    back = mech.from_payloads(payloads)
    assert np.array_equal(back, reports)
    if name == "cms":
        assert base64.b64decode(payloads[0]["bits"]) == reports["bits"][0].tobytes()
        assert len(base64.b64decode(payloads[0]["bits"])) == 5
    assert mech.from_payloads([]).shape[0] == 0


GOOD_CMS = {"row": 1, "bits": base64.b64encode(bytes([0x80, 0, 0, 0, 0])).decode()}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"bits": GOOD_CMS["bits"]}, "integer 'row'"),
        ({**GOOD_CMS, "row": True}, "integer 'row'"),
        ({**GOOD_CMS, "row": 3}, "outside"),
        ({**GOOD_CMS, "row": -1}, "outside"),
        ({"row": 0}, "base64 string 'bits'"),
        ({"row": 0, "bits": "not base64!"}, "not valid base64"),
        ({"row": 0, "bits": base64.b64encode(bytes(4)).decode()}, "expected 5"),
        ({"row": 0, "bits": base64.b64encode(bytes([0] * 4 + [1])).decode()}, "padding"),
        (["row", 0], "integer 'row'"),
    ],
)
def test_bad_cms_payloads(payload: Any, message: str) -> None:
    mech = build("cms", 1.0, 37, 3)
    assert mech.from_payloads([GOOD_CMS]).shape == (1,)
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([GOOD_CMS, payload])


GOOD_HCMS = {"row": 2, "column": 31, "bit": 1}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"row": 0, "bit": 1}, "integer 'column'"),
        ({**GOOD_HCMS, "bit": 2}, "outside"),
        ({**GOOD_HCMS, "bit": False}, "integer 'bit'"),
        ({**GOOD_HCMS, "column": 32}, "outside"),
        ({**GOOD_HCMS, "row": 3}, "outside"),
        ({**GOOD_HCMS, "row": 1.0}, "integer 'row'"),
        ({**GOOD_HCMS, "column": "5"}, "integer 'column'"),
        (None, "integer 'row'"),
    ],
)
def test_bad_hcms_payloads(payload: Any, message: str) -> None:
    mech = build("hcms", 1.0, 32, 3)
    assert mech.from_payloads([GOOD_HCMS]).tolist() == [[2, 31, 1]]
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([GOOD_HCMS, payload])


def test_bad_reports_are_refused() -> None:
    cms, hcms = build("cms", 1.0, 8, 2), build("hcms", 1.0, 8, 2)
    with pytest.raises(ValueError, match="dtype"):
        cms.aggregate(np.zeros((3, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="row, column, bit"):
        hcms.aggregate(np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="column"):
        hcms.check_reports(np.array([[0, 8, 1]]))


def test_bad_values_and_candidates() -> None:
    mech = build("hcms", 1.0, 8, 2)
    statistics = mech.aggregate(mech.encode(["a"] * 10, rng=np.random.default_rng(59)))
    with pytest.raises(ValueError, match="position 1 must be a string"):
        mech.encode(["a", 3])
    with pytest.raises(ValueError, match="lone surrogate"):
        mech.encode(["\ud800"])
    with pytest.raises(TypeError, match="single string"):
        mech.estimate(statistics, "abc")
    with pytest.raises(TypeError, match="position 1"):
        mech.estimate(statistics, ["a", b"b"])
    with pytest.raises(ValueError, match="position 0"):
        mech.estimate(statistics, ["\udfff"])
    with pytest.raises(TypeError, match="Generator"):
        mech.simulate_statistics(["a"], [3], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="counts"):
        mech.simulate_statistics(["a", "b"], [3], np.random.default_rng(0))
    assert mech.encode([], rng=np.random.default_rng(0)).shape == (0, 3)
    assert build("cms", 1.0, 8, 2).encode([]).shape == (0,)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a 'cms' spec"):
        CountMeanSketch(
            MechanismSpec(mechanism="hcms", epsilon=1.0, sketch_width=8, sketch_depth=2)
        )
    with pytest.raises(ValidationError, match="power of two"):
        MechanismSpec(mechanism="hcms", epsilon=1.0, sketch_width=12, sketch_depth=2)
    with pytest.raises(ValidationError, match="sketch_depth is required"):
        MechanismSpec(mechanism="cms", epsilon=1.0, sketch_width=12)
    with pytest.raises(ValidationError, match="exceeds"):
        MechanismSpec(mechanism="cms", epsilon=1.0, sketch_width=4096, sketch_depth=4096)
    with pytest.raises(ValidationError, match="epsilon"):
        MechanismSpec(mechanism="cms", sketch_width=16, sketch_depth=2)


def test_heavy_hitters_need_a_discovery_mechanism() -> None:
    mech = build("cms", 1.0, 8, 2)
    assert as_discovery(mech) is None and mech.kind == "string"
    assert not hasattr(mech, "heavy_hitters")
