"""The hierarchical histogram (``hh``): spec, wire form, exact privacy, the consistency
estimator against brute force, and its statistics against simulation.

Statistical tolerances (all seeds fixed). Every check on a random quantity is a test at
level ALPHA = 1e-6 (Bonferroni over the edges or ranges it covers), so a correct
implementation fails one with probability below 1e-6; the file holds about a dozen, so
it fails falsely with probability below about 1e-5.

* Means: the mean of R estimates is within z sqrt(V / R) of the truth, V the mechanism's
  variance (its formula, averaged over the runs), z the two-sided normal quantile at
  ALPHA / K for K edges.
* Variances: (R - 1) s^2 / V is chi-square with R - 1 degrees of freedom for normal
  estimates (each is a sum of many independent bounded terms); s^2 / V must lie between
  its ALPHA / (2 K) and 1 - ALPHA / (2 K) quantiles (at R = 2000, K = 63: 0.83..1.19).
* Coverage: the count of R = 400 intervals that hold the truth is at least the ALPHA
  quantile of Binomial(R, 0.95) (the whole-bucket intervals are conservative).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared.mechanisms import MECHANISMS, as_distribution, make_mechanism
from shared.mechanisms.abilities import DistributionValues
from shared.mechanisms.categorical import MAX_ENUMERATED_OUTPUTS
from shared.mechanisms.hh import (
    ConsistentTree,
    HierarchicalHistogram,
    sampling_versus_split,
)
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics
from tests.distribution_checks import (
    ALPHA,
    assert_cdf_unbiased_with_stated_variance,
    assert_same_law,
    normal_bound,
    skewed,
    variance_ratio_bounds,
)

RATIO_RTOL = 1e-12


def build(**fields: Any) -> HierarchicalHistogram:
    mech = make_mechanism(MechanismSpec.model_validate({"mechanism": "hh", **fields}))
    assert isinstance(mech, HierarchicalHistogram)
    return mech


# --- spec -------------------------------------------------------------------------------


def test_defaults_are_filled_in_and_published() -> None:
    spec = MechanismSpec.model_validate({"mechanism": "hh", "epsilon": 1, "lower": 0, "upper": 9})
    assert spec.model_dump() == {
        "mechanism": "hh",
        "epsilon": 1.0,
        "lower": 0.0,
        "upper": 9.0,
        "buckets": 256,
        "scale": "linear",
        "branching": 4,
    }
    assert MechanismSpec.model_validate_json(spec.model_dump_json()) == spec
    three = MechanismSpec.model_validate(
        {"mechanism": "hh", "epsilon": 1, "lower": 0, "upper": 9, "branching": 3}
    )
    assert three.model_dump()["buckets"] == 729
    assert build(epsilon=1, lower=0, upper=1, branching=16).buckets == 256


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"buckets": 100}, "buckets must be a power of branching (4): 4, 16, 64, 256, 1024, 4096; "
         "got 100"),
        ({"buckets": 8, "branching": 2, "scale": "log"}, "scale 'log' needs lower > 0"),
        ({"branching": 1}, "greater than or equal to 2"),
        ({"branching": 17}, "less than or equal to 16"),
        ({"buckets": 8192, "branching": 2}, "less than or equal to 4096"),
        ({"buckets": 27}, "got 27"),
        ({"domain_size": 4}, "domain_size does not apply to the 'hh' mechanism"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MechanismSpec.model_validate(
            {"mechanism": "hh", "epsilon": 1, "lower": 0, "upper": 9, **fields}
        )


def test_is_a_distribution_mechanism() -> None:
    mech = build(epsilon=1, lower=0, upper=10, buckets=64)
    assert MECHANISMS["hh"] is HierarchicalHistogram
    assert as_distribution(mech) is mech and isinstance(mech, DistributionValues)
    assert mech.kind == "distribution" and mech.height == 3
    np.testing.assert_allclose(mech.edges(), np.linspace(0, 10, 65))


def test_each_level_uses_the_lower_variance_oracle() -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=256)
    assert [oracle.name for oracle in mech.oracles] == ["grr", "olh", "olh", "olh"]
    for oracle in mech.oracles:
        other = "olh" if oracle.name == "grr" else "grr"
        spec = MechanismSpec.model_validate(
            {"mechanism": other, "epsilon": 1.0, "domain_size": oracle.domain_size}
        )
        assert oracle.variance(1) <= make_mechanism(spec).variance(1)


# --- reports ----------------------------------------------------------------------------


def test_encode_aggregate_and_payloads_round_trip() -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=64)
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.random(3000), [-5.0, 0.0, 1.0, 7.0]])
    reports = mech.encode(values, rng)
    assert reports.dtype == np.int64 and reports.shape == (values.size, 4)
    assert set(np.unique(reports[:, 0])) == {1, 2, 3}
    grr_rows = reports[reports[:, 0] == 1]
    assert np.all(grr_rows[:, 1:3] == 0)
    payloads = mech.to_payloads(reports)
    assert set(payloads[0]) == {"level", "a", "b", "value"} == mech.payload_fields
    np.testing.assert_array_equal(mech.from_payloads(payloads), reports)
    stats_ = mech.aggregate(reports)
    assert stats_.n == values.size and stats_.length == 4 + 16 + 64 + 3
    assert mech.statistics_from_bytes(stats_.to_bytes()) == stats_
    halves = mech.aggregate(reports[:1000]) + mech.aggregate(reports[1000:])
    assert halves == stats_
    for level in (1, 2, 3):  # each level's block is its oracle's statistics
        rows = reports[reports[:, 0] == level]
        oracle = mech.oracle(level)
        expected = oracle.aggregate(rows[:, 1:] if level > 1 else rows[:, 3])
        start, stop = mech.offsets[level - 1], mech.offsets[level]
        np.testing.assert_array_equal(stats_.counts[start:stop], expected.counts)
        assert stats_.counts[mech.offsets[-1] + level - 1] == rows.shape[0]
    assert mech.aggregate(np.zeros((0, 4), dtype=np.int64)) == mech.empty_statistics()
    one = mech.encode(np.array([0.5]))  # a device: the OS CSPRNG
    assert one.shape == (1, 4) and mech.aggregate(one).n == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ([0, 0, 0, 1], "report 1: level = 0 is outside 1..3"),
        ([1, 1, 0, 1], r"report 1: a = 1 is outside 0..0 for level 1 \(grr over 4 nodes\)"),
        ([1, 0, 0, 4], "report 1: value = 4 is outside 0..3 for level 1"),
        ([2, 0, 3, 1], r"report 1: a = 0 is outside 1..16 for level 2 \(olh over 16 nodes\)"),
        ([3, 5, 67, 0], "report 1: b = 67 is outside 0..66 for level 3"),
        ([3, 5, 6, 4], "report 1: value = 4 is outside 0..3 for level 3"),
    ],
)
def test_bad_reports_name_the_first_one(row: list[int], message: str) -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=64)
    reports = np.array([[1, 0, 0, 2], row, [0, 0, 0, 0]], dtype=np.int64)
    with pytest.raises(ValueError, match=message):
        mech.aggregate(reports)
    payloads = [dict(zip(("level", "a", "b", "value"), map(int, r), strict=True)) for r in reports]
    with pytest.raises(ValueError, match=message):
        mech.from_payloads(payloads)


def test_report_bounds_are_the_oracles_own() -> None:
    """Each level's table of (a, b, value) bounds in ``check_reports`` agrees with the
    level oracle's ``check_reports``: the corners pass it, one step outside fails it."""
    mech = build(epsilon=1, lower=0, upper=1, buckets=64)
    low, high = mech._field_bounds()
    for level in range(1, mech.height + 1):
        oracle = mech.oracle(level)

        def oracle_form(row: np.ndarray, level: int = level) -> np.ndarray:
            return row[None, :] if mech.uses_hash(level) else row[2:]

        for corner in (low[level - 1], high[level - 1]):
            oracle.check_reports(oracle_form(corner))
        for field in range(3) if mech.uses_hash(level) else (2,):
            for edge, step in ((low, -1), (high, 1)):
                row = edge[level - 1].copy()
                row[field] += step
                with pytest.raises(ValueError):
                    oracle.check_reports(oracle_form(row))


