"""``onebitmean``: 1BitMean with alpha-point rounding, memoization and output perturbation
(``shared.mechanisms.onebitmean``).

Checked here:

* privacy, exactly: one report's law, rebuilt in rational arithmetic from the realized
  thresholds for every grid point and for fractional and clipped inputs, has largest
  likelihood ratio at most e^epsilon_report and within 1e-9 of it; the memoized bit's
  (``permanent_matrix``) at most e^epsilon and within 1e-9 of it (within the documented
  (s + 2)(e^eps + 1) 2^-52 for a huge grid at epsilon 20); logarithms in 60 digits;
* unbiasedness, exactly: alpha-point rounding's E[g] is t up to 2^-53 (floating-point
  error of t aside), and E[y | x] is exactly the grid position (exactly x at grid points);
* the samplers: encoded reports against ``transition_matrix``, memoized bits against
  ``permanent_matrix``, rounding against its law (chi-square), without a memo and with
  memos of distinct devices; the memo words as the module docstring specifies them;
* memoization: the same device (secret and scope, or simulated id) gets the same offset
  and bits in a new memo object; other secrets give independent ones; a constant value
  keeps one memo key for a year; one device's reports average to its memoized bit, not
  to its value, while stateless reports (``memo=None``) average to the value;
* the estimator, per period with devices memoized across periods: unbiased, variance as
  the formula, through the fast path and through encode + aggregate; interval coverage at
  epsilon 0.5, 2 and 8; the wire form and the spec's validation.

Tolerances. Every statistical assertion has false-failure probability at most
``ALPHA = 1e-6`` (chi-square p-values, exact binomial intervals, or z = 4.89 two-sided
for normal approximations of sums of many independent bounded terms); with about 80 such
assertions the file fails falsely with probability below 1e-4, and with fixed seeds its
outcome is fixed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import zlib
from decimal import Context, Decimal, localcontext
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared.mechanisms import DeviceContext
from shared.mechanisms.duchi import DuchiMean
from shared.mechanisms.onebitmean import DEFAULT_GRID_STEPS, OneBitMean, onebitmean_epsilon_report
from shared.memo import KeyedMemo, SimulatedMemo, memo_scope
from shared.schemas import MechanismSpec

N = 2**53
ALPHA = 1e-6
Z = float(stats.norm.isf(ALPHA / 2))  # 4.89
LOWER, UPPER = -3.7, 11.2
SECRET = bytes(range(32))
SCOPE = memo_scope("session.minutes", 2)


def build(
    epsilon: float,
    flip: float | None = None,
    grid_steps: int | None = None,
    lower: float = LOWER,
    upper: float = UPPER,
) -> OneBitMean:
    return OneBitMean(
        MechanismSpec(
            mechanism="onebitmean",
            epsilon=epsilon,
            lower=lower,
            upper=upper,
            grid_steps=grid_steps,
            flip_probability=flip,
        )
    )


def rng_for(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def grid_inputs(mech: OneBitMean) -> np.ndarray:
    """Every grid point, fractional positions in several cells, and clipped inputs."""
    width = mech.upper - mech.lower
    steps = mech.grid_steps
    return np.concatenate(
        [
            mech.lower + width * np.arange(steps + 1) / steps,
            mech.lower + width * np.array([1e-12, 0.013, 0.31415926, 0.5 + 1e-9, 0.77, 0.999]),
            [mech.lower - 1.0, mech.lower - 1e9, mech.upper + 0.5, mech.upper + 1e9],
        ]
    )


# --- the exact laws, rebuilt from the realized thresholds -------------------------------


def thresholds(mech: OneBitMean) -> list[int]:
    """T(0..s) as Python ints, checked to be the documented exact line."""
    table = [int(t) for t in mech.bit_thresholds]
    low, steps = table[0], mech.grid_steps
    assert (N - 2 * low) % steps == 0
    assert table == [low + g * (N - 2 * low) // steps for g in range(steps + 1)]
    assert table[-1] == N - low
    return table


def sent_law(mech: OneBitMean, table: list[int], g: int) -> Fraction:
    """P(report 1 | grid point g): the memoized bit (T(g) / 2^53) flipped w.p. F / 2^53."""
    flip = mech.flip_threshold
    return Fraction(flip * N + (N - 2 * flip) * table[g], N * N)


def exact_plus(mech: OneBitMean, values: np.ndarray) -> list[Fraction]:
    """P(report 1 | x): grid point k w.p. 1 - T_up / 2^53, k + 1 w.p. T_up / 2^53."""
    table = thresholds(mech)
    below, up = mech.grid_rounding(values)
    out = []
    for k, u in zip(below.tolist(), up.tolist(), strict=True):
        law = sent_law(mech, table, k) * Fraction(N - u, N)
        if u:
            law += sent_law(mech, table, k + 1) * Fraction(u, N)
        out.append(law)
    return out


def worst_ratio(ones: list[Fraction]) -> Fraction:
    """max over the report's two values of max_x P / min_x P."""
    return max(max(ones) / min(ones), (1 - min(ones)) / (1 - max(ones)))


