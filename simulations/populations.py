"""Synthetic populations: how many users hold each value, for a data shape.

A population is fixed before any mechanism runs, so that every path and every worker
measures the error against the same truth:

* categorical shapes give the share of each of the d categories, and the population of
  n users is ``n * share`` rounded by largest remainders (the counts sum to n exactly):
  ``uniform``; ``zipf:S``, share of the i-th category proportional to ``(i + 1)^-S``;
  ``counts:FILE``, the shares of a CSV of counts (one count per line, or ``label,count``;
  its number of rows is the domain size).
* numeric shapes give values on ``[lower, upper]`` as a histogram of ``levels`` (the
  midpoints of 1024 equal bins) and their counts, so the fast path can draw the
  statistics per level: ``uniform``, ``normal:MEAN,SD``, ``exponential:SCALE`` (the
  density truncated to the range, as a share of users per bin).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CategoricalShape",
    "NumericShape",
    "NumericPopulation",
    "apportion",
    "parse_categorical_shape",
    "parse_numeric_shape",
]

#: Bins of a numeric population's histogram.
NUMERIC_LEVELS = 1024


def apportion(shares: np.ndarray, n: int) -> np.ndarray:
    """``n`` split in proportion to ``shares`` by largest remainders: sums to ``n`` exactly."""
    weights = np.asarray(shares, dtype=np.float64)
    if weights.ndim != 1 or weights.size == 0 or np.any(weights < 0) or not weights.sum() > 0:
        raise ValueError("shares must be non-negative and not all zero")
    exact = weights / weights.sum() * n
    counts = np.floor(exact).astype(np.int64)
    short = n - int(counts.sum())
    if short:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


@dataclass(frozen=True)
class CategoricalShape:
    """A data shape over categories; ``text`` is how it was written on the command line."""

    text: str
    exponent: float | None = None  # zipf
    file_counts: tuple[int, ...] | None = None  # counts:FILE
    file_labels: tuple[str, ...] | None = None  # counts:FILE with a name before each count

    def shares(self, d: int) -> np.ndarray:
        """The share of each of ``d`` categories (most popular first for zipf)."""
        if self.file_counts is not None:
            if len(self.file_counts) != d:
                raise ValueError(
                    f"shape {self.text!r} has {len(self.file_counts)} categories, but the "
                    f"domain size is {d}: give --domain-sizes {len(self.file_counts)}"
                )
            return np.asarray(self.file_counts, dtype=np.float64)
        if self.exponent is not None:
            return np.arange(1, d + 1, dtype=np.float64) ** -self.exponent
        return np.ones(d)

    def counts(self, d: int, n: int) -> np.ndarray:
        """How many of ``n`` users hold each of the ``d`` categories."""
        return apportion(self.shares(d), n)

    def labels(self, d: int) -> tuple[str, ...]:
        """The names of the ``d`` categories: a counts file's first column where it has
        one (and d rows), else ``category 0`` .. ``category d-1``."""
        if self.file_labels is not None and len(self.file_labels) == d:
            return self.file_labels
        return tuple(f"category {index}" for index in range(d))


def parse_categorical_shape(text: str) -> CategoricalShape:
    """``uniform``, ``zipf:S`` (S > 0) or ``counts:FILE``; ValueError saying what is wrong."""
    kind, _, argument = text.partition(":")
    if kind == "uniform" and not argument:
        return CategoricalShape(text)
    if kind == "zipf":
        try:
            exponent = float(argument)
        except ValueError:
            raise ValueError(f"shape {text!r}: zipf needs an exponent, e.g. zipf:1.1") from None
        if not (math.isfinite(exponent) and exponent > 0):
            raise ValueError(f"shape {text!r}: the zipf exponent must be a number > 0")
        return CategoricalShape(text, exponent=exponent)
    if kind == "counts" and argument:
        counts, labels = _read_counts(Path(argument))
        return CategoricalShape(text, file_counts=counts, file_labels=labels)
    raise ValueError(f"unknown shape {text!r}: use uniform, zipf:S or counts:FILE")


def _read_counts(path: Path) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The counts of a CSV file (the last column of each row), and the names in its first
    column when every row has one and they are distinct (else None)."""
    if not path.is_file():
        raise ValueError(f"counts file {str(path)!r} does not exist")
    counts: list[int] = []
    names: list[str] = []
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if not row or not "".join(row).strip():
                continue
            cell = row[-1].strip()
            try:
                count = int(cell)
            except ValueError:
                if number == 1:  # a header line
                    continue
                raise ValueError(f"{path}:{number}: {cell!r} is not an integer count") from None
            if count < 0:
                raise ValueError(f"{path}:{number}: counts must be >= 0, got {count}")
            counts.append(count)
            names.append(row[0].strip() if len(row) > 1 else "")
    if len(counts) < 2 or sum(counts) == 0:
        raise ValueError(f"{path}: needs at least two categories and a positive total")
    named = all(names) and len(set(names)) == len(names)
    return tuple(counts), tuple(names) if named else None


@dataclass(frozen=True)
class NumericPopulation:
    """Users' values as a histogram: ``counts[j]`` users hold ``levels[j]``."""

    levels: np.ndarray
    counts: np.ndarray

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def mean(self) -> float:
        """The true mean (the values are inside the range, so clipping changes nothing)."""
        return float(self.counts @ self.levels / self.n)


@dataclass(frozen=True)
class NumericShape:
    """A data shape for numbers on ``[lower, upper]``."""

    text: str
    kind: str
    parameters: tuple[float, ...] = ()

    def population(self, lower: float, upper: float, n: int) -> NumericPopulation:
        edges = np.linspace(lower, upper, NUMERIC_LEVELS + 1)
        levels = (edges[:-1] + edges[1:]) / 2
        if self.kind == "uniform":
            mass = np.ones(NUMERIC_LEVELS)
        elif self.kind == "normal":
            mean, sd = self.parameters
            mass = np.diff(np.array([_normal_cdf((e - mean) / sd) for e in edges]))
        else:
            (scale,) = self.parameters
            mass = np.diff(-np.exp(-np.maximum(edges - lower, 0.0) / scale))
        if not mass.sum() > 0:
            raise ValueError(f"shape {self.text!r} puts no mass on [{lower:g}, {upper:g}]")
        return NumericPopulation(levels, apportion(mass, n))


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def parse_numeric_shape(text: str) -> NumericShape:
    """``uniform``, ``normal:MEAN,SD`` (SD > 0) or ``exponential:SCALE`` (SCALE > 0)."""
    kind, _, argument = text.partition(":")
    try:
        parameters = tuple(float(part) for part in argument.split(",")) if argument else ()
    except ValueError:
        raise ValueError(f"shape {text!r}: parameters must be numbers") from None
    if not all(math.isfinite(value) for value in parameters):
        raise ValueError(f"shape {text!r}: parameters must be finite numbers")
    if kind == "uniform" and not parameters:
        return NumericShape(text, kind)
    if kind == "normal" and len(parameters) == 2 and parameters[1] > 0:
        return NumericShape(text, kind, parameters)
    if kind == "exponential" and len(parameters) == 1 and parameters[0] > 0:
        return NumericShape(text, kind, parameters)
    raise ValueError(
        f"unknown or malformed shape {text!r}: use uniform, normal:MEAN,SD or exponential:SCALE"
    )
