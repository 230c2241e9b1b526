"""``ldp-sim attack`` from the command line: tiny grids, the tables and the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.cli import main


@pytest.mark.slow
def test_the_attack_command_prints_and_writes_its_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "attack", "--mechanisms", "grr,oue,lsue", "--epsilon-lifetime", "3",
            "--attacks", "mga,random-item",
            "--defences", "none,normalization,refusal", "--betas", "0.05", "--domain", "64",
            "--users", "2000", "--targets", "3", "--reps", "2", "--numeric", "laplace",
            "--quiet", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "gain_ratio" in out and "honest_mse_ratio" in out and "shift" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["frequency"]) == 3 * 2 * 3  # mechanisms x attacks x defences
    assert {row["defence"] for row in results["numeric"]} == {"none", "refusal", "robust"}
    assert (tmp_path / "frequency.csv").read_text().startswith("mechanism,")
    assert (tmp_path / "numeric.csv").read_text().startswith("mechanism,")


def test_a_tiny_grid_with_federated_clients_runs_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "attack", "--mechanisms", "grr", "--defences", "none,normalization",
            "--betas", "0.05", "--domain", "16", "--users", "500", "--targets", "2",
            "--reps", "2", "--federated", "--federated-modes", "central",
            "--federated-rounds", "1", "--federated-clients", "10",
            "--federated-fractions", "0,0.5", "--quiet", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "gain_ratio" in out and "accuracy_loss" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["defence"] for row in results["frequency"]] == ["none", "normalization"]
    clean, attacked = results["federated"]
    assert (clean["fraction"], clean["malicious"], clean["accuracy_loss"]) == (0.0, 0, 0.0)
    assert (attacked["mode"], attacked["malicious"]) == ("central", 5)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "federated.csv", "frequency.csv", "results.json"
    ]  # fmt: skip


def test_a_bad_option_is_refused_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["attack", "--attacks", "flood"])
    assert exited.value.code == 2
    assert "flood" in capsys.readouterr().err
