"""Longitudinal unary encodings (``lsue``, ``loue``, ``losue``): exact privacy of one report
and of the memoized response, samplers, memoization, the estimator per period, the wire.

Privacy is checked exactly: the output law of one report is enumerated through the chain
(every permanent response z, then every report y) in integer arithmetic over 2^(106 d),
and its largest likelihood ratio is compared with e^epsilon_report in 60-digit decimals;
the permanent response's law likewise against e^epsilon. Both must hold and be tight
(within 1e-9 of the bound).

Statistical tests use fixed seeds (or fixed secrets) and reject at ALPHA = 1e-6 per test
item, split by Bonferroni over the item's assertions: a correct implementation fails an
item with probability at most 1e-6 for some seed, and the fixed inputs make the outcome
fixed. Normal approximations are used for sums of at least 300 independent bounded terms.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import tracemalloc
import zlib
from decimal import Context, Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared.mechanisms import DeviceContext, lue
from shared.mechanisms.lue import (
    LongitudinalOSUE,
    LongitudinalOUE,
    LongitudinalSUE,
    LongitudinalUnaryEncoding,
    chained_ratio,
)
from shared.memo import FreshMemo, KeyedMemo, SimulatedMemo, memo_scope
from shared.randomness import BITS53, RandomSource
from shared.schemas import MechanismSpec

N = BITS53
CLASSES: dict[str, type[LongitudinalUnaryEncoding]] = {
    "lsue": LongitudinalSUE,
    "loue": LongitudinalOUE,
    "losue": LongitudinalOSUE,
}
NAMES = sorted(CLASSES)
#: False-failure rate of one statistical test item.
ALPHA = 1e-6
#: A realized ratio reaches its bound to within this (relative): thresholds are 53-bit.
TIGHT = 1e-9
#: Least expected count of a chi-square cell (rarer cells are pooled).
MIN_EXPECTED = 100.0
SCOPE = memo_scope("app.page", 2)


def build(name: str, epsilon: float, epsilon_report: float, d: int) -> LongitudinalUnaryEncoding:
    fields = {"mechanism": name, "epsilon": epsilon, "epsilon_report": epsilon_report}
    return CLASSES[name](MechanismSpec.model_validate({**fields, "domain_size": d}))


def seeded(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def unpack(reports: np.ndarray, d: int) -> np.ndarray:
    return np.unpackbits(reports, axis=1, count=d).astype(np.int64)


def output_index(reports: np.ndarray, d: int) -> np.ndarray:
    """Column of ``transition_matrix``: bit j of the index is category j's bit."""
    return unpack(reports, d) @ (1 << np.arange(d))


# ---------------------------------------------------------------------------------------
# Exact privacy, by enumeration
# ---------------------------------------------------------------------------------------

#: (epsilon, epsilon_report, d) for every mechanism: small and large epsilons and gaps.
PRIVACY_SETTINGS = [
    (0.01, 0.005, 3),
    (0.5, 0.2, 2),
    (1.0, 0.5, 3),
    (2.0, 1.0, 4),
    (4.0, 1.5, 3),
    (8.0, 2.5, 2),
]
#: epsilon_report close to epsilon: beyond what ``loue`` can reach (ln((2 e^5 + 1) / 3)).
NEAR_SETTINGS = [(5.0, 4.9, 3), (2.0, 1.99, 2)]
PRIVACY_CASES = [(name, *setting) for name in NAMES for setting in PRIVACY_SETTINGS] + [
    (name, *setting) for name in ("lsue", "losue") for setting in NEAR_SETTINGS
]


def log_decimal(numerator: int, denominator: int) -> Decimal:
    """ln(numerator / denominator) to 60 digits (``Decimal.ln`` is correctly rounded)."""
    with localcontext(Context(prec=60)):
        return Decimal(numerator).ln() - Decimal(denominator).ln()


