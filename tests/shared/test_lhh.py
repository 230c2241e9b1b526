"""The longitudinal hierarchical histogram (``lhh``): spec, level oracles, exact privacy of
one report and of the permanent response, the permanent level and memoized responses,
ledger keys, the estimator per period, and the wire form.

Statistical tolerances (all seeds fixed, so outcomes are deterministic). Every check of
a random quantity is a test at level ALPHA = 1e-6, split by Bonferroni over the
assertions it makes, so a correct implementation fails one with probability below 1e-6;
with the 9 such items here the file fails falsely with probability below about 1e-5
for a random seed.

* Goodness of fit: Pearson chi-square against exact cell probabilities, cells expecting
  fewer than 100 counts pooled.
* Means: the mean of R estimates within z sqrt(V / R) of the truth, V the formula's
  variance averaged over the runs, z the two-sided normal quantile at ALPHA / K (K edges).
* Variances: (R - 1) s^2 / V is chi-square with R - 1 degrees of freedom for normal
  estimates (sums of thousands of independent bounded terms): s^2 / V must lie between
  its ALPHA / (2 K) and 1 - ALPHA / (2 K) quantiles (R = 1000, K = 63: 0.77..1.27).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from shared.mechanisms import DeviceContext, as_distribution, as_memoized, make_mechanism
from shared.mechanisms.abilities import DistributionValues, Memoized
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.lhh import (
    LEVEL_PURPOSE,
    LhhSpec,
    LongitudinalHierarchicalHistogram,
    memoized_level_oracle,
)
from shared.mechanisms.lue import LongitudinalOSUE
from shared.mechanisms.memoized import memo_key_bytes
from shared.mechanisms.registry import MECHANISMS
from shared.memo import KeyedMemo, SimulatedMemo, memo_scope
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics
from tests.distribution_checks import (
    ALPHA,
    assert_cdf_unbiased_with_stated_variance,
    assert_same_law,
    normal_bound,
    skewed,
)

RATIO_RTOL = 1e-12
#: Least expected count of a chi-square cell (rarer cells are pooled).
MIN_EXPECTED = 100.0
SCOPE = memo_scope("app.latency", 1)


def build(**fields: Any) -> LongitudinalHierarchicalHistogram:
    spec = MechanismSpec.model_validate({"mechanism": "lhh", "lower": 0, "upper": 1, **fields})
    mech = make_mechanism(spec)
    assert isinstance(mech, LongitudinalHierarchicalHistogram)
    return mech


def secret(label: str, index: int = 0) -> bytes:
    return hashlib.sha256(label.encode() + index.to_bytes(4, "big")).digest()


def midpoints(mech: LongitudinalHierarchicalHistogram) -> np.ndarray:
    """A value inside each bucket, bucket 0 first."""
    return (np.arange(mech.buckets) + 0.5) / mech.buckets


def output_columns(mech: LongitudinalHierarchicalHistogram, reports: np.ndarray) -> np.ndarray:
    """Each report's column of ``transition_matrix`` (and of ``permanent_matrix``): level 1's
    outputs first; an lgrr level's output is its index, a losue level's the integer whose
    bit j is node j's bit (``UnaryEncoding.transition_matrix``)."""
    widths = [
        2**mech.branching**level if mech.is_unary(level) else mech.branching**level
        for level in range(1, mech.height + 1)
    ]
    starts = np.concatenate([[0], np.cumsum(widths)])
    column = np.empty(reports.size, dtype=np.int64)
    for level in range(1, mech.height + 1):
        rows = np.flatnonzero(reports["level"] == level)
        if mech.is_unary(level):
            size = mech.branching**level
            bits = np.unpackbits(reports["bits"][rows], axis=1, count=size).astype(np.int64)
            output = bits @ (1 << np.arange(size))
        else:
            output = reports["value"][rows]
        column[rows] = starts[level - 1] + output
    return column


def assert_fits(observed: np.ndarray, probabilities: np.ndarray, alpha: float) -> None:
    """Pearson chi-square of counts against exact cell probabilities, rare cells pooled."""
    expected = probabilities * observed.sum()
    small = expected < MIN_EXPECTED
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert stats.chisquare(observed[keep], expected[keep]).pvalue > alpha


# --- spec -------------------------------------------------------------------------------