def test_bad_payloads_and_statistics_are_refused() -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=16)
    with pytest.raises(ValueError, match="report 0: payload needs an integer 'b'"):
        mech.from_payloads([{"level": 1, "a": 0, "value": 1}])
    with pytest.raises(ValueError, match="integer rows"):
        mech.aggregate(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="statistics have 5 counts"):
        mech.statistics_from_bytes(CountStatistics(1, np.ones(5, dtype=np.int64)).to_bytes())
    forged = np.zeros(4 + 16 + 2, dtype=np.int64)
    forged[-2:] = (3, 3)
    with pytest.raises(ValueError, match="level counts summing to n = 7"):
        mech.estimate(CountStatistics(7, forged))
    with pytest.raises(ValueError, match="cannot estimate from zero reports"):
        mech.estimate(mech.empty_statistics())


# --- exact privacy ----------------------------------------------------------------------


def enumerable(epsilon: float, branching: int, height: int) -> bool:
    """Whether every level's oracle can list its outputs (``require_enumerable``)."""
    for level in range(1, height + 1):
        d = branching**level
        mech = build(
            epsilon=epsilon, lower=0, upper=1, branching=branching, buckets=branching**height
        )
        oracle = mech.oracle(level)
        outputs = d
        if isinstance(oracle, OptimizedLocalHashing):
            outputs = (oracle.prime - 1) * oracle.prime * oracle.buckets
        if d * outputs > MAX_ENUMERATED_OUTPUTS:
            return False
    return True


