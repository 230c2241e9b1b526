"""DP-SGD: differentially private stochastic gradient descent over one holder's records.

Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar and Zhang, *Deep Learning with
Differential Privacy* (CCS 2016). Every step ``t`` of training on ``N`` records:

1. **Poisson sampling**: each record joins the step's batch ``B_t`` independently with
   probability ``q`` (the batch size varies; its expectation is ``q N``). Drawn with
   :meth:`shared.randomness.RandomSource.bernoulli_bytewise`, whose realized rate
   ``floor(q 2^53) / 2^53`` is at most ``q``: accounting at ``q`` is never optimistic.
2. **Per-example gradients** ``g_i = grad loss_i(theta)`` for ``i`` in ``B_t``: one
   vectorized pass for a :class:`~shared.federated.models.PerExampleModel` (the built-in
   models), else one ``loss_and_grad`` call per example (any other
   :class:`~shared.federated.models.Model`; correct, and slower by the per-call
   overhead times the batch size).
3. **Clipping** each to L2 norm ``C``: ``g_i <- g_i min(1, C / ||g_i||)``, so that adding
   or removing one record moves the sum by at most ``C``.
4. **Noise** on the sum, on an integer lattice (:class:`shared.federated.lattice.
   Lattice`): every clipped ``g_i`` is divided by the public step ``s`` (about
   ``C / 2^16``) and rounded to integers of L2 norm at most ``Delta`` (conditional
   randomized rounding; ``Delta`` a little above ``C / s``), and exact discrete Gaussian
   noise is added to the integer sum: ``g = s (sum_i round(g_i / s) + N_Z(0, (sigma
   Delta)^2 I)) / (q N)`` (the operating system's CSPRNG unless a seeded generator is
   passed, for simulations), divided by the *expected* batch size, a constant. Without
   noise (``sigma = 0``) the float sum ``sum_i g_i / (q N)`` is used as it is.
5. **Step**: ``theta <- theta - eta g``.

Large batches are processed in chunks of at most ``max_physical_batch`` examples whose
clipped sums are added up (gradient accumulation): memory stays at
``max_physical_batch x num_params`` floats per step, the noise is drawn once per step,
and the result equals the single-pass one.

Privacy. Each step is the Poisson-subsampled discrete Gaussian mechanism with noise
multiplier ``sigma`` (relative to the lattice sensitivity ``Delta``) and sampling rate
``q`` (add-or-remove-one-record neighbours; the record count ``N``, which fixes the
expected batch size, is public, as in every DP-SGD implementation): ``1 / (2 sigma^2)``-
zCDP before sampling (Canonne, Kamath and Steinke 2020). ``T`` steps are accounted by
:mod:`shared.accounting` by that zCDP bound with Zhu and Wang's Poisson subsampling
(``mechanism="discrete_gaussian"``, whatever the method; :meth:`DPSGD.epsilon`);
:meth:`DPSGD.calibrated` finds the smallest ``sigma`` that meets a target epsilon. A
multiplier of 0 clips without noise: the non-private baseline (epsilon infinite).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np

from shared.accounting import AccountingMethod, calibrate_noise_multiplier, gaussian_epsilon
from shared.federated.lattice import Lattice
from shared.federated.models import Model
from shared.federated.privacy import MAX_CLIP_NORM, clip_rows
from shared.randomness import RandomSource, Rng, as_source, threshold53

__all__ = [
    "DPSGD",
    "clipped_gradient_sum",
    "dpsgd_train",
    "dpsgd_update",
    "lattice_gradient_sum",
    "noisy_gradient",
    "per_example_gradients",
    "poisson_batch",
]

#: The largest physical batch (rows of per-example gradients held at once) by default.
DEFAULT_PHYSICAL_BATCH = 512


@dataclass(frozen=True)
class DPSGD:
    """The hyper-parameters of DP-SGD: ``sigma``, ``C``, ``q``, ``eta``, the chunk size."""

    noise_multiplier: float
    clip_norm: float
    sample_rate: float
    learning_rate: float
    max_physical_batch: int = DEFAULT_PHYSICAL_BATCH

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}"
            )
        if not 0 < self.clip_norm <= MAX_CLIP_NORM:  # also refuses NaN
            raise ValueError(
                f"clip_norm must be a number in (0, {MAX_CLIP_NORM:g}], got {self.clip_norm!r}"
            )
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {self.sample_rate!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"learning_rate must be a finite number > 0, got {self.learning_rate!r}"
            )
        if isinstance(self.max_physical_batch, bool) or self.max_physical_batch < 1:
            raise ValueError(
                f"max_physical_batch must be an integer >= 1, got {self.max_physical_batch!r}"
            )

    @property
    def private(self) -> bool:
        """Whether the steps add noise (and so have a finite epsilon)."""
        return self.noise_multiplier > 0

    def epsilon(self, steps: int, delta: float, method: AccountingMethod = "pld") -> float:
        """Epsilon at ``delta`` after ``steps`` steps (0 for none, inf without noise)."""
        if steps == 0:
            return 0.0
        if not self.private:
            return math.inf
        return gaussian_epsilon(
            self.noise_multiplier, self.sample_rate, steps, delta, method,
            mechanism="discrete_gaussian",
        )  # fmt: skip

    @classmethod
    def calibrated(
        cls,
        target_epsilon: float,
        delta: float,
        steps: int,
        *,
        clip_norm: float,
        sample_rate: float,
        learning_rate: float,
        max_physical_batch: int = DEFAULT_PHYSICAL_BATCH,
        method: AccountingMethod = "pld",
    ) -> DPSGD:
        """The smallest ``sigma`` whose ``steps`` steps are ``(target_epsilon, delta)``-DP
        (:func:`shared.accounting.calibrate_noise_multiplier` of the discrete Gaussian),
        with the other settings."""
        sigma = calibrate_noise_multiplier(
            target_epsilon, sample_rate, steps, delta, method, mechanism="discrete_gaussian"
        )
        return cls(sigma, clip_norm, sample_rate, learning_rate, max_physical_batch)


def per_example_gradients(
    model: Model, params: np.ndarray, x: np.ndarray, y: np.ndarray
) -> np.ndarray:
    """``(n, num_params)``: row ``i`` is the gradient of example ``i``'s own loss.

    One vectorized pass when ``model`` is a :class:`PerExampleModel`; otherwise one
    ``loss_and_grad`` call on each single example (the fallback for models that do not
    provide ``per_example_grads``). The method is looked up directly: a runtime protocol
    check costs more than a small model's whole step.
    """
    vectorized = getattr(model, "per_example_grads", None)
    if callable(vectorized):
        return cast(np.ndarray, vectorized(params, x, y))
    rows = [model.loss_and_grad(params, x[i : i + 1], y[i : i + 1])[1] for i in range(len(x))]
    return np.stack(rows) if rows else np.zeros((0, model.num_params))


def clipped_gradient_sum(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    clip_norm: float,
    max_physical_batch: int = DEFAULT_PHYSICAL_BATCH,
) -> np.ndarray:
    """``sum_i g_i min(1, C / ||g_i||)`` over the rows of ``(x, y)``, in chunks of at most
    ``max_physical_batch`` examples (gradient accumulation); zeros for no rows."""
    total = np.zeros(model.num_params)
    for clipped in _clipped_chunks(model, params, x, y, clip_norm, max_physical_batch):
        total += clipped.sum(axis=0)
    return total


def lattice_gradient_sum(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    lattice: Lattice,
    max_physical_batch: int = DEFAULT_PHYSICAL_BATCH,
    rng: Rng | RandomSource = None,
) -> np.ndarray:
    """``sum_i round(clip(g_i) / s)``: every clipped gradient rounded onto ``lattice``
    (norm at most its ``Delta``) and summed as int64, in chunks as
    :func:`clipped_gradient_sum`."""
    source = as_source(rng)
    total = np.zeros(model.num_params, dtype=np.int64)
    chunks = _clipped_chunks(model, params, x, y, lattice.clip_norm, max_physical_batch)
    for clipped in chunks:
        total += lattice.round(clipped, source).sum(axis=0)
    return total


def _clipped_chunks(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    clip_norm: float,
    max_physical_batch: int,
) -> Iterator[np.ndarray]:
    """The clipped per-example gradients of ``(x, y)``, ``max_physical_batch`` rows at a time."""
    for start in range(0, len(x), max_physical_batch):
        chunk = slice(start, start + max_physical_batch)
        yield clip_rows(per_example_gradients(model, params, x[chunk], y[chunk]), clip_norm)[0]


def poisson_batch(
    num_records: int, sample_rate: float, rng: Rng | RandomSource = None
) -> np.ndarray:
    """The indices of the records one step samples, each independently with probability
    ``floor(q 2^53) / 2^53 <= q`` (:meth:`RandomSource.bernoulli_bytewise`: one random
    byte per record decides all but the 1/256 that tie, which draw six more)."""
    threshold = int(threshold53(sample_rate, "down"))
    return np.flatnonzero(as_source(rng).bernoulli_bytewise(threshold, num_records))


def noisy_gradient(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    batch: np.ndarray,
    config: DPSGD,
    rng: Rng | RandomSource = None,
) -> np.ndarray:
    """One step's gradient over the records ``batch`` (indices) of the ``N = len(x)``
    records: ``s (sum_(i in batch) round(clip(g_i) / s) + N_Z(0, (sigma Delta)^2 I)) /
    (q N)`` on the lattice of step ``s`` and bound ``Delta``; without noise the float
    ``sum_(i in batch) clip(g_i) / (q N)``."""
    expected_batch = config.sample_rate * len(x)
    if not config.private:
        total = clipped_gradient_sum(
            model, params, x[batch], y[batch], config.clip_norm, config.max_physical_batch
        )
        return total / expected_batch
    source = as_source(rng)
    lattice = Lattice(config.clip_norm, model.num_params)
    total = lattice_gradient_sum(
        model, params, x[batch], y[batch], lattice, config.max_physical_batch, source
    )
    total = total + lattice.noise(config.noise_multiplier, total.shape, source)
    return total * lattice.step / expected_batch


def dpsgd_train(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    config: DPSGD,
    steps: int,
    rng: Rng | RandomSource = None,
) -> np.ndarray:
    """The parameters after ``steps`` DP-SGD steps over the records ``(x, y)`` from
    ``params`` (which is not modified): each step samples a Poisson batch
    (:func:`poisson_batch`) and moves by ``-eta`` times its :func:`noisy_gradient`.
    ``rng=None`` draws the batches and the noise from the operating system's CSPRNG."""
    if len(x) == 0:
        raise ValueError("DP-SGD needs at least one record to train on")
    if len(y) != len(x):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)} labels")
    if isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    source = as_source(rng)
    theta = np.array(params, dtype=np.float64, copy=True)
    for _ in range(steps):
        batch = poisson_batch(len(x), config.sample_rate, source)
        theta -= config.learning_rate * noisy_gradient(model, theta, x, y, batch, config, source)
    return theta


def dpsgd_update(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    config: DPSGD,
    steps: int,
    rng: Rng | RandomSource = None,
) -> np.ndarray:
    """A silo's federated update: its parameters after ``steps`` DP-SGD steps from the
    global ``params``, minus ``params``. Record-level private as the steps are (the
    difference is post-processing)."""
    return dpsgd_train(model, params, x, y, config, steps, rng) - params