def test_defaults_are_hhs_and_published() -> None:
    spec = MechanismSpec.model_validate(
        {"mechanism": "lhh", "epsilon": 2, "epsilon_report": 1, "lower": 0, "upper": 9}
    )
    assert isinstance(spec, LhhSpec) and spec.is_memoized and spec.kind == "distribution"
    assert spec.model_dump() == {
        "mechanism": "lhh",
        "epsilon": 2.0,
        "epsilon_report": 1.0,
        "lower": 0.0,
        "upper": 9.0,
        "buckets": 256,
        "scale": "linear",
        "branching": 4,
    }
    assert MechanismSpec.model_validate_json(spec.model_dump_json()) == spec
    assert spec.report_epsilon == 1.0
    three = build(epsilon=2, epsilon_report=1, branching=3)
    assert (three.buckets, three.height) == (729, 6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "epsilon_report is required for the 'lhh' mechanism"),
        ({"epsilon_report": 2.0}, "epsilon_report must be < epsilon"),
        ({"epsilon_report": 3.0}, "epsilon_report must be < epsilon"),
        ({"epsilon_report": 1.0, "buckets": 100}, "buckets must be a power of branching"),
        ({"epsilon_report": 1.0, "branching": 17}, "less than or equal to 16"),
        ({"epsilon_report": 1.0, "scale": "log", "lower": 0}, "scale 'log' needs lower > 0"),
        ({"epsilon_report": 1.0, "domain_size": 4}, "domain_size does not apply"),
        ({"epsilon_report": 1.0, "flip_probability": 0.1}, "flip_probability does not apply"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    base = {"mechanism": "lhh", "epsilon": 2.0, "lower": 0, "upper": 9}
    with pytest.raises(ValidationError, match=message):
        MechanismSpec.model_validate({**base, **fields})


def test_is_a_memoized_distribution_mechanism() -> None:
    mech = build(epsilon=2.0, epsilon_report=0.7, buckets=64)
    assert MECHANISMS["lhh"] is LongitudinalHierarchicalHistogram
    assert as_distribution(mech) is mech and isinstance(mech, DistributionValues)
    assert as_memoized(mech) is mech and isinstance(mech, Memoized)
    assert mech.stateful and mech.kind == "distribution" and mech.height == 3
    assert (mech.epsilon_lifetime, mech.epsilon_report) == (2.0, 0.7)
    assert mech.payload_fields == frozenset({"level", "value", "bits"})
    np.testing.assert_allclose(mech.edges(), np.linspace(0, 1, 65))


# --- level oracles ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("epsilon", "epsilon_report"), [(0.5, 0.25), (1.0, 0.5), (2.0, 1.0), (4.0, 2.5), (8.0, 1.0)]
)
def test_each_level_uses_the_lower_variance_memoized_oracle(
    epsilon: float, epsilon_report: float
) -> None:
    """lgrr below d = 3 e^r + 2, losue above; neither lsue nor loue (where feasible) is ever
    lower than the choice."""
    for d in (2, 3, 4, 9, 16, 27, 64, 256, 1024, 4096):
        oracle = memoized_level_oracle(epsilon, epsilon_report, d)
        expected = LongitudinalGRR if d < 3 * math.exp(epsilon_report) + 2 else LongitudinalOSUE
        assert type(oracle) is expected, d
        assert (oracle.epsilon, oracle.epsilon_report, oracle.domain_size) == (
            epsilon,
            epsilon_report,
            d,
        )
        for name in ("lgrr", "lsue", "loue", "losue"):
            fields = {"epsilon": epsilon, "epsilon_report": epsilon_report, "domain_size": d}
            try:
                other = make_mechanism(MechanismSpec.model_validate({"mechanism": name, **fields}))
            except ValidationError:  # loue beyond its limit
                assert name == "loue"
                continue
            assert oracle.variance(1) <= other.variance(1) * (1 + 1e-12), (d, name)
    mech = build(epsilon=2.0, epsilon_report=1.0, buckets=256)
    assert [oracle.name for oracle in mech.oracles] == ["lgrr", "losue", "losue", "losue"]


# --- exact privacy ----------------------------------------------------------------------

