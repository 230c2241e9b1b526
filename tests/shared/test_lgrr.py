"""Longitudinal GRR (``shared.mechanisms.lgrr``): privacy, samplers, memoization, estimator.

* Privacy, exactly: the permanent and the instantaneous response are enumerated as
  matrices of Fractions built from the realized 53-bit thresholds and composed exactly;
  one report's largest likelihood ratio is at most e^epsilon_report and within 1e-9 of
  it, the permanent response's at most e^epsilon and within 1e-9 of it (certified with
  ``ratio_within_epsilon``, compared against 60-digit ``Decimal`` exponentials).
* Parameters: the instantaneous (p2, q2) are the closed forms of the module docstring;
  the papers' p2 agrees for d = 2 and, for d > 2, composes to less than epsilon_report.
* Samplers: chi-square goodness of fit of ``encode`` (fresh and memoized), of
  ``permanent`` (simulated, fresh and keyed memos) and of the report given its permanent
  response.
* Memoization: the same (secret, scope, value) or (simulated device, value) gives the
  same permanent response every time; another secret or metric version an independent
  one; a device's reports over many periods concentrate on its permanent response, not on
  its value, unless the permanent response is redrawn (``memo=None``, the stateless leak).
* Estimator: unbiased with the frequency-oracle variance of GRR at epsilon_report, per
  period, with devices memoized across periods; the simulation fast path has the same law.

Tolerances. Every statistical test item has a false-failure rate of at most ALPHA = 1e-6,
split by Bonferroni over its assertions (chi-square and binomial tests use exact or
asymptotic p-values; mean and variance checks use normal and chi-square approximations
of sums of thousands of independent bounded terms). Seeds are fixed, so outcomes are
deterministic; its 12 statistical items make a false failure of the file below 1.2e-5
for a random seed.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared.mechanisms import DeviceContext, as_memoized
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.lgrr import PERMANENT_PURPOSE, LongitudinalGRR
from shared.memo import FreshMemo, KeyedMemo, Memo, SimulatedMemo, memo_scope
from shared.randomness import BITS53, RandomSource, ratio_within_epsilon
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
#: Relative distance from e^epsilon within which an enumerated ratio must lie (tightness).
TIGHT = 1e-9
SCOPE = memo_scope("app.theme", 3)

#: (epsilon, epsilon_report, d): tiny and large epsilons, Warner's d = 2, epsilon_report
#: far below and just below epsilon.
PRIVACY_CASES = [
    (0.002, 0.001, 2),
    (0.05, 0.01, 2),
    (0.5, 0.25, 3),
    (1.0, 0.5, 3),
    (2.0, 1.0, 5),
    (4.0, 0.5, 8),
    (8.0, 6.0, 16),
    (10.0, 3.0, 2),
    (1.0, 0.999999, 4),
    (3.0, 0.001, 6),
]


def lgrr(epsilon: float, epsilon_report: float, d: int) -> LongitudinalGRR:
    spec = MechanismSpec(
        mechanism="lgrr", epsilon=epsilon, epsilon_report=epsilon_report, domain_size=d
    )
    return LongitudinalGRR(spec)


def rng_for(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def case_id(case: tuple[float, float, int]) -> str:
    return "eps{:g}-rep{:g}-d{}".format(*case)


# ---------------------------------------------------------------------------------------
# Exact privacy
# ---------------------------------------------------------------------------------------


def exact_grr(threshold: int, d: int) -> list[list[Fraction]]:
    """GRR keeping with probability T / 2^53, else uniform over d: exact (d, d) law."""
    keep = Fraction(threshold, BITS53)
    return [[keep * (x == y) + (1 - keep) / d for y in range(d)] for x in range(d)]


def compose(first: list[list[Fraction]], second: list[list[Fraction]]) -> list[list[Fraction]]:
    """The law of applying ``first`` and then ``second``: the exact matrix product."""
    d = len(first)
    return [
        [sum((first[x][z] * second[z][y] for z in range(d)), Fraction(0)) for y in range(d)]
        for x in range(d)
    ]


def largest_ratio(matrix: list[list[Fraction]]) -> Fraction:
    """max over outputs y and inputs x, x' of P[y | x] / P[y | x'], exactly."""
    columns = list(zip(*matrix, strict=True))
    return max(max(column) / min(column) for column in columns)


def is_tight(ratio: Fraction, epsilon: float) -> bool:
    """Whether ``ratio`` is at least e^epsilon (1 - TIGHT), in 60-digit arithmetic."""
    with localcontext(Context(prec=60)):
        bound = Decimal(epsilon).exp()
        return Decimal(ratio.numerator) / Decimal(ratio.denominator) >= bound * (1 - Decimal(TIGHT))


@pytest.mark.parametrize("case", PRIVACY_CASES, ids=case_id)
def test_one_report_is_exactly_epsilon_report_ldp_and_tight(
    case: tuple[float, float, int],
) -> None:
    epsilon, epsilon_report, d = case
    mech = lgrr(*case)
    permanent = exact_grr(mech.permanent_threshold, d)
    report = compose(permanent, exact_grr(mech.instantaneous_threshold, d))
    assert all(sum(row) == 1 for row in report)
    # The chain is one GRR whose keep probability is the product T1 T2 / 2^106.
    lam = mech.keep_probability
    assert lam == Fraction(mech.permanent_threshold * mech.instantaneous_threshold, BITS53**2)
    for x in range(d):
        for y in range(d):
            assert report[x][y] == lam * (x == y) + (1 - lam) / d
    ratio = largest_ratio(report)
    assert ratio_within_epsilon(ratio, epsilon_report)
    assert is_tight(ratio, epsilon_report)
    # The float matrix the estimator and the contract tests use is the exact law, rounded.
    expected = np.array([[float(entry) for entry in row] for row in report])
    np.testing.assert_allclose(mech.transition_matrix(), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("case", PRIVACY_CASES, ids=case_id)
def test_permanent_response_is_exactly_epsilon_ldp_and_tight(
    case: tuple[float, float, int],
) -> None:
    epsilon, _, d = case
    mech = lgrr(*case)
    permanent = exact_grr(mech.permanent_threshold, d)
    assert all(sum(row) == 1 for row in permanent)
    ratio = largest_ratio(permanent)
    assert ratio_within_epsilon(ratio, epsilon)
    assert is_tight(ratio, epsilon)
    expected = np.array([[float(entry) for entry in row] for row in permanent])
    np.testing.assert_allclose(mech.permanent_matrix(), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("case", PRIVACY_CASES, ids=case_id)
def test_float_matrices_pass_at_epsilon_and_fail_just_below(
    case: tuple[float, float, int],
) -> None:
    """OpenDP-style tightness on the matrices as published: d_out = eps passes,
    eps - 1e-6 fails (relative slack 1e-12 for the rounding of the entries)."""
    epsilon, epsilon_report, _ = case
    mech = lgrr(*case)
    for matrix, eps in (
        (mech.transition_matrix(), epsilon_report),
        (mech.permanent_matrix(), epsilon),
    ):
        ratio = float((matrix.max(axis=0) / matrix.min(axis=0)).max())
        assert ratio <= math.exp(eps) * (1 + 1e-12)
        assert ratio > math.exp(eps - 1e-6)


# ---------------------------------------------------------------------------------------
# Parameters and variance against the papers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PRIVACY_CASES, ids=case_id)
def test_parameters_are_the_documented_closed_forms(case: tuple[float, float, int]) -> None:
    epsilon, epsilon_report, d = case
    mech = lgrr(*case)
    a, b = math.exp(epsilon), math.exp(epsilon_report)
    p1, q1 = mech.permanent_probabilities
    p2, q2 = mech.instantaneous_probabilities
    assert p1 == pytest.approx(a / (a + d - 1), rel=1e-12)
    assert q1 == pytest.approx(1 / (a + d - 1), rel=1e-9)
    assert p2 == pytest.approx((a * b + (d - 2) * b - (d - 1)) / ((a - 1) * (b + d - 1)), rel=1e-9)
    assert q2 == pytest.approx((a - b) / ((a - 1) * (b + d - 1)), rel=1e-6, abs=1e-15)
    # One report: the chain's P(v | v) and P(v | u) are GRR's at epsilon_report.
    assert mech.p == pytest.approx(p1 * p2 + (1 - p1) * q2, rel=1e-14)
    assert mech.q == pytest.approx(q1 * p2 + (1 - q1) * q2, rel=1e-12)
    assert mech.p == pytest.approx(b / (b + d - 1), rel=1e-12)
    assert mech.q == pytest.approx(1 / (b + d - 1), rel=1e-9)


def papers_p2(epsilon: float, epsilon_report: float, d: int) -> float:
    """Arcolezi et al.'s L-GRR p2 = (e^(eps + eps1) - 1) / (-d e^eps1 + (d - 1) e^eps +
    e^eps1 + e^(eps + eps1) - 1)."""
    a, b = math.exp(epsilon), math.exp(epsilon_report)
    return (a * b - 1) / (-d * b + (d - 1) * a + b + a * b - 1)


def chain_law(p1: float, p2: float, d: int) -> tuple[float, float]:
    """(P(y = v | v), P(y = v | u)) of GRR(p1) then GRR(p2), with q = (1 - p) / (d - 1)."""
    q1, q2 = (1 - p1) / (d - 1), (1 - p2) / (d - 1)
    return p1 * p2 + (1 - p1) * q2, q1 * p2 + (1 - q1) * q2


def test_papers_p2_agrees_for_two_values_and_undershoots_above() -> None:
    mech = lgrr(1.0, 0.5, 2)
    assert mech.instantaneous_probabilities[0] == pytest.approx(papers_p2(1.0, 0.5, 2), rel=1e-12)
    for epsilon, epsilon_report, d in ((1.0, 0.5, 3), (2.0, 1.0, 5), (4.0, 0.5, 8)):
        mech = lgrr(epsilon, epsilon_report, d)
        p1 = mech.permanent_probabilities[0]
        theirs = papers_p2(epsilon, epsilon_report, d)
        q1, q2 = (1 - p1) / (d - 1), (1 - theirs) / (d - 1)
        # Theirs solves the two-path condition, without the paths through a third value...
        two_path = (p1 * theirs + q1 * q2) / (p1 * q2 + q1 * theirs)
        assert two_path == pytest.approx(math.exp(epsilon_report), rel=1e-12)
        # ...so its chain realizes less than epsilon_report, at a larger variance.
        p, q = chain_law(p1, theirs, d)
        assert math.log(p / q) < epsilon_report - 0.01
        assert q * (1 - q) / (p - q) ** 2 > mech.variance(1)
    p, q = chain_law(lgrr(1.0, 0.5, 3).permanent_probabilities[0], papers_p2(1.0, 0.5, 3), 3)
    assert math.log(p / q) == pytest.approx(0.442, abs=5e-4)


@pytest.mark.parametrize("case", PRIVACY_CASES, ids=case_id)
def test_variance_is_grrs_at_epsilon_report(case: tuple[float, float, int]) -> None:
    epsilon, epsilon_report, d = case
    mech = lgrr(*case)
    grr = GeneralizedRandomizedResponse(
        MechanismSpec(mechanism="grr", epsilon=epsilon_report, domain_size=d)
    )
    n = 12_345
    b = math.exp(epsilon_report)
    assert mech.variance(n) == pytest.approx(grr.variance(n), rel=1e-9)
    assert mech.variance(n) == pytest.approx((b + d - 2) / (n * (b - 1) ** 2), rel=1e-6)
    # The papers' form: q (1 - q) / (n (p1 - q1)^2 (p2 - q2)^2).
    p1, q1 = mech.permanent_probabilities
    p2, q2 = mech.instantaneous_probabilities
    papers = mech.q * (1 - mech.q) / (n * (p1 - q1) ** 2 * (p2 - q2) ** 2)
    assert mech.variance(n) == pytest.approx(papers, rel=1e-9)


def test_estimator_is_the_papers() -> None:
    """f_v = (C_v / n - q1 (p2 - q2) - q2) / ((p1 - q1)(p2 - q2))."""
    mech = lgrr(2.0, 1.0, 5)
    counts = np.array([400, 250, 150, 130, 70])
    estimate = mech.estimate(CountStatistics(int(counts.sum()), counts))
    p1, q1 = mech.permanent_probabilities
    p2, q2 = mech.instantaneous_probabilities
    n = counts.sum()
    papers = (counts / n - q1 * (p2 - q2) - q2) / ((p1 - q1) * (p2 - q2))
    np.testing.assert_allclose(estimate.frequencies, papers, rtol=1e-9, atol=1e-12)
    assert estimate.n == n


# ---------------------------------------------------------------------------------------
# Samplers: goodness of fit
# ---------------------------------------------------------------------------------------

GOF = (2.0, 1.0, 5)
PER_VALUE = 40_000


def block_values(d: int, per_value: int) -> np.ndarray:
    return np.repeat(np.arange(d), per_value)


def assert_rows_fit(outputs: np.ndarray, d: int, matrix: np.ndarray, alpha: float) -> None:
    """Block v of ``outputs`` (values v, equal-sized blocks) against row v of ``matrix``:
    one chi-square test per value, sharing ``alpha`` by Bonferroni."""
    blocks = outputs.reshape(d, -1)
    for v in range(d):
        observed = np.bincount(blocks[v], minlength=matrix.shape[1])
        result = stats.chisquare(observed, matrix[v] * blocks.shape[1])
        assert result.pvalue > alpha / d, (v, observed, matrix[v] * blocks.shape[1])


@pytest.mark.parametrize("memoized", [False, True], ids=["fresh", "simulated-memo"])
def test_encode_follows_the_transition_matrix(memoized: bool) -> None:
    mech = lgrr(*GOF)
    d = mech.domain_size
    values = block_values(d, PER_VALUE)
    rng = rng_for(f"encode-{memoized}")
    memo = SimulatedMemo(np.arange(values.size), seed=5) if memoized else None
    reports = mech.encode(values, rng, context=DeviceContext(memo=memo))
    assert_rows_fit(reports, d, mech.transition_matrix(), ALPHA)


def memo_of(kind: str, size: int) -> Memo:
    """``size`` distinct devices' memos of one kind."""
    if kind == "simulated":
        return SimulatedMemo(np.arange(size), seed=9)
    if kind == "fresh":
        return FreshMemo(RandomSource(rng_for("fresh-permanent")), size)
    secrets = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(size)]
    return KeyedMemo(secrets, SCOPE)


