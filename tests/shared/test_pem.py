"""PEM (``shared.mechanisms.pem``): parameters, hash, exact privacy, samplers, estimator, discovery.

* Parameters: groups, buckets and seeds follow the documented rule, and the statistics
  stay within 2^22 counts and 2^16 (group, seed) pairs with at least 64 seeds at every
  (max_length, epsilon); the
  collision probability is the closed form of the multiply-shift bucket sizes.
* Hash: the module's fingerprints and buckets are the docstring's recipe, recomputed
  here from hashlib and Python integers; over random pairs of prefixes, collisions across
  the S seeds are binomial(S, c) and buckets are uniform (the random-function model the
  estimator rests on).
* Prefixes (``shared.mechanisms.strings``): the UTF-8 automaton agrees with Python's
  decoder on every string of up to two bytes, on random longer ones, and on which partial
  prefixes can be completed; extending prefixes a byte at a time keeps exactly those.
* Privacy, exactly: at max_length 1 every value and every report enumerate; the largest
  likelihood ratio is e^epsilon up to float rounding (and the realized p / o is proven at
  most e^epsilon, within 1e-9 of it, in exact arithmetic); at max_length 2 each group's
  report is epsilon-LDP and tight, and the group does not depend on the value.
* Samplers: ``encode`` + ``aggregate`` and the fast path ``simulate_statistics`` against
  the exact law of the statistics (chi-square over cells); a device's group is stable.
* Estimator: given the one public hash, the mean of the estimates is the exact
  conditional expectation (the realized collisions included); over fresh strings (a
  fresh draw of the hash, in the random-function model) it is unbiased with the
  documented variance, hash-collision term included, and the reported std agrees.
* Discovery: the true top-10 of a Zipf(1.1) population of 10^6 users at epsilon 4 is
  found with recall >= 0.9, with estimates within their std; non-ASCII strings and the
  empty string are found and decoded.
* Wire and statistics: payload round trip, bad payloads and inputs refused with a
  message, statistics sparse or dense, merged, serialized.

Tolerances. Every statistical assertion has a false-failure rate of at most ALPHA = 1e-6
(chi-square and binomial tests use their p-values; means use normal quantiles; variances
chi-square quantiles of the sample variance of independent trials, each estimate being a
sum of thousands of independent bounded terms). Seeds are fixed, so outcomes are
deterministic; its 9 statistical items (Bonferroni within each) make a false failure of
this file less likely than 1e-5 for a random seed.
"""

from __future__ import annotations

import codecs
import hashlib
import math
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.estimates import HeavyHitters
from shared.mechanisms import DeviceContext, as_discovery, pem
from shared.mechanisms.pem import (
    MAX_CELLS,
    MAX_HEAVY_HITTERS,
    MAX_LEVEL_CANDIDATES,
    MIN_SEEDS,
    SCREEN_SHARE,
    PrefixExtendingMethod,
    collision_probability,
    fingerprints,
    hash_buckets,
)
from shared.mechanisms.strings import (
    UTF8_START,
    padded_matrix,
    utf8_extensions,
    well_formed_prefixes,
)
from shared.memo import KeyedMemo, SimulatedMemo, memo_scope
from shared.randomness import BITS53, ratio_within_epsilon
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
#: Relative slack of a float likelihood ratio (products of a few correctly rounded doubles).
RATIO_RTOL = 1e-12
#: Relative distance from e^epsilon within which the exact ratio must lie (tightness).
TIGHT = 1e-9
MASK64 = (1 << 64) - 1


def build(epsilon: float, max_length: int) -> PrefixExtendingMethod:
    spec = MechanismSpec(mechanism="pem", epsilon=epsilon, max_length=max_length)
    return PrefixExtendingMethod(spec)


def z_two_sided(alpha: float) -> float:
    return float(stats.norm.isf(alpha / 2))


def reference_bucket(prefix: bytes, seed: int, buckets: int) -> int:
    """H_s(P) from the module docstring, in Python integers."""
    header = b"LDP PEM v1\x00" + (8 * len(prefix)).to_bytes(2, "big")
    z = int.from_bytes(hashlib.sha256(header + prefix).digest()[:8], "little")
    z = (z + (seed + 1) * 0x9E3779B97F4A7C15) & MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return ((z >> 32) * buckets) >> 32


