"""One device's report: the single-value paths of ``encode`` follow the mechanism's law.

A device encodes one value at a time, and ``grr`` and the unary encodings take a shorter
path for one value (Python integers and one byte-wise draw per bit instead of array
passes). These tests draw many single reports, one call each, and test their law:
chi-square goodness of fit against the transition matrix row (grr), per-bit binomial
tests and the law of the number of ones (a Poisson-binomial, exact by convolution) for
the unary encodings, and the scalar samplers behind them. Each test's false-failure
rate is at most ALPHA = 1e-6 (Bonferroni inside a test).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import make_mechanism
from shared.randomness import RandomSource, exact_probability, threshold53
from shared.schemas import MechanismSpec

ALPHA = 1e-6


def chi_square_ok(observed: np.ndarray, expected_probabilities: np.ndarray) -> bool:
    expected = expected_probabilities * observed.sum()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return bool(stats.chi2.sf(statistic, observed.size - 1) > ALPHA)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "csprng"])
def test_scalar_samplers(seeded: bool) -> None:
    source = RandomSource(np.random.default_rng(1) if seeded else None)
    draws = np.array([source.below(7) for _ in range(14_000)])
    assert chi_square_ok(np.bincount(draws, minlength=7), np.full(7, 1 / 7))
    threshold = int(threshold53(0.3, "down"))
    ones = sum(source.bernoulli_one(threshold) for _ in range(20_000))
    assert stats.binomtest(ones, 20_000, exact_probability(0.3)).pvalue > ALPHA
    with pytest.raises(ValueError, match="high >= 1"):
        source.below(0)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "csprng"])
def test_grr_single_reports_follow_the_transition_matrix(seeded: bool) -> None:
    mech = make_mechanism(MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=5))
    rng = np.random.default_rng(2) if seeded else None
    value = np.array([2])
    reports = np.array([mech.encode(value, rng)[0] for _ in range(30_000)])
    assert chi_square_ok(np.bincount(reports, minlength=5), mech.transition_matrix()[2])


@pytest.mark.parametrize("name", ["oue", "sue"])
def test_unary_single_reports_have_independent_bits_of_the_right_law(name: str) -> None:
    d, value, n = 12, 3, 20_000
    mech = make_mechanism(MechanismSpec(mechanism=name, epsilon=1.0, domain_size=d))
    rng = np.random.default_rng(3)
    rows = np.concatenate([mech.encode(np.array([value]), rng) for _ in range(n)])
    assert rows.shape == (n, 2)
    bits = np.unpackbits(rows, axis=1)
    assert not bits[:, d:].any()  # padding stays zero
    bits = bits[:, :d]
    probabilities = np.full(d, exact_probability(mech.q))
    probabilities[value] = exact_probability(mech.p)
    per_bit = ALPHA / (d + 1)
    for j in range(d):
        assert stats.binomtest(int(bits[:, j].sum()), n, probabilities[j]).pvalue > per_bit
    # The number of ones per report: a Poisson-binomial law, exact by convolution.
    law = np.array([1.0])
    for p in probabilities:
        law = np.convolve(law, [1 - p, p])
    observed = np.bincount(bits.sum(axis=1), minlength=d + 1).astype(float)
    keep = law * n >= 5  # pool the sparse tails into one cell
    cells = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(law[keep], law[~keep].sum())
    statistic = float(((cells - expected * n) ** 2 / (expected * n)).sum())
    assert stats.chi2.sf(statistic, cells.size - 1) > per_bit


def test_single_value_checks_stay() -> None:
    mech = make_mechanism(MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=5))
    with pytest.raises(ValueError, match="outside the domain"):
        mech.encode(np.array([5]))
    with pytest.raises(ValueError, match="outside the domain"):
        mech.encode(np.array([-1]))
    oue = make_mechanism(MechanismSpec(mechanism="oue", epsilon=1.0, domain_size=5))
    with pytest.raises(ValueError, match="not an integer"):
        oue.encode(np.array([1.5]))