#: (epsilon, epsilon_report, B, h): enumerable trees (a losue level has at most 9 nodes).
PRIVACY_CASES = [
    (1.0, 0.5, 2, 3),
    (0.5, 0.25, 3, 2),
    (0.2, 0.05, 2, 3),
    (4.0, 2.0, 2, 3),
    (2.0, 1.0, 3, 2),
    (3.0, 0.5, 4, 1),
    (6.0, 5.9, 2, 2),
    (0.01, 0.005, 2, 2),
]


def max_ratio(matrix: np.ndarray) -> float:
    top, bottom = matrix.max(axis=0), matrix.min(axis=0)
    assert np.all(bottom > 0)
    return float((top / bottom).max())


def test_privacy_cases_exercise_both_oracles() -> None:
    names = {
        oracle.name
        for eps, rep, b, h in PRIVACY_CASES
        for oracle in build(epsilon=eps, epsilon_report=rep, branching=b, buckets=b**h).oracles
    }
    assert names == {"lgrr", "losue"}


@pytest.mark.parametrize(("epsilon", "epsilon_report", "branching", "height"), PRIVACY_CASES)
def test_one_report_and_the_permanent_response_are_exactly_private(
    epsilon: float, epsilon_report: float, branching: int, height: int
) -> None:
    """One report's law (``transition_matrix``) has largest ratio at most e^epsilon_report
    and equal to it (tight); the permanent response's (``permanent_matrix``, any number of
    reports of one node) at most e^epsilon and equal to it. Both equal the level
    oracles' own realized ratios (certified exactly in test_lgrr.py, test_lue.py)."""
    mech = build(
        epsilon=epsilon,
        epsilon_report=epsilon_report,
        branching=branching,
        buckets=branching**height,
    )
    for matrix, oracle_matrix, bound in (
        (mech.transition_matrix(), "transition_matrix", epsilon_report),
        (mech.permanent_matrix(), "permanent_matrix", epsilon),
    ):
        assert matrix.shape[0] == mech.buckets
        np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-12, atol=0)
        ratio = max_ratio(matrix)
        levels = max(max_ratio(getattr(oracle, oracle_matrix)()) for oracle in mech.oracles)
        assert ratio == pytest.approx(levels, rel=RATIO_RTOL)
        assert ratio <= math.exp(bound) * (1 + RATIO_RTOL)
        assert ratio >= math.exp(bound) * (1 - RATIO_RTOL)
    values = np.array([-1.0, 0.0, 0.49, 0.5, 1.0, 3.0])
    np.testing.assert_array_equal(
        mech.transition_matrix(values), mech.transition_matrix()[mech.spec.bucket_of(values)]
    )


# --- samplers ---------------------------------------------------------------------------

#: lgrr over 2 and 4 nodes, losue over 8: every kind of column.
SAMPLER = {"epsilon": 1.0, "epsilon_report": 0.5, "branching": 2, "buckets": 8}


@pytest.mark.parametrize("memoized", [False, True], ids=["fresh", "simulated-memo"])
def test_encode_draws_from_the_transition_matrix(memoized: bool) -> None:
    """1.2 * 10^5 reports of one value by distinct devices against its matrix row."""
    mech = build(**SAMPLER)
    size, bucket = 120_000, 5
    values = np.full(size, (bucket + 0.5) / mech.buckets)
    memo = SimulatedMemo(np.arange(size), seed=11) if memoized else None
    reports = mech.encode(values, np.random.default_rng(8), DeviceContext(memo=memo))
    row = mech.transition_matrix()[bucket]
    assert_fits(np.bincount(output_columns(mech, reports), minlength=row.size), row, ALPHA)


def test_permanent_draws_from_the_permanent_matrix() -> None:
    mech = build(**SAMPLER)
    size, bucket = 120_000, 2
    values = np.full(size, (bucket + 0.5) / mech.buckets)
    responses = mech.permanent(values, SimulatedMemo(np.arange(size), seed=12))
    row = mech.permanent_matrix()[bucket]
    assert_fits(np.bincount(output_columns(mech, responses), minlength=row.size), row, ALPHA)


# --- the permanent level and the memoized responses -------------------------------------


def reference_level(words: list[int], height: int) -> int:
    """The module docstring's recipe: 1 + the first word masked to 2^ceil(log2 h) - 1 below h."""
    mask = (1 << (height - 1).bit_length()) - 1
    return 1 + next(word & mask for word in words if word & mask < height)


