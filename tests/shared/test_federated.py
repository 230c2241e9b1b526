"""Federated learning core: models, FedAvg, clipping, noise, privacy modes, tasks.

Statistical tests use fixed seeds; each states its false-failure rate under the
hypothesis it checks (about 1e-6 unless said otherwise).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from shared import accounting
from shared.accounting import (
    AccountingMethod,
    GaussianRoundsAccountant,
    calibrate_noise_multiplier,
    gaussian_epsilon,
    gaussian_rounds_epsilon,
)
from shared.federated.fedavg import FedAvg, ServerState, client_update
from shared.federated.models import (
    MLP,
    LocalTraining,
    LogisticRegression,
    ModelSpec,
    accuracy,
    local_train,
    make_model,
)
from shared.federated.privacy import (
    MAX_CLIP_LOG_STEP,
    MAX_CLIP_NORM,
    MIN_CLIP_NORM,
    UNCLIPPED_TAIL_ALLOWANCE,
    AdaptiveClipping,
    DPConfig,
    PrivateAggregation,
    clip_rows,
    clip_update,
    privatize,
)
from shared.federated.task import (
    ACCOUNTING_GRID,
    FEDERATED_DISCRETIZATION,
    MAX_PLANNED_EPSILON,
    BudgetExhaustedError,
    TaskConfig,
    TaskState,
    calibrate,
)

ALPHA = 1e-6  # false-failure rate of each goodness-of-fit test below


@pytest.fixture(scope="module", autouse=True)
def calibrate_each_task_once() -> Iterator[None]:
    """Calibration is a pure function of (target, q, T, delta, method, interval), and the
    tasks below calibrate the same one many times (seconds each at q = 0.1): the module
    keeps each result. Every distinct task is still calibrated, once, by the real search;
    the tests that check the search itself call ``calibrate_noise_multiplier`` directly."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            accounting,
            "calibrate_noise_multiplier",
            functools.cache(accounting.calibrate_noise_multiplier),
        )
        yield


def blobs(n: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs around well-separated class centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, size=(classes, features))
    y = rng.integers(0, classes, n)
    return centres[y] + rng.normal(0, 1, size=(n, features)), y


# --- models -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [LogisticRegression(5, 3, l2=0.1), MLP(5, 3, hidden=4, l2=0.05)],
    ids=["logistic", "mlp"],
)
def test_gradient_matches_finite_differences(model: LogisticRegression | MLP) -> None:
    x, y = blobs(20, 5, 3, seed=1)
    rng = np.random.default_rng(2)
    params = rng.normal(0, 0.5, model.num_params)
    _, grad = model.loss_and_grad(params, x, y)
    h = 1e-6
    numeric = np.array(
        [
            (
                model.loss_and_grad(params + h * e, x, y)[0]
                - model.loss_and_grad(params - h * e, x, y)[0]
            )
            / (2 * h)
            for e in np.eye(model.num_params)
        ]
    )
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["logistic", "mlp"])
def test_local_training_learns_separable_blobs(kind: str) -> None:
    x, y = blobs(400, 4, 3, seed=3)
    model = make_model(ModelSpec(kind=kind, num_features=4, num_classes=3, hidden=8))
    rng = np.random.default_rng(4)
    start = model.init_params(rng)
    trained = local_train(
        model, start, x, y, LocalTraining(epochs=20, batch_size=16, learning_rate=0.1), rng
    )
    assert accuracy(model, trained, x, y) > 0.95
    assert model.loss_and_grad(trained, x, y)[0] < model.loss_and_grad(start, x, y)[0]


