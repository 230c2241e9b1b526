"""dBitFlip (``shared/mechanisms/dbitflip.py``): exact privacy, samplers, memoization,
the estimator and the wire form.

* Privacy by enumeration over every (sample, bits) output: one report's likelihood ratio
  is at most e^epsilon_report (= e^epsilon) and reaches it, in floating point and in exact
  rational arithmetic from the 53-bit thresholds; the permanent response's is the same.
* Samplers: chi-square of encoded outputs against ``transition_matrix`` (fresh, simulated
  and keyed memos), of ``permanent`` against ``permanent_matrix``; the memo draws follow
  the documented word-to-draw rules exactly.
* Memoization: one device's response is stable across calls, objects and batches; other
  secrets and other metric versions give independent ones; a memoized device's reports
  do not average to its value, a stateless device's do.
* Estimator: unbiased, with the derived variance, through the simulation fast path and
  through encode + aggregate with devices memoized across periods.

Tolerances. Every statistical assertion has a false-failure rate of at most ALPHA = 1e-6
(Bonferroni within a test where it makes several), about 60 of them: the file fails
falsely with probability below 1e-4, and with fixed seeds it is deterministic. Normal
approximations are for sums of thousands of independent bounded terms. A sample variance
s^2 of R values is compared with chi2_nu / nu, nu = 2 / (2 / (R - 1) + kappa / R) matched
to Var[s^2] with kappa the exact excess kurtosis of one value.
"""

from __future__ import annotations

import base64
import itertools
import math
import struct
import zlib
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import DeviceContext
from shared.mechanisms.dbitflip import (
    BITS_PURPOSE,
    BUCKETS_PURPOSE,
    DBitFlip,
    _shuffle_dense,
    _shuffle_moves,
    shuffle_prefix,
)
from shared.mechanisms.unary import SymmetricUnaryEncoding
from shared.memo import KeyedMemo, Memo, SimulatedMemo, memo_scope
from shared.randomness import BITS53, ratio_within_epsilon
from shared.schemas import MAX_EPSILON, MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
#: Least expected count of a chi-square cell (rarer cells are pooled).
MIN_EXPECTED = 100.0
#: Relative slack of the floating-point ratio bound (entries are products of <= 2^s
#: correctly rounded factors: ~1e-15), and of its tightness.
RATIO_RTOL = 1e-12
TIGHT_RTOL = 1e-9
SCOPE = memo_scope("daily.home-page", 3)


def mechanism(epsilon: float, d: int, s: int) -> DBitFlip:
    return DBitFlip(
        MechanismSpec(mechanism="dbitflip", epsilon=epsilon, domain_size=d, bits_per_device=s)
    )