PRIVACY_CASES = [
    (eps, b, h)
    for eps, b, h in itertools.product((0.5, 1.0, 3.0), (2, 3, 4), (1, 2, 3))
    if enumerable(eps, b, h)
]


def test_privacy_cases_exercise_both_oracles() -> None:
    names = {
        oracle.name
        for eps, b, h in PRIVACY_CASES
        for oracle in build(epsilon=eps, lower=0, upper=1, branching=b, buckets=b**h).oracles
    }
    assert names == {"grr", "olh"} and len(PRIVACY_CASES) >= 20


def max_ratio(matrix: np.ndarray) -> float:
    top, bottom = matrix.max(axis=0), matrix.min(axis=0)
    assert np.all(bottom > 0)
    return float((top / bottom).max())


@pytest.mark.parametrize(("epsilon", "branching", "height"), PRIVACY_CASES)
def test_likelihood_ratio_is_exactly_epsilon(epsilon: float, branching: int, height: int) -> None:
    """The full output law per bucket (level, oracle output): rows sum to 1, the largest
    ratio is at most e^eps and equals the levels' realized ratios (tight)."""
    mech = build(epsilon=epsilon, lower=0, upper=1, branching=branching, buckets=branching**height)
    matrix = mech.transition_matrix()
    assert matrix.shape[0] == branching**height
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12, atol=0)
    ratio = max_ratio(matrix)
    levels = max(max_ratio(np.asarray(oracle.transition_matrix())) for oracle in mech.oracles)
    assert ratio == pytest.approx(levels, rel=RATIO_RTOL)
    assert ratio <= math.exp(epsilon) * (1 + RATIO_RTOL)
    assert ratio >= math.exp(epsilon) * (1 - RATIO_RTOL)
    values = np.array([-1.0, 0.0, 0.49, 0.5, 1.0, 3.0])
    np.testing.assert_array_equal(
        mech.transition_matrix(values), matrix[mech.spec.bucket_of(values)]
    )


def test_encode_draws_from_the_matrix() -> None:
    """2 * 10^5 reports of one value against its matrix row (chi-square, ALPHA; cells
    expected below 100 pooled)."""
    mech = build(epsilon=1, lower=0, upper=1, buckets=16)  # levels grr(4), olh(16)
    row = mech.transition_matrix()[11]
    reports = mech.encode(np.full(200_000, 11.5 / 16), np.random.default_rng(8))
    olh = mech.oracle(2)
    assert isinstance(olh, OptimizedLocalHashing)
    level2 = ((reports[:, 1] - 1) * olh.prime + reports[:, 2]) * olh.buckets + reports[:, 3]
    column = np.where(reports[:, 0] == 1, reports[:, 3], 4 + level2)
    observed = np.bincount(column, minlength=row.size)
    expected = row * reports.shape[0]
    small = expected < 100
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    assert stats.chisquare(observed, expected).pvalue > ALPHA


