"""Report profiles (the ``Profiled`` ability): the ones-count histogram of unary encodings.

The honest law of a report's count of ones (Bernoulli(p) + Binomial(d - 1, q) at the
realized p and q) is checked exactly against rational arithmetic; the profile of real
reports is their histogram; under no attack the chi-square p-values are uniform; under
Cao, Jia and Gong's maximal gain attack (MGA, USENIX Security 2021) the test fires.

Windows are drawn from the count law itself (a multinomial over the d + 1 counts, plus the
fake reports' fixed count), which is exactly the law of the histogram of encoded reports
and costs O(d) per window; one test encodes 10^5 reports for real.

False-failure rates: the uniformity check rejects when a Kolmogorov-Smirnov test of 200
p-values gives p < 1e-3 (a correct implementation fails with probability 1e-3 for some
seed, here fixed). The detection check asks p < ``ALERT_P_VALUE`` (1e-3) in at least 18 of
20 attacked windows: 1,000 fakes in a bin expecting about 2,800 reports add about
1000^2 / 2800 = 360 to a statistic whose honest law is chi-square with about 90 degrees of
freedom (mean 90, sd 13), so p-values are near 1e-40 and a miss has probability far below
1e-12.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.integrity import ALERT_P_VALUE, Profiled, as_profiled
from shared.mechanisms import make_mechanism
from shared.mechanisms.unary import binomial_pmf
from shared.randomness import BITS53
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

D = 1024
EPSILON = 1.0
N = 100_000
BETA = 0.01
TARGETS = 10


def build(**spec: Any) -> Any:
    return make_mechanism(MechanismSpec(**spec))


def oue(d: int = D) -> Any:
    return build(mechanism="oue", epsilon=EPSILON, domain_size=d)


def exact_ones_law(p_threshold: int, q_threshold: int, d: int) -> list[Fraction]:
    """P(X = x) exactly, X = Bernoulli(T_p / 2^53) + Binomial(d - 1, T_q / 2^53)."""
    p, q = Fraction(p_threshold, BITS53), Fraction(q_threshold, BITS53)
    others = [comb(d - 1, k) * q**k * (1 - q) ** (d - 1 - k) for k in range(d)]
    zero = Fraction(0)
    return [
        (p * others[x - 1] if x > 0 else zero) + ((1 - p) * others[x] if x < d else zero)
        for x in range(d + 1)
    ]


@pytest.mark.parametrize(("name", "d"), [("oue", 40), ("sue", 40), ("oue", 300)])
def test_ones_count_law_is_exact_to_1e_12(name: str, d: int) -> None:
    mech = build(mechanism=name, epsilon=EPSILON, domain_size=d)
    p_threshold, q_threshold = mech.thresholds
    exact = exact_ones_law(p_threshold, q_threshold, d)
    pmf = mech.ones_count_pmf
    assert pmf.shape == (d + 1,)
    for x in range(d + 1):
        if exact[x] > Fraction(1, 10**250):  # beyond: below the doubles' normal range
            assert abs(Fraction(pmf[x]) / exact[x] - 1) < 1e-12, x


def test_binomial_pmf_at_large_n_against_exact_points() -> None:
    """Loader's expansion at n = 2^12, checked exactly at a spread of points."""
    n, threshold = 1 << 12, 3_000_000_000_000_000
    pmf = binomial_pmf(n, threshold / BITS53)
    r = Fraction(threshold, BITS53)
    for x in (0, 1, 100, 600, 1364, 1365, 1500, 2000, n - 1, n):
        exact = comb(n, x) * r**x * (1 - r) ** (n - x)
        if exact > Fraction(1, 10**250):
            assert abs(Fraction(pmf[x]) / exact - 1) < 1e-12, x
        else:
            assert pmf[x] < 1e-250


def test_profile_is_the_histogram_of_ones_and_merges() -> None:
    mech = oue(64)
    rng = np.random.default_rng(4)
    reports = mech.encode(rng.integers(0, 64, 500), rng)
    profile = mech.profile(reports)
    ones = np.unpackbits(reports, axis=1, count=64).sum(axis=1)
    assert profile.n == 500 and profile.length == mech.profile_length == 65
    np.testing.assert_array_equal(profile.counts, np.bincount(ones, minlength=65))
    halves = mech.profile(reports[:200]).merge(mech.profile(reports[200:]))
    np.testing.assert_array_equal(halves.counts, profile.counts)
    fit = mech.fit(profile)
    assert fit is not None and fit.reports == 500 and 0.0 <= fit.p_value <= 1.0
    assert fit.test.startswith("ones per report against Bernoulli(0.5) + Binomial(63, ")
    assert mech.fit(mech.profile(reports[:10])) is None  # below MIN_FIT_REPORTS
    with pytest.raises(ValueError, match="65"):
        mech.fit(CountStatistics(5, np.ones(5, dtype=np.int64)))