def rng_for(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def secrets(count: int, label: str) -> list[bytes]:
    """``count`` distinct 32-byte device secrets (seeded: a test, not a device)."""
    return [bytes(row) for row in rng_for(label).integers(0, 256, (count, 32), dtype=np.uint8)]


def columns(mech: DBitFlip, reports: np.ndarray) -> np.ndarray:
    """Each report's column of ``transition_matrix`` (its documented order)."""
    d, s = mech.domain_size, mech.bits_per_device
    index = {combo: c for c, combo in enumerate(itertools.combinations(range(d), s))}
    samples = np.array([index[tuple(row)] for row in reports["buckets"].tolist()])
    return samples * 2**s + reports["bits"].astype(np.int64) @ (1 << np.arange(s))


def max_ratio(matrix: np.ndarray) -> float:
    assert np.all(matrix > 0)
    return float((matrix.max(axis=0) / matrix.min(axis=0)).max())


def assert_fits(observed: np.ndarray, probabilities: np.ndarray, alpha: float = ALPHA) -> None:
    """Pearson chi-square at ``alpha``, the rarest cells pooled to >= MIN_EXPECTED each."""
    assert probabilities.sum() == pytest.approx(1.0, rel=1e-12)
    total = int(observed.sum())
    expected = total * probabilities
    order = np.argsort(expected)
    rare = int(np.count_nonzero(expected < MIN_EXPECTED))
    enough = int(np.searchsorted(np.cumsum(expected[order]), MIN_EXPECTED)) + 1
    pooled = order[: max(rare, enough)] if rare else order[:0]
    if pooled.size > 1:
        keep = np.setdiff1d(np.arange(expected.size), pooled)
        observed = np.append(observed[keep], observed[pooled].sum())
        expected = np.append(expected[keep], expected[pooled].sum())
    assert expected.min() >= MIN_EXPECTED, "cells too small for the chi-square approximation"
    result = stats.chisquare(observed, expected)
    assert result.pvalue > alpha, f"chi-square p = {result.pvalue:.3g}"


def variance_interval(runs: int, kurtosis: float, alpha: float) -> tuple[float, float]:
    """Acceptance interval of s^2 / sigma^2 for ``runs`` values of excess kurtosis kappa."""
    nu = 2.0 / (2.0 / (runs - 1) + kurtosis / runs)
    return float(stats.chi2.ppf(alpha / 2, nu) / nu), float(stats.chi2.isf(alpha / 2, nu) / nu)


def term_cumulants(mech: DBitFlip, own: bool) -> tuple[float, float, float]:
    """Mean, variance and fourth cumulant of one device's term (d / s) [j sampled]
    (b_j - q) / (p - q) of f_j, for a device of value j (``own``) or another value."""
    p, q, r = mech.bit_p, mech.bit_q, mech.sampling_rate
    one = p if own else q
    points = np.array([(1 - q) / (r * (p - q)), -q / (r * (p - q)), 0.0])
    weights = np.array([r * one, r * (1 - one), 1 - r])
    mean = float(weights @ points)
    central = points - mean
    second = float(weights @ central**2)
    return mean, second, float(weights @ central**4) - 3 * second**2


def estimator_kurtosis(mech: DBitFlip, user_counts: np.ndarray) -> np.ndarray:
    """Exact excess kurtosis of each f_j: fourth cumulants of independent terms add."""
    n = int(user_counts.sum())
    own, other = term_cumulants(mech, True), term_cumulants(mech, False)
    second = user_counts * own[1] + (n - user_counts) * other[1]
    fourth = user_counts * own[2] + (n - user_counts) * other[2]
    return fourth / second**2


def check_estimates(
    mech: DBitFlip, frequencies: np.ndarray, user_counts: np.ndarray, tests: int
) -> None:
    """R estimates (rows) against the truth: unbiased, variance ``frequency_variance``."""
    runs, d = frequencies.shape
    n = int(user_counts.sum())
    truth = user_counts / n
    variance = mech.frequency_variance(truth, n)
    np.testing.assert_allclose(
        mech.frequency_variance(0.0, n) + truth * (d / mech.bits_per_device - 1) / n,
        variance,
        rtol=1e-12,
    )  # p + q = 1: the paper's symmetric form
    z = float(stats.norm.isf(ALPHA / (2 * tests)))
    error = frequencies.mean(axis=0) - truth
    assert np.all(np.abs(error) <= z * np.sqrt(variance / runs)), error / np.sqrt(variance / runs)
    ratio = frequencies.var(axis=0, ddof=1) / variance
    for j in range(d):
        low, high = variance_interval(
            runs, float(estimator_kurtosis(mech, user_counts)[j]), ALPHA / tests
        )
        assert low <= ratio[j] <= high, (j, ratio[j], low, high)


# ======================================================================================
# Exact privacy, by enumeration
# ======================================================================================

#: (epsilon, d, s): s = 1 (one bit carries eps), s >= 2 (two bits of eps / 2), s = d
#: (SUE), small and large epsilon. eps <= 8 keeps q >= 3e-4, so one threshold step moves
#: the ratio by < 1e-12 and the certified thresholds reach e^eps to within TIGHT_RTOL.
PRIVACY_CASES = [
    (0.05, 3, 1),
    (0.5, 2, 1),
    (1.0, 5, 1),
    (1.0, 4, 2),
    (2.3, 5, 2),
    (5.0, 6, 3),
    (0.5, 4, 4),
    (8.0, 6, 1),
    (8.0, 5, 2),
]


@pytest.mark.parametrize(("epsilon", "d", "s"), PRIVACY_CASES)
def test_one_report_and_the_permanent_response_are_exactly_epsilon(
    epsilon: float, d: int, s: int
) -> None:
    mech = mechanism(epsilon, d, s)
    assert mech.epsilon_report == mech.epsilon_lifetime == epsilon
    one_report = mech.transition_matrix()
    permanent = mech.permanent_matrix()
    assert one_report.shape == (d, math.comb(d, s) * 2**s)
    np.testing.assert_allclose(one_report.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(permanent, one_report)
    for matrix, bound in ((one_report, mech.epsilon_report), (permanent, mech.epsilon)):
        ratio = max_ratio(matrix)
        assert ratio <= math.exp(bound) * (1 + RATIO_RTOL)
        assert ratio >= math.exp(bound) * (1 - TIGHT_RTOL)


@pytest.mark.parametrize(("epsilon", "d", "s"), PRIVACY_CASES)
def test_realized_ratio_is_certified_in_exact_arithmetic(epsilon: float, d: int, s: int) -> None:
    """P(S, b | v) from the integer thresholds as fractions, every pair of inputs: the
    largest ratio is proven <= e^eps (60-digit bound) and is within TIGHT_RTOL of it."""
    mech = mechanism(epsilon, d, s)
    p_threshold, q_threshold = mech.thresholds
    assert p_threshold + q_threshold == BITS53
    p, q = Fraction(p_threshold, BITS53), Fraction(q_threshold, BITS53)
    worst = Fraction(0)
    for sample in itertools.combinations(range(d), s):
        for bits in itertools.product((0, 1), repeat=s):
            law = [
                Fraction(
                    math.prod(
                        (p if v == j else q) if b else (1 - p if v == j else 1 - q)
                        for j, b in zip(sample, bits, strict=True)
                    )
                )
                for v in range(d)
            ]
            worst = max(worst, max(law) / min(law))
    assert ratio_within_epsilon(worst, epsilon)
    assert float(worst) >= math.exp(epsilon) * (1 - TIGHT_RTOL)


@pytest.mark.parametrize(("epsilon", "d", "s"), PRIVACY_CASES)
def test_bit_probabilities_are_the_papers(epsilon: float, d: int, s: int) -> None:
    """p = e^a / (e^a + 1), a = eps / 2 when two sampled bits can change (s >= 2, the
    paper's), a = eps when only one can (s = 1); p + q = 1 exactly."""
    mech = mechanism(epsilon, d, s)
    a = epsilon / min(2, s)
    assert mech.bit_p == pytest.approx(math.exp(a) / (math.exp(a) + 1), rel=1e-13)
    assert mech.bit_p + mech.bit_q == 1.0
    assert mech.p == pytest.approx(s / d * mech.bit_p, rel=1e-15)
    assert mech.q == pytest.approx(s / d * mech.bit_q, rel=1e-15)


@pytest.mark.parametrize("epsilon", [0.001, 0.5, 8.0, 19.9, MAX_EPSILON])
@pytest.mark.parametrize("s", [1, 2, 5])
def test_thresholds_are_certified_and_tight_up_to_the_largest_epsilon(
    epsilon: float, s: int
) -> None:
    """The worst ratio from the thresholds alone, (T_p / T_q)^min(2, s) (p + q = 1), is
    proven <= e^eps, and moving T_q 8 units the unsafe way (down) breaks the bound: the
    realized epsilon is within a few threshold steps of the declared one."""
    mech = mechanism(epsilon, 16, s)
    p_threshold, q_threshold = mech.thresholds
    assert p_threshold + q_threshold == BITS53
    changed = min(2, s)
    assert ratio_within_epsilon(Fraction(p_threshold, q_threshold) ** changed, epsilon)
    unsafe = q_threshold - 8
    assert not ratio_within_epsilon(Fraction(BITS53 - unsafe, unsafe) ** changed, epsilon)


def test_enumeration_refuses_large_output_spaces() -> None:
    with pytest.raises(ValueError, match="output space"):
        mechanism(1.0, 64, 3).transition_matrix()


# ======================================================================================
# Samplers
# ======================================================================================

#: (epsilon, d, s, value): s^2 <= d takes the moves-only shuffle, s^2 > d the dense one.
SAMPLER_CASES = [(1.0, 4, 1, 2), (1.0, 5, 2, 4), (2.3, 5, 3, 0), (0.5, 3, 3, 1)]
SAMPLES = 60_000


@pytest.mark.parametrize(("epsilon", "d", "s", "value"), SAMPLER_CASES)
def test_encode_fresh_matches_the_matrix(epsilon: float, d: int, s: int, value: int) -> None:
    mech = mechanism(epsilon, d, s)
    reports = mech.encode(np.full(SAMPLES, value), rng_for(f"fresh-{d}-{s}"))
    observed = np.bincount(columns(mech, reports), minlength=math.comb(d, s) * 2**s)
    assert_fits(observed, mech.transition_matrix()[value])


def test_encode_with_the_os_csprng_matches_the_matrix() -> None:
    mech = mechanism(1.0, 5, 2)
    reports = mech.encode(np.full(20_000, 3))  # rng=None: os.urandom, not reproducible
    assert_fits(np.bincount(columns(mech, reports), minlength=40), mech.transition_matrix()[3])


@pytest.mark.parametrize(("epsilon", "d", "s", "value"), SAMPLER_CASES)
def test_memoized_encode_and_permanent_match_their_matrices(
    epsilon: float, d: int, s: int, value: int
) -> None:
    """One report each of SAMPLES distinct simulated devices; ``permanent`` is the same
    response (no instantaneous randomness) and follows ``permanent_matrix``."""
    mech = mechanism(epsilon, d, s)
    values = np.full(SAMPLES, value)
    memo = SimulatedMemo(np.arange(SAMPLES), seed=zlib.crc32(f"sim-{d}-{s}".encode()))
    reports = mech.encode(values, rng_for("unused"), context=DeviceContext(memo=memo))
    np.testing.assert_array_equal(mech.permanent(values, memo), reports)
    cells = math.comb(d, s) * 2**s
    assert_fits(
        np.bincount(columns(mech, reports), minlength=cells), mech.transition_matrix()[value]
    )
    permanent = mech.permanent(values, SimulatedMemo(np.arange(SAMPLES) + SAMPLES, seed=5))
    assert_fits(
        np.bincount(columns(mech, permanent), minlength=cells), mech.permanent_matrix()[value]
    )


def test_keyed_memo_over_many_devices_matches_the_matrix() -> None:
    mech = mechanism(1.0, 4, 2)
    devices = 3000
    memo = KeyedMemo(secrets(devices, "keyed-fit"), SCOPE)
    reports = mech.permanent(np.full(devices, 1), memo)
    assert_fits(np.bincount(columns(mech, reports), minlength=24), mech.permanent_matrix()[1])


def reference_shuffle(offsets: list[int], d: int) -> list[int]:
    """The documented partial Fisher-Yates shuffle, step by step."""
    order = list(range(d))
    for i, r in enumerate(offsets):
        order[i], order[i + r] = order[i + r], order[i]
    return order[: len(offsets)]


@pytest.mark.parametrize(("d", "s"), [(2, 1), (9, 3), (20, 4), (20, 5), (20, 7), (6, 6)])
def test_both_shuffles_are_the_documented_one(d: int, s: int) -> None:
    rng = rng_for(f"shuffle-{d}-{s}")
    offsets = np.stack([rng.integers(0, d - i, 500) for i in range(s)], axis=1)
    expected = np.array([reference_shuffle(row, d) for row in offsets.tolist()])
    np.testing.assert_array_equal(_shuffle_moves(offsets), expected)
    np.testing.assert_array_equal(_shuffle_dense(offsets, d), expected)
    np.testing.assert_array_equal(shuffle_prefix(offsets, d), expected)


@pytest.mark.parametrize(("d", "s"), [(5, 2), (37, 3), (6, 6)])
def test_memo_draws_follow_the_documented_words(d: int, s: int) -> None:
    """Rebuild one keyed device's response from its raw words by the module docstring's
    rules (rejection below the next power of two, Fisher-Yates, 53-bit comparisons)."""
    mech = mechanism(1.0, d, s)
    secret = secrets(1, f"words-{d}-{s}")[0]
    p_threshold, q_threshold = mech.thresholds
    for value in range(d):
        memo = KeyedMemo(secret, SCOPE)
        words = memo.draws(BUCKETS_PURPOSE)
        offsets = []
        for i in range(s):
            high = d - i
            mask = (1 << (high - 1).bit_length()) - 1
            draw = int(words.words(1)[0, 0]) & mask
            while draw >= high:
                draw = int(words.words(1)[0, 0]) & mask
            offsets.append(draw)
        sample = sorted(reference_shuffle(offsets, d))
        bits = []
        for j in sample:
            word = int(memo.draws(BITS_PURPOSE, [2 * j + (j == value)]).words(1)[0, 0])
            bits.append((word >> 11) < (p_threshold if j == value else q_threshold))
        report = mech.permanent(np.array([value]), KeyedMemo(secret, SCOPE))
        assert report["buckets"][0].tolist() == sample
        assert report["bits"][0].tolist() == bits


# ======================================================================================
# Memoization
# ======================================================================================


def test_one_device_keeps_its_response_across_calls_restarts_and_batches() -> None:
    mech = mechanism(1.5, 7, 3)
    secret = secrets(1, "stable")[0]
    values = np.arange(7)
    device = KeyedMemo(secret, SCOPE, size=7)  # one device, a batch of its values
    first = mech.permanent(values, device)
    np.testing.assert_array_equal(mech.permanent(values, device), first)
    restarted = KeyedMemo(secret, SCOPE, size=7)  # a new object: the process restarted
    np.testing.assert_array_equal(
        mech.encode(values, None, context=DeviceContext(memo=restarted)), first
    )
    for v in range(7):  # one value at a time, as a device reports
        single = mech.encode(np.array([v]), context=DeviceContext(memo=KeyedMemo(secret, SCOPE)))
        np.testing.assert_array_equal(single[0], first[v])
    # Every value's response uses the device's one sample.
    assert len({tuple(row) for row in first["buckets"].tolist()}) == 1


def test_simulated_devices_keep_their_responses_wherever_they_sit_in_a_batch() -> None:
    mech = mechanism(1.0, 10, 2)
    devices = np.arange(5000)
    values = devices % 10
    first = mech.encode(
        values, rng_for("a"), context=DeviceContext(memo=SimulatedMemo(devices, seed=17))
    )
    order = rng_for("order").permutation(devices.size)
    again = mech.encode(
        values[order],
        rng_for("b"),
        context=DeviceContext(memo=SimulatedMemo(devices[order], seed=17)),
    )
    np.testing.assert_array_equal(again, first[order])


@pytest.mark.parametrize("change", ["secret", "scope"])
def test_another_secret_or_metric_version_draws_an_independent_response(change: str) -> None:
    """Joint law of (response A, response B) for one value over many devices: the product
    of the two matrix rows (chi-square over the 16 joint outputs)."""
    mech = mechanism(0.5, 2, 1)
    devices = 4000
    first = secrets(devices, "independent-a")
    other = secrets(devices, "independent-b") if change == "secret" else first
    other_scope = SCOPE if change == "secret" else memo_scope("daily.home-page", 4)
    values = np.zeros(devices, dtype=np.int64)
    a = columns(mech, mech.permanent(values, KeyedMemo(first, SCOPE)))
    b = columns(mech, mech.permanent(values, KeyedMemo(other, other_scope)))
    row = mech.permanent_matrix()[0]
    assert_fits(np.bincount(a * 4 + b, minlength=16), np.outer(row, row).ravel())


def test_memoized_reports_do_not_average_to_the_value_stateless_ones_do() -> None:
    """A device's debiased term for its own bucket, X = (d / s) [v sampled] (b_v - q) /
    (p - q), has mean 1 and variance sigma^2 = ``frequency_variance(1, 1)``. Averaged over
    T periods: memoized, all T reports are one report, so the per-device averages keep
    variance sigma^2; stateless (memo=None), they are means of T independent X, variance
    sigma^2 / T: they converge to the value."""
    mech = mechanism(1.0, 8, 1)
    d, devices, periods = 8, 2000, 100
    values = np.arange(devices) % d
    memo = SimulatedMemo(np.arange(devices), seed=99)
    rng = rng_for("periods")
    p, q, scale = mech.bit_p, mech.bit_q, d / mech.bits_per_device

    def own_term(reports: np.ndarray) -> np.ndarray:
        hit = reports["buckets"][:, 0] == values
        return scale * hit * (reports["bits"][:, 0] - q) / (p - q)

    first = mech.encode(values, rng, context=DeviceContext(memo=memo))
    memoized = np.zeros(devices)
    stateless = np.zeros(devices)
    for _ in range(periods):
        reports = mech.encode(values, rng, context=DeviceContext(memo=memo))
        np.testing.assert_array_equal(reports, first)  # the same report every period
        memoized += own_term(reports) / periods
        stateless += own_term(mech.encode(values, rng)) / periods
    sigma2 = float(mech.frequency_variance(1.0, 1))
    _, second, fourth = term_cumulants(mech, True)
    assert second == pytest.approx(sigma2, rel=1e-12)
    kurtosis = fourth / second**2
    for averages, variance, kappa in (
        (memoized, sigma2, kurtosis),
        (stateless, sigma2 / periods, kurtosis / periods),
    ):
        low, high = variance_interval(devices, kappa, ALPHA / 2)
        spread = float(np.mean((averages - 1.0) ** 2))  # around the known mean 1
        assert low <= spread / variance <= high, (spread, variance)


# ======================================================================================
# Estimator
# ======================================================================================

ESTIMATOR_CASES = [
    (1.0, 6, 2, np.array([900, 500, 300, 200, 100, 0])),
    (0.5, 4, 1, np.array([1000, 600, 400, 0])),
    (3.0, 5, 5, np.array([700, 700, 300, 200, 100])),
]


@pytest.mark.parametrize(
    ("epsilon", "d", "s", "user_counts"), ESTIMATOR_CASES, ids=["d6-s2", "d4-s1", "d5-s5"]
)
def test_fast_path_estimates_are_unbiased_with_the_derived_variance(
    epsilon: float, d: int, s: int, user_counts: np.ndarray
) -> None:
    mech = mechanism(epsilon, d, s)
    rng = rng_for(f"fast-{d}-{s}")
    estimates = [mech.estimate(mech.simulate_statistics(user_counts, rng)) for _ in range(4000)]
    assert all(e.n == user_counts.sum() for e in estimates)
    check_estimates(mech, np.array([e.frequencies for e in estimates]), user_counts, 2 * d)


@pytest.mark.slow
def test_memoized_devices_estimate_each_period_unbiasedly() -> None:
    """R independent populations (one simulated memo, device ids r n + i) report over
    three periods; between periods a fixed part of the devices changes value, the others
    send exactly their previous report. Each period's R estimates are unbiased for that
    period's frequencies with the derived variance: devices are independent."""
    mech = mechanism(1.0, 6, 2)
    n, runs = 600, 800
    values = np.repeat(np.arange(6), [240, 150, 90, 60, 60, 0])
    memo = SimulatedMemo(np.arange(n * runs), seed=2024)
    rng = rng_for("periods-estimate")
    previous = None
    for period in range(3):
        if period:  # every fifth device moves to the next bucket
            values = np.where(np.arange(n) % 5 == period, (values + 1) % 6, values)
        reports = mech.encode(np.tile(values, runs), rng, context=DeviceContext(memo=memo))
        if previous is not None:
            kept = np.tile(values == previous[0], runs)
            np.testing.assert_array_equal(reports[kept], previous[1][kept])
        previous = (values.copy(), reports)
        estimates = [
            mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])) for r in range(runs)
        ]
        frequencies = np.array([e.frequencies for e in estimates])
        check_estimates(mech, frequencies, np.bincount(values, minlength=6), 3 * 2 * 6)