# --- the consistency estimator against brute force -------------------------------------


def linear_map(tree: ConsistentTree) -> np.ndarray:
    """The (D, nodes) matrix of the consistent leaves' response to each node estimate."""
    b, h = tree.branching, tree.height
    columns = []
    for level in range(1, h + 1):
        for node in range(b**level):
            observed = [np.zeros(b**k) for k in range(h + 1)]
            observed[level][node] = 1.0
            columns.append(tree.consistent(observed, root=0.0)[-1])
    return np.array(columns).T


def all_pairs(buckets: int) -> tuple[np.ndarray, np.ndarray]:
    low, high = np.array(list(itertools.combinations_with_replacement(range(buckets + 1), 2))).T
    return low, high


def brute_variance(matrix: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """Var[F^_j - F^_i] = w^T Cov w for every pair (i <= j), w the difference of prefix rows."""
    prefix = np.vstack([np.zeros(matrix.shape[1]), np.cumsum(matrix, axis=0)])
    low, high = all_pairs(matrix.shape[0])
    weights = prefix[high] - prefix[low]
    return np.einsum("qi,ij,qj->q", weights, covariance, weights)


TREES = [(2, 2), (2, 3), (2, 4), (3, 2), (3, 3), (4, 2), (4, 3)]


@pytest.mark.parametrize(("branching", "height"), TREES)
def test_range_variance_matches_the_explicit_linear_map(branching: int, height: int) -> None:
    """Independent node estimates, heterogeneous variances, some levels empty (the leaf
    level too): every (low, high) to 1e-12 relative."""
    rng = np.random.default_rng(branching * 10 + height)
    for empty in ((), (1,), (height,), (1, height)):
        if len(set(empty)) == height:
            continue
        typical = np.concatenate([[np.inf], rng.uniform(0.3, 3.0, height)])
        sigma2 = [np.zeros(1)] + [rng.uniform(0.1, 2.0, branching**k) for k in range(1, height + 1)]
        for level in empty:
            typical[level], sigma2[level] = np.inf, np.zeros(branching**level)
        tree = ConsistentTree(branching, ConsistentTree.weights(typical, branching), tuple(sigma2))
        matrix = linear_map(tree)
        expected = brute_variance(matrix, np.diag(np.concatenate(sigma2[1:])))
        got = tree.range_variance(*all_pairs(branching**height))
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14 * expected.max())


def node_covariance(
    mech: HierarchicalHistogram, counts: np.ndarray, leaves: np.ndarray
) -> np.ndarray:
    """The covariance of every node estimate (levels 1..h) given the level counts, built
    from scratch: GRR levels multinomial (sum_u x_u (diag(pi_u) - pi_u pi_u^T) / (n_l
    (p - q)^2)), OLH levels per-node, and the level samples' finite-population covariance
    (A_l (diag x - x x^T) A_l'^T times (n - n_l) / (n_l (n - 1)) on a level, -1 / (n - 1)
    across levels)."""
    b, h, n = mech.branching, mech.height, int(counts.sum())
    aggregate = [np.kron(np.eye(b**k), np.ones((1, b ** (h - k)))) for k in range(1, h + 1)]
    population = np.diag(leaves) - np.outer(leaves, leaves)
    blocks: list[list[np.ndarray]] = []
    for l1 in range(1, h + 1):
        row = []
        for l2 in range(1, h + 1):
            sampling = aggregate[l1 - 1] @ population @ aggregate[l2 - 1].T
            n1 = counts[l1 - 1]
            if n1 == 0 or counts[l2 - 1] == 0:  # an empty level's estimate is not used
                row.append(np.zeros_like(sampling))
                continue
            if l1 != l2:
                row.append(-sampling / (n - 1))
                continue
            x = aggregate[l1 - 1] @ leaves
            oracle = mech.oracle(l1)
            p, q = oracle.p, oracle.q
            if mech.uses_hash(l1):
                noise = np.diag(
                    (q * (1 - q) + x * (p * (1 - p) - q * (1 - q))) / (n1 * (p - q) ** 2)
                )
            else:
                pi = q + (p - q) * np.eye(x.size)  # row u: the report law of a user at node u
                moment = np.einsum("u,uv->v", x, pi)
                second = np.einsum("u,uv,uw->vw", x, pi, pi)
                noise = (np.diag(moment) - second) / (n1 * (p - q) ** 2)
            row.append(noise + sampling * (n - n1) / (n1 * (n - 1)))
        blocks.append(row)
    return np.block(blocks)