def padded(value: str, max_length: int) -> bytes:
    raw = value.encode("utf-8")
    return raw + b"\xff" * (max_length - len(raw))


def seed_buckets(mech: PrefixExtendingMethod, prefixes: list[bytes]) -> np.ndarray:
    """H_s(P) for every prefix (one length) and every seed: (len(prefixes), S)."""
    matrix = np.frombuffer(b"".join(prefixes), dtype=np.uint8).reshape(len(prefixes), -1)
    return hash_buckets(fingerprints(matrix)[:, None], np.arange(mech.seeds), mech.buckets)


def cell_probabilities(
    mech: PrefixExtendingMethod, strings: list[str], counts: np.ndarray
) -> np.ndarray:
    """The exact law of one report of a user drawn from the population, as (G, S, g):
    (1 / (G S)) (o + (p - o) share of users whose group-j prefix hashes to y under s)."""
    p, other = mech.bucket_probabilities
    weights = counts / counts.sum()
    law = np.zeros((mech.groups, mech.seeds, mech.buckets))
    seeds = np.arange(mech.seeds)
    for group in range(mech.groups):
        prefixes = [padded(text, mech.max_length)[: group + 1] for text in strings]
        hashed = seed_buckets(mech, prefixes)
        for weight, row in zip(weights, hashed, strict=True):
            law[group, seeds, row] += weight
    return (other + (p - other) * law) / (mech.groups * mech.seeds)