@pytest.mark.parametrize(
    ("kind", "per_value"), [("simulated", PER_VALUE), ("fresh", PER_VALUE), ("keyed", 2000)]
)
def test_permanent_follows_the_permanent_matrix(kind: str, per_value: int) -> None:
    mech = lgrr(*GOF)
    d = mech.domain_size
    values = block_values(d, per_value)
    responses = mech.permanent(values, memo_of(kind, values.size))
    assert_rows_fit(responses, d, mech.permanent_matrix(), ALPHA)


def test_report_given_its_permanent_response_is_the_instantaneous_grr() -> None:
    """The joint law of (permanent response, report) for value 1 is P1[1, z] P2[z, y]."""
    mech = lgrr(*GOF)
    d = mech.domain_size
    values = np.ones(200_000, dtype=np.int64)
    memo = SimulatedMemo(np.arange(values.size), seed=21)
    permanent = mech.permanent(values, memo)
    reports = mech.encode(values, rng_for("joint"), context=DeviceContext(memo=memo))
    p2, q2 = mech.instantaneous_probabilities
    instantaneous = np.where(np.eye(d, dtype=bool), p2, q2)
    expected = mech.permanent_matrix()[1][:, None] * instantaneous * values.size
    observed = np.bincount(permanent * d + reports, minlength=d * d).reshape(d, d)
    assert stats.chisquare(observed.ravel(), expected.ravel()).pvalue > ALPHA


