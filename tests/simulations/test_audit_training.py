"""``ldp-sim audit training``: canaries through a federated round, against the accountant.

What is checked: a central-mode round's many-runs bound is below the accountant's epsilon
and above zero; the same round with the server's noise removed (the accountant still
charging for it) is caught, its bound above the accounted epsilon; the local and
distributed modes keep their promise; the one-run audit (Steinke et al. 2023) keeps the
promise of an honest round and catches the noiseless one; a silo's DP-SGD (canary records
in its data, scored on its upload) keeps its record-level promise and is caught with its
noise removed, by either audit; every privacy mode has an audit; the command end to end.

False alarms: every bound is at confidence 1 - ALPHA, ALPHA = 1e-6, so an honest round is
reported violated at most once in 10^6 runs; the one-run audits use a task delta of
1e-10, small enough that the delta term of the one-run p-value (2 m delta times at most
1) stays below ALPHA.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.federated.dpsgd import per_example_gradients
from shared.federated.models import Model
from shared.federated.privacy import PRIVACY_MODES, PrivateAggregation, RoundOutcome, clip_rows
from shared.federated.task import TaskConfig, local_update
from shared.randomness import RandomSource, Rng
from simulations.audit_training import (
    MODE_AUDITS,
    CanaryRound,
    SiloUpdate,
    accounted_epsilon,
    audit_many_runs,
    audit_one_run,
)
from simulations.cli import main
from simulations.commands.audit import TRAINING_MODES

ALPHA = 1e-6
OTHERS = 3
SILO_RECORDS = 12


def task(
    mode: str, epsilon: float, features: int = 3, classes: int = 4, delta: float = 1e-5
) -> TaskConfig:
    """A one-round task of OTHERS + 1 users, all taking part, at a target epsilon."""
    return TaskConfig.model_validate(
        {
            "model": {"kind": "logistic", "num_features": features, "num_classes": classes},
            "mode": mode,
            "rounds": 1,
            "population": OTHERS + 1,
            "clients_per_round": OTHERS + 1,
            "target_epsilon": epsilon,
            "delta": delta,
            "min_clients": OTHERS,
        }
    )


def others(parameters: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.3, (OTHERS, parameters))


def silo(
    canaries: int = 1,
    *,
    sample_rate: float = 1.0,
    steps: int = 1,
    delta: float = 1e-5,
    silo_update: SiloUpdate = local_update,
    **privacy: float,
) -> CanaryRound:
    """One silo of SILO_RECORDS records with 3 features (and ``canaries`` more columns, all
    zero, for the canary records), 3 classes, ``steps`` DP-SGD steps at ``sample_rate``;
    ``privacy`` gives the noise multiplier or the target epsilon (calibrating one at a
    sampling rate below 1 takes seconds)."""
    features = 3 + canaries
    config = TaskConfig.model_validate(
        {
            "model": {"kind": "logistic", "num_features": features, "num_classes": 3},
            "mode": "silo",
            "rounds": 1,
            "population": 1,
            "clients_per_round": 1,
            "delta": delta,
            "dpsgd": {"sample_rate": sample_rate, "steps": steps},
            **privacy,
        }
    )
    rng = np.random.default_rng(0)
    x = np.hstack([rng.normal(0.0, 1.0, (SILO_RECORDS, 3)), np.zeros((SILO_RECORDS, canaries))])
    y = rng.integers(0, 3, SILO_RECORDS)
    others = np.zeros((0, (features + 1) * 3))
    return CanaryRound(config, others, records=(x, y), silo_update=silo_update)


def silo_without_noise(
    config: TaskConfig,
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    noise_multiplier: float,
    clip_norm: float,
    rng: Rng,
) -> np.ndarray:
    """The silo's DP-SGD with its noise dropped (a bug), while the task's accountant still
    charges the steps at the configured multiplier."""
    return local_update(config, model, params, x, y, 0.0, clip_norm, rng)


class WithoutNoise(PrivateAggregation):
    """The server's aggregation with its Gaussian noise dropped (a bug), while the task's
    accountant still charges the round at the configured multiplier."""

    def aggregate(
        self,
        updates: np.ndarray,
        unclipped: np.ndarray,
        weights: np.ndarray,
        clip_norm: float,
        rng: Rng | RandomSource = None,
    ) -> RoundOutcome:
        quiet = dataclasses.replace(self.config, noise_multiplier=0.0)
        return PrivateAggregation(self.strategy, quiet).aggregate(
            updates, unclipped, weights, clip_norm, rng
        )


@pytest.mark.slow
def test_a_central_round_keeps_its_accounted_epsilon() -> None:
    round_ = CanaryRound(task("central", 2.0), others(16))
    result = audit_many_runs(round_, 3000, 1500, ALPHA, np.random.default_rng(1))
    assert result.accounted_epsilon == pytest.approx(2.0, rel=1e-3)
    assert 0.0 < result.lower_bound < result.accounted_epsilon
    assert not result.violation


@pytest.mark.slow
def test_a_central_round_without_its_noise_is_caught() -> None:
    round_ = CanaryRound(task("central", 2.0), others(16), WithoutNoise)
    result = audit_many_runs(round_, 3000, 1500, ALPHA, np.random.default_rng(2))
    assert result.hits == (3000, 0)  # the canary's coordinate gives it away every time
    assert result.lower_bound > result.accounted_epsilon and result.violation


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_the_other_private_modes_keep_their_accounted_epsilon(mode: str) -> None:
    round_ = CanaryRound(task(mode, 2.0), others(16))
    result = audit_many_runs(round_, 1500, 1000, ALPHA, np.random.default_rng(3))
    assert 0.0 <= result.lower_bound < result.accounted_epsilon


def test_the_none_mode_promises_nothing_and_shows_it() -> None:
    config = task("central", 2.0).model_copy(
        update={"mode": "none", "target_epsilon": None, "noise_multiplier": None}
    )
    result = audit_many_runs(CanaryRound(config, others(16)), 500, 500, ALPHA)
    assert result.accounted_epsilon == float("inf")
    assert result.lower_bound > 3.0 and not result.violation


def test_one_run_keeps_an_honest_round_and_catches_a_noiseless_one() -> None:
    config = task("central", 2.0, features=99, classes=5, delta=1e-10)  # 500 parameters
    honest = audit_one_run(
        CanaryRound(config, others(500)), 500, 100, ALPHA, np.random.default_rng(4)
    )
    assert honest.lower_bound < honest.accounted_epsilon
    broken = CanaryRound(config, others(500), WithoutNoise)
    caught = audit_one_run(broken, 500, 100, ALPHA, np.random.default_rng(5))
    assert caught.hits == (200, 200)
    assert caught.lower_bound > caught.accounted_epsilon


def test_canaries_sit_where_the_others_move_least() -> None:
    updates = np.zeros((OTHERS, 16))
    updates[:, :12] = 1.0
    round_ = CanaryRound(task("central", 2.0), updates)
    assert set(np.flatnonzero(round_.directions(4).sum(axis=0))) == {12, 13, 14, 15}
    with pytest.raises(ValueError, match="17 canaries need as many coordinates"):
        round_.directions(17)


def test_the_accountant_is_charged_as_the_service_charges() -> None:
    """The distributed mode's round is charged at its participants: fewer, more epsilon."""
    round_ = CanaryRound(task("distributed", 2.0), others(16))
    assert accounted_epsilon(round_, OTHERS) > accounted_epsilon(round_, 10 * OTHERS)