def assert_cells_fit(observed: np.ndarray, law: np.ndarray, fold: int) -> None:
    """Pearson chi-square of (G, S, g) cell counts against the exact law, after summing
    blocks of ``fold`` adjacent seeds (a partition of the cells) so that every pooled cell
    expects at least 100 reports."""
    groups, seeds, buckets = law.shape
    observed = observed.reshape(groups, seeds // fold, fold, buckets).sum(axis=2).ravel()
    expected = law.reshape(groups, seeds // fold, fold, buckets).sum(axis=2).ravel()
    assert expected.sum() == pytest.approx(1.0, rel=1e-12)
    expected = expected * observed.sum()
    assert expected.min() >= 100, "too few reports per cell for the chi-square approximation"
    assert stats.chisquare(observed, expected).pvalue > ALPHA


def distinct_words(rng: np.random.Generator, count: int, alphabet: str, sizes: range) -> list[str]:
    """``count`` distinct random words over ``alphabet`` with lengths in ``sizes``."""
    words: dict[str, None] = {}
    letters = np.array(list(alphabet))
    while len(words) < count:
        size = int(rng.integers(sizes.start, sizes.stop))
        words.setdefault("".join(rng.choice(letters, size)), None)
    return list(words)


# ---------------------------------------------------------------------------------------
# Parameters and hash
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_length", [1, 2, 6, 33, 256])
@pytest.mark.parametrize("epsilon", [0.001, 0.5, 4.0, 9.0, 20.0])
def test_parameters_follow_the_rule_and_bound_the_statistics(
    max_length: int, epsilon: float
) -> None:
    mech = build(epsilon, max_length)
    assert mech.groups == max_length
    assert [mech.prefix_bits(j) for j in range(mech.groups)] == [
        8 * (j + 1) for j in range(max_length)
    ]
    assert mech.prefix_bits(mech.groups - 1) == 8 * max_length  # the last group: whole strings
    optimal = round(math.exp(epsilon)) + 1
    assert mech.buckets == min(optimal, MAX_CELLS // (MIN_SEEDS * max_length))
    assert mech.seeds == min(
        1 << 13, (1 << 16) // max_length, MAX_CELLS // (max_length * mech.buckets)
    )
    assert mech.seeds >= MIN_SEEDS
    assert mech.cells == mech.groups * mech.seeds * mech.buckets <= MAX_CELLS
    assert mech.groups * mech.seeds <= 1 << 16
    assert mech.empty_statistics().length == mech.cells
    assert as_discovery(mech) is not None and mech.kind == "string" and mech.name == "pem"


@pytest.mark.parametrize("buckets", [2, 3, 56, 1000, 65536])
def test_collision_probability_is_the_closed_form(buckets: int) -> None:
    """2^32 = m g + r words: r buckets hold m + 1 of them, the others m."""
    whole, extra = divmod(1 << 32, buckets)
    closed = Fraction(extra * (whole + 1) ** 2 + (buckets - extra) * whole**2, 1 << 64)
    assert collision_probability(buckets) == closed
    assert closed - Fraction(1, buckets) == Fraction(extra * (buckets - extra), buckets << 64)


def test_q_mixes_p_and_o_by_the_collision_probability() -> None:
    mech = build(4.0, 3)
    p, other = mech.bucket_probabilities
    c = float(collision_probability(mech.buckets))
    assert mech.collision == c
    assert mech.q == pytest.approx(c * p + (1 - c) * other, rel=1e-15)
    assert p / other <= math.exp(4.0) * (1 + RATIO_RTOL)


def test_hash_is_the_documented_recipe() -> None:
    rng = np.random.default_rng(5)
    for size in (1, 2, 5, 16):
        rows = rng.integers(0, 256, size=(40, size), dtype=np.uint8)
        seeds = rng.integers(0, 1 << 13, size=40)
        for buckets in (2, 56, 4097):
            ours = hash_buckets(fingerprints(rows), seeds, buckets)
            theirs = [
                reference_bucket(row.tobytes(), int(s), buckets)
                for row, s in zip(rows, seeds, strict=True)
            ]
            assert ours.tolist() == theirs
    assert padded_matrix([b"ab", b""], 3).tolist() == [[97, 98, 255], [255, 255, 255]]


def test_collisions_are_binomial_and_buckets_uniform() -> None:
    """The random-function model: for random pairs of distinct prefixes, the seeds on which
    they collide are Bin(S, c) (total and dispersion), and buckets are uniform."""
    mech = build(4.0, 3)
    rng = np.random.default_rng(17)
    pairs = 400
    rows = rng.integers(0, 256, size=(2 * pairs, 3), dtype=np.uint8)
    assert len({row.tobytes() for row in rows}) == 2 * pairs
    hashed = hash_buckets(fingerprints(rows)[:, None], np.arange(mech.seeds), mech.buckets)
    collisions = (hashed[:pairs] == hashed[pairs:]).sum(axis=1)
    c, seeds = mech.collision, mech.seeds
    assert stats.binomtest(int(collisions.sum()), pairs * seeds, c).pvalue > ALPHA / 3
    dispersion = float(((collisions - seeds * c) ** 2).sum() / (seeds * c * (1 - c)))
    assert stats.chi2.sf(dispersion, pairs) > ALPHA / 6
    assert stats.chi2.cdf(dispersion, pairs) > ALPHA / 6
    counts = np.bincount(hashed.ravel(), minlength=mech.buckets)
    assert stats.chisquare(counts).pvalue > ALPHA / 3


# ---------------------------------------------------------------------------------------
# Well-formed prefixes
# ---------------------------------------------------------------------------------------


def decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def is_padded_value(raw: bytes) -> bool:
    """Whole padded encoding: UTF-8, then only 0xFF."""
    cut = raw.find(b"\xff")
    body = raw if cut < 0 else raw[:cut]
    return decodes(body) and set(raw[len(body) :]) <= {0xFF}


def completable(raw: bytes, max_length: int) -> bool:
    """Some completion within max_length decodes: the next byte any continuation byte (its
    range depends on the lead byte), later ones 0x80 (Table 3-7 constrains only the byte
    after the lead). A prefix the incremental decoder already rejects has none."""
    if b"\xff" in raw:
        return is_padded_value(raw)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
    except UnicodeDecodeError:
        return False
    for missing in range(max_length - len(raw) + 1):
        tail = bytes([0x80] * (missing - 1))
        nexts = [b""] if missing == 0 else [bytes([first]) for first in range(0x80, 0xC0)]
        if any(decodes(raw + first + tail) for first in nexts):
            return True
    return False


def test_whole_values_are_exactly_the_padded_utf8_strings() -> None:
    rng = np.random.default_rng(3)
    samples = [bytes([a]) for a in range(256)]
    samples += [bytes([a, b]) for a in range(256) for b in range(256)]
    for size in (3, 4):
        rows = rng.integers(0, 256, size=(100_000, size), dtype=np.uint8)
        rows[:50_000, 0] = rng.integers(0xC0, 0x100, size=50_000)  # mostly multi-byte leads
        rows[:25_000, 1:] = rng.integers(0x80, 0xC0, size=(25_000, size - 1))
        samples += [row.tobytes() for row in rows]
    by_length: dict[int, list[bytes]] = {}
    for raw in samples:
        by_length.setdefault(len(raw), []).append(raw)
    for size, group in by_length.items():
        matrix = np.frombuffer(b"".join(group), dtype=np.uint8).reshape(len(group), size)
        ours = well_formed_prefixes(matrix, size)
        assert ours.tolist() == [is_padded_value(raw) for raw in group]


def test_prefixes_extended_byte_by_byte_are_the_completable_ones() -> None:
    """``utf8_extensions`` from the empty prefix, twice: exactly the one- and two-byte
    prefixes ``well_formed_prefixes`` keeps, in (prefix, byte) order, for max_length 2 to 4."""
    for max_length in (2, 3, 4):
        parent, first, states = utf8_extensions(np.array([UTF8_START]), 1, max_length)
        assert parent.tolist() == [0] * first.size
        singles = np.arange(256, dtype=np.uint8)[:, None]
        assert first.tolist() == np.flatnonzero(well_formed_prefixes(singles, max_length)).tolist()
        parent, second, _ = utf8_extensions(states, 2, max_length)
        pairs = np.stack([first[parent], second], axis=1).astype(np.uint8)
        every = np.array(list(np.ndindex(256, 256)), dtype=np.uint8)
        kept = every[well_formed_prefixes(every, max_length)]
        assert pairs.tolist() == kept.tolist()


@pytest.mark.slow
def test_partial_prefixes_are_kept_exactly_when_completable() -> None:
    for max_length in (2, 4):
        for size in (1, 2):
            raws = [bytes(pair) for pair in np.ndindex(*(256,) * size)]
            matrix = np.frombuffer(b"".join(raws), dtype=np.uint8).reshape(len(raws), size)
            ours = well_formed_prefixes(matrix, max_length)
            assert ours.tolist() == [completable(raw, max_length) for raw in raws]


# ---------------------------------------------------------------------------------------
# Exact privacy
# ---------------------------------------------------------------------------------------


def exp_decimal(epsilon: float) -> Decimal:
    with localcontext(Context(prec=60)):
        return Decimal(epsilon).exp()


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 1.8])
def test_every_report_is_exactly_epsilon_ldp_and_tight(epsilon: float) -> None:
    """max_length 1: the empty string and the 128 one-byte values, every (seed, bucket)."""
    mech = build(epsilon, 1)
    matrix = mech.transition_matrix()
    assert matrix.shape == (129, mech.seeds * mech.buckets)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12, atol=0)
    ratio = float((matrix.max(axis=0) / matrix.min(axis=0)).max())
    assert ratio <= math.exp(epsilon) * (1 + RATIO_RTOL)
    assert ratio >= math.exp(epsilon) * (1 - RATIO_RTOL)
    assert ratio > math.exp(epsilon - 1e-6) * (1 + RATIO_RTOL)  # fails just below epsilon
    # The realized p / o, exactly from the keep threshold T: (T (g - 1) + 2^53) / (2^53 - T).
    keep, g = mech.keep_threshold, mech.buckets
    exact = Fraction(keep * (g - 1) + BITS53, BITS53 - keep)
    assert ratio_within_epsilon(exact, epsilon)
    assert Decimal(exact.numerator) / Decimal(exact.denominator) > exp_decimal(epsilon) * (
        1 - Decimal(TIGHT)
    )
    # The likely bucket of every (value, seed) is the documented hash.
    blocks = matrix.reshape(129, mech.seeds, g)
    values = [b"\xff"] + [bytes([b]) for b in range(128)]
    hashed = seed_buckets(mech, values)
    np.testing.assert_array_equal(blocks.argmax(axis=2), hashed)


