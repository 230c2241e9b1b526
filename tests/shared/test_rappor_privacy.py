"""RAPPOR's two guarantees, checked by exact enumeration (no sampling; only rounding slack).

test_privacy.py runs the registry-wide check on RAPPOR (one report, every pair of Bloom
filters, tight at epsilon_one for k >= 2h). Here:

* epsilon_one and epsilon_infinity against the paper's formulas computed independently, and
  the figures of the reference implementation's (google/rappor) regression tests;
* the permanent response alone: the largest likelihood ratio over every pair of Bloom
  filters is exactly e^epsilon_infinity (tight for k >= 2h);
* any number of reports of one value (memoized PRR, fresh IRRs): the joint distribution
  of r reports, enumerated for r = 1..5, never exceeds e^epsilon_infinity, grows with r
  towards it, and for r = 1 equals e^epsilon_one;
* k < 2h: epsilon_one is still a bound, no longer tight.
"""

from __future__ import annotations

import itertools
import math
from decimal import Context, Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor, rappor_epsilon_infinity, rappor_epsilon_one
from shared.schemas import MechanismSpec

#: Relative slack for float rounding in products of a few dozen probabilities (~1e-14).
RTOL = 1e-12


def rappor(k: int, h: int, f: float, p: float, q: float) -> Rappor:
    mech = make_mechanism(
        MechanismSpec(mechanism="rappor", num_bits=k, num_hashes=h, num_cohorts=1, f=f, p=p, q=q)
    )
    assert isinstance(mech, Rappor)
    return mech


def max_ratio(matrix: np.ndarray) -> float:
    assert np.all(matrix > 0)
    return float((matrix.max(axis=0) / matrix.min(axis=0)).max())


def paper_epsilons(h: int, f: float, p: float, q: float) -> tuple[float, float]:
    """Erlingsson et al. (CCS 2014), Section 3, written out independently of the library."""
    q_star = 0.5 * f * (p + q) + (1 - f) * q
    p_star = 0.5 * f * (p + q) + (1 - f) * p
    one = h * math.log((q_star * (1 - p_star)) / (p_star * (1 - q_star)))
    infinity = 2 * h * math.log((1 - 0.5 * f) / (0.5 * f)) if f > 0 else math.inf
    return one, infinity


PARAMETERS = [
    (2, 1, 0.5, 0.25, 0.75),
    (4, 2, 0.5, 0.25, 0.75),
    (6, 3, 0.25, 0.1, 0.8),
    (8, 2, 0.45, 0.39, 0.61),
    (6, 2, 0.5, 0.5, 0.75),
    (4, 1, 0.9, 0.0, 1.0),
]


@pytest.mark.parametrize(("k", "h", "f", "p", "q"), PARAMETERS)
def test_epsilons_are_the_paper_formulas(k: int, h: int, f: float, p: float, q: float) -> None:
    mech = rappor(k, h, f, p, q)
    one, infinity = paper_epsilons(h, f, p, q)
    assert mech.epsilon_one == pytest.approx(one, rel=1e-12)
    assert mech.epsilon_infinity == pytest.approx(infinity, rel=1e-12)
    assert mech.epsilon == mech.epsilon_one == mech.spec.epsilon
    assert mech.p_star == pytest.approx(0.5 * f * (p + q) + (1 - f) * p, rel=1e-12)
    assert mech.q_star == pytest.approx(0.5 * f * (p + q) + (1 - f) * q, rel=1e-12)


def test_reference_regression_test_figures() -> None:
    """tests/regtest_spec.py: (p, q, f) = (0.39, 0.61, 0.45), h = 2 "eps_1 = 1, eps_inf = 5"
    (rounded: 0.973 and 4.947); Chrome's (0.25, 0.75, 0.5) with h = 1: eps_inf = 2 ln 3."""
    assert rappor_epsilon_one(2, 0.45, 0.39, 0.61) == pytest.approx(0.97277, abs=5e-6)
    assert rappor_epsilon_infinity(2, 0.45) == pytest.approx(4.94705, abs=5e-6)
    assert rappor_epsilon_infinity(1, 0.5) == pytest.approx(2 * math.log(3), rel=1e-12)
    assert rappor_epsilon_infinity(3, 0.0) == math.inf


@pytest.mark.parametrize(("k", "h", "f", "p", "q"), [c for c in PARAMETERS if c[2] > 0])
def test_permanent_response_alone_is_exactly_epsilon_infinity(
    k: int, h: int, f: float, p: float, q: float
) -> None:
    mech = rappor(k, h, f, p, q)
    matrix = mech.prr_matrix()
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12)
    ratio = max_ratio(matrix)
    bound = math.exp(mech.epsilon_infinity)
    assert bound * (1 - RTOL) <= ratio <= bound * (1 + RTOL)