def bit_law(d: int, thresholds: list[tuple[int, ...]]) -> list[list[int]]:
    """law[x][y] * N^d = P(y | x) for independent bits: bit j of y is 1 with probability
    thresholds[x][j] / N (a tuple per input x of d thresholds)."""
    law = []
    for row in thresholds:
        cells = []
        for y in range(2**d):
            weight = 1
            for j, t in enumerate(row):
                weight *= t if (y >> j) & 1 else N - t
            cells.append(weight)
        law.append(cells)
    return law


def unary_law(d: int, p_threshold: int, q_threshold: int) -> list[list[int]]:
    """The one-hot encoding randomized bit by bit: value v's bit v with p, others with q."""
    rows = [tuple(p_threshold if j == v else q_threshold for j in range(d)) for v in range(d)]
    return bit_law(d, rows)


def chain_law(mech: LongitudinalUnaryEncoding) -> list[list[int]]:
    """law[v][y] * N^(2d) = P(report y | value v), summed over every permanent response z."""
    d = mech.domain_size
    permanent = unary_law(d, *mech.thresholds)
    p2, q2 = mech.instantaneous_thresholds
    given_z = bit_law(d, [tuple(p2 if (z >> j) & 1 else q2 for j in range(d)) for z in range(2**d)])
    return [
        [sum(permanent[v][z] * given_z[z][y] for z in range(2**d)) for y in range(2**d)]
        for v in range(d)
    ]


def max_ratio(law: list[list[int]]) -> tuple[int, int]:
    """(numerator, denominator) of max_y max_{x, x'} P(y | x) / P(y | x'), exactly."""
    best = (1, 1)
    for column in zip(*law, strict=True):
        top, bottom = max(column), min(column)
        assert bottom > 0
        if top * best[1] > best[0] * bottom:
            best = (top, bottom)
    return best


def assert_tight(ratio: tuple[int, int], epsilon: float) -> None:
    """ln(ratio) <= epsilon (the double's exact value) and within TIGHT of it."""
    loss = log_decimal(*ratio)
    assert loss <= Decimal(epsilon), f"privacy loss {loss} exceeds {epsilon}"
    assert loss >= Decimal(epsilon) - Decimal(TIGHT) * max(Decimal(epsilon), Decimal(1)), (
        f"privacy loss {loss} falls short of {epsilon}: the bound is not tight"
    )


@pytest.mark.parametrize(("name", "epsilon", "epsilon_report", "d"), PRIVACY_CASES)
def test_one_report_is_exactly_epsilon_report(
    name: str, epsilon: float, epsilon_report: float, d: int
) -> None:
    mech = build(name, epsilon, epsilon_report, d)
    law = chain_law(mech)
    scale = N ** (2 * d)
    assert all(sum(row) == scale for row in law)
    ratio = max_ratio(law)
    assert_tight(ratio, epsilon_report)
    # The enumeration agrees with the closed form and with the mechanism's matrix.
    assert Fraction(*ratio) == chained_ratio(mech.thresholds, mech.instantaneous_thresholds)
    exact = np.array([[Fraction(cell, scale) for cell in row] for row in law], dtype=np.float64)
    np.testing.assert_allclose(mech.transition_matrix(), exact, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("name", "epsilon", "epsilon_report", "d"), PRIVACY_CASES)
def test_permanent_response_is_exactly_epsilon(
    name: str, epsilon: float, epsilon_report: float, d: int
) -> None:
    """What any number of reports of one value reveal: the permanent response's law."""
    mech = build(name, epsilon, epsilon_report, d)
    law = unary_law(d, *mech.thresholds)
    assert all(sum(row) == N**d for row in law)
    assert_tight(max_ratio(law), epsilon)
    exact = np.array([[Fraction(cell, N**d) for cell in row] for row in law], dtype=np.float64)
    np.testing.assert_allclose(mech.permanent_matrix(), exact, rtol=1e-12, atol=0)


