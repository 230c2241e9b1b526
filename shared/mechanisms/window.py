"""Window channels: report a cell near the input, exactly, and check reported cells.

``piecewise`` and ``sw`` share one law over M cells: an input index i owns the window of
w cells [i, i + w), and the device reports a cell uniform on that window with probability
P(window) = T / 2^53, otherwise a cell uniform on the M - w cells outside it. So

    P(m | i) = H = T / (2^53 w)  inside,   L = (2^53 - T) / (2^53 (M - w))  outside,

and the likelihood ratio of two inputs is at most H / L = T (M - w) / ((2^53 - T) w)
(``window_ratio``, exact as a fraction, which the mechanisms certify at most e^eps). The
sampler draws integers only (``shared.randomness``): no floating-point output set.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from shared.randomness import BITS53, RandomSource


def window_ratio(threshold: int, window: int, outside: int) -> Fraction:
    """H / L = T (cells outside) / ((2^53 - T) w) exactly, for P(window) = T / 2^53."""
    return Fraction(threshold * outside, (BITS53 - threshold) * window)


def draw_window_cells(
    index: np.ndarray, window: int, cells: int, threshold: int, source: RandomSource
) -> np.ndarray:
    """One cell per index i: with probability T / 2^53 uniform on [i, i + w), otherwise
    uniform on the M - w cells outside (exact integer sampling)."""
    n = index.size
    inside = source.bernoulli_below(threshold, n)
    in_window = index + source.integers(window, n)
    rest = source.integers(cells - window, n)
    outside = np.where(rest < index, rest, rest + window)
    return np.where(inside, in_window, outside)


def check_cell_reports(reports: np.ndarray, cells: int, name: str) -> np.ndarray:
    """``reports`` as int64 cell indices in 0..cells-1, or ValueError naming the first bad."""
    array = np.asarray(reports)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{name} reports must be a 1-d array of integer cell indices, got {array.dtype} "
            f"of shape {array.shape}"
        )
    bad = np.flatnonzero((array < 0) | (array >= cells))
    if bad.size:
        raise ValueError(f"report {bad[0]}: cell index {array[bad[0]]} is outside 0..{cells - 1}")
    return array.astype(np.int64)
