"""The fast Walsh-Hadamard transform.

For a vector x of length 2^r, the Sylvester-Hadamard transform is

    (H x)[u] = sum_v x[v] (-1)^popcount(u & v),

H the 2^r x 2^r matrix with H_1 = [1] and H_2n = [[H_n, H_n], [H_n, -H_n]], so H H = 2^r I.
It factors into r butterfly passes, one per bit of the index: pass t (half = 2^t) replaces
each pair (x[i], x[i + half]), i with bit t clear, by (x[i] + x[i + half], x[i] - x[i +
half]); O(r 2^r) additions, in any order of the passes. Hadamard response aggregates
through it (``shared.mechanisms.hr``), the Hadamard count mean sketch transforms its rows
back (``shared.mechanisms.sketch``), and SFP decodes all 2^24 fragment keys of a position
at once (``shared.mechanisms.sfp``).

``walsh_hadamard`` transforms along the last axis, exactly in int64 (the sums of counts
stay far below 2^63) or in float64. Every pass runs on a buffer of at most ``_BLOCK``
elements that stays in cache, reading one buffer and writing the other (two operations
per pair), and always on contiguous runs of many elements, so numpy's vector loops do
the work:

* a vector of L <= ``_BLOCK`` elements (several at once when they are short) is read as
  an A x B matrix, A B = L: the passes of the high index bits run down its columns
  (runs of B elements), then the matrix is transposed and those of the low bits run down
  the other way (runs of A), and it is transposed back;
* a longer vector is read as an R x ``_BLOCK`` matrix: each row is transformed as above,
  then the passes of the high bits run down the columns, a slice of columns copied into
  the buffer at a time. Each element crosses memory twice, not once per pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["walsh_hadamard"]

#: Elements transformed together (512 KiB of float64 or int64; with the second buffer they
#: fill a core's L2 cache, and each numpy call has many elements to amortize its cost).
_BLOCK = 1 << 16
#: Fewest columns copied together by the passes down the columns of a long vector.
_MIN_COLUMNS = 64


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
    vectors = out.reshape(-1, size)
    if size <= _BLOCK:
        _transform_rows(vectors, dtype)
    else:
        for vector in vectors:
            matrix = vector.reshape(size // _BLOCK, _BLOCK)
            _transform_rows(matrix, dtype)
            _transform_columns(matrix, dtype)
    return out


def _transform_rows(matrix: np.ndarray, dtype: np.dtype[Any]) -> None:
    """Each row of a C-contiguous (rows, L) matrix, L <= ``_BLOCK``, transformed in place,
    as many rows at a time as fill a block (module docstring)."""
    rows, length = matrix.shape
    bits = length.bit_length() - 1
    low = 1 << (bits // 2)  # B: the low index bits
    high = length // low  # A: the high index bits
    group = max(1, _BLOCK // length)
    first, second = np.empty(group * length, dtype), np.empty(group * length, dtype)
    for start in range(0, rows, group):
        block = matrix[start : start + group]
        size = block.size
        source, spare = first[:size], second[:size]
        np.copyto(source.reshape(block.shape), block)
        source, spare = _passes(source, spare, high, low)  # high bits, runs of B
        np.copyto(spare.reshape(-1, low, high), source.reshape(-1, high, low).transpose(0, 2, 1))
        source, spare = _passes(spare, source, low, high)  # low bits, runs of A
        np.copyto(block.reshape(-1, high, low), source.reshape(-1, low, high).transpose(0, 2, 1))


def _transform_columns(matrix: np.ndarray, dtype: np.dtype[Any]) -> None:
    """The passes down the columns of a C-contiguous (R, ``_BLOCK``) matrix, in place, a
    slice of columns copied into a buffer at a time."""
    rows, columns = matrix.shape
    width = min(columns, max(_MIN_COLUMNS, _BLOCK // rows))
    first, second = np.empty(rows * width, dtype), np.empty(rows * width, dtype)
    for start in range(0, columns, width):
        np.copyto(first.reshape(rows, width), matrix[:, start : start + width])
        source, _ = _passes(first, second, rows, width)
        np.copyto(matrix[:, start : start + width], source.reshape(rows, width))


def _passes(
    source: np.ndarray, spare: np.ndarray, length: int, run: int
) -> tuple[np.ndarray, np.ndarray]:
    """The butterfly passes of an axis of ``length`` elements spaced ``run`` apart, in a
    flat buffer of whole (length x run) blocks: each pass reads one buffer and writes the
    other. Returns (the buffer holding the result, the other)."""
    half = 1
    while half < length:
        pairs = source.reshape(-1, 2, half * run)
        into = spare.reshape(-1, 2, half * run)
        np.add(pairs[:, 0], pairs[:, 1], out=into[:, 0])
        np.subtract(pairs[:, 0], pairs[:, 1], out=into[:, 1])
        source, spare = spare, source
        half *= 2
    return source, spare