def test_std_is_the_variance_formula_at_the_clipped_estimate() -> None:
    mech = mechanism(2.0, 8, 3)
    values = rng_for("std").integers(0, 8, 5000)
    estimate = mech.estimate(mech.aggregate(mech.encode(values, rng_for("std-encode"))))
    expected = mech.frequency_variance(np.clip(estimate.frequencies, 0, 1), 5000)
    np.testing.assert_array_equal(estimate.std, np.sqrt(expected))
    low, high = estimate.ci(0.95)
    np.testing.assert_allclose(high - low, 2 * 1.959963984540054 * estimate.std, rtol=1e-12)


@pytest.mark.parametrize(("epsilon", "d", "s"), [(0.5, 10, 1), (1.0, 10, 2), (4.0, 64, 7)])
def test_planning_variance_is_the_papers(epsilon: float, d: int, s: int) -> None:
    """variance(n) = (d / (n s)) e^a / (e^a - 1)^2, a = eps / min(2, s)."""
    mech = mechanism(epsilon, d, s)
    a = epsilon / min(2, s)
    nominal = d / (1000 * s) * math.exp(a) / math.expm1(a) ** 2
    assert mech.variance(1000) == pytest.approx(nominal, rel=1e-12)


def test_with_every_bucket_sampled_it_is_sue() -> None:
    """s = d: every device reports every bucket's bit at eps / 2, the SUE variance."""
    spec = MechanismSpec(mechanism="sue", epsilon=1.3, domain_size=9)
    assert mechanism(1.3, 9, 9).variance(777) == pytest.approx(
        SymmetricUnaryEncoding(spec).variance(777), rel=1e-12
    )