def closed_form(name: str, epsilon: float, epsilon_report: float) -> tuple[float, float]:
    """(p2, q2) as the module docstring states them (Arcolezi et al.)."""
    e, r = math.exp(epsilon), math.exp(epsilon_report)
    if name == "lsue":
        a, b = math.exp(epsilon / 2), math.exp(epsilon_report / 2)
        p2 = (a * b - 1) / ((a - 1) * (b + 1))
        return p2, 1 - p2
    if name == "losue":
        p2 = (e * r - 1) / ((e - 1) * (r + 1))
        return p2, 1 - p2
    a_, b_, c_ = e * (r - 1), e + 1 + r - 3 * e * r, 2 * e + 1 - 3 * r
    return 0.5, c_ / (-b_ + math.sqrt(b_ * b_ - 4 * a_ * c_))


@pytest.mark.parametrize(("name", "epsilon", "epsilon_report", "d"), PRIVACY_CASES)
def test_parameters_are_the_papers(
    name: str, epsilon: float, epsilon_report: float, d: int
) -> None:
    """Realized (p2, q2) are the closed forms to within threshold rounding; the permanent
    response is SUE or OUE at epsilon; L-SUE's report is SUE at epsilon_report and L-OSUE's
    OUE at epsilon_report (so L-OSUE has the least variance of the three)."""
    mech = build(name, epsilon, epsilon_report, d)
    p2, q2 = (t / N for t in mech.instantaneous_thresholds)
    want_p2, want_q2 = closed_form(name, epsilon, epsilon_report)
    assert p2 == pytest.approx(want_p2, rel=0, abs=1e-11)
    assert q2 == pytest.approx(want_q2, rel=0, abs=1e-11)
    e, r = math.exp(epsilon), math.exp(epsilon_report)
    p1, q1 = (t / N for t in mech.thresholds)
    if name == "lsue":
        assert (p1, q1) == pytest.approx((e**0.5 / (e**0.5 + 1), 1 / (e**0.5 + 1)), abs=1e-12)
        assert (mech.p, mech.q) == pytest.approx((r**0.5 / (r**0.5 + 1), 1 / (r**0.5 + 1)))
    else:
        assert (p1, q1) == pytest.approx((0.5, 1 / (e + 1)), abs=1e-12)
    if name == "losue":
        assert (mech.p, mech.q) == pytest.approx((0.5, 1 / (r + 1)), rel=1e-9)
        assert mech.variance(1000) == pytest.approx(4 * r / (1000 * (r - 1) ** 2), rel=1e-9)
    assert mech.p == pytest.approx(p1 * p2 + (1 - p1) * q2, rel=1e-12)
    assert mech.q == pytest.approx(q1 * p2 + (1 - q1) * q2, rel=1e-12)


@pytest.mark.parametrize(("epsilon", "epsilon_report"), [(1.0, 0.5), (2.0, 1.0), (4.0, 3.0)])
def test_losue_has_the_least_variance(epsilon: float, epsilon_report: float) -> None:
    variances = {name: build(name, epsilon, epsilon_report, 8).variance(1) for name in NAMES}
    assert min(variances, key=variances.__getitem__) == "losue"


def test_loue_refuses_what_it_cannot_reach() -> None:
    """L-OUE's report reveals at most ln((2 e^eps + 1) / 3) (q2 = 0); beyond, a clear error."""
    limit = math.log((2 * math.exp(2.0) + 1) / 3)
    build("loue", 2.0, limit - 1e-6, 4)  # just below the limit: fine and exact
    with pytest.raises(ValueError, match="epsilon_report = 1.7 is more than one 'loue' report"):
        build("loue", 2.0, 1.7, 4)
    build("losue", 2.0, 1.7, 4)  # losue has no such limit


# ---------------------------------------------------------------------------------------
# Samplers against the exact laws
# ---------------------------------------------------------------------------------------


def assert_fits(observed: np.ndarray, probabilities: np.ndarray, alpha: float = ALPHA) -> None:
    """Pearson chi-square of counts against exact cell probabilities, rare cells pooled
    until every cell expects at least MIN_EXPECTED counts."""
    total = int(observed.sum())
    expected = total * probabilities / probabilities.sum()
    order = np.argsort(expected)
    rare = int(np.count_nonzero(expected < MIN_EXPECTED))  # pool every small cell, and
    enough = int(np.searchsorted(np.cumsum(expected[order]), MIN_EXPECTED)) + 1  # enough mass
    pooled = order[: max(rare, enough)]
    if rare and pooled.size > 1:
        keep = np.setdiff1d(np.arange(expected.size), pooled)
        observed = np.append(observed[keep], observed[pooled].sum())
        expected = np.append(expected[keep], expected[pooled].sum())
    assert expected.min() >= MIN_EXPECTED
    pvalue = stats.chisquare(observed, expected).pvalue
    assert pvalue > alpha, f"chi-square p = {pvalue:.3g}"


