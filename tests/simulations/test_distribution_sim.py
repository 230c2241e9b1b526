"""``ldp-sim distribution``: range, quantile and Wasserstein errors of the distribution
mechanisms, by the fast path and by every user encoded.

What is checked:

* the shapes: values drawn from each fall in the buckets as often as its bucket
  probabilities say (chi-square), and its quantiles invert its CDF;
* the measures: Wasserstein-1 on the grid against closed forms, ranges uniform over the
  pairs of edges (chi-square) and wide ones wider than a tenth of the buckets;
* the fast path and the exact path agree in law: per mechanism, the mean over runs of
  the range MSE and of the wide-range MSE by each path, a two-sample z test;
* on a modest fast sweep, the CDF intervals cover 95% of the time, the quantile
  intervals at least 95%, and the range MSE matches the variance the mechanism states;
* 10^8 users per cell run (the fast path is O(D h) whatever n);
* the command end to end: results.csv with the documented columns, results.json, one PNG
  per shape, the table; --quick; errors named; help as plain text with its defaults.

False failures. Each two-sided z check is at Z_TWO = 4.417 (1e-5), each one-sided one at
Z_ONE = 4.265 (1e-5), each chi-square at 1e-6; about 40 checks in all: at most about 4e-4
for the file. The coverage checks bound the variance of a run's share of covered edges
by pbar (1 - pbar) (a mean of Bernoulli indicators, however correlated, varies at most as
much as one of them would at their mean rate), so the tolerance z sqrt(0.95 x 0.05 / R)
over R independent runs is conservative.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from simulations import distribution
from simulations.cli import build_parser, main
from simulations.distribution import (
    COLUMNS,
    SHAPES,
    DistributionCell,
    distribution_mechanisms,
    draw_ranges,
    grid_wasserstein,
    simulate,
)
from simulations.text import shown

#: Two-sided and one-sided normal quantiles of a 1e-5 false failure.
Z_TWO = 4.417
Z_ONE = 4.265
P_FLOOR = 1e-6
MECHANISMS = distribution_mechanisms()


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


# --- shapes and measures --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SHAPES))
def test_values_drawn_from_a_shape_fill_its_buckets_as_its_law_says(name: str) -> None:
    shape = SHAPES[name]
    spec = DistributionCell("hh", name, 1.0, 1, 64, 4).spec()
    n = 200_000
    values = shape.sample(n, np.random.default_rng(list(SHAPES).index(name)))
    assert values.min() >= shape.lower and values.max() <= shape.upper
    expected = n * shape.bucket_probabilities(spec.edges())
    observed = np.bincount(spec.bucket_of(values), minlength=expected.size)
    keep = expected > 5  # pool the sparse tail buckets into one cell
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    _, p_value = stats.chisquare(observed, expected)
    assert p_value > P_FLOOR, (name, p_value)


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_shapes_quantiles_invert_its_cdf(name: str) -> None:
    shape = SHAPES[name]
    levels = np.array([0.01, 0.5, 0.9, 0.95, 0.99])
    assert np.allclose(shape.cdf(shape.quantile(levels)), levels, atol=1e-12)
    assert shape.cdf(shape.lower) == 0.0 and shape.cdf(shape.upper) == 1.0


def test_pareto_has_its_closed_form_quantiles() -> None:
    """P(X > x) = (10 / x)^1.5, truncated at 10^4: G^-1(q) = 10 (1 - q m)^(-1/1.5) with m
    the mass below 10^4."""
    mass = 1 - (10 / 10_000) ** 1.5
    levels = np.array([0.5, 0.99])
    closed = 10 * (1 - levels * mass) ** (-1 / 1.5)
    assert np.allclose(SHAPES["pareto"].quantile(levels), closed, rtol=1e-12)


def test_wasserstein_on_the_grid_has_its_closed_forms() -> None:
    edges = np.linspace(0.0, 8.0, 9)  # D = 8, width 1
    first = np.concatenate([[0.0], np.ones(8)])  # all mass in bucket 0
    last = np.concatenate([np.zeros(8), [1.0]])  # all in bucket 7
    assert grid_wasserstein(edges, first, last) == pytest.approx(7.0)  # (D - 1) widths
    assert grid_wasserstein(edges, first, first) == 0.0
    # Shares (1, 0, 0) against (0.5, 0.5, 0): half the mass one bucket up, W1 = 0.5 width.
    base = np.array([0.0, 1.0, 1.0, 1.0])
    shifted = np.array([0.0, 0.5, 1.0, 1.0])
    assert grid_wasserstein(np.arange(4.0), base, shifted) == pytest.approx(0.5)
    # Every share one bucket up: W1 = one width, whatever the shares.
    assert grid_wasserstein(np.arange(4.0), shifted, [0.0, 0.0, 0.5, 1.0]) == pytest.approx(1.0)
    # A crossing inside a bucket: d goes from +0.2 to -0.2, two triangles of 0.05 each.
    crossing = grid_wasserstein(np.array([0.0, 1.0]), np.array([0.2, -0.2]), np.zeros(2))
    assert crossing == pytest.approx(0.1)


def test_ranges_are_uniform_over_the_pairs_of_edges() -> None:
    """D = 3: the 6 pairs a < b of edges 0..3 equally likely; wide ones (b - a >= 2): 3."""
    rng = np.random.default_rng(1)
    low, high = draw_ranges(rng, 3, 60_000)
    assert np.all(low < high) and low.min() == 0 and high.max() == 3
    _, counts = np.unique(low * 4 + high, return_counts=True)
    assert counts.size == 6
    assert stats.chisquare(counts).pvalue > P_FLOOR
    low, high = draw_ranges(rng, 3, 30_000, min_width=2)
    _, counts = np.unique(low * 4 + high, return_counts=True)
    assert counts.size == 3 and np.all(high - low >= 2)
    assert stats.chisquare(counts).pvalue > P_FLOOR
    with pytest.raises(ValueError, match="min_width"):
        draw_ranges(rng, 3, 10, min_width=4)


# --- the two paths, coverage, scale ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_fast_path_agrees_with_the_exact_path_in_law(mechanism: str) -> None:
    """n = 10,000 on the normal shape, 16 buckets, epsilon 1, 300 runs by each path: the
    mean range MSE (and the wide ranges') of the two paths differ by at most Z_TWO
    standard errors of the difference (the runs are independent; the ranges of run r are
    the same on both paths). Measured: the range MSE's relative sd over runs is about 0.5,
    so this detects a difference of about 17% of the MSE."""
    cells = [DistributionCell(mechanism, "normal", 1.0, 10_000, 16, 4)]
    runs = {
        path: simulate(cells, 300, path, seed=5, progress=False).runs for path in ("fast", "exact")
    }
    for column in ("range_mse", "wide_mse"):
        fast = np.array([run[column] for run in runs["fast"]])
        exact = np.array([run[column] for run in runs["exact"]])
        error = math.sqrt(fast.var(ddof=1) / fast.size + exact.var(ddof=1) / exact.size)
        assert abs(fast.mean() - exact.mean()) <= Z_TWO * error, (column, fast.mean(), exact.mean())


@pytest.mark.slow
def test_intervals_cover_and_the_stated_range_variance_is_right() -> None:
    """Every mechanism on the normal shape at epsilon 1 and the lognormal (log scale) at
    epsilon 4, n = 10^5, 64 buckets, 400 runs: CDF coverage within
    Z_TWO sqrt(0.95 x 0.05 / 400) = 0.048 of 0.95; quantile coverage at least
    0.95 - Z_ONE sqrt(0.95 x 0.05 / (4 x 400)) = 0.927 (the intervals are whole buckets: at
    least 0.95 by construction); the range MSE over the stated variance within Z_TWO
    standard errors (over runs) of 1."""
    reps = 400
    cells = [
        DistributionCell(mechanism, shape, epsilon, 100_000, 64, 4)
        for mechanism in MECHANISMS
        for shape, epsilon in (("normal", 1.0), ("lognormal", 4.0))
    ]
    run = simulate(cells, reps, seed=7, ranges=100, progress=False)
    for row in run.rows:
        where = (row["mechanism"], row["shape"], row["epsilon"])
        assert abs(row["cdf_coverage"] - 0.95) <= Z_TWO * math.sqrt(0.0475 / reps), where
        floor = 0.95 - Z_ONE * math.sqrt(0.0475 / (len(distribution.LEVELS) * reps))
        assert row["quantile_coverage"] >= floor, where
        for kind in ("range", "wide"):
            ratio, error = row[f"{kind}_ratio"], row[f"{kind}_ratio_se"]
            assert abs(ratio - 1) <= Z_TWO * error, (where, kind, ratio, error)


@pytest.mark.slow
def test_a_hundred_million_users_per_cell_run() -> None:
    """The fast path is O(D h) whatever n: 10^8 users, 256 buckets, two runs per mechanism
    and shape complete with finite measures (time is not asserted)."""
    cells = [
        DistributionCell(mechanism, shape, 1.0, 10**8, 256, 4)
        for mechanism in MECHANISMS
        for shape in ("lognormal", "bimodal")
    ]
    run = simulate(cells, 2, progress=False)
    for row in run.rows:
        assert row["n"] == 10**8
        assert all(math.isfinite(row[c]) for c in ("range_mse", "range_variance", "w1", "rank_99"))


# --- the command ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_writes_results_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dist"
    code = main(
        [
            "distribution", "--shapes", "normal,pareto", "--users", "1e4", "--epsilons", "1",
            "--reps", "2", "--buckets", "16", "--ranges", "20", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "range_mse" in printed and "cdf_coverage" in printed
    with (out / "results.csv").open(newline="") as handle:
        assert next(csv.reader(handle)) == COLUMNS
    rows = read_rows(out / "results.csv")
    assert len(rows) == len(MECHANISMS) * 2  # mechanisms x shapes
    assert {row["shape"] for row in rows} == {"normal", "pareto"}
    assert {row["scale"] for row in rows if row["shape"] == "pareto"} == {"log"}
    assert all(row["n"] == "10000" and row["runs"] == "2" and row["path"] == "fast" for row in rows)
    assert all(0 <= float(row["cdf_coverage"]) <= 1 for row in rows)
    data = json.loads((out / "results.json").read_text())
    assert len(data["cells"]) == len(rows) and len(data["runs"]) == 2 * len(rows)
    for shape in ("normal", "pareto"):
        assert (out / f"distribution_{shape}.png").stat().st_size > 10_000


def test_quick_fills_in_only_what_is_not_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["distribution", "--quick", "--users", "2000", "--reps", "1", "--buckets",
                 "16", "--ranges", "5", "--quiet"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()[2:]
    assert len(lines) == len(MECHANISMS) * 2 * 2  # --quick: 2 shapes x 2 epsilons
    assert all(" 2000 " in line for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "cauchy"], "unknown shape 'cauchy'"),
        (["--mechanisms", "oue"], "unknown mechanism 'oue'"),
        (["--buckets", "100", "--mechanisms", "hh"], "buckets must be a power of branching"),
        (["--scale", "log", "--shapes", "normal"], "scale 'log' needs lower > 0"),
        (["--epsilons", "0"], "epsilons: '0' is not a number > 0"),
        (["--users", "1.0005e3"], "not a whole number"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["distribution", *argv, "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_is_plain_text_and_shows_defaults() -> None:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = action.choices["distribution"]
    text = parser.format_help()
    assert "`" not in text
    flat = " ".join(text.split())
    for option in parser._actions:
        if option.option_strings and option.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {shown(option.default)})" in flat, option.option_strings
    for name, shape in SHAPES.items():
        assert f"{name} {shape.description}" in flat
    assert "(default: 1e4,1e6,1e8; --quick: 1e4,1e6)" in flat