def log_ratio(ratio: Fraction) -> Decimal:
    with localcontext(Context(prec=60)):
        return Decimal(ratio.numerator).ln() - Decimal(ratio.denominator).ln()


def assert_tight(ratio: Fraction, epsilon: float, slack: float = 1e-9) -> None:
    """ln(ratio) <= epsilon (the double's exact value) and within ``slack`` of it."""
    gap = Decimal(epsilon) - log_ratio(ratio)
    assert gap >= 0, f"ratio exceeds e^{epsilon} by {-gap:.3e} in the exponent"
    assert gap <= Decimal(slack), f"ratio is e^({epsilon} - {gap:.3e}): not tight"


#: (epsilon, flip probability, grid steps): small and large epsilon, odd and even grids.
PRIVACY_CASES = [
    (0.01, 0.3, 5),
    (0.5, None, 8),
    (1.0, 0.1, 8),
    (2.0, 0.25, 3),
    (5.0, 0.0, 1),
    (8.0, None, 8),
    (8.0, 0.4, 16),
    (12.0, 0.05, 64),
]


@pytest.mark.parametrize(("epsilon", "flip", "steps"), PRIVACY_CASES)
def test_one_report_reveals_exactly_epsilon_report(
    epsilon: float, flip: float | None, steps: int
) -> None:
    mech = build(epsilon, flip, steps)
    report_epsilon = onebitmean_epsilon_report(epsilon, flip or 0.0)
    assert mech.epsilon_report == report_epsilon and mech.epsilon_lifetime == epsilon
    assert mech.flip_threshold >= (flip or 0.0) * N
    inputs = grid_inputs(mech)
    ones = exact_plus(mech, inputs)
    assert_tight(worst_ratio(ones), report_epsilon)
    # The float matrix is this law, correctly rounded but for a few ulps.
    matrix = mech.transition_matrix(inputs)
    np.testing.assert_allclose(matrix[:, 1], [float(p) for p in ones], rtol=1e-14, atol=0)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-15)
    ratio = float((matrix.max(axis=0) / matrix.min(axis=0)).max())
    assert ratio == pytest.approx(math.exp(report_epsilon), rel=1e-9)


@pytest.mark.parametrize(("epsilon", "flip", "steps"), PRIVACY_CASES)
def test_memoized_bit_reveals_exactly_epsilon(
    epsilon: float, flip: float | None, steps: int
) -> None:
    mech = build(epsilon, flip, steps)
    table = thresholds(mech)
    ones = [Fraction(t, N) for t in table]
    assert_tight(worst_ratio(ones), epsilon)
    matrix = mech.permanent_matrix()
    assert matrix.shape == (steps + 1, 2)
    np.testing.assert_array_equal(matrix[:, 1], [float(p) for p in ones])
    np.testing.assert_array_equal(matrix.sum(axis=1), 1.0)
    if flip:  # output perturbation: one report reveals strictly less than the memoized bit
        assert mech.epsilon_report < epsilon


def test_a_huge_grid_at_epsilon_20_stays_within_the_documented_slack() -> None:
    """Making 2^53 - 2 T_lo divisible by s = 65536 costs at most (s + 2)(e^eps + 1) 2^-52 of
    the ratio; the one report (with a flip) stays tight."""
    epsilon, steps = 20.0, 65536
    mech = build(epsilon, 0.1, steps)
    slack = (steps + 2) * (math.exp(epsilon) + 1) * 2.0**-52
    assert_tight(worst_ratio([Fraction(t, N) for t in thresholds(mech)]), epsilon, slack)
    ends = np.array([mech.lower, mech.upper])
    assert_tight(worst_ratio(exact_plus(mech, ends)), mech.epsilon_report)