def test_each_groups_report_is_epsilon_ldp_and_the_group_ignores_the_value() -> None:
    epsilon = 1.0
    mech = build(epsilon, 2)
    values = ["", *map(chr, range(128))]
    values += ["ab", "ac", "a\x00", "\x00\x00", "é", "ñ", "\u07ff", "zz", "z", "ba"]
    matrix = mech.report_probabilities(values)
    blocks = matrix.reshape(len(values), mech.groups, mech.seeds * mech.buckets)
    np.testing.assert_allclose(blocks.sum(axis=2), 1 / mech.groups, rtol=1e-12, atol=0)
    bound = math.exp(epsilon)
    for group in range(mech.groups):
        block = blocks[:, group]
        ratio = float((block.max(axis=0) / block.min(axis=0)).max())
        assert bound * (1 - RATIO_RTOL) <= ratio <= bound * (1 + RATIO_RTOL)
    # Group 0 sees the first byte only: values sharing it report alike there.
    first = {text: i for i, text in enumerate(values)}
    np.testing.assert_array_equal(blocks[first["ab"], 0], blocks[first["a"], 0])
    np.testing.assert_array_equal(blocks[first["ac"], 0], blocks[first["a\x00"], 0])
    assert not np.array_equal(blocks[first["ab"], 1], blocks[first["ac"], 1])


