"""DP-SGD: per-example gradients, clipping, noise, Poisson sampling, accounting, training.

Statistical tests use fixed seeds; each has a false-failure rate of at most
``ALPHA = 1e-6`` under the hypothesis it checks (the stated distribution).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.accounting import gaussian_epsilon
from shared.federated.dpsgd import (
    DPSGD,
    clipped_gradient_sum,
    dpsgd_train,
    dpsgd_update,
    noisy_gradient,
    per_example_gradients,
    poisson_batch,
)
from shared.federated.models import MLP, LogisticRegression, Model, PerExampleModel, accuracy

ALPHA = 1e-6
DELTA = 1e-5


def batch(rng: np.random.Generator, n: int = 24, features: int = 5, classes: int = 3) -> Any:
    return rng.normal(size=(n, features)), rng.integers(0, classes, size=n)


MODELS: list[Model] = [
    LogisticRegression(5, 3),
    LogisticRegression(5, 3, l2=0.3),
    MLP(5, 3, hidden=4),
    MLP(5, 3, hidden=4, l2=0.2),
]


class Opaque:
    """A model without ``per_example_grads``: DP-SGD must fall back to one call per example."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner

    @property
    def num_params(self) -> int:
        return self.inner.num_params

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        return self.inner.init_params(rng)

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> Any:
        return self.inner.loss_and_grad(params, x, y)

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self.inner.predict(params, x)


# --- per-example gradients ---------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS, ids=repr)
def test_per_example_gradients_equal_single_example_gradients(model: Model) -> None:
    rng = np.random.default_rng(1)
    x, y = batch(rng)
    params = rng.normal(size=model.num_params)
    assert isinstance(model, PerExampleModel)
    rows = model.per_example_grads(params, x, y)
    loop = np.stack([model.loss_and_grad(params, x[i : i + 1], y[i : i + 1])[1] for i in range(24)])
    assert rows.shape == (24, model.num_params)
    np.testing.assert_allclose(rows, loop, rtol=0, atol=1e-10)
    # and their mean is the batch gradient
    np.testing.assert_allclose(rows.mean(axis=0), model.loss_and_grad(params, x, y)[1], atol=1e-12)


@pytest.mark.parametrize("model", MODELS[::2], ids=repr)
def test_models_without_per_example_grads_fall_back_to_a_loop(model: Model) -> None:
    rng = np.random.default_rng(2)
    x, y = batch(rng)
    params = rng.normal(size=model.num_params)
    opaque = Opaque(model)
    assert not isinstance(opaque, PerExampleModel)
    np.testing.assert_allclose(
        per_example_gradients(opaque, params, x, y),
        per_example_gradients(model, params, x, y),
        atol=1e-12,
    )
    assert per_example_gradients(opaque, params, x[:0], y[:0]).shape == (0, model.num_params)


# --- clipping and accumulation ---------------------------------------------------------


@pytest.mark.parametrize("model", MODELS, ids=repr)
@pytest.mark.parametrize("clip_norm", [1e-3, 0.5, 100.0])
def test_each_examples_contribution_is_at_most_the_clip_norm(
    model: Model, clip_norm: float
) -> None:
    """The clipped sum with example i minus the sum without it (add-or-remove-one) has
    norm min(||g_i||, C) <= C, for every i."""
    rng = np.random.default_rng(3)
    x, y = batch(rng, n=12)
    x *= 10.0  # large gradients, so that small clip norms bite
    params = rng.normal(size=model.num_params)
    full = clipped_gradient_sum(model, params, x, y, clip_norm)
    norms = np.linalg.norm(per_example_gradients(model, params, x, y), axis=1)
    for i in range(12):
        rest = np.delete(np.arange(12), i)
        without = clipped_gradient_sum(model, params, x[rest], y[rest], clip_norm)
        contribution = float(np.linalg.norm(full - without))
        assert contribution <= clip_norm * (1 + 1e-9)
        assert contribution == pytest.approx(min(norms[i], clip_norm), rel=1e-9)


@pytest.mark.parametrize("chunk", [1, 5, 7, 1000])
def test_gradient_accumulation_equals_one_pass(chunk: int) -> None:
    rng = np.random.default_rng(4)
    model = MLP(5, 3, hidden=4)
    x, y = batch(rng, n=23)
    params = rng.normal(size=model.num_params)
    one_pass = clipped_gradient_sum(model, params, x, y, 0.7, max_physical_batch=23)
    accumulated = clipped_gradient_sum(model, params, x, y, 0.7, max_physical_batch=chunk)
    np.testing.assert_allclose(accumulated, one_pass, atol=1e-12)
    assert not np.any(clipped_gradient_sum(model, params, x[:0], y[:0], 0.7))


# --- noise -----------------------------------------------------------------------------


