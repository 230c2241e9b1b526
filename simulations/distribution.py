"""Distribution estimation (``hh``, ``sw``): range, quantile and Wasserstein errors, two paths.

A run is a grid of *cells* (mechanism x shape x n x epsilon, at one bucket count D,
branching and scale), each repeated ``reps`` times (*runs*).

Shapes (``SHAPES``), each a fixed law truncated to its own domain (the density
renormalized on [lower, upper], so that clipping moves no mass), cut into D buckets on its
own scale unless ``scale`` says otherwise (``shared.mechanisms.spec.DistributionSpec``):

* ``normal``: N(50, 15^2) on [0, 100], linear;
* ``bimodal``: 0.6 N(30, 8^2) + 0.4 N(75, 6^2) on [0, 100], linear;
* ``lognormal``: latencies in ms, ln X ~ N(ln 100, 1) (median 100 ms) on [1, 10000], log;
* ``pareto``: latencies in ms, P(X > x) = (10 / x)^1.5 for x >= 10 on [1, 10000], log
  (no mass below 10 ms, a heavy tail: the 99th percentile is 215 ms).

The truth of a run. ``fast`` path: the users' bucket counts are one multinomial draw,
Multinomial(n, pi) with pi_b = F(e_(b+1)) - F(e_b) the shape's bucket probabilities:
the law of the counts of n values drawn from the shape, in O(D) whatever n (drawing 10^8
values would take minutes). Then the statistics are drawn from their law given the
counts (the mechanism's ``simulate_statistics``, O(D h)). ``exact`` path: n values are
drawn from the shape (a component of the mixture by its truncated mass, then the
component's inverse CDF at a uniform point of its truncated range), in chunks of
``CHUNK_USERS``; each chunk is bucketed for the true counts and goes through the
mechanism's own ``encode`` and ``aggregate``. The truth draws of a run come from a stream
of their own, seeded by (seed, run): every mechanism and epsilon of a run sees the same
users (paired comparisons); the noise has one seed per work unit.

Measures of one run, against the users' own CDF F_k = (users below e_k) / n at the edges
(what the estimate is unbiased for), with F^ the estimate's CDF (``DistributionEstimate``):

* range queries: ``ranges`` pairs of edge indices 0 <= a < b <= D drawn uniformly among
  all such pairs (rejection sampling), and as many *wide* ones, uniform among the pairs
  with b - a > D / 10 (a tenth of the buckets: of the domain on a linear scale, of its
  logarithm on a log scale). The ranges of run r are the same for every cell (their own
  stream, seeded by (seed, run)). ``range_mse`` = mean over the ranges and runs of
  ((F^_b - F^_a) - (F_b - F_a))^2; ``range_variance`` = the mean of the mechanism's own
  Var[F^_b - F^_a] (``range_variance``, evaluated by the mechanism at its estimate) over the
  same ranges; ``range_ratio`` = range_mse / range_variance, 1 when the stated variance is
  right. ``range_ratio_se`` = sd_r(m_r / v) / sqrt(R), m_r run r's mean squared error, v
  the mean variance: the runs are independent, the ranges within a run are not. The same
  for ``wide_*``.
* quantiles at q = 0.5, 0.9, 0.95, 0.99 (``LEVELS``): ``qerr_Q`` = |Q^_q - Q_q| in value
  units, Q_q the shape's (population) quantile; ``rank_Q`` = |G(Q^_q) - q|, G the shape's
  CDF: the error in rank. Both averaged over runs.
* ``quantile_coverage``: the share of (run, level) whose 95% interval [ci_low, ci_high]
  holds the bucket of the users' q-quantile, the bucket b with F_b < q <= F_(b+1) (the
  intervals are whole buckets; at least 0.95 by construction, ``shared.distributions``).
* ``cdf_coverage``: the share of (run, inner edge k = 1..D-1) with |F^_k - F_k| <=
  z_0.975 sd(F^_k), sd from the mechanism (0.95 when the stated variance is right and the
  estimate near normal).
* ``w1``: the Wasserstein-1 distance, in value units, between the post-processed
  distribution (``postprocessed``: a valid distribution over the buckets) and the users'
  bucket shares, each spread uniformly within its buckets: the integral of |P(x) - F(x)|
  over [lower, upper], with P and F linear between the edges, so per bucket of width w and
  end differences d0, d1: w (|d0| + |d1|) / 2 when they have one sign, else
  w (d0^2 + d1^2) / (2 (|d0| + |d1|)) (the two triangles on either side of the crossing).

Every work unit (one run of one cell) is independent, so runs go to a local or remote
Dask cluster (``simulations.execution``); results depend on the seed only.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

from shared.distributions import DistributionEstimate
from shared.estimates import z_value
from shared.mechanisms import DistributionValues, Mechanism, as_distribution, make_mechanism
from shared.mechanisms.spec import DistributionSpec, Scale, as_distribution_spec, spec_models
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics
from simulations import report
from simulations.execution import run_units

__all__ = [
    "COLUMNS",
    "LEVELS",
    "SHAPES",
    "Component",
    "DistributionCell",
    "DistributionRun",
    "Shape",
    "distribution_mechanisms",
    "draw_ranges",
    "grid_wasserstein",
    "measure",
    "plot_distribution",
    "simulate",
]

#: How a run's statistics are made: every user encoded, or drawn from their law.
SimulationPath = Literal["exact", "fast"]
#: Quantile levels measured, and their column suffixes.
LEVELS = (0.5, 0.9, 0.95, 0.99)
SUFFIXES = ("50", "90", "95", "99")
#: Confidence of the quantile and CDF intervals checked.
CONFIDENCE = 0.95
#: A wide range covers more than this share of the buckets.
WIDE_SHARE = 0.1
#: Users drawn, encoded and aggregated at once on the exact path.
CHUNK_USERS = 1 << 18
#: Streams of the run's seed: the users (truth), the ranges, the noise.
TRUTH_STREAM, RANGE_STREAM, NOISE_STREAM = 1, 2, 3

COLUMNS = (
    "mechanism shape scale lower upper buckets branching epsilon n path runs ranges "
    "range_mse range_variance range_ratio range_ratio_se wide_mse wide_variance wide_ratio "
    "wide_ratio_se "
    + " ".join(f"qerr_{s}" for s in SUFFIXES)
    + " "
    + " ".join(f"rank_{s}" for s in SUFFIXES)
    + " w1 quantile_coverage cdf_coverage seconds"
).split()
TABLE_COLUMNS = (
    "mechanism shape epsilon n path runs range_mse range_ratio wide_ratio qerr_50 rank_50 "
    "rank_99 w1 quantile_coverage cdf_coverage seconds"
).split()


# --- shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    """One law of a mixture: ``normal`` (a = mean, b = sd), ``lognormal`` (ln X normal with
    mean a and sd b) or ``pareto`` (P(X > x) = (a / x)^b for x >= a)."""

    weight: float
    kind: Literal["normal", "lognormal", "pareto"]
    a: float
    b: float

    def cdf(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if self.kind == "normal":
            return np.asarray(special.ndtr((x - self.a) / self.b))
        if self.kind == "lognormal":
            logs = np.log(np.maximum(x, np.finfo(np.float64).tiny))
            return np.where(x > 0, special.ndtr((logs - self.a) / self.b), 0.0)
        return np.where(
            x >= self.a, -np.expm1(self.b * np.log(self.a / np.maximum(x, self.a))), 0.0
        )

    def ppf(self, u: np.ndarray) -> np.ndarray:
        """The inverse of ``cdf`` at u in [0, 1]."""
        u = np.asarray(u, dtype=np.float64)
        if self.kind == "normal":
            return self.a + self.b * np.asarray(special.ndtri(u))
        if self.kind == "lognormal":
            return np.exp(self.a + self.b * np.asarray(special.ndtri(u)))
        return self.a * np.exp(-np.log1p(-np.minimum(u, 1.0 - 1e-16)) / self.b)


@dataclass(frozen=True)
class Shape:
    """A mixture of ``components`` truncated to [lower, upper], bucketed on ``scale``."""

    name: str
    description: str
    lower: float
    upper: float
    scale: Scale
    components: tuple[Component, ...]

    @functools.cached_property
    def _masses(self) -> np.ndarray:
        """Each component's weight times its mass inside [lower, upper]."""
        ends = np.array([self.lower, self.upper])
        return np.array([c.weight * float(np.diff(c.cdf(ends))[0]) for c in self.components])

    def cdf(self, x: np.ndarray | float) -> np.ndarray:
        """G(x) = sum_i w_i (C_i(x) - C_i(lower)) / sum_i w_i (C_i(upper) - C_i(lower)),
        for x clipped to [lower, upper]."""
        clipped = np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)
        total = np.zeros_like(clipped)
        for component in self.components:
            below = component.cdf(np.array(self.lower))
            total = total + component.weight * (component.cdf(clipped) - below)
        return np.clip(total / self._masses.sum(), 0.0, 1.0)

    def bucket_probabilities(self, edges: np.ndarray) -> np.ndarray:
        """pi_b = G(e_(b+1)) - G(e_b), summing to 1."""
        shares = np.maximum(np.diff(self.cdf(edges)), 0.0)
        return shares / shares.sum()

    def quantile(self, levels: Sequence[float] | np.ndarray) -> np.ndarray:
        """G^-1(q) by bisection (64 halvings: to the last bit), on ln x for a log shape."""
        q = np.asarray(levels, dtype=np.float64)
        logs = self.scale == "log"
        low = np.full(q.shape, math.log(self.lower) if logs else self.lower)
        high = np.full(q.shape, math.log(self.upper) if logs else self.upper)
        for _ in range(64):
            middle = (low + high) / 2
            below = self.cdf(np.exp(middle) if logs else middle) < q
            low, high = np.where(below, middle, low), np.where(below, high, middle)
        middle = (low + high) / 2
        return np.exp(middle) if logs else middle

    @functools.cached_property
    def level_quantiles(self) -> np.ndarray:
        """G^-1 at ``LEVELS`` (computed once)."""
        return self.quantile(LEVELS)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` values of the truncated mixture: component i with probability proportional
        to its truncated mass, then C_i^-1(U) with U uniform on [C_i(lower), C_i(upper))."""
        counts = rng.multinomial(n, self._masses / self._masses.sum())
        parts = []
        for component, count in zip(self.components, counts, strict=True):
            ends = component.cdf(np.array([self.lower, self.upper]))
            parts.append(component.ppf(rng.uniform(ends[0], ends[1], int(count))))
        return np.clip(np.concatenate(parts), self.lower, self.upper)


SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        Shape(
            "normal", "N(50, 15^2) on [0, 100], linear", 0.0, 100.0, "linear",
            (Component(1.0, "normal", 50.0, 15.0),),
        ),
        Shape(
            "lognormal", "latency ms, ln X ~ N(ln 100, 1), on [1, 10000], log", 1.0, 10_000.0,
            "log", (Component(1.0, "lognormal", math.log(100.0), 1.0),),
        ),
        Shape(
            "bimodal", "0.6 N(30, 8^2) + 0.4 N(75, 6^2) on [0, 100], linear", 0.0, 100.0,
            "linear", (Component(0.6, "normal", 30.0, 8.0), Component(0.4, "normal", 75.0, 6.0)),
        ),
        Shape(
            "pareto", "latency ms, P(X > x) = (10 / x)^1.5 from 10, on [1, 10000], log", 1.0,
            10_000.0, "log", (Component(1.0, "pareto", 10.0, 1.5),),
        ),
    )
}  # fmt: skip


# --- cells ---------------------------------------------------------------------------------


def distribution_mechanisms() -> list[str]:
    """The registered mechanisms whose values are estimated as a distribution, one report
    per device (the memoized ones, lhh, are simulated per period by their own tests)."""
    return sorted(
        name
        for name, model in spec_models().items()
        if model.kind == "distribution" and not model.is_memoized
    )


@functools.lru_cache(maxsize=64)
def mechanism_for(spec: MechanismSpec) -> Mechanism[Any]:
    """``make_mechanism(spec)``, built once per process."""
    return make_mechanism(spec)


@dataclass(frozen=True)
class DistributionCell:
    """One mechanism on one shape at one n and epsilon; ``scale`` None: the shape's own;
    ``branching`` goes to the mechanisms that take it (``hh``)."""

    mechanism: str
    shape: str
    epsilon: float
    n: int
    buckets: int
    branching: int
    scale: Scale | None = None

    @property
    def law(self) -> Shape:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; choose from {', '.join(SHAPES)}")
        return SHAPES[self.shape]

    def spec(self) -> DistributionSpec:
        """The metric's spec; ``pydantic.ValidationError`` or ValueError names what is wrong."""
        law = self.law
        model = spec_models().get(self.mechanism)
        if model is None or model.kind != "distribution":
            raise ValueError(f"{self.mechanism!r} is not a distribution mechanism")
        fields: dict[str, Any] = {
            "mechanism": self.mechanism, "epsilon": self.epsilon, "lower": law.lower,
            "upper": law.upper, "buckets": self.buckets, "scale": self.scale or law.scale,
        }  # fmt: skip
        if "branching" in model.model_fields:
            fields["branching"] = self.branching
        spec = as_distribution_spec(MechanismSpec.model_validate(fields))
        assert spec is not None  # the model's kind, checked above
        return spec

    def make(self) -> DistributionValues:
        """The mechanism, as a distribution estimator."""
        distribution = as_distribution(mechanism_for(self.spec()))
        if distribution is None:
            raise ValueError(f"{self.mechanism!r} does not estimate a distribution")
        return distribution


# --- the measures --------------------------------------------------------------------------


def draw_ranges(
    rng: np.random.Generator, buckets: int, count: int, min_width: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` pairs of edge indices 0 <= a < b <= D, uniform among the pairs with
    b - a >= ``min_width`` (rejection sampling from two uniform edges)."""
    if not 1 <= min_width <= buckets:
        raise ValueError(f"min_width must be in 1..{buckets}, got {min_width}")
    low: list[np.ndarray] = []
    high: list[np.ndarray] = []
    found = 0
    while found < count:
        pairs = rng.integers(0, buckets + 1, size=(2 * count, 2))
        a, b = pairs.min(axis=1), pairs.max(axis=1)
        keep = b - a >= min_width
        low.append(a[keep])
        high.append(b[keep])
        found += int(keep.sum())
    return np.concatenate(low)[:count], np.concatenate(high)[:count]


def grid_wasserstein(edges: ArrayLike, first: ArrayLike, second: ArrayLike) -> float:
    """The integral of |P(x) - F(x)| over the edges' span, P and F the CDFs ``first`` and
    ``second`` at the edges, linear between them (module docstring)."""
    difference = np.asarray(first, dtype=np.float64) - np.asarray(second, dtype=np.float64)
    d0, d1 = difference[:-1], difference[1:]
    widths = np.diff(np.asarray(edges, dtype=np.float64))
    size = np.abs(d0) + np.abs(d1)
    crossing = np.divide(d0**2 + d1**2, 2 * size, out=np.zeros_like(size), where=size > 0)
    return float(np.sum(widths * np.where(d0 * d1 >= 0, size / 2, crossing)))


def _range_errors(
    estimate: DistributionEstimate, error: np.ndarray, ranges: tuple[np.ndarray, np.ndarray]
) -> tuple[float, float]:
    """(mean squared error, mean stated variance) of the ranges [a, b)."""
    low, high = ranges
    squared = (error[high] - error[low]) ** 2
    return float(squared.mean()), float(np.mean(estimate.range_variance(low, high)))


def measure(
    estimate: DistributionEstimate,
    counts: np.ndarray,
    shape: Shape,
    ranges: tuple[np.ndarray, np.ndarray],
    wide: tuple[np.ndarray, np.ndarray],
) -> dict[str, float]:
    """One run's measures (module docstring) of ``estimate`` against the users' bucket
    ``counts`` and their ``shape``."""
    n = int(counts.sum())
    truth = np.concatenate([[0.0], np.cumsum(counts)]) / n
    error = estimate.cdf - truth
    metrics: dict[str, float] = {}
    metrics["range_mse"], metrics["range_variance"] = _range_errors(estimate, error, ranges)
    metrics["wide_mse"], metrics["wide_variance"] = _range_errors(estimate, error, wide)
    quantiles = estimate.quantiles(LEVELS, CONFIDENCE)
    population = shape.level_quantiles
    covered = []
    for suffix, answer, level, true in zip(SUFFIXES, quantiles, LEVELS, population, strict=True):
        metrics[f"qerr_{suffix}"] = abs(answer.value - float(true))
        metrics[f"rank_{suffix}"] = abs(float(shape.cdf(answer.value)) - level)
        bucket = min(int(np.searchsorted(truth[1:], level, side="left")), estimate.buckets - 1)
        holds = (
            answer.ci_low <= estimate.edges[bucket] and answer.ci_high >= estimate.edges[bucket + 1]
        )
        covered.append(holds)
    metrics["quantile_coverage"] = float(np.mean(covered))
    inner = slice(1, estimate.buckets)
    half = z_value(CONFIDENCE) * estimate.cdf_std()[inner]
    metrics["cdf_coverage"] = float(np.mean(np.abs(error[inner]) <= half))
    metrics["w1"] = grid_wasserstein(estimate.edges, estimate.postprocessed_cdf(), truth)
    return metrics


# --- work units ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """Run ``run`` of one cell by one path; ``seed`` is the run's seed (truth and ranges),
    ``noise`` the unit's own."""

    cell: DistributionCell
    run: int
    path: SimulationPath
    ranges: int
    seed: int
    noise: np.random.SeedSequence