def test_local_train_leaves_its_input_alone() -> None:
    x, y = blobs(10, 3, 2, seed=5)
    model = LogisticRegression(3, 2)
    params = np.zeros(model.num_params)
    local_train(model, params, x, y, LocalTraining(), np.random.default_rng(0))
    assert not params.any()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LogisticRegression(0, 3), "num_features"),
        (lambda: LogisticRegression(3, 1), "num_classes"),
        (lambda: MLP(3, 3, hidden=0), "hidden"),
        (lambda: LogisticRegression(3, 3, l2=-1.0), "l2"),
        (lambda: LocalTraining(epochs=0), "epochs"),
        (lambda: LocalTraining(learning_rate=float("nan")), "learning_rate"),
        (lambda: FedAvg(server_momentum=1.0), "server_momentum"),
    ],
)
def test_invalid_parameters_are_named(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_bad_batches_are_refused() -> None:
    model = LogisticRegression(3, 2)
    params = np.zeros(model.num_params)
    with pytest.raises(ValueError, match="shape"):
        model.loss_and_grad(params, np.zeros((2, 4)), np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match="labels"):
        model.loss_and_grad(params, np.zeros((2, 3)), np.array([0, 2]))
    with pytest.raises(ValueError, match="length"):
        model.loss_and_grad(np.zeros(3), np.zeros((2, 3)), np.zeros(2, dtype=int))


# --- FedAvg ---------------------------------------------------------------------------


def test_fedavg_of_one_full_batch_step_is_the_centralized_step() -> None:
    """One local step of full-batch GD per client, averaged with example weights, is
    exactly one centralized GD step on the pooled data (the mean gradient is the
    example-weighted mean of the clients' mean gradients)."""
    x, y = blobs(300, 6, 4, seed=6)
    model = LogisticRegression(6, 4)
    owners = np.random.default_rng(7).integers(0, 9, len(x))
    lr = 0.3
    fedavg, central = ServerState.start(np.zeros(model.num_params)), np.zeros(model.num_params)
    strategy = FedAvg()
    for _ in range(5):
        updates, weights = [], []
        for owner in range(9):
            mine = owners == owner
            training = LocalTraining(epochs=1, batch_size=int(mine.sum()), learning_rate=lr)
            rng = np.random.default_rng(0)
            updates.append(client_update(model, fedavg.params, x[mine], y[mine], training, rng))
            weights.append(mine.sum())
        fedavg = strategy.apply(fedavg, strategy.aggregate(np.array(updates), np.array(weights)))
        central = central - lr * model.loss_and_grad(central, x, y)[1]
    np.testing.assert_allclose(fedavg.params, central, rtol=1e-10, atol=1e-12)


def test_server_momentum_accumulates() -> None:
    strategy = FedAvg(server_learning_rate=0.5, server_momentum=0.9)
    state = ServerState.start(np.zeros(2))
    step = np.array([1.0, -2.0])
    state = strategy.apply(state, step)
    state = strategy.apply(state, step)
    np.testing.assert_allclose(state.velocity, 1.9 * step)
    np.testing.assert_allclose(state.params, 0.5 * (1.0 + 1.9) * step)


# --- clipping and noise -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.floats(-1e6, 1e6, allow_subnormal=False), min_size=3, max_size=3),
        min_size=1,
        max_size=8,
    ),
    clip=st.floats(1e-3, 1e3),
)
def test_clipping_bounds_every_norm(rows: list[list[float]], clip: float) -> None:
    updates = np.array(rows)
    clipped, unclipped = clip_rows(updates, clip)
    norms = np.linalg.norm(clipped, axis=1)
    assert np.all(norms <= clip * (1 + 1e-12))
    np.testing.assert_array_equal(clipped[unclipped], updates[unclipped])
    # A clipped row keeps its direction.
    big = ~unclipped
    np.testing.assert_allclose(
        clipped[big] * np.linalg.norm(updates[big], axis=1)[:, None] / clip,
        updates[big],
        rtol=1e-9,
        atol=1e-12,
    )


def test_clip_update_reports_whether_it_clipped() -> None:
    assert clip_update(np.array([3.0, 4.0]), 5.0)[1]
    clipped, unclipped = clip_update(np.array([3.0, 4.0]), 1.0)
    assert not unclipped
    np.testing.assert_allclose(clipped, [0.6, 0.8])


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_uploads_lie_on_the_public_lattice(mode: str) -> None:
    """A noised upload is g times integers: the lattice step g = 2^(floor(log2 C) - 16)
    (the noise is discrete, not floating point)."""
    config = DPConfig(mode, clip_norm=0.7, noise_multiplier=1.1, expected_clients=9)  # type: ignore[arg-type]
    upload = privatize(np.random.default_rng(3).normal(0, 1, 300), config, 0.7).update
    step = 2.0 ** (math.floor(math.log2(0.7)) - 16)
    units = upload / step
    assert np.array_equal(units, np.round(units))
    assert np.any(units != 0)


