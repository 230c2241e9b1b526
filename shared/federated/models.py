"""Models for federated learning: numpy classifiers behind one small interface.

A federated model is a *flat parameter vector* and three functions of it. Everything
else (local training, clipping, noise, averaging, accounting) works on flat vectors,
so any model that implements :class:`Model` trains here unchanged:

* ``num_params``: the length of the flat vector;
* ``init_params(rng)``: a starting vector (the server draws it once per task);
* ``loss_and_grad(params, x, y)``: the mean loss over the batch and its gradient,
  a vector of length ``num_params``;
* ``predict(params, x)``: class indices, for evaluation.

To wrap a model of your own, write a class with these four members (flatten your
weights with ``np.concatenate([w.ravel() for w in weights])`` and split them back
with ``np.split`` on the cumulative sizes) and pass it wherever a ``Model`` is
expected. :class:`ModelSpec` names the built-in ones so that a task can say which
model it trains over the wire.

Built in:

* :class:`LogisticRegression`, multinomial logistic regression with weights
  ``W`` (features x classes) and bias ``b``: ``p = softmax(x W + b)``, loss
  ``-(1/n) sum_i log p_i[y_i] + (l2/2) ||W||^2``, gradient
  ``dW = x^T (p - Y) / n + l2 W``, ``db = sum_i (p_i - Y_i) / n`` with ``Y``
  the one-hot labels (e.g. Bishop, *Pattern Recognition and Machine Learning*,
  section 4.3.4).
* :class:`MLP`, one hidden layer of ``tanh`` units: ``h = tanh(x W1 + b1)``,
  ``p = softmax(h W2 + b2)``, the same cross-entropy loss, gradients by back
  propagation: ``G2 = (p - Y) / n``, ``dW2 = h^T G2``, ``G1 = (G2 W2^T)(1 - h^2)``,
  ``dW1 = x^T G1``. Weights start Glorot-uniform (Glorot and Bengio 2010).

Both are vectorized over the batch; no Python loop runs over examples. Both also give
every example's own gradient in one pass (:class:`PerExampleModel`, what DP-SGD clips):
with ``a`` a dense layer's input and ``g`` the gradient of each example's loss with
respect to the layer's output, example ``i``'s weight gradient is the outer product
``a_i^T g_i`` (plus ``l2 W``) and its bias gradient ``g_i``; the batch gradient is their
mean, computed as the matrix product ``a^T g / n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "MLP",
    "LocalTraining",
    "LogisticRegression",
    "Model",
    "ModelSpec",
    "PerExampleModel",
    "accuracy",
    "evaluate",
    "local_train",
    "make_model",
]


@runtime_checkable
class Model(Protocol):
    """What federated training needs from a model: a flat parameter vector and its loss."""

    @property
    def num_params(self) -> int:
        """The length of the flat parameter vector."""
        ...

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """A starting parameter vector of length ``num_params``."""
        ...

    def loss_and_grad(
        self, params: np.ndarray, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """Mean loss over the batch ``(x, y)`` and its gradient with respect to ``params``."""
        ...

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Predicted class index for every row of ``x``."""
        ...


def _softmax_cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each example's cross-entropy ``-log softmax(logits_i)[y_i]`` and its gradient with
    respect to the logits, the residual ``p_i - Y_i`` (one row per example, unscaled)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(logits.shape[0])
    residual = np.exp(log_p)
    residual[rows, y] -= 1.0
    return -log_p[rows, y], residual