def test_noise_is_gaussian_with_std_sigma_c() -> None:
    """Over 40 draws of a 68-parameter gradient (2,720 coordinates), ``(g q N - clipped
    sum) / (sigma C)`` fits N(0, 1) (Kolmogorov-Smirnov) and its sum of squares the
    chi-square with 2,720 degrees of freedom (two-sided); each at ALPHA / 2."""
    rng = np.random.default_rng(5)
    model = MLP(5, 3, hidden=8)
    x, y = batch(rng, n=30)
    params = rng.normal(size=model.num_params)
    config = DPSGD(noise_multiplier=1.7, clip_norm=0.4, sample_rate=0.2, learning_rate=0.1)
    chosen = np.arange(0, 30, 3)
    exact = clipped_gradient_sum(model, params, x[chosen], y[chosen], config.clip_norm)
    scale = config.sample_rate * len(x)
    draws = np.concatenate(
        [
            noisy_gradient(model, params, x, y, chosen, config, rng) * scale - exact
            for _ in range(40)
        ]
    ) / (config.noise_multiplier * config.clip_norm)
    assert stats.kstest(draws, "norm").pvalue > ALPHA / 2
    squares = float(np.sum(draws**2))
    tail = min(stats.chi2.cdf(squares, draws.size), stats.chi2.sf(squares, draws.size))
    assert 2 * tail > ALPHA / 2


def test_without_noise_the_gradient_is_the_clipped_sum_over_the_expected_batch() -> None:
    rng = np.random.default_rng(6)
    model = LogisticRegression(5, 3)
    x, y = batch(rng, n=20)
    params = rng.normal(size=model.num_params)
    config = DPSGD(0.0, 0.5, 0.25, 0.1)
    chosen = np.array([1, 4, 9])
    expected = clipped_gradient_sum(model, params, x[chosen], y[chosen], 0.5) / (0.25 * 20)
    np.testing.assert_allclose(noisy_gradient(model, params, x, y, chosen, config, rng), expected)


def test_the_default_randomness_is_the_operating_systems() -> None:
    """rng=None draws batches and noise from the OS CSPRNG: two runs differ."""
    rng = np.random.default_rng(7)
    model = LogisticRegression(5, 3)
    x, y = batch(rng)
    config = DPSGD(1.0, 1.0, 0.5, 0.1)
    start = np.zeros(model.num_params)
    first, second = (dpsgd_train(model, start, x, y, config, 2) for _ in range(2))
    assert not np.array_equal(first, second)


# --- Poisson sampling ------------------------------------------------------------------


def test_poisson_sampling_includes_each_record_with_probability_q() -> None:
    """Over 400 steps of 500 records at q = 0.03: the total drawn is Binomial(200,000, q)
    (two-sided, ALPHA / 2), and the per-record counts fit Binomial(400, q) (chi-square
    over the pooled count cells, ALPHA / 2)."""
    rng = np.random.default_rng(8)
    steps, records, q = 400, 500, 0.03
    counts = np.zeros(records, dtype=np.int64)
    for _ in range(steps):
        chosen = poisson_batch(records, q, rng)
        assert np.all(np.diff(chosen) > 0)
        counts[chosen] += 1
    total = int(counts.sum())
    assert stats.binomtest(total, steps * records, q).pvalue > ALPHA / 2
    cells = np.arange(0, 25)
    probabilities = stats.binom.pmf(cells, steps, q)
    probabilities[-1] += stats.binom.sf(cells[-1], steps, q)
    observed = np.bincount(np.minimum(counts, cells[-1]), minlength=cells.size)
    keep = probabilities * records >= 5
    pooled_expected = np.append(probabilities[keep], probabilities[~keep].sum()) * records
    pooled_observed = np.append(observed[keep], observed[~keep].sum())
    assert stats.chisquare(pooled_observed, pooled_expected).pvalue > ALPHA / 2


# --- accounting ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rdp", "pld"])
@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.01, 1.1, 1000), (1 / 23, 1.5, 460)])
def test_epsilon_equals_dp_accountings(method: str, q: float, sigma: float, steps: int) -> None:
    import dp_accounting
    from dp_accounting import pld, rdp

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    reference = (
        rdp.RdpAccountant()
        if method == "rdp"
        else pld.PLDAccountant(value_discretization_interval=1e-4)
    ).compose(event)
    config = DPSGD(sigma, 1.0, q, 0.1)
    # The steps add discrete Gaussian noise, accounted by its zCDP bound (Zhu and Wang's
    # Poisson subsampling), never below the continuous Gaussian's figure by either method.
    spent = config.epsilon(steps, DELTA, method)  # type: ignore[arg-type]
    discrete = gaussian_epsilon(sigma, q, steps, DELTA, mechanism="discrete_gaussian")
    assert spent == discrete >= reference.get_epsilon(DELTA)
    assert config.epsilon(0, DELTA) == 0.0
    assert DPSGD(0.0, 1.0, q, 0.1).epsilon(steps, DELTA) == math.inf


