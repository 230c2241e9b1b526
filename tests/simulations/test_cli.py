"""``ldp-sim frequency``, ``numeric`` and ``fleet`` run as a user runs them; every
subcommand's argument errors named; help and output read as plain text (defaults shown,
counts pluralized), and the plots tell lines apart."""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulations import report
from simulations.cli import build_parser, main
from simulations.text import counted, shown

ROOT = Path(__file__).resolve().parents[2]


def ldp_sim(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simulations.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_frequency_writes_results_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "freq"
    done = ldp_sim(
        "frequency", "--mechanisms", "grr,oue,hr", "--epsilons", "0.5,2", "--domain-sizes", "16",
        "--users", "1e9", "--reps", "2", "--shape", "zipf:1.1", "--shape", "uniform",
        "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_rows(out / "results.csv")
    assert len(rows) == 3 * 2 * 2  # mechanisms x epsilons x shapes
    for column in ("mechanism", "epsilon", "d", "n", "shape", "mse", "variance", "coverage"):
        assert column in rows[0]
    assert {row["n"] for row in rows} == {"1000000000"}
    assert all(0.2 < float(row["ratio"]) < 5 for row in rows)
    assert len(list(out.glob("*.png"))) == 2  # one per (d, n, shape)
    data = json.loads((out / "results.json").read_text())
    assert len(data["repetitions"]) == 2 * len(rows)
    assert "mse" in done.stdout and "variance" in done.stdout


@pytest.mark.slow
def test_numeric_exact_path(tmp_path: Path) -> None:
    out = tmp_path / "num"
    done = ldp_sim(
        "numeric", "--epsilons", "1", "--users", "2000", "--reps", "3", "--path", "exact",
        "--lower", "0", "--upper", "60", "--shape", "normal:20,5", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_rows(out / "results.csv")
    assert {row["mechanism"] for row in rows} == {"laplace", "duchi", "piecewise"}
    assert all(row["path"] == "exact" for row in rows)


@pytest.mark.slow
def test_workers_do_not_change_the_results(tmp_path: Path) -> None:
    """A local Dask cluster of 2 workers and the in-process run agree for one seed (both
    through the command's entry point in this process: the tests above run the program)."""
    common = [
        "frequency", "--mechanisms", "grr,olh", "--epsilons", "1", "--domain-sizes", "32",
        "--users", "20000", "--reps", "3", "--path", "exact", "--seed", "11", "--quiet",
    ]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--workers", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = read_rows(tmp_path / "one/results.csv"), read_rows(tmp_path / "two/results.csv")
    for a, b in zip(one, two, strict=True):
        a.pop("seconds"), b.pop("seconds")
        assert a == b


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("frequency", "--epsilons", "1,-2"), "not a number > 0"),
        (("frequency", "--mechanisms", "laplace"), "unknown mechanism"),
        (("frequency", "--shape", "pareto"), "unknown shape"),
        (("frequency", "--users", "0"), "integer >= 1"),
        (("frequency", "--path", "slow"), "invalid choice"),
        (("frequency", "--epsilons", "500", "--mechanisms", "grr"), "epsilon=500"),
        (("numeric", "--lower", "3", "--upper", "1"), "must be below"),
        (("fleet", "--endpoint", "http://127.0.0.1:9"), "needs --admin-key"),
        (("federated", "--modes", "secret"), "unknown mode 'secret'"),
        (("federated", "--epsilons", "-1"), "must be a number > 0"),
        (("federated", "--partition", "random"), "unknown partition 'random'"),
        (("federated", "--datasets", "mnist"), "unknown dataset 'mnist'"),
        (("federated", "--epsilons", "50", "--modes", "central", "--rounds", "1"), "epsilon"),
        (("federated", "--clients", "0"), "is not an integer >= 1"),
        (("federated", "--rounds", "0"), "is not an integer >= 1"),
        (("strings", "--reps", "0"), "is not an integer >= 1"),
        (("longitudinal", "--change", "1.5"), "is not a probability in [0, 1]"),
        (("federated-nonsense",), "invalid choice"),
    ],
)
def test_bad_arguments_are_named(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's entry point in this process: argument errors need no program start
    (``test_missing_extras_say_how_to_install_from_a_checkout`` checks the exit status of
    the program itself)."""
    quiet = ["--quiet"] if args[0] != "federated-nonsense" else []
    try:
        status: int | str | None = main([*args, *quiet])
    except SystemExit as stopped:  # argparse's own errors
        status = stopped.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_fleet_against_a_real_aggregator(tmp_path: Path) -> None:
    """400 devices through the SDK: every report counted, the estimate against theory."""
    out = tmp_path / "fleet"
    done = ldp_sim(
        "fleet", "--devices", "400", "--mechanism", "grr", "--domain-size", "4",
        "--epsilon", "2", "--groups", "8", "--threads", "2", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = read_rows(out / "fleet.csv")
    assert row["devices"] == row["counted"] == "400"
    assert row["delivered"] == "True"
    # MSE over 4 items: at most ~20x its expectation but with negligible probability.
    assert float(row["mse"]) < 20 * float(row["variance"])
    assert (out / "fleet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fleet.png" in done.stdout
    # --quiet silences the progress bar only: the estimate is printed beside the truth,
    # category by category, by name (the metric is defined with labels).
    assert "the estimate beside the truth" in done.stdout
    estimates = read_rows(out / "fleet_estimates.csv")
    assert [row["label"] for row in estimates] == [f"category {i}" for i in range(4)]
    assert sum(float(row["truth"]) for row in estimates) == pytest.approx(1.0)
    table = done.stdout[done.stdout.index("the estimate beside the truth") :]
    assert "truth  estimate" in table
    for item in estimates:
        assert item["label"] in table


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"ldp-sim": parser, **subparsers.choices}


@pytest.mark.parametrize(
    "command",
    [
        "ldp-sim",
        "frequency",
        "numeric",
        "dpsgd",
        "federated",
        "fleet",
        "longitudinal",
        "strings",
        "distribution",
    ],
)
def test_help_is_plain_text_and_shows_defaults(command: str) -> None:
    parser = subcommand_parsers()[command]
    text = parser.format_help()
    assert "``" not in text and "`" not in text, text
    assert ":func:" not in text and "register(" not in text and "subparsers" not in text
    flat = " ".join(text.split())
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        assert f"(default: {shown(action.default)})" in flat, (command, action.option_strings)


def test_reps_default_is_shown() -> None:
    flat = " ".join(subcommand_parsers()["frequency"].format_help().split())
    assert re.search(r"--reps REPS repetitions per cell \(default: 10\)", flat)
    assert "(default: 0.5,1,2,4)" in flat  # lists as typed, not [0.5, 1.0, ...]


@pytest.mark.slow
def test_missing_extras_say_how_to_install_from_a_checkout() -> None:
    done = subprocess.run(
        [
            sys.executable, "-c",
            "import sys; sys.modules['tqdm'] = None\n"
            "from simulations.cli import main\nraise SystemExit(main(['frequency']))",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install -e '.[sim]'" in done.stderr and "repository root" in done.stderr
    assert "ldp-telemetry[sim]" not in done.stderr


@pytest.mark.parametrize(
    ("n", "noun", "plural", "text"),
    [
        (0, "report", None, "0 reports"),
        (1, "report", None, "1 report"),
        (2, "report", None, "2 reports"),
        (1, "batch", "batches", "1 batch"),
        (1_000_000, "user", None, "1,000,000 users"),
    ],
)
def test_counted_pluralizes(n: int, noun: str, plural: str | None, text: str) -> None:
    assert counted(n, noun, plural) == text


#: A number followed by a counted noun inside an f-string: "{n} reports" reads "1 reports".
BARE_COUNT = re.compile(
    r"\{[^{}]*\} (reports|users|rounds|clients|buckets|devices|rows|groups|batches|cells|"
    r"workers|senders|plots|keys|metrics|updates)\b(?!/)"
)


def test_no_bare_counts_in_output() -> None:
    """Messages count through ``counted`` (or an explicit plural), never "{n} nouns"."""
    sources = [*ROOT.glob("simulations/**/*.py"), ROOT / "aggregator/cli.py"]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BARE_COUNT.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "\n".join(found)


def dash_pattern(line: Any) -> str:
    """The dash pattern of ``line`` as drawn (offset, on-off lengths)."""
    return str(line._unscaled_dash_pattern)


def test_frequency_plot_styles_are_distinct() -> None:
    """oue, olh and auto with identical errors still differ in marker, marker size and line
    style; the theory lines are black, dashed and one legend entry."""
    rows = [
        {"mechanism": m, "epsilon": e, "mse": 1e-4 / e, "variance": 1e-4 / e}
        for m in ("grr", "oue", "olh", "auto", "hr", "sue")
        for e in (0.5, 1.0, 2.0)
    ]
    figure = report.error_figure(rows, "d=16")
    try:
        lines = figure.axes[0].get_lines()
        names = ["grr", "oue", "olh", "auto", "hr", "sue"]
        measured = [line for line in lines if line.get_label() in names]
        theory = [line for line in lines if line.get_label() not in names]
        assert [line.get_label() for line in measured] == names
        assert len(theory) == len(names)
        drawn_legend = figure.axes[0].get_legend()
        assert drawn_legend is not None
        legend = [text.get_text() for text in drawn_legend.get_texts()]
        assert legend == [*names, report.THEORY_LABEL]
        assert {line.get_color() for line in theory} == {"black"}
        sizes = [line.get_markersize() for line in measured]
        assert all(a != b for a, b in zip(sizes, sizes[1:], strict=False))
        markers = {line.get_marker() for line in measured}
        # The dash pattern as drawn (offset, on-off lengths): get_linestyle() names every
        # custom pattern "--", so compare the patterns themselves.
        patterns = {dash_pattern(line) for line in measured}
        assert len(markers) == len(patterns) == len(names), (markers, patterns)
        (theory_pattern,) = {dash_pattern(line) for line in theory}
        assert theory_pattern not in patterns  # no measured line looks like a theory line
        assert all(line.get_marker() in ("None", "", None) for line in theory)
        assert all(line.get_markerfacecolor() == "none" for line in measured)
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_series_styles_differ_for_thirty_lines() -> None:
    pairs = {
        (report.series_style(i)["marker"], str(report.series_style(i)["linestyle"]))
        for i in range(30)
    }
    assert len(pairs) == 30


def test_fleet_figure_draws_estimate_against_truth() -> None:
    from shared.schemas import MechanismSpec
    from simulations.fleet import estimate_figure

    values = np.array([0, 0, 1, 2, 2, 2, 3, 3])
    estimate = {
        "n": 8,
        "estimates": [
            {"index": i, "frequency": f, "ci_low": f - 0.1, "ci_high": f + 0.1}
            for i, f in enumerate([0.3, 0.1, 0.35, 0.25])
        ],
    }
    spec = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 2.0, "domain_size": 4})
    figure = estimate_figure(spec, values, estimate)
    try:
        axes = figure.axes[0]
        heights = [patch.get_height() for patch in axes.patches]  # type: ignore[attr-defined]
        assert heights == pytest.approx([0.25, 0.125, 0.375, 0.25])  # the truth
        (points,) = [line for line in axes.get_lines() if line.get_marker() == "o"]
        assert np.asarray(points.get_ydata()).tolist() == pytest.approx([0.3, 0.1, 0.35, 0.25])
        assert "8 reports" in axes.get_title()
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_dpsgd_plot_draws_the_no_noise_baseline_as_a_level_not_an_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epsilon inf is a horizontal line in its series' colour, not an (empty) x slot."""
    import matplotlib.pyplot as plt

    from simulations.dpsgd import plot_accuracy

    figures = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: figures.append(figure))
    rows = [
        {"model": "logistic", "dataset": "digits", "target_epsilon": e, "final_accuracy": a}
        for e, a in ((1.0, 0.8), (8.0, 0.88), (float("inf"), 0.9))
    ]
    plot_accuracy(rows, tmp_path / "accuracy.png")
    (figure,) = figures
    try:
        axes = figure.axes[0]
        assert [tick.get_text() for tick in axes.get_xticklabels()] == ["1", "8"]
        assert all(np.isfinite(line.get_xdata()).all() for line in axes.get_lines())
        (level,) = [line for line in axes.get_lines() if "epsilon inf" in line.get_label()]
        assert list(level.get_ydata()) == [0.9, 0.9]
        (curve,) = [line for line in axes.get_lines() if line.get_label() == "logistic (digits)"]
        assert level.get_color() == curve.get_color()
        assert list(curve.get_xdata()) == [1.0, 8.0]
    finally:
        plt.close(figure)