def exact_statistics(
    mechanism: DistributionValues,
    shape: Shape,
    n: int,
    truth: np.random.Generator,
    noise: np.random.Generator,
) -> tuple[np.ndarray, CountStatistics]:
    """(the users' bucket counts, the statistics of their reports): ``n`` values drawn from
    ``shape`` and encoded by the mechanism's own ``encode``, ``CHUNK_USERS`` at a time."""
    mech: Any = mechanism
    edges = mechanism.edges()
    counts = np.zeros(edges.size - 1, dtype=np.int64)
    stats = mech.empty_statistics()
    for start in range(0, n, CHUNK_USERS):
        values = shape.sample(min(CHUNK_USERS, n - start), truth)
        counts += np.bincount(mech.spec.bucket_of(values), minlength=counts.size)
        stats = stats.merge(mech.aggregate(mech.encode(values, noise)))
    return counts, stats


def run_unit(unit: Unit) -> dict[str, float]:
    """Draw the users, their statistics, estimate and measure: one run (what workers run)."""
    cell, shape = unit.cell, unit.cell.law
    mechanism = cell.make()
    truth = np.random.default_rng([unit.seed, TRUTH_STREAM, unit.run])
    noise = np.random.default_rng(unit.noise)
    started = time.perf_counter()
    if unit.path == "fast":
        counts = truth.multinomial(cell.n, shape.bucket_probabilities(mechanism.edges()))
        stats = mechanism.simulate_statistics(counts, noise)
    else:
        counts, stats = exact_statistics(mechanism, shape, cell.n, truth, noise)
    estimate = mechanism.estimate(stats)
    seconds = time.perf_counter() - started
    ranges_rng = np.random.default_rng([unit.seed, RANGE_STREAM, unit.run])
    buckets = estimate.buckets
    ranges = draw_ranges(ranges_rng, buckets, unit.ranges)
    wide = draw_ranges(ranges_rng, buckets, unit.ranges, math.floor(WIDE_SHARE * buckets) + 1)
    return {**measure(estimate, counts, shape, ranges, wide), "seconds": seconds}