@dataclass(frozen=True)
class _Backprop:
    """One forward and backward pass of a stack of dense layers ``z = a W + b``.

    ``losses`` holds each example's cross-entropy; ``layers`` holds, in the order of the
    flat parameter vector, each layer's input ``a`` (n x fan_in), the gradient ``g`` of
    each example's loss with respect to the layer's output (n x fan_out) and its weights
    ``W``. For example ``i`` the layer's gradients are ``dW_i = a_i^T g_i`` and
    ``db_i = g_i``; the batch's are their means.
    """

    losses: np.ndarray
    layers: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]

    def loss_and_grad(self, l2: float) -> tuple[float, np.ndarray]:
        """``mean_i loss_i + (l2/2) sum ||W||^2`` and its gradient (matrix products)."""
        n = self.losses.shape[0]
        penalty = sum(float(np.sum(w * w)) for _, _, w in self.layers)
        parts: list[np.ndarray] = []
        for a, g, w in self.layers:
            parts += [(a.T @ g / n + l2 * w).ravel(), g.sum(axis=0) / n]
        return float(self.losses.mean()) + 0.5 * l2 * penalty, np.concatenate(parts)

    def per_example_grads(self, l2: float) -> np.ndarray:
        """Row ``i``: the gradient of ``loss_i + (l2/2) sum ||W||^2`` (outer products)."""
        n = self.losses.shape[0]
        parts: list[np.ndarray] = []
        for a, g, w in self.layers:
            outer = np.einsum("ni,nj->nij", a, g).reshape(n, -1)
            parts += [outer + l2 * w.ravel() if l2 else outer, g]
        return np.concatenate(parts, axis=1)