def test_transition_matrix_refuses_what_it_cannot_enumerate() -> None:
    with pytest.raises(ValueError, match="max_length 1"):
        build(1.0, 2).transition_matrix()
    with pytest.raises(ValueError, match="enumerates at most"):
        build(4.0, 1).report_probabilities(["a"])


# ---------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------


def test_encode_and_aggregate_draw_the_exact_law() -> None:
    """max_length 2, epsilon 1: 2 groups x 8192 seeds x 4 buckets, folded 64 seeds a cell;
    also P(y = H_s(own prefix)) = p per report, and the group independent of the value."""
    mech = build(1.0, 2)
    strings = ["a", "ab", "é", "", "zq", "\x00"]
    counts = np.array([60_000, 50_000, 40_000, 30_000, 15_000, 5_000])
    values = np.repeat(np.array(strings, dtype=object), counts)
    rng = np.random.default_rng(41)
    reports = mech.encode(list(rng.permutation(values)), rng=rng)
    observed = mech.aggregate(reports).counts
    assert_cells_fit(observed, cell_probabilities(mech, strings, counts), fold=64)

    reports = mech.encode(list(values), rng=rng)
    group, seed, y = reports.T
    own = np.array(
        [
            reference_bucket(padded(text, 2)[: j + 1], int(s), mech.buckets)
            for text, j, s in zip(values[::50], group[::50], seed[::50], strict=True)
        ]
    )
    hits = int(np.count_nonzero(y[::50] == own))
    assert stats.binomtest(hits, own.size, mech.p).pvalue > ALPHA
    codes = np.repeat(np.arange(len(strings)), counts)
    table = np.zeros((len(strings), mech.groups), dtype=np.int64)
    np.add.at(table, (codes, group), 1)
    assert stats.chi2_contingency(table).pvalue > ALPHA


def test_the_fast_path_draws_the_exact_law() -> None:
    """max_length 1, epsilon 0.5: 8192 seeds x 3 buckets, about 200 reports a cell; one
    string has more keepers than seeds (multinomial over seeds), the others fewer."""
    mech = build(0.5, 1)
    strings = ["a", "", *[chr(i) for i in range(128) if i != ord("a")]]
    counts = np.array([3_000_000, 300_000, *[12_000] * 127])
    rng = np.random.default_rng(43)
    simulated = mech.simulate_statistics(strings, counts, rng)
    assert simulated.n == counts.sum()
    law = cell_probabilities(mech, strings, counts)
    assert_cells_fit(simulated.counts, law, fold=1)


def test_a_devices_group_is_permanent() -> None:
    mech = build(2.0, 8)
    scope = memo_scope("app.words", 1)
    secrets = [hashlib.sha256(b"device %d" % i).digest() for i in range(3000)]
    first = mech.encode(["alpha"] * 3000, context=DeviceContext(memo=KeyedMemo(secrets, scope)))[
        :, 0
    ]
    again = mech.encode(["beta"] * 3000, context=DeviceContext(memo=KeyedMemo(secrets, scope)))[
        :, 0
    ]
    np.testing.assert_array_equal(first, again)
    assert stats.chisquare(np.bincount(first, minlength=mech.groups)).pvalue > ALPHA
    devices = np.arange(500)
    simulated = [
        mech.encode(
            ["x", "yy"] * 250,
            np.random.default_rng(i),
            context=DeviceContext(memo=SimulatedMemo(devices, 9)),
        )[:, 0]
        for i in range(2)
    ]
    np.testing.assert_array_equal(simulated[0], simulated[1])


# ---------------------------------------------------------------------------------------
# Estimator
# ---------------------------------------------------------------------------------------