@pytest.mark.parametrize(("epsilon", "flip", "steps"), PRIVACY_CASES)
def test_report_law_is_exactly_linear_in_the_grid_position(
    epsilon: float, flip: float | None, steps: int
) -> None:
    """P(1 | x) = q' + (p' - q') E[g] / s with p' = 1 - q' exactly, so the debiased report's
    mean lower + (upper - lower)(P - q') / (p' - q') is exactly lower + w E[g]."""
    mech = build(epsilon, flip, steps)
    inputs = grid_inputs(mech)
    below, up = mech.grid_rounding(inputs)
    low = mech.lowest_report
    assert exact_plus(mech, np.array([mech.lower]))[0] == low
    assert exact_plus(mech, np.array([mech.upper]))[0] == 1 - low
    width = Fraction(mech.upper) - Fraction(mech.lower)
    for law, k, u in zip(exact_plus(mech, inputs), below.tolist(), up.tolist(), strict=True):
        position = k + Fraction(u, N)
        assert law == low + (1 - 2 * low) * position / steps
        mean = Fraction(mech.lower) + width * (law - low) / (1 - 2 * low)
        assert mean == Fraction(mech.lower) + width * position / steps
    assert mech.scale == pytest.approx(float(1 / (1 - 2 * low)), rel=1e-15)


@pytest.mark.parametrize(("lower", "upper", "steps"), [(0.0, 1.0, 8), (LOWER, UPPER, 5)])
def test_alpha_rounding_is_unbiased_exactly(lower: float, upper: float, steps: int) -> None:
    """E[g] = k + floor(phi 2^53) / 2^53 is within 2^-53 of t = s (x - lower)/(upper - lower)
    plus t's floating-point error (at most 8 s 2^-53 here, a few roundings of numbers
    below 2 s); exactly g at the grid points of a dyadic range. And debias(E[b]) = x."""
    mech = build(1.0, 0.2, steps, lower, upper)
    inputs = np.concatenate([grid_inputs(mech), rng_for("alpha").uniform(lower, upper, 500)])
    below, up = mech.grid_rounding(inputs)
    assert np.all((0 <= below) & (below <= steps)) and np.all(up[below == steps] == 0)
    width = Fraction(upper) - Fraction(lower)
    for x, k, u in zip(inputs.tolist(), below.tolist(), up.tolist(), strict=True):
        clipped = min(max(Fraction(x), Fraction(lower)), Fraction(upper))
        t = steps * (clipped - Fraction(lower)) / width
        assert abs(k + Fraction(u, N) - t) <= Fraction(8 * steps + 1, N)
    if (lower, upper) == (0.0, 1.0):
        points = np.arange(steps + 1) / steps
        below, up = mech.grid_rounding(points)
        assert below.tolist() == list(range(steps + 1)) and not up.any()
    mean = mech.debias(np.zeros(inputs.size)) + mech.scale * (upper - lower) * (
        mech.plus_probability(inputs)
    )
    np.testing.assert_allclose(mean, np.clip(inputs, lower, upper), rtol=0, atol=1e-12 * upper)


def test_alpha_rounding_is_unbiased_statistically() -> None:
    """Over 200,000 devices, the keys of one fractional value are k + Bin(1, T_up / 2^53):
    their mean is t within z(1e-6) standard errors sqrt(phi (1 - phi) / n)."""
    mech = build(1.0, None, 8, 0.0, 8.0)
    n, x = 200_000, 3.3
    keys = mech.memo_keys(np.full(n, x), SimulatedMemo(np.arange(n), seed=5))
    assert set(np.unique(keys).tolist()) == {3, 4}
    phi = 0.3
    assert abs(keys.mean() - 3.3) <= Z * math.sqrt(phi * (1 - phi) / n)


# --- the samplers --------------------------------------------------------------------


SAMPLES = 200_000


def assert_fits(observed: np.ndarray, probabilities: np.ndarray) -> None:
    """Pearson chi-square of counts against exact cell probabilities (every cell expects
    at least 100 here), rejecting at p < ALPHA."""
    expected = observed.sum() * probabilities / probabilities.sum()
    assert expected.min() >= 100
    pvalue = stats.chisquare(observed, expected).pvalue
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.3g}: {observed} vs {expected}"


def memo_cases() -> list[Any]:
    return [
        pytest.param(None, id="fresh"),
        pytest.param(lambda n: SimulatedMemo(np.arange(n) * 7 + 3, seed=17), id="devices"),
    ]


@pytest.mark.parametrize("memo", memo_cases())
@pytest.mark.parametrize(("epsilon", "flip"), [(1.0, None), (0.5, 0.3), (4.0, 0.1)])
@pytest.mark.parametrize("fraction", [0.0, 0.4, 0.6180339887, 1.0, 1.5])
def test_reports_follow_the_transition_matrix(
    memo: Any, epsilon: float, flip: float | None, fraction: float
) -> None:
    mech = build(epsilon, flip, 5)
    value = LOWER + fraction * (UPPER - LOWER)  # 1.5: clipped to upper
    row = mech.transition_matrix(np.array([value]))[0]
    label = f"reports-{epsilon}-{flip}-{fraction}-{memo is None}"
    reports = mech.encode(
        np.full(SAMPLES, value),
        rng=rng_for(label),
        context=DeviceContext(memo=None if memo is None else memo(SAMPLES)),
    )
    assert reports.dtype == np.int8
    assert_fits(np.bincount(reports, minlength=2), row)