SAMPLER_CASES = [(name, 1.0, 0.5) for name in NAMES] + [(name, 4.0, 2.0) for name in NAMES]
SAMPLES = 200_000


@pytest.mark.parametrize("memo_kind", ["none", "simulated"])
@pytest.mark.parametrize(("name", "epsilon", "epsilon_report"), SAMPLER_CASES)
def test_reports_follow_the_transition_matrix(
    name: str, epsilon: float, epsilon_report: float, memo_kind: str
) -> None:
    """All 16 reports of d = 4 (so the bits' independence too), one value, distinct devices."""
    d, value = 4, 2
    mech = build(name, epsilon, epsilon_report, d)
    label = f"reports-{name}-{epsilon}-{memo_kind}"
    memo = SimulatedMemo(np.arange(SAMPLES), seed=zlib.crc32(label.encode()))
    reports = mech.encode(
        np.full(SAMPLES, value),
        rng=seeded(label),
        context=DeviceContext(memo=None if memo_kind == "none" else memo),
    )
    observed = np.bincount(output_index(reports, d), minlength=2**d)
    assert_fits(observed, mech.transition_matrix()[value])


@pytest.mark.parametrize("memo_kind", ["fresh", "simulated"])
@pytest.mark.parametrize(("name", "epsilon", "epsilon_report"), SAMPLER_CASES)
def test_permanent_follows_the_permanent_matrix(
    name: str, epsilon: float, epsilon_report: float, memo_kind: str
) -> None:
    d, value = 4, 0
    mech = build(name, epsilon, epsilon_report, d)
    label = f"permanent-{name}-{epsilon}-{memo_kind}"
    memo = (
        FreshMemo(RandomSource(seeded(label)), SAMPLES)
        if memo_kind == "fresh"
        else SimulatedMemo(np.arange(SAMPLES), seed=zlib.crc32(label.encode()))
    )
    permanent = mech.permanent(np.full(SAMPLES, value), memo)
    observed = np.bincount(output_index(permanent, d), minlength=2**d)
    assert_fits(observed, mech.permanent_matrix()[value])


@pytest.mark.parametrize("d", [37, 130])
@pytest.mark.parametrize("memo_kind", ["none", "simulated"])
def test_bits_across_groups_and_padding(d: int, memo_kind: str) -> None:
    """Bit v is 1 with p*, every other bit with q* (words of 64 lanes; padding stays 0)."""
    mech = build("losue", 2.0, 1.0, d)
    value, samples = d - 2, 40_000
    label = f"bits-{d}-{memo_kind}"
    memo = SimulatedMemo(np.arange(samples), seed=5) if memo_kind == "simulated" else None
    reports = mech.encode(
        np.full(samples, value), rng=seeded(label), context=DeviceContext(memo=memo)
    )
    assert reports.shape == (samples, mech.row_bytes)
    mech.check_reports(reports)  # padding bits are 0
    ones = unpack(reports, d).sum(axis=0)
    for bit in range(d):  # d binomial tests sharing ALPHA
        expected = mech.p if bit == value else mech.q
        assert stats.binomtest(int(ones[bit]), samples, expected).pvalue > ALPHA / d, bit


