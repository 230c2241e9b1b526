"""The distribution benchmark (``simulations.benchmarks.distribution_bench``): its measures
and conventions at tiny sizes, the peer's bucket convention, and a ``--quick`` run.

The peer, ldp-hierarchical-mechanism, is only in the ``bench`` extra, which CI does not
install: the tests that run it skip and say so when it does not import.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.mechanisms.spec import DistributionSpec
from simulations.benchmarks.distribution_bench import (
    WIDE_SHARE,
    Population,
    Target,
    bucket_rank_error,
    distribution_spec,
    first_crossing,
    law_population,
    load_peer,
    main,
    peer_quantile,
    peer_run,
    random_ranges,
    ratio,
)


@pytest.fixture(scope="module")
def peer() -> Any:
    """The peer's tree class; the test skips, saying why, when the peer does not import
    (imported here, not at collection: it pulls in scikit-learn and statsmodels)."""
    tree_class, status = load_peer()
    if tree_class is None:
        pytest.skip(
            f"ldp-hierarchical-mechanism (the bench-distribution extra) does not import: {status}"
        )
    return tree_class


def test_random_ranges_are_ordered_and_wide_ones_cover_a_tenth() -> None:
    rng = np.random.default_rng(1)
    low, high = random_ranges(64, 500, rng)
    assert low.shape == high.shape == (500,)
    assert np.all(low < high) and low.min() >= 0 and high.max() <= 64
    low, high = random_ranges(64, 500, rng, wide=True)
    assert low.size == 500 and np.all(high - low > WIDE_SHARE * 64)


def test_bucket_rank_error_is_the_distance_to_the_bucket_ranks() -> None:
    cdf = np.array([0.0, 0.2, 0.5, 1.0])  # bucket 1 holds ranks [0.2, 0.5]
    assert bucket_rank_error(cdf, 1, 0.3) == 0.0
    assert bucket_rank_error(cdf, 1, 0.6) == pytest.approx(0.1)
    assert bucket_rank_error(cdf, 2, 0.3) == pytest.approx(0.2)


def test_population_cdf_ranks_and_quantiles() -> None:
    values = np.array([1.0, 2.0, 2.0, 5.0])
    population = Population(np.array([1, 2, 1]), values)
    assert population.cdf.tolist() == [0.0, 0.25, 0.75, 1.0]
    assert population.rank(2.0) == 0.75 and population.rank(0.5) == 0.0
    assert population.quantile(0.5) == 2.0 and population.quantile(0.99) == 5.0


def test_law_population_holds_every_user() -> None:
    spec = distribution_spec("hh", 1.0, 64, 4)
    assert isinstance(spec, DistributionSpec)
    population = law_population(spec, 123_457, seed=3)
    assert population.n == 123_457 and population.counts.size == 64


def test_verdicts_flag_ratios_within_two_standard_errors() -> None:
    assert Target("1", "x", 0.5, 0.01, 0.7, at_most=True).verdict == "PASS"
    assert Target("1", "x", 0.69, 0.02, 0.7, at_most=True).verdict == "PASS?"
    assert Target("2", "x", 2.0, 0.1, 3.0, at_most=False).verdict == "FAIL"
    assert Target("4", "x", math.nan, math.nan, 60.0, at_most=True).verdict == "-"
    value, se = ratio(2.0, 0.2, 4.0, 0.4)  # relative errors 0.1 and 0.1
    assert value == 0.5 and se == pytest.approx(0.5 * math.sqrt(0.02))


@pytest.mark.slow  # importing the peer (scikit-learn, statsmodels) takes seconds
def test_peer_leaves_are_our_buckets(peer: Any) -> None:
    """Every user in bucket 5 of 16: the peer's CDF must step at edge 6 (its leaf k is our
    bucket k, its cdf[k] our F at edge k + 1). At epsilon 10 its OUE node estimates have
    std about sqrt(p (1 - p) / n_l) / p = 0.03 (p = 1/2, n_l = 1000 per level), so 0.25
    is 8 std: a false failure is below 1e-12; a shift by one bucket would err by 1.

    Its ``get_quantile`` returns the leaf whose CDF is closest above q, which on the
    plateau after the step is any leaf from 5 on; the first crossing is 5."""
    buckets = np.full(2000, 5)
    tree = peer_run(peer, 10.0, 4, buckets, 16, seed=7)
    cdf = np.concatenate([[0.0], np.asarray(tree.cdf)])
    truth = (np.arange(17) >= 6).astype(float)
    assert np.max(np.abs(cdf - truth)) < 0.25
    assert first_crossing(tree.cdf, 0.5) == 5
    bucket, answered = peer_quantile(tree, 0.5)
    assert answered and 5 <= bucket < 16


@pytest.mark.slow
def test_quick_run_prints_every_table(
    peer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "distribution.json"
    code = main(["--quick", "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for title in ("\n1. against", "\n2. hh against", "\n2b. ", "\n3. quantiles", "\n4. scale"):
        assert title in printed
    assert "\n5. sw and hh" in printed
    document = json.loads(out.read_text())
    labels = {target["label"] for target in document["targets"]}
    assert {"range MSE", "encode /s", "aggregate /s", "flat/hh wide-range MSE"} <= labels
    assert document["failures"] == []
