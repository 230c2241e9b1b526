"""The fast Walsh-Hadamard transform.

For a vector x of length 2^r, the Sylvester-Hadamard transform is

    (H x)[u] = sum_v x[v] (-1)^popcount(u & v),

H the 2^r x 2^r matrix with H_1 = [1] and H_2n = [[H_n, H_n], [H_n, -H_n]], so H H = 2^r I.
It factors into r butterfly passes: pass t (half = 2^t) replaces each pair
(x[i], x[i + half]), i with bit t clear, by (x[i] + x[i + half], x[i] - x[i + half]);
O(r 2^r) additions. Hadamard response aggregates through it (``shared.mechanisms.hr``),
the Hadamard count mean sketch transforms its rows back (``shared.mechanisms.sketch``),
and SFP decodes all 2^24 fragment keys of a position at once (``shared.mechanisms.sfp``).

``walsh_hadamard`` transforms along the last axis, exactly in int64 (the sums of counts
stay far below 2^63) or in float64. The passes whose pairs lie within blocks of
``_BLOCK`` consecutive elements run block by block, so each block is loaded into cache
once for all of them; only the long-stride passes of vectors longer than a block sweep
the whole vector.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["walsh_hadamard"]

#: Elements transformed together by the short-stride passes (128 KiB: they stay in cache).
_BLOCK = 1 << 14


def _butterflies(block: np.ndarray, half: int, stop: int, scratch: np.ndarray) -> None:
    """Passes half, 2 half, ..., stop / 2 in place over the rows of a 2-D ``block`` whose
    row length is a multiple of ``stop``; ``scratch`` holds at least block.size / 2 values."""
    rows = block.shape[0]
    while half < stop:
        pairs = block.reshape(rows, -1, 2, half)
        low, high = pairs[:, :, 0, :], pairs[:, :, 1, :]
        difference = scratch[: low.size].reshape(low.shape)
        np.subtract(low, high, out=difference)
        low += high
        high[...] = difference
        half *= 2


def walsh_hadamard(values: npt.ArrayLike, out: np.ndarray | None = None) -> np.ndarray:
    """H x along the last axis of ``values`` (length 2^r): int64 for integer or boolean
    input, float64 for real input (module docstring).

    ``out``, when given, receives the result: a C-contiguous array of ``values``' shape
    and of that dtype; ``out=values`` transforms in place.
    """
    array = np.asarray(values)
    if array.ndim == 0 or array.shape[-1] == 0 or array.shape[-1] & (array.shape[-1] - 1):
        raise ValueError(
            f"walsh_hadamard needs a last axis whose length is a power of two, got shape "
            f"{array.shape}"
        )
    dtype: np.dtype[Any]
    if array.dtype.kind in "biu":
        dtype = np.dtype(np.int64)
    elif array.dtype.kind == "f":
        dtype = np.dtype(np.float64)
    else:
        raise TypeError(f"walsh_hadamard transforms integers or reals, got {array.dtype}")
    if out is None:
        out = np.array(array, dtype=dtype, order="C")
    else:
        if out.dtype != dtype or out.shape != array.shape or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous {dtype} array of shape {array.shape}, got "
                f"{out.dtype} {out.shape}"
            )
        if out is not values:
            np.copyto(out, array)
    size = array.shape[-1]
    inner = min(size, _BLOCK)
    pieces = out.reshape(-1, inner)  # every row cut into blocks of ``inner`` elements
    step = max(1, min(pieces.shape[0], _BLOCK // inner))  # blocks transformed together
    scratch = np.empty(max(size, step * inner) // 2, dtype=dtype)
    for start in range(0, pieces.shape[0], step):
        _butterflies(pieces[start : start + step], 1, inner, scratch)
    if size > inner:
        for row in out.reshape(-1, size):
            _butterflies(row[None, :], inner, size, scratch)
    return out