def test_every_privacy_mode_is_audited_and_offered() -> None:
    """A new mode cannot ship without a canary audit, nor be missing from the command."""
    assert set(MODE_AUDITS) == set(PRIVACY_MODES)
    assert set(TRAINING_MODES) == set(PRIVACY_MODES)


@pytest.mark.slow
def test_a_silo_keeps_its_record_level_epsilon() -> None:
    """Two DP-SGD steps of all the records, accounted as a silo's record-level epsilon."""
    round_ = silo(steps=2, target_epsilon=2.0)
    result = audit_many_runs(round_, 1500, 1000, ALPHA, np.random.default_rng(6))
    assert result.mode == "silo" and result.accounted_epsilon == pytest.approx(2.0, rel=1e-3)
    assert 0.0 < result.lower_bound < result.accounted_epsilon
    assert not result.violation


def test_a_silo_without_its_noise_is_caught() -> None:
    """Without noise the canary's own weights stay exactly zero unless a step sampled it."""
    round_ = silo(sample_rate=0.5, steps=2, noise_multiplier=2.0, silo_update=silo_without_noise)
    result = audit_many_runs(round_, 1000, 500, ALPHA, np.random.default_rng(7))
    # sampled in one of two steps at rate 1/2: 750 of 1000 expected, sd 14 (600: 11 sd off)
    assert result.hits[1] == 0 and result.hits[0] > 600
    assert result.lower_bound > result.accounted_epsilon and result.violation


