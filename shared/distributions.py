"""Distributions estimated from local reports: histogram, CDF, ranges and quantiles.

A distribution mechanism (``hh``, ``sw``) cuts [lower, upper] into D buckets with edges
e_0 < e_1 < ... < e_D (``shared.mechanisms.spec.DistributionSpec``) and estimates the
CDF at the edges,

    F_k = share of the users' values below e_k,   F_0 = 0, F_D = 1 (exactly),

by a linear, unbiased estimate F^_k, and computes from its own law the variance of the
difference of any two, Var[F^_j - F^_i] (so Var[F^_k] = Var[F^_k - F^_0], F^_0 being 0).
Everything published derives from those two (``DistributionEstimate``):

* a bucket's share x_b = F_{b+1} - F_b, and the share of a range of whole buckets
  F_j - F_i, estimated by the difference of the CDF estimates, unbiased, with the
  mechanism's Var[F^_j - F^_i];
* normal intervals estimate ± z std (each estimate is a sum of n independent bounded
  terms: the central limit theorem applies);
* a valid distribution over the buckets (``postprocessed``, non-negative and summing to 1),
  biased, from the mechanism: the weighted isotonic regression of the CDF estimates
  (``monotone_fractions``) or a reconstruction of the mechanism's own (``sw``: EMS);
* quantiles. The q-quantile Q lies in bucket b when F_b < q <= F_{b+1}. Its point estimate
  is where the post-processed CDF P crosses q: the first bucket b with P_{b+1} >= q, at
  the fraction (q - P_b) / (P_{b+1} - P_b) of its width (equal widths on a linear scale,
  equal ratios on a log scale). Its interval inverts two one-sided tests per bucket:
  bucket b is ruled out when F^_b - z s_b >= q (then F_b < q is implausible) or when
  F^_{b+1} + z s_{b+1} < q, with z = z_{(1 + level) / 2}. Each test, at the bucket that
  holds Q, errs with probability at most (1 - level) / 2, so the buckets not ruled out
  hold Q with probability at least ``level`` (to the normal approximation); the interval
  is their hull, [e_first, e_{last + 1}], in whole buckets. When ``postprocessed`` is the
  isotonic regression, the point's bucket is never ruled out (the last value of a pooled
  block is at most the block's mean, the first at least), so the point lies in its
  interval. Another post-processing (``sw``'s EMS) may cross q in a bucket the tests rule
  out; the point is then the nearest end of the interval, so that it always lies in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.estimates import z_value

#: Var[F^_high - F^_low] for arrays of edge indices low <= high (elementwise, same shape).
RangeVariance = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Quantile:
    """The ``q``-quantile's estimate and its interval, in value units."""

    q: float
    value: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class RangeFraction:
    """The share of values in [low, high), whole buckets: ``requested_low`` and
    ``requested_high`` snapped to the nearest edges ``low`` and ``high``. ``fraction`` is
    unbiased, with ``std`` and the interval around it; ``postprocessed`` is the share under
    the post-processed distribution (biased; for the isotonic fit, a projection of the
    CDF estimate onto the non-decreasing CDFs, never farther from the truth in the weighted
    norm, and in practice a smaller error)."""

    requested_low: float
    requested_high: float
    low: float
    high: float
    fraction: float
    std: float
    ci_low: float
    ci_high: float
    postprocessed: float


def monotone_fractions(cdf: np.ndarray, variance: np.ndarray) -> np.ndarray:
    """Bucket shares whose CDF is the weighted isotonic regression of ``cdf`` (weights
    1 / variance) with its ends held at 0 and 1, clipped to [0, 1]: a valid distribution.

    Pool-adjacent-violators (Barlow, Bartholomew, Bremner and Brunk 1972): blocks of
    adjacent values are merged into their weighted mean until the means increase. O(D).
    """
    values = np.clip(np.asarray(cdf, dtype=np.float64), 0.0, 1.0)
    inner = values[1:-1]
    weights = 1.0 / np.maximum(np.asarray(variance, dtype=np.float64)[1:-1], 1e-300)
    means: list[float] = []
    masses: list[float] = []
    sizes: list[int] = []
    for value, weight in zip(inner.tolist(), weights.tolist(), strict=True):
        means.append(value)
        masses.append(weight)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            mass = masses[-2] + masses[-1]
            mean = (means[-2] * masses[-2] + means[-1] * masses[-1]) / mass
            size = sizes[-2] + sizes[-1]
            del means[-1], masses[-1], sizes[-1]
            means[-1], masses[-1], sizes[-1] = mean, mass, size
    fitted = np.repeat(np.array(means, dtype=np.float64), sizes) if means else np.zeros(0)
    monotone = np.concatenate([[0.0], fitted, [1.0]])
    return np.diff(monotone)


