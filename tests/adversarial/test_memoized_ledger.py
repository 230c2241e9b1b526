"""Attack: link a device's memoized RAPPOR reports and learn more than the ledger charged.

A RAPPOR device answers every report of one value from one memoized permanent
randomized response (PRR), so its reports are correlated and basic composition does
not hold: n reports can reveal more than n epsilon_one. A ledger charging epsilon_one
per report (and claiming that over-counts) under-charges. The defence
(``client/ledger.py``): epsilon_infinity once per distinct value for life. These tests
compute the exact joint law of several reports of one device and check:

* sequences with the same equality pattern (x_i = x_j iff x'_i = x'_j) lose at most
  epsilon_infinity per distinct value that differs, at most what the ledger charges
  (the transcript is a post-processing of one independent PRR per distinct value);
* pairs that change the pattern ((v, v) against (u, w)) exceed n epsilon_one (the old
  rule fails) and, at the demo's k = 32, even both sequences' charges together: the
  equality pattern is what memoization does not hide. What bounds them is the
  instantaneous response over the whole bit vector, n k ln(max(q/p, (1-p)/(1-q))).

Joint laws are exact: a small spec (k = 4, h = 1, the demo's f, p, q) enumerates every
PRR and every output of up to four reports; the demo spec (k = 32, h = 1) uses the
factorization over bit positions (with h = 1 the Bloom filter is one bit, PRR and IRR
flip bits independently, so given the values the reports' bits at position b depend
only on position b, and the largest log-ratio is the sum of each position's largest).
"""

from __future__ import annotations

import itertools
import math
import string
from pathlib import Path

import numpy as np
import pytest

from client.ledger import BudgetLimits, MemoizedCost, PrivacyLedger
from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec, MetricSpec
from shared.spec_hash import spec_hash

DEMO = {"num_hashes": 1, "num_cohorts": 64, "f": 0.5, "p": 0.25, "q": 0.75}
#: Slack for sums and logarithms of floating-point probabilities.
SLACK = 1e-9


def rappor(bits: int) -> Rappor:
    mechanism = make_mechanism(MechanismSpec(mechanism="rappor", num_bits=bits, **DEMO))
    assert isinstance(mechanism, Rappor)
    return mechanism


