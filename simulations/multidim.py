"""Several private attributes per report (``spl``, ``smp``, ``rsfd``): per-attribute and
per-marginal errors against the variance the estimate states, two paths.

A run is a grid of *cells* (protocol x epsilon x n, over one population of attributes,
one oracle and one set of declared pairs), each repeated ``reps`` times (*runs*).

The population (``Population``): k attributes, each categorical over its own domain
(``domains[j]`` values) or numeric on [0, 1] (``None``), drawn jointly through an
equicorrelated **Gaussian copula**: Z = sqrt(rho) S + sqrt(1 - rho) E_j with S (a latent
shared by the attributes) and E_j standard normal and independent, so that
corr(Z_i, Z_j) = rho for i != j; U_j = Phi(Z_j) is uniform on [0, 1] and carries the
attribute through its marginal: a categorical one takes the value v with
C(v - 1) < U_j <= C(v), C the cumulative shares of the categorical ``shape`` (uniform or
Zipf: share of v proportional to (v + 1)^-S, most popular first); a numeric one is U_j
itself (uniform on [0, 1]). With rho = 0 the attributes are independent; as rho grows,
the pairs' joint distributions concentrate near their diagonals (equal quantiles).

The truth of a run is the users' own shares (what every estimate is unbiased for; under
``smp`` too, whose std includes the sampling of devices over views): per categorical
attribute its value counts / n, per numeric one the mean of its values, per declared pair
its joint counts / n. ``fast`` path: the users' rows drawn ``CHUNK_USERS`` at a time, each
chunk's statistics drawn from their law given the rows (the mechanism's
``simulate_statistics``), merged; ``exact`` path: each chunk through the mechanism's own
``encode`` and ``aggregate``. A run's users come from a stream of their own, seeded by
(seed, run, n): every protocol and epsilon of a run sees the same users (paired
comparisons); the noise has one seed per work unit.

Measures of one run, per *target* (an attribute, or a declared pair's joint cells), with
f^ the estimate, f the truth and s the std the estimate states (at the observed counts):

* ``mse`` = the mean over the target's cells and the runs of (f^ - f)^2;
* ``stated`` = the mean of s^2 over the same: what ``mse`` should be;
* ``ratio`` = mse / stated, 1 when the stated variance is right; ``ratio_low``,
  ``ratio_high`` its 95% interval over the runs, ratio -+ 1.96 sd_r(m_r / v) / sqrt(R)
  with m_r run r's mean squared error and v the mean stated variance (the runs are
  independent; the cells within a run are not); NaN with one run;
* ``mae`` = the mean of |f^ - f|;
* ``coverage`` = the share of (cell, run) with |f^ - f| <= z_0.975 s: 0.95 when the stated
  variance is right and the estimate near normal.

A numeric attribute is one cell (its mean). Every work unit (one run of one cell) is
independent, so runs go to a local or remote Dask cluster (``simulations.execution``);
results depend on the seed only.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from scipy import special

from shared.attributes import AttributesEstimate, CategoricalAttribute, PairMarginal
from shared.estimates import z_value
from shared.mechanisms import make_mechanism
from shared.mechanisms.abilities import AttributeValues, as_attributes
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics
from simulations import report
from simulations.execution import run_units
from simulations.populations import CategoricalShape

__all__ = [
    "COLUMNS",
    "ORACLES",
    "PROTOCOLS",
    "TABLE_COLUMNS",
    "MultidimCell",
    "MultidimRun",
    "Population",
    "Truth",
    "all_pairs",
    "measure",
    "parse_pairs",
    "plot_multidim",
    "simulate",
]

#: How a run's statistics are made: every user encoded, or drawn from their law.
SimulationPath = Literal["exact", "fast"]
#: The protocols (``auto``: the lowest summed planning variance, resolved by the mechanism
#: module's ``resolve_protocol``) and the frequency oracles of categorical views.
PROTOCOLS = ("spl", "smp", "rsfd", "auto")
ORACLES = ("grr", "oue", "auto")
#: The range of a numeric attribute.
NUMERIC_RANGE = (0.0, 1.0)
#: Confidence of the intervals whose coverage is measured.
CONFIDENCE = 0.95
#: Users drawn (and, on the exact path, encoded) at once.
CHUNK_USERS = 1 << 18
#: Streams of the run's seed: the users (truth), the noise.
TRUTH_STREAM, NOISE_STREAM = 1, 2

COLUMNS = (
    "protocol resolved oracle epsilon n path runs attributes domains correlation target kind "
    "method cells mse stated ratio ratio_low ratio_high mae coverage seconds"
).split()
TABLE_COLUMNS = (
    "protocol epsilon n runs target kind method cells mse stated ratio ratio_low ratio_high "
    "mae coverage seconds"
).split()


# --- the population ------------------------------------------------------------------------


@dataclass(frozen=True)
class Population:
    """k attributes (``domains[j]`` categories, or ``None`` for a number on [0, 1]) joined by
    an equicorrelated Gaussian copula with correlation ``correlation`` (module docstring);
    categorical marginals from ``shape``."""

    domains: tuple[int | None, ...]
    shape: CategoricalShape
    correlation: float

    def __post_init__(self) -> None:
        if len(self.domains) < 2:
            raise ValueError(f"a report needs at least 2 attributes, got {len(self.domains)}")
        for index, size in enumerate(self.domains):
            if size is not None and size < 2:
                raise ValueError(f"attribute {index} has {size} categories; it needs at least 2")
        if not 0.0 <= self.correlation < 1.0:
            raise ValueError(f"the correlation must lie in [0, 1), got {self.correlation!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """``a0``, ``a1``, ...: the attributes' names in the spec."""
        return tuple(f"a{index}" for index in range(len(self.domains)))

    @functools.cached_property
    def cumulative(self) -> tuple[np.ndarray | None, ...]:
        """Per categorical attribute the cumulative shares C(0), ..., C(d - 1) = 1."""
        shares: list[np.ndarray | None] = []
        for size in self.domains:
            if size is None:
                shares.append(None)
                continue
            weights = self.shape.shares(size)
            shares.append(np.cumsum(weights / weights.sum()))
        return tuple(shares)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` rows (float64, shape (n, k)): category indices and numbers, through the
        copula (module docstring)."""
        k = len(self.domains)
        shared = rng.standard_normal((n, 1))
        own = rng.standard_normal((n, k))
        uniform = special.ndtr(
            math.sqrt(self.correlation) * shared + math.sqrt(1 - self.correlation) * own
        )
        rows = np.empty((n, k), dtype=np.float64)
        for column, cumulative in enumerate(self.cumulative):
            if cumulative is None:
                low, high = NUMERIC_RANGE
                rows[:, column] = low + (high - low) * uniform[:, column]
            else:  # C(v - 1) < U <= C(v); the last share's rounding kept inside the domain
                index = np.searchsorted(cumulative, uniform[:, column], side="left")
                rows[:, column] = np.minimum(index, cumulative.size - 1)
        return rows

    def attributes_json(self) -> list[dict[str, Any]]:
        """The spec's ``attributes``."""
        low, high = NUMERIC_RANGE
        return [
            {"name": name, "domain_size": size}
            if size is not None
            else {"name": name, "lower": low, "upper": high}
            for name, size in zip(self.names, self.domains, strict=True)
        ]

    def describe(self) -> str:
        """``8,8,num`` style: the domains as typed."""
        return ",".join("num" if size is None else str(size) for size in self.domains)


def all_pairs(population: Population) -> tuple[tuple[int, int], ...]:
    """Every pair (i, j), i < j, of categorical attributes, in order."""
    categorical = [index for index, size in enumerate(population.domains) if size is not None]
    return tuple(
        (first, second)
        for position, first in enumerate(categorical)
        for second in categorical[position + 1 :]
    )


def parse_pairs(text: str, population: Population) -> tuple[tuple[int, int], ...]:
    """``none``, ``all`` (``all_pairs``) or a comma-separated list of ``I:J`` (attribute
    indices, or names ``aI:aJ``); ValueError naming the pair at fault."""
    if text == "none":
        return ()
    if text == "all":
        return all_pairs(population)
    names = population.names
    pairs: list[tuple[int, int]] = []
    for item in (part.strip() for part in text.split(",")):
        first, colon, second = item.partition(":")
        if not colon:
            raise ValueError(f"pair {item!r}: write it I:J (attribute indices), e.g. 0:1")
        try:
            indices = tuple(
                names.index(part) if part in names else int(part) for part in (first, second)
            )
        except ValueError:
            raise ValueError(f"pair {item!r}: attributes are 0..{len(names) - 1}") from None
        i, j = indices
        if not (0 <= i < len(names) and 0 <= j < len(names)):
            raise ValueError(f"pair {item!r}: attributes are 0..{len(names) - 1}")
        if i == j:
            raise ValueError(f"pair {item!r}: the two attributes must differ")
        if population.domains[i] is None or population.domains[j] is None:
            raise ValueError(f"pair {item!r}: both attributes must be categorical")
        if (i, j) in pairs or (j, i) in pairs:
            raise ValueError(f"pair {item!r} is declared twice")
        pairs.append((i, j))
    return tuple(pairs)


# --- the truth -----------------------------------------------------------------------------


@dataclass
class Truth:
    """The users' own shares, accumulated chunk by chunk: per attribute its value counts
    (categorical) or sum (numeric), per pair its joint counts (row-major, i * d2 + j)."""

    population: Population
    pairs: tuple[tuple[int, int], ...]
    n: int = 0

    def __post_init__(self) -> None:
        self.attributes: list[np.ndarray] = [
            np.zeros(size if size is not None else 1, dtype=np.float64)
            for size in self.population.domains
        ]
        self.joint: list[np.ndarray] = [
            np.zeros(self._size(i) * self._size(j), dtype=np.float64) for i, j in self.pairs
        ]

    def _size(self, column: int) -> int:
        size = self.population.domains[column]
        assert size is not None  # pairs are of categorical attributes
        return size

    def add(self, rows: np.ndarray) -> None:
        self.n += rows.shape[0]
        for column, size in enumerate(self.population.domains):
            if size is None:
                self.attributes[column] += rows[:, column].sum()
            else:
                self.attributes[column] += np.bincount(
                    rows[:, column].astype(np.int64), minlength=size
                )
        for index, (i, j) in enumerate(self.pairs):
            cells = rows[:, i].astype(np.int64) * self._size(j) + rows[:, j].astype(np.int64)
            self.joint[index] += np.bincount(cells, minlength=self.joint[index].size)

    def attribute(self, column: int) -> np.ndarray:
        """Shares (categorical) or the 1-vector of the mean (numeric)."""
        return self.attributes[column] / self.n

    def pair(self, index: int) -> np.ndarray:
        """The pair's joint shares, row-major."""
        return self.joint[index] / self.n


# --- cells ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _mechanism(spec_json: str) -> AttributeValues:
    """The multi-attribute mechanism of a canonical spec (JSON), built once per process."""
    mechanism = make_mechanism(MechanismSpec.model_validate(json.loads(spec_json)))
    attributes = as_attributes(mechanism)
    if attributes is None:
        raise ValueError(f"{mechanism.spec.mechanism!r} does not estimate attributes")
    return attributes


def resolved(mechanism_json: dict[str, Any]) -> dict[str, Any]:
    """The spec with ``auto`` resolved to a protocol (``resolve_protocol``: the lowest
    summed planning variance); any other protocol as it is."""
    if mechanism_json["mechanism"] != "auto":
        return mechanism_json
    from shared.mechanisms.multidim import resolve_protocol

    return resolve_protocol(mechanism_json)


@dataclass(frozen=True)
class MultidimCell:
    """One protocol at one epsilon and n, over ``population``, with ``oracle`` and the
    declared ``pairs`` (attribute indices)."""

    protocol: str
    epsilon: float
    n: int
    population: Population
    pairs: tuple[tuple[int, int], ...]
    oracle: str

    def mechanism_json(self) -> dict[str, Any]:
        """The metric's spec as JSON, ``auto`` resolved."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"unknown protocol {self.protocol!r}; choose from {', '.join(PROTOCOLS)}"
            )
        names = self.population.names
        spec: dict[str, Any] = {
            "mechanism": self.protocol,
            "epsilon": self.epsilon,
            "attributes": self.population.attributes_json(),
            "oracle": self.oracle,
        }
        if self.pairs:
            spec["pairs"] = [[names[i], names[j]] for i, j in self.pairs]
        return resolved(spec)

    @property
    def resolved(self) -> str:
        """The protocol that runs (``auto``'s choice)."""
        return str(self.mechanism_json()["mechanism"])

    @property
    def label(self) -> str:
        """``smp``, or ``auto (smp)``."""
        return self.protocol if self.protocol != "auto" else f"auto ({self.resolved})"

    def make(self) -> AttributeValues:
        """The mechanism (``pydantic.ValidationError`` or ValueError names what is wrong)."""
        return _mechanism(json.dumps(self.mechanism_json(), sort_keys=True))

    def targets(self) -> list[tuple[str, str]]:
        """(name, kind) of every target: the attributes, then the pairs ``a0:a1``."""
        names = self.population.names
        kinds = ["categorical" if size else "numeric" for size in self.population.domains]
        return list(zip(names, kinds, strict=True)) + [
            (f"{names[i]}:{names[j]}", "marginal") for i, j in self.pairs
        ]


# --- the measures --------------------------------------------------------------------------


def _cell_measures(
    estimate: np.ndarray, std: np.ndarray, truth: np.ndarray, z: float
) -> dict[str, float]:
    """Sums over a target's cells: squared errors, stated variances, absolute errors,
    covered cells; and the cell count."""
    error = np.asarray(estimate, dtype=np.float64).ravel() - truth
    spread = np.asarray(std, dtype=np.float64).ravel()
    return {
        "squared": float(np.sum(error**2)),
        "variance": float(np.sum(spread**2)),
        "absolute": float(np.sum(np.abs(error))),
        "covered": float(np.sum(np.abs(error) <= z * spread)),
        "cells": float(error.size),
    }


def measure(
    estimate: AttributesEstimate, truth: Truth, confidence: float = CONFIDENCE
) -> list[dict[str, Any]]:
    """One run's sums per target (``_cell_measures``), attributes then pairs, each with its
    one-way ``method`` (``direct``, ``consistent``; ``-`` for numbers and pairs)."""
    z = z_value(confidence)
    measured = []
    for column, attribute in enumerate(estimate.attributes):
        if isinstance(attribute, CategoricalAttribute):
            sums = _cell_measures(attribute.frequencies, attribute.std, truth.attribute(column), z)
            method: str = attribute.method
        else:
            sums = _cell_measures(
                np.array([attribute.mean]), np.array([attribute.std]), truth.attribute(column), z
            )
            method = "-"
        measured.append({"target": attribute.name, "method": method, **sums})
    for index, marginal in enumerate(estimate.marginals):
        pair: PairMarginal = marginal
        sums = _cell_measures(pair.frequencies, pair.std, truth.pair(index), z)
        measured.append({"target": ":".join(pair.attributes), "method": "-", **sums})
    return measured


# --- work units ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """Run ``run`` of one cell by one path; ``seed`` is the run's seed (the users), ``noise``
    the unit's own."""

    cell: MultidimCell
    run: int
    path: SimulationPath
    seed: int
    noise: np.random.SeedSequence


def run_unit(unit: Unit) -> dict[str, Any]:
    """Draw the users chunk by chunk, their statistics, estimate and measure: one run."""
    cell = unit.cell
    mechanism = cell.make()
    base: Any = mechanism
    users = np.random.default_rng([unit.seed, TRUTH_STREAM, unit.run, cell.n])
    noise = np.random.default_rng(unit.noise)
    truth = Truth(cell.population, cell.pairs)
    stats: CountStatistics = base.empty_statistics()
    started = time.perf_counter()
    for start in range(0, cell.n, CHUNK_USERS):
        rows = cell.population.sample(min(CHUNK_USERS, cell.n - start), users)
        truth.add(rows)
        if unit.path == "fast":
            part = mechanism.simulate_statistics(rows, noise)
        else:
            part = base.aggregate(base.encode(rows, noise))
        stats = stats.merge(part)
    estimate = mechanism.estimate(stats)
    seconds = time.perf_counter() - started
    return {"targets": measure(estimate, truth), "seconds": seconds}


# --- the run -------------------------------------------------------------------------------


@dataclass
class MultidimRun:
    """What ``simulate`` measured: one row per (cell, target) (``COLUMNS``), and every run's
    sums."""

    rows: list[dict[str, Any]]
    runs: list[dict[str, Any]]


def simulate(
    cells: Sequence[MultidimCell],
    reps: int,
    path: SimulationPath = "fast",
    seed: int = 0,
    *,
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
) -> MultidimRun:
    """Every cell ``reps`` times by ``path`` where the options say (``run_units``), measured
    and summarized (module docstring)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if path not in ("exact", "fast"):
        raise ValueError(f"path must be 'exact' or 'fast', got {path!r}")
    plan = [(cell, run) for cell in cells for run in range(reps)]
    noises = np.random.SeedSequence([seed, NOISE_STREAM]).spawn(len(plan))
    units = [
        Unit(cell, run, path, seed, noise) for (cell, run), noise in zip(plan, noises, strict=True)
    ]
    measured = run_units(
        run_unit, units, workers=workers, scheduler=scheduler, progress=progress,
        description=f"{path} path",
    )  # fmt: skip
    rows, runs = [], []
    for index, cell in enumerate(cells):
        mine = measured[index * reps : (index + 1) * reps]
        rows += summarize(cell, mine, path)
        runs += [
            {"cell": index, "run": run, "seconds": result["seconds"], **target}
            for run, result in enumerate(mine)
            for target in result["targets"]
        ]
    return MultidimRun(rows, runs)


def ratio_interval(squared: np.ndarray, variances: np.ndarray) -> tuple[float, float, float]:
    """(mean squared error / mean stated variance, and its 95% interval over the independent
    runs: ratio -+ 1.96 sd_r(m_r / v) / sqrt(R)); NaN ends with one run."""
    variance = float(variances.mean())
    if not variance > 0:
        return math.nan, math.nan, math.nan
    ratio = float(squared.mean()) / variance
    if squared.size < 2:
        return ratio, math.nan, math.nan
    half = z_value(CONFIDENCE) * float(np.std(squared / variance, ddof=1)) / math.sqrt(squared.size)
    return ratio, ratio - half, ratio + half


def summarize(
    cell: MultidimCell, measured: Sequence[dict[str, Any]], path: str
) -> list[dict[str, Any]]:
    """One row per target (``COLUMNS``): means over the runs' cells, the ratio with its
    interval, the cell's total seconds."""
    seconds = float(sum(result["seconds"] for result in measured))
    rows = []
    for position, (target, kind) in enumerate(cell.targets()):
        sums = [result["targets"][position] for result in measured]
        assert all(item["target"] == target for item in sums), (target, sums[0]["target"])
        cells = sums[0]["cells"]

        def per_cell(
            name: str, sums: list[dict[str, Any]] = sums, cells: float = cells
        ) -> np.ndarray:
            return np.array([item[name] for item in sums], dtype=np.float64) / cells

        squared, variances = per_cell("squared"), per_cell("variance")
        ratio, low, high = ratio_interval(squared, variances)
        rows.append(
            {
                "protocol": cell.label,
                "resolved": cell.resolved,
                "oracle": cell.oracle,
                "epsilon": cell.epsilon,
                "n": cell.n,
                "path": path,
                "runs": len(measured),
                "attributes": len(cell.population.domains),
                "domains": cell.population.describe(),
                "correlation": cell.population.correlation,
                "target": target,
                "kind": kind,
                "method": sums[0]["method"],
                "cells": int(cells),
                "mse": float(squared.mean()),
                "stated": float(variances.mean()),
                "ratio": ratio,
                "ratio_low": low,
                "ratio_high": high,
                "mae": float(per_cell("absolute").mean()),
                "coverage": float(per_cell("covered").mean()),
                "seconds": seconds,
            }  # fmt: skip
        )
    return rows


# --- plot ----------------------------------------------------------------------------------


#: The figure's panels: (kind of target, y label).
PANELS = (
    ("categorical", "attributes: MSE per value"),
    ("marginal", "declared pairs: MSE per joint cell"),
    ("numeric", "numeric attributes: MSE of the mean"),
)


def _pooled(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(MSE, stated variance) per cell over ``rows`` (targets of one kind), weighted by
    their cells."""
    cells = sum(row["cells"] for row in rows)
    return (
        sum(row["mse"] * row["cells"] for row in rows) / cells,
        sum(row["stated"] * row["cells"] for row in rows) / cells,
    )


def multidim_figure(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """MSE per cell against epsilon (log scale), one line per protocol, the stated variance
    black and dashed; one panel per kind of target present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(kind, label) for kind, label in PANELS if any(r["kind"] == kind for r in rows)]
    figure, axes = plt.subplots(
        1, len(panels), figsize=(4.6 * len(panels) + 0.6, 4.4), squeeze=False
    )
    protocols = list(dict.fromkeys(row["protocol"] for row in rows))
    for column, (kind, label) in enumerate(panels):
        axis = axes[0][column]
        for index, protocol in enumerate(protocols):
            mine = [r for r in rows if r["protocol"] == protocol and r["kind"] == kind]
            epsilons = sorted({r["epsilon"] for r in mine})
            points = [_pooled([r for r in mine if r["epsilon"] == e]) for e in epsilons]
            axis.plot(
                epsilons, [p[0] for p in points], label=protocol, **report.series_style(index)
            )
            theory = report.theory_style(index == len(protocols) - 1)
            axis.plot(epsilons, [p[1] for p in points], **theory)
        axis.set_xlabel("epsilon")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title)
    return figure


def plot_multidim(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per n, ``multidim_n-N.png`` (``multidim_figure``); the paths written."""
    written = []
    for n in dict.fromkeys(row["n"] for row in rows):
        mine = [row for row in rows if row["n"] == n]
        first = mine[0]
        title = (
            f"n = {n:,}, domains {first['domains']}, correlation {first['correlation']:g}, "
            f"oracle {first['oracle']}"
        )
        path = out_dir / f"multidim_n-{n}.png"
        report.save_figure(multidim_figure(mine, title), path)
        written.append(path)
    return written