@pytest.mark.parametrize(
    ("branching", "height", "epsilon"), [(2, 3, 1.0), (2, 4, 1.0), (3, 2, 0.5), (4, 2, 1.0),
                                         (3, 3, 2.0), (4, 3, 1.0)]
)  # fmt: skip
def test_variance_model_matches_the_explicit_covariance(
    branching: int, height: int, epsilon: float
) -> None:
    """``variance_model`` (what ``estimate`` reports) against w^T Cov w with the covariance
    built from scratch, at the true fractions, for every range; an internal level empty."""
    mech = build(epsilon=epsilon, lower=0, upper=1, branching=branching, buckets=branching**height)
    assert {oracle.name for oracle in mech.oracles} >= {"grr"}
    rng = np.random.default_rng(height * 7 + branching)
    leaves = rng.dirichlet(np.full(branching**height, 0.7))
    for counts in (rng.integers(50, 500, height), np.array([0] + [300] * (height - 1))):
        tree = mech.consistent_tree(counts, float(counts.sum()))
        fractions = [leaves.reshape(branching**k, -1).sum(axis=1) for k in range(height + 1)]
        model = mech.variance_model(tree, counts, float(counts.sum()), fractions)
        covariance = node_covariance(mech, counts, leaves)
        expected = brute_variance(linear_map(tree), covariance)
        got = model(*all_pairs(branching**height))
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-13 * expected.max())


@pytest.mark.parametrize(("branching", "height"), TREES)
def test_consistency_is_the_weighted_least_squares_solution(branching: int, height: int) -> None:
    """u minimizes sum_l sum_v (A_v x - y_v)^2 / tau^2_l subject to sum x = 1 (numpy lstsq
    on the null space of the constraint), with and without an empty internal level."""
    rng = np.random.default_rng(height * 5 + branching)
    leaves = branching**height
    basis = np.linalg.svd(np.ones((1, leaves)))[2][1:].T  # orthonormal, sums to 0
    centre = np.full(leaves, 1.0 / leaves)
    for empty in ((), (1,)):
        typical = np.concatenate([[np.inf], rng.uniform(0.3, 3.0, height)])
        for level in empty:
            typical[level] = np.inf
        zeros = tuple(np.zeros(branching**k) for k in range(height + 1))
        tree = ConsistentTree(branching, ConsistentTree.weights(typical, branching), zeros)
        observed = [np.ones(1)] + [
            rng.normal(branching**-k, 0.3, branching**k) for k in range(1, height + 1)
        ]
        design = np.vstack(
            [
                np.kron(np.eye(branching**k), np.ones(branching ** (height - k)))
                for k in range(1, height + 1)
            ]
        )
        weight = np.sqrt(
            np.concatenate(
                [np.full(branching**k, 1 / typical[k] if np.isfinite(typical[k]) else 0.0)
                 for k in range(1, height + 1)]
            )
        )  # fmt: skip
        target = np.concatenate(observed[1:]) - design @ centre
        solution = np.linalg.lstsq(weight[:, None] * design @ basis, weight * target, rcond=None)[0]
        np.testing.assert_allclose(
            tree.consistent(observed)[-1], centre + basis @ solution, rtol=0, atol=1e-12
        )


def test_decomposition_is_minimal_and_exact() -> None:
    mech = build(epsilon=1, lower=0, upper=1, branching=3, buckets=81)
    for low, high in itertools.combinations(range(82), 2):
        covered = np.zeros(81, dtype=int)
        per_level: dict[int, int] = {}
        for level, first, stop in mech.decompose(low, high):
            width = 3 ** (4 - level)
            covered[first * width : stop * width] += 1
            per_level[level] = per_level.get(level, 0) + stop - first
        assert np.array_equal(covered, (np.arange(81) >= low) & (np.arange(81) < high))
        assert all(count <= 2 * (3 - 1) for count in per_level.values())
    assert mech.decompose(0, 81) == [(0, 0, 1)]


