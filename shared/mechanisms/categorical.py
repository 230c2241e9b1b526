"""Frequency oracles: the estimator every categorical mechanism shares.

Each categorical mechanism defines, for a report y and a category v, whether y
*supports* v, with

    p = P(y supports v | user's value is v),
    q = P(y supports v | user's value is u), the same for every u != v.

With C_v the number of the n reports that support v, the estimator

    f_v = (C_v / n - q) / (p - q)

is unbiased, and since users are independent

    Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))

(Wang, Blocki, Li, Jha, "Locally Differentially Private Protocols for
Frequency Estimation", USENIX Security 2017, Section 4). ``variance(n)`` is the
first term (f_v = 0), the figure used for planning and for choosing a
mechanism; ``Estimate.std`` evaluates the whole formula at the estimate clipped
to [0, 1].
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from shared.estimates import Estimate
from shared.mechanisms.abilities import CategoricalValues
from shared.mechanisms.base import Mechanism
from shared.mechanisms.spec import CategoricalSpec
from shared.statistics import CountStatistics

#: Largest output space ``transition_matrix`` enumerates.
MAX_ENUMERATED_OUTPUTS = 1 << 16


def require_enumerable(outputs: int) -> None:
    """Refuse to enumerate an output space larger than ``MAX_ENUMERATED_OUTPUTS``."""
    if outputs > MAX_ENUMERATED_OUTPUTS:
        raise ValueError(
            f"the output space has {outputs} elements; transition_matrix enumerates at most "
            f"{MAX_ENUMERATED_OUTPUTS} (use a smaller domain)"
        )


def check_true_counts(counts: object, domain_size: int, rng: object) -> np.ndarray:
    """``counts`` as int64, or ValueError unless it is d non-negative integers; the
    simulation fast path also insists on a seeded ``numpy.random.Generator``."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("simulate_statistics needs a numpy.random.Generator (simulation only)")
    array = np.asarray(counts)
    if array.shape != (domain_size,) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"counts must be {domain_size} integers, one per category")
    if np.any(array < 0):
        raise ValueError("counts must be non-negative")
    return array.astype(np.int64)


class CategoricalMechanism(Mechanism[CountStatistics]):
    """A frequency oracle over categories 0..d-1, defined by its p and q."""

    provides: ClassVar[tuple[type, ...]] = (CategoricalValues,)
    spec: CategoricalSpec

    def __init__(self, spec: CategoricalSpec) -> None:
        super().__init__(spec)
        self.domain_size: int = spec.domain_size

    @property
    @abstractmethod
    def p(self) -> float:
        """P(report supports v | value v)."""

    @property
    @abstractmethod
    def q(self) -> float:
        """P(report supports v | value u), u != v."""

    @abstractmethod
    def support_counts(self, stats: CountStatistics) -> np.ndarray:
        """C_v for every category v, from the sufficient statistics."""

    @abstractmethod
    def transition_matrix(self) -> np.ndarray:
        """Exact ``P[output | value]`` as a (d, outputs) matrix, for small output spaces.

        Raises ValueError when the output space has more than
        ``MAX_ENUMERATED_OUTPUTS`` elements.
        """

    @abstractmethod
    def simulate_statistics(self, counts: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """The statistics of ``counts[v]`` users of value ``v`` reporting once each, drawn
        directly from their distribution (binomial and multinomial sums) in time that does
        not grow with ``n = sum(counts)``: the simulation fast path. See the subclass for
        how exact it is. Simulation only: it takes a seeded numpy Generator."""

    def estimate(self, stats: CountStatistics) -> Estimate:
        """Unbiased frequencies ``(C_v / n - q) / (p - q)`` with their analytical std."""
        return self.estimate_many([stats])[0]

    def estimate_many(self, stats: Sequence[CountStatistics]) -> list[Estimate]:
        """``estimate`` of each statistics (of one breakdown's groups, say), computed as one
        (groups x d) matrix: f = (C / n - q) / (p - q) row by row, with the std
        ``sqrt((q (1 - q) / (p - q)^2 + f' (1 - p - q) / (p - q)) / n)`` at f' = f clipped
        to [0, 1] (Wang et al., USENIX Security 2017, with the frequency term)."""
        n = np.array([part.n for part in stats], dtype=np.float64)
        if np.any(n <= 0):
            raise ValueError("cannot estimate from zero reports")
        p, q = self.p, self.q
        support = np.stack([self.support_counts(part) for part in stats]).astype(np.float64)
        frequencies = (support / n[:, None] - q) / (p - q)
        at = np.clip(frequencies, 0.0, 1.0)
        variance = (q * (1 - q) / (p - q) ** 2 + at * (1 - p - q) / (p - q)) / n[:, None]
        return row_estimates(frequencies, np.sqrt(variance), n)

    def variance(self, n: int) -> float:
        """``q (1 - q) / (n (p - q)^2)``: variance of one frequency whose truth is 0."""
        return self.q * (1 - self.q) / (n * (self.p - self.q) ** 2)


def row_estimates(frequencies: np.ndarray, std: np.ndarray, n: np.ndarray) -> list[Estimate]:
    """One ``Estimate`` per row of the (groups x d) ``frequencies`` and ``std``."""
    return [
        Estimate(row, deviation, int(size))
        for row, deviation, size in zip(frequencies, std, n.tolist(), strict=True)
    ]