def _variance_interval(n: int, variance: float) -> tuple[float, float]:
    """Acceptance interval for a sample variance of n normal draws (chi-square, two-sided)."""
    low, high = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], n - 1)
    return variance * low / (n - 1), variance * high / (n - 1)


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_client_noise_has_the_calibrated_std(mode: str) -> None:
    config = DPConfig(mode, clip_norm=2.0, noise_multiplier=1.3, expected_clients=25)  # type: ignore[arg-type]
    update = np.full(5_000, 0.01)
    contribution = privatize(update, config, 2.0, np.random.default_rng(9))
    noise = contribution.update - update  # the update is within the clip norm
    std = 1.3 * 2.0 if mode == "local" else 1.3 * 2.0 / 5.0
    assert abs(noise.mean()) < 5.33 * std / math.sqrt(noise.size)  # two-sided 1e-7
    low, high = _variance_interval(noise.size, std**2)
    assert low < noise.var(ddof=1) < high


def test_central_noise_is_added_once_with_a_fixed_denominator() -> None:
    """Sum of clipped updates / (q W) plus N(0, (z C / (q W))^2) per coordinate."""
    config = DPConfig(
        "central", clip_norm=1.0, noise_multiplier=0.8, expected_clients=40, sample_rate=0.4
    )
    aggregation = PrivateAggregation(FedAvg(), config)
    updates = np.zeros((30, 4_000))
    updates[:, 0] = 3.0  # clipped to 1.0 by the server
    outcome = aggregation.aggregate(
        updates, np.zeros(30), np.ones(30), 1.0, np.random.default_rng(10)
    )
    std = 0.8 * 1.0 / 40
    noise = outcome.mean_update[1:]
    low, high = _variance_interval(noise.size, std**2)
    assert low < noise.var(ddof=1) < high
    assert abs(outcome.mean_update[0] - 30 / 40) < 6 * std  # 30 clipped ones over q W = 40


@pytest.mark.slow
def test_private_uploads_never_exceed_the_norm_bound() -> None:
    config = DPConfig("local", clip_norm=0.7, noise_multiplier=2.0, expected_clients=10)
    rng = np.random.default_rng(11)
    bound = config.max_upload_norm(0.7, 650)
    norms = [
        np.linalg.norm(privatize(rng.normal(0, 5, 650), config, 0.7, rng).update)
        for _ in range(200)
    ]
    assert max(norms) <= bound
    assert DPConfig("central", 0.7, 2.0, 10).max_upload_norm(0.7, 650) == math.inf  # re-clipped


# --- adaptive clipping ---------------------------------------------------------------


def test_adaptive_noise_split_is_as_private_as_z() -> None:
    """(z_Delta^-2 + (2 sigma_b)^-2)^(-1/2) = z: the pair of releases composes to z."""
    config = DPConfig(
        "central", 1.0, 1.1, expected_clients=100, sample_rate=0.1, adaptive=AdaptiveClipping(5.0)
    )
    z_delta = config.update_noise_multiplier
    assert z_delta > 1.1
    assert math.isclose((z_delta**-2 + (2 * 5.0) ** -2) ** -0.5, 1.1, rel_tol=1e-12)
    with pytest.raises(ValueError, match="count_noise"):
        DPConfig("central", 1.0, 11.0, 100, 0.1, adaptive=AdaptiveClipping(5.0))
    with pytest.raises(ValueError, match="central and distributed"):
        DPConfig("local", 1.0, 1.0, 100, 0.1, adaptive=AdaptiveClipping(5.0))


def test_adaptive_clip_norm_tracks_the_target_quantile() -> None:
    """Noise-free, C moves geometrically until half of the norms are below it."""
    rng = np.random.default_rng(12)
    norms = rng.lognormal(0.0, 0.5, 400)  # median 1.0
    adaptive = AdaptiveClipping(count_noise=1.0, target_quantile=0.5, learning_rate=0.2)
    config = DPConfig("central", 0.05, 0.0, expected_clients=400, adaptive=adaptive)
    aggregation = PrivateAggregation(FedAvg(), config)
    clip = 0.05
    updates = norms[:, None] * np.eye(400)[:, :1]
    for _ in range(150):
        bits = (norms <= clip).astype(float)
        clip = aggregation.aggregate(updates, bits, np.ones(400), clip).clip_norm
    assert abs(np.mean(norms <= clip) - 0.5) < 0.03