# ---------------------------------------------------------------------------------------
# Memoization
# ---------------------------------------------------------------------------------------


def reference_permanent(words: list[int], value: int, threshold: int, d: int) -> int:
    """The module docstring's recipe from a stream's words: keep if the top 53 bits of
    word 0 are below T1, else the first later word masked to 2^ceil(log2 d) - 1 below d."""
    if words[0] >> 11 < threshold:
        return value
    mask = (1 << (d - 1).bit_length()) - 1
    return next(word & mask for word in words[1:] if word & mask < d)


@pytest.mark.parametrize("d", [2, 5, 6, 17])
def test_keyed_permanent_follows_the_documented_recipe(d: int) -> None:
    """What a client in another language reproduces: purpose, key and word mapping."""
    mech = lgrr(0.7, 0.3, d)  # a small epsilon: most responses take the uniform branch
    size = 600
    secrets = [hashlib.sha256(b"device" + i.to_bytes(4, "big")).digest() for i in range(size)]
    values = np.arange(size) % d
    words = KeyedMemo(secrets, SCOPE).draws(PERMANENT_PURPOSE, values).words(64).tolist()
    expected = [
        reference_permanent(row, int(v), mech.permanent_threshold, d)
        for row, v in zip(words, values, strict=True)
    ]
    assert mech.permanent(values, KeyedMemo(secrets, SCOPE)).tolist() == expected
    assert mech.memo_keys(values).tolist() == values.tolist()