def test_which_mechanisms_have_profiles() -> None:
    """sue, oue, cms and sfp: one law for every input. The memoized lue family and
    dbitflip: a device's reports share its state, so no profile."""
    assert as_profiled(oue()) is not None
    assert Profiled in type(build(mechanism="sue", epsilon=1.0, domain_size=8)).abilities
    assert as_profiled(build(mechanism="cms", epsilon=1.0, sketch_width=64, sketch_depth=2))
    for spec in (
        dict(mechanism="losue", epsilon=2.0, epsilon_report=1.0, domain_size=64),
        dict(mechanism="lsue", epsilon=2.0, epsilon_report=1.0, domain_size=64),
        dict(mechanism="dbitflip", epsilon=1.0, domain_size=64, bits_per_device=8),
        dict(mechanism="grr", epsilon=1.0, domain_size=8),
    ):
        assert as_profiled(build(**spec)) is None, spec["mechanism"]


def window(
    mech: Any, rng: np.random.Generator, honest: int, fakes: int = 0, fake_ones: int = 0
) -> CountStatistics:
    """A window's profile drawn from the count law: honest counts multinomial over the
    honest law, plus ``fakes`` reports with ``fake_ones`` ones each."""
    counts = rng.multinomial(honest, mech.ones_count_pmf / mech.ones_count_pmf.sum())
    counts[fake_ones] += fakes
    return CountStatistics(honest + fakes, counts)


def test_p_values_are_uniform_under_no_attack() -> None:
    mech = oue()
    rng = np.random.default_rng(2029)
    p_values = []
    for _ in range(200):
        fit = mech.fit(window(mech, rng, 20_000))
        assert fit is not None
        p_values.append(fit.p_value)
    # false-failure rate 1e-3 (module docstring)
    assert stats.kstest(p_values, "uniform").pvalue > 1e-3


def mga_ones(mech: Any) -> int:
    """The MGA fake's count of ones: r targets plus l = round(p + (d - 1) q) - r padding
    bits, so round(p + (d - 1) q) in all (Cao et al. 2021, Section 4)."""
    return round(mech.p + (mech.domain_size - 1) * mech.q)


def test_mga_at_one_percent_fires_the_signal() -> None:
    mech = oue()
    rng = np.random.default_rng(1021)
    fakes = round(BETA * N)
    assert 200 < mga_ones(mech) - TARGETS < D - TARGETS  # the padding fits
    fired = 0
    for _ in range(20):
        fit = mech.fit(window(mech, rng, N - fakes, fakes, mga_ones(mech)))
        assert fit is not None and fit.reports == N
        fired += fit.p_value < ALERT_P_VALUE
    assert fired >= 18


def test_mga_on_encoded_reports_fires_and_honest_encodes_do_not() -> None:
    """Real encodes: 99,000 honest OUE reports and 1,000 MGA fakes (10 targets set, the
    padding drawn uniformly from the other bits)."""
    mech = oue()
    rng = np.random.default_rng(77)
    fakes = round(BETA * N)
    honest = mech.encode(rng.integers(0, D, N - fakes), rng)
    clean = mech.fit(mech.profile(honest))
    assert clean is not None and clean.p_value > 1e-6  # honest: fails with prob. 1e-6
    bits = np.zeros((fakes, D), dtype=bool)
    bits[:, :TARGETS] = True
    padding = mga_ones(mech) - TARGETS
    others = np.argsort(rng.random((fakes, D - TARGETS)), axis=1)[:, :padding] + TARGETS
    np.put_along_axis(bits, others, True, axis=1)
    forged = np.packbits(bits, axis=1)
    assert not (mech.refusals(forged) >= 0).any()  # MGA pads to a typical count
    attacked = mech.fit(mech.profile(np.concatenate([honest, forged])))
    assert attacked is not None and attacked.p_value < ALERT_P_VALUE