def test_adaptive_counts_unclipped_updates() -> None:
    adaptive = AdaptiveClipping(1.0, target_quantile=0.5, learning_rate=0.2)
    assert adaptive.next_clip_norm(1.0, 1.0) < 1.0  # all unclipped: shrink
    assert adaptive.next_clip_norm(1.0, 0.0) > 1.0  # all clipped: grow


@given(
    clip=st.floats(MIN_CLIP_NORM, MAX_CLIP_NORM),
    fraction=st.floats(allow_nan=False, allow_infinity=False),
    rate=st.floats(1e-6, 1e300),
)
def test_adaptive_step_is_clamped_and_finite(clip: float, fraction: float, rate: float) -> None:
    """Whatever the noisy fraction and learning rate, C moves by at most a factor e and
    stays in [MIN_CLIP_NORM, MAX_CLIP_NORM]."""
    new = AdaptiveClipping(1.0, 0.5, rate).next_clip_norm(clip, fraction)
    assert MIN_CLIP_NORM <= new <= MAX_CLIP_NORM
    ratio = new / clip
    step = math.exp(MAX_CLIP_LOG_STEP)
    assert 1 / step * (1 - 1e-12) <= ratio <= step * (1 + 1e-12) or new in (
        MIN_CLIP_NORM,
        MAX_CLIP_NORM,
    )


def test_adaptive_step_refuses_non_finite_fractions() -> None:
    adaptive = AdaptiveClipping(1.0)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="must be finite"):
            adaptive.next_clip_norm(1.0, bad)


@pytest.mark.parametrize("hostile", [-1e6, -2000.0, 1e6, 5.0])
def test_central_mode_clips_hostile_unclipped_bits(hostile: float) -> None:
    """One device reporting any bit moves the count as a bit in [0, 1] does (no noise here,
    so the outcome is exact); it used to overflow exp (-1e6) or blow C up to 1e58 (-2000)."""
    adaptive = AdaptiveClipping(count_noise=1.0, target_quantile=0.5, learning_rate=0.2)
    config = DPConfig("central", 1.0, 0.0, expected_clients=3, adaptive=adaptive)
    aggregation = PrivateAggregation(FedAvg(), config)
    updates = np.full((3, 4), 0.01)
    outcome = aggregation.aggregate(updates, np.array([hostile, 1.0, 1.0]), np.ones(3), 1.0)
    clipped = min(max(hostile, 0.0), 1.0)
    assert outcome.unclipped_fraction == pytest.approx((clipped + 2.0) / 3.0)
    assert outcome.clip_norm == pytest.approx(adaptive.next_clip_norm(1.0, (clipped + 2.0) / 3.0))


@pytest.mark.slow
def test_distributed_unclipped_range_holds_honest_bits_and_bounds_hostile_ones() -> None:
    """Honest noisy bits lie in [-t s, 1 + t s] (each leaves it with probability below
    exp(-50), so 2,000 draws all inside fail with probability below 1e-18), and carry
    their noise share: the sample std of 2,000 draws is within 15% of s (9 standard errors
    of 1 / sqrt(2 n) = 1.6%: a false failure below 1e-18). The aggregation brings a hostile
    bit into that range, so it moves the count by at most 1 + 2 t s."""
    adaptive = AdaptiveClipping(count_noise=5.0)
    config = DPConfig("distributed", 1.0, 1.0, expected_clients=100, adaptive=adaptive)
    s = 5.0 / math.sqrt(100)
    assert config.unclipped_noise_std == pytest.approx(s)
    low, high = config.unclipped_range()
    t = UNCLIPPED_TAIL_ALLOWANCE
    assert (low, high) == pytest.approx((-t * s, 1 + t * s))
    rng = np.random.default_rng(31)
    bits = np.array([privatize(np.zeros(2), config, 1.0, rng).unclipped for _ in range(2_000)])
    assert np.all((low <= bits) & (bits <= high))
    assert abs(np.std(bits) - s) < 0.15 * s  # the share is there
    free = DPConfig("distributed", 1.0, 0.0, expected_clients=100, adaptive=adaptive)
    assert free.unclipped_range() == (0.0, 1.0)  # no noise: the bit is exactly 0 or 1
    aggregation = PrivateAggregation(FedAvg(), free)
    outcome = aggregation.aggregate(np.zeros((2, 2)), np.array([-1e6, 1.0]), np.ones(2), 1.0)
    assert outcome.unclipped_fraction == pytest.approx(1.0 / 100)