def test_the_same_device_and_value_give_the_same_permanent_response_forever() -> None:
    mech = lgrr(1.0, 0.5, 6)
    secret = hashlib.sha256(b"one device").digest()
    values = np.tile(np.arange(6), 50)
    first = mech.permanent(values, KeyedMemo(secret, SCOPE, size=values.size))
    # Every report of a value carries the same permanent response...
    assert all(np.unique(first[values == v]).size == 1 for v in range(6))
    # ...and so does a restarted client (a new memo object over the same secret).
    restarted = mech.permanent(values, KeyedMemo(secret, SCOPE, size=values.size))
    assert np.array_equal(first, restarted)
    # Simulated devices: a device's response depends on its id and value, not on its row.
    devices = np.repeat(np.arange(40), 30)
    device_values = np.arange(devices.size) % 6
    order = rng_for("rows").permutation(devices.size)
    memo = SimulatedMemo(devices, seed=3)
    shuffled = SimulatedMemo(devices[order], seed=3)
    once = mech.permanent(device_values, memo)
    again = mech.permanent(device_values[order], shuffled)
    assert np.array_equal(once[order], again)
    for device in range(40):
        rows = devices == device
        for v in range(6):
            assert np.unique(once[rows & (device_values == v)]).size == 1


@pytest.mark.parametrize("change", ["secret", "version"])
def test_another_secret_or_version_gives_an_independent_permanent_response(change: str) -> None:
    """4,000 devices, value 2 (d = 3, epsilon = 0.5): the pairs (response under one
    secret or scope, response under the other) form an independent contingency table
    whose margins are the permanent row (three tests sharing ALPHA)."""
    mech = lgrr(0.5, 0.25, 3)
    size = 4000
    secrets = [hashlib.sha256(b"a" + i.to_bytes(4, "big")).digest() for i in range(size)]
    values = np.full(size, 2)
    first = mech.permanent(values, KeyedMemo(secrets, SCOPE))
    if change == "secret":
        others = [hashlib.sha256(b"b" + i.to_bytes(4, "big")).digest() for i in range(size)]
        second = mech.permanent(values, KeyedMemo(others, SCOPE))
    else:
        second = mech.permanent(values, KeyedMemo(secrets, memo_scope("app.theme", 4)))
    table = np.bincount(first * 3 + second, minlength=9).reshape(3, 3)
    assert stats.chi2_contingency(table).pvalue > ALPHA / 3
    row = mech.permanent_matrix()[2] * size
    assert stats.chisquare(table.sum(axis=1), row).pvalue > ALPHA / 3
    assert stats.chisquare(table.sum(axis=0), row).pvalue > ALPHA / 3