@pytest.mark.parametrize("memo", memo_cases())
@pytest.mark.parametrize("value", [0.5, 0.55])
def test_memoized_bits_follow_the_permanent_matrix(memo: Any, value: float) -> None:
    """Joint law of (key, memoized bit) on [0, 1] with 4 steps: 0.5 is grid point 2, 0.55
    rounds to 2 or 3 by the rounding law, then the bit follows the key's row of
    ``permanent_matrix``. Fresh draws (no memo) give the keys' and the bits' marginals."""
    mech = build(1.0, 0.2, 4, 0.0, 1.0)
    (below,), (up,) = mech.grid_rounding(np.array([value]))
    assert below == 2 and (up == 0) == (value == 0.5)
    rounding = np.array([N - int(up), int(up)], dtype=np.float64) / N
    matrix = mech.permanent_matrix()
    values = np.full(SAMPLES, value)
    if memo is None:
        keys = mech.memo_keys(values, None)
        bits = mech.permanent(values, None)  # fresh draws: each call its own offsets
        assert_fits(np.bincount(bits, minlength=2), rounding @ matrix[2:4])
    else:
        memo_object = memo(SAMPLES)
        keys = mech.memo_keys(values, memo_object)
        bits = mech.permanent(values, memo_object)
        if up:
            joint = np.concatenate([rounding[0] * matrix[2], rounding[1] * matrix[3]])
            assert_fits(np.bincount(2 * (keys - 2) + bits, minlength=4), joint)
        else:
            assert_fits(np.bincount(bits, minlength=2), matrix[2])
    if up:
        assert_fits(np.bincount(keys - 2, minlength=2), rounding)
    else:
        assert np.all(keys == 2)


def reference_words(secret: bytes, purpose: bytes, key: int) -> int:
    """Word 0 of a memo stream, as ``shared.memo`` specifies it, written out here."""
    message = (
        b"LDP memo v1\x00"
        + len(SCOPE).to_bytes(2, "big")
        + SCOPE
        + len(purpose).to_bytes(2, "big")
        + purpose
        + key.to_bytes(8, "big")
    )
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return int.from_bytes(hashlib.shake_256(digest).digest(8), "little")


def test_memo_draws_are_the_documented_words() -> None:
    """What a client in another language computes from the module docstring: U from word 0
    of b"onebitmean alpha" (key 0), g = k + [U < floor(phi 2^53)], the bit from word 0 of
    b"onebitmean bit" keyed by g, compared with T(g)."""
    mech = build(2.0, 0.1, 8)
    values = np.linspace(LOWER - 1, UPPER + 1, 301)
    keys = mech.memo_keys(values, KeyedMemo(SECRET, SCOPE, values.size))
    bits = mech.permanent(values, KeyedMemo(SECRET, SCOPE, values.size))
    offset = reference_words(SECRET, b"onebitmean alpha", 0) >> 11
    half = (UPPER - LOWER) / 2
    for x, key, bit in zip(values.tolist(), keys.tolist(), bits.tolist(), strict=True):
        t = (min(max((min(max(x, LOWER), UPPER) - LOWER) / half - 1, -1.0), 1.0) + 1) * 4.0
        k = min(math.floor(t), 8)
        g = k + (offset < math.floor((t - k) * N))
        assert key == g
        word = reference_words(SECRET, b"onebitmean bit", g) >> 11
        assert bit == (word < int(mech.bit_thresholds[g]))


# --- memoization ---------------------------------------------------------------------


def test_keyed_memo_is_stable_across_restarts() -> None:
    """One device (one secret): new memo objects (a restart) give the same keys, bits and,
    without flips, reports; the order of the values does not matter; alpha-point rounding
    with one offset keeps the keys in the order of the values."""
    mech = build(1.0, None, 8)
    values = rng_for("restart").uniform(LOWER - 2, UPPER + 2, 200)
    size = values.size
    keys = mech.memo_keys(values, KeyedMemo(SECRET, SCOPE, size))
    bits = mech.permanent(values, KeyedMemo(SECRET, SCOPE, size))
    for _ in range(3):
        assert np.array_equal(mech.memo_keys(values, KeyedMemo(SECRET, SCOPE, size)), keys)
        assert np.array_equal(mech.permanent(values, KeyedMemo(SECRET, SCOPE, size)), bits)
        assert np.array_equal(
            mech.encode(values, context=DeviceContext(memo=KeyedMemo(SECRET, SCOPE, size))), bits
        )
    order = np.argsort(values)
    assert np.all(np.diff(keys[order]) >= 0)
    shuffled = rng_for("shuffle").permutation(size)
    again = mech.permanent(values[shuffled], KeyedMemo(SECRET, SCOPE, size))
    assert np.array_equal(again, bits[shuffled])
    # Rows that round to the same grid point share one memoized bit.
    for key in np.unique(keys):
        assert np.unique(bits[keys == key]).size == 1
    # Another metric version (scope) is another memo.
    other = KeyedMemo(SECRET, memo_scope("session.minutes", 3), size)
    assert not np.array_equal(mech.memo_keys(values, other), keys)