def test_estimator_matches_multi_freq_ldpy() -> None:
    """multi-freq-ldpy 0.2.5's dBitFlipPM estimator on the same reports (its -1 marks a
    bit not sampled; it clips at 0 and normalizes): equal to ours clipped and normalized."""
    peer = pytest.importorskip("multi_freq_ldpy.long_freq_est.dBitFlipPM")
    d, s, epsilon = 6, 2, 1.0
    mech = mechanism(epsilon, d, s)
    values = rng_for("peer").integers(0, d, 400)
    reports = mech.encode(values, rng_for("peer-encode"))
    theirs = np.full((values.size, d), -1.0)
    rows = np.arange(values.size)[:, None]
    theirs[rows, reports["buckets"].astype(np.int64)] = reports["bits"]
    expected = peer.dBitFlipPM_Aggregator_MI(list(theirs), d, s, epsilon)
    ours = np.clip(mech.estimate(mech.aggregate(reports)).frequencies, 0, None)
    np.testing.assert_allclose(ours / ours.sum(), expected, rtol=1e-9, atol=1e-12)


def test_fast_path_needs_a_generator_and_true_counts() -> None:
    mech = mechanism(1.0, 4, 2)
    with pytest.raises(TypeError, match="Generator"):
        mech.simulate_statistics(np.array([1, 2, 3, 4]), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="4 integers"):
        mech.simulate_statistics(np.array([1, 2, 3]), rng_for("x"))
    with pytest.raises(ValueError, match="non-negative"):
        mech.simulate_statistics(np.array([1, -2, 3, 4]), rng_for("x"))


