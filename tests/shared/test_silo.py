"""The ``silo`` federated mode in the shared core: configuration, calibration, accounting
per record of a silo over every step of every round, aggregation, the budget.

Deterministic (seeded) throughout; no statistical assertion.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shared import accounting
from shared.accounting import gaussian_epsilon, gaussian_rounds_epsilon, releases_epsilon
from shared.federated.dpsgd import DPSGD, dpsgd_update
from shared.federated.models import LogisticRegression
from shared.federated.privacy import DPConfig, RecordSampling, privatize
from shared.federated.task import (
    FEDERATED_DISCRETIZATION,
    BudgetExhaustedError,
    TaskConfig,
    TaskState,
    calibrate,
    local_update,
)

DELTA = 1e-5
RATE, STEPS = 0.1, 4  # each silo: 4 DP-SGD steps a round, records sampled at 0.1


def silo_config(**changes: Any) -> TaskConfig:
    values: dict[str, Any] = {
        "model": {"kind": "logistic", "num_features": 4, "num_classes": 3},
        "mode": "silo",
        "rounds": 4,
        "population": 3,
        "clients_per_round": 3,
        "noise_multiplier": 1.5,
        "dpsgd": {"sample_rate": RATE, "steps": STEPS, "learning_rate": 0.5},
    }
    values.update(changes)
    return TaskConfig.model_validate({k: v for k, v in values.items() if v is not None})


@pytest.fixture(scope="module", autouse=True)
def calibrate_each_task_once() -> Iterator[None]:
    """Calibration is a pure function of its arguments, seconds each: the module keeps
    each result, computed once for real."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            accounting,
            "calibrate_noise_multiplier",
            functools.cache(accounting.calibrate_noise_multiplier),
        )
        yield


def calibrated_config() -> TaskConfig:
    return silo_config(noise_multiplier=None, target_epsilon=1.5)


def rounds_within(z: float, target: float) -> int:
    """The most rounds whose steps keep a silo's epsilon within ``target``."""
    rounds = 0
    while silo_epsilon(z, (rounds + 1) * STEPS) <= target:
        rounds += 1
    return rounds


def silo_epsilon(z: float, steps: int) -> float:
    """A silo's epsilon per record after ``steps`` DP-SGD steps, as the service accounts
    (discrete Gaussian noise, by its zCDP bound)."""
    return gaussian_epsilon(z, RATE, steps, DELTA, mechanism="discrete_gaussian")


# --- accounting of releases at several sampling rates ------------------------------------


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_releases_at_two_rates_compose_as_dp_accounting_does(method: str) -> None:
    import dp_accounting
    from dp_accounting import pld, rdp

    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n
        )
        for (z, q), n in sorted({(1.5, 0.1): 30, (2.5, 0.3): 3}.items())
    ]
    accountant = rdp.RdpAccountant() if method == "rdp" else pld.PLDAccountant(
        value_discretization_interval=1e-3
    )  # fmt: skip
    for event in events:
        accountant.compose(event)
    ours = releases_epsilon(
        {(1.5, 0.1): 30, (2.5, 0.3): 3}, DELTA, method,  # type: ignore[arg-type]
        value_discretization_interval=1e-3,
    )  # fmt: skip
    assert ours == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)


def test_releases_at_one_rate_are_the_rounds_accountant() -> None:
    rounds = {0.9: 7, 1.3: 2}
    assert releases_epsilon({(z, 0.1): n for z, n in rounds.items()}, DELTA, "rdp") == (
        gaussian_rounds_epsilon(rounds, 0.1, DELTA, "rdp")
    )
    assert releases_epsilon({}, DELTA) == 0.0
    with pytest.raises(ValueError, match="sample_rate"):
        releases_epsilon({(1.0, 0.0): 1}, DELTA)
    with pytest.raises(ValueError, match="noise_multiplier"):
        releases_epsilon({(-1.0, 0.5): 1}, DELTA)


# --- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dpsgd": None}, "needs dpsgd"),
        ({"mode": "central"}, "silo mode only"),
        ({"local_training": {"epochs": 2}}, "local_training does not apply"),
        ({"adaptive_clipping": {}}, "adaptive clipping"),
        ({"dpsgd": {"sample_rate": 0.0, "steps": 1}}, "sample_rate"),
        ({"dpsgd": {"sample_rate": 0.5, "steps": 0}}, "steps"),
    ],
)
def test_bad_silo_tasks_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        silo_config(**changes)


def test_only_the_silo_mode_takes_a_noise_multiplier_and_a_target() -> None:
    both = silo_config(target_epsilon=4.0)
    assert both.noise_multiplier == 1.5 and both.target_epsilon == 4.0
    with pytest.raises(ValueError, match="not both"):
        silo_config(mode="central", dpsgd=None, target_epsilon=4.0)