#: Estimator population: one string held by 90% of users, the target by 5%, 500 others by
#: 10 users each; epsilon 2, max_length 2 (S = 8192, g = 8): the hash-collision term is
#: about half of the variance here.
EST_USERS = 100_000
EST_TRIALS = 150
COND_TRIALS = 100


def estimator_population(rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    pairs = rng.choice(len(letters) ** 2, size=502, replace=False)
    strings = [letters[pair // len(letters)] + letters[pair % len(letters)] for pair in pairs]
    return strings, np.array([90_000, 5_000, *[10] * 500])


def test_given_the_hash_the_mean_is_the_exact_conditional_expectation() -> None:
    """E[f_v | H] = f_v + sum_{u != v} f_u (c_uv - c) / (1 - c), c_uv the share of the S
    seeds on which u and v collide, computed here from the hash itself. The 5% string is
    the one whose collisions with the 90% string deviate most from c, so that the
    realized collisions visibly move the mean."""
    mech = build(2.0, 2)
    rng = np.random.default_rng(61)
    strings, counts = estimator_population(rng)
    hashed = seed_buckets(mech, [padded(text, 2) for text in strings])
    target = 1 + int(np.abs((hashed[1:] == hashed[0]).mean(axis=1) - mech.collision).argmax())
    strings[1], strings[target] = strings[target], strings[1]
    hashed[[1, target]] = hashed[[target, 1]]
    frequencies = counts / counts.sum()
    shares = (hashed == hashed[1]).mean(axis=1)  # c_uv, u = every string, v = strings[1]
    others = np.arange(len(strings)) != 1
    offset = float((frequencies[others] * (shares[others] - mech.collision)).sum())
    expected = frequencies[1] + offset / (1 - mech.collision)
    estimates = np.empty(COND_TRIALS)
    for trial in range(COND_TRIALS):
        statistics = mech.simulate_statistics(strings, counts, rng)
        estimates[trial] = mech.estimate(statistics, [strings[1]]).frequencies[0]
    spread = estimates.std(ddof=1) / math.sqrt(COND_TRIALS)
    assert abs(estimates.mean() - expected) <= z_two_sided(ALPHA) * spread
    assert abs(offset) > 10 * spread  # the realized collisions matter, and are accounted for


@pytest.mark.slow
def test_over_fresh_hashes_the_estimate_is_unbiased_with_the_documented_variance() -> None:
    """Fresh random strings in every trial are a fresh draw of the hash (random-function
    model): the estimate of the 5% string is unbiased, and its variance is the three terms
    of the module docstring at the true values, which the reported std matches; a string
    nobody holds has ``variance(n)`` plus the collision term."""
    mech = build(2.0, 2)
    rng = np.random.default_rng(67)
    n, n_group = EST_USERS, EST_USERS / 2
    estimates, variances, moments = [], [], []
    for _ in range(EST_TRIALS):
        strings, counts = estimator_population(rng)
        statistics = mech.simulate_statistics(strings, counts, rng)
        found = mech.estimate(statistics, [strings[1], "00"])  # digits: nobody's string
        estimates.append(found.frequencies)
        variances.append(found.std[0] ** 2)
        moments.append(mech.second_moment(statistics.counts.reshape(2, mech.seeds, -1)[1]))
    f = 0.05
    second = float(((counts / n) ** 2).sum())
    p, q, c = mech.p, mech.q, mech.collision
    oracle = (q * (1 - q) / (p - q) ** 2 + f * (1 - p - q) / (p - q)) / n_group
    sampling = f * (1 - f) * (n - n_group) / (n_group * (n - 1))
    collisions = c * (second - f**2) / ((1 - c) * mech.seeds)
    theory = oracle + sampling + collisions
    assert collisions > 0.4 * theory  # the term this test is about is far from negligible
    absent = mech.variance(n) + c * second / ((1 - c) * mech.seeds)

    sample, empty = np.array(estimates).T
    z = z_two_sided(ALPHA / 6)
    assert abs(sample.mean() - f) <= z * math.sqrt(theory / EST_TRIALS)
    assert abs(empty.mean()) <= z * math.sqrt(absent / EST_TRIALS)
    dof = EST_TRIALS - 1
    low, high = stats.chi2.ppf([ALPHA / 12, 1 - ALPHA / 12], dof) / dof
    assert low <= sample.var(ddof=1) / theory <= high
    assert low <= sample.var(ddof=1) / float(np.mean(variances)) <= high
    assert low <= empty.var(ddof=1) / absent <= high
    # F2, estimated from same-seed pairs of reports, is unbiased for the group's F2.
    spread = np.std(moments, ddof=1) / math.sqrt(EST_TRIALS)
    assert abs(np.mean(moments) - second) <= z * spread + 2 / n_group


# ---------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_discovery_finds_the_zipf_top_10_at_epsilon_4() -> None:
    """10^6 users, 10^4 distinct words of 1..6 letters, Zipf(1.1) by rank."""
    mech = build(4.0, 6)
    rng = np.random.default_rng(2026)
    words = distinct_words(rng, 10_000, "abcdefghijklmnopqrstuvwxyz", range(1, 7))
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    counts = rng.multinomial(1_000_000, ranks**-1.1 / (ranks**-1.1).sum())
    truth = {words[i] for i in np.argsort(-counts, kind="stable")[:10]}
    found = mech.heavy_hitters(mech.simulate_statistics(words, counts, rng), 10)
    assert isinstance(found, HeavyHitters)
    assert len(found.strings) == 10 and found.n == counts.sum()
    assert len(truth & set(found.strings)) >= 9
    assert np.all(np.diff(found.frequencies) <= 0)
    own = np.array([counts[words.index(text)] for text in found.strings]) / counts.sum()
    assert np.all(np.abs(found.frequencies - own) <= z_two_sided(ALPHA / 10) * found.std)


@pytest.mark.slow
def test_a_query_for_the_most_strings_is_screened_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """k = 100 over 10^4 words of 1..6 letters: levels of up to 2k * 180 candidates. Each
    candidate costs S / SCREEN_SHARE hash evaluations, and at most MAX_LEVEL_CANDIDATES a
    level the other seeds too; without the screen every candidate cost all S seeds.

    The true top 10 hold f >= 0.011, 17 stds of their last-group estimate (n / 6 reports)
    and 8 of a screening estimate (about twice that std) above the screen's cut (about 1.2
    screening stds when most candidates are absent): each of their prefixes survives each
    of the 6 levels but with probability below Phi(-6) = 1e-9 (false failure < 1e-7)."""
    mech = build(4.0, 6)
    rng = np.random.default_rng(2027)
    words = distinct_words(rng, 10_000, "abcdefghijklmnopqrstuvwxyz", range(1, 7))
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    counts = rng.multinomial(1_000_000, ranks**-1.1 / (ranks**-1.1).sum())
    statistics = mech.simulate_statistics(words, counts, rng)
    hashed = candidates = 0
    counted_hashes, counted_prints = pem.splitmix64, pem.fingerprints

    def counting_hashes(words: np.ndarray) -> np.ndarray:
        nonlocal hashed
        hashed += words.size
        return counted_hashes(words)

    def counting_prints(prefixes: np.ndarray) -> np.ndarray:
        nonlocal candidates
        candidates += prefixes.shape[0]
        return counted_prints(prefixes)

    monkeypatch.setattr(pem, "splitmix64", counting_hashes)
    monkeypatch.setattr(pem, "fingerprints", counting_prints)
    found = mech.heavy_hitters(statistics, MAX_HEAVY_HITTERS)
    screen = mech.seeds // SCREEN_SHARE
    assert candidates > mech.groups * MAX_LEVEL_CANDIDATES  # the screen was needed
    assert hashed <= candidates * screen + mech.groups * MAX_LEVEL_CANDIDATES * (
        mech.seeds - screen
    )
    assert hashed < candidates * mech.seeds / 2
    truth = {words[i] for i in np.argsort(-counts, kind="stable")[:10]}
    assert len(found.strings) == MAX_HEAVY_HITTERS and truth <= set(found.strings)
    assert np.all(np.diff(found.frequencies) <= 0)


def test_discovery_decodes_multibyte_and_empty_strings() -> None:
    mech = build(6.0, 6)
    rng = np.random.default_rng(7)
    strings = ["日本", "é", "🙂", "", "naïve", "\x00", "abcd"]
    counts = np.array([50_000, 45_000, 40_000, 35_000, 30_000, 25_000, 20_000])
    background = distinct_words(rng, 2000, "abcdefghijklmnopqrstuvwxyz", range(1, 5))
    background = [text for text in background if text not in strings]
    population = strings + background
    weights = np.concatenate([counts, np.full(len(background), 5)])
    values = np.repeat(np.array(population, dtype=object), weights)
    statistics = mech.aggregate(mech.encode(list(values), rng=rng))
    found = mech.heavy_hitters(statistics, len(strings))
    assert set(found.strings) == set(strings)
    assert found.strings[0] == "日本"


# ---------------------------------------------------------------------------------------
# Wire form, statistics and refusals
# ---------------------------------------------------------------------------------------


def test_payloads_round_trip_and_statistics_merge_and_serialize() -> None:
    mech = build(3.0, 5)
    rng = np.random.default_rng(13)
    reports = mech.encode(["hello", "", "wörd", "hello"] * 25, rng=rng)
    payloads = mech.to_payloads(reports)
    assert set(payloads[0]) == mech.payload_fields == {"group", "seed", "value"}
    assert all(type(value) is int for payload in payloads for value in payload.values())
    np.testing.assert_array_equal(mech.from_payloads(payloads), reports)

    parts = [mech.aggregate(part) for part in np.array_split(reports, 3)]
    whole = mech.aggregate(reports)
    assert parts[0].merge(parts[1]).merge(parts[2]) == whole
    assert parts[0].merge(parts[1].merge(parts[2])) == parts[2].merge(parts[0]).merge(parts[1])
    dense = CountStatistics(whole.n, whole.counts)
    assert dense == whole and dense.to_bytes() == whole.to_bytes()
    assert mech.statistics_from_bytes(whole.to_bytes()) == whole
    assert mech.empty_statistics().merge(whole) == whole
    with pytest.raises(ValueError, match="counts"):
        mech.statistics_from_bytes(build(3.0, 4).empty_statistics().to_bytes())


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"group": 0, "seed": 0}, "integer 'value'"),
        ({"group": 0, "seed": True, "value": 1}, "integer 'seed'"),
        ({"group": "0", "seed": 0, "value": 1}, "integer 'group'"),
        ({"group": 5, "seed": 0, "value": 1}, "group = 5 is outside 0..4"),
        ({"group": 0, "seed": -1, "value": 1}, "seed = -1 is outside"),
        ({"group": 0, "seed": 0, "value": 10**6}, "value = 1000000 is outside"),
        ({"group": 0, "seed": 0, "value": 2**70}, "out of range"),
    ],
)
def test_bad_payloads_are_refused(payload: dict[str, Any], message: str) -> None:
    mech = build(3.0, 5)
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([{"group": 1, "seed": 2, "value": 3}, payload])


