"""Decoding RAPPOR statistics against candidate strings: accuracy, calibration, detection.

The population: six strings holding 90% of the reports and a tail of 2000 strings
holding 10% (each 1/20,000: no candidate, they form the uniform background the decoder
fits). Statistics come from ``simulate_statistics`` (exact in distribution for one report
per device, checked against the device path at the end), so that R runs are cheap.

Tolerances (alpha = 1e-6 per test, Bonferroni inside a test):

* calibration: with the true strings as the only candidates, the fit is the least-squares
  fit of 6 strings and the background, none of them truncated at 0 except the background
  with probability about 0.3% (its z is about 2.8 at this n; the strings' z exceed 10),
  so each estimate is unbiased with the reported std: the R standardized errors have
  mean 0 (normal, sd 1/sqrt(R)) and variance 1 (chi-square(R - 1) interval);
* the tail's leak into the candidates is about 0.01 std (each Bloom bit of each cohort is
  set by ~ 2000 * 2 / 128 = 31 tail strings: relative fluctuation 1/sqrt(31) of a load of
  0.1 * 2 / 128 that the background absorbs, averaged over a candidate's 32 bits);
* detection: Bonferroni at alpha bounds the probability of any false positive by alpha
  (z-statistics of null candidates are standard normal), so the number of R runs with a
  false positive is at most Binomial(R, alpha), tested with its 1e-6 upper quantile.
"""

from __future__ import annotations

import math
from functools import cache
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import DeviceContext, make_mechanism
from shared.mechanisms.rappor import Rappor, RapporEstimate
from shared.mechanisms.rappor_decode import _nnls_exact, nonnegative_qp
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
RUNS = 150
#: Runs of the false-positive tests (each decodes with both corrections).
DECOY_RUNS = 100
REPORTS = 100_000
TRUE = tuple(f"site-{i}.example" for i in range(6))
FREQUENCIES = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05])
TAIL = tuple(f"tail-{i}" for i in range(2000))
DECOYS = tuple(f"decoy-{i}.example" for i in range(60))


def rappor(k: int = 128, h: int = 2, m: int = 16, **probabilities: float) -> Rappor:
    fields: dict[str, Any] = {"f": 0.5, "p": 0.25, "q": 0.75, **probabilities}
    mech = make_mechanism(
        MechanismSpec(mechanism="rappor", num_bits=k, num_hashes=h, num_cohorts=m, **fields)
    )
    assert isinstance(mech, Rappor)
    return mech


@cache
def population_bits(mech: Rappor) -> np.ndarray:
    return mech.candidate_bits(TRUE + TAIL)


def simulate(
    mech: Rappor, rng: np.random.Generator, n: int = REPORTS
) -> tuple[CountStatistics, np.ndarray]:
    """One population of n devices: 90% on the six strings, 10% on the tail. Returns the
    statistics and the six strings' realized shares."""
    head = rng.multinomial(n, np.append(FREQUENCIES * 0.9 / FREQUENCIES.sum(), 0.1))
    tail = rng.multinomial(head[-1], np.full(len(TAIL), 1 / len(TAIL)))
    counts = np.concatenate([head[:-1], tail])
    stats_ = mech.simulate_statistics(TRUE + TAIL, counts, rng, bits=population_bits(mech))
    return stats_, head[:-1] / n


@cache
def calibration_runs() -> tuple[list[RapporEstimate], np.ndarray]:
    mech = rappor()
    rng = np.random.default_rng(20240611)
    estimates, truths = [], []
    for _ in range(RUNS):
        statistics, truth = simulate(mech, rng)
        estimates.append(mech.estimate(statistics, candidates=list(TRUE)))
        truths.append(truth)
    return estimates, np.array(truths)


def z_two_sided(alpha: float, tests: int) -> float:
    return NormalDist().inv_cdf(1 - alpha / (2 * tests))


