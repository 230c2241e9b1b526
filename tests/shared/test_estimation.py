"""Statistical tests of every mechanism's estimator: unbiasedness, variance, intervals.

Every mechanism in the registry (``shared.mechanisms.MECHANISMS``) plus ``auto``
is run R times over a fixed population of n users with a fixed seed, and its
estimates are compared with the theory:

* categorical (frequency oracles): the mean of the R estimates is the true
  frequency, their empirical variance is the full Wang et al. (2017) formula
  q (1 - q) / (n (p - q)^2) + f (1 - p - q) / (n (p - q)) at the *true* f, the
  95% intervals cover at the nominal rate, ``std`` is that formula at the
  clipped estimate, ``variance(n)`` is the table of Wang et al. 2017, and the
  post-processed frequencies are the Euclidean projection onto the simplex;
* numeric (means): the mean estimate is unbiased for the mean of the *clipped*
  values, its variance is mean(report_variance(x_i)) / n, ``variance(n)`` is
  the worst case over inputs, ``report_variance`` is the paper's closed form,
  the plug-in ``population_std`` has its documented expectation, its intervals
  cover (``std``, the error around the users' own mean, is tested in
  test_numeric_intervals.py).

Tolerances. Each test item is one parametrized case; its assertions share a
false-failure budget ``ALPHA = 1e-6`` by Bonferroni (e.g. unbiasedness over d
categories uses z = Phi^-1(1 - ALPHA / (2 d)), 5.29 for d = 8). There are about
100 statistical items, so the whole file fails falsely with probability below
1e-4; with the fixed seeds it is deterministic (it also passes for other seeds).
Normal approximations are used for sums of n (or R n) independent bounded
terms, where the central limit theorem is accurate far into the tails here.
For the variance checks the sample variance s^2 of R estimates is about sigma^2 chi2_nu / nu,
with nu matched to Var[s^2] = sigma^4 (2 / (R - 1) + kappa / R), kappa the
excess kurtosis of one estimate (exact from Bernoulli cumulants for the
frequency oracles, estimated from the R n individual reports for the numeric
mechanisms); for normal estimates (kappa = 0) this is the exact chi2(R - 1) law.

A new mechanism is covered as soon as it is registered: the case lists are
built from the registry, and the tests that need a per-mechanism reference
formula fail until one is added here.

String mechanisms (``rappor``): the debiased per-cohort Bloom counts t_jb are
checked here the same way (unbiased for the true counts T_jb, empirical variance
equal to (T q*(1 - q*) + (N - T) p*(1 - p*)) / (q* - p*)^2, std the formula at
the clipped estimate, intervals cover), over fresh device secrets each run;
decoding against candidate strings is tested in test_rappor_decode.py.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.estimates import Estimate, MeanEstimate
from shared.mechanisms import MECHANISMS, DeviceContext, make_mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.laplace import DiscreteLaplace
from shared.mechanisms.numeric import NumericMechanism
from shared.mechanisms.strings import OpenStringMechanism
from shared.schemas import MEMOIZED_MECHANISMS, MechanismSpec

#: Fixed seed of every simulation here (each case derives its own stream from it).
SEED = 20240611
#: False-failure rate of one test item, split over its assertions by Bonferroni.
ALPHA = 1e-6
#: Independent encode + aggregate + estimate runs per case.
RUNS = 1000
#: Users in the fixed population of each run.
USERS = 2000
#: Confidence level of the intervals under test.
LEVEL = 0.95

#: Memoized mechanisms are tested per period, with devices kept across periods, in their
#: own files (tests/shared/test_lgrr.py, test_lue.py, test_dbitflip.py, test_onebitmean.py).
MEMOIZED_NAMES: list[str] = sorted(MEMOIZED_MECHANISMS)
CATEGORICAL_NAMES: list[str] = sorted(
    name
    for name, cls in MECHANISMS.items()
    if issubclass(cls, CategoricalMechanism) and name not in MEMOIZED_MECHANISMS
) + ["auto"]
NUMERIC_NAMES: list[str] = sorted(
    name
    for name, cls in MECHANISMS.items()
    if issubclass(cls, NumericMechanism) and name not in MEMOIZED_MECHANISMS
)
#: Open-domain string mechanisms are tested in their own files (tests/shared/test_sketch.py,
#: test_pem.py, test_sfp.py); here, the candidate-list one (rappor).
OPEN_STRING_NAMES: list[str] = sorted(
    name for name, cls in MECHANISMS.items() if issubclass(cls, OpenStringMechanism)
)
STRING_NAMES: list[str] = sorted(
    name
    for name, cls in MECHANISMS.items()
    if getattr(cls, "kind", None) == "string" and name not in OPEN_STRING_NAMES
)


def rng_for(case_id: str) -> np.random.Generator:
    """A generator seeded from SEED and the case id (stable whatever the test order)."""
    return np.random.default_rng([SEED, zlib.crc32(case_id.encode())])


def z_bonferroni(alpha: float, tests: int) -> float:
    """Two-sided normal quantile for ``tests`` assertions sharing a false-failure rate ``alpha``."""
    return float(stats.norm.isf(alpha / (2 * tests)))


def variance_ratio_interval(runs: int, excess_kurtosis: float, alpha: float) -> tuple[float, float]:
    """Two-sided acceptance interval of s^2 / sigma^2 for the sample variance of ``runs`` values.

    s^2 / sigma^2 is approximated by chi2_nu / nu with nu = 2 / (2 / (R - 1) + kappa / R),
    which has the exact variance of s^2 / sigma^2 for values of excess kurtosis kappa
    (and is exactly chi2(R - 1) / (R - 1) for normal values).
    """
    nu = 2.0 / (2.0 / (runs - 1) + excess_kurtosis / runs)
    return (
        float(stats.chi2.ppf(alpha / 2, nu) / nu),
        float(stats.chi2.isf(alpha / 2, nu) / nu),
    )


def binomial_interval(trials: int, probability: float, alpha: float) -> tuple[int, int]:
    """Counts [lo, hi] with P(X < lo), P(X > hi) <= alpha / 2 for X ~ Bin(trials, probability)."""
    low = int(stats.binom.ppf(alpha / 2, trials, probability))
    high = int(stats.binom.isf(alpha / 2, trials, probability))
    return low, high


def test_every_registered_mechanism_has_estimation_tests() -> None:
    """A mechanism of a new kind would otherwise be silently left out of this file."""
    tested = set(CATEGORICAL_NAMES) | set(NUMERIC_NAMES) | set(STRING_NAMES)
    distributions = {name for name, cls in MECHANISMS.items() if cls.kind == "distribution"}
    attributes = {name for name, cls in MECHANISMS.items() if cls.kind == "attributes"}
    # memoized, open-domain string, distribution and multi-attribute mechanisms (the last in
    # test_multidim.py): in their own test files
    elsewhere = (
        (set(MEMOIZED_NAMES) & set(MECHANISMS))
        | set(OPEN_STRING_NAMES)
        | distributions
        | attributes
    )
    assert tested | elsewhere == set(MECHANISMS) | {"auto"}
    assert not set(CATEGORICAL_NAMES) & set(NUMERIC_NAMES)
    assert not (set(CATEGORICAL_NAMES) | set(NUMERIC_NAMES)) & set(STRING_NAMES)
    assert {case.name for case in STRING_CASES} == set(STRING_NAMES)


# ======================================================================================
# Categorical mechanisms (frequency oracles)
# ======================================================================================


@dataclass(frozen=True)
class CategoricalCase:
    name: str
    epsilon: float
    domain_size: int

    @property
    def id(self) -> str:
        return f"{self.name}-eps{self.epsilon:g}-d{self.domain_size}"

    def mechanism(self) -> CategoricalMechanism:
        spec = MechanismSpec.model_validate(
            {"mechanism": self.name, "epsilon": self.epsilon, "domain_size": self.domain_size}
        )
        mech = make_mechanism(spec)
        assert isinstance(mech, CategoricalMechanism)
        return mech


#: (epsilon, d) run for every categorical mechanism: Warner's d = 2, small d, larger eps.
BASE_CATEGORICAL = [(0.5, 2), (1.0, 5), (2.0, 8)]
#: Extra cases. OLH: d prime so the hash prime P equals d and "mod P mod g" is far from
#: uniform (collision probability 1/3, 1/10, 2/21, 2/11 instead of 1/g; and g > P at
#: eps = 2, d = 3, where it is 0). auto: a domain where it does not pick GRR.
EXTRA_CATEGORICAL: dict[str, list[tuple[float, int]]] = {
    "olh": [(0.4, 3), (1.5, 7), (1.0, 11), (2.0, 3)],
    "auto": [(1.0, 32)],
}
CATEGORICAL_CASES = [
    CategoricalCase(name, eps, d)
    for name in CATEGORICAL_NAMES
    for eps, d in BASE_CATEGORICAL + EXTRA_CATEGORICAL.get(name, [])
]


def population_counts(d: int, n: int) -> np.ndarray:
    """Users per category: geometric weights 0.6^j, and the last category empty when d >= 3."""
    weights = 0.6 ** np.arange(d)
    if d >= 3:
        weights[-1] = 0.0
    counts = np.floor(n * weights / weights.sum()).astype(np.int64)
    counts[0] += n - counts.sum()
    return counts


def full_variance(p: float, q: float, f: np.ndarray, n: int) -> np.ndarray:
    """Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))."""
    return q * (1 - q) / (n * (p - q) ** 2) + f * (1 - p - q) / (n * (p - q))


def bernoulli_fourth_cumulant(prob: float) -> float:
    """kappa_4 of a Bernoulli(prob) variable: pi (1 - pi) (1 - 6 pi (1 - pi))."""
    v = prob * (1 - prob)
    return v * (1 - 6 * v)


@dataclass(frozen=True)
class CategoricalRuns:
    """R independent estimates of one case over the same population."""

    mech: CategoricalMechanism
    n: int
    user_counts: np.ndarray  # (d,) true number of users per category
    truth: np.ndarray  # (d,) true frequencies
    estimates: list[Estimate]
    frequencies: np.ndarray  # (R, d)
    std: np.ndarray  # (R, d)

    @property
    def true_variance(self) -> np.ndarray:
        return full_variance(self.mech.p, self.mech.q, self.truth, self.n)

    @property
    def excess_kurtosis(self) -> np.ndarray:
        """Excess kurtosis of each f_v: that of C_v, a sum of independent Bernoullis."""
        p, q, n_v, n = self.mech.p, self.mech.q, self.user_counts, self.n
        k2 = n_v * p * (1 - p) + (n - n_v) * q * (1 - q)
        k4 = n_v * bernoulli_fourth_cumulant(p) + (n - n_v) * bernoulli_fourth_cumulant(q)
        return np.asarray(k4 / k2**2)


@cache
def categorical_runs(case: CategoricalCase) -> CategoricalRuns:
    """Encode R n values in one call, then aggregate and estimate R slices of n reports."""
    mech = case.mechanism()
    n, d = USERS, case.domain_size
    user_counts = population_counts(d, n)
    population = np.repeat(np.arange(d), user_counts)
    reports = mech.encode(np.tile(population, RUNS), rng=rng_for(case.id))
    estimates = [mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])) for r in range(RUNS)]
    return CategoricalRuns(
        mech=mech,
        n=n,
        user_counts=user_counts,
        truth=user_counts / n,
        estimates=estimates,
        frequencies=np.stack([est.frequencies for est in estimates]),
        std=np.stack([est.std for est in estimates]),
    )


def unbiasedness_statistic(runs: CategoricalRuns, frequencies: np.ndarray) -> np.ndarray:
    """|mean of R estimates - truth| / sqrt(Var / R) per category, Var at the true f."""
    error = frequencies.mean(axis=0) - runs.truth
    return np.asarray(np.abs(error) / np.sqrt(runs.true_variance / RUNS))


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_frequency_estimates_are_unbiased(case: CategoricalCase) -> None:
    runs = categorical_runs(case)
    z = z_bonferroni(ALPHA, case.domain_size)  # 1e-6 over the d categories
    statistic = unbiasedness_statistic(runs, runs.frequencies)
    assert np.all(statistic <= z), (
        f"{runs.mech!r}: mean estimate {runs.frequencies.mean(axis=0)} vs truth {runs.truth}: "
        f"{statistic.round(2)} standard errors (limit {z:.2f})"
    )


@pytest.mark.parametrize(
    "case",
    [c for c in CATEGORICAL_CASES if c.name == "olh"],
    ids=lambda c: c.id,
)
def test_unbiasedness_check_detects_the_naive_hash_q(case: CategoricalCase) -> None:
    """Power: an OLH estimator with q = 1/g (ignoring "mod P mod g") fails the check above."""
    runs = categorical_runs(case)
    mech = runs.mech
    g = round(math.exp(case.epsilon)) + 1
    p, q, naive_q = mech.p, mech.q, 1.0 / g
    assert not math.isclose(q, naive_q), "this case's hash is uniform: no bias to detect"
    support_fraction = runs.frequencies * (p - q) + q
    naive = (support_fraction - naive_q) / (p - naive_q)
    z = z_bonferroni(ALPHA, case.domain_size)
    assert np.max(unbiasedness_statistic(runs, naive)) > z


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
def test_empirical_variance_matches_full_formula(case: CategoricalCase) -> None:
    runs = categorical_runs(case)
    ratio = runs.frequencies.var(axis=0, ddof=1) / runs.true_variance
    for v in range(case.domain_size):
        # 1e-6 over the d categories (two-sided chi-square interval each).
        low, high = variance_ratio_interval(
            RUNS, float(runs.excess_kurtosis[v]), ALPHA / case.domain_size
        )
        assert low <= ratio[v] <= high, (
            f"{runs.mech!r}, category {v} (f = {runs.truth[v]:.4f}): empirical / analytical "
            f"variance = {ratio[v]:.3f}, outside [{low:.3f}, {high:.3f}]"
        )


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
def test_std_is_the_formula_at_the_clipped_estimate(case: CategoricalCase) -> None:
    runs = categorical_runs(case)
    p, q = runs.mech.p, runs.mech.q
    expected = np.sqrt(full_variance(p, q, np.clip(runs.frequencies, 0.0, 1.0), runs.n))
    np.testing.assert_allclose(runs.std, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
def test_confidence_intervals_cover_at_the_nominal_rate(case: CategoricalCase) -> None:
    """Per category the R coverage indicators are independent Bernoulli(~0.95)."""
    runs = categorical_runs(case)
    bounds = [est.ci(LEVEL) for est in runs.estimates]
    low = np.stack([b[0] for b in bounds])
    high = np.stack([b[1] for b in bounds])
    covered = ((low <= runs.truth) & (runs.truth <= high)).sum(axis=0)
    # 1e-6 over the d categories; exact binomial quantiles.
    lo, hi = binomial_interval(RUNS, LEVEL, ALPHA / case.domain_size)
    assert np.all((lo <= covered) & (covered <= hi)), (
        f"{runs.mech!r}: intervals covered the truth {covered} times out of {RUNS} "
        f"(accepted {lo}..{hi})"
    )


def simplex_projection_by_enumeration(v: np.ndarray) -> np.ndarray:
    """Brute force: the closest point of the simplex, trying every support set S.

    On a support S the closest point with sum 1 is v - tau on S (tau = (sum_S v - 1) / |S|)
    and 0 elsewhere; among the candidates that are non-negative (hence in the simplex) the
    nearest to v is the projection, since the projection itself is one of them.
    Vectorized over rows of v (runs) and all 2^d - 1 supports.
    """
    d = v.shape[1]
    supports = np.array(list(itertools.product([False, True], repeat=d))[1:])  # (S, d)
    sizes = supports.sum(axis=1)
    tau = (v @ supports.T - 1.0) / sizes  # (R, S)
    candidates = np.where(supports[None], v[:, None, :] - tau[:, :, None], 0.0)  # (R, S, d)
    feasible = np.all(candidates >= -1e-15, axis=2)
    distance = np.where(feasible, ((candidates - v[:, None, :]) ** 2).sum(axis=2), np.inf)
    best = distance.argmin(axis=1)
    return candidates[np.arange(v.shape[0]), best]


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
def test_counts_and_postprocessing(case: CategoricalCase) -> None:
    runs = categorical_runs(case)
    for est in runs.estimates:
        assert est.n == runs.n
        assert np.array_equal(est.counts, est.frequencies * runs.n)
    processed = [est.postprocessed() for est in runs.estimates]
    assert all(post.unbiased is False for post in processed)
    x = np.stack([post.frequencies for post in processed])
    v = runs.frequencies
    assert np.all(x >= 0.0)
    np.testing.assert_allclose(x.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    # KKT of min ||x - v||^2 s.t. x >= 0, sum x = 1: x = max(v - tau, 0) for one tau per
    # run, i.e. v - x equals tau on the support and v <= tau off it.
    positive = x > 0
    tau = np.where(positive, v - x, -np.inf).max(axis=1)
    assert np.all(positive.any(axis=1))
    np.testing.assert_allclose(
        np.where(positive, v - x, tau[:, None]),
        np.broadcast_to(tau[:, None], v.shape),
        rtol=0,
        atol=1e-12,
    )
    assert np.all(np.where(positive, -np.inf, v) <= tau[:, None] + 1e-12)
    if case.domain_size >= 3:
        # An empty category: half the estimates are negative, so the projection moves them.
        assert np.any(v < 0)
    if case.domain_size <= 12:
        sample = slice(0, 200)  # (200, 2^d, d) candidates stay small
        np.testing.assert_allclose(
            x[sample], simplex_projection_by_enumeration(v[sample]), rtol=0, atol=1e-12
        )


# --- analytical parameters and variances (Wang et al., USENIX Security 2017) --------------


def olh_collision_by_enumeration(d: int, g: int) -> float:
    """P(H(u) = H(v)), u != v, over the family ((a x + b) mod P) mod g, by enumeration.

    Also checks that it is the same for every pair, which the estimator relies on.
    """
    prime = next(k for k in itertools.count(max(d, 2)) if all(k % j for j in range(2, k)))
    a, b = np.meshgrid(np.arange(1, prime), np.arange(prime), indexing="ij")
    hashed = ((a[..., None] * np.arange(d) + b[..., None]) % prime) % g  # (P-1, P, d)
    flat = hashed.reshape(-1, d)
    collide = (flat[:, :, None] == flat[:, None, :]).mean(axis=0)  # (d, d)
    off_diagonal = collide[~np.eye(d, dtype=bool)]
    assert np.ptp(off_diagonal) < 1e-12, "collision probability differs between pairs"
    return float(off_diagonal[0])


def reference_pq(name: str, eps: float, d: int) -> tuple[float, float]:
    """(p, q) of grr, sue, oue (Wang et al. 2017), and the olh / hr module docstrings."""
    e = math.exp(eps)
    if name == "grr":
        return e / (e + d - 1), 1 / (e + d - 1)
    if name == "sue":
        return math.exp(eps / 2) / (math.exp(eps / 2) + 1), 1 / (math.exp(eps / 2) + 1)
    if name == "oue":
        return 0.5, 1 / (e + 1)
    if name == "olh":
        g = round(e) + 1
        p = e / (e + g - 1)
        c = olh_collision_by_enumeration(d, g)
        return p, c * p + (1 - c) * (1 - p) / (g - 1)
    if name == "hr":
        return e / (e + 1), 0.5
    raise LookupError(f"no reference (p, q) for {name!r}: add it to reference_pq")


#: Leading variance n Var[f_v] at f_v = 0 (Wang et al. 2017; hr: its docstring).
TABLE_VARIANCE: dict[str, Callable[[float, int], float]] = {
    "grr": lambda eps, d: (math.exp(eps) + d - 2) / (math.exp(eps) - 1) ** 2,
    "sue": lambda eps, d: math.exp(eps / 2) / (math.exp(eps / 2) - 1) ** 2,
    "oue": lambda eps, d: 4 * math.exp(eps) / (math.exp(eps) - 1) ** 2,
    "hr": lambda eps, d: (math.exp(eps) + 1) ** 2 / (math.exp(eps) - 1) ** 2,
}


def test_every_categorical_mechanism_has_reference_parameters() -> None:
    for name in CATEGORICAL_NAMES:
        if name != "auto":
            reference_pq(name, 1.0, 5)  # raises LookupError naming a missing one


@pytest.mark.parametrize("case", CATEGORICAL_CASES, ids=lambda c: c.id)
def test_planning_variance_formula(case: CategoricalCase) -> None:
    mech = case.mechanism()
    eps, d = case.epsilon, case.domain_size
    p, q = reference_pq(mech.name, eps, d)
    assert mech.p == pytest.approx(p, rel=1e-12)
    assert mech.q == pytest.approx(q, rel=1e-12)
    for n in (1, 1000, 123_457):
        assert mech.variance(n) == pytest.approx(q * (1 - q) / (n * (p - q) ** 2), rel=1e-12)
        if mech.name in TABLE_VARIANCE:
            assert mech.variance(n) == pytest.approx(
                TABLE_VARIANCE[mech.name](eps, d) / n, rel=1e-12
            )
    if case.name == "auto":
        best = min(
            qq * (1 - qq) / (pp - qq) ** 2
            for pp, qq in (
                reference_pq(name, eps, d) for name in CATEGORICAL_NAMES if name != "auto"
            )
        )
        assert mech.variance(1) == pytest.approx(best, rel=1e-12)


# ======================================================================================
# Numeric mechanisms (means)
# ======================================================================================


@dataclass(frozen=True)
class NumericCase:
    name: str
    epsilon: float
    lower: float
    upper: float
    centre: float  # where the bulk of the population sits, as a fraction of the range
    grid_steps: int | None = None

    @property
    def id(self) -> str:
        steps = f"-K{self.grid_steps}" if self.grid_steps else ""
        return f"{self.name}-eps{self.epsilon:g}-[{self.lower:g},{self.upper:g}]{steps}"

    def mechanism(self) -> NumericMechanism:
        spec = MechanismSpec.model_validate(
            {
                "mechanism": self.name,
                "epsilon": self.epsilon,
                "lower": self.lower,
                "upper": self.upper,
                "grid_steps": self.grid_steps,
            }
        )
        mech = make_mechanism(spec)
        assert isinstance(mech, NumericMechanism)
        return mech


#: (epsilon, lower, upper, centre): a non-symmetric range, and a unit range at larger eps.
BASE_NUMERIC = [(1.0, -3.0, 10.0, 0.35), (2.5, 0.0, 1.0, 0.7)]
#: laplace and piecewise on a coarse grid, where randomized rounding is a visible part of
#: the variance.
EXTRA_NUMERIC: dict[str, list[NumericCase]] = {
    "laplace": [NumericCase("laplace", 2.0, -3.0, 10.0, 0.35, grid_steps=4)],
    "piecewise": [NumericCase("piecewise", 2.0, -3.0, 10.0, 0.35, grid_steps=4)],
}
NUMERIC_CASES = [
    NumericCase(name, eps, low, high, centre)
    for name in NUMERIC_NAMES
    for eps, low, high, centre in BASE_NUMERIC
] + [case for name in NUMERIC_NAMES for case in EXTRA_NUMERIC.get(name, [])]


def numeric_population(case: NumericCase, n: int) -> np.ndarray:
    """n values: a normal bulk, 5% below lower and 5% above upper (clipped), both bounds."""
    rng = rng_for("population-" + case.id)
    width = case.upper - case.lower
    bulk = case.lower + width * rng.normal(case.centre, 0.15, n)
    tail = n // 20
    bulk[:tail] = case.lower - width * rng.uniform(0.01, 0.5, tail)
    bulk[tail : 2 * tail] = case.upper + width * rng.uniform(0.01, 0.5, tail)
    bulk[2 * tail] = case.lower
    bulk[2 * tail + 1] = case.upper
    return bulk


@dataclass(frozen=True)
class NumericRuns:
    mech: NumericMechanism
    population: np.ndarray
    clipped: np.ndarray
    estimates: list[MeanEstimate]
    means: np.ndarray  # (R,)
    population_std: np.ndarray  # (R,)
    excess_kurtosis: float  # of one run's mean, estimated from all R n reports

    @property
    def n(self) -> int:
        return self.population.size

    @property
    def mean_report_variance(self) -> float:
        """mean_i Var[y | x_i] from the mechanism's analytical ``report_variance``."""
        return float(self.mech.report_variance(self.population).mean())