@pytest.mark.parametrize("name", NAMES)
def test_instantaneous_bits_follow_the_permanent_ones(name: str) -> None:
    """Given the memoized bit, a report's bit is 1 with p2 (permanent 1) or q2 (permanent 0)."""
    d, samples = 4, 100_000
    mech = build(name, 2.0, 1.0, d)
    values = np.arange(samples) % d
    memo = SimulatedMemo(np.arange(samples), seed=17)
    permanent = unpack(mech.permanent(values, memo), d)
    reports = unpack(
        mech.encode(values, rng=seeded(f"inst-{name}"), context=DeviceContext(memo=memo)), d
    )
    p2, q2 = (t / N for t in mech.instantaneous_thresholds)
    for state, probability in ((1, p2), (0, q2)):
        given = permanent == state
        hits = int(reports[given].sum())
        assert stats.binomtest(hits, int(given.sum()), probability).pvalue > ALPHA / 2


# ---------------------------------------------------------------------------------------
# Memoization
# ---------------------------------------------------------------------------------------


def reference_permanent(mech: LongitudinalUnaryEncoding, secret: bytes, value: int) -> np.ndarray:
    """The permanent bits as the module docstring specifies them, written out independently:
    all 53 G words of the (secret, scope, purpose, value) stream, U_i assembled from bit i of
    each round's block (numpy.unpackbits order), bit i = [U_i < T_i]."""
    d = mech.domain_size
    groups = -(-d // 64)
    purpose = mech.name.encode() + b" prr"
    message = (
        b"LDP memo v1\x00"
        + len(SCOPE).to_bytes(2, "big")
        + SCOPE
        + len(purpose).to_bytes(2, "big")
        + purpose
        + value.to_bytes(8, "big")
    )
    stream = hashlib.shake_256(hmac.new(secret, message, hashlib.sha256).digest())
    raw = stream.digest(8 * 53 * groups)  # words as little-endian bytes: the bytes in order
    uniforms = [0] * d
    for round_index in range(53):
        block = np.frombuffer(
            raw[8 * groups * round_index : 8 * groups * (round_index + 1)], np.uint8
        )
        for i, bit in enumerate(np.unpackbits(block)[:d].tolist()):
            uniforms[i] |= bit << (52 - round_index)
    p_threshold, q_threshold = mech.thresholds
    bits = [u < (p_threshold if i == value else q_threshold) for i, u in enumerate(uniforms)]
    return np.array(bits, dtype=np.int64)


@pytest.mark.parametrize("name", NAMES)
def test_permanent_bits_follow_the_documented_word_map(name: str) -> None:
    """A client in another language reproduces the permanent response from the docstring."""
    mech = build(name, 1.0, 0.5, 130)  # three words per round, two padding bytes
    for index, value in enumerate((0, 63, 64, 129)):
        secret = hashlib.sha256(b"device %d" % index).digest()
        got = unpack(mech.permanent(np.array([value]), KeyedMemo(secret, SCOPE)), 130)[0]
        np.testing.assert_array_equal(got, reference_permanent(mech, secret, value))


def test_same_device_same_value_same_permanent_response() -> None:
    mech = build("losue", 3.0, 1.0, 64)
    secret = bytes(range(1, 33))
    values = np.array([5, 9, 5, 40, 9])
    first = mech.permanent(values, KeyedMemo(secret, SCOPE, size=values.size))
    assert np.array_equal(first[0], first[2]) and np.array_equal(first[1], first[4])
    restarted = KeyedMemo(secret, SCOPE, size=values.size)  # a new process: same secret
    assert np.array_equal(mech.permanent(values, restarted), first)
    for value, row in ((5, 0), (40, 3)):  # one device reporting one value at a time
        alone = mech.permanent(np.array([value]), KeyedMemo(secret, SCOPE))
        assert np.array_equal(alone[0], first[row])
    other_scope = mech.permanent(values, KeyedMemo(secret, memo_scope("app.page", 3), size=5))
    assert not np.array_equal(other_scope, first)
    simulated = mech.permanent(np.array([5, 5, 5]), SimulatedMemo([7, 3, 7], seed=1))
    assert np.array_equal(simulated[0], simulated[2])
    moved = mech.permanent(np.array([9, 5]), SimulatedMemo([2, 7], seed=1))
    assert np.array_equal(moved[1], simulated[0])


def test_permanent_response_does_not_depend_on_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    mech = build("lsue", 2.0, 1.0, 130)
    values = np.arange(200) % 130
    memo = SimulatedMemo(np.arange(200), seed=3)
    whole = mech.permanent(values, memo)
    monkeypatch.setattr(lue, "CHUNK_WORDS", 7)  # two rows of three words per chunk
    assert np.array_equal(mech.permanent(values, memo), whole)


def test_different_secrets_give_independent_permanent_responses() -> None:
    """Pairs of devices (secret a_i, secret b_i) holding the same value: the pairs of
    permanent responses (4 x 4 outcomes at d = 2) are independent, and each follows the
    permanent matrix. Two chi-square tests share ALPHA."""
    mech = build("loue", 1.0, 0.5, 2)
    pairs = 6_000
    secrets = [bytes(row) for row in seeded("secrets").integers(0, 256, (2 * pairs, 32))]
    permanent = mech.permanent(np.zeros(2 * pairs, dtype=np.int64), KeyedMemo(secrets, SCOPE))
    outcome = output_index(permanent, 2)
    table = np.zeros((4, 4), dtype=np.int64)
    np.add.at(table, (outcome[:pairs], outcome[pairs:]), 1)
    assert stats.chi2_contingency(table).pvalue > ALPHA / 2
    assert_fits(np.bincount(outcome, minlength=4), mech.permanent_matrix()[0], ALPHA / 2)


def test_memoization_stops_the_averaging_leak() -> None:
    """One device reports one value 3000 times. With its memo, the average report debiased
    by (p2, q2) converges to the permanent response, not to the value's one-hot vector;
    without (memo=None, a stateless client) the average debiased by (p*, q*) converges to
    the one-hot vector: the leak memoization stops. Each bit's debiased mean is within
    z = 5.3 standard errors (Bonferroni over 2 d bits at ALPHA)."""
    d, value, periods = 8, 3, 3000
    mech = build("losue", 2.0, 1.0, d)
    one_hot = (np.arange(d) == value).astype(np.int64)
    # The first of 100 devices whose permanent response is not the one-hot vector itself
    # (each is with probability p1 (1 - q1)^(d - 1), about 0.2).
    candidates = unpack(mech.permanent(np.full(100, value), SimulatedMemo(np.arange(100), 11)), d)
    device = int(np.flatnonzero(np.any(candidates != one_hot, axis=1))[0])
    permanent = candidates[device]
    memo = SimulatedMemo(np.full(periods, device), seed=11)  # that device, every period
    z = float(stats.norm.isf(ALPHA / (2 * 2 * d)))

    memoized = unpack(
        mech.encode(np.full(periods, value), rng=seeded("leak"), context=DeviceContext(memo=memo)),
        d,
    )
    p2, q2 = (t / N for t in mech.instantaneous_thresholds)
    debiased = (memoized.mean(axis=0) - q2) / (p2 - q2)
    spread = np.sqrt(np.where(permanent == 1, p2 * (1 - p2), q2 * (1 - q2)) / periods) / (p2 - q2)
    assert np.all(np.abs(debiased - permanent) <= z * spread)
    assert np.any(np.abs(debiased - one_hot) > z * spread)  # the value is not revealed

    stateless = unpack(mech.encode(np.full(periods, value), rng=seeded("leak-none")), d)
    p, q = mech.p, mech.q
    revealed = (stateless.mean(axis=0) - q) / (p - q)
    spread = np.sqrt(np.where(one_hot == 1, p * (1 - p), q * (1 - q)) / periods) / (p - q)
    assert np.all(np.abs(revealed - one_hot) <= z * spread)


# ---------------------------------------------------------------------------------------
# The estimator, per period
# ---------------------------------------------------------------------------------------


def full_variance(p: float, q: float, f: np.ndarray, n: int) -> np.ndarray:
    """Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))."""
    return q * (1 - q) / (n * (p - q) ** 2) + f * (1 - p - q) / (n * (p - q))


def excess_kurtosis(p: float, q: float, counts: np.ndarray) -> np.ndarray:
    """Of C_v, a sum of independent Bernoullis (counts[v] with p, the others with q)."""
    n = counts.sum()

    def cumulants(prob: float, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        v = prob * (1 - prob)
        return weight * v, weight * v * (1 - 6 * v)

    (k2p, k4p), (k2q, k4q) = cumulants(p, counts), cumulants(q, n - counts)
    return np.asarray((k4p + k4q) / (k2p + k2q) ** 2)


def assert_unbiased_with_formula_variance(
    estimates: np.ndarray, truth: np.ndarray, counts: np.ndarray, p: float, q: float, alpha: float
) -> None:
    """``estimates`` (R, d) against the truth: means within z standard errors, sample
    variances within the chi-square interval matched to their kurtosis (Bonferroni)."""
    runs, d = estimates.shape
    n = int(counts.sum())
    variance = full_variance(p, q, truth, n)
    z = float(stats.norm.isf(alpha / (4 * d)))
    error = np.abs(estimates.mean(axis=0) - truth)
    assert np.all(error <= z * np.sqrt(variance / runs)), error / np.sqrt(variance / runs)
    ratio = estimates.var(axis=0, ddof=1) / variance
    for v, kappa in enumerate(excess_kurtosis(p, q, counts)):
        nu = 2.0 / (2.0 / (runs - 1) + kappa / runs)
        low = stats.chi2.ppf(alpha / (4 * d), nu) / nu
        high = stats.chi2.isf(alpha / (4 * d), nu) / nu
        assert low <= ratio[v] <= high, f"category {v}: variance ratio {ratio[v]:.3f}"


COUNTS = np.array([300, 150, 0, 50, 400, 100])


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_is_unbiased_with_the_formula_variance(name: str) -> None:
    mech = build(name, 2.0, 1.0, COUNTS.size)
    rng = seeded(f"fast-{name}")
    estimates = np.array(
        [mech.estimate(mech.simulate_statistics(COUNTS, rng)).frequencies for _ in range(4000)]
    )
    truth = COUNTS / COUNTS.sum()
    assert_unbiased_with_formula_variance(estimates, truth, COUNTS, mech.p, mech.q, ALPHA)


@pytest.mark.parametrize("memo_kind", ["none", "simulated"])
@pytest.mark.parametrize("name", NAMES)
def test_each_period_is_unbiased_with_the_formula_variance(name: str, memo_kind: str) -> None:
    """R independent populations of n devices over T periods (one period without a memo);
    a tenth of the devices change value each period, and each device keeps its memo across
    periods. Per period, the R estimates are unbiased with the formula's variance: devices
    are independent, and each report has the one-report law whatever the memo holds."""
    d, n, runs = 6, 300, 1000
    periods = 3 if memo_kind == "simulated" else 1
    mech = build(name, 2.0, 1.0, d)
    rng = seeded(f"periods-{name}-{memo_kind}")
    population = np.repeat(np.arange(d), np.array([90, 60, 0, 30, 75, 45]))
    memo = SimulatedMemo(np.arange(runs * n), seed=23) if memo_kind == "simulated" else None
    for period in range(periods):
        counts = np.bincount(population, minlength=d)
        reports = mech.encode(np.tile(population, runs), rng=rng, context=DeviceContext(memo=memo))
        estimates = np.array(
            [
                mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])).frequencies
                for r in range(runs)
            ]
        )
        assert_unbiased_with_formula_variance(
            estimates, counts / n, counts, mech.p, mech.q, ALPHA / periods
        )
        movers = np.arange(period, n, 10)  # a tenth of the devices change value
        population = population.copy()
        population[movers] = (population[movers] + 1 + period) % d