def test_the_privacy_parameters_of_a_silo() -> None:
    dp = silo_config().dp_config(1.5)
    assert dp.records == RecordSampling(RATE, STEPS)
    assert dp.accounting_sample_rate == RATE and dp.releases_per_round == STEPS
    assert dp.accounting_noise_multiplier(1) == 1.5 and dp.noised_on_device
    assert math.isinf(dp.max_upload_norm(1.0, 15))
    with pytest.raises(ValueError, match="silo mode, and it alone"):
        DPConfig("silo", 1.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="silo mode, and it alone"):
        DPConfig("central", 1.0, 1.0, 3.0, records=RecordSampling(RATE, STEPS))


def test_calibration_covers_every_step_of_every_round() -> None:
    z = calibrate(calibrated_config())
    assert z == accounting.calibrate_noise_multiplier(
        1.5, RATE, 4 * STEPS, DELTA, "pld", value_discretization_interval=FEDERATED_DISCRETIZATION,
        mechanism="discrete_gaussian",
    )  # fmt: skip
    assert 1.5 * (1 - 1e-3) <= silo_epsilon(z, 4 * STEPS) <= 1.5


# --- rounds --------------------------------------------------------------------------------


def close(state: TaskState, seed: int, updates: np.ndarray | None = None) -> float:
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(3, state.num_params)) if updates is None else updates
    return state.close_round(rows, np.zeros(3), np.array([10.0, 20.0, 30.0]), rng).epsilon


def test_each_round_charges_a_silos_steps_and_the_target_holds() -> None:
    """The epsilon after round r is that of r * s DP-SGD steps, and after the planned
    rounds exactly the target (within calibration); then the task is over."""
    state = TaskState.start(calibrated_config())
    spent = [close(state, r) for r in range(4)]
    for r, epsilon in enumerate(spent, start=1):
        assert epsilon == pytest.approx(silo_epsilon(state.noise_multiplier, r * STEPS), rel=1e-9)
    assert spent == sorted(spent) and spent[-1] <= 1.5
    assert state.epsilon() == spent[-1]
    with pytest.raises(BudgetExhaustedError, match="planned rounds"):
        state.check_round()


def test_a_task_with_fixed_noise_runs_until_its_target() -> None:
    """z = 1.5 and target 2.5: the rounds run while a silo's epsilon after one more stays
    within 2.5, and the next is refused; never past the target."""
    z, target = 1.5, 2.5
    state = TaskState.start(silo_config(noise_multiplier=z, target_epsilon=target, rounds=50))
    allowed = rounds_within(z, target)
    assert 1 < allowed < 50
    for r in range(allowed):
        assert close(state, r) <= target
    with pytest.raises(BudgetExhaustedError, match="past the task's budget of 2.5"):
        state.check_round()
    before = state.to_json()
    with pytest.raises(BudgetExhaustedError):
        close(state, 99)
    assert state.to_json() == before  # a refused round changes nothing
    assert state.epsilon() <= target < silo_epsilon(z, (allowed + 1) * STEPS)


def test_the_server_takes_the_example_weighted_mean_as_uploaded() -> None:
    """Silo uploads are DP-SGD outcomes: no server clipping or noise, FedAvg weights."""
    state = TaskState.start(silo_config(server_momentum=0.0))
    start = state.server.params.copy()
    rows = np.random.default_rng(0).normal(size=(3, state.num_params)) * 100.0
    close(state, 0, rows)
    expected = (np.array([10.0, 20.0, 30.0]) @ rows) / 60.0
    np.testing.assert_allclose(state.server.params - start, expected, atol=1e-12)
    upload = privatize(rows[0], state.dp, state.clip_norm, np.random.default_rng(1))
    np.testing.assert_array_equal(upload.update, rows[0])


def test_a_silos_update_is_dp_sgd_over_its_records() -> None:
    config = silo_config()
    model = LogisticRegression(4, 3)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 4)), rng.integers(0, 3, size=40)
    params = rng.normal(size=model.num_params)
    ours = local_update(config, model, params, x, y, 1.3, 0.7, np.random.default_rng(3))
    expected = dpsgd_update(
        model, params, x, y, DPSGD(1.3, 0.7, RATE, 0.5), STEPS, np.random.default_rng(3)
    )
    np.testing.assert_array_equal(ours, expected)


def test_the_state_round_trips_through_json() -> None:
    state = TaskState.start(silo_config(target_epsilon=3.0))
    close(state, 0)
    again = TaskState.from_json(state.to_json())
    assert again.config.dpsgd == state.config.dpsgd and not again.calibrated
    assert again.epsilon() == state.epsilon()
