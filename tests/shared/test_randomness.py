"""Goodness-of-fit and exactness tests for every sampler in shared.randomness.

Every sampler is run from both sources: a seeded numpy Generator
(``RandomSource(np.random.default_rng(seed))``, reproducible) and the OS CSPRNG
(``RandomSource(None)``, not seedable).

Significance
------------
Every statistical test function has a total false-failure rate of at most
``ALPHA = 1e-6``. A test that makes m assertions runs each at ``ALPHA / m``
(Bonferroni), so the family still fails falsely with probability <= 1e-6. The
seeded cases use fixed seeds, so they are deterministic; the CSPRNG cases fail
falsely with probability <= 1e-6 per test function per run.

All assertions go through the helpers below (``assert_chisquare``,
``assert_binomial``, ``assert_binomials``, ``assert_contingency_independent``,
``assert_z``), which apply the chi-square / exact binomial / z tests at the
given alpha and demand an expected count of at least 5 in every chi-square bin.

A few tests are white-box (``*_boundary``): they replace ``words`` with crafted
words to check the exact comparison ``U < floor(p * 2**53)`` at its boundary,
which no sample of practical size can resolve.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.randomness import (
    DIRECT_BERNOULLI_WORDS,
    RandomSource,
    as_source,
    certified_threshold,
    discrete_laplace_pmf,
    discrete_laplace_variance,
    exact_probability,
    ratio_within_epsilon,
    realized_probability,
    step_until_within,
    threshold53,
)

#: Total false-failure rate of each statistical test function.
ALPHA = 1e-6
#: Smallest expected count allowed in a chi-square bin.
MIN_EXPECTED = 5.0
TWO_53 = 2**53

SourceFactory = Callable[[int], RandomSource]

# --------------------------------------------------------------------------------------
# Shared statistical assertions
# --------------------------------------------------------------------------------------


def assert_chisquare(
    counts: np.ndarray, probs: np.ndarray, *, alpha: float = ALPHA, label: str = ""
) -> None:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs`` at level ``alpha``.

    ``probs`` must sum to 1 (the tails binned in); every expected count must be
    at least ``MIN_EXPECTED`` so that the chi-square approximation holds.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    assert counts.shape == probs.shape and counts.ndim == 1 and counts.size >= 2
    assert abs(probs.sum() - 1.0) < 1e-9, f"{label}: bin probabilities sum to {probs.sum()!r}"
    n = counts.sum()
    expected = n * probs / probs.sum()
    assert expected.min() >= MIN_EXPECTED, (
        f"{label}: expected count {expected.min():.3g} < {MIN_EXPECTED}: bin the tails"
    )
    result = stats.chisquare(counts, expected)
    assert result.pvalue > alpha, (
        f"{label}: chi-square = {result.statistic:.1f} on {counts.size - 1} df, "
        f"p = {result.pvalue:.3g} <= alpha = {alpha:.3g}"
    )


def assert_binomial(
    successes: int, trials: int, p: float, *, alpha: float = ALPHA, label: str = ""
) -> None:
    """Exact two-sided binomial test of ``successes`` out of ``trials`` at probability ``p``.

    For ``p`` = 0 or 1 the outcome is certain, so the count must be exactly 0 or ``trials``.
    """
    successes, trials = int(successes), int(trials)
    if p == 0.0 or p == 1.0:
        assert successes == round(p * trials), f"{label}: {successes}/{trials} at p = {p}"
        return
    pvalue = stats.binomtest(successes, trials, p).pvalue
    assert pvalue > alpha, (
        f"{label}: {successes}/{trials} = {successes / trials:.6g} vs p = {p:.6g}, "
        f"binomial p-value {pvalue:.3g} <= alpha = {alpha:.3g}"
    )


def assert_binomials(
    successes: np.ndarray, trials: int, p: float, *, alpha: float = ALPHA, label: str = ""
) -> None:
    """Binomial tests of each count in ``successes`` (Bonferroni: each at alpha / count)."""
    successes = np.asarray(successes).reshape(-1)
    for i, k in enumerate(successes):
        assert_binomial(int(k), trials, p, alpha=alpha / successes.size, label=f"{label}[{i}]")


def assert_contingency_independent(
    first: np.ndarray, second: np.ndarray, *, alpha: float = ALPHA, label: str = ""
) -> None:
    """Chi-square test of independence on the 2x2 table of paired booleans ``first, second``."""
    first = np.asarray(first, dtype=bool).reshape(-1)
    second = np.asarray(second, dtype=bool).reshape(-1)
    table = np.bincount(2 * first + second, minlength=4).reshape(2, 2)
    result = stats.chi2_contingency(table, correction=False)
    assert result.expected_freq.min() >= MIN_EXPECTED, f"{label}: table {table.tolist()} too thin"
    assert result.pvalue > alpha, (
        f"{label}: table {table.tolist()}, chi-square = {result.statistic:.2f}, "
        f"p = {result.pvalue:.3g} <= alpha = {alpha:.3g}"
    )


def assert_z(z: float, *, alpha: float = ALPHA, label: str = "") -> None:
    """Two-sided z-test: |z| must stay below the normal quantile for ``alpha``."""
    bound = float(stats.norm.isf(alpha / 2))  # 4.89 at alpha = 1e-6
    assert abs(z) < bound, f"{label}: |z| = {abs(z):.2f} >= {bound:.2f} (alpha = {alpha:.3g})"


# --------------------------------------------------------------------------------------
# Binning helpers (exact bin probabilities)
# --------------------------------------------------------------------------------------


def uniform_bins(values: np.ndarray, high: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of ``values`` in ``min(high, bins)`` bins of {0..high-1}, with exact probabilities.

    Bin j holds the integers in [ceil(j high / B), ceil((j + 1) high / B)); the
    edges are computed in Python integers, so they are exact for any int64 high.
    """
    nbins = min(high, bins)
    edges = [-(-j * high // nbins) for j in range(nbins + 1)]
    widths = np.array([b - a for a, b in zip(edges[:-1], edges[1:], strict=True)], np.float64)
    index = np.searchsorted(np.array(edges[1:-1], dtype=np.int64), values, side="right")
    return np.bincount(index, minlength=nbins), widths / high


def residue_probs(high: int, modulus: int) -> np.ndarray:
    """P(X mod modulus = r) for X uniform on {0..high-1}, exactly, r = 0..modulus-1."""
    counts = [(high - 1 - r) // modulus + 1 if r < high else 0 for r in range(modulus)]
    return np.array(counts, dtype=np.float64) / high


def integer_bins(
    values: np.ndarray,
    pmf: Callable[[np.ndarray], np.ndarray],
    lower_tail: Callable[[int], float],
    upper_tail: Callable[[int], float],
    lo: int,
    hi: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Counts and probabilities on the bins (-inf, a-1], a, ..., b, [b+1, inf).

    ``pmf`` gives P(Y = y); ``lower_tail(k)`` = P(Y <= k) and ``upper_tail(k)`` =
    P(Y >= k). [a, b] is the widest interval inside [lo, hi] of values whose
    expected count is at least MIN_EXPECTED; a tail with a smaller expected
    count is merged into its neighbouring bin.
    """
    n = values.size
    support = np.arange(lo, hi + 1)
    core = support[n * pmf(support) >= MIN_EXPECTED]
    a, b = int(core.min()), int(core.max())
    probs = np.concatenate([[lower_tail(a - 1)], pmf(np.arange(a, b + 1)), [upper_tail(b + 1)]])
    counts = np.bincount(np.clip(values, a - 1, b + 1) - (a - 1), minlength=b - a + 3)
    if n * probs[0] < MIN_EXPECTED:  # merge the lower tail into the bin of a
        probs, counts = (
            np.concatenate([[probs[0] + probs[1]], probs[2:]]),
            np.concatenate([[counts[0] + counts[1]], counts[2:]]),
        )
    if n * probs[-1] < MIN_EXPECTED:  # merge the upper tail into the bin of b
        probs, counts = (
            np.concatenate([probs[:-2], [probs[-2] + probs[-1]]]),
            np.concatenate([counts[:-2], [counts[-2] + counts[-1]]]),
        )
    return counts, probs


# --------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------


@pytest.fixture(params=["seeded", "os"])
def make_source(request: pytest.FixtureRequest) -> SourceFactory:
    """A factory of RandomSources: a seeded Generator, or the OS CSPRNG (seed ignored)."""

    def make(seed: int) -> RandomSource:
        if request.param == "seeded":
            return RandomSource(np.random.default_rng(seed))
        return RandomSource(None)

    return make


# --------------------------------------------------------------------------------------
# words and uniform
# --------------------------------------------------------------------------------------


def test_words_bits_and_bytes_uniform(make_source: SourceFactory) -> None:
    """Each of the 64 bit positions is Bernoulli(1/2) and the bytes are uniform on 0..255."""
    words = make_source(101).words(125_000)
    assert words.dtype == np.uint64 and words.shape == (125_000,)
    bits = np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1)
    # Two families at ALPHA / 2 each: the 64 bit-position tests (ALPHA / 128 apiece) and
    # the byte chi-square; total false-failure rate <= 1e-6.
    assert_binomials(bits.sum(axis=0), words.size, 0.5, alpha=ALPHA / 2, label="bit")
    byte_counts = np.bincount(words.view(np.uint8), minlength=256)
    assert_chisquare(byte_counts, np.full(256, 1 / 256), alpha=ALPHA / 2, label="bytes")
    assert make_source(101).words(0).shape == (0,)


@pytest.mark.parametrize(
    "bits",
    [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937],
)
def test_words_are_the_generators_full_range_integers(bits: type[np.random.BitGenerator]) -> None:
    """A seeded source's words are exactly numpy's full-range uint64 integers of the same
    generator: the raw-output shortcut (``random_raw``, taken for the bit generators whose
    raw output is one 64-bit word) changes no simulation's stream, and MT19937 (32-bit raw
    output) keeps the general path."""
    words = RandomSource(np.random.Generator(bits(7))).words(1000)
    expected = np.random.Generator(bits(7)).integers(
        0, 2**64 - 1, size=1000, dtype=np.uint64, endpoint=True
    )
    assert words.dtype == np.uint64
    assert np.array_equal(words, expected)


def test_uniform_grid_and_ks(make_source: SourceFactory) -> None:
    """uniform() returns multiples of 2**-53 in [0, 1), Kolmogorov-Smirnov-consistent (1e-6)."""
    values = make_source(102).uniform(200_000)
    assert values.dtype == np.float64
    assert values.min() >= 0.0 and values.max() < 1.0
    scaled = values * TWO_53
    assert np.array_equal(scaled, np.floor(scaled))
    result = stats.kstest(values, "uniform")
    assert result.pvalue > ALPHA, f"KS p = {result.pvalue:.3g}"


# --------------------------------------------------------------------------------------
# integers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("high", [2, 3, 5, 7, 10, 64, 100, 1000])
def test_integers_small_range_uniform(make_source: SourceFactory, high: int) -> None:
    """Scalar high: chi-square uniformity on {0..high-1} (alpha 1e-6), n = 2e5."""
    values = make_source(200 + high).integers(high, size=200_000)
    assert values.dtype == np.int64 and values.shape == (200_000,)
    assert values.min() >= 0 and values.max() < high
    assert_chisquare(np.bincount(values, minlength=high), np.full(high, 1 / high), label="ints")


@pytest.mark.parametrize("high", [2**40 + 3, 3 * 2**60 + 1, 2**63 - 1])
def test_integers_large_range_uniform(make_source: SourceFactory, high: int) -> None:
    """Large high: chi-square on 1000 exact bins (top bits) and on value mod 256 (low bits).

    The low-bits test catches generators that lose precision past 2**53 (e.g.
    ``floor(uniform * high)``). Two assertions, each at ALPHA / 2.
    """
    values = make_source(300 + high % 1000).integers(high, size=200_000)
    assert values.min() >= 0 and values.max() < high
    counts, probs = uniform_bins(values, high, 1000)
    assert_chisquare(counts, probs, alpha=ALPHA / 2, label="top bins")
    assert_chisquare(
        np.bincount(values % 256, minlength=256),
        residue_probs(high, 256),
        alpha=ALPHA / 2,
        label="low byte",
    )


def test_integers_high_one_is_always_zero(make_source: SourceFactory) -> None:
    """high = 1 has one value: 0, whether scalar, with size, or an array of ones."""
    source = make_source(400)
    assert source.integers(1, size=10_000).tolist() == [0] * 10_000
    assert np.array_equal(source.integers(np.ones((50, 3), dtype=np.int64)), np.zeros((50, 3)))
    scalar = source.integers(1)
    assert scalar.shape == () and int(scalar) == 0


def test_integers_per_element_high(make_source: SourceFactory) -> None:
    """Array high (2-D, mixed small and large bounds): shape kept, each column uniform.

    Eight chi-square tests (one per column with high > 1), each at ALPHA / 8.
    """
    highs = np.array([1, 2, 3, 5, 6, 7, 12, 100, 2**40 + 3], dtype=np.int64)
    rows = 60_000
    values = make_source(401).integers(np.tile(highs, (rows, 1)))
    assert values.shape == (rows, highs.size) and values.dtype == np.int64
    assert np.all(values >= 0) and np.all(values < highs)
    assert np.all(values[:, 0] == 0)
    for column, high in enumerate(highs[1:], start=1):
        counts, probs = uniform_bins(values[:, column], int(high), 100)
        assert_chisquare(counts, probs, alpha=ALPHA / 8, label=f"high={high}")


def test_integers_rejects_high_below_one() -> None:
    """high < 1 anywhere is a ValueError, for both sources."""
    for source in (RandomSource(np.random.default_rng(0)), RandomSource(None)):
        for bad in (0, -1, [3, 0, 2]):
            with pytest.raises(ValueError, match="high >= 1"):
                source.integers(bad)


# --------------------------------------------------------------------------------------
# bernoulli
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1e-3, 0.1, 1 / 3, 0.5, 0.73, 0.999])
def test_bernoulli_scalar_p(make_source: SourceFactory, p: float) -> None:
    """Scalar p: the count of Trues in 1e6 draws is Binomial(1e6, exact_probability(p))."""
    draws = make_source(500 + int(p * 1000)).bernoulli(p, size=1_000_000)
    assert draws.dtype == np.bool_ and draws.shape == (1_000_000,)
    assert_binomial(draws.sum(), draws.size, exact_probability(p), label=f"p={p}")


def test_bernoulli_p_zero_and_one(make_source: SourceFactory) -> None:
    """p = 0 is never True and p = 1 always True, exactly; scalar p without size is 0-d."""
    source = make_source(510)
    assert not source.bernoulli(0.0, size=200_000).any()
    assert source.bernoulli(1.0, size=200_000).all()
    assert exact_probability(0.0) == 0.0 and exact_probability(1.0) == 1.0
    assert source.bernoulli(0.5).shape == ()


def test_bernoulli_per_element_p(make_source: SourceFactory) -> None:
    """Array p (2-D): shape kept; p = 0 / 1 columns exact; other columns binomial.

    Five binomial tests (columns with 0 < p < 1), each at ALPHA / 5.
    """
    probs = np.array([0.0, 1e-3, 0.1, 0.5, 0.73, 0.999, 1.0])
    draws = make_source(511).bernoulli(np.tile(probs, (200_000, 1)))
    assert draws.shape == (200_000, probs.size) and draws.dtype == np.bool_
    assert not draws[:, 0].any() and draws[:, -1].all()
    for column, p in enumerate(probs[1:-1], start=1):
        assert_binomial(
            draws[:, column].sum(),
            draws.shape[0],
            exact_probability(float(p)),
            alpha=ALPHA / 5,
            label=f"p={p}",
        )


@pytest.mark.parametrize(
    "p", [0.0, 2.0**-54, 2.0**-53, 3 * 2.0**-54, 1e-3, 0.1, 0.5, 0.73, 1 - 2.0**-53, 1.0]
)
def test_threshold53_is_exact_floor_or_ceiling(p: float) -> None:
    """threshold53(p, "down") = floor(p * 2**53) and (p, "up") = ceil(p * 2**53) in exact
    arithmetic; exact_probability = floor / 2**53 and realized_probability(T) = T / 2**53."""
    floor, ceiling = math.floor(Fraction(p) * TWO_53), math.ceil(Fraction(p) * TWO_53)
    assert int(threshold53(p, "down")) == floor
    assert int(threshold53(p, "up")) == ceiling
    assert exact_probability(p) == floor / TWO_53 == realized_probability(floor)
    assert threshold53(np.array([p, p]), "down").tolist() == [floor, floor]
    assert threshold53(np.array([p, p]), "up").tolist() == [ceiling, ceiling]


def test_threshold53_needs_a_rounding_direction() -> None:
    with pytest.raises(ValueError, match="rounding must be 'down' or 'up'"):
        threshold53(0.5, "nearest")  # type: ignore[arg-type]


@pytest.mark.parametrize("epsilon", [1e-3, 0.5, 1.0, 2.3, 8.0, 20.0])
def test_ratio_within_epsilon_is_exact_at_the_boundary(epsilon: float) -> None:
    """Rationals a relative 1e-40 below e^eps are accepted, 1e-40 above refused: the
    comparison resolves far finer than any 53-bit threshold step (>= 2^-53 relative)."""
    with localcontext(Context(prec=80)):
        exact = Fraction(Decimal(epsilon).exp())  # e^eps to 80 digits
    assert ratio_within_epsilon(exact * (1 - Fraction(1, 10**40)), epsilon)
    assert not ratio_within_epsilon(exact * (1 + Fraction(1, 10**40)), epsilon)


def test_certified_threshold_steps_in_the_safe_direction() -> None:
    """T / (2^53 - T) <= e^eps: from a start above the largest such T, stepping down
    ends exactly at the largest; a ratio that never fits is refused with a ValueError."""
    epsilon = 1.0
    ratio = lambda t: Fraction(t, TWO_53 - t)  # noqa: E731
    with localcontext(Context(prec=60)):
        e = Fraction(Decimal(epsilon).exp())
    largest = math.floor(e * TWO_53 / (1 + e))  # T <= e (2^53 - T)
    assert certified_threshold((largest + 3) / TWO_53, "down", ratio, epsilon) == largest
    assert step_until_within(largest + 5, "down", ratio, epsilon) == largest
    with pytest.raises(ValueError, match="likelihood ratio"):
        step_until_within(largest + 1, "up", ratio, epsilon)


def _crafted_words(tops: list[int]) -> Callable[[int], np.ndarray]:
    """A ``words`` replacement returning words whose top 53 bits are ``tops`` (low bits set)."""

    def words(size: int) -> np.ndarray:
        assert size == len(tops)
        return (np.array(tops, dtype=np.uint64) << np.uint64(11)) | np.uint64(0x7FF)

    return words


@pytest.mark.parametrize("p", [2.0**-53, 1e-3, 0.1, 0.5, 0.73, 1 - 2.0**-53])
def test_bernoulli_threshold_boundary(monkeypatch: pytest.MonkeyPatch, p: float) -> None:
    """White-box: bernoulli is True iff U < T for the 53-bit U = word >> 11 (so P = T / 2**53).

    Words with U = T - 1 must give True and U = T, T + 1 False; U = 0 is True
    (T >= 1 here) and U = 2**53 - 1 False (T < 2**53).
    """
    threshold = int(threshold53(p, "down"))
    tops = [threshold - 1, threshold, min(threshold + 1, TWO_53 - 1), 0, TWO_53 - 1]
    source = RandomSource(None)
    monkeypatch.setattr(source, "words", _crafted_words(tops))
    assert source.bernoulli(p, size=len(tops)).tolist() == [True, False, False, True, False]


def test_bernoulli_threshold_boundary_p_zero_and_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """White-box: p = 0 is False even at U = 0; p = 1 is True even at U = 2**53 - 1."""
    source = RandomSource(None)
    monkeypatch.setattr(source, "words", _crafted_words([0, TWO_53 - 1]))
    assert source.bernoulli(0.0, size=2).tolist() == [False, False]
    assert source.bernoulli(1.0, size=2).tolist() == [True, True]


# --------------------------------------------------------------------------------------
# bernoulli_bits
# --------------------------------------------------------------------------------------

BITS_PROBS = [1e-3, 0.1, 0.5, 0.73]
BITS_ROWS, BITS_WIDTH = 100_000, 130  # 1.3e7 bits; 6.5e6 disjoint pairs (>= 5 (1,1) at 1e-3)


@pytest.mark.parametrize("bits", [1, 7, 8, 9, 63, 64, 65, 77, 130])
def test_bernoulli_bits_layout(make_source: SourceFactory, bits: int) -> None:
    """Shape (rows, ceil(bits/8)) uint8, zero padding, unpackbits(count=bits) is the matrix.

    p = 1 sets every real bit and no padding bit; p = 0 sets nothing.
    """
    source = make_source(600 + bits)
    rows, nbytes = 257, (bits + 7) // 8
    for p in (0.0, 0.5, 1.0):
        packed = source.bernoulli_bits(int(threshold53(p, "down")), rows, bits)
        assert packed.dtype == np.uint8 and packed.shape == (rows, nbytes)
        full = np.unpackbits(packed, axis=1)
        assert not full[:, bits:].any(), "padding bits must be zero"
        matrix = np.unpackbits(packed, axis=1, count=bits)
        assert matrix.shape == (rows, bits)
        assert np.array_equal(np.packbits(matrix, axis=1), packed)
        if p == 0.0:
            assert not matrix.any()
        if p == 1.0:
            assert matrix.all()
    assert source.bernoulli_bits(int(threshold53(0.5, "down")), 0, bits).shape == (0, nbytes)


@pytest.mark.parametrize("p", BITS_PROBS)
def test_bernoulli_bits_frequencies(make_source: SourceFactory, p: float) -> None:
    """Each of 130 bit positions and the total count are Binomial at exact_probability(p).

    131 binomial tests, each at ALPHA / 131.
    """
    threshold = int(threshold53(p, "down"))
    packed = make_source(700 + int(p * 1000)).bernoulli_bits(threshold, BITS_ROWS, BITS_WIDTH)
    matrix = np.unpackbits(packed, axis=1, count=BITS_WIDTH)
    prob = exact_probability(p)
    family = BITS_WIDTH + 1
    assert_binomials(
        matrix.sum(axis=0),
        BITS_ROWS,
        prob,
        alpha=ALPHA * BITS_WIDTH / family,
        label=f"p={p} position",
    )
    assert_binomial(
        int(matrix.sum(dtype=np.int64)),
        matrix.size,
        prob,
        alpha=ALPHA / family,
        label=f"p={p} total",
    )


@pytest.mark.parametrize("p", [1e-3, 0.27, 0.5])
@pytest.mark.slow
def test_bernoulli_bits_small_matrices_frequencies(make_source: SourceFactory, p: float) -> None:
    """One-row matrices (the direct draw, one U per bit) stacked over 20,000 calls: each of
    the 130 positions and the total are Binomial at exact_probability(p) (131 tests, each at
    ALPHA / 131)."""
    source = make_source(900 + int(p * 1000))
    rows, threshold = 20_000, int(threshold53(p, "down"))
    matrix = np.concatenate(
        [
            np.unpackbits(source.bernoulli_bits(threshold, 1, BITS_WIDTH), axis=1, count=BITS_WIDTH)
            for _ in range(rows)
        ]
    )
    prob, family = exact_probability(p), BITS_WIDTH + 1
    assert_binomials(
        matrix.sum(axis=0), rows, prob, alpha=ALPHA * BITS_WIDTH / family, label=f"p={p} position"
    )
    assert_binomial(
        int(matrix.sum(dtype=np.int64)), matrix.size, prob, alpha=ALPHA / family, label="total"
    )


@pytest.mark.parametrize("p", BITS_PROBS)
def test_bernoulli_bits_adjacent_independence(make_source: SourceFactory, p: float) -> None:
    """Neighbouring bits are independent: 2x2 chi-square on disjoint pairs.

    Pairs (2k, 2k+1) within bytes, pairs (2k+1, 2k+2) across every byte and word
    boundary (7|8, 63|64, 127|128), and the same bit in rows 2i, 2i+1. Three
    contingency tests, each at ALPHA / 3.
    """
    threshold = int(threshold53(p, "down"))
    packed = make_source(800 + int(p * 1000)).bernoulli_bits(threshold, BITS_ROWS, BITS_WIDTH)
    matrix = np.unpackbits(packed, axis=1, count=BITS_WIDTH).astype(bool)
    assert_contingency_independent(
        matrix[:, 0::2], matrix[:, 1::2], alpha=ALPHA / 3, label=f"p={p} (2k, 2k+1)"
    )
    assert_contingency_independent(
        matrix[:, 1:-1:2], matrix[:, 2::2], alpha=ALPHA / 3, label=f"p={p} (2k+1, 2k+2)"
    )
    assert_contingency_independent(
        matrix[0::2], matrix[1::2], alpha=ALPHA / 3, label=f"p={p} rows (2i, 2i+1)"
    )


def _bit_words(threshold: int, flip_at: int | None) -> Callable[[int], np.ndarray]:
    """A ``words`` replacement feeding U's bits from position 52 down, one call per position.

    Every lane's U copies T's bit at each position, except at ``flip_at`` where
    it takes 0 (T has a 1 there), making U < T in every lane.
    """
    positions: Iterator[int] = iter(range(52, -1, -1))

    def words(size: int) -> np.ndarray:
        position = next(positions)
        bit = (threshold >> position) & 1 and position != flip_at
        return np.full(size, np.iinfo(np.uint64).max if bit else 0, dtype=np.uint64)

    return words


@pytest.mark.parametrize("p", [2.0**-53, 1e-3, 0.1, 0.5, 0.73, 1 - 2.0**-53])
def test_bernoulli_bits_threshold_boundary(monkeypatch: pytest.MonkeyPatch, p: float) -> None:
    """White-box: a bit is 1 iff U < T exactly: U = T gives 0, U just below T gives 1.

    Relies on the documented lazy comparison: U's bits are drawn most significant
    first, one call of ``words`` per bit position (a matrix above the direct-draw size).
    """
    threshold = int(threshold53(p, "down"))
    lowest_one = (threshold & -threshold).bit_length() - 1
    rows = DIRECT_BERNOULLI_WORDS  # 64 rows of 10 bytes: 80 words, the lazy path
    for flip_at, expected in ((None, 0), (lowest_one, 1)):
        source = RandomSource(None)
        monkeypatch.setattr(source, "words", _bit_words(threshold, flip_at))
        matrix = np.unpackbits(source.bernoulli_bits(threshold, rows, 77), axis=1, count=77)
        assert np.all(matrix == expected), f"U {'= T' if flip_at is None else '< T'}"


@pytest.mark.parametrize("p", [2.0**-53, 1e-3, 0.5, 1 - 2.0**-53])
def test_bernoulli_bits_direct_draw_boundary(monkeypatch: pytest.MonkeyPatch, p: float) -> None:
    """White-box, small matrices (one 56-bit V per bit: its top byte, then, for the lanes
    where that byte ties with 8 T's, its six other bytes): V = 8 T gives 0, V = 8 T - 1
    gives 1."""
    threshold = int(threshold53(p, "down"))
    for v, expected in ((threshold << 3, 0), ((threshold << 3) - 1, 1)):
        source = RandomSource(None)
        octets = v.to_bytes(7, "big")
        draws = iter([octets[:1], octets[1:]])  # the top byte, then six per tied lane

        def fake(size: int, d: Iterator[bytes] = draws) -> np.ndarray:
            chunk = next(d)
            return np.frombuffer(chunk * (size // len(chunk)), dtype=np.uint8).copy()

        monkeypatch.setattr(source, "octets", fake)
        matrix = np.unpackbits(source.bernoulli_bits(threshold, 3, 77), axis=1, count=77)
        assert np.all(matrix == expected), f"V = 8T{'' if expected == 0 else ' - 1'}"


# --------------------------------------------------------------------------------------
# bernoulli_row (one report of a unary encoding)
# --------------------------------------------------------------------------------------

ROW_BITS = 13  # two bytes, three padding bits
ROW_SPECIAL = 5


def test_bernoulli_row_frequencies(make_source: SourceFactory) -> None:
    """20,000 rows of 13 bits, bit 5 at p = 0.5 and the others at q = 0.27: the padding is
    zero, and each position is Binomial at its exact_probability (13 tests, each at
    ALPHA / 13)."""
    source = make_source(1_300)
    rows = 20_000
    q_threshold, p_threshold = int(threshold53(0.27, "down")), int(threshold53(0.5, "down"))
    packed = np.stack(
        [source.bernoulli_row(q_threshold, ROW_BITS, ROW_SPECIAL, p_threshold) for _ in range(rows)]
    )
    assert packed.shape == (rows, 2) and packed.dtype == np.uint8
    assert not (packed[:, 1] & 0b111).any(), "padding bits must be zero"
    counts = np.unpackbits(packed, axis=1, count=ROW_BITS).sum(axis=0)
    probs = np.full(ROW_BITS, exact_probability(0.27))
    probs[ROW_SPECIAL] = exact_probability(0.5)
    for position in range(ROW_BITS):
        assert_binomial(
            int(counts[position]),
            rows,
            float(probs[position]),
            alpha=ALPHA / ROW_BITS,
            label=f"position {position}",
        )


@pytest.mark.parametrize("p", [2.0**-53, 1e-3, 0.27, 0.5, 1 - 2.0**-53])
def test_bernoulli_row_boundary(monkeypatch: pytest.MonkeyPatch, p: float) -> None:
    """White-box: bit i is [V_i < 8 T_i] exactly, V_i = 8 T_i gives 0 and 8 T_i - 1 gives 1,
    for the special bit (at its own threshold, that of 0.3) and the others. Relies on the
    documented draw: one buffer of V's top bytes, then six bytes per tied bit (the special
    bit first, then the others in order)."""
    thresholds = np.full(ROW_BITS, int(threshold53(p, "down")), dtype=object)
    thresholds[ROW_SPECIAL] = int(threshold53(0.3, "down"))
    for offset, expected in ((0, 0), (-1, 1)):
        values = [(int(t) << 3) + offset for t in thresholds]
        if min(values) < 0:
            continue  # T = 0 has no V below 8 T
        tops = bytes(v >> 48 for v in values)
        tied = [
            i
            for i in [ROW_SPECIAL] + [j for j in range(ROW_BITS) if j != ROW_SPECIAL]
            if tops[i] == (int(thresholds[i]) << 3) >> 48
        ]
        rests = b"".join((values[i] & ((1 << 48) - 1)).to_bytes(6, "big") for i in tied)
        draws = iter([tops, rests])
        source = RandomSource(None)
        monkeypatch.setattr(source, "raw_bytes", lambda size, d=draws: next(d))
        row = source.bernoulli_row(
            int(thresholds[0]), ROW_BITS, ROW_SPECIAL, int(thresholds[ROW_SPECIAL])
        )
        bits = np.unpackbits(row, count=ROW_BITS)
        assert np.all(bits == expected), f"V = 8T{'' if expected == 0 else ' - 1'}: {bits}"


def test_bernoulli_row_certain_bits_and_errors(make_source: SourceFactory) -> None:
    """Probability 0 gives 0 and probability 1 gives 1, whatever is drawn; a special bit
    outside the row is refused."""
    source = make_source(1_301)
    zero, one = int(threshold53(0.0, "down")), int(threshold53(1.0, "down"))
    for _ in range(200):
        assert np.unpackbits(source.bernoulli_row(zero, 20, 3, one), count=20).tolist() == [
            int(i == 3) for i in range(20)
        ]
        assert np.unpackbits(source.bernoulli_row(one, 20, 3, zero), count=20).tolist() == [
            int(i != 3) for i in range(20)
        ]
    with pytest.raises(ValueError, match="special bit 20 is outside 0..19"):
        source.bernoulli_row(zero, 20, 20, one)


# --------------------------------------------------------------------------------------
# bernoulli_exp
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numerator", "denominator"),
    [(1, 3), (99, 100), (7, 7), (1, 1), (101, 100), (5, 2), (10, 1)],
)
def test_bernoulli_exp_probability(
    make_source: SourceFactory, numerator: int, denominator: int
) -> None:
    """P(True) = exp(-numerator / denominator) for gamma < 1, = 1 and > 1 (binomial, n = 5e5)."""
    n = 500_000
    draws = make_source(900 + numerator).bernoulli_exp(np.full(n, numerator), denominator)
    assert draws.dtype == np.bool_ and draws.shape == (n,)
    assert_binomial(
        draws.sum(), n, math.exp(-numerator / denominator), label=f"gamma={numerator}/{denominator}"
    )


def test_bernoulli_exp_per_element(make_source: SourceFactory) -> None:
    """Array numerators (2-D) over one denominator: shape kept, each value's rate exp(-gamma).

    gamma = 0 is always True; seven binomial tests, each at ALPHA / 7.
    """
    numerators = np.array([0, 1, 2, 3, 4, 5, 7, 10], dtype=np.int64)
    rows = 100_000
    draws = make_source(910).bernoulli_exp(np.tile(numerators, (rows, 1)), 3)
    assert draws.shape == (rows, numerators.size) and draws.dtype == np.bool_
    assert draws[:, 0].all()
    for column, numerator in enumerate(numerators[1:], start=1):
        assert_binomial(
            draws[:, column].sum(),
            rows,
            math.exp(-numerator / 3),
            alpha=ALPHA / 7,
            label=f"gamma={numerator}/3",
        )


def test_bernoulli_exp_scalar_and_errors() -> None:
    """A scalar numerator gives a 0-d result; negative numerators or denominators < 1 fail."""
    for source in (RandomSource(np.random.default_rng(911)), RandomSource(None)):
        assert source.bernoulli_exp(0, 5).shape == ()
        assert bool(source.bernoulli_exp(0, 5))
        assert source.bernoulli_exp(7, 2).shape == ()
        with pytest.raises(ValueError):
            source.bernoulli_exp(-1, 3)
        with pytest.raises(ValueError):
            source.bernoulli_exp(np.array([1, -2]), 3)
        with pytest.raises(ValueError):
            source.bernoulli_exp(1, 0)


# --------------------------------------------------------------------------------------
# geometric_exp
# --------------------------------------------------------------------------------------


def test_geometric_exp_pmf(make_source: SourceFactory) -> None:
    """P(V = v) = (1 - e^-1) e^-v for v >= 0: chi-square (tail binned), n = 1e6."""
    values = make_source(1000).geometric_exp(1_000_000)
    assert values.dtype == np.int64 and values.shape == (1_000_000,)
    assert values.min() >= 0
    counts, probs = integer_bins(
        values,
        pmf=lambda v: (1 - math.exp(-1)) * np.exp(-v.astype(np.float64)),
        lower_tail=lambda k: 0.0,
        upper_tail=lambda k: math.exp(-k),  # P(V >= k) = e^-k
        lo=0,
        hi=60,
    )
    assert_chisquare(counts, probs, label="geometric_exp")
    assert make_source(1001).geometric_exp(0).shape == (0,)


# --------------------------------------------------------------------------------------
# discrete_laplace
# --------------------------------------------------------------------------------------

#: (s, t): large g = 2 (small scale), g = 1/3, g = 3/7 with s > 1, g = 1/50 (large scale).
LAPLACE_PARAMS = [(2, 1), (1, 3), (3, 7), (1, 50)]


def _laplace_upper_tail(s: int, t: int, k: int) -> float:
    """P(Y >= k) = r^k / (1 + r) for k >= 1, r = e^(-s/t) (from P(Y = y) ∝ r^|y|)."""
    r = math.exp(-s / t)
    return r**k / (1 + r)


def _laplace_moments(s: int, t: int) -> tuple[float, float]:
    """(E[Y^2], E[Y^4]) by direct summation of (1 - r)/(1 + r) r^|y| over |y| <= 100 t / s."""
    r = math.exp(-s / t)
    y = np.arange(1, 100 * t // s + 2, dtype=np.float64)
    weights = 2 * (1 - r) / (1 + r) * r**y  # y and -y
    return float(np.sum(weights * y**2)), float(np.sum(weights * y**4))


def test_discrete_laplace_reference_formulas() -> None:
    """discrete_laplace_pmf and discrete_laplace_variance agree with (1-r)/(1+r) r^|y|."""
    for s, t in LAPLACE_PARAMS:
        r = math.exp(-s / t)
        y = np.arange(-20, 21)
        assert np.allclose(
            discrete_laplace_pmf(y, s, t), (1 - r) / (1 + r) * r ** np.abs(y), rtol=1e-12, atol=0
        )
        second, _ = _laplace_moments(s, t)
        assert math.isclose(discrete_laplace_variance(s, t), second, rel_tol=1e-10)


@pytest.mark.parametrize(("s", "t"), LAPLACE_PARAMS)
def test_discrete_laplace_pmf_fit(make_source: SourceFactory, s: int, t: int) -> None:
    """Chi-square against discrete_laplace_pmf, both tails binned to expected counts >= 5."""
    values = make_source(1100 + 10 * s + t).discrete_laplace(s, t, 300_000)
    assert values.dtype == np.int64 and values.shape == (300_000,)
    bound = 100 * t // s + 10
    counts, probs = integer_bins(
        values,
        pmf=lambda y: discrete_laplace_pmf(y, s, t),
        lower_tail=lambda k: _laplace_upper_tail(s, t, -k),  # symmetric: P(Y <= k) = P(Y >= -k)
        upper_tail=lambda k: _laplace_upper_tail(s, t, k),
        lo=-bound,
        hi=bound,
    )
    assert_chisquare(counts, probs, label=f"discrete_laplace s={s} t={t}")


@pytest.mark.parametrize(("s", "t"), LAPLACE_PARAMS)
def test_discrete_laplace_moments_and_symmetry(make_source: SourceFactory, s: int, t: int) -> None:
    """Mean 0, E[Y^2] = discrete_laplace_variance, and sign symmetry.

    z-tests use the exact sd of the sample mean sqrt(Var / n) and of the sample
    second moment sqrt((E[Y^4] - Var^2) / n); the sign of the nonzero values is
    Binomial(1/2). Three assertions, each at ALPHA / 3 (|z| < 5.10).
    """
    n = 300_000
    values = make_source(1200 + 10 * s + t).discrete_laplace(s, t, n)
    variance = discrete_laplace_variance(s, t)
    _, fourth = _laplace_moments(s, t)
    as_float = values.astype(np.float64)
    assert_z(as_float.mean() / math.sqrt(variance / n), alpha=ALPHA / 3, label="mean")
    second = float(np.mean(as_float**2))
    assert_z(
        (second - variance) / math.sqrt((fourth - variance**2) / n),
        alpha=ALPHA / 3,
        label="second moment",
    )
    nonzero = values[values != 0]
    assert_binomial(int(np.sum(nonzero < 0)), nonzero.size, 0.5, alpha=ALPHA / 3, label="sign")


def test_discrete_laplace_rejects_bad_parameters() -> None:
    """s < 1 or t < 1 is a ValueError; size 0 gives an empty int64 array."""
    source = RandomSource(np.random.default_rng(1300))
    for s, t in ((0, 1), (1, 0), (-2, 3)):
        with pytest.raises(ValueError):
            source.discrete_laplace(s, t, 10)
    empty = source.discrete_laplace(1, 2, 0)
    assert empty.shape == (0,) and empty.dtype == np.int64


# --------------------------------------------------------------------------------------
# RandomSource contract
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [np.random.RandomState(0), np.random.PCG64(0), random.Random(0), 0, "secure"],
    ids=["RandomState", "PCG64", "random.Random", "int", "str"],
)
def test_random_source_rejects_non_generator(bad: Any) -> None:
    """Only a numpy Generator or None is accepted; anything else is a TypeError."""
    with pytest.raises(TypeError, match="Generator"):
        RandomSource(bad)


@pytest.mark.parametrize(
    "bad",
    [-0.1, -1e-300, 1.0000001, 2.0, math.nan, math.inf, -math.inf, [0.5, math.nan], [0.2, 1.5]],
)
def test_threshold53_rejects_outside_unit_interval(bad: Any) -> None:
    """p outside [0, 1], NaN or infinite is a ValueError (also inside arrays and bernoulli)."""
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        threshold53(bad, "down")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        threshold53(bad, "up")
    with pytest.raises(ValueError):
        RandomSource(np.random.default_rng(0)).bernoulli(bad)


def test_threshold53_endpoints() -> None:
    """threshold53 maps 0 to 0 and 1 to 2**53 (the always-True threshold), either way."""
    assert threshold53([0.0, 1.0], "down").tolist() == [0, TWO_53]
    assert threshold53([0.0, 1.0], "up").tolist() == [0, TWO_53]
    assert threshold53(0.5, "down").dtype == np.uint64


def test_thresholds_outside_the_53_bit_range_are_refused() -> None:
    source = RandomSource(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"0\.\.2\*\*53"):
        source.bernoulli_below(TWO_53 + 1, 4)
    with pytest.raises(ValueError, match=r"0\.\.2\*\*53"):
        source.bernoulli_bits(TWO_53 + 1, 2, 9)


def test_secure_property_and_as_source() -> None:
    """secure is True exactly for the OS CSPRNG; as_source wraps or passes through."""
    assert RandomSource().secure and RandomSource(None).secure
    assert not RandomSource(np.random.default_rng(0)).secure
    source = RandomSource(np.random.default_rng(0))
    assert as_source(source) is source
    assert as_source(None).secure
    assert not as_source(np.random.default_rng(0)).secure


def test_seeded_source_is_reproducible_and_os_source_is_not() -> None:
    """Equal seeds give equal outputs from every sampler; two CSPRNG draws differ.

    Two 4-word CSPRNG draws coincide with probability 2**-256.
    """

    def draw_all(source: RandomSource) -> list[np.ndarray]:
        return [
            source.words(16),
            source.uniform(16),
            source.integers(np.array([3, 2**40 + 3, 1000])),
            source.bernoulli(0.3, size=16),
            source.bernoulli_bits(int(threshold53(0.3, "down")), 4, 77),
            source.bernoulli_below(np.array([1, 2**52, 2**53 - 1]), 3),
            source.bernoulli_exp(np.arange(8), 3),
            source.geometric_exp(16),
            source.discrete_laplace(1, 3, 16),
        ]

    first = draw_all(RandomSource(np.random.default_rng(1400)))
    second = draw_all(RandomSource(np.random.default_rng(1400)))
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a, b)
    secure = RandomSource(None)
    assert not np.array_equal(secure.words(4), secure.words(4))