def test_different_secrets_give_independent_memos() -> None:
    """4,000 devices, two secrets each: the memoized bits of one value (t = 2.5, the key
    2 or 3 by the offset) under the two secrets are independent (2 x 2 contingency
    chi-square), and so are the offsets' rounding decisions; each marginal has its law."""
    mech = build(1.0, None, 5)
    devices = 4000
    value = LOWER + 0.5 * (UPPER - LOWER)
    first = [hashlib.sha256(b"a" + i.to_bytes(4, "big")).digest() for i in range(devices)]
    second = [hashlib.sha256(b"b" + i.to_bytes(4, "big")).digest() for i in range(devices)]
    values = np.full(devices, value)
    memos = (KeyedMemo(first, SCOPE), KeyedMemo(second, SCOPE))
    keys = [mech.memo_keys(values, memo) for memo in memos]
    bits = [mech.permanent(values, memo) for memo in memos]
    for pair in (keys, bits):
        table = np.zeros((2, 2))
        np.add.at(table, (pair[0] - pair[0].min(), pair[1] - pair[1].min()), 1)
        assert stats.chi2_contingency(table, correction=False).pvalue > ALPHA
    (up,) = mech.grid_rounding(values[:1])[1]
    rounding = np.array([N - int(up), int(up)]) / N
    assert_fits(np.bincount(keys[0] - 2, minlength=2), rounding)
    law = rounding @ mech.permanent_matrix()[2:4]
    assert_fits(np.bincount(bits[1], minlength=2), law)


def test_simulated_devices_keep_their_memo_wherever_they_appear() -> None:
    mech = build(1.0, None, 8)
    values = np.array([2.0, 2.0, 7.3, 2.0, 7.3])
    devices = np.array([7, 7, 3, 7, 3])
    bits = mech.permanent(values, SimulatedMemo(devices, seed=9))
    keys = mech.memo_keys(values, SimulatedMemo(devices, seed=9))
    assert bits[0] == bits[1] == bits[3] and bits[2] == bits[4]
    moved = mech.permanent(values[::-1], SimulatedMemo(devices[::-1], seed=9))
    assert np.array_equal(moved, bits[::-1])
    assert np.array_equal(mech.memo_keys(values, SimulatedMemo(devices, seed=9)), keys)


def test_a_constant_value_keeps_one_memo_key_for_a_year() -> None:
    """365 daily reports, each from a new memo object (a restart): one key for life; a value
    wandering inside one cell uses at most its two grid points, and changes no report
    between days that round alike (flip 0)."""
    mech = build(1.0, None, 8, 0.0, 8.0)
    keys = {int(mech.memo_keys(np.array([3.7]), KeyedMemo(SECRET, SCOPE))[0]) for _ in range(365)}
    assert len(keys) == 1
    wandering = rng_for("wander").uniform(3.0, 4.0, 365)
    daily = mech.memo_keys(wandering, KeyedMemo(SECRET, SCOPE, wandering.size))
    assert set(daily.tolist()) <= {3, 4}
    reports = mech.encode(
        wandering,
        rng_for("year"),
        context=DeviceContext(memo=KeyedMemo(SECRET, SCOPE, wandering.size)),
    )
    for key in np.unique(daily):
        assert np.unique(reports[daily == key]).size == 1