def test_memoization_stops_reports_from_averaging_to_the_value() -> None:
    """200 devices report their unchanging value over 1,000 periods (d = 4, epsilon = 2,
    epsilon_report = 0.5). With the memo, each device's most frequent report is its
    permanent response, which is its value for about p1 of the devices (binomial test);
    with ``memo=None`` every permanent response is redrawn, and the most frequent report
    is every device's value. A mode misses its target only if another count overtakes it:
    a difference of counts with mean 1000 (p - q) and standard deviation at most 25,
    about 9 (memoized) and 6 (stateless) standard deviations: below 1e-8 over all devices."""
    mech = lgrr(2.0, 0.5, 4)
    d, devices, periods = 4, 200, 1000
    values = np.arange(devices) % d
    rows = np.repeat(np.arange(devices), periods)
    memo = SimulatedMemo(rows, seed=17)
    rng = rng_for("leak")

    def modes(reports: np.ndarray) -> np.ndarray:
        counts = np.bincount(rows * d + reports, minlength=devices * d).reshape(devices, d)
        return np.asarray(counts.argmax(axis=1))

    memoized = modes(mech.encode(values[rows], rng, context=DeviceContext(memo=memo)))
    permanent = mech.permanent(values, SimulatedMemo(np.arange(devices), seed=17))
    assert np.array_equal(memoized, permanent)
    low = stats.binom.ppf(ALPHA / 4, devices, mech.permanent_probabilities[0])
    high = stats.binom.isf(ALPHA / 4, devices, mech.permanent_probabilities[0])
    assert low <= np.sum(memoized == values) <= high < devices
    stateless = modes(mech.encode(values[rows], rng))
    assert np.array_equal(stateless, values)