def test_statistics_merge_serialize_and_refuse_other_lengths() -> None:
    mech = mechanism(1.0, 5, 2)
    reports = mech.encode(rng_for("merge").integers(0, 5, 300), rng_for("merge-encode"))
    whole = mech.aggregate(reports)
    assert mech.aggregate(reports[:100]) + mech.aggregate(reports[100:]) == whole
    assert whole.counts[:5].sum() == 2 * 300  # each report samples two buckets
    assert mech.empty_statistics() + whole == whole
    assert mech.statistics_from_bytes(whole.to_bytes()) == whole
    with pytest.raises(ValueError, match="10"):
        mech.statistics_from_bytes(CountStatistics(3, np.zeros(5, np.int64)).to_bytes())
    with pytest.raises(ValueError, match="2 d = 10"):
        mech.estimate(CountStatistics(3, np.ones(5, np.int64)))
    with pytest.raises(ValueError, match="zero reports"):
        mech.estimate(mech.empty_statistics())


# ======================================================================================
# Wire form
# ======================================================================================


@pytest.mark.parametrize(("d", "s"), [(4, 1), (10, 3), (40, 9)])
def test_payloads_round_trip(d: int, s: int) -> None:
    mech = mechanism(1.0, d, s)
    reports = mech.encode(rng_for(f"wire-{d}").integers(0, d, 200), rng_for("wire"))
    payloads = mech.to_payloads(reports)
    assert all(set(payload) == {"buckets", "bits"} for payload in payloads)
    np.testing.assert_array_equal(mech.from_payloads(payloads), reports)