def slots(values: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Distinct values in first-seen order, and each report's index among them."""
    distinct = list(dict.fromkeys(values))
    return distinct, [distinct.index(v) for v in values]


def joint_law(mechanism: Rappor, values: tuple[int, ...]) -> np.ndarray:
    """Exact P[reports = (o_1..o_n) | Bloom bits (values)] for h = 1: value v sets bit v.

    Sum over one PRR per distinct value (``prr_matrix``) of the product of the reports'
    instantaneous responses: bit 1 with probability q where the PRR bit is 1, p where 0.
    """
    k = mechanism.num_bits
    _, p, q = mechanism.realized_probabilities
    outputs = (np.arange(2**k)[:, None] >> np.arange(k)[None, :]) & 1
    one = np.where(outputs == 1, q, p)  # P(report bit 1 | PRR a), per PRR a (row) and bit
    chosen = np.where(outputs[None, :, :] == 1, one[:, None, :], 1 - one[:, None, :])
    irr = np.prod(chosen, axis=2)  # irr[a, o] = P(report o | PRR a)
    prr = mechanism.prr_matrix()  # rows: Bloom filters e_0..e_{k-1} (h = 1), columns PRR a
    distinct, of = slots(values)
    letters = iter(string.ascii_letters)
    prr_index = [next(letters) for _ in distinct]
    out_index = [next(letters) for _ in values]
    operands: list[np.ndarray] = [prr[v] for v in distinct] + [irr] * len(values)
    terms = prr_index + [prr_index[s] + out_index[i] for i, s in enumerate(of)]
    law = np.einsum(",".join(terms) + "->" + "".join(out_index), *operands, optimize=True)
    return np.asarray(law)


def loss(first: np.ndarray, second: np.ndarray) -> float:
    """The largest |log P[o | x] / P[o | x']| over all outputs o (both laws positive)."""
    ratio = np.log(first) - np.log(second)
    return float(max(ratio.max(), -ratio.min()))


def patterns(n: int) -> list[tuple[int, ...]]:
    """Every equality pattern of n reports, as a canonical value sequence (0, 0, 1, ...)."""
    return sorted({tuple(slots(seq)[1]) for seq in itertools.product(range(n), repeat=n)})


def ledger_charge(directory: Path, metric: str, values: tuple[int, ...]) -> float:
    """The lifetime epsilon the device ledger charges for reporting ``values`` (RAPPOR)."""
    mechanism = rappor(4)
    cost = MemoizedCost(mechanism.epsilon_infinity, mechanism.epsilon_one)
    spec = MetricSpec(name=metric, version=1, mechanism=mechanism.spec)
    limits = BudgetLimits(per_metric_per_period=1e6, total_per_period=1e6)
    ledger = PrivacyLedger(directory, limits)
    before = ledger.status().spent_lifetime
    for value in values:
        ledger.debit_memoized(metric, spec_hash(spec), f"value-{value}".encode(), cost)
    ledger.release()
    return ledger.status().spent_lifetime - before


def test_same_equality_pattern_loses_at_most_epsilon_infinity_per_differing_value(
    tmp_path: Path,
) -> None:
    """Every pattern of n = 1..4 reports, every relabelling of its values among the k = 4
    Bloom bits: the exact joint loss is at most epsilon_infinity times the number of
    distinct values that differ, and at most the ledger's charge."""
    mechanism = rappor(4)
    eps_inf = mechanism.epsilon_infinity
    checked = 0
    for n in range(1, 5):
        for pattern in patterns(n):
            m = max(pattern) + 1
            base = joint_law(mechanism, pattern)
            for labels in itertools.permutations(range(4), m):
                other = tuple(labels[s] for s in pattern)
                differing = sum(labels[j] != j for j in range(m))
                bound = differing * eps_inf
                assert loss(base, joint_law(mechanism, other)) <= bound + SLACK, (pattern, other)
                checked += 1
    assert checked > 300
    # The charge that backs the bound: one epsilon_infinity per distinct value, however
    # many reports (the sequence (0, 1, 0, 0) has two distinct values).
    assert ledger_charge(tmp_path, "m", (0, 1, 0, 0)) == pytest.approx(2 * eps_inf)
    assert ledger_charge(tmp_path, "m", (0, 0, 1, 1)) == 0.0  # both charged already


def test_the_per_value_bound_is_reached() -> None:
    """Tight: many reports of v against as many of u approach epsilon_infinity (k = 4),
    so nothing smaller than epsilon_infinity per value could be charged for life."""
    mechanism = rappor(4)
    losses = [
        loss(joint_law(mechanism, (0,) * n), joint_law(mechanism, (1,) * n)) for n in (1, 2, 4)
    ]
    assert losses[0] == pytest.approx(mechanism.epsilon_one)  # one report: epsilon_one
    assert losses[0] < losses[1] < losses[2] < mechanism.epsilon_infinity
    assert losses[2] > 0.95 * mechanism.epsilon_infinity


def test_changing_the_pattern_defeats_the_old_per_report_charge() -> None:
    """(v, v) against (u, w): more than 2 epsilon_one. Over the three Bloom bits involved
    (k = 3) it is 2.383 against 2 epsilon_one = 2.043; k = 4 adds an untouched bit whose
    correlation (one PRR bit against two) leaks too."""
    three, four = rappor(3), rappor(4)
    small = loss(joint_law(three, (0, 0)), joint_law(three, (1, 2)))
    assert small == pytest.approx(2.383288550984972, abs=1e-9)
    assert 2 * three.epsilon_one == pytest.approx(2.0433024950639624, abs=1e-9)
    assert small > 2 * three.epsilon_one  # the old rule under-charges
    larger = loss(joint_law(four, (0, 0)), joint_law(four, (1, 2)))
    assert larger > small
    for n in (3, 4):
        linked = loss(joint_law(four, (0,) * n), joint_law(four, tuple(range(n))))
        assert linked > n * four.epsilon_one


def test_pattern_changes_are_bounded_only_by_the_whole_instantaneous_response() -> None:
    """Any two sequences of n reports: loss <= n k ln(max(q/p, (1-p)/(1-q))), since each
    law is a mixture over PRRs of products of per-report, per-bit responses. Checked
    exactly on every pair of sequences of n = 1..3 reports over k = 3 bits."""
    mechanism = rappor(3)
    _, p, q = mechanism.realized_probabilities
    per_bit = math.log(max(q / p, (1 - p) / (1 - q)))
    for n in (1, 2, 3):
        laws = {seq: joint_law(mechanism, seq) for seq in itertools.product(range(3), repeat=n)}
        worst = max(loss(a, b) for a, b in itertools.combinations(laws.values(), 2))
        assert worst <= n * 3 * per_bit + SLACK


# --- the demo spec, k = 32, by factorization over bit positions --------------------------


def position_law(thetas: list[float], of: list[int], p: float, q: float) -> np.ndarray:
    """Exact law of the n reports' bits at one position: slot j's PRR bit is 1 with
    probability ``thetas[j]``; report i answers from slot ``of[i]`` (1 w.p. q or p)."""
    n = len(of)
    outputs = np.array(list(itertools.product((0, 1), repeat=n)))
    law = np.zeros(len(outputs))
    for prr in itertools.product((0, 1), repeat=len(thetas)):
        weight = math.prod(t if a else 1 - t for t, a in zip(thetas, prr, strict=True))
        one = np.array([q if prr[s] else p for s in of])
        law += weight * np.prod(np.where(outputs == 1, one, 1 - one), axis=1)
    return law


def demo_loss(first: tuple[int, ...], second: tuple[int, ...], bits: int = 32) -> float:
    """Exact joint loss of two value sequences (value = its Bloom bit) under the demo spec:
    the sum over positions of each position's largest log-ratio (both directions)."""
    mechanism = rappor(bits)
    flip, p, q = mechanism.realized_probabilities
    (a_values, a_of), (b_values, b_of) = slots(first), slots(second)
    forward = backward = 0.0
    for position in range(bits):
        a = position_law([1 - flip if v == position else flip for v in a_values], a_of, p, q)
        b = position_law([1 - flip if v == position else flip for v in b_values], b_of, p, q)
        ratio = np.log(a) - np.log(b)
        forward, backward = forward + ratio.max(), backward - ratio.min()
    return max(forward, backward)


def repeated_against_distinct(n: int, bits: int = 32) -> float:
    """(v, ..., v) against (u_1, ..., u_n), all distinct, at the demo spec, for any n: at
    each position the repeated sequence has one PRR bit, the other n independent ones, so
    the law depends on the count of ones (and on the one report that sets the bit)."""
    mechanism = rappor(bits)
    flip, p, q = mechanism.realized_probabilities
    p_star, q_star = flip * q + (1 - flip) * p, (1 - flip) * q + flip * p

    def repeated(theta: float, ones: int) -> float:
        zeros = n - ones
        return theta * q**ones * (1 - q) ** zeros + (1 - theta) * p**ones * (1 - p) ** zeros

    def independent(ones: int, reports: int) -> float:
        return float(p_star**ones * (1 - p_star) ** (reports - ones))

    def extremes(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        ratios = [math.log(a / b) for a, b in pairs]
        return max(ratios), -min(ratios)

    own = extremes([(repeated(1 - flip, t), independent(t, n)) for t in range(n + 1)])
    other = extremes(  # u_i's bit: report i answers it with q*, the others with p*
        [
            (repeated(flip, t + s), (q_star if s else 1 - q_star) * independent(t, n - 1))
            for s in (0, 1)
            for t in range(n)
        ]
    )
    untouched = extremes([(repeated(flip, t), independent(t, n)) for t in range(n + 1)])
    rest = bits - 1 - n
    return max(own[d] + n * other[d] + rest * untouched[d] for d in (0, 1))


def test_demo_spec_factorized_law_agrees_with_full_enumeration() -> None:
    """The per-position computation and the closed count form agree with the full joint
    enumeration where that is feasible (k = 4)."""
    mechanism = rappor(4)
    for first, second in [((0, 0), (1, 2)), ((0, 0, 0), (1, 2, 3)), ((0, 1, 0), (2, 3, 2))]:
        exact = loss(joint_law(mechanism, first), joint_law(mechanism, second))
        assert demo_loss(first, second, bits=4) == pytest.approx(exact, abs=1e-9)
    for n in (2, 3):
        exact = loss(joint_law(mechanism, (0,) * n), joint_law(mechanism, tuple(range(1, n + 1))))
        assert repeated_against_distinct(n, bits=4) == pytest.approx(exact, abs=1e-9)


@pytest.mark.parametrize("n", [2, 10, 20])
def test_demo_spec_repeated_against_distinct_values(n: int) -> None:
    """k = 32: n reports of v against n distinct values exceed n epsilon_one (the old rule)
    and the two sequences' lifetime charges together ((n + 1) epsilon_infinity): the
    equality pattern is not protected; the whole-vector instantaneous bound holds."""
    mechanism = rappor(32)
    _, p, q = mechanism.realized_probabilities
    linked = repeated_against_distinct(n)
    assert linked > n * mechanism.epsilon_one
    assert linked > (n + 1) * mechanism.epsilon_infinity
    assert linked <= n * 32 * math.log(max(q / p, (1 - p) / (1 - q)))
    expected = {2: 10.726068652086616, 10: 173.43761484252687, 20: 390.1348758426445}
    assert linked == pytest.approx(expected[n], rel=1e-9)


def test_demo_spec_same_pattern_stays_within_the_charge() -> None:
    """k = 32, same pattern: (v, v, w) against (u, u, w) changes one distinct value,
    (v, w, v, w) against (u, x, u, x) two; within one and two epsilon_infinity."""
    eps_inf = rappor(32).epsilon_infinity
    assert demo_loss((0, 0, 5), (1, 1, 5)) <= eps_inf + SLACK
    assert demo_loss((0, 5, 0, 5), (1, 6, 1, 6)) <= 2 * eps_inf + SLACK
    assert demo_loss((0, 0), (1, 2)) > 3 * eps_inf  # pattern change: beyond both charges