def test_std_is_the_formula_at_the_clipped_estimate() -> None:
    mech = build("loue", 2.0, 1.0, COUNTS.size)
    estimate = mech.estimate(mech.simulate_statistics(COUNTS, seeded("std")))
    clipped = np.clip(estimate.frequencies, 0.0, 1.0)
    expected = np.sqrt(full_variance(mech.p, mech.q, clipped, int(COUNTS.sum())))
    np.testing.assert_allclose(estimate.std, expected, rtol=1e-12)


# ---------------------------------------------------------------------------------------
# Batches, the wire, bad input
# ---------------------------------------------------------------------------------------


def test_large_batches_encode_in_bounded_memory() -> None:
    """30,000 reports of d = 1024 (3.8 MB): the working memory beyond the output stays at a
    few chunks (about 5 MiB; unchunked it would be about 30 MiB), whether the permanent
    response is fresh or memoized."""
    mech = build("losue", 2.0, 1.0, 1024)
    values = seeded("memory").integers(0, 1024, 30_000)
    for memo in (None, SimulatedMemo(np.arange(values.size), seed=2)):
        tracemalloc.start()
        try:
            reports = mech.encode(
                values, rng=seeded("memory-encode"), context=DeviceContext(memo=memo)
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert reports.shape == (values.size, 128)
        assert peak <= reports.nbytes + (12 << 20), f"peak {peak / 2**20:.1f} MiB"


def test_one_device_report_on_the_secure_default() -> None:
    mech = build("lsue", 2.0, 1.0, 300)
    report = mech.encode(np.array([299]), context=DeviceContext(memo=KeyedMemo(bytes(32), SCOPE)))
    assert report.shape == (1, 38)
    mech.check_reports(report)
    assert mech.memo_keys(np.array([299, 4])).tolist() == [299, 4]


@pytest.mark.parametrize("name", NAMES)
def test_payloads_round_trip(name: str) -> None:
    mech = build(name, 1.0, 0.5, 13)
    reports = mech.encode(np.arange(13), rng=seeded(f"wire-{name}"))
    payloads = mech.to_payloads(reports)
    assert set(payloads[0]) == {"bits"}
    assert base64.b64decode(payloads[3]["bits"]) == reports[3].tobytes()
    assert np.array_equal(mech.from_payloads(payloads), reports)
    assert mech.aggregate(reports).n == 13


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({}, "needs a base64 string 'bits'"),
        ({"bits": 5}, "needs a base64 string 'bits'"),
        ({"bits": "not base64!"}, "not valid base64"),
        ({"bits": base64.b64encode(b"\x00").decode()}, "holds 1 bytes, expected 2"),
        ({"bits": base64.b64encode(b"\x00\x01").decode()}, "sets padding bits"),
    ],
)
def test_bad_payloads_are_refused(payload: dict, message: str) -> None:
    mech = build("losue", 1.0, 0.5, 13)
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([{"bits": "AAA="}, payload])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"epsilon": 1.0}, "epsilon_report is required"),
        ({"epsilon": 1.0, "epsilon_report": 1.0}, "epsilon_report must be < epsilon"),
        ({"epsilon": 1.0, "epsilon_report": 2.0}, "epsilon_report must be < epsilon"),
        ({"epsilon": 1.0, "epsilon_report": 0.5, "bits_per_device": 2}, "bits_per_device"),
        ({"epsilon": 1.0, "epsilon_report": 0.5, "flip_probability": 0.1}, "flip_probability"),
        ({"epsilon": 1.0, "epsilon_report": 0.0}, "epsilon_report"),
    ],
)
@pytest.mark.parametrize("name", NAMES)
def test_specs_name_the_bad_field(name: str, fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        MechanismSpec.model_validate({"mechanism": name, "domain_size": 4, **fields})


def test_bad_input_is_refused() -> None:
    mech = build("loue", 1.0, 0.5, 4)
    with pytest.raises(ValueError, match="outside the domain"):
        mech.encode(np.array([0, 4]))
    with pytest.raises(ValueError, match="2 rows for 3 values"):
        mech.encode(np.array([0, 1, 2]), context=DeviceContext(memo=SimulatedMemo([1, 2], seed=0)))
    with pytest.raises(TypeError, match="Generator"):
        mech.encode(np.array([0]), rng=np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'lsue' spec"):
        LongitudinalSUE(mech.spec)
    with pytest.raises(ValueError, match="uint8 of shape"):
        mech.aggregate(np.zeros((3, 2), dtype=np.uint8))