def test_one_run_keeps_an_honest_silo_and_catches_a_noiseless_one() -> None:
    """200 canary records in one silo, one DP-SGD step of all its records."""
    honest = silo(200, delta=1e-10, target_epsilon=1.0)
    result = audit_one_run(honest, 200, 50, ALPHA, np.random.default_rng(8))
    assert result.lower_bound < result.accounted_epsilon
    broken = silo(200, delta=1e-10, target_epsilon=1.0, silo_update=silo_without_noise)
    caught = audit_one_run(broken, 200, 50, ALPHA, np.random.default_rng(9))
    assert caught.hits == (100, 100)
    assert caught.lower_bound > caught.accounted_epsilon


def test_silo_canaries_are_records_on_columns_the_silo_leaves_at_zero() -> None:
    round_ = silo(2, target_epsilon=2.0)
    canaries = round_.canaries(2)
    assert canaries.records is not None
    canary_x, labels = canaries.records
    assert np.count_nonzero(canary_x[:, :3]) == 0 and np.all(canary_x[[0, 1], [3, 4]] > 0)
    assert labels.tolist() == [0, 1]
    # each direction lies on its own feature's weights (3 classes a row) and points to its label
    assert set(np.flatnonzero(canaries.directions[0])) == {9, 10, 11}
    assert np.argmax(canaries.directions[1]) == 4 * 3 + 1
    np.testing.assert_allclose(np.linalg.norm(canaries.directions, axis=1), 1.0)
    # clipped to C, a canary's gradient keeps more than 0.995 C along -u (10 / sqrt(101))
    gradients = per_example_gradients(round_.model, round_.state.server.params, canary_x, labels)
    clipped, _ = clip_rows(gradients, round_.state.clip_norm)
    assert np.all(np.sum(clipped * -canaries.directions, axis=1) > 0.995 * round_.state.clip_norm)
    with pytest.raises(ValueError, match="3 canary records need as many feature columns"):
        round_.canaries(3)
    with pytest.raises(ValueError, match="the silo mode, and it alone"):
        CanaryRound(round_.config, round_.others)


@pytest.mark.slow
def test_the_command_writes_a_table_csv_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "training"
    code = main(
        [
            "audit", "training", "--modes", "central,local,silo", "--epsilons", "2",
            "--dataset", "synthetic", "--clients", "4", "--trials", "300", "--calibration",
            "200", "--canaries", "60", "--guesses", "10", "--seed", "1", "--out", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    rows: list[dict[str, Any]] = json.loads((out / "training_audit.json").read_text())
    assert [(r["method"], r["mode"]) for r in rows] == [
        ("many-runs", "central"), ("many-runs", "local"), ("many-runs", "silo"),
        ("one-run", "central"), ("one-run", "local"), ("one-run", "silo"),
    ]  # fmt: skip
    assert all(r["lower_bound"] < r["accounted_epsilon"] for r in rows)
    assert (out / "training_audit.csv").exists() and (out / "training_audit.png").exists()


def test_too_many_canaries_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "training", "--dataset", "synthetic", "--clients", "2",
              "--canaries", "10000", "--quiet"])  # fmt: skip
    assert "--canaries must lie in" in capsys.readouterr().err


def test_a_task_the_service_would_refuse_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "training", "--modes", "silo", "--steps", "20000", "--method",
              "many-runs", "--dataset", "synthetic", "--clients", "2", "--quiet"])  # fmt: skip
    error = capsys.readouterr().err
    assert "the audited task is not valid" in error and "dpsgd.steps" in error
