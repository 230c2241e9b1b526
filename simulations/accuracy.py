"""Accuracy of the mechanisms against theory: frequency and mean estimation, two paths.

A run is a grid of *cells* (mechanism x epsilon x domain size x n x shape for
frequencies; mechanism x epsilon x n x shape for means), each repeated ``reps`` times.
Each repetition builds the cell's sufficient statistics by one of two paths:

* ``exact``: every user's value goes through the mechanism's own ``encode`` and the
  reports through ``aggregate``, in chunks of users (memory bounded whatever n is);
  a repetition of more than ``SHARD_USERS`` users is split into shards, separate work
  units whose statistics merge by addition (so a cluster shares one repetition).
* ``fast``: the statistics are drawn directly from their law given the population
  (``simulate_statistics``: binomial and multinomial sums), in time independent of n.

Then the estimate is compared with the truth. Frequencies: the MSE over the d
categories, the largest error, the share of categories whose 95% interval covers the
truth, the recall of the top-k categories (k = min(10, d)), and the analytical MSE
``mean_v Var[f_v]`` with ``Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) /
(n (p - q))`` at the true f (Wang et al., USENIX Security 2017). Means: the squared
error, whether the interval covers, and the analytical variance
``(1 / n^2) sum_i Var[y | x_i]``.

Every work unit gets its own seed, spawned in a fixed order from the run's seed, so the
results are the same however many workers run them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from shared.mechanisms import (
    CategoricalValues,
    Mechanism,
    NumericValues,
    as_categorical,
    as_numeric,
    make_mechanism,
)
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics, MomentStatistics
from simulations.execution import run_units
from simulations.populations import CategoricalShape, NumericShape

__all__ = [
    "FrequencyCell",
    "NumericCell",
    "Path",
    "run_frequency",
    "run_numeric",
    "summarize",
]

Path = Literal["exact", "fast"]
#: Users per exact-path work unit; larger repetitions are split into shards.
SHARD_USERS = 1 << 24
#: Bytes of reports one exact-path chunk may hold at once.
CHUNK_BYTES = 1 << 25
#: Categories in the top-k recall.
TOP_K = 10


@dataclass(frozen=True)
class FrequencyCell:
    mechanism: str
    epsilon: float
    d: int
    n: int
    shape: CategoricalShape

    def make(self) -> Mechanism[Any]:
        mech = make_mechanism(
            MechanismSpec.model_validate(
                {"mechanism": self.mechanism, "epsilon": self.epsilon, "domain_size": self.d}
            )
        )
        self.categories(mech)
        return mech

    def categories(self, mech: Mechanism[Any]) -> CategoricalValues:
        """``mech`` as a frequency oracle, or ValueError."""
        categories = as_categorical(mech)
        if categories is None:
            raise ValueError(f"{self.mechanism!r} is not a categorical mechanism")
        return categories

    def counts(self) -> np.ndarray:
        return self.shape.counts(self.d, self.n)


@dataclass(frozen=True)
class NumericCell:
    mechanism: str
    epsilon: float
    n: int
    shape: NumericShape
    lower: float
    upper: float

    def make(self) -> Mechanism[Any]:
        mech = make_mechanism(
            MechanismSpec.model_validate(
                {
                    "mechanism": self.mechanism,
                    "epsilon": self.epsilon,
                    "lower": self.lower,
                    "upper": self.upper,
                }
            )
        )
        self.numbers(mech)
        return mech

    def numbers(self, mech: Mechanism[Any]) -> NumericValues:
        """``mech`` as a mean estimator, or ValueError."""
        numbers = as_numeric(mech)
        if numbers is None:
            raise ValueError(f"{self.mechanism!r} is not a numeric mechanism")
        return numbers


Cell = FrequencyCell | NumericCell


@dataclass(frozen=True)
class Unit:
    """One shard of one repetition of one cell: users ``[start, stop)`` by one path."""

    cell: Cell
    rep: int
    path: Path
    start: int
    stop: int
    seed: np.random.SeedSequence


def _units(cells: Sequence[Cell], reps: int, path: Path, seed: int, shard_users: int) -> list[Unit]:
    plan: list[tuple[Cell, int, int, int]] = []
    for cell in cells:
        for rep in range(reps):
            if path == "fast":
                plan.append((cell, rep, 0, cell.n))
            else:
                for start in range(0, cell.n, shard_users):
                    plan.append((cell, rep, start, min(cell.n, start + shard_users)))
    seeds = np.random.SeedSequence(seed).spawn(len(plan))
    return [Unit(c, r, path, a, b, s) for (c, r, a, b), s in zip(plan, seeds, strict=True)]


def _user_values(boundaries: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The value index of users ``start..stop-1`` when users are sorted by value."""
    return np.searchsorted(boundaries, np.arange(start, stop), side="right")


