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
            "attack", "--mechanisms", "grr,oue", "--attacks", "mga,random-item",
            "--defences", "none,normalization,refusal", "--betas", "0.05", "--domain", "64",
            "--users", "2000", "--targets", "3", "--reps", "2", "--numeric", "laplace",
            "--quiet", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "gain_ratio" in out and "honest_mse_ratio" in out and "shift" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["frequency"]) == 2 * 2 * 3  # mechanisms x attacks x defences
    assert {row["defence"] for row in results["numeric"]} == {"none", "refusal", "robust"}
    assert (tmp_path / "frequency.csv").read_text().startswith("mechanism,")
    assert (tmp_path / "numeric.csv").read_text().startswith("mechanism,")


def test_a_bad_option_is_refused_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["attack", "--attacks", "flood"])
    assert exited.value.code == 2
    assert "flood" in capsys.readouterr().err