# ---------------------------------------------------------------------------------------
# Accuracy and calibration
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_estimates_are_unbiased_with_the_reported_std() -> None:
    estimates, truths = calibration_runs()
    frequencies = np.array([est.frequencies for est in estimates])
    std = np.array([est.std for est in estimates])
    z = (frequencies - truths) / std
    limit = z_two_sided(ALPHA / 2, 6) / math.sqrt(RUNS)  # means: 1e-6 / 2 over six strings
    assert np.all(np.abs(z.mean(axis=0)) <= limit), (z.mean(axis=0), limit)
    variance = z.var(axis=0, ddof=1)  # variances: 1e-6 / 2 over six strings
    low = stats.chi2.ppf(ALPHA / 24, RUNS - 1) / (RUNS - 1)
    high = stats.chi2.isf(ALPHA / 24, RUNS - 1) / (RUNS - 1)
    assert np.all((low <= variance) & (variance <= high)), (variance, low, high)
    # The analytical std is the collision-free sqrt(s0 / (h n)) up to the shared bits.
    planning = math.sqrt(estimates[0].n and rappor().variance(REPORTS))
    assert np.all((std >= planning * (1 - 1e-9)) & (std <= planning * 1.1))


def test_explained_mass_and_intervals() -> None:
    estimates, truths = calibration_runs()
    explained = np.array([est.explained_mass for est in estimates])
    spread = np.array([est.explained_mass_std for est in estimates])
    z = (explained - truths.sum(axis=1)) / spread
    assert abs(z.mean()) <= z_two_sided(ALPHA / 3, 1) / math.sqrt(RUNS)
    low = stats.chi2.ppf(ALPHA / 6, RUNS - 1) / (RUNS - 1)
    high = stats.chi2.isf(ALPHA / 6, RUNS - 1) / (RUNS - 1)
    assert low <= z.var(ddof=1) <= high
    for est in estimates:
        assert est.unexplained_mass == pytest.approx(1 - est.explained_mass)
    # The tail's share is fitted as the background (its z ~ 2.8: truncation at 0 moves the
    # mean by < 1e-4); mean against the realized tail share, empirical std (1e-6 / 3).
    background = np.array([est.background_mass for est in estimates]) - (1 - truths.sum(axis=1))
    limit = z_two_sided(ALPHA / 3, 1) * background.std(ddof=1) / math.sqrt(RUNS)
    assert abs(background.mean()) <= limit
    # 95% intervals of each string cover its share in ~95% of runs (exact binomial, 1e-6/3).
    covered = np.sum(
        [
            (est.ci()[0] <= truth) & (truth <= est.ci()[1])
            for est, truth in zip(estimates, truths, strict=True)
        ],
        axis=0,
    )
    lo = stats.binom.ppf(ALPHA / 36, RUNS, 0.95)
    hi = stats.binom.isf(ALPHA / 36, RUNS, 0.95)
    assert np.all((lo <= covered) & (covered <= hi)), covered