# --- the run -------------------------------------------------------------------------------


@dataclass
class DistributionRun:
    """What ``simulate`` measured: one row per cell (``COLUMNS``), and every run's measures."""

    rows: list[dict[str, Any]]
    runs: list[dict[str, Any]]


def simulate(
    cells: Sequence[DistributionCell],
    reps: int,
    path: SimulationPath = "fast",
    seed: int = 0,
    *,
    ranges: int = 200,
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
) -> DistributionRun:
    """Every cell ``reps`` times by ``path`` where the options say (``run_units``), measured
    and summarized (module docstring)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if ranges < 1:
        raise ValueError(f"ranges must be >= 1, got {ranges}")
    if path not in ("exact", "fast"):
        raise ValueError(f"path must be 'exact' or 'fast', got {path!r}")
    plan = [(cell, run) for cell in cells for run in range(reps)]
    noises = np.random.SeedSequence([seed, NOISE_STREAM]).spawn(len(plan))
    units = [
        Unit(cell, run, path, ranges, seed, noise)
        for (cell, run), noise in zip(plan, noises, strict=True)
    ]
    measured = run_units(
        run_unit, units, workers=workers, scheduler=scheduler, progress=progress,
        description=f"{path} path",
    )  # fmt: skip
    rows, runs = [], []
    for index, cell in enumerate(cells):
        mine = measured[index * reps : (index + 1) * reps]
        rows.append(summarize(cell, mine, path, ranges))
        runs += [{"cell": index, "run": run, **metrics} for run, metrics in enumerate(mine)]
    return DistributionRun(rows, runs)


def _ratio(errors: np.ndarray, variances: np.ndarray) -> tuple[float, float]:
    """(mean error / mean variance, its standard error over the independent runs)."""
    variance = float(variances.mean())
    if not variance > 0:
        return math.nan, math.nan
    spread = float(np.std(errors / variance, ddof=1)) if errors.size > 1 else math.nan
    return float(errors.mean()) / variance, spread / math.sqrt(errors.size)


def summarize(
    cell: DistributionCell, measured: Sequence[dict[str, float]], path: str, ranges: int
) -> dict[str, Any]:
    """One row (``COLUMNS``): means over the runs, ratios of means, total seconds."""

    def column(name: str) -> np.ndarray:
        return np.array([metrics[name] for metrics in measured], dtype=np.float64)

    spec = cell.spec()
    row: dict[str, Any] = {
        "mechanism": cell.mechanism, "shape": cell.shape, "scale": spec.scale,
        "lower": spec.lower, "upper": spec.upper, "buckets": spec.buckets,
        "branching": getattr(spec, "branching", None) or "", "epsilon": cell.epsilon,
        "n": cell.n, "path": path, "runs": len(measured), "ranges": ranges,
    }  # fmt: skip
    for kind in ("range", "wide"):
        errors, variances = column(f"{kind}_mse"), column(f"{kind}_variance")
        ratio, ratio_se = _ratio(errors, variances)
        row |= {
            f"{kind}_mse": float(errors.mean()), f"{kind}_variance": float(variances.mean()),
            f"{kind}_ratio": ratio, f"{kind}_ratio_se": ratio_se,
        }  # fmt: skip
    for name in [f"{k}_{s}" for k in ("qerr", "rank") for s in SUFFIXES]:
        row[name] = float(column(name).mean())
    for name in ("w1", "quantile_coverage", "cdf_coverage"):
        row[name] = float(column(name).mean())
    row["seconds"] = float(column("seconds").sum())
    return {name: row[name] for name in COLUMNS}


# --- plot ----------------------------------------------------------------------------------


#: The figure's rows: (column, y label); the first also draws the stated variance.
PANELS = (
    ("range_mse", "range MSE\n(dashed: stated variance)"),
    ("rank", "quantile rank error |G(Q^) - q|\n(mean of q = 0.5, 0.9, 0.95, 0.99)"),
    ("w1", "Wasserstein-1\n(value units)"),
)


def shape_figure(rows: Sequence[dict[str, Any]], shape: str) -> Any:
    """For one shape: range MSE (with the stated variance, black dashed), the mean rank
    error over the quantile levels and W1, against n (log-log), one column per epsilon,
    one line per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [row for row in rows if row["shape"] == shape]
    epsilons = sorted({row["epsilon"] for row in mine})
    mechanisms = list(dict.fromkeys(row["mechanism"] for row in mine))
    figure, axes = plt.subplots(
        len(PANELS), len(epsilons), figsize=(3.4 * len(epsilons) + 0.6, 8.4), squeeze=False
    )
    for col, epsilon in enumerate(epsilons):
        for index, mechanism in enumerate(mechanisms):
            line = sorted(
                (r for r in mine if r["epsilon"] == epsilon and r["mechanism"] == mechanism),
                key=lambda r: r["n"],
            )
            users = [r["n"] for r in line]
            style = report.series_style(index)
            for row_index, (name, _) in enumerate(PANELS):
                axis = axes[row_index][col]
                if name == "rank":
                    values = [np.mean([r[f"rank_{s}"] for s in SUFFIXES]) for r in line]
                else:
                    values = [r[name] for r in line]
                axis.plot(users, values, label=mechanism, **style)
                if name == "range_mse":
                    theory = report.theory_style(index == len(mechanisms) - 1)
                    axis.plot(users, [r["range_variance"] for r in line], **theory)
        for row_index, (_, label) in enumerate(PANELS):
            axis = axes[row_index][col]
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.grid(True, which="both", alpha=0.3)
            axis.set_xlabel("users n")
            if col == 0:
                axis.set_ylabel(label, fontsize="small")
        axes[0][col].set_title(f"epsilon = {epsilon:g}")
    axes[0][0].legend(fontsize="small")
    figure.suptitle(f"{shape}: {SHAPES[shape].description}")
    return figure


def plot_distribution(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per shape, ``distribution_SHAPE.png`` (``shape_figure``); the paths written."""
    written = []
    for shape in dict.fromkeys(row["shape"] for row in rows):
        path = out_dir / f"distribution_{shape}.png"
        report.save_figure(shape_figure(rows, shape), path)
        written.append(path)
    return written