def test_payload_layout() -> None:
    """Buckets as little-endian uint32, bits packed big-endian in the same order."""
    mech = mechanism(1.0, 300, 3)
    report = np.zeros(1, dtype=mech.report_dtype)
    report["buckets"] = [1, 5, 258]
    report["bits"] = [True, False, True]
    payload = mech.to_payloads(report)[0]
    assert base64.b64decode(payload["buckets"]) == struct.pack("<3I", 1, 5, 258)
    assert base64.b64decode(payload["bits"]) == bytes([0b1010_0000])


def encoded(buckets: list[int], bits: bytes = b"\x80") -> dict[str, Any]:
    return {
        "buckets": base64.b64encode(struct.pack(f"<{len(buckets)}I", *buckets)).decode(),
        "bits": base64.b64encode(bits).decode(),
    }


GOOD = encoded([1, 4])


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"bits": GOOD["bits"]}, "needs a base64 string 'buckets'"),
        ({**GOOD, "buckets": 7}, "needs a base64 string 'buckets'"),
        ({**GOOD, "buckets": "AAAA!"}, "'buckets' is not valid base64"),
        (encoded([1]), "'buckets' holds 4 bytes, expected 8"),
        (encoded([1, 2, 3]), "'buckets' holds 12 bytes, expected 8"),
        (encoded([1, 6]), "bucket 6 is outside 0..5"),
        (encoded([4, 1]), r"buckets \[4, 1\] are not strictly increasing"),
        (encoded([3, 3]), r"buckets \[3, 3\] are not strictly increasing"),
        ({"buckets": GOOD["buckets"]}, "needs a base64 string 'bits'"),
        (encoded([1, 4], b"\x80\x00"), "'bits' holds 2 bytes, expected 1"),
        (encoded([1, 4], b"\xa0"), "sets padding bits past bit 1"),
        ({**GOOD, "value": 1}, r"unexpected payload keys \['value'\]"),
        ("buckets", "needs a base64 string 'buckets'"),
    ],
)
def test_bad_payloads_are_refused_saying_why(payload: Any, message: str) -> None:
    mech = mechanism(1.0, 6, 2)
    assert mech.from_payloads([GOOD])["buckets"].tolist() == [[1, 4]]
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([GOOD, payload])