# ---------------------------------------------------------------------------------------
# Estimator: unbiased per period, variance of GRR at epsilon_report
# ---------------------------------------------------------------------------------------


def variance_ratio_bounds(runs: int, excess_kurtosis: float, alpha: float) -> tuple[float, float]:
    """Acceptance interval of s^2 / sigma^2 for ``runs`` values of excess kurtosis kappa:
    chi2_nu / nu with nu = 2 / (2 / (R - 1) + kappa / R), which has the exact variance."""
    nu = 2.0 / (2.0 / (runs - 1) + excess_kurtosis / runs)
    return float(stats.chi2.ppf(alpha / 2, nu) / nu), float(stats.chi2.isf(alpha / 2, nu) / nu)


def count_cumulants(mech: LongitudinalGRR, users: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mean, variance and fourth cumulant of each count C_y: sums of independent
    Bernoulli(P[v, y]) indicators over the ``users[v]`` users of each value v."""
    matrix = mech.transition_matrix()
    cell = matrix * (1 - matrix)
    weights = users.astype(np.float64)
    return weights @ matrix, weights @ cell, weights @ (cell * (1 - 6 * cell))


def assert_unbiased_with_formula_variance(
    mech: LongitudinalGRR, users: np.ndarray, frequencies: np.ndarray, alpha: float
) -> None:
    """R estimates (rows of ``frequencies``) of a population with ``users[v]`` users per
    value: mean within z standard errors of the truth, sample variance within the
    chi-square interval around the full formula, per value (2 d assertions share alpha)."""
    d, runs, n = mech.domain_size, frequencies.shape[0], int(users.sum())
    truth = users / n
    p, q = mech.p, mech.q
    variance = q * (1 - q) / (n * (p - q) ** 2) + truth * (1 - p - q) / (n * (p - q))
    z = float(stats.norm.isf(alpha / (4 * d)))
    error = np.abs(frequencies.mean(axis=0) - truth) / np.sqrt(variance / runs)
    assert np.all(error <= z), error
    _, second, fourth = count_cumulants(mech, users)
    ratio = frequencies.var(axis=0, ddof=1) / variance
    for v in range(d):
        low, high = variance_ratio_bounds(runs, fourth[v] / second[v] ** 2, alpha / (2 * d))
        assert low <= ratio[v] <= high, (v, ratio[v], low, high)


def test_estimates_per_period_are_unbiased_with_grrs_variance_at_epsilon_report() -> None:
    """800 independent populations of 500 devices, memoized across 3 periods in which a
    fifth and then two fifths of the devices move to the next value; each period's
    estimates against that period's truth (ALPHA shared over the periods)."""
    mech = lgrr(2.0, 1.0, 5)
    d, devices, runs, periods = 5, 500, 800, 3
    weights = 0.6 ** np.arange(d - 1)
    base = np.repeat(np.arange(d - 1), np.round(devices * weights / weights.sum()).astype(int))
    base = np.resize(base, devices)  # the last value starts empty
    memo = SimulatedMemo(np.arange(runs * devices), seed=2024)
    rng = rng_for("periods")
    previous = None
    for period in range(periods):
        values = np.where(np.arange(devices) % 5 < period, (base + 1) % d, base)
        population = np.tile(values, runs)
        reports = mech.encode(population, rng, context=DeviceContext(memo=memo)).reshape(
            runs, devices
        )
        counts = np.stack([np.bincount(row, minlength=d) for row in reports])
        frequencies = np.stack(
            [mech.estimate(CountStatistics(devices, c)).frequencies for c in counts]
        )
        users = np.bincount(values, minlength=d)
        assert_unbiased_with_formula_variance(mech, users, frequencies, ALPHA / periods)
        # Devices whose value did not change kept their permanent response.
        current = mech.permanent(population, memo)
        if previous is not None:
            same = population == previous[0]
            assert np.array_equal(current[same], previous[1][same])
        previous = (population, current)


SIMULATED_COUNTS = np.array([120, 60, 0, 30, 75, 15])


@pytest.mark.parametrize(("path", "scale"), [("encode", 1), ("fast", 100)])
def test_both_paths_draw_the_one_report_statistics(path: str, scale: int) -> None:
    """3,000 periods of 300 users (encoded) or 30,000 (fast path, whose cost does not grow
    with n: its keep probability is then resolved to about 0.2%): each count's mean and
    variance against its Bernoulli-sum law, and the estimates unbiased with the formula
    variance (ALPHA over both checks)."""
    mech = lgrr(1.5, 0.8, SIMULATED_COUNTS.size)
    users = SIMULATED_COUNTS * scale
    d, runs = mech.domain_size, 3000
    n = int(users.sum())
    rng = rng_for(f"paths-{path}")
    if path == "fast":
        counts = np.stack([mech.simulate_statistics(users, rng).counts for _ in range(runs)])
    else:
        values = np.tile(np.repeat(np.arange(d), users), runs)
        reports = mech.encode(
            values, rng, context=DeviceContext(memo=SimulatedMemo(np.arange(values.size), seed=8))
        )
        run = np.repeat(np.arange(runs), n)
        counts = np.bincount(run * d + reports, minlength=runs * d).reshape(runs, d)
    assert np.all(counts.sum(axis=1) == n)
    mean, variance, fourth = count_cumulants(mech, users)
    z = float(stats.norm.isf(ALPHA / (2 * 4 * d)))
    assert np.all(np.abs(counts.mean(axis=0) - mean) <= z * np.sqrt(variance / runs))
    spread = variance * np.sqrt(2 / (runs - 1) + fourth / variance**2 / runs)
    assert np.all(np.abs(counts.var(axis=0, ddof=1) - variance) <= z * spread)
    frequencies = np.stack([mech.estimate(CountStatistics(n, c)).frequencies for c in counts])
    assert_unbiased_with_formula_variance(mech, users, frequencies, ALPHA / 2)


def test_fast_path_refuses_bad_counts() -> None:
    mech = lgrr(1.0, 0.5, 3)
    rng = np.random.default_rng(0)
    for bad in (np.array([1, 2]), np.array([1.0, 2.0, 3.0]), np.array([1, -1, 2])):
        with pytest.raises(ValueError, match="counts"):
            mech.simulate_statistics(bad, rng)
    with pytest.raises(TypeError, match="Generator"):
        mech.simulate_statistics(np.array([1, 2, 3]), None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Wire form, statistics, specs and bad input
# ---------------------------------------------------------------------------------------


def test_payloads_round_trip_and_statistics_merge() -> None:
    mech = lgrr(2.0, 1.0, 7)
    reports = mech.encode(np.arange(7).repeat(3), rng_for("wire"))
    payloads = mech.to_payloads(reports)
    assert all(set(payload) == {"value"} for payload in payloads)
    assert np.array_equal(mech.from_payloads(payloads), reports)
    whole = mech.aggregate(reports)
    parts = mech.aggregate(reports[:5]).merge(mech.aggregate(reports[5:]))
    assert np.array_equal(whole.counts, parts.counts) and whole.n == parts.n == 21
    restored = mech.statistics_from_bytes(whole.to_bytes())
    assert np.array_equal(restored.counts, whole.counts)
    assert mech.empty_statistics().n == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"value": 7}, "outside the domain 0..6"),
        ({"value": -1}, "outside the domain"),
        ({"value": "3"}, "integer 'value'"),
        ({"value": True}, "integer 'value'"),
        ({"value": 2.0}, "integer 'value'"),
        ({}, "integer 'value'"),
        ({"value": 2**70}, "out of range"),
    ],
)
def test_bad_payloads_are_refused(payload: dict[str, Any], message: str) -> None:
    mech = lgrr(2.0, 1.0, 7)
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([{"value": 1}, payload])


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"epsilon_report": 2.0}, "epsilon_report"),
        ({"epsilon_report": 3.0}, "epsilon_report"),
        ({"epsilon_report": None}, "epsilon_report"),
        ({"epsilon_report": 1.0, "bits_per_device": 1}, "bits_per_device"),
        ({"epsilon_report": 1.0, "flip_probability": 0.1}, "flip_probability"),
        ({"epsilon_report": 1.0, "domain_size": None}, "domain_size"),
        ({"epsilon_report": 1.0, "lower": 0.0, "upper": 1.0}, "lower"),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    spec = {"mechanism": "lgrr", "epsilon": 2.0, "domain_size": 4, **fields}
    with pytest.raises(ValidationError, match=field):
        MechanismSpec.model_validate({k: v for k, v in spec.items() if v is not None})