def test_the_level_is_permanent_per_device_and_follows_the_recipe() -> None:
    """Keyed devices: every report of one device, whatever its value, is at one level, the
    one the documented recipe gives, the same after a restart (a new memo object)."""
    mech = build(epsilon=2.0, epsilon_report=1.0, buckets=256)  # h = 4
    values = np.random.default_rng(4).random(12)
    for index in range(16):
        device = secret("level", index)
        words = KeyedMemo(device, SCOPE).draws(LEVEL_PURPOSE).words(32)[0].tolist()
        level = reference_level(words, mech.height)
        levels = {
            int(mech.encode(np.array([value]), context=DeviceContext(KeyedMemo(device, SCOPE)))[
                "level"
            ][0])
            for value in values
        }  # fmt: skip
        assert levels == {level}


def test_simulated_levels_are_uniform_and_kept_across_periods() -> None:
    """60,000 simulated devices over 3 periods with changing values: each keeps its level;
    the levels are uniform on 1..h (chi-square at ALPHA)."""
    mech = build(epsilon=2.0, epsilon_report=1.0, buckets=64)
    size = 60_000
    memo = SimulatedMemo(np.arange(size), seed=5)
    rng = np.random.default_rng(6)
    levels = [mech.encode(rng.random(size), rng, DeviceContext(memo=memo))["level"] for _ in "abc"]
    assert all(np.array_equal(levels[0], other) for other in levels[1:])
    observed = np.bincount(levels[0], minlength=mech.height + 1)[1:]
    assert_fits(observed, np.full(mech.height, 1 / mech.height), ALPHA)


def test_values_in_one_node_share_the_permanent_response() -> None:
    """One keyed device reports every bucket's value 3 times: values in the same node at
    its level carry the same permanent response (the node's), restarts included."""
    mech = build(epsilon=1.0, epsilon_report=0.5, branching=2, buckets=16)
    values = np.tile(midpoints(mech), 3)
    for index in range(8):
        device = secret("node", index)
        first = mech.permanent(values, KeyedMemo(device, SCOPE, size=values.size))
        again = mech.permanent(values, KeyedMemo(device, SCOPE, size=values.size))
        assert np.array_equal(first, again)
        level = int(first["level"][0])
        nodes = mech.nodes(mech.spec.bucket_of(values), level)
        for node in range(mech.branching**level):
            assert np.unique(first[nodes == node]).size == 1


def test_memoization_stops_reports_from_averaging_to_the_value() -> None:
    """200 devices report their unchanging value over 600 periods (B = 2, D = 8, every level
    lgrr, epsilon 4, epsilon_report 2). Memoized: every report of a device is at its level
    and the most frequent one is its permanent response (the mode's margin over any other
    output has mean 600 lam2 >= 298, lam2 the instantaneous keep probability, and sd at most
    25: 12 sd). Stateless (no memo): the most frequent leaf-level report is the device's
    bucket (about 200 leaf reports: margin mean 88, sd 11, 8 sd). Both miss with
    probability below 1e-9 over all devices."""
    mech = build(epsilon=4.0, epsilon_report=2.0, branching=2, buckets=8)
    assert all(oracle.name == "lgrr" for oracle in mech.oracles)
    devices, periods = 200, 600
    buckets = np.arange(devices) % mech.buckets
    rows = np.repeat(np.arange(devices), periods)
    values = ((buckets + 0.5) / mech.buckets)[rows]
    rng = np.random.default_rng(17)
    offsets = np.asarray(mech.offsets)

    def modes(reports: np.ndarray, keep: np.ndarray) -> np.ndarray:
        token = offsets[reports["level"] - 1] + reports["value"]  # unique per (level, value)
        width = offsets[-1]
        counts = np.bincount(rows[keep] * width + token[keep], minlength=devices * width)
        return np.asarray(counts.reshape(devices, width).argmax(axis=1))

    memoized = mech.encode(values, rng, DeviceContext(memo=SimulatedMemo(rows, seed=3)))
    permanent = mech.permanent(values[::periods], SimulatedMemo(np.arange(devices), seed=3))
    assert np.array_equal(memoized["level"].reshape(devices, periods)[:, 0], permanent["level"])
    assert np.all(np.ptp(memoized["level"].reshape(devices, periods), axis=1) == 0)
    expected = offsets[permanent["level"] - 1] + permanent["value"]
    assert np.array_equal(modes(memoized, np.ones(rows.size, dtype=bool)), expected)
    stateless = mech.encode(values, rng)
    leaf = stateless["level"] == mech.height
    assert np.array_equal(modes(stateless, leaf), offsets[-2] + buckets)