@pytest.mark.slow
def test_numeric_prints_the_ratio_with_its_standard_error(tmp_path: Path) -> None:
    done = ldp_sim(
        "numeric", "--mechanisms", "laplace", "--epsilons", "1", "--users", "1000",
        "--reps", "8", "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(r"\bratio\s+ratio_se\b", done.stdout)
    (row,) = read_rows(tmp_path / "results.csv")
    assert float(row["ratio_se"]) == pytest.approx(float(row["ratio"]) * np.sqrt(2 / 8))


def test_the_ratio_standard_error_matches_the_spread_of_ratios() -> None:
    """sqrt(2 / R) is the relative spread of a ratio over R repetitions: 60 groups of R = 8
    (480 repetitions of one cell, errors near-normal at n = 10^4) have ratios whose
    relative standard deviation is sqrt(2 / 8) = 0.5 within 35%. The sample deviation of
    60 ratios (chi-square_8 / 8, kurtosis 1.5 above normal) has a relative standard error
    of about sqrt((2 + 1.5) / (4 * 59)) = 0.12, so 35% is 2.9 of those, a false failure
    about 1 run in 250 at a random seed; the seed is fixed."""
    from simulations.accuracy import NumericCell, run_numeric, summarize
    from simulations.populations import parse_numeric_shape

    reps, groups = 8, 60
    cells = [
        NumericCell("laplace", 1.0, 10_000, parse_numeric_shape("uniform"), 0.0, 1.0)
        for _ in range(groups)
    ]
    rows = summarize(run_numeric(cells, reps, "fast", seed=11, progress=False))
    ratios = np.array([row["ratio"] for row in rows])
    spread = ratios.std(ddof=1) / ratios.mean()
    assert abs(spread / np.sqrt(2 / reps) - 1) < 0.35, spread
    assert all(row["ratio_se"] == pytest.approx(row["ratio"] * 0.5) for row in rows)