def test_adaptive_clipping_needs_room_in_the_noise_split() -> None:
    """2 sigma_b barely above z leaves z_Delta near infinity: refused at construction (it
    used to pass the check, then z_Delta was 1e8 or a ZeroDivisionError)."""
    with pytest.raises(ValueError, match="count_noise"):
        DPConfig("central", 1.0, 1.0, 100, 0.1, adaptive=AdaptiveClipping(0.5 * (1 + 1e-15)))
    config = DPConfig("central", 1.0, 1.0, 100, 0.1, adaptive=AdaptiveClipping(0.5 * 1.01))
    assert math.isclose(config.update_noise_multiplier, (1 - 1 / 1.01**2) ** -0.5, rel_tol=1e-9)


# --- accounting -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rdp", "pld"])
@pytest.mark.slow
def test_rounds_accountant_matches_dp_accounting_directly(method: AccountingMethod) -> None:
    import dp_accounting
    from dp_accounting import pld, rdp

    rounds = {1.1: 300, 0.9: 200, 1.7: 50}
    interval = FEDERATED_DISCRETIZATION  # the PLD grid tasks are charged on
    accountant = (
        rdp.RdpAccountant()
        if method == "rdp"
        else pld.PLDAccountant(value_discretization_interval=interval)
    )
    for z, count in rounds.items():
        event = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(z))
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, count))
    expected = accountant.get_epsilon(1e-5)
    ours = gaussian_rounds_epsilon(
        rounds, 0.01, 1e-5, method, value_discretization_interval=interval
    )
    assert math.isclose(ours, expected, rel_tol=1e-9)
    running = GaussianRoundsAccountant(0.01, 1e-5, method, value_discretization_interval=interval)
    for z, count in rounds.items():
        for _ in range(count):
            running.record(z)
    assert math.isclose(running.epsilon(), expected, rel_tol=1e-9)


def test_rounds_accountant_reference_figure() -> None:
    """RDP of the subsampled Gaussian (Mironov, Talwar, Zhang 2019) at q = 0.01, z = 1.1,
    T = 1000, delta = 1e-5: epsilon 1.712."""
    running = GaussianRoundsAccountant(0.01, 1e-5, "rdp", {1.1: 999})
    assert round(running.epsilon_after(1.1), 3) == 1.712
    assert GaussianRoundsAccountant(0.01, 1e-5).epsilon() == 0.0


@pytest.mark.slow
def test_local_mode_calibration_is_per_upload_at_half_the_multiplier() -> None:
    config = TaskConfig(
        model=ModelSpec(kind="logistic", num_features=2, num_classes=2),
        mode="local",
        rounds=10,
        population=50,
        clients_per_round=50,
        target_epsilon=8.0,
    )
    z = calibrate(config)
    expected = calibrate_noise_multiplier(8.0, 1.0, 10, 1e-5, mechanism="discrete_gaussian")
    assert math.isclose(z, 2 * expected)
    # The discrete noise is accounted by its zCDP bound, never by the continuous PLD: it
    # needs at least the noise the continuous calibration would give.
    continuous = calibrate_noise_multiplier(
        8.0, 1.0, 10, 1e-5, value_discretization_interval=FEDERATED_DISCRETIZATION
    )
    assert z >= 2 * continuous
    # Each upload on its own: the discrete Gaussian mechanism at z / 2 (sensitivity 2 Delta).
    single = gaussian_epsilon(z / 2, 1.0, 1, 1e-5, mechanism="discrete_gaussian")
    assert single < 8.0


# --- tasks ------------------------------------------------------------------------------


def _task(**overrides: object) -> TaskConfig:
    values: dict[str, object] = {
        "model": ModelSpec(kind="logistic", num_features=4, num_classes=3),
        "mode": "central",
        "rounds": 10,
        "population": 200,
        "clients_per_round": 20,
        "target_epsilon": 2.0,
        "clip_norm": 1.0,
    }
    values.update(overrides)
    return TaskConfig.model_validate(values)


def _round(state: TaskState, m: int, rng: np.random.Generator) -> None:
    updates = rng.normal(0, 1, (m, state.num_params))
    state.close_round(updates, np.ones(m), np.ones(m), rng)