def test_bad_values_memos_and_specs_are_refused() -> None:
    mech = lgrr(2.0, 1.0, 4)
    with pytest.raises(ValueError, match="outside the domain 0..3"):
        mech.encode(np.array([0, 4]))
    with pytest.raises(ValueError, match="not an integer"):
        mech.encode(np.array([0.5]))
    with pytest.raises(ValueError, match="one-dimensional"):
        mech.permanent(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="one per value"):
        mech.encode(
            np.array([0, 1, 2]), context=DeviceContext(memo=SimulatedMemo(np.arange(2), seed=1))
        )
    with pytest.raises(ValueError, match="one per value"):
        mech.permanent(np.array([0, 1]), KeyedMemo(bytes(32), SCOPE, size=3))
    with pytest.raises(ValueError, match="'lgrr' spec"):
        LongitudinalGRR(MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=4))


def test_it_is_a_memoized_mechanism_with_its_spec_epsilons() -> None:
    mech = lgrr(2.0, 0.7, 4)
    assert as_memoized(mech) is not None and mech.kind == "categorical" and mech.name == "lgrr"
    assert (mech.epsilon_lifetime, mech.epsilon_report) == (2.0, 0.7)
    assert mech.payload_fields == frozenset({"value"})
    # One device's report on the device: its keyed memo, the OS CSPRNG.
    reports = mech.encode(
        np.array([3]), context=DeviceContext(memo=KeyedMemo(bytes(range(32)), SCOPE))
    )
    assert reports.shape == (1,) and 0 <= int(reports[0]) < 4