@cache
def numeric_runs(case: NumericCase) -> NumericRuns:
    mech = case.mechanism()
    n = USERS
    population = numeric_population(case, n)
    clipped = np.clip(population, case.lower, case.upper)
    reports = mech.encode(np.tile(population, RUNS), rng=rng_for(case.id))
    estimates = [mech.estimate(mech.aggregate(reports[r * n : (r + 1) * n])) for r in range(RUNS)]
    # kappa of a sum of independent terms: sum of 4th cumulants / (sum of variances)^2,
    # each user's moments estimated from its R reports.
    residuals = mech.debias(mech.check_reports(reports)).reshape(RUNS, n) - clipped
    m2 = (residuals**2).mean(axis=0)
    m4 = (residuals**4).mean(axis=0)
    kurtosis = float((m4 - 3 * m2**2).sum() / m2.sum() ** 2)
    return NumericRuns(
        mech=mech,
        population=population,
        clipped=clipped,
        estimates=estimates,
        means=np.array([est.mean for est in estimates]),
        population_std=np.array([est.population_std for est in estimates]),
        excess_kurtosis=kurtosis,
    )


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_mean_is_unbiased_for_the_clipped_mean(case: NumericCase) -> None:
    runs = numeric_runs(case)
    assert np.any(runs.population < case.lower) and np.any(runs.population > case.upper)
    variance = runs.mean_report_variance / runs.n
    z = z_bonferroni(ALPHA, 1)  # 4.89: 1e-6 for this one assertion
    error = runs.means.mean() - runs.clipped.mean()
    assert abs(error) <= z * math.sqrt(variance / RUNS), (
        f"{runs.mech!r}: mean of estimates {runs.means.mean():.5f} vs clipped mean "
        f"{runs.clipped.mean():.5f}: {error / math.sqrt(variance / RUNS):.2f} standard errors"
    )


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
def test_empirical_variance_of_the_mean_matches(case: NumericCase) -> None:
    runs = numeric_runs(case)
    ratio = runs.means.var(ddof=1) / (runs.mean_report_variance / runs.n)
    low, high = variance_ratio_interval(RUNS, runs.excess_kurtosis, ALPHA)
    assert low <= ratio <= high, (
        f"{runs.mech!r}: empirical / analytical variance of the mean = {ratio:.3f}, "
        f"outside [{low:.3f}, {high:.3f}] (kappa = {runs.excess_kurtosis:.4f})"
    )


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
def test_plug_in_std_has_its_documented_expectation(case: NumericCase) -> None:
    """n population_std^2 is the sample variance s^2 of the n debiased reports, and

    E[s^2] = mean_i Var[y | x_i] + (n / (n - 1)) popvar(clipped x),

    between the mean report variance and it plus the population variance.
    """
    runs = numeric_runs(case)
    n = runs.n
    plug_in = runs.population_std**2 * n
    noise = runs.mean_report_variance
    spread = float(runs.clipped.var()) * n / (n - 1)
    # 1e-6 for the two-sided check (the bracket check fails only if it does too); the sd
    # of s^2 is estimated from the R independent runs (normal approximation for the mean).
    z = z_bonferroni(ALPHA, 1)
    tolerance = z * float(plug_in.std(ddof=1)) / math.sqrt(RUNS)
    average = float(plug_in.mean())
    assert noise - tolerance <= average <= noise + spread + tolerance
    assert abs(average - (noise + spread)) <= tolerance, (
        f"{runs.mech!r}: mean n population_std^2 = {average:.5g}, expected {noise + spread:.5g} "
        f"(noise {noise:.5g} + spread {spread:.5g}) within {tolerance:.3g}"
    )


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
def test_mean_confidence_interval_coverage(case: NumericCase) -> None:
    """The population interval covers the users' own (clipped) mean at 95% up to the
    plug-in population_std's documented inflation by the spread of x."""
    runs = numeric_runs(case)
    n = runs.n
    noise = runs.mean_report_variance
    inflation = math.sqrt((noise + float(runs.clipped.var()) * n / (n - 1)) / noise)
    expected = 2 * stats.norm.cdf(stats.norm.ppf((1 + LEVEL) / 2) * inflation) - 1
    assert LEVEL <= expected < 0.99  # the cases are chosen so 95% is still the point
    bounds = np.array([est.ci(LEVEL, population=True) for est in runs.estimates])
    truth = runs.clipped.mean()
    covered = int(((bounds[:, 0] <= truth) & (truth <= bounds[:, 1])).sum())
    low, high = binomial_interval(RUNS, expected, ALPHA)  # exact binomial, 1e-6
    assert low <= covered <= high, (
        f"{runs.mech!r}: {covered}/{RUNS} intervals covered the clipped mean; expected "
        f"coverage {expected:.4f}, accepted {low}..{high}"
    )


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
def test_postprocessed_mean_is_clipped(case: NumericCase) -> None:
    runs = numeric_runs(case)
    for est in runs.estimates:
        assert est.postprocessed() == np.clip(est.mean, case.lower, case.upper)
    # Single-report estimates leave [lower, upper] on both sides (an unbiased eps-LDP
    # mechanism must, at the bounds), so the clipping itself is exercised.
    mech = runs.mech
    values = np.tile([case.lower, case.upper], 500)
    reports = mech.encode(values, rng=rng_for("single-" + case.id))
    single = [mech.estimate(mech.aggregate(reports[i : i + 1])) for i in range(values.size)]
    means = np.array([est.mean for est in single])
    assert np.any(means < case.lower) and np.any(means > case.upper)
    processed = np.array([est.postprocessed() for est in single])
    np.testing.assert_array_equal(processed, np.clip(means, case.lower, case.upper))