def test_task_spends_its_target_and_refuses_one_round_more() -> None:
    state = TaskState.start(_task())
    rng = np.random.default_rng(13)
    for _ in range(state.config.rounds):
        _round(state, 20, rng)
    assert state.epsilon() <= 2.0 + 1e-9
    assert state.epsilon() > 1.9  # calibrated: the target is nearly used up
    assert state.history[-1].epsilon == state.epsilon()
    with pytest.raises(BudgetExhaustedError, match="planned rounds"):
        state.check_round()


def test_task_planning_more_than_the_epsilon_cap_is_refused() -> None:
    """z = 0.3 unsampled over 10000 rounds plans epsilon ~6e4 (RDP bound): refused by the
    cheap RDP screen; just inside the cap the task starts and its PLD budget is below the
    RDP bound (PLD is the tighter upper bound)."""
    with pytest.raises(ValueError, match=r"spend epsilon up to 6\d{4}.*RDP bound.*100"):
        TaskState.start(
            _task(target_epsilon=None, noise_multiplier=0.3, rounds=10_000, clients_per_round=200)
        )
    config = _task(target_epsilon=None, noise_multiplier=1.0, rounds=100, clients_per_round=200)
    state = TaskState.start(config)
    rdp = gaussian_rounds_epsilon({1.0: 100}, 1.0, config.delta, "rdp")
    assert rdp <= MAX_PLANNED_EPSILON
    assert 0 < state.budget <= rdp


def test_task_refuses_a_round_past_a_given_budget() -> None:
    """With a target epsilon and an explicit, too small noise, the accountant stops the task."""
    state = TaskState.start(_task(rounds=1000), noise_multiplier=0.6)
    rng = np.random.default_rng(14)
    with pytest.raises(BudgetExhaustedError, match="budget"):
        for _ in range(1000):
            _round(state, 20, rng)
    assert state.epsilon() <= 2.0 + 1e-9
    assert state.round < 1000


def test_distributed_calibration_covers_rounds_with_fewest_clients() -> None:
    config = _task(mode="distributed", min_clients=10)
    state = TaskState.start(config)
    central = TaskState.start(_task()).noise_multiplier
    assert math.isclose(state.noise_multiplier, central * math.sqrt(2.0))
    rng = np.random.default_rng(15)
    for _ in range(config.rounds):
        _round(state, 10, rng)  # every round at the fewest clients allowed
    assert state.epsilon() <= 2.0 + 1e-9


def test_task_state_round_trips_through_json() -> None:
    state = TaskState.start(_task(adaptive_clipping={"target_quantile": 0.6}))
    rng = np.random.default_rng(16)
    for _ in range(3):
        _round(state, 20, rng)
    restored = TaskState.from_json(state.to_json())
    np.testing.assert_array_equal(restored.server.params, state.server.params)
    np.testing.assert_array_equal(restored.server.velocity, state.server.velocity)
    assert restored.clip_norm == state.clip_norm != 1.0
    assert restored.epsilon() == state.epsilon()
    assert restored.history == state.history


def test_adaptive_task_with_too_little_count_noise_names_the_fields() -> None:
    """clients_per_round = 20 gives the default count noise 1, too little for z = 2."""
    with pytest.raises(ValueError, match=r"clients_per_round / 20.*noise_multiplier.*at least"):
        _task(target_epsilon=None, noise_multiplier=2.0, adaptive_clipping={})
    _task(target_epsilon=None, noise_multiplier=2.0, adaptive_clipping={"count_noise": 1.5})
    small = _task(  # q = 1: calibrated in a fraction of the time a sampled task takes
        population=3, clients_per_round=3, rounds=4, target_epsilon=4.0, adaptive_clipping={}
    )
    with pytest.raises(ValueError, match=r"calibrated for target_epsilon=4.*count_noise"):
        TaskState.start(small)


def test_a_non_finite_round_raises_and_changes_nothing() -> None:
    state = TaskState.start(_task(mode="none", target_epsilon=None, server_learning_rate=1e300))
    params = state.server.params.copy()
    updates = np.full((2, state.num_params), 1e10)
    with pytest.raises(ArithmeticError, match="non-finite"):
        state.close_round(updates, np.ones(2), np.ones(2), np.random.default_rng(0))
    assert state.round == 0 and not state.history
    np.testing.assert_array_equal(state.server.params, params)