@dataclass(frozen=True)
class DistributionEstimate:
    """A distribution over D buckets estimated from n reports (see the module docstring).

    ``edges``: the D + 1 edges; ``cdf``: the unbiased F^ at every edge (F^_0 = 0 and
    F^_D = 1); ``range_variance``: Var[F^_high - F^_low]; ``postprocessed``: a valid
    distribution over the buckets, biased, made by ``method``.
    """

    edges: np.ndarray
    scale: Literal["linear", "log"]
    n: int
    cdf: np.ndarray
    range_variance: RangeVariance
    postprocessed: np.ndarray
    method: str

    def __post_init__(self) -> None:
        buckets = self.edges.size - 1
        if self.cdf.shape != (buckets + 1,) or self.postprocessed.shape != (buckets,):
            raise ValueError(
                f"a distribution over {buckets} buckets needs {buckets + 1} CDF values and "
                f"{buckets} post-processed shares"
            )

    @property
    def buckets(self) -> int:
        return self.edges.size - 1

    def cdf_variance(self) -> np.ndarray:
        """Var[F^_k] at every edge (0 at both ends)."""
        every = np.arange(self.buckets + 1)
        return np.maximum(self.range_variance(np.zeros_like(every), every), 0.0)

    def cdf_std(self) -> np.ndarray:
        return np.sqrt(self.cdf_variance())

    def fractions(self) -> np.ndarray:
        """Unbiased bucket shares x^_b = F^_{b+1} - F^_b (may be negative)."""
        return np.diff(self.cdf)

    def between_std(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """std of F^_high - F^_low for arrays of edge indices low <= high."""
        return np.sqrt(np.maximum(self.range_variance(np.asarray(low), np.asarray(high)), 0.0))

    def fraction_std(self) -> np.ndarray:
        """std of every bucket's unbiased share."""
        every = np.arange(self.buckets)
        return self.between_std(every, every + 1)

    def postprocessed_cdf(self) -> np.ndarray:
        """The CDF of ``postprocessed`` at the edges (0 first, 1 last)."""
        cumulative = np.concatenate([[0.0], np.cumsum(self.postprocessed)])
        cumulative = np.minimum(np.maximum.accumulate(cumulative), 1.0)
        cumulative[-1] = 1.0
        return cumulative

    def value_at(self, bucket: int, fraction: float) -> float:
        """The value ``fraction`` of the way through ``bucket``: by width on a linear
        scale, by ratio on a log scale."""
        low, high = float(self.edges[bucket]), float(self.edges[bucket + 1])
        if self.scale == "log":
            return low * math.exp(fraction * math.log(high / low))
        return low + fraction * (high - low)

    def quantiles(self, levels: Sequence[float], confidence: float = 0.95) -> list[Quantile]:
        """Each ``q`` in ``levels`` (0 < q < 1): point and interval (module docstring)."""
        z = z_value(confidence)
        std = self.cdf_std()
        cumulative = self.postprocessed_cdf()
        answers = []
        for q in levels:
            if not 0.0 < q < 1.0:
                raise ValueError(f"a quantile level must lie strictly between 0 and 1, got {q}")
            bucket = int(np.searchsorted(cumulative[1:], q, side="left"))
            bucket = min(bucket, self.buckets - 1)
            below, above = cumulative[bucket], cumulative[bucket + 1]
            fraction = (q - below) / (above - below) if above > below else 0.5
            value = self.value_at(bucket, float(np.clip(fraction, 0.0, 1.0)))
            ruled_out_low = self.cdf[:-1] - z * std[:-1] >= q
            ruled_out_high = self.cdf[1:] + z * std[1:] < q
            kept = np.flatnonzero(~(ruled_out_low | ruled_out_high))
            first, last = (int(kept[0]), int(kept[-1])) if kept.size else (bucket, bucket)
            low, high = float(self.edges[first]), float(self.edges[last + 1])
            answers.append(
                Quantile(q=float(q), value=min(max(value, low), high), ci_low=low, ci_high=high)
            )
        return answers

    def nearest_edge(self, value: float) -> int:
        """The index of the edge nearest ``value`` (by ratio on a log scale), after
        clipping to [lower, upper]."""
        clipped = min(max(value, float(self.edges[0])), float(self.edges[-1]))
        if self.scale == "log":
            distance = np.abs(np.log(self.edges) - math.log(clipped))
        else:
            distance = np.abs(self.edges - clipped)
        return int(np.argmin(distance))

    def range_fraction(self, low: float, high: float, confidence: float = 0.95) -> RangeFraction:
        """The share of values in [low, high), snapped to whole buckets, with its interval;
        ValueError when low >= high or both snap to the same edge."""
        if not (math.isfinite(low) and math.isfinite(high)) or not low < high:
            raise ValueError(f"a range needs finite LOW < HIGH, got {low}, {high}")
        first, last = self.nearest_edge(low), self.nearest_edge(high)
        if first >= last:
            raise ValueError(
                f"the range {low:g}..{high:g} is narrower than one bucket: both ends snap to "
                f"the edge {self.edges[first]:g}; the buckets' edges are listed in the histogram"
            )
        fraction = float(self.cdf[last] - self.cdf[first])
        std = float(self.between_std(np.array([first]), np.array([last]))[0])
        half = z_value(confidence) * std
        cumulative = self.postprocessed_cdf()
        return RangeFraction(
            requested_low=low,
            requested_high=high,
            low=float(self.edges[first]),
            high=float(self.edges[last]),
            fraction=fraction,
            std=std,
            ci_low=fraction - half,
            ci_high=fraction + half,
            postprocessed=float(cumulative[last] - cumulative[first]),
        )
