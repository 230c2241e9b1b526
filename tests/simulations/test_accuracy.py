"""Accuracy sweeps: populations, the two paths, seeds, and a real Dask LocalCluster."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from simulations import execution
from simulations.accuracy import (
    FrequencyCell,
    NumericCell,
    run_frequency,
    run_numeric,
    summarize,
)
from simulations.populations import (
    apportion,
    parse_categorical_shape,
    parse_numeric_shape,
)

ZIPF = parse_categorical_shape("zipf:1.1")


def test_apportion_is_exact_and_proportional() -> None:
    counts = apportion(np.array([1.0, 2.0, 3.0, 0.0]), 1001)
    assert counts.sum() == 1001
    np.testing.assert_allclose(counts, np.array([1, 2, 3, 0]) / 6 * 1001, atol=1)
    assert counts[3] == 0


def test_zipf_shape_decreases() -> None:
    counts = ZIPF.counts(50, 10_000)
    assert counts.sum() == 10_000
    assert np.all(np.diff(counts) <= 0)
    assert counts[0] / counts[9] == pytest.approx(10**1.1, rel=0.02)


def test_counts_file_shape(tmp_path: Path) -> None:
    path = tmp_path / "pages.csv"
    path.write_text("page,count\nhome,50\nnews,30\nshop,20\n")
    shape = parse_categorical_shape(f"counts:{path}")
    assert shape.counts(3, 1000).tolist() == [500, 300, 200]
    with pytest.raises(ValueError, match="--domain-sizes 3"):
        shape.counts(4, 1000)
    path.write_text("home,50\nnews,x\n")
    with pytest.raises(ValueError, match="not an integer"):
        parse_categorical_shape(f"counts:{path}")
    with pytest.raises(ValueError, match="does not exist"):
        parse_categorical_shape(f"counts:{tmp_path / 'missing.csv'}")


@pytest.mark.parametrize("text", ["zipf", "zipf:-1", "zipf:abc", "pareto", "uniform:3"])
def test_bad_categorical_shapes_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="shape"):
        parse_categorical_shape(text)


@pytest.mark.parametrize("text", ["normal:1", "normal:0,-1", "exponential:0", "beta:1,2"])
def test_bad_numeric_shapes_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="shape"):
        parse_numeric_shape(text)


def test_numeric_population_matches_its_shape() -> None:
    population = parse_numeric_shape("normal:3,1").population(0.0, 10.0, 100_000)
    assert population.n == 100_000
    assert population.mean == pytest.approx(3.0, abs=0.01)
    exponential = parse_numeric_shape("exponential:2").population(0.0, 50.0, 100_000)
    assert exponential.mean == pytest.approx(2.0, abs=0.02)


def _frequency_cells() -> list[FrequencyCell]:
    return [
        FrequencyCell(name, epsilon, 16, 20_000, ZIPF)
        for name in ("grr", "oue", "olh", "hr")
        for epsilon in (1.0, 2.0)
    ]


@pytest.mark.parametrize("path", ["exact", "fast"])
def test_mse_matches_theory(path: str) -> None:
    """Mean MSE over 40 repetitions against the analytical MSE. The MSE of one run is
    a mean of d = 16 squared errors: its relative sd is at most sqrt(2 / 1) (one
    dominant item), so over 40 runs the mean's relative sd is below 0.23; a ratio
    outside [0.3, 2] is past 3 sd (false-failure about 1e-3 per cell under the normal
    approximation in that worst case, far less with 16 items sharing the weight; the
    fixed seed makes it deterministic)."""
    rows = summarize(run_frequency(_frequency_cells(), 40, path, seed=3, progress=False))  # type: ignore[arg-type]
    for row in rows:
        assert 0.3 < row["ratio"] < 2.0, row
        assert 0.85 < row["coverage"] <= 1.0, row


def test_exact_path_shards_merge() -> None:
    """One repetition split into shards gives a full-size estimate."""
    cells = [FrequencyCell("oue", 2.0, 16, 10_000, ZIPF)]
    outcomes = run_frequency(cells, 2, "exact", seed=4, progress=False, shard_users=3000)
    assert len(outcomes) == 2
    assert all(o.metrics["mse"] < 5 * o.metrics["variance"] for o in outcomes)


def test_same_seed_same_results_and_different_seed_different() -> None:
    cells = _frequency_cells()[:3]
    first = run_frequency(cells, 2, "fast", seed=5, progress=False)
    again = run_frequency(cells, 2, "fast", seed=5, progress=False)
    other = run_frequency(cells, 2, "fast", seed=6, progress=False)
    assert [o.metrics for o in first] == [o.metrics for o in again]
    assert [o.metrics for o in first] != [o.metrics for o in other]


def test_numeric_sweep_is_unbiased() -> None:
    cells = [
        NumericCell(name, 1.0, 5000, parse_numeric_shape("normal:0.3,0.1"), 0.0, 1.0)
        for name in ("laplace", "duchi", "piecewise")
    ]
    for path in ("exact", "fast"):
        rows = summarize(run_numeric(cells, 30, path, seed=7, progress=False))  # type: ignore[arg-type]
        for row in rows:
            # Mean of 30 squared standard-normal multiples: chi2(30)/30 lies in [0.3, 2]
            # but with probability ~1e-4.
            assert 0.3 < row["ratio"] < 2.0, row


@pytest.mark.slow
def test_local_dask_cluster_gives_the_same_results() -> None:
    """A real dask.distributed LocalCluster of 2 worker processes, exact path with
    shards: the results equal the in-process run's for the same seed."""
    cells = [FrequencyCell("grr", 1.0, 16, 6000, ZIPF), FrequencyCell("oue", 1.0, 16, 6000, ZIPF)]
    local = run_frequency(cells, 2, "exact", seed=8, progress=False, shard_users=2500)
    dask = run_frequency(cells, 2, "exact", seed=8, progress=False, shard_users=2500, workers=2)
    assert [o.metrics for o in local] == [o.metrics for o in dask]
    assert all(math.isfinite(o.metrics["mse"]) for o in dask)


def test_unreachable_scheduler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execution, "SCHEDULER_CONNECT_TIMEOUT", "0.5s")
    cells = [FrequencyCell("grr", 1.0, 16, 100, ZIPF)]
    with pytest.raises(ConnectionError, match="Dask scheduler"):
        run_frequency(cells, 1, "fast", progress=False, scheduler="tcp://127.0.0.1:9")