def test_ledger_keys_are_the_node_at_the_devices_level() -> None:
    """Per simulated device: memo key offsets[l - 1] + node, equal exactly for values in
    the same node at its level; ledger keys are their 8 big-endian bytes."""
    mech = build(epsilon=2.0, epsilon_report=1.0, branching=3, buckets=27)
    devices = 60
    rows = np.repeat(np.arange(devices), mech.buckets)
    values = np.tile(midpoints(mech), devices)
    memo = SimulatedMemo(rows, seed=9)
    keys = mech.memo_keys(values, memo).reshape(devices, mech.buckets)
    levels = mech.encode(values, np.random.default_rng(1), DeviceContext(memo=memo))["level"]
    levels = levels.reshape(devices, mech.buckets)[:, 0]
    assert set(levels.tolist()) == {1, 2, 3}
    for device, level in enumerate(levels.tolist()):
        nodes = np.arange(mech.buckets) // mech.branching ** (mech.height - level)
        np.testing.assert_array_equal(keys[device], mech.offsets[level - 1] + nodes)
        same = keys[device][:, None] == keys[device][None, :]
        np.testing.assert_array_equal(same, nodes[:, None] == nodes[None, :])
    one = DeviceContext(memo=SimulatedMemo(np.array([7]), seed=9))
    key = int(keys[7, 13])
    assert mech.ledger_keys(np.array([values[13]]), one) == [memo_key_bytes(key)]
    # Distinct nodes of different levels never share a key.
    every = [mech.offsets[level - 1] + node for level in (1, 2, 3) for node in range(3**level)]
    assert len(set(every)) == len(every) == mech.offsets[-1]


# --- statistics: fast path, unbiasedness, variance --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("epsilon", "epsilon_report", "branching", "buckets"),
    [(2.0, 1.0, 4, 64), (3.0, 1.5, 2, 32)],
)
def test_consistent_cdf_is_unbiased_with_the_stated_variance(
    epsilon: float, epsilon_report: float, branching: int, buckets: int
) -> None:
    """R = 1000 fast-path periods (exact: lgrr levels keep/uniform, losue bits binomial)
    at n = 10^5: every inner edge's mean and variance against hh's formula, with lgrr and
    losue levels (lgrr, losue, losue; lgrr x 3, losue x 2)."""
    mech = build(
        epsilon=epsilon, epsilon_report=epsilon_report, branching=branching, buckets=buckets
    )
    assert {oracle.name for oracle in mech.oracles} == {"lgrr", "losue"}
    rng = np.random.default_rng(int(epsilon * 100) + branching)
    assert_cdf_unbiased_with_stated_variance(mech, skewed(buckets, 100_000, rng), 1000, rng)


@pytest.mark.slow
def test_each_period_of_memoized_devices_has_the_fast_paths_law() -> None:
    """R = 3000 populations of 40 simulated devices report over 2 periods (a quarter of
    them change value in the second); each period's statistics against R fast-path draws
    of that period's buckets: two-sample chi-square on n_1, an lgrr count and a losue
    count (cells expecting fewer than 20 pooled; ALPHA / 6 each)."""
    mech = build(epsilon=2.0, epsilon_report=1.0, branching=4, buckets=16)  # lgrr(4), losue(16)
    runs, devices = 3000, 40
    first = np.array([0, 0, 3, 5, 5, 5, 9, 12, 15, 15] * 4)
    second = np.where(np.arange(devices) % 4 == 0, (first + 7) % 16, first)
    memo = SimulatedMemo(np.arange(runs * devices), seed=31)
    rng = np.random.default_rng(21)
    for buckets in (first, second):
        values = np.tile((buckets + 0.5) / 16, runs)
        reports = mech.encode(values, rng, DeviceContext(memo=memo))
        encoded = np.array(
            [mech.aggregate(reports[run * devices : (run + 1) * devices]).counts
             for run in range(runs)]
        )  # fmt: skip
        histogram = np.bincount(buckets, minlength=16)
        simulated = np.array([mech.simulate_statistics(histogram, rng).counts for _ in range(runs)])
        for column in (mech.offsets[-1], 1, mech.offsets[1] + 5):  # n_1, lgrr 1, losue 5
            assert_same_law(encoded[:, column], simulated[:, column], ALPHA / 6)