# --- closed forms of report_variance and variance(n) -------------------------------------


def normalized(case: NumericCase, x: np.ndarray) -> np.ndarray:
    """t = 2 (clip(x) - lower) / (upper - lower) - 1."""
    clipped = np.clip(x, case.lower, case.upper)
    return 2 * (clipped - case.lower) / (case.upper - case.lower) - 1


def duchi_variance(mech: NumericMechanism, case: NumericCase, x: np.ndarray) -> np.ndarray:
    """(C^2 - t^2) ((upper - lower) / 2)^2 with C = (e^eps + 1) / (e^eps - 1)."""
    c = (math.exp(case.epsilon) + 1) / (math.exp(case.epsilon) - 1)
    return (c**2 - normalized(case, x) ** 2) * ((case.upper - case.lower) / 2) ** 2


def piecewise_variance(mech: NumericMechanism, case: NumericCase, x: np.ndarray) -> np.ndarray:
    """sum_m P[m | x] (y_m - E[y | x])^2 over the exact pmf of the M cells (the matrix the
    privacy tests enumerate), y_m the debiased cell, a few thousand inputs at a time."""
    cells = mech.debias(np.arange(mech.cells))  # type: ignore[attr-defined]
    parts = []
    for chunk in np.array_split(x, max(1, x.size // 2048)):
        pmf = mech.transition_matrix(chunk)  # type: ignore[attr-defined]
        mean = pmf @ cells
        parts.append(np.einsum("ij,ij->i", pmf, (cells[None, :] - mean[:, None]) ** 2))
    return np.concatenate(parts)


def laplace_variance(mech: NumericMechanism, case: NumericCase, x: np.ndarray) -> np.ndarray:
    """w^2 (phi (1 - phi) + 2 e^-g / (1 - e^-g)^2), g = noise_s / noise_t, w the grid step."""
    assert isinstance(mech, DiscreteLaplace)
    w = mech.step
    g = mech.noise_s / mech.noise_t
    position = (np.clip(x, case.lower, case.upper) - case.lower) / w
    phi = position - np.floor(position)
    return w**2 * (phi * (1 - phi) + 2 * math.exp(-g) / (1 - math.exp(-g)) ** 2)


CLOSED_FORMS: dict[str, Callable[[NumericMechanism, NumericCase, np.ndarray], np.ndarray]] = {
    "duchi": duchi_variance,
    "piecewise": piecewise_variance,
    "laplace": laplace_variance,
}


def dense_inputs(case: NumericCase) -> np.ndarray:
    """Inputs beyond both bounds and a grid of [lower, upper] that holds every cell midpoint
    of a laplace grid of K steps for K dividing 20480 (the worst case of its rounding)."""
    width = case.upper - case.lower
    return np.concatenate(
        [
            np.linspace(case.lower - width, case.upper + width, 2001),
            np.linspace(case.lower, case.upper, 40 * 1024 + 1),
        ]
    )


def test_every_numeric_mechanism_has_a_closed_form() -> None:
    assert set(NUMERIC_NAMES) <= set(CLOSED_FORMS), "add the paper's variance to CLOSED_FORMS"


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_report_variance_is_the_closed_form(case: NumericCase) -> None:
    mech = case.mechanism()
    x = dense_inputs(case)
    expected = CLOSED_FORMS[case.name](mech, case, x)
    np.testing.assert_allclose(mech.report_variance(x), expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.id)
def test_planning_variance_is_the_worst_case_over_inputs(case: NumericCase) -> None:
    mech = case.mechanism()
    grid = mech.report_variance(dense_inputs(case))
    for n in (1, 1000):
        # Relative 1e-12: only floating-point rounding of the same formula at nearby inputs.
        assert np.all(grid <= mech.variance(n) * n * (1 + 1e-12))
        assert mech.variance(n) * n == pytest.approx(grid.max(), rel=1e-9)


def piecewise_moments(eps: float, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of the piecewise output, integrated from its density.

    Wang et al. (ICDE 2019): y is uniform on [l(t), r(t)] with probability z / (z + 1),
    else uniform on [-C, l(t)) and (r(t), C]; l(t) = (C + 1) t / 2 - (C - 1) / 2,
    r(t) = l(t) + C - 1, C = (z + 1) / (z - 1), z = e^(eps / 2).
    """
    z = math.exp(eps / 2)
    c = (z + 1) / (z - 1)
    left = (c + 1) * t / 2 - (c - 1) / 2
    right = left + c - 1
    inside, outside = z / (z + 1) / (c - 1), 1 / (z + 1) / (c + 1)

    def moment(k: int, about: np.ndarray) -> np.ndarray:
        def integral(a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
            return np.asarray(((b - about) ** (k + 1) - (a - about) ** (k + 1)) / (k + 1))

        return (
            outside * integral(-c, left)
            + inside * integral(left, right)
            + outside * integral(right, c)
        )

    mean = moment(1, np.zeros_like(t))
    return mean, moment(2, mean)


def test_piecewise_grid_is_no_worse_than_the_continuous_law() -> None:
    """At the default grid the discrete mechanism's worst-case variance is at most that of
    Wang et al.'s continuous law (integrated from the paper's density), in normalized units."""
    t = np.linspace(-1, 1, 201)
    for eps in (0.5, 1.0, 2.5, 6.0):
        mean, variance = piecewise_moments(eps, t)
        np.testing.assert_allclose(mean, t, rtol=0, atol=1e-9)
        spec = MechanismSpec(mechanism="piecewise", epsilon=eps, lower=-1.0, upper=1.0)
        assert make_mechanism(spec).variance(1) <= variance.max()


# ======================================================================================
# String mechanisms (rappor): debiased per-cohort Bloom counts
# ======================================================================================


@dataclass(frozen=True)
class StringCase:
    name: str
    num_bits: int
    num_hashes: int
    num_cohorts: int
    f: float
    p: float
    q: float

    @property
    def id(self) -> str:
        return (
            f"{self.name}-k{self.num_bits}-h{self.num_hashes}-m{self.num_cohorts}"
            f"-f{self.f:g}-p{self.p:g}-q{self.q:g}"
        )

    def mechanism(self) -> Any:
        return make_mechanism(
            MechanismSpec(
                mechanism=self.name,
                num_bits=self.num_bits,
                num_hashes=self.num_hashes,
                num_cohorts=self.num_cohorts,
                f=self.f,
                p=self.p,
                q=self.q,
            )
        )


#: Symmetric (p* + q* = 1: variance free of T) and asymmetric (variance grows with T).
STRING_CASES = [
    StringCase("rappor", 16, 2, 3, 0.5, 0.25, 0.75),
    StringCase("rappor", 12, 3, 2, 0.5, 0.5, 0.75),
]
#: Runs and devices per run: every run draws fresh device secrets (independent PRRs)
#: and fresh IRRs for the same population of (value, cohort).
STRING_RUNS = 400
STRING_USERS = 600


@dataclass(frozen=True)
class StringRuns:
    mech: Any
    reports: np.ndarray  # (m,) N_j
    truth: np.ndarray  # (m, k) T_jb
    counts: np.ndarray  # (R, m, k) t_jb
    std: np.ndarray  # (R, m, k)

    def variance(self, true_ones: np.ndarray) -> np.ndarray:
        p_star, q_star = self.mech.p_star, self.mech.q_star
        n = self.reports[:, None]
        return (true_ones * q_star * (1 - q_star) + (n - true_ones) * p_star * (1 - p_star)) / (
            q_star - p_star
        ) ** 2


@cache
def string_runs(case: StringCase) -> StringRuns:
    mech = case.mechanism()
    rng = rng_for(case.id)
    values = np.array([f"value-{v}" for v in rng.zipf(1.6, STRING_USERS) % 40], dtype=object)
    cohorts = rng.integers(0, case.num_cohorts, STRING_USERS)
    blooms = mech.bloom_bit_indices(values, cohorts)  # (n, h)
    truth = np.zeros((case.num_cohorts, case.num_bits), dtype=np.int64)
    for j in range(case.num_cohorts):  # per cohort: distinct bits of each value, counted
        rows = blooms[cohorts == j]
        hits = (rows[:, :, None] == np.arange(case.num_bits)).any(axis=1)
        truth[j] = hits.sum(axis=0)
    secrets = rng.integers(0, 256, (STRING_RUNS * STRING_USERS, 16), dtype=np.uint8)
    reports = mech.encode(
        np.tile(values, STRING_RUNS),
        rng=rng,
        context=DeviceContext(secrets=secrets, cohorts=np.tile(cohorts, STRING_RUNS)),
    )
    estimates = [
        mech.bloom_counts(mech.aggregate(reports[r * STRING_USERS : (r + 1) * STRING_USERS]))
        for r in range(STRING_RUNS)
    ]
    return StringRuns(
        mech=mech,
        reports=np.bincount(cohorts, minlength=case.num_cohorts),
        truth=truth,
        counts=np.stack([est.counts for est in estimates]),
        std=np.stack([est.std for est in estimates]),
    )


def test_every_string_mechanism_has_cases() -> None:
    assert {case.name for case in STRING_CASES} == set(STRING_NAMES)


@pytest.mark.parametrize("case", STRING_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_bloom_counts_are_unbiased(case: StringCase) -> None:
    runs = string_runs(case)
    cells = runs.truth.size
    z = z_bonferroni(ALPHA, cells)  # 1e-6 over the m k cells
    error = runs.counts.mean(axis=0) - runs.truth
    statistic = np.abs(error) / np.sqrt(runs.variance(runs.truth) / STRING_RUNS)
    assert np.all(statistic <= z), (
        f"{runs.mech!r}: mean t_jb - T_jb = {error.round(2)}: {statistic.round(2)} standard "
        f"errors (limit {z:.2f})"
    )
    # The cases are informative: some cells hold few of their cohort's reports, some many.
    share = runs.truth / runs.reports[:, None]
    assert share.min() < 0.05 and share.max() > 0.25


@pytest.mark.parametrize("case", STRING_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_bloom_count_variance_matches_formula(case: StringCase) -> None:
    runs = string_runs(case)
    p_star, q_star = runs.mech.p_star, runs.mech.q_star
    n = runs.reports[:, None]
    k2 = runs.truth * q_star * (1 - q_star) + (n - runs.truth) * p_star * (1 - p_star)
    k4 = runs.truth * bernoulli_fourth_cumulant(q_star) + (n - runs.truth) * (
        bernoulli_fourth_cumulant(p_star)
    )
    ratio = runs.counts.var(axis=0, ddof=1) / runs.variance(runs.truth)
    cells = runs.truth.size
    for (j, b), value in np.ndenumerate(ratio):
        # 1e-6 over the m k cells (two-sided chi-square interval each).
        kurtosis = float(k4[j, b] / k2[j, b] ** 2)
        low, high = variance_ratio_interval(STRING_RUNS, kurtosis, ALPHA / cells)
        assert low <= value <= high, (
            f"{runs.mech!r}, cohort {j} bit {b} (T = {runs.truth[j, b]}): empirical / analytical "
            f"variance = {value:.3f}, outside [{low:.3f}, {high:.3f}]"
        )


@pytest.mark.parametrize("case", STRING_CASES, ids=lambda c: c.id)
def test_bloom_count_std_is_the_formula_at_the_clipped_estimate(case: StringCase) -> None:
    runs = string_runs(case)
    clipped = np.clip(runs.counts, 0.0, runs.reports[None, :, None])
    np.testing.assert_allclose(runs.std, np.sqrt(runs.variance(clipped)), rtol=1e-12, atol=0)


@pytest.mark.parametrize("case", STRING_CASES, ids=lambda c: c.id)
def test_bloom_count_intervals_cover(case: StringCase) -> None:
    """t_jb +- 1.96 std covers T_jb at about 95% (normal approximation of a binomial sum)."""
    runs = string_runs(case)
    half = stats.norm.ppf((1 + LEVEL) / 2) * runs.std
    covered = (np.abs(runs.counts - runs.truth) <= half).sum(axis=0)
    cells = runs.truth.size
    # Plug-in std and a sum of ~100-600 Bernoullis: coverage within 0.93-0.97 by the
    # Berry-Esseen bound is generous; 1e-6 over the cells on top (exact binomial quantiles).
    low = binomial_interval(STRING_RUNS, 0.93, ALPHA / cells)[0]
    high = binomial_interval(STRING_RUNS, 0.97, ALPHA / cells)[1]
    assert np.all((low <= covered) & (covered <= high)), (
        f"{runs.mech!r}: coverage counts {covered} of {STRING_RUNS}, accepted {low}..{high}"
    )
