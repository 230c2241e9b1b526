"""Estimates with standard errors, normal-approximation intervals and post-processing.

``Estimate`` holds unbiased frequency estimates of every category; ``MeanEstimate``
an unbiased mean. Both give a two-sided confidence interval
``estimate ± z_{(1 + level) / 2} · std`` (normal approximation: each estimate is
a sum of n independent bounded terms, so the central limit theorem applies).

Unbiased frequencies can be negative and need not sum to 1.
``Estimate.postprocessed()`` projects them onto the probability simplex
(Euclidean projection, the "Norm-Sub" of Wang et al., "Locally Differentially
Private Frequency Estimation with Consistency", NDSS 2020): the closest valid
distribution, at the price of bias. It is returned as a separate, marked object
so the two are never confused.

A mean has two standard errors, for two questions (``MeanEstimate``): ``std`` is the
error around the mean of the users' own (clipped) values, the privacy noise alone;
``population_std`` the error around the mean of the population the users were drawn
from, which adds the spread of their values (see ``shared.mechanisms.numeric``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

#: How ``MeanEstimate.std`` was obtained: "known" (the noise variance does not depend on
#: the data), "estimated" (unbiasedly, from the sum of squares of the reports) or
#: "upper-bound" (not identifiable from the reports: the interval is conservative).
StdMethod = Literal["known", "estimated", "upper-bound"]


@functools.lru_cache(maxsize=64)
def z_value(level: float) -> float:
    """The two-sided normal quantile for a confidence ``level`` in (0, 1)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must lie in (0, 1), got {level}")
    return NormalDist().inv_cdf((1.0 + level) / 2.0)


def project_to_simplex(values: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {x : x >= 0, sum x = 1} (sort-based, O(d log d)).

    The projection is ``max(v - tau, 0)`` with tau chosen so the result sums to 1
    (Held, Wolfe, Crowder 1974; Duchi et al., ICML 2008, Figure 1).
    """
    return project_rows_to_simplex(np.asarray(values, dtype=np.float64)[None, :])[0]


def project_rows_to_simplex(rows: np.ndarray) -> np.ndarray:
    """``project_to_simplex`` of every row of a (g, d) matrix, in one pass of numpy
    operations over the matrix: per row, tau = (sum of the rho + 1 largest - 1) / (rho + 1)
    with rho the last rank k (from 0) where the (k + 1)-th largest exceeds that mean."""
    v = np.asarray(rows, dtype=np.float64)
    ordered = -np.sort(-v, axis=1)
    cumulative = np.cumsum(ordered, axis=1) - 1.0
    ranks = np.arange(1, v.shape[1] + 1)
    positive = ordered - cumulative / ranks > 0  # true at rank 0, false after some rank
    rho = v.shape[1] - 1 - np.argmax(positive[:, ::-1], axis=1)
    tau = cumulative[np.arange(v.shape[0]), rho] / (rho + 1)
    return np.maximum(v - tau[:, None], 0.0)


@dataclass(frozen=True)
class PostprocessedFrequencies:
    """A valid distribution derived from unbiased estimates; biased, for display and ranking."""

    frequencies: np.ndarray
    method: str = "simplex-projection"
    unbiased: bool = False


@dataclass(frozen=True)
class Estimate:
    """Unbiased frequency estimates of d categories from n reports, with standard errors."""

    frequencies: np.ndarray
    std: np.ndarray
    n: int

    @property
    def counts(self) -> np.ndarray:
        """Estimated number of users per category, ``n · frequency``."""
        return self.frequencies * self.n

    def ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Per-category normal-approximation interval ``f ± z · std``."""
        half = z_value(level) * self.std
        return self.frequencies - half, self.frequencies + half

    def postprocessed(self) -> PostprocessedFrequencies:
        """The closest valid distribution (non-negative, sums to 1), marked as biased."""
        return PostprocessedFrequencies(project_to_simplex(self.frequencies))


@dataclass(frozen=True)
class HeavyHitters(Estimate):
    """The most frequent strings found without a candidate list, most frequent first:
    ``strings[i]`` has the estimated frequency ``frequencies[i]`` with standard error
    ``std[i]`` (of the estimate given the string was found; see the mechanism for how
    discovery and estimation share the reports)."""

    strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.strings) != len(self.frequencies):
            raise ValueError(
                f"heavy hitters need one frequency per string, got {len(self.strings)} "
                f"strings and {len(self.frequencies)} frequencies"
            )


@dataclass(frozen=True)
class MeanEstimate:
    """An unbiased mean of n clipped values, with two standard errors.

    ``std``: sqrt(sum_i Var[y_i | x_i]) / n, the error around the users' own mean
    (1/n) sum_i clip(x_i), how it was obtained given by ``std_method``.
    ``population_std``: sqrt(s^2 / n), s^2 the sample variance of the debiased reports,
    the error around the mean of the population the users were drawn from.
    """

    mean: float
    std: float
    n: int
    lower: float
    upper: float
    population_std: float
    std_method: StdMethod

    def ci(self, level: float = 0.95, population: bool = False) -> tuple[float, float]:
        """``mean ± z · std`` for the users' own mean, or with ``population=True``
        ``mean ± z · population_std`` for the mean of the population they came from."""
        half = z_value(level) * (self.population_std if population else self.std)
        return self.mean - half, self.mean + half

    def postprocessed(self) -> float:
        """The mean clipped to [lower, upper], where every true mean lies; biased."""
        return float(np.clip(self.mean, self.lower, self.upper))