def test_estimates_from_encoded_reports() -> None:
    """One period of 50,000 simulated devices on a log scale, end to end (encode, aggregate,
    estimate): every inner edge's CDF within z(ALPHA / 15) standard deviations (the
    estimate's own) of the devices' own CDF."""
    mech = build(epsilon=3.0, epsilon_report=2.0, lower=1, upper=10_000, buckets=16, scale="log")
    rng = np.random.default_rng(5)
    values = 10 ** rng.uniform(0, 4, 50_000)
    memo = SimulatedMemo(np.arange(values.size), seed=2)
    estimate = mech.estimate(mech.aggregate(mech.encode(values, rng, DeviceContext(memo=memo))))
    assert estimate.scale == "log" and estimate.method == "consistency+isotonic"
    assert estimate.cdf[0] == 0 and estimate.cdf[-1] == 1 and estimate.n == values.size
    counts = np.bincount(mech.spec.bucket_of(values), minlength=16)
    truth = np.concatenate([[0], np.cumsum(counts)]) / values.size
    error = np.abs(estimate.cdf - truth)[1:-1] / np.sqrt(estimate.cdf_variance()[1:-1])
    assert error.max() < normal_bound(15)
    assert mech.variance(1000) == pytest.approx(mech.variance(10_000) * 10, rel=1e-12)


# --- reports and payloads ---------------------------------------------------------------


def test_encode_aggregate_and_payloads_round_trip() -> None:
    mech = build(epsilon=2.0, epsilon_report=1.0, buckets=64)  # lgrr(4), losue(16), losue(64)
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.random(3000), [-5.0, 0.0, 1.0, 7.0]])
    memo = SimulatedMemo(np.arange(values.size), seed=4)
    reports = mech.encode(values, rng, DeviceContext(memo=memo))
    assert reports.dtype == mech.report_dtype and reports.shape == (values.size,)
    assert mech.report_dtype["bits"].shape == (8,)
    assert set(np.unique(reports["level"])) == {1, 2, 3}
    assert np.all(reports["bits"][reports["level"] == 1] == 0)
    assert np.all(reports["value"][reports["level"] > 1] == 0)
    payloads = mech.to_payloads(reports)
    assert set(payloads[0]) == {"level", "value", "bits"} == mech.payload_fields
    sizes = {1: 0, 2: 2, 3: 8}
    assert all(len(base64.b64decode(p["bits"])) == sizes[p["level"]] for p in payloads)
    np.testing.assert_array_equal(mech.from_payloads(payloads), reports)
    statistics = mech.aggregate(reports)
    assert statistics.n == values.size and statistics.length == 4 + 16 + 64 + 3
    assert mech.statistics_from_bytes(statistics.to_bytes()) == statistics
    assert mech.aggregate(reports[:1000]) + mech.aggregate(reports[1000:]) == statistics
    for level in (1, 2, 3):  # each level's block is its oracle's statistics
        rows = reports[reports["level"] == level]
        oracle_reports = rows["value"] if level == 1 else rows["bits"][:, : sizes[level]].copy()
        expected = mech.oracle(level).aggregate(oracle_reports)
        start, stop = mech.offsets[level - 1], mech.offsets[level]
        np.testing.assert_array_equal(statistics.counts[start:stop], expected.counts)
        assert statistics.counts[mech.offsets[-1] + level - 1] == rows.size
    assert mech.aggregate(np.zeros(0, dtype=mech.report_dtype)) == mech.empty_statistics()
    assert mech.to_payloads(np.zeros(0, dtype=mech.report_dtype)) == []
    one = mech.encode(np.array([0.5]), context=DeviceContext(KeyedMemo(secret("one"), SCOPE)))
    assert one.shape == (1,) and mech.aggregate(one).n == 1