def _chunks(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    for low in range(start, stop, size):
        yield low, min(stop, low + size)


def _report_bytes(mech: Mechanism[Any]) -> int:
    """About how many bytes one encoded report holds (unary encodings: d bits)."""
    categories = as_categorical(mech)
    if categories is not None and mech.name in ("sue", "oue"):
        return (categories.domain_size + 7) // 8
    return 24


def compute_statistics(unit: Unit) -> CountStatistics | MomentStatistics:
    """The sufficient statistics of one work unit (the function the workers run)."""
    rng = np.random.default_rng(unit.seed)
    cell = unit.cell
    mech = cell.make()
    if isinstance(cell, FrequencyCell):
        counts = cell.counts()
        if unit.path == "fast":
            return cell.categories(mech).simulate_statistics(counts, rng)
        boundaries = np.cumsum(counts)
        levels = None
    else:
        population = cell.shape.population(cell.lower, cell.upper, cell.n)
        if unit.path == "fast":
            return cell.numbers(mech).simulate_statistics(population.levels, population.counts, rng)
        boundaries = np.cumsum(population.counts)
        levels = population.levels
    chunk = max(4096, CHUNK_BYTES // _report_bytes(mech))
    stats: Any = mech.empty_statistics()
    for low, high in _chunks(unit.start, unit.stop, chunk):
        values = _user_values(boundaries, low, high)
        batch = values if levels is None else levels[values]
        stats = stats.merge(mech.aggregate(mech.encode(batch, rng)))
    return stats


@dataclass
class Outcome:
    """One repetition of one cell: the estimate's errors beside the theory."""

    cell: Cell
    rep: int
    path: Path
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def _frequency_metrics(cell: FrequencyCell, stats: CountStatistics) -> dict[str, float]:
    mech = cell.categories(cell.make())
    truth = cell.counts() / cell.n
    estimate = mech.estimate(stats)
    error = estimate.frequencies - truth
    p, q = mech.p, mech.q
    per_item = (q * (1 - q) / (p - q) ** 2 + truth * (1 - p - q) / (p - q)) / cell.n
    k = min(TOP_K, cell.d)
    top_true = set(np.argsort(-truth, kind="stable")[:k].tolist())
    top_est = set(np.argsort(-estimate.frequencies, kind="stable")[:k].tolist())
    return {
        "mse": float(np.mean(error**2)),
        "variance": float(np.mean(per_item)),
        "max_error": float(np.max(np.abs(error))),
        "coverage": float(np.mean(np.abs(error) <= 1.959964 * estimate.std)),
        "topk_recall": len(top_true & top_est) / k,
    }


def _numeric_metrics(cell: NumericCell, stats: MomentStatistics) -> dict[str, float]:
    mech = cell.numbers(cell.make())
    population = cell.shape.population(cell.lower, cell.upper, cell.n)
    estimate = mech.estimate(stats)
    error = estimate.mean - population.mean
    variance = float(population.counts @ mech.report_variance(population.levels)) / cell.n**2
    return {
        "mse": error**2,
        "variance": variance,
        "max_error": abs(error),
        "coverage": float(abs(error) <= 1.959964 * estimate.std),
        "mean": estimate.mean,
        "truth": population.mean,
    }


def _run(
    cells: Sequence[Cell],
    reps: int,
    path: Path,
    seed: int,
    workers: int,
    scheduler: str | None,
    progress: bool,
    shard_users: int,
) -> list[Outcome]:
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if shard_users < 1:
        raise ValueError(f"shard_users must be >= 1, got {shard_users}")
    units = _units(cells, reps, path, seed, shard_users)
    statistics = run_units(
        _timed_statistics,
        units,
        workers=workers,
        scheduler=scheduler,
        progress=progress,
        description=f"{path} path",
    )
    merged: dict[tuple[int, int], tuple[Any, float]] = {}
    index = {id(cell): i for i, cell in enumerate(cells)}
    for unit, (stats, seconds) in zip(units, statistics, strict=True):
        key = (index[id(unit.cell)], unit.rep)
        if key in merged:
            previous, spent = merged[key]
            merged[key] = (previous.merge(stats), spent + seconds)
        else:
            merged[key] = (stats, seconds)
    outcomes = []
    for (cell_index, rep), (stats, seconds) in sorted(merged.items()):
        cell = cells[cell_index]
        metrics = (
            _frequency_metrics(cell, stats)
            if isinstance(cell, FrequencyCell)
            else _numeric_metrics(cell, stats)
        )
        outcomes.append(Outcome(cell, rep, path, seconds, metrics))
    return outcomes


def _timed_statistics(unit: Unit) -> tuple[CountStatistics | MomentStatistics, float]:
    started = time.perf_counter()
    stats = compute_statistics(unit)
    return stats, time.perf_counter() - started


def run_frequency(
    cells: Sequence[FrequencyCell],
    reps: int,
    path: Path = "fast",
    seed: int = 0,
    *,
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
    shard_users: int = SHARD_USERS,
) -> list[Outcome]:
    """Every cell ``reps`` times by ``path``; one :class:`Outcome` per (cell, rep)."""
    return _run(cells, reps, path, seed, workers, scheduler, progress, shard_users)


def run_numeric(
    cells: Sequence[NumericCell],
    reps: int,
    path: Path = "fast",
    seed: int = 0,
    *,
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
    shard_users: int = SHARD_USERS,
) -> list[Outcome]:
    """Every numeric cell ``reps`` times by ``path``; one :class:`Outcome` per (cell, rep)."""
    return _run(cells, reps, path, seed, workers, scheduler, progress, shard_users)


def summarize(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per cell: means over the repetitions, and the theory beside them.

    ``mse`` is the mean over repetitions (``mse_se`` its standard error), ``variance``
    the analytical MSE, ``ratio`` = mse / variance (1 when the theory holds),
    ``max_error`` the largest over repetitions, ``coverage`` and ``topk_recall`` means.

    Numeric cells also get ``ratio_se``, the ratio's standard error. Each repetition's
    error e_r of the mean is a sum over n users, near-normal N(0, V) with V the variance;
    it is measured against the known truth, so sum_r e_r^2 / V is chi-square with R
    degrees of freedom (not R - 1: no mean is estimated from the repetitions), whose
    variance is 2 R. Hence Var[ratio] = Var[(1 / R) sum_r e_r^2 / V] = 2 rho^2 / R for a
    true ratio rho, and ``ratio_se = ratio * sqrt(2 / R)``, rho estimated by the ratio.
    (For a sample variance about a mean estimated from the same R draws the relative
    standard error would be sqrt(2 / (R - 1)).)
    """
    groups: dict[int, list[Outcome]] = {}
    order: list[Cell] = []
    for outcome in outcomes:
        key = id(outcome.cell)
        if key not in groups:
            groups[key] = []
            order.append(outcome.cell)
        groups[key].append(outcome)
    rows = []
    for cell in order:
        group = groups[id(cell)]
        mses = np.array([o.metrics["mse"] for o in group])
        variance = float(np.mean([o.metrics["variance"] for o in group]))
        row: dict[str, Any] = {
            "mechanism": cell.mechanism,
            "resolved": cell.make().name,
            "epsilon": cell.epsilon,
            "d": cell.d if isinstance(cell, FrequencyCell) else "",
            "n": cell.n,
            "shape": cell.shape.text,
            "path": group[0].path,
            "reps": len(group),
            "mse": float(mses.mean()),
            "mse_se": float(mses.std(ddof=1) / math.sqrt(len(mses))) if len(mses) > 1 else math.nan,
            "variance": variance,
            "ratio": float(mses.mean() / variance) if variance > 0 else math.nan,
            "max_error": max(o.metrics["max_error"] for o in group),
            "coverage": float(np.mean([o.metrics["coverage"] for o in group])),
            "topk_recall": (
                float(np.mean([o.metrics["topk_recall"] for o in group]))
                if isinstance(cell, FrequencyCell)
                else math.nan
            ),
            "seconds": float(sum(o.seconds for o in group)),
        }
        if isinstance(cell, NumericCell):
            row["ratio_se"] = row["ratio"] * math.sqrt(2 / len(group))
        rows.append(row)
    return rows