@pytest.mark.parametrize("device", range(4))
def test_a_devices_reports_average_to_its_memoized_bit_not_its_value(device: int) -> None:
    """4,000 periods of one device holding x = lower + 0.3 (upper - lower), flip 0.25.
    Memoized: E[b] = f + (1 - 2f) bit, so the debiased mean converges to lower + w_b with
    w_1 = (upper - lower) p0 / (p0 - q0) > upper or w_0 < lower: never to x. Stateless
    (memo=None, the offset and bit redrawn each period): it converges to x, the leak."""
    mech = build(1.0, 0.25, 8)
    periods = 4000
    x = LOWER + 0.3 * (UPPER - LOWER)
    values = np.full(periods, x)
    memo = SimulatedMemo(np.full(periods, device), seed=21)
    bit = int(mech.permanent(values[:1], SimulatedMemo([device], seed=21))[0])
    flip = mech.flip_threshold / N
    reports = mech.encode(values, rng_for(f"leak-{device}"), context=DeviceContext(memo=memo))
    mean = float(mech.debias(reports).mean())
    low = float(mech.lowest_report)
    width = UPPER - LOWER
    target = LOWER + width * (flip + (1 - 2 * flip) * bit - low) / (1 - 2 * low)
    spread = width * math.sqrt(flip * (1 - flip)) / (1 - 2 * low)
    assert abs(mean - target) <= Z * spread / math.sqrt(periods)
    assert not LOWER <= mean <= UPPER
    stateless = mech.debias(mech.encode(values, rng_for(f"stateless-{device}")))
    sd = math.sqrt(float(mech.report_variance(np.array([x]))[0]) / periods)
    assert abs(float(stateless.mean()) - x) <= Z * sd


# --- the estimator -------------------------------------------------------------------


#: A fixed population: values off and on the grid, and clipped ones.
LEVELS = np.array([-5.0, -3.7, 0.2, 2.35, 4.0, 7.45, 9.9, 11.2, 14.0])
COUNTS = np.array([300, 250, 700, 900, 800, 1000, 600, 300, 150])


def variance_of_mean(
    mech: OneBitMean, levels: np.ndarray, counts: np.ndarray
) -> tuple[float, float]:
    """(Var, kappa) of the mean of one period's debiased reports: sum m2 / n^2 and the
    excess kurtosis sum k4 / (sum m2)^2 (k4 = m4 - 3 m2^2, exact two-point moments)."""
    n = counts.sum()
    m2, _, m4 = mech.report_central_moments(levels).T
    total = counts @ m2
    return float(total / n**2), float((counts @ (m4 - 3 * m2**2)) / total**2)


def assert_unbiased_with_variance(
    means: np.ndarray, truth: float, variance: float, kappa: float
) -> None:
    """Mean of R estimates within Z sd / sqrt(R) of the truth; their sample variance within
    Z sqrt(Var[s^2]) of the formula, Var[s^2] = sigma^4 (2 / (R - 1) + kappa / R)."""
    runs = means.size
    assert abs(means.mean() - truth) <= Z * math.sqrt(variance / runs)
    spread = variance * math.sqrt(2 / (runs - 1) + kappa / runs)
    assert abs(means.var(ddof=1) - variance) <= Z * spread, (means.var(ddof=1), variance)


@pytest.mark.parametrize(
    ("epsilon", "flip", "steps"), [(1.0, None, 8), (2.0, 0.3, 8), (0.5, 0.1, 5)]
)
def test_fast_path_is_unbiased_with_the_formula_variance(
    epsilon: float, flip: float | None, steps: int
) -> None:
    mech = build(epsilon, flip, steps)
    rng = rng_for(f"fast-{epsilon}-{flip}")
    runs = 4000
    means = np.array(
        [mech.estimate(mech.simulate_statistics(LEVELS, COUNTS, rng)).mean for _ in range(runs)]
    )
    truth = float(COUNTS @ np.clip(LEVELS, LOWER, UPPER) / COUNTS.sum())
    variance, kappa = variance_of_mean(mech, LEVELS, COUNTS)
    assert variance == pytest.approx(
        COUNTS @ mech.report_variance(LEVELS) / COUNTS.sum() ** 2, rel=1e-9
    )
    assert_unbiased_with_variance(means, truth, variance, kappa)


def test_report_variance_is_duchis_at_epsilon_report() -> None:
    """Var[y | x] = h^2 (C^2 - t^2), C = (e^eps_r + 1) / (e^eps_r - 1) (to 1e-12: realized),
    and with flips C grows by 1 / (1 - 2 gamma): the worst case by 1 / (1 - 2 gamma)^2."""
    x = np.linspace(LOWER - 1, UPPER + 1, 1001)
    base = build(2.0).variance(1)
    for flip in (None, 0.1, 0.3):
        mech = build(2.0, flip)
        duchi = DuchiMean(
            MechanismSpec(mechanism="duchi", epsilon=mech.epsilon_report, lower=LOWER, upper=UPPER)
        )
        np.testing.assert_allclose(mech.report_variance(x), duchi.report_variance(x), rtol=1e-12)
        gamma = flip or 0.0
        assert mech.variance(1) == pytest.approx(base / (1 - 2 * gamma) ** 2, rel=1e-12)
        assert mech.variance(10) == pytest.approx(mech.variance(1) / 10, rel=1e-15)