@pytest.mark.slow
def test_recovers_the_distribution_through_the_device_path() -> None:
    """Real devices: encode (fresh secrets, cohorts from them) -> aggregate -> decode with 60
    decoys. Every true string is detected and within 5.3 std of its share (1e-6 over six),
    no decoy is detected (alpha = 1e-6: false-failure rate 1e-6)."""
    mech = rappor(k=64, h=2, m=8)
    rng = np.random.default_rng(7)
    devices = 150_000
    shares = np.append(FREQUENCIES * 0.9 / FREQUENCIES.sum(), 0.1)
    picks = rng.choice(len(TRUE) + 1, size=devices, p=shares)
    tail = np.array(TAIL[:2000], dtype=object)[rng.integers(0, 2000, devices)]
    values = np.where(picks < len(TRUE), np.array(TRUE + ("",), dtype=object)[picks], tail)
    secrets = rng.integers(0, 256, (devices, 32), dtype=np.uint8)
    cohorts = np.array([mech.assign_cohort(row.tobytes()) for row in secrets[:2000]])
    cohorts = np.tile(cohorts, devices // 2000)
    reports = mech.encode(values, rng=rng, context=DeviceContext(secrets=secrets, cohorts=cohorts))
    est = mech.estimate(
        mech.aggregate(reports),
        candidates=list(TRUE + DECOYS),
        alpha=ALPHA,
        correction="bonferroni",
    )
    truth = np.bincount(picks, minlength=7)[:6] / devices
    z = z_two_sided(ALPHA, 6)
    assert np.all(np.abs(est.frequencies[:6] - truth) <= z * est.std[:6])
    assert est.detected[:6].all() and not est.detected[6:].any()
    detected = est.detected_strings()
    assert [d.string for d in detected] == [
        TRUE[i] for i in np.argsort(-est.frequencies[:6], kind="stable")
    ]
    for item in detected:
        assert item.count == pytest.approx(item.frequency * devices)
        assert item.ci_low <= item.frequency <= item.ci_high
    assert est.n == devices


# ---------------------------------------------------------------------------------------
# Detection: false positives at the stated rate, power at the stated threshold
# ---------------------------------------------------------------------------------------


@cache
def decoy_runs() -> tuple[list[RapporEstimate], list[RapporEstimate]]:
    """The same statistics decoded with Bonferroni and with Benjamini-Hochberg."""
    mech = rappor()
    rng = np.random.default_rng(99)
    candidates = list(TRUE + DECOYS)
    bonferroni, bh = [], []
    for _ in range(DECOY_RUNS):
        statistics = simulate(mech, rng)[0]
        bonferroni.append(mech.estimate(statistics, candidates=candidates, correction="bonferroni"))
        bh.append(mech.estimate(statistics, candidates=candidates, correction="bh", alpha=0.05))
    return bonferroni, bh


@pytest.mark.slow
def test_bonferroni_bounds_the_runs_with_any_false_positive() -> None:
    runs = decoy_runs()[0]
    with_false_positive = sum(int(est.detected[6:].any()) for est in runs)
    assert with_false_positive <= stats.binom.isf(ALPHA, DECOY_RUNS, 0.05)
    assert all(est.detected[:6].all() for est in runs)  # 0.05 is > 10 std at this n
    # A null candidate's estimate is its z truncated at 0, positive about half the time;
    # the decoys are correlated (shared bits, the sum constraint): a loose 0.35..0.65 band.
    positive = np.mean([np.mean(est.frequencies[6:] > 0) for est in runs])
    assert 0.35 <= positive <= 0.65


@pytest.mark.slow
def test_benjamini_hochberg_detects_a_superset_at_a_bounded_false_discovery_rate() -> None:
    bonferroni, bh = decoy_runs()
    for strict, loose in zip(bonferroni, bh, strict=True):
        assert np.all(loose.detected >= strict.detected)
        assert loose.correction == "bh"
    false = sum(int(est.detected[6:].sum()) for est in bh)
    found = sum(int(est.detected.sum()) for est in bh)
    # FDR <= alpha: the false share of all discoveries stays near or below 5%.
    assert false <= stats.binom.isf(ALPHA, found, 0.05)
    # Every rule reads the same p-values: Bonferroni at alpha / C, none at alpha.
    for est in bonferroni:
        np.testing.assert_array_equal(
            est.detected, (est.p_values <= 0.05 / est.p_values.size) & (est.frequencies > 0)
        )
        assert est.correction == "bonferroni"


def test_default_rule_is_benjamini_hochberg_at_a_false_discovery_rate_of_one_fifth() -> None:
    mech = rappor()
    statistics = simulate(mech, np.random.default_rng(13))[0]
    candidates = list(TRUE + DECOYS)
    default = mech.estimate(statistics, candidates=candidates)
    explicit = mech.estimate(statistics, candidates=candidates, correction="bh", alpha=0.2)
    assert (default.correction, default.alpha) == ("bh", 0.2)
    np.testing.assert_array_equal(default.detected, explicit.detected)
    # BH: reject the j smallest p-values, j the largest rank with p_(j) <= 0.2 j / C.
    ordered = np.sort(default.p_values)
    ranks = np.flatnonzero(ordered <= 0.2 * np.arange(1, ordered.size + 1) / ordered.size)
    assert default.detected.sum() == (ranks[-1] + 1 if ranks.size else 0)
    assert mech.estimate(statistics, candidates=candidates, correction="bonferroni").alpha == 0.05


def test_no_correction_tests_each_candidate_at_alpha() -> None:
    mech = rappor()
    statistics = simulate(mech, np.random.default_rng(12))[0]
    candidates = list(TRUE + DECOYS)
    strict = mech.estimate(statistics, candidates=candidates, correction="bonferroni")
    loose = mech.estimate(statistics, candidates=candidates, correction="none", alpha=0.2)
    np.testing.assert_array_equal(loose.frequencies, strict.frequencies)
    np.testing.assert_array_equal(loose.detected, (loose.p_values <= 0.2) & (loose.frequencies > 0))
    assert np.all(loose.detected >= strict.detected)
    z = NormalDist().inv_cdf(0.8)
    np.testing.assert_allclose(
        loose.detection_thresholds,
        z * strict.detection_thresholds / NormalDist().inv_cdf(1 - 0.05 / len(candidates)),
    )


@pytest.mark.slow
def test_a_string_at_its_detection_threshold_is_found_half_the_time() -> None:
    """smallest_detectable_frequency is where detection has probability 1/2."""
    mech = rappor(k=128, h=2, m=16)
    candidates = list(TRUE[:3] + DECOYS[:20])
    base = mech.estimate(
        simulate(mech, np.random.default_rng(1))[0], candidates=candidates, correction="bonferroni"
    )
    threshold = float(base.detection_thresholds[2])
    assert threshold == pytest.approx(base.smallest_detectable_frequency, rel=0.1)
    planning = mech.smallest_detectable_frequency(REPORTS, len(candidates))
    assert planning * (1 - 1e-9) <= threshold <= planning * 1.1
    rng = np.random.default_rng(2)
    values = TRUE[:3] + TAIL[:2000]
    bits = mech.candidate_bits(values)
    found = 0
    for _ in range(RUNS):
        shares = np.concatenate([[0.4, 0.3, threshold], np.full(2000, (0.3 - threshold) / 2000)])
        counts = rng.multinomial(REPORTS, shares)
        est = mech.estimate(
            mech.simulate_statistics(values, counts, rng, bits=bits),
            candidates=candidates,
            correction="bonferroni",
        )
        found += int(est.detected[2])
    # P(detect) = Phi((f - z_crit std) / std) = 1/2: the realized share varies by 0.07 std
    # and truncating the 20 decoys moves the estimate by < 0.05 std (their correlation
    # with it is ~ 1/64): P within 0.48..0.52, inside the exact binomial interval (1e-6).
    low = stats.binom.ppf(ALPHA / 2, RUNS, 0.5)
    assert low <= found <= stats.binom.isf(ALPHA / 2, RUNS, 0.5)


# ---------------------------------------------------------------------------------------
# Many candidates: the non-negative LASSO
# ---------------------------------------------------------------------------------------


def test_lasso_selection_with_more_candidates_than_equations() -> None:
    """600 candidates, m k = 256 equations: selection runs; the true strings are found, no
    decoy is detected (alpha = 1e-6)."""
    mech = rappor(k=32, h=2, m=8)
    rng = np.random.default_rng(5)
    statistics, truth = simulate(mech, rng, n=1_000_000)
    candidates = list(TRUE) + [f"other-{i}" for i in range(594)]
    est = mech.estimate(statistics, candidates=candidates, alpha=ALPHA, correction="bonferroni")
    assert 0 < est.selected.sum() < 256 and est.selected[:6].all()
    assert est.detected[:6].all() and not est.detected[6:].any()
    z = z_two_sided(ALPHA, 6)
    assert np.all(np.abs(est.frequencies[:6] - truth) <= z * est.std[:6])
    forced = mech.estimate(
        statistics,
        candidates=candidates[:40],
        selection="lasso",
        alpha=ALPHA,
        correction="bonferroni",
    )
    assert forced.detected[:6].all() and not forced.detected[6:].any()


def test_decoding_is_deterministic() -> None:
    mech = rappor(k=32, h=2, m=8)
    statistics, _ = simulate(mech, np.random.default_rng(3))
    candidates = list(TRUE) + [f"other-{i}" for i in range(300)]
    first = mech.estimate(statistics, candidates=candidates)
    second = mech.estimate(mech.statistics_from_bytes(statistics.to_bytes()), candidates=candidates)
    for field in ("frequencies", "std", "detected", "p_values", "selected", "detection_thresholds"):
        np.testing.assert_array_equal(getattr(first, field), getattr(second, field))
    assert first.explained_mass == second.explained_mass


# ---------------------------------------------------------------------------------------
# The constrained fit and its solvers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_nonnegative_qp_matches_lawson_hanson(seed: int) -> None:
    rng = np.random.default_rng(seed)
    design = (rng.random((300, 60)) < 0.1).astype(float) * rng.uniform(1, 3, 300)[:, None]
    gram = design.T @ design
    target = design.T @ (design @ np.maximum(rng.normal(0, 1, 60), 0) + rng.normal(0, 1, 300))
    x = nonnegative_qp(gram, target)
    np.testing.assert_allclose(x, _nnls_exact(gram, target), rtol=1e-7, atol=1e-9)
    gradient = gram @ x - target
    assert np.all(x >= 0)
    assert np.all(gradient >= -1e-6 * np.sqrt(np.diag(gram)))  # KKT: no descent direction
    assert np.all(np.abs(gradient[x > 0]) <= 1e-6 * np.sqrt(np.diag(gram))[x > 0])


def test_sum_of_candidates_is_at_most_one_and_optimal() -> None:
    """Few reports and many decoys push the unconstrained sum above 1: the fit sits on
    the constraint, and it satisfies the KKT conditions with one multiplier mu >= 0."""
    from shared.mechanisms.rappor_decode import _Problem

    mech = rappor(k=16, h=2, m=4)
    statistics, _ = simulate(mech, np.random.default_rng(11), n=3000)
    candidates = list(TRUE) + [f"other-{i}" for i in range(40)]
    est = mech.estimate(statistics, candidates=candidates, selection="none")
    assert est.explained_mass == pytest.approx(1.0, abs=1e-9)
    assert np.all(est.frequencies >= 0)
    problem = _Problem(mech, statistics, candidates, True)
    columns = np.arange(problem.columns)
    x = np.append(est.frequencies, est.background_mass)
    gradient = problem.gram(columns) @ x - problem.xty  # of 1/2 ||y - X x||^2
    counted = np.append(np.ones(len(candidates)), 0.0)
    free = x > 0
    mu = -float(np.median(gradient[free & (counted > 0)]))
    scale = np.sqrt(problem.norms_sq)
    assert mu > 0
    np.testing.assert_allclose((gradient + mu * counted)[free] / scale[free], 0.0, atol=1e-5)
    assert np.all((gradient + mu * counted)[~free] / scale[~free] >= -1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"candidates": []}, "at least one"),
        ({"candidates": ["a", "b", "a"]}, "'a'"),
        ({"candidates": ["a", 5]}, "position 1"),
        ({"candidates": ["a"], "alpha": 0.0}, "alpha"),
        ({"candidates": ["a"], "correction": "holm"}, "correction"),
        ({"candidates": ["a"], "selection": "cv"}, "selection"),
        ({}, "candidates"),
    ],
)
def test_bad_decoding_requests_are_refused(kwargs: dict[str, Any], message: str) -> None:
    mech = rappor(k=16, h=2, m=4)
    statistics, _ = simulate(mech, np.random.default_rng(0), n=1000)
    with pytest.raises(ValueError, match=message):
        mech.estimate(statistics, **kwargs)
    with pytest.raises(ValueError, match="zero reports"):
        mech.estimate(mech.empty_statistics(), candidates=["a"])


