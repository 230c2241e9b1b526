"""``ldp-sim frequency``, ``numeric`` and ``fleet`` run as a user runs them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_workers_do_not_change_the_results(tmp_path: Path) -> None:
    """A local Dask cluster of 2 workers and the in-process run agree for one seed."""
    common = (
        "frequency", "--mechanisms", "grr,olh", "--epsilons", "1", "--domain-sizes", "32",
        "--users", "20000", "--reps", "3", "--path", "exact", "--seed", "11", "--quiet",
    )  # fmt: skip
    alone = ldp_sim(*common, "--out", str(tmp_path / "one"))
    cluster = ldp_sim(*common, "--workers", "2", "--out", str(tmp_path / "two"))
    assert alone.returncode == 0 and cluster.returncode == 0, alone.stderr + cluster.stderr
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
        (("federated-nonsense",), "invalid choice"),
    ],
)
def test_bad_arguments_are_named(args: tuple[str, ...], message: str) -> None:
    done = ldp_sim(*args, "--quiet") if args[0] != "federated-nonsense" else ldp_sim(*args)
    assert done.returncode == 2
    assert message in done.stderr


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