@runtime_checkable
class PerExampleModel(Model, Protocol):
    """A :class:`Model` that also gives every example's gradient in one vectorized pass."""

    def per_example_grads(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``(n, num_params)``: row ``i`` equals ``loss_and_grad(params, x[i:i+1],
        y[i:i+1])[1]``, the gradient of example ``i``'s own loss."""
        ...


def _check_batch(x: np.ndarray, y: np.ndarray, num_features: int, num_classes: int) -> None:
    if x.ndim != 2 or x.shape[1] != num_features:
        raise ValueError(f"x must have shape (n, {num_features}), got {x.shape}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape ({x.shape[0]},), got {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("the batch is empty: a loss needs at least one example")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")


def _check_params(params: np.ndarray, num_params: int) -> None:
    if params.shape != (num_params,):
        raise ValueError(f"params must be a flat vector of length {num_params}, got {params.shape}")


@dataclass(frozen=True)
class LogisticRegression:
    """Multinomial logistic regression (softmax regression) with an L2 penalty on ``W``."""

    num_features: int
    num_classes: int
    l2: float = 0.0

    def __post_init__(self) -> None:
        _check_dims(self.num_features, self.num_classes)
        if not (math.isfinite(self.l2) and self.l2 >= 0):
            raise ValueError(f"l2 must be a finite number >= 0, got {self.l2!r}")

    @property
    def num_params(self) -> int:
        return (self.num_features + 1) * self.num_classes

    def _split(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _check_params(params, self.num_params)
        cut = self.num_features * self.num_classes
        return params[:cut].reshape(self.num_features, self.num_classes), params[cut:]

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """Zeros: the loss is convex, so no symmetry needs breaking."""
        return np.zeros(self.num_params)

    def _backprop(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> _Backprop:
        _check_batch(x, y, self.num_features, self.num_classes)
        w, b = self._split(params)
        losses, residual = _softmax_cross_entropy(x @ w + b, y)
        return _Backprop(losses, ((x, residual, w),))

    def loss_and_grad(
        self, params: np.ndarray, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray]:
        return self._backprop(params, x, y).loss_and_grad(self.l2)

    def per_example_grads(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``(n, num_params)``: row ``i`` is ``x_i^T (p_i - Y_i) + l2 W`` then ``p_i - Y_i``."""
        return self._backprop(params, x, y).per_example_grads(self.l2)

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        w, b = self._split(params)
        return np.argmax(x @ w + b, axis=1)


@dataclass(frozen=True)
class MLP:
    """One hidden layer of ``tanh`` units and a softmax output, L2 penalty on the weights."""

    num_features: int
    num_classes: int
    hidden: int = 32
    l2: float = 0.0

    def __post_init__(self) -> None:
        _check_dims(self.num_features, self.num_classes)
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden!r}")
        if not (math.isfinite(self.l2) and self.l2 >= 0):
            raise ValueError(f"l2 must be a finite number >= 0, got {self.l2!r}")

    @property
    def num_params(self) -> int:
        f, h, k = self.num_features, self.hidden, self.num_classes
        return f * h + h + h * k + k

    def _split(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        _check_params(params, self.num_params)
        f, h, k = self.num_features, self.hidden, self.num_classes
        w1, b1, w2, b2 = np.split(params, np.cumsum([f * h, h, h * k]))
        return w1.reshape(f, h), b1, w2.reshape(h, k), b2

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """Glorot-uniform weights, ``U(-a, a)`` with ``a = sqrt(6 / (fan_in + fan_out))``."""
        f, h, k = self.num_features, self.hidden, self.num_classes
        a1, a2 = math.sqrt(6.0 / (f + h)), math.sqrt(6.0 / (h + k))
        return np.concatenate(
            [rng.uniform(-a1, a1, f * h), np.zeros(h), rng.uniform(-a2, a2, h * k), np.zeros(k)]
        )

    def _backprop(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> _Backprop:
        _check_batch(x, y, self.num_features, self.num_classes)
        w1, b1, w2, b2 = self._split(params)
        hidden = np.tanh(x @ w1 + b1)
        losses, g2 = _softmax_cross_entropy(hidden @ w2 + b2, y)
        g1 = (g2 @ w2.T) * (1.0 - hidden * hidden)
        return _Backprop(losses, ((x, g1, w1), (hidden, g2, w2)))

    def loss_and_grad(
        self, params: np.ndarray, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray]:
        return self._backprop(params, x, y).loss_and_grad(self.l2)

    def per_example_grads(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``(n, num_params)``: row ``i`` is example ``i``'s ``dW1, db1, dW2, db2``."""
        return self._backprop(params, x, y).per_example_grads(self.l2)

    def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2 = self._split(params)
        return np.argmax(np.tanh(x @ w1 + b1) @ w2 + b2, axis=1)


def _check_dims(num_features: int, num_classes: int) -> None:
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features!r}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes!r}")


#: Largest model a task may train: half a million parameters (4 MB as float64, 5.3 MB in
#: base64: an upload stays under the service's default 8 MiB body limit).
MAX_MODEL_PARAMETERS = 500_000


class ModelSpec(BaseModel):
    """A built-in model by name, as a federated task states it on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["logistic", "mlp"]
    num_features: int = Field(ge=1, le=MAX_MODEL_PARAMETERS)
    num_classes: int = Field(ge=2, le=MAX_MODEL_PARAMETERS)
    hidden: int = Field(default=32, ge=1, le=MAX_MODEL_PARAMETERS, description="mlp only")
    l2: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _not_too_large(self) -> ModelSpec:
        size = make_model(self).num_params
        if size > MAX_MODEL_PARAMETERS:
            raise ValueError(
                f"the model has {size} parameters; a task may train at most {MAX_MODEL_PARAMETERS}"
            )
        return self


def make_model(spec: ModelSpec) -> LogisticRegression | MLP:
    """The model a :class:`ModelSpec` names."""
    if spec.kind == "logistic":
        return LogisticRegression(spec.num_features, spec.num_classes, spec.l2)
    return MLP(spec.num_features, spec.num_classes, spec.hidden, spec.l2)


@dataclass(frozen=True)
class LocalTraining:
    """Minibatch SGD on the device: ``epochs`` passes over its data in shuffled batches."""

    epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"learning_rate must be a finite number > 0, got {self.learning_rate!r}"
            )


def local_train(
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    training: LocalTraining,
    rng: np.random.Generator,
) -> np.ndarray:
    """Parameters after ``training.epochs`` epochs of minibatch SGD from ``params``.

    Each epoch visits the examples in a fresh random order, in batches of
    ``batch_size`` (the last may be smaller): ``theta <- theta - lr * grad L_B(theta)``.
    The input vector is not modified.
    """
    if len(x) == 0:
        raise ValueError("a client needs at least one example to train")
    theta = np.array(params, dtype=np.float64, copy=True)
    n = len(x)
    for _ in range(training.epochs):
        order = rng.permutation(n)
        for start in range(0, n, training.batch_size):
            batch = order[start : start + training.batch_size]
            _, grad = model.loss_and_grad(theta, x[batch], y[batch])
            theta -= training.learning_rate * grad
    return theta


def accuracy(model: Model, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of rows of ``x`` whose predicted class is ``y``."""
    return float(np.mean(model.predict(params, x) == y))


def evaluate(model: Model, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy and mean loss of ``params`` on ``(x, y)``."""
    loss, _ = model.loss_and_grad(params, x, y)
    return {"accuracy": accuracy(model, params, x, y), "loss": float(loss)}