def test_empty_cohorts_are_ignored() -> None:
    mech = rappor(k=32, h=2, m=8)
    statistics, truth = simulate(mech, np.random.default_rng(4), n=200_000)
    table = statistics.counts.reshape(8, 33).copy()
    kept = table[:6].sum(axis=0)[0]
    table[6:] = 0
    est = mech.estimate(CountStatistics(int(kept), table.reshape(-1)), candidates=list(TRUE))
    assert est.residual_dof == 6 * 32 - int((est.frequencies > 0).sum()) - int(
        est.background_mass > 0
    )
    assert np.all(np.abs(est.frequencies - truth) <= z_two_sided(ALPHA, 6) * est.std)


# ---------------------------------------------------------------------------------------
# The simulation fast path against the device path
# ---------------------------------------------------------------------------------------


def test_fast_path_has_the_device_paths_expected_counts() -> None:
    """E[c_jb] = (n / m) p* + E[T_jb] (q* - p*) with E[T_jb] = sum_v n_v / m [b in B_j(v)]:
    the mean of R fast-path tables against it, per cell, with the empirical std
    (normal approximation of a mean of R independent tables; 1e-6 over the m k cells)."""
    mech = rappor(k=16, h=2, m=4)
    values = ["x", "y", "z"]
    counts = np.array([3000, 2000, 1000])
    rng = np.random.default_rng(8)
    tables = np.array([mech.simulate_statistics(values, counts, rng).counts for _ in range(400)])
    tables = tables.reshape(400, 4, 17)
    assert np.all(tables[:, :, 0].sum(axis=1) == 6000)
    bits = mech.candidate_bits(values)
    expected_ones = np.zeros((4, 16))
    for v, count in enumerate(counts):
        for j in range(4):
            expected_ones[j, np.unique(bits[v, j])] += count / 4
    expected = 6000 / 4 * mech.p_star + expected_ones * (mech.q_star - mech.p_star)
    error = tables[:, :, 1:].mean(axis=0) - expected
    limit = z_two_sided(ALPHA, 64) * tables[:, :, 1:].std(axis=0, ddof=1) / math.sqrt(400)
    assert np.all(np.abs(error) <= limit)