# --- sampling against splitting the budget ----------------------------------------------


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("buckets", [256, 1024])
def test_level_sampling_beats_splitting_the_budget(epsilon: float, buckets: int) -> None:
    """Per node, summed over levels: h V(eps) + (h - 1) / 4 (sampling, worst case of its
    sampling term) against V(eps / h) (split), B = 4."""
    sampling, split = sampling_versus_split(epsilon, 4, buckets)
    assert sampling < split
    assert split / sampling > 3.0  # 3.3x (eps 4, D 256) to 5.9x (eps 2, D 1024)


# --- statistics: the simulation fast path, unbiasedness, variance, coverage -------------


@pytest.mark.slow
def test_simulated_statistics_follow_the_encoded_law() -> None:
    """At n = 40 users (fixed buckets), R = 3000 runs each way: the distributions of n_1, a
    GRR count and an OLH count agree (two-sample chi-square on their histograms, cells
    with fewer than 20 expected pooled, ALPHA / 3 each)."""
    mech = build(epsilon=1, lower=0, upper=1, buckets=16)
    buckets = np.bincount(np.array([0, 0, 3, 5, 5, 5, 9, 12, 15, 15] * 4), minlength=16)
    values = np.repeat((np.arange(16) + 0.5) / 16, buckets)
    rng = np.random.default_rng(21)
    runs = 3000
    encoded = np.array([mech.aggregate(mech.encode(values, rng)).counts for _ in range(runs)])
    simulated = np.array([mech.simulate_statistics(buckets, rng).counts for _ in range(runs)])
    for column in (mech.offsets[-1], 1, mech.offsets[1] + 5):  # n_1, grr count 1, olh item 5
        assert_same_law(encoded[:, column], simulated[:, column], ALPHA / 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("epsilon", "branching", "buckets"), [(1.0, 4, 64), (0.5, 2, 32), (4.0, 4, 64)]
)
def test_consistent_cdf_is_unbiased_with_the_stated_variance(
    epsilon: float, branching: int, buckets: int
) -> None:
    """R = 2000 fast-path runs (exact for GRR levels and for the level split; OLH items
    independent) at n = 10^5: every inner edge's mean and variance (module docstring)."""
    mech = build(epsilon=epsilon, lower=0, upper=1, branching=branching, buckets=buckets)
    rng = np.random.default_rng(int(epsilon * 100) + branching)
    assert_cdf_unbiased_with_stated_variance(mech, skewed(buckets, 100_000, rng), 2000, rng)


@pytest.mark.slow
def test_raw_ranges_are_unbiased_with_the_stated_variance() -> None:
    """Cormode et al.'s raw estimate over R = 2000 fast-path runs, GRR levels only (eps = 4,
    B = 4: the fast path is the exact law, and so is the variance formula), for ranges
    that use 1, 2 and 3 levels; and unbiased with OLH levels (eps = 1: the mean depends
    only on each count's own law, which the fast path draws exactly)."""
    ranges = [(5, 6), (3, 17), (1, 63), (0, 40)]
    for epsilon, check_variance in ((4.0, True), (1.0, False)):
        mech = build(epsilon=epsilon, lower=0, upper=1, buckets=64)
        assert (mech.oracles[-1].name == "grr") is check_variance
        rng = np.random.default_rng(31)
        counts = skewed(64, 20_000, rng)
        truth = np.concatenate([[0], np.cumsum(counts)]) / counts.sum()
        runs = 2000
        results = np.empty((runs, len(ranges), 2))
        for run in range(runs):
            statistics = mech.simulate_statistics(counts, rng)
            results[run] = [mech.raw_range(statistics, low, high) for low, high in ranges]
        exact = np.array([truth[high] - truth[low] for low, high in ranges])
        variance = results[:, :, 1].mean(axis=0)
        z = (results[:, :, 0].mean(axis=0) - exact) / np.sqrt(variance / runs)
        assert np.abs(z).max() < normal_bound(2 * len(ranges))
        if check_variance:
            low, high = variance_ratio_bounds(runs, len(ranges))
            ratio = results[:, :, 0].var(axis=0, ddof=1) / variance
            assert low < ratio.min() and ratio.max() < high, ratio


