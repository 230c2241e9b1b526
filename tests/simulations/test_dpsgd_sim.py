"""``ldp-sim dpsgd``: records, schedule, runs, outputs (small and fast: RDP, few epochs)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from simulations.cli import main
from simulations.dpsgd import DATASET_DEFAULTS, load_records, run_dpsgd, settings_for


def test_records_and_schedule() -> None:
    digits = load_records("digits", seed=0)
    assert len(digits.train_x) == 1438 and len(digits.test_x) == 359
    assert digits.num_features == 64 and digits.num_classes == 10
    synthetic = load_records("synthetic", seed=0, records=1000)
    assert len(synthetic.train_x) == 1000 and len(synthetic.test_x) == 5000
    assert synthetic.num_features == 20 and synthetic.num_classes == 4
    settings = settings_for("digits")
    assert settings == DATASET_DEFAULTS["digits"]
    # Opacus's Poisson loader: ceil(N / B) steps per epoch at q = 1 / ceil(N / B).
    assert settings.steps_per_epoch(1438) == 23 and settings.sample_rate(1438) == 1 / 23
    assert settings_for("digits", epochs=3, batch_size=None).epochs == 3
    assert settings_for("digits", epochs=3).batch_size == 64


def test_a_run_spends_its_target_and_learns() -> None:
    records = load_records("digits", seed=0)
    settings = settings_for("digits", epochs=3)
    run = run_dpsgd(records, "logistic", 8.0, settings, 1e-5, "rdp", seed=0)
    assert 7.99 <= run.epsilon_spent <= 8.0
    assert len(run.accuracy) == 3 and run.accuracy[-1] > 0.8  # chance is 0.1
    again = run_dpsgd(records, "logistic", 8.0, settings, 1e-5, "rdp", seed=0)
    assert again.accuracy == run.accuracy
    baseline = run_dpsgd(records, "logistic", math.inf, settings, 1e-5, "rdp", seed=0)
    assert baseline.config.noise_multiplier == 0 and math.isinf(baseline.epsilon_spent)


@pytest.mark.slow
def test_cli_writes_results_epochs_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "dpsgd"
    status = main([
        "dpsgd", "--datasets", "digits,synthetic", "--records", "2000", "--models", "mlp",
        "--epsilons", "3,inf", "--epochs", "2", "--accounting", "rdp", "--out", str(out),
        "--quiet",
    ])  # fmt: skip
    assert status == 0
    with (out / "results.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["dataset"], r["target_epsilon"]) for r in rows] == [
        ("digits", "3.0"), ("digits", "inf"), ("synthetic", "3.0"), ("synthetic", "inf"),
    ]  # fmt: skip
    for row in rows:
        spent, target = float(row["epsilon_spent"]), float(row["target_epsilon"])
        assert spent <= target and (math.isinf(spent) == math.isinf(target))
        assert 0.0 <= float(row["final_accuracy"]) <= 1.0
    with (out / "epochs.csv").open(newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 4 * 2
    assert (out / "accuracy.png").stat().st_size > 0
    assert np.isfinite(float(rows[0]["seconds_per_epoch"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--delta", "2"], "--delta must lie in (0, 1)"),
        (["--epochs", "0"], "is not an integer >= 1"),
        (["--learning-rate", "nan"], "is not a number > 0"),
        (["--models", "cnn"], "unknown model 'cnn'"),
    ],
)
def test_bad_arguments_say_what_is_wrong(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dpsgd", "--quiet", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_federated_silo_mode(tmp_path: Path) -> None:
    """``ldp-sim federated --modes silo``: each client a silo running DP-SGD over its
    records (clipped, here without noise: calibration is tested with the task, in
    tests/shared/test_silo.py), the silos' updates averaged."""
    out = tmp_path / "silo"
    status = main([
        "federated", "--modes", "silo", "--clients", "4", "--epsilons", "inf",
        "--rounds", "3", "--out", str(out), "--quiet",
    ])  # fmt: skip
    assert status == 0
    with (out / "results.csv").open(newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert (row["mode"], row["epsilon_spent"], row["noise_multiplier"]) == ("silo", "inf", "0.0")
    assert float(row["final_accuracy"]) > 0.8  # chance is 0.1