@pytest.mark.parametrize("flip", [None, 0.2])
@pytest.mark.slow
def test_periods_are_unbiased_with_devices_memoized_across_them(flip: float | None) -> None:
    """R = 1,000 independent populations of n = 1,000 devices, each reporting 3 periods
    through encode + aggregate with its memo kept across periods; values drift (a tenth of
    the devices move each period). Each period's estimate is unbiased with the formula
    variance. Periods of the same devices are correlated through the memo (Fisher z > Z),
    stateless reports of the same devices are not (|Fisher z| <= Z)."""
    mech = build(1.0, flip, 8)
    rng = rng_for(f"periods-{flip}")
    runs, n, periods = 1000, 1000, 3
    values = [rng.choice(LEVELS, size=n, p=COUNTS / COUNTS.sum())]
    for _ in range(periods - 1):
        moved = rng.random(n) < 0.1
        values.append(np.where(moved, values[-1] + rng.normal(0, 2.0, n), values[-1]))
    devices = np.arange(runs * n)
    estimates: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for period, period_values in enumerate(values):
        batch = np.tile(period_values, runs)
        for memoized in (True, False):
            memo = SimulatedMemo(devices, seed=33) if memoized else None
            reports = mech.encode(
                batch,
                rng_for(f"period-{flip}-{period}-{memoized}"),
                context=DeviceContext(memo=memo),
            )
            estimates[memoized].append(
                np.array(
                    [
                        mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])).mean
                        for r in range(runs)
                    ]
                )
            )
        truth = float(np.clip(period_values, LOWER, UPPER).mean())
        variance, kappa = variance_of_mean(mech, period_values, np.ones(n, dtype=np.int64))
        assert_unbiased_with_variance(estimates[True][period], truth, variance, kappa)
    for memoized, series in estimates.items():
        fisher = math.atanh(np.corrcoef(series[0], series[1])[0, 1]) * math.sqrt(runs - 3)
        assert (fisher > Z) if memoized else (abs(fisher) <= Z), (memoized, fisher)


COVERAGE_LEVELS = np.array([0.0, 0.7, 2.35, 5.0, 6.1, 9.42, 10.0, 12.0])
COVERAGE_SHARES = np.array([0.1, 0.15, 0.2, 0.15, 0.15, 0.1, 0.1, 0.05])


@pytest.mark.parametrize(("epsilon", "flip"), [(0.5, None), (2.0, None), (8.0, None), (2.0, 0.25)])
@pytest.mark.slow
def test_intervals_cover(epsilon: float, flip: float | None) -> None:
    """4,000 runs of 20,000 users drawn from a fixed population (exact fast path): ``ci``
    covers the users' own clipped mean at least 95% of the time (``std`` is Duchi's upper
    bound: one-sided exact binomial, 1e-6), ``ci(population=True)`` the population mean at
    95% (two-sided exact binomial interval, 1e-6)."""
    mech = build(epsilon, flip, None, 0.0, 10.0)
    rng = rng_for(f"coverage-{epsilon}-{flip}")
    runs, users, level = 4000, 20_000, 0.95
    clipped = np.clip(COVERAGE_LEVELS, 0.0, 10.0)
    population_mean = float(COVERAGE_SHARES @ clipped)
    own = population = 0
    for _ in range(runs):
        counts = rng.multinomial(users, COVERAGE_SHARES)
        estimate = mech.estimate(mech.simulate_statistics(COVERAGE_LEVELS, counts, rng))
        assert estimate.std_method == "upper-bound"
        low, high = estimate.ci(level)
        own += low <= float(counts @ clipped) / users <= high
        low, high = estimate.ci(level, population=True)
        population += low <= population_mean <= high
    assert own >= stats.binom.ppf(ALPHA, runs, level), own
    lowest, highest = (
        stats.binom.ppf(ALPHA / 2, runs, level),
        stats.binom.isf(ALPHA / 2, runs, level),
    )
    assert lowest <= population <= highest, population


def test_intervals_cover_through_memoized_encode() -> None:
    """The users' interval at epsilon 8 with every report encoded from device memos:
    at least 95% of 500 runs of 2,000 devices (one-sided exact binomial, 1e-6)."""
    mech = build(8.0, 0.1, None, 0.0, 10.0)
    runs, n = 500, 2000
    values = np.repeat(COVERAGE_LEVELS, np.round(COVERAGE_SHARES * n).astype(np.int64))
    truth = float(np.clip(values, 0.0, 10.0).mean())
    memo = SimulatedMemo(np.arange(runs * n), seed=41)
    reports = mech.encode(
        np.tile(values, runs), rng_for("encode-coverage"), context=DeviceContext(memo=memo)
    )
    covered = 0
    for r in range(runs):
        low, high = mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])).ci(0.95)
        covered += low <= truth <= high
    assert covered >= stats.binom.ppf(ALPHA, runs, 0.95), covered


