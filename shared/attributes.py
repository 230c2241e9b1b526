"""Estimates of a multi-attribute report: one per attribute, and 2-way marginals of pairs.

A multi-attribute metric (``spl``, ``smp``, ``rsfd``: ``shared.mechanisms.multidim``)
protects several private attributes in one report. Its estimate is an
``AttributesEstimate``:

* one ``CategoricalAttribute`` (unbiased frequencies with std, and the closest valid
  distribution) or ``NumericAttribute`` (an unbiased mean with std) per attribute, in the
  spec's order;
* one ``PairMarginal`` per declared pair: the unbiased joint frequencies of the pair's
  cells with std, a valid joint distribution derived from them, and the conditional shares
  P(second = j | first = i) and P(first = i | second = j) with delta-method std.

Intervals are normal: ``estimate ± z std`` (``shared.estimates.z_value``). Unbiased
values may be negative or exceed 1; the post-processed ones never do and are biased.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.estimates import z_value

#: How an attribute's one-way estimate was obtained: from its own reports ("direct"), or
#: as the consistent projection of the declared pairs that contain it ("consistent").
OneWayMethod = Literal["direct", "consistent"]


def normal_interval(
    estimate: np.ndarray | float, std: np.ndarray | float, level: float
) -> tuple[np.ndarray, np.ndarray]:
    """``estimate ± z std``, the two-sided normal interval at ``level``."""
    z = z_value(level)
    low = np.asarray(estimate, dtype=np.float64) - z * np.asarray(std, dtype=np.float64)
    high = np.asarray(estimate, dtype=np.float64) + z * np.asarray(std, dtype=np.float64)
    return low, high


@dataclass(frozen=True)
class CategoricalAttribute:
    """A categorical attribute's estimated distribution over its ``domain_size`` values.

    ``n``: the reports that inform it (all of them under ``spl`` and ``rsfd``; under
    ``smp``, those that sampled a view holding it). ``frequencies`` are unbiased, ``std``
    their standard errors at the observed counts; ``postprocessed`` is the closest valid
    distribution (biased).
    """

    name: str
    labels: tuple[str, ...] | None
    n: int
    frequencies: np.ndarray
    std: np.ndarray
    postprocessed: np.ndarray
    method: OneWayMethod

    kind: Literal["categorical"] = "categorical"

    @property
    def domain_size(self) -> int:
        return int(self.frequencies.size)

    def ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        return normal_interval(self.frequencies, self.std, level)


@dataclass(frozen=True)
class NumericAttribute:
    """A numeric attribute's unbiased mean over [lower, upper] with its standard error;
    ``postprocessed_mean`` is the mean clipped into the bounds (biased)."""

    name: str
    lower: float
    upper: float
    n: int
    mean: float
    std: float
    postprocessed_mean: float

    kind: Literal["numeric"] = "numeric"

    def ci(self, level: float = 0.95) -> tuple[float, float]:
        low, high = normal_interval(self.mean, self.std, level)
        return float(low), float(high)


@dataclass(frozen=True)
class PairMarginal:
    """The joint distribution of two categorical attributes (a declared pair).

    Cell (i, j) is the share of devices whose first attribute has value i and second j.
    ``frequencies`` (shape (d1, d2)) are unbiased and consistent with the one-way
    estimates: summing over j gives the first attribute's ``frequencies``, over i the
    second's. ``postprocessed`` is a valid joint distribution (non-negative, sums to 1).

    Conditional shares, from the unbiased joint, with delta-method std (first order in
    the joint's covariance; the ratio is biased at order 1/n):

    * ``given_first[i, j]`` = P(second = j | first = i) = f(i, j) / sum_j' f(i, j');
    * ``given_second[i, j]`` = P(first = i | second = j) = f(i, j) / sum_i' f(i', j).

    Where the denominator's estimate is not positive the share is NaN (no answer).
    """

    attributes: tuple[str, str]
    n: int
    frequencies: np.ndarray
    std: np.ndarray
    postprocessed: np.ndarray
    given_first: np.ndarray
    given_first_std: np.ndarray
    given_second: np.ndarray
    given_second_std: np.ndarray

    conditional_method: Literal["delta"] = "delta"

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.frequencies.shape
        return int(rows), int(columns)

    def ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        return normal_interval(self.frequencies, self.std, level)


@dataclass(frozen=True)
class AttributesEstimate:
    """Everything a multi-attribute metric's statistics estimate.

    ``protocol``: ``spl``, ``smp`` or ``rsfd``; ``n``: the reports; ``attributes`` in the
    spec's order; ``marginals`` in the order the spec declares its pairs.
    """

    protocol: str
    n: int
    attributes: tuple[CategoricalAttribute | NumericAttribute, ...]
    marginals: tuple[PairMarginal, ...]

    def attribute(self, name: str) -> CategoricalAttribute | NumericAttribute:
        for attribute in self.attributes:
            if attribute.name == name:
                return attribute
        raise KeyError(f"no attribute {name!r}")

    def marginal(self, first: str, second: str) -> PairMarginal:
        for marginal in self.marginals:
            if marginal.attributes == (first, second):
                return marginal
        raise KeyError(f"no declared pair ({first!r}, {second!r})")