def test_known_figures() -> None:
    """q = 0.01, sigma = 1.1, 1000 steps, delta 1e-5: dp-accounting's published figures
    for the continuous Gaussian are 1.712 (RDP) and 1.515 (PLD); the discrete Gaussian
    steps DP-SGD runs are charged 2.015, by their zCDP bound, whatever the method."""
    config = DPSGD(1.1, 1.0, 0.01, 0.1)
    assert gaussian_epsilon(1.1, 0.01, 1000, DELTA, "rdp") == pytest.approx(1.712, abs=1e-3)
    assert gaussian_epsilon(1.1, 0.01, 1000, DELTA, "pld") == pytest.approx(1.515, abs=1e-3)
    assert config.epsilon(1000, DELTA, "rdp") == pytest.approx(2.015, abs=1e-3)
    assert config.epsilon(1000, DELTA, "pld") == config.epsilon(1000, DELTA, "rdp")


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_calibration_inverts_the_accountant(method: str) -> None:
    """The calibrated sigma meets the target and is the smallest that does (0.1% less
    noise exceeds it)."""
    q, steps, target = 1 / 23, 460, 3.0
    config = DPSGD.calibrated(
        target, DELTA, steps, clip_norm=1.0, sample_rate=q, learning_rate=0.5,
        method=method,  # type: ignore[arg-type]
    )  # fmt: skip
    spent = config.epsilon(steps, DELTA, method)  # type: ignore[arg-type]
    assert target * (1 - 1e-3) <= spent <= target
    below = gaussian_epsilon(
        config.noise_multiplier * 0.999, q, steps, DELTA, mechanism="discrete_gaussian"
    )
    assert below > target


# --- training --------------------------------------------------------------------------


def test_train_leaves_its_input_alone_and_update_is_the_difference() -> None:
    rng = np.random.default_rng(9)
    model = LogisticRegression(5, 3)
    x, y = batch(rng)
    params = rng.normal(size=model.num_params)
    before = params.copy()
    config = DPSGD(1.0, 1.0, 0.3, 0.1)
    trained = dpsgd_train(model, params, x, y, config, 5, np.random.default_rng(0))
    update = dpsgd_update(model, params, x, y, config, 5, np.random.default_rng(0))
    np.testing.assert_array_equal(params, before)
    np.testing.assert_allclose(update, trained - params)
    np.testing.assert_array_equal(dpsgd_train(model, params, x, y, config, 0), params)


def test_the_fallback_trains_exactly_as_the_vectorized_path() -> None:
    rng = np.random.default_rng(10)
    model = MLP(5, 3, hidden=4)
    x, y = batch(rng)
    params = model.init_params(rng)
    config = DPSGD(0.8, 0.5, 0.4, 0.2, max_physical_batch=5)
    fast = dpsgd_train(model, params, x, y, config, 4, np.random.default_rng(1))
    slow = dpsgd_train(Opaque(model), params, x, y, config, 4, np.random.default_rng(1))
    np.testing.assert_allclose(slow, fast, atol=1e-12)


@pytest.mark.slow
def test_digits_at_epsilon_3_reaches_the_benchmarked_accuracy() -> None:
    """Logistic regression on the bundled digits (80% train), expected batch 64 (q = 1/23),
    20 epochs, C = 1, lr = 1, sigma calibrated for (3, 1e-5) by RDP (1.63; looser than
    PLD's 1.53, so a little more noise): measured 0.930-0.950 test accuracy over seeds 0-4
    at this sigma, and 0.944 averaged over 10 seeds at PLD's in the Opacus benchmark
    (non-private 0.95-0.975); 0.90 leaves a margin.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1438], order[1438:]
    model = LogisticRegression(64, 10)
    steps_per_epoch = math.ceil(1438 / 64)
    steps = 20 * steps_per_epoch
    config = DPSGD.calibrated(
        3.0, DELTA, steps, clip_norm=1.0, sample_rate=1 / steps_per_epoch, learning_rate=1.0,
        method="rdp",
    )  # fmt: skip
    assert config.epsilon(steps, DELTA, "rdp") <= 3.0
    rng = np.random.default_rng(0)
    params = dpsgd_train(model, model.init_params(rng), x[train] / 16, y[train], config, steps, rng)
    assert accuracy(model, params, x[test] / 16, y[test]) >= 0.90


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": math.inf}, "clip_norm"),
        ({"clip_norm": math.nan}, "clip_norm"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_physical_batch": 0}, "max_physical_batch"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    settings = {"noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 0.1,
                "learning_rate": 0.1} | kwargs  # fmt: skip
    with pytest.raises(ValueError, match=message):
        DPSGD(**settings)


def test_bad_training_input_is_refused() -> None:
    model = LogisticRegression(5, 3)
    config = DPSGD(1.0, 1.0, 0.1, 0.1)
    params = np.zeros(model.num_params)
    with pytest.raises(ValueError, match="at least one record"):
        dpsgd_train(model, params, np.zeros((0, 5)), np.zeros(0, dtype=int), config, 1)
    with pytest.raises(ValueError, match="labels"):
        dpsgd_train(model, params, np.zeros((3, 5)), np.zeros(2, dtype=int), config, 1)
    with pytest.raises(ValueError, match="steps"):
        dpsgd_train(model, params, np.zeros((3, 5)), np.zeros(3, dtype=int), config, -1)