def joint_reports(mech: Rappor, reports: int) -> np.ndarray:
    """Exact P[r reports | Bloom filter] with one memoized PRR and r fresh IRRs.

    P(y_1..y_r | B) = sum_PRR P(PRR | B) prod_t P(y_t | PRR); columns enumerate the
    (2^k)^r report tuples.
    """
    k = mech.num_bits
    _, p, q = mech.realized_probabilities
    outputs = (np.arange(2**k)[:, None] >> np.arange(k)) & 1  # (2^k, k)
    prr_states = outputs
    one_prob = np.where(prr_states == 1, q, p)  # (PRR, k)
    irr = np.prod(
        np.where(outputs[None, :, :] == 1, one_prob[:, None, :], 1 - one_prob[:, None, :]), axis=2
    )  # (PRR, y): P(y | PRR)
    joint = np.ones((prr_states.shape[0], 1))
    for _ in range(reports):
        joint = (joint[:, :, None] * irr[:, None, :]).reshape(prr_states.shape[0], -1)
    return mech.prr_matrix() @ joint  # (Bloom filters, (2^k)^r)


@pytest.mark.parametrize(
    ("k", "h", "f", "p", "q"), [(2, 1, 0.5, 0.25, 0.75), (3, 1, 0.3, 0.2, 0.9)]
)
def test_many_reports_of_one_value_stay_within_epsilon_infinity(
    k: int, h: int, f: float, p: float, q: float
) -> None:
    mech = rappor(k, h, f, p, q)
    ratios = []
    for reports in range(1, 6 if k == 2 else 4):
        matrix = joint_reports(mech, reports)
        np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12)
        ratios.append(max_ratio(matrix))
    assert ratios[0] == pytest.approx(math.exp(mech.epsilon_one), rel=RTOL)
    assert all(b >= a * (1 - RTOL) for a, b in itertools.pairwise(ratios))  # grows with r
    assert ratios[-1] > ratios[0]
    assert max(ratios) <= math.exp(mech.epsilon_infinity) * (1 + RTOL)


@pytest.mark.parametrize(("k", "h"), [(3, 2), (5, 3), (1, 1), (4, 4)])
def test_epsilon_one_bounds_but_is_not_tight_when_k_below_2h(k: int, h: int) -> None:
    """Two Bloom filters of h bits cannot be disjoint in k < 2h bits: a strict bound."""
    mech = rappor(k, h, 0.5, 0.25, 0.75)
    assert max_ratio(mech.transition_matrix()) < math.exp(mech.epsilon_one) * (1 - 1e-6)
    assert max_ratio(mech.prr_matrix()) < math.exp(mech.epsilon_infinity) * (1 - 1e-6)


def exact_log(ratio: Fraction) -> Decimal:
    """ln of an exact rational, to 60 digits (errors below 1e-55)."""
    with localcontext(Context(prec=60)):
        return Decimal(ratio.numerator).ln() - Decimal(ratio.denominator).ln()


@pytest.mark.parametrize(("k", "h", "f", "p", "q"), PARAMETERS)
def test_realized_thresholds_stay_within_the_reported_epsilons(
    k: int, h: int, f: float, p: float, q: float
) -> None:
    """From the thresholds (T_f, T_p, T_q) alone, in exact rationals: the PRR's
    2 h ln((N - T_f) / T_f) <= epsilon_infinity and one report's h ln(q* (1 - p*) /
    (p* (1 - q*))) <= epsilon_one, with q* = ((N - T_f) T_q + T_f T_p) / N^2 and
    p* = (T_f T_q + (N - T_f) T_p) / N^2. The logarithms are exact to 1e-55, so no
    excess from rounding thresholds the wrong way (about 1e-16 here) could hide."""
    mech = rappor(k, h, f, p, q)
    n = 2**53
    flip, p_threshold, q_threshold = mech.thresholds
    assert abs(flip - f / 2 * n) <= 64 and abs(p_threshold - p * n) <= 1
    assert abs(q_threshold - q * n) <= 1
    q_star = (n - flip) * q_threshold + flip * p_threshold
    p_star = flip * q_threshold + (n - flip) * p_threshold
    square = n * n
    one = exact_log(Fraction(q_star * (square - p_star), p_star * (square - q_star)) ** h)
    assert one <= Decimal(mech.epsilon_one) and one <= Decimal(mech.epsilon)
    if f > 0:
        assert exact_log(Fraction(n - flip, flip) ** (2 * h)) <= Decimal(mech.epsilon_infinity)