@pytest.mark.slow
def test_quantile_intervals_cover() -> None:
    """400 fast-path runs at n = 2 * 10^4: the 95% intervals of the median and the 0.95
    quantile each hold the true quantile in at least the ALPHA quantile of
    Binomial(400, 0.95) runs."""
    mech = build(epsilon=1, lower=0, upper=1, buckets=256)
    rng = np.random.default_rng(41)
    counts = skewed(256, 20_000, rng)
    cumulative = np.cumsum(counts) / counts.sum()
    edges = mech.edges()
    covered = np.zeros(2, dtype=int)
    runs = 400
    for _ in range(runs):
        answers = mech.estimate(mech.simulate_statistics(counts, rng)).quantiles([0.5, 0.95])
        for k, answer in enumerate(answers):
            bucket = int(np.searchsorted(cumulative, answer.q, side="left"))  # F_b < q <= F_b+1
            covered[k] += answer.ci_low <= edges[bucket] and edges[bucket + 1] <= answer.ci_high
    assert covered.min() >= stats.binom.ppf(ALPHA, runs, 0.95)


def test_log_scale_buckets_and_estimates() -> None:
    mech = build(epsilon=2, lower=1, upper=10_000, buckets=16, scale="log")
    np.testing.assert_allclose(mech.edges(), 10 ** (np.arange(17) / 4), rtol=1e-12)
    values = np.array([0.5, 1.0, 1.7, 10.0, 99.0, 10_000.0, 1e9])
    np.testing.assert_array_equal(mech.spec.bucket_of(values), [0, 0, 0, 4, 7, 15, 15])
    rng = np.random.default_rng(5)
    estimate = mech.estimate(mech.aggregate(mech.encode(10 ** rng.uniform(0, 4, 50_000), rng)))
    assert estimate.scale == "log" and estimate.method == "consistency+isotonic"
    median = estimate.quantiles([0.5])[0]
    assert median.ci_low <= 100.0 <= median.ci_high
    assert estimate.postprocessed.min() >= 0 and estimate.postprocessed.sum() == pytest.approx(1)


def test_simulation_handles_huge_populations_and_empty_levels() -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=1024)
    rng = np.random.default_rng(2)
    huge = mech.simulate_statistics(np.full(1024, 10**8), rng)
    assert huge.n == 1024 * 10**8
    assert np.abs(mech.estimate(huge).fractions() - 1 / 1024).max() < 1e-4
    tiny = build(epsilon=1, lower=0, upper=1, buckets=16)  # two levels
    reports = np.array([[2, 3, 4, 1], [2, 1, 0, 2]], dtype=np.int64)  # level 1 empty
    estimate = tiny.estimate(tiny.aggregate(reports))
    assert estimate.cdf[0] == 0 and estimate.cdf[-1] == 1
    assert np.all(np.isfinite(estimate.cdf_variance()))
    with pytest.raises(ValueError, match="level 1 has no reports"):
        tiny.raw_range(tiny.aggregate(reports), 0, 8)
    top_only = tiny.estimate(tiny.aggregate(np.array([[1, 0, 0, 2], [1, 0, 0, 1]])))
    leaves = top_only.fractions()  # no leaf report: each level-1 node split evenly
    np.testing.assert_allclose(leaves.reshape(4, 4), leaves.reshape(4, 4)[:, :1] @ np.ones((1, 4)))
    assert np.all(np.isfinite(top_only.cdf_variance()))


def test_planning_variance_is_the_worst_bucket_at_uniform_data() -> None:
    mech = build(epsilon=1, lower=0, upper=1, buckets=256)
    assert mech.variance(1000) == pytest.approx(mech.variance(10_000) * 10, rel=1e-12)
    # consistency beats the raw leaf estimate, h V_leaf / n plus the sampling term
    raw_leaf = mech.height * mech.oracles[-1].variance(1)
    assert 0 < mech.variance(1) < raw_leaf
