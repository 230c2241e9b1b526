"""``ldp-sim multidim`` (``simulations.multidim``): the population, the declared pairs, the
truth, the measures against the stated variance, and the command.

False failures: every statistical assertion holds with probability at least 1 - 1e-6
(``tests.distribution_checks.ALPHA``), Bonferroni over the quantities it covers.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from scipy import stats

from simulations import multidim
from simulations.cli import build_parser, main
from simulations.multidim import (
    COLUMNS,
    MultidimCell,
    Population,
    Truth,
    all_pairs,
    parse_pairs,
    ratio_interval,
    simulate,
)
from simulations.populations import parse_categorical_shape
from simulations.text import shown
from tests.distribution_checks import ALPHA, normal_bound

ZIPF = parse_categorical_shape("zipf:1.1")


def population(domains: tuple[int | None, ...], rho: float = 0.5) -> Population:
    return Population(domains, ZIPF, rho)


# --- the population ------------------------------------------------------------------------


def test_each_attribute_follows_its_marginal() -> None:
    """Categorical columns: chi-square goodness of fit to the Zipf shares; the numeric
    column: Kolmogorov-Smirnov against the uniform law on [0, 1]; each at ALPHA / 3."""
    people = population((4, 16, None), rho=0.7)
    rows = people.sample(100_000, np.random.default_rng(1))
    for column, size in enumerate((4, 16)):
        counts = np.bincount(rows[:, column].astype(np.int64), minlength=size)
        shares = ZIPF.shares(size) / ZIPF.shares(size).sum()
        assert stats.chisquare(counts, 100_000 * shares).pvalue > ALPHA / 3
    assert stats.kstest(rows[:, 2], "uniform").pvalue > ALPHA / 3
    assert np.all(rows[:, :2] == np.rint(rows[:, :2]))


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_the_copula_has_its_rank_correlation(rho: float) -> None:
    """Spearman's rho of a Gaussian copula is (6 / pi) asin(rho / 2); two numeric columns
    carry the copula's uniforms themselves. Its standard error is below 1 / sqrt(n - 1)
    (0.0032 at n = 10^5, Bonett-Wright's sqrt((1 + r^2 / 2) / (n - 3)) at most 1.23 times
    that): 7 of them is a bound that fails with probability far below ALPHA."""
    rows = population((None, None), rho).sample(100_000, np.random.default_rng(2))
    measured = stats.spearmanr(rows[:, 0], rows[:, 1]).statistic
    expected = 6 / math.pi * math.asin(rho / 2)
    assert abs(measured - expected) < 7 * 1.23 / math.sqrt(100_000 - 1)


def test_bad_populations_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 attributes"):
        population((4,))
    with pytest.raises(ValueError, match="correlation must lie in"):
        population((4, 4), rho=1.0)
    with pytest.raises(ValueError, match="attribute 1 has 1 categories"):
        population((4, 1))


# --- pairs and the truth -------------------------------------------------------------------


def test_pairs_are_parsed_and_checked() -> None:
    people = population((4, 8, None, 3))
    assert parse_pairs("none", people) == ()
    assert parse_pairs("all", people) == all_pairs(people) == ((0, 1), (0, 3), (1, 3))
    assert parse_pairs("0:1, a3:a1", people) == ((0, 1), (3, 1))
    for text, message in [
        ("0-1", "write it I:J"),
        ("0:9", "attributes are 0..3"),
        ("1:1", "must differ"),
        ("0:2", "both attributes must be categorical"),
        ("0:1,1:0", "declared twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_pairs(text, people)


def test_the_truth_adds_up_over_chunks() -> None:
    people = population((3, 4, None))
    rows = people.sample(1000, np.random.default_rng(3))
    truth = Truth(people, ((0, 1),))
    truth.add(rows[:400])
    truth.add(rows[400:])
    assert truth.n == 1000
    assert np.allclose(truth.attribute(1), np.bincount(rows[:, 1].astype(int), minlength=4) / 1000)
    assert truth.attribute(2) == pytest.approx([rows[:, 2].mean()])
    joint = np.zeros((3, 4))
    np.add.at(joint, (rows[:, 0].astype(int), rows[:, 1].astype(int)), 1)
    assert np.allclose(truth.pair(0), joint.ravel() / 1000)


def test_the_ratio_interval_is_the_runs_spread() -> None:
    squared = np.array([1.0, 3.0])
    ratio, low, high = ratio_interval(squared, np.array([2.0, 2.0]))
    half = 1.959963984540054 * np.std(squared / 2, ddof=1) / math.sqrt(2)
    assert ratio == 1.0 and low == pytest.approx(1 - half) and high == pytest.approx(1 + half)
    assert math.isnan(ratio_interval(np.array([1.0]), np.array([1.0]))[1])


# --- against the stated variance (needs the protocols) -------------------------------------

#: The protocols' small case: three attributes (one a number), one declared pair.
SMALL = population((3, 4, None), rho=0.6)
RUNS = 100


@pytest.mark.slow
@pytest.mark.parametrize("oracle", ["grr", "oue"])
@pytest.mark.parametrize("protocol", ["spl", "smp", "rsfd"])
def test_errors_match_the_stated_variance(protocol: str, oracle: str) -> None:
    """Fast path, n = 20,000, epsilon 2, 100 runs over the same users. Per target, the
    runs' ratios m_r / v (m_r run r's mean squared error per cell, v the mean stated
    variance) are independent: their mean is 1 within ``normal_bound`` of its standard
    error (Bonferroni over the 4 targets; CLT over 100 runs). Per cell, the mean error
    over the runs is 0 within ``normal_bound`` of sqrt(v_cell / R) (unbiasedness; over the
    3 + 4 + 1 + 12 cells)."""
    cell = MultidimCell(protocol, 2.0, 20_000, SMALL, ((0, 1),), oracle)
    mechanism = cell.make()
    users = SMALL.sample(cell.n, np.random.default_rng(4))
    truth = Truth(SMALL, cell.pairs)
    truth.add(users)
    rng = np.random.default_rng(5)
    ratios = np.empty((RUNS, 4))
    errors, variances = [], []
    for run in range(RUNS):
        estimate = mechanism.estimate(mechanism.simulate_statistics(users, rng))
        sums = multidim.measure(estimate, truth)
        ratios[run] = [item["squared"] / item["variance"] for item in sums]
        first, second, number = (cast(Any, a) for a in estimate.attributes)
        pair = estimate.marginals[0]
        errors.append(
            np.concatenate(
                [
                    first.frequencies - truth.attribute(0),
                    second.frequencies - truth.attribute(1),
                    [number.mean - truth.attribute(2)[0]],
                    np.ravel(pair.frequencies) - truth.pair(0),
                ]
            )
        )
        variances.append(
            np.concatenate([first.std, second.std, [number.std], np.ravel(pair.std)]) ** 2
        )
    z = normal_bound(4)
    means, spreads = ratios.mean(axis=0), ratios.std(axis=0, ddof=1) / math.sqrt(RUNS)
    assert np.all(np.abs(means - 1) < z * spreads), (means, spreads)
    bias = np.mean(errors, axis=0) / np.sqrt(np.mean(variances, axis=0) / RUNS)
    assert np.abs(bias).max() < normal_bound(bias.size), bias


# --- the command ---------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fast", "exact"])
def test_the_command_writes_results_and_plots(
    path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "multidim"
    code = main(
        [
            "multidim", "--attributes", "3", "--domains", "4,3,num", "--pairs", "0:1",
            "--users", "2000", "--epsilons", "1,4", "--reps", "2", "--path", path,
            "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "ratio_low" in printed and "coverage" in printed
    with (out / "results.csv").open(newline="") as handle:
        assert next(csv.reader(handle)) == COLUMNS
    rows = read_rows(out / "results.csv")
    assert len(rows) == 4 * 2 * 4  # protocols x epsilons x targets (3 attributes, 1 pair)
    assert {row["target"] for row in rows} == {"a0", "a1", "a2", "a0:a1"}
    assert {row["kind"] for row in rows} == {"categorical", "numeric", "marginal"}
    assert all(row["path"] == path and row["runs"] == "2" for row in rows)
    assert {row["method"] for row in rows if row["target"] in ("a0", "a1")} == {"consistent"}
    assert all(0 <= float(row["coverage"]) <= 1 and float(row["stated"]) > 0 for row in rows)
    assert any(row["protocol"].startswith("auto (") for row in rows)
    data = json.loads((out / "results.json").read_text())
    assert len(data["rows"]) == len(rows) and len(data["runs"]) == 2 * len(rows)
    assert (out / "multidim_n-2000.png").stat().st_size > 10_000


def test_the_same_seed_gives_the_same_results() -> None:
    cell = MultidimCell("smp", 1.0, 3000, population((4, 4)), ((0, 1),), "grr")

    def measured(seed: int) -> list[dict[str, object]]:
        rows = simulate([cell], 2, seed=seed, progress=False).rows
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    first = measured(7)
    assert measured(7) == first
    assert measured(8) != first


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--protocols", "xyz"], "unknown protocol 'xyz'"),
        (["--oracle", "olh"], "unknown oracle 'olh'"),
        (["--domains", "4,4"], "--domains lists 2 sizes for 5 attributes"),
        (["--domains", "1"], "at least 2 categories"),
        (["--correlation", "1.5"], "correlation must lie in [0, 1)"),
        (["--pairs", "0:0"], "--pairs: pair '0:0': the two attributes must differ"),
        (["--shape", "zipf"], "zipf needs an exponent"),
        (["--epsilons", "0"], "epsilons: '0' is not a number > 0"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["multidim", *argv, "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_is_plain_text_and_shows_defaults() -> None:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = action.choices["multidim"]
    text = parser.format_help()
    assert "`" not in text
    flat = " ".join(text.split())
    for option in parser._actions:
        if option.option_strings and option.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {shown(option.default)})" in flat, option.option_strings
    assert "Gaussian copula" in flat and "(default: 1e5,1e6; --quick: 1e5)" in flat