@pytest.mark.parametrize(("k", "h", "m"), [(256, 3, 2), (1024, 2, 1)])
def test_wide_bloom_filters_decode(k: int, h: int, m: int) -> None:
    """k = 256 and 1024 (bits past 255 carry noise only): the strings are still found."""
    mech = rappor(k=k, h=h, m=m)
    statistics, truth = simulate(mech, np.random.default_rng(k), n=200_000)
    est = mech.estimate(
        statistics, candidates=list(TRUE + DECOYS[:10]), alpha=ALPHA, correction="bonferroni"
    )
    assert est.detected[:6].all() and not est.detected[6:].any()
    assert np.all(np.abs(est.frequencies[:6] - truth) <= z_two_sided(ALPHA, 6) * est.std[:6])


@pytest.mark.slow
def test_reports_from_a_single_cohort_decode_without_error() -> None:
    """When every report sits in one cohort, candidates can share their only Bloom bit
    there: their columns are equal and the fit must still succeed, splitting the mass
    between the aliased candidates instead of failing on a singular system."""
    mech = rappor(k=32, h=1, m=64)
    rng = np.random.default_rng(4)
    pool = [rng.bytes(16) for _ in range(64 * 1500)]
    secrets = [s for s in pool if mech.assign_cohort(s) == mech.assign_cohort(pool[0])]
    cohort = mech.assign_cohort(pool[0])
    candidates = ["example.com", "example.org", "example.net", "news.example", "mail.example"]
    bits = mech.candidate_bits(candidates)
    n = len(secrets)
    reports = mech.encode(
        ["example.net"] * n,
        rng=rng,
        context=DeviceContext(secrets=secrets, cohorts=np.full(n, cohort)),
    )
    est = mech.estimate(mech.aggregate(reports), candidates=candidates, correction="bonferroni")
    assert np.all(np.isfinite(est.frequencies)) and np.all(est.frequencies >= 0)
    assert est.frequencies.sum() <= 1 + 1e-9
    aliased = [i for i in range(5) if np.array_equal(bits[i, cohort], bits[2, cohort])]
    assert len(aliased) >= 1
    # The aliased group holds the whole share, within 5.3 of its standard errors (1e-6).
    group = est.frequencies[aliased].sum()
    assert abs(group - 1.0) <= 5.3 * max(est.std[aliased].max(), 1e-9), (group, est.std)
