"""What the RAPPOR mechanism and its decoder share: string factorization, debiased Bloom
counts, the decoded estimate, and the interface the decoder needs from the mechanism.

A leaf module, so that ``shared.mechanisms.rappor`` (the device and server sides) and
``shared.mechanisms.rappor_decode`` (the server-only least-squares decoder, which needs
scipy) both import it and neither needs the other at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.estimates import Estimate, PostprocessedFrequencies
from shared.statistics import CountStatistics

__all__ = [
    "BloomCounts",
    "BloomDecodable",
    "DetectedString",
    "RapporEstimate",
    "distinct_per_row",
    "factorize_strings",
]


def factorize_strings(values: Any, what: str = "value") -> tuple[list[str], np.ndarray]:
    """Distinct strings (first-seen order) and each value's index among them.

    One dictionary lookup per value (the fastest exact way: a numpy ``str_`` array
    would drop trailing NULs), and the type and UTF-8 checks once per distinct string.
    """
    array = np.asarray(values, dtype=object)
    if array.ndim != 1:
        raise ValueError(f"{what}s must be a one-dimensional sequence, got shape {array.shape}")
    index: dict[Any, int] = {}
    try:
        codes = np.fromiter(
            (index.setdefault(v, len(index)) for v in array), dtype=np.int64, count=array.size
        )
    except TypeError:  # an unhashable element, certainly not a string: find it to name it
        position = next(i for i, v in enumerate(array) if not isinstance(v, str))
        raise ValueError(
            f"{what}s must be strings; got {type(array[position]).__name__} at position {position}"
        ) from None
    distinct = list(index)
    for i, text in enumerate(distinct):  # once per distinct string
        problem = None
        if not isinstance(text, str):
            problem = f"must be a string, got {type(text).__name__} {text!r}"
        else:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                problem = "is not valid Unicode (it holds a lone surrogate)"
        if problem:
            position = int(np.flatnonzero(codes == i)[0])
            raise ValueError(f"{what} at position {position} {problem}")
    return distinct, codes


@dataclass(frozen=True)
class BloomCounts:
    """Debiased per-cohort Bloom counts: t_jb estimates how many reports set Bloom bit b."""

    counts: np.ndarray  # (m, k) t_jb, unbiased
    std: np.ndarray  # (m, k) plug-in std of t_jb (T_jb clipped to [0, N_j])
    reports: np.ndarray  # (m,) N_j

    @property
    def fractions(self) -> np.ndarray:
        """t_jb / N_j: the estimated share of cohort j's reports with bit b set (0 if N_j = 0)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            share = self.counts / self.reports[:, None]
        return np.where(self.reports[:, None] > 0, share, 0.0)


@dataclass(frozen=True)
class DetectedString:
    """One detected candidate: estimated proportion, count, std and confidence interval."""

    string: str
    frequency: float
    count: float
    std: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class RapporEstimate(Estimate):
    """Frequencies of candidate strings decoded from RAPPOR statistics.

    ``frequencies[i]`` is the estimated share of the n reports whose value is
    ``candidates[i]`` (constrained least squares: non-negative, summing to at most
    1; a candidate's estimate is unbiased while it is well above 0, not near 0),
    ``std[i]`` its standard error, ``detected[i]`` whether it passed the detection
    test at ``alpha`` (``p_values`` one-sided, ``correction`` over all candidates),
    ``selected[i]`` whether the LASSO kept it for the fit.

    ``explained_mass`` is the total frequency the candidates take (it includes the
    positive part of every absent candidate's noise, about 0.4 std each) and
    ``unexplained_mass = 1 - explained_mass`` the rest, which belongs to strings
    that are not candidates; ``background_mass`` is the part of it the fit
    attributes to a uniform background (many rare strings outside the candidates).
    ``detection_thresholds[i]`` is the frequency at which candidate i is detected
    with probability 1/2, ``smallest_detectable_frequency`` their median.
    ``residual_chi2`` on ``residual_dof`` degrees of freedom tests the fit
    (``residual_p_value``). ``ci`` is the normal interval clipped to [0, 1].
    """

    candidates: tuple[str, ...]
    detected: np.ndarray
    p_values: np.ndarray
    selected: np.ndarray
    detection_thresholds: np.ndarray
    explained_mass: float
    explained_mass_std: float
    unexplained_mass: float
    background_mass: float
    smallest_detectable_frequency: float
    alpha: float
    correction: str
    residual_chi2: float
    residual_dof: int

    def ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """``f ± z std`` clipped to [0, 1] (every true frequency lies there)."""
        low, high = super().ci(level)
        return np.clip(low, 0.0, 1.0), np.clip(high, 0.0, 1.0)

    def detected_strings(self, level: float = 0.95) -> list[DetectedString]:
        """The detected candidates, most frequent first."""
        low, high = self.ci(level)
        counts = self.counts
        order = np.flatnonzero(self.detected)
        order = order[np.argsort(-self.frequencies[order], kind="stable")]
        return [
            DetectedString(
                self.candidates[i],
                float(self.frequencies[i]),
                float(counts[i]),
                float(self.std[i]),
                float(low[i]),
                float(high[i]),
            )
            for i in order
        ]

    def postprocessed(self) -> PostprocessedFrequencies:
        """The frequencies themselves: already non-negative with a sum of at most 1."""
        return PostprocessedFrequencies(self.frequencies.copy(), "constrained-least-squares")

    @property
    def residual_p_value(self) -> float:
        """P(chi2_dof >= residual_chi2): small when strings outside the candidates carry mass."""
        from scipy import stats  # server side only

        if self.residual_dof <= 0:
            return 1.0
        return float(stats.chi2.sf(self.residual_chi2, self.residual_dof))


def distinct_per_row(cells: np.ndarray) -> np.ndarray:
    """Sort each row and replace repeated entries by -1 (a value sets a Bloom bit once)."""
    order = np.sort(cells, axis=1)
    repeated = np.zeros(order.shape, dtype=bool)
    repeated[:, 1:] = order[:, 1:] == order[:, :-1]
    return np.where(repeated, -1, order)


class BloomDecodable(Protocol):
    """What decoding needs from a RAPPOR mechanism (``shared.mechanisms.rappor.Rappor``).

    k = ``num_bits`` Bloom bits, h = ``num_hashes`` hashes; ``p_star`` and ``q_star`` the
    probabilities that a reported bit is 1 when its Bloom bit is 0 and 1;
    ``noise_per_report`` s0 = p* (1 - p*) / (q* - p*)^2.
    """

    num_bits: int
    num_hashes: int

    @property
    def p_star(self) -> float: ...

    @property
    def q_star(self) -> float: ...

    @property
    def noise_per_report(self) -> float: ...

    def bloom_counts(self, stats: CountStatistics) -> BloomCounts:
        """Debiased per-cohort Bloom counts t_jb of ``stats``."""
        ...

    def candidate_bits(self, candidates: Sequence[str]) -> np.ndarray:
        """The Bloom bits of each candidate in each cohort, shape (C, m, h)."""
        ...