# --- wire form, input checks and the spec ----------------------------------------------


def test_payloads_round_trip() -> None:
    mech = build(1.0, 0.1)
    reports = mech.encode(np.linspace(LOWER, UPPER, 50), rng_for("wire"))
    payloads = mech.to_payloads(reports)
    assert {tuple(p) for p in payloads} == {("value",)}
    assert {p["value"] for p in payloads} == {0, 1}
    assert np.array_equal(mech.from_payloads(payloads), reports)
    assert mech.from_payloads(payloads).dtype == np.int8


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"value": 2}, "report 1: the bit must be 0 or 1, got 2"),
        ({"value": -1}, "report 1: the bit must be 0 or 1"),
        ({"value": True}, "report 1: payload needs an integer 'value'"),
        ({"value": "1"}, "report 1: payload needs an integer 'value'"),
        ({"value": 1.0}, "report 1: payload needs an integer 'value'"),
        ({"bits": "AA=="}, "report 1: payload needs an integer 'value'"),
        ("1", "report 1: payload needs an integer 'value'"),
    ],
)
def test_bad_payloads_are_refused(payload: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(1.0).from_payloads([{"value": 1}, payload])


def test_bad_reports_and_values_are_refused() -> None:
    mech = build(1.0)
    with pytest.raises(ValueError, match="1-d array of bits"):
        mech.aggregate(np.zeros((2, 2), dtype=np.int8))
    with pytest.raises(ValueError, match="report 2: the bit must be 0 or 1, got 0.5"):
        mech.aggregate(np.array([0, 1, 0.5]))
    with pytest.raises(ValueError, match="position 1 is NaN"):
        mech.encode(np.array([1.0, math.nan]))
    with pytest.raises(ValueError, match="one-dimensional"):
        mech.encode(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="the memo has 3 rows for 2 values"):
        mech.encode(
            np.array([1.0, 2.0]), context=DeviceContext(memo=SimulatedMemo(np.arange(3), seed=1))
        )
    with pytest.raises(TypeError, match="not one 53-bit threshold"):
        mech.plus_thresholds(np.array([1.0]))
    with pytest.raises(ValueError, match="needs a 'onebitmean' spec"):
        OneBitMean(MechanismSpec(mechanism="duchi", epsilon=1.0, lower=0.0, upper=1.0))


def test_secure_default_encodes_one_value() -> None:
    mech = build(1.0, 0.1)
    report = mech.encode(np.array([2.0]))
    assert report.shape == (1,) and report[0] in (0, 1)
    assert mech.permanent(np.array([2.0])).dtype == np.int8


def test_spec_fills_in_epsilon_report_and_defaults() -> None:
    spec = MechanismSpec(mechanism="onebitmean", epsilon=2.0, lower=0.0, upper=1.0)
    assert spec.epsilon_report == onebitmean_epsilon_report(2.0, 0.0)
    mech = OneBitMean(spec)
    assert mech.grid_steps == DEFAULT_GRID_STEPS == 8 and mech.flip_threshold == 0
    flipped = MechanismSpec(
        mechanism="onebitmean", epsilon=2.0, lower=0.0, upper=1.0, flip_probability=0.2
    )
    grown = math.exp(2.0)
    assert flipped.epsilon_report == pytest.approx(
        math.log((0.8 * grown + 0.2) / (0.2 * grown + 0.8))
    )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"epsilon_report": 0.5}, "epsilon_report"),
        ({"flip_probability": 0.5}, "flip_probability"),
        ({"flip_probability": -0.1}, "flip_probability"),
        ({"flip_probability": 0.49999999}, "flip_probability"),
        ({"grid_steps": 0}, "grid_steps"),
        ({"upper": None}, "upper"),
        ({"domain_size": 4}, "domain_size"),
        ({"bits_per_device": 2}, "bits_per_device"),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = {"mechanism": "onebitmean", "epsilon": 1.0, "lower": 0.0, "upper": 1.0}
    with pytest.raises(ValidationError, match=field):
        MechanismSpec.model_validate({**base, **fields})


def test_flip_probability_belongs_to_onebitmean() -> None:
    with pytest.raises(ValidationError, match="flip_probability does not apply"):
        MechanismSpec(mechanism="duchi", epsilon=1.0, lower=0.0, upper=1.0, flip_probability=0.1)