@settings(max_examples=30, deadline=None)
@given(
    mode=st.sampled_from(["none", "local", "central", "distributed"]),
    clients=st.sampled_from([1.0, 1.5, 20.0, 200.0]),
    noise=st.sampled_from([0.0, 0.7, 1e3, 1e6]),
    clip=st.sampled_from([MIN_CLIP_NORM, 1.0, MAX_CLIP_NORM]),
    adaptive=st.sampled_from([None, {}, {"count_noise": 0.5000001}, {"count_noise": 1e12}]),
    bits=st.sampled_from([-1e6, -2000.0, 0.0, 1.0, 1e6]),
)
def test_every_valid_config_starts_and_survives_a_hostile_round(
    mode: str, clients: float, noise: float, clip: float, adaptive: object, bits: float
) -> None:
    """What the service runs on create (start, check_round, budget) and on close never
    raises for a config that validated, whatever the uploaded bits (RDP accounting keeps
    each example fast)."""
    overrides: dict[str, object] = {
        "mode": mode, "clients_per_round": clients, "clip_norm": clip, "rounds": 3,
        "accounting": "rdp",
        "target_epsilon": None, "noise_multiplier": None if mode == "none" else noise,
        "adaptive_clipping": adaptive,
    }  # fmt: skip
    try:
        config = _task(**overrides)
    except ValueError:
        return  # refused at validation: the service answers 422
    state = TaskState.start(config)
    assert state.budget >= 0
    try:
        state.check_round()
    except BudgetExhaustedError:
        return  # born out of budget (rounds at min_clients cost more): the service says so
    rng = np.random.default_rng(5)
    updates = rng.normal(0, 1, (2, state.num_params))
    state.close_round(updates, np.array([bits, 1.0]), np.ones(2), rng)
    assert math.isfinite(state.clip_norm) and MIN_CLIP_NORM <= state.clip_norm <= MAX_CLIP_NORM
    assert np.all(np.isfinite(state.server.params))


def test_noise_multiplier_and_clip_norm_ranges() -> None:
    with pytest.raises(ValueError, match="at least 0.1"):
        _task(target_epsilon=None, noise_multiplier=1e-6)
    with pytest.raises(ValueError, match="clip_norm"):
        _task(clip_norm=1e7)


def test_non_private_task_reports_infinite_epsilon() -> None:
    state = TaskState.start(_task(mode="none", target_epsilon=None))
    _round(state, 5, np.random.default_rng(17))
    assert state.epsilon() == math.inf
    assert not state.dp.private


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clients_per_round": 300}, "exceeds population"),
        ({"target_epsilon": None}, "noise_multiplier or a target_epsilon"),
        ({"noise_multiplier": 1.0}, "not both"),
        ({"mode": "none"}, "adds no noise"),
        ({"mode": "local", "adaptive_clipping": {}}, "adaptive"),
        ({"min_clients": 5, "max_clients": 4}, "max_clients"),
        ({"rounds": 0}, "rounds"),
    ],
)
def test_task_config_errors_name_the_problem(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _task(**overrides)


def test_distributed_rounds_are_charged_on_a_conservative_grid() -> None:
    config = _task(mode="distributed", population=2000, clients_per_round=200, min_clients=150)
    state = TaskState.start(config)
    rng = np.random.default_rng(18)
    sizes = rng.integers(150, 260, 8)  # 8 rounds of 8 sizes, on 5 grid points
    for m in sizes:
        _round(state, int(m), rng)
    charged = state.accountant_rounds
    assert len(charged) < len(set(sizes.tolist()))  # nearby sizes share a grid point

    def epsilon_at(scale: float) -> float:
        rounds: dict[float, int] = {}
        for m in sizes:
            z = state.dp.accounting_noise_multiplier(int(m)) * scale
            rounds[z] = rounds.get(z, 0) + 1
        return gaussian_rounds_epsilon(
            rounds, state.config.sample_rate, 1e-5, mechanism="discrete_gaussian"
        )

    # Never below the exact charge, never above the charge one grid step lower.
    assert epsilon_at(1.0) <= state.epsilon() <= epsilon_at(1 / ACCOUNTING_GRID)