def test_check_reports_refuses_other_arrays() -> None:
    mech = mechanism(1.0, 6, 2)
    with pytest.raises(ValueError, match="dtype"):
        mech.aggregate(np.zeros((3, 4), dtype=np.uint32))
    with pytest.raises(ValueError, match="dtype"):
        mech.aggregate(np.zeros(3, dtype=mechanism(1.0, 6, 3).report_dtype))


# ======================================================================================
# Specs and inputs
# ======================================================================================


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"epsilon_report": 0.5}, "epsilon_report"),
        ({"bits_per_device": 7}, "bits_per_device"),
        ({"bits_per_device": 0}, "bits_per_device"),
        ({"flip_probability": 0.1}, "flip_probability"),
        ({"domain_size": None}, "domain_size"),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    base = {"mechanism": "dbitflip", "epsilon": 1.0, "domain_size": 6}
    with pytest.raises(ValueError, match=field):
        MechanismSpec.model_validate({**base, **fields})


def test_spec_defaults_and_wrong_mechanism() -> None:
    mech = DBitFlip(MechanismSpec(mechanism="dbitflip", epsilon=2.0, domain_size=6))
    assert (mech.bits_per_device, mech.epsilon_report) == (1, 2.0)
    with pytest.raises(ValueError, match="'dbitflip' spec"):
        DBitFlip(MechanismSpec(mechanism="sue", epsilon=1.0, domain_size=6))


def test_bad_values_and_memos_are_refused() -> None:
    mech = mechanism(1.0, 6, 2)
    with pytest.raises(ValueError, match="outside the domain 0..5"):
        mech.encode(np.array([0, 6]))
    with pytest.raises(ValueError, match="not an integer"):
        mech.permanent(np.array([0.5]))
    short: Memo = SimulatedMemo(np.arange(2), seed=1)
    with pytest.raises(ValueError, match="2 rows for 3 values"):
        mech.encode(np.array([0, 1, 2]), None, context=DeviceContext(memo=short))
    np.testing.assert_array_equal(mech.memo_keys(np.array([5, 0, 5])), [5, 0, 5])
    assert mech.encode(np.zeros(0, np.int64)).shape == (0,)
