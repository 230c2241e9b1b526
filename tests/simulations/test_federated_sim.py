"""``ldp-sim federated``: datasets, partitions, in-process and over-HTTP runs, outputs."""

from __future__ import annotations

import csv
import functools
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared import accounting
from simulations.cli import main
from simulations.federated import load_dataset, run_task, task_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def calibrate_each_task_once() -> Iterator[None]:
    """Calibration is a pure function of (target, q, T, delta, method, interval), and the
    in-process runs below calibrate the same central task (epsilon 8, q = 0.2, 3 rounds)
    five times, seconds each: the module keeps each result, computed once for real."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            accounting,
            "calibrate_noise_multiplier",
            functools.cache(accounting.calibrate_noise_multiplier),
        )
        yield


def ldp_sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simulations.cli", "federated", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_partitions() -> None:
    iid = load_dataset("digits", 100, "iid", seed=0)
    skew = load_dataset("digits", 100, "label-skew", seed=0)
    assert len(iid.clients) == len(skew.clients) == 100
    assert sum(len(x) for x, _ in iid.clients) == sum(len(x) for x, _ in skew.clients) == 1438
    assert len(iid.test_y) == 359 and iid.num_features == 64 and iid.num_classes == 10
    # Sorted by label and cut in equal consecutive shares: at most two classes per client.
    assert max(len(set(y.tolist())) for _, y in skew.clients) <= 2
    assert np.mean([len(set(y.tolist())) for _, y in iid.clients]) > 5
    synthetic = load_dataset("synthetic", 1000, "iid", seed=0)
    assert all(len(x) == 2 for x, _ in synthetic.clients)
    assert synthetic.num_features == 20 and synthetic.num_classes == 4


def test_same_seed_same_run() -> None:
    data = load_dataset("digits", 50, "iid", seed=1)
    config = task_config(data, "central", 8.0, 3, 1e-5, "logistic", seed=1)
    first, second = run_task(data, config, 8.0, seed=1), run_task(data, config, 8.0, seed=1)
    assert first.accuracy == second.accuracy and first.epsilon_spent == second.epsilon_spent
    assert run_task(data, config, 8.0, seed=2).accuracy != first.accuracy


def test_non_private_fedavg_learns_digits() -> None:
    """Plain FedAvg on IID digits over 50 clients, 20 rounds: well above chance (0.1)."""
    data = load_dataset("digits", 50, "iid", seed=0)
    run = run_task(data, task_config(data, "none", math.inf, 20, 1e-5, "logistic", 0), math.inf, 0)
    assert run.accuracy[-1] > 0.85
    assert math.isinf(run.epsilon_spent)


def test_secure_aggregation_releases_exactly_the_plain_distributed_sum() -> None:
    """SecAgg+ unmasks the exact sum of the lattice uploads, and the device's lattice
    upload draws what the plain upload draws: without dropouts a secure run is the plain
    distributed run, round for round (same accuracy, same epsilon), bit for bit."""
    data = load_dataset("digits", 30, "iid", seed=3)
    plain = task_config(data, "distributed", 8.0, 3, 1e-5, "logistic", seed=3)
    secure = task_config(data, "distributed", 8.0, 3, 1e-5, "logistic", seed=3, secure=True)
    assert secure.secure_aggregation is not None and plain.secure_aggregation is None
    expected, got = run_task(data, plain, 8.0, seed=3), run_task(data, secure, 8.0, seed=3)
    assert got.accuracy == expected.accuracy and got.epsilon_spent == expected.epsilon_spent
    assert got.row()["secure_aggregation"] and not expected.row()["secure_aggregation"]


@pytest.mark.slow
def test_secure_aggregation_with_dropouts_charges_the_masked_inputs() -> None:
    """Every device takes part (q = 1); with 20% of them dropping out of each round, rounds
    hold fewer noise shares and are charged more: the epsilon spent exceeds the run
    without dropouts."""
    data = load_dataset("digits", 30, "iid", seed=4)
    config = task_config(data, "distributed", 8.0, 3, 1e-5, "logistic", seed=4, secure=True)
    config = config.model_copy(update={"min_clients": 2, "clients_per_round": 30})
    full = run_task(data, config, 8.0, seed=4)
    dropped = run_task(data, config, 8.0, seed=4, dropout=0.2)
    assert len(dropped.accuracy) == 3 and np.isfinite(dropped.accuracy).all()
    assert dropped.epsilon_spent > full.epsilon_spent


@pytest.mark.slow
def test_cli_writes_results_rounds_and_plot(tmp_path: Path) -> None:
    """The command's entry point in this process (``test_cli_over_http`` runs it as a
    program), so that its runs share the module's calibrations."""
    out = tmp_path / "fl"
    status = main([
        "federated", "--clients", "30", "--modes", "none,central,local", "--epsilons", "8,inf",
        "--partition", "iid,label-skew", "--rounds", "3", "--out", str(out), "--quiet",
    ])  # fmt: skip
    assert status == 0
    with (out / "results.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for column in ("mode", "clients", "target_epsilon", "epsilon_spent", "final_accuracy"):
        assert column in rows[0]
    assert len(rows) == 2 * (1 + 2 * 2)  # partitions x (none + 2 modes x 2 epsilons)
    assert {row["mode"] for row in rows} == {"none", "central", "local"}
    for row in rows:
        spent, target = float(row["epsilon_spent"]), float(row["target_epsilon"])
        assert spent <= target + 1e-9 or math.isinf(target)
    assert (out / "accuracy.png").stat().st_size > 0
    with (out / "rounds.csv").open(newline="") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows) * 3


@pytest.mark.slow
def test_cli_over_http(tmp_path: Path) -> None:
    """The same run through a real aggregator and FederatedClient devices."""
    out = tmp_path / "http"
    done = ldp_sim(
        "--clients", "12", "--modes", "central", "--epsilons", "8", "--rounds", "3",
        "--over-http", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (out / "results.csv").open(newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["over_http"] == "True"
    assert 0 < float(row["epsilon_spent"]) <= 8.0 + 1e-9
    assert 0.0 <= float(row["final_accuracy"]) <= 1.0


@pytest.mark.slow
def test_cli_over_http_without_noise_when_every_client_joins(tmp_path: Path) -> None:
    """Local mode at epsilon inf: no noise, so an upload's norm bound is the clip norm itself,
    which float clipping may pass by an ulp (the service allows rounding); and with every
    client uploading, a round fills and the service closes it before the run asks to."""
    out = tmp_path / "http-no-noise"
    done = ldp_sim(
        "--clients", "12", "--modes", "local", "--epsilons", "inf", "--rounds", "3",
        "--over-http", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (out / "results.csv").open(newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["epsilon_spent"] == "inf"
    assert float(row["final_accuracy"]) > 0.5