def bits_of(size: int, *set_bits: int) -> str:
    row = np.zeros(size * 8, dtype=bool)
    row[list(set_bits)] = True
    return base64.b64encode(np.packbits(row).tobytes()).decode()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"level": 0, "value": 0, "bits": ""}, "report 1: level = 0 is outside 1..3"),
        ({"level": 4, "value": 0, "bits": ""}, "report 1: level = 4 is outside 1..3"),
        ({"level": 1, "value": 4, "bits": ""}, r"value = 4 is outside 0..3 for level 1 \(lgrr"),
        ({"level": 1, "value": -1, "bits": ""}, "value = -1 is outside 0..3"),
        ({"level": 1, "value": 0, "bits": "AA=="}, r"'bits' holds 1 bytes, expected 0 \(an lgrr"),
        ({"level": 2, "value": 1, "bits": bits_of(2, 3)}, "value = 1 is outside 0..0 for level 2"),
        ({"level": 2, "value": 0, "bits": bits_of(1)}, "holds 1 bytes, expected 2 .16 bits"),
        ({"level": 3, "value": 0, "bits": "not base64!"}, "'bits' is not valid base64"),
        ({"level": 2, "value": 0}, "report 1: payload needs a base64 string 'bits'"),
        ({"level": 2, "bits": ""}, "report 1: payload needs an integer 'value'"),
        ({"level": True, "value": 0, "bits": ""}, "payload needs an integer 'level'"),
        ({"level": 1, "value": 0, "bits": "", "a": 1}, r"unexpected payload keys \['a'\]"),
    ],
)  # fmt: skip
def test_bad_payloads_name_the_first_one(payload: dict[str, Any], message: str) -> None:
    mech = build(epsilon=2.0, epsilon_report=1.0, buckets=64)
    good = {"level": 2, "value": 0, "bits": bits_of(2, 0, 15)}
    with pytest.raises(ValueError, match=message):
        mech.from_payloads([good, payload, {"level": 0, "value": 0, "bits": ""}])


def test_padding_bits_and_bad_records_are_refused() -> None:
    mech = build(epsilon=2.0, epsilon_report=1.0, branching=3, buckets=27)  # lgrr, lgrr, losue
    assert [oracle.name for oracle in mech.oracles] == ["lgrr", "lgrr", "losue"]
    padded = {"level": 3, "value": 0, "bits": bits_of(4, 27)}  # bit 27 of 27 bits
    with pytest.raises(ValueError, match=r"report 0: sets bits past bit 26 for level 3 \(losue"):
        mech.from_payloads([padded])
    reports = np.zeros(2, dtype=mech.report_dtype)
    reports["level"] = (2, 1)
    reports["bits"][1, 0] = 1
    with pytest.raises(ValueError, match=r"report 1: sets bits \(an lgrr level reports none\)"):
        mech.aggregate(reports)
    with pytest.raises(ValueError, match="one-dimensional array of dtype"):
        mech.aggregate(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="statistics have 5 counts"):
        mech.statistics_from_bytes(CountStatistics(1, np.ones(5, dtype=np.int64)).to_bytes())
    with pytest.raises(ValueError, match="NaN"):
        mech.encode(np.array([0.5, math.nan]))
    with pytest.raises(ValueError, match="one per value"):
        mech.encode(np.array([0.1, 0.2]), context=DeviceContext(SimulatedMemo([0, 1, 2], seed=1)))
    with pytest.raises(ValueError, match="one per value"):
        mech.memo_keys(np.array([0.1]), SimulatedMemo([0, 1], seed=1))


def test_report_bounds_are_the_oracles_own() -> None:
    """A record passes ``check_reports`` exactly when its level oracle accepts its part."""
    mech = build(epsilon=2.0, epsilon_report=1.0, branching=3, buckets=27)
    for level, value, bit in itertools.product((1, 2, 3), (-1, 0, 2, 3, 8, 9), (None, 0, 8, 26)):
        record = np.zeros(1, dtype=mech.report_dtype)
        record["level"], record["value"] = level, value
        if bit is not None:
            record["bits"][0, bit // 8] = 0x80 >> (bit % 8)
        d = 3**level
        if mech.is_unary(level):
            accepted = value == 0 and (bit is None or bit < d)
        else:
            accepted = 0 <= value < d and bit is None
        if accepted:
            mech.check_reports(record)
            continue
        with pytest.raises(ValueError, match="report 0"):
            mech.check_reports(record)