def test_bad_reports_values_and_queries_are_refused() -> None:
    mech = build(3.0, 3)
    with pytest.raises(ValueError, match="integer rows"):
        mech.aggregate(np.zeros((4, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="integer rows"):
        mech.aggregate(np.zeros((4, 3)))
    with pytest.raises(ValueError, match="position 2 has 4 UTF-8 bytes"):
        mech.encode(["ab", "c", "dddd"])
    with pytest.raises(ValueError, match="position 1 has 4 UTF-8 bytes"):
        mech.encode(["ab", "€x", "ab"])  # the euro sign is three bytes
    with pytest.raises(ValueError, match="position 1 must be a string"):
        mech.encode(["ab", 7])  # type: ignore[list-item]
    statistics = mech.aggregate(mech.encode(["abc"] * 300, rng=np.random.default_rng(1)))
    with pytest.raises(ValueError, match="max_length of 3"):
        mech.estimate(statistics, ["abcd"])
    for k in (0, -1, True, 2.0, MAX_HEAVY_HITTERS + 1):
        with pytest.raises(ValueError, match="k must be an integer"):
            mech.heavy_hitters(statistics, k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zero reports"):
        mech.estimate(mech.empty_statistics(), ["a"])
    one_group = mech.aggregate(np.array([[0, 1, 2]]))
    with pytest.raises(ValueError, match="group 1 has no reports"):
        mech.heavy_hitters(one_group, 3)
    with pytest.raises(ValueError, match="group 2 has no reports"):
        mech.estimate(one_group, ["a"])
    with pytest.raises(ValueError, match="CountStatistics of"):
        mech.estimate(CountStatistics(5, np.ones(7, dtype=np.int64)), ["a"])
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        mech.simulate_statistics(["a"], np.array([3]), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 integers"):
        mech.simulate_statistics(["a", "b"], np.array([3]), np.random.default_rng(0))
