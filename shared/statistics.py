"""Mergeable sufficient statistics: what the server keeps instead of reports.

Both kinds merge by addition (associative and commutative; equal to aggregating
the union of the reports) and serialize to a compact byte string:

* ``CountStatistics``: ``n`` reports and a non-negative integer count vector (support
  counts, bit sums or an output histogram, as the mechanism defines), held dense or
  sparse and written in whichever of two formats is smaller (see ``to_bytes``).
* ``MomentStatistics``: ``n`` reports and the sum and sum of squares of their
  debiased values.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_COUNT_MAGIC = b"LDPC1"
_SPARSE_MAGIC = b"LDPS1"
_MOMENT_MAGIC = b"LDPM1"
#: Dense: magic, then n and length (int64), then ``length`` int64 counts.
_DENSE_HEADER = len(_COUNT_MAGIC) + 16
#: Sparse: magic, then n, length and the number of nonzero entries (int64), then
#: ``nnz`` uint32 indices (strictly increasing), then their ``nnz`` int64 counts.
_SPARSE_HEADER = len(_SPARSE_MAGIC) + 24
_SPARSE_ENTRY = 4 + 8
_MAX_SPARSE_LENGTH = 1 << 32  # indices are uint32


def _integer_vector(values: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be a one-dimensional integer array")
    return array


class CountStatistics:
    """``n`` reports summarized by a non-negative int64 count vector of fixed ``length``.

    The vector is held dense (``CountStatistics(n, counts)``) or sparse
    (``CountStatistics.sparse(n, length, indices, values)``: the nonzero entries only),
    so statistics of a few reports over a long vector (a RAPPOR table of up to 2^22
    cells) cost memory in proportion to the entries the reports touched. ``counts`` is
    always the dense vector (built on first use when the statistics are sparse); the
    two forms of equal vectors are equal and write the same bytes. Immutable.
    """

    __slots__ = ("_n", "_length", "_dense", "_indices", "_values")

    _n: int
    _length: int
    _dense: np.ndarray | None
    _indices: np.ndarray | None
    _values: np.ndarray | None

    def __init__(self, n: int, counts: np.ndarray) -> None:
        counts = _integer_vector(counts, "counts")
        if n < 0 or np.any(counts < 0):
            raise ValueError("n and counts must be non-negative")
        dense = counts.astype(np.int64, copy=True)
        dense.flags.writeable = False
        self._set(int(n), dense.size, dense, None, None)

    def _set(
        self,
        n: int,
        length: int,
        dense: np.ndarray | None,
        indices: np.ndarray | None,
        values: np.ndarray | None,
    ) -> None:
        object.__setattr__(self, "_n", n)
        object.__setattr__(self, "_length", length)
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "_indices", indices)
        object.__setattr__(self, "_values", values)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CountStatistics is immutable")

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        """Pickle (e.g. to Dask workers) as the compact bytes of ``to_bytes``."""
        return CountStatistics.from_bytes, (self.to_bytes(),)

    @classmethod
    def sparse(
        cls, n: int, length: int, indices: np.ndarray, values: np.ndarray
    ) -> CountStatistics:
        """Counts that are ``values`` at the strictly increasing ``indices`` and 0 elsewhere.

        Zero values are dropped; an index out of ``0..length-1``, a repeated or unsorted
        index, or a negative value is refused.
        """
        indices = _integer_vector(indices, "indices").astype(np.int64)
        values = _integer_vector(values, "values").astype(np.int64)
        if indices.size != values.size:
            raise ValueError(f"{indices.size} indices but {values.size} values")
        if n < 0 or length < 0 or np.any(values < 0):
            raise ValueError("n, length and counts must be non-negative")
        if indices.size and (indices[0] < 0 or indices[-1] >= length):
            raise ValueError(f"an index is outside 0..{length - 1}")
        if np.any(np.diff(indices) <= 0):
            raise ValueError("indices must be strictly increasing")
        keep = values != 0
        indices, values = indices[keep], values[keep]
        indices.flags.writeable = False
        values.flags.writeable = False
        stats = cls.__new__(cls)
        stats._set(int(n), int(length), None, indices, values)
        return stats

    @classmethod
    def of_rows(cls, n: Sequence[int], counts: np.ndarray) -> list[CountStatistics]:
        """``CountStatistics(n[i], counts[i])`` for every row of a (r, length) count matrix,
        checked and copied once for all rows (each holds a read-only view of the copy)."""
        matrix = np.array(counts, dtype=np.int64)  # a copy
        if matrix.ndim != 2 or matrix.shape[0] != len(n):
            raise ValueError(f"need one count row per n, got {matrix.shape} for {len(n)}")
        if any(size < 0 for size in n) or np.any(matrix < 0):
            raise ValueError("n and counts must be non-negative")
        matrix.flags.writeable = False
        rows = []
        for size, row in zip(n, matrix, strict=True):
            stats = cls.__new__(cls)
            stats._set(int(size), matrix.shape[1], row, None, None)
            rows.append(stats)
        return rows

    @classmethod
    def empty(cls, length: int) -> CountStatistics:
        """Zero reports: all counts 0 (held sparse, so it costs no memory of ``length``)."""
        return cls.sparse(0, length, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    @property
    def n(self) -> int:
        return self._n

    @property
    def length(self) -> int:
        return self._length

    @property
    def counts(self) -> np.ndarray:
        """The dense int64 count vector (read-only)."""
        if self._dense is None:
            assert self._indices is not None and self._values is not None
            dense = np.zeros(self._length, dtype=np.int64)
            dense[self._indices] = self._values
            dense.flags.writeable = False
            object.__setattr__(self, "_dense", dense)
            return dense
        return self._dense

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """The indices (increasing) and values of the nonzero counts."""
        if self._indices is not None and self._values is not None:
            return self._indices, self._values
        indices = np.flatnonzero(self.counts)
        return indices, self.counts[indices]

    def merge(self, other: CountStatistics) -> CountStatistics:
        """Entrywise sum; sparse when both are sparse (O(nnz log nnz)), else dense."""
        if not isinstance(other, CountStatistics) or other.length != self.length:
            raise ValueError("can only merge CountStatistics with counts of the same length")
        if self._dense is not None or other._dense is not None:
            return self.merge_many([other])
        left, right = self.nonzero(), other.nonzero()
        indices = np.concatenate([left[0], right[0]])
        values = np.concatenate([left[1], right[1]])
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        starts = np.flatnonzero(np.diff(indices, prepend=-1))
        summed = np.add.reduceat(values, starts) if values.size else values
        return CountStatistics.sparse(self.n + other.n, self.length, indices[starts], summed)

    def merge_many(self, parts: Iterable[CountStatistics]) -> CountStatistics:
        """The sum of ``self`` and every part, into one dense vector (dense result).

        One int64 accumulator of ``length`` entries: a dense part is added in place, a
        sparse part scattered into it (``acc[indices] += values``; its indices are
        distinct, so the fancy-indexed add is exact). Memory: one vector whatever the
        number of parts; time O(length + total nonzero entries of sparse parts).
        """
        total = np.zeros(self.length, dtype=np.int64)
        n = 0
        for part in itertools.chain([self], parts):  # parts are read one at a time
            if not isinstance(part, CountStatistics) or part.length != self.length:
                raise ValueError("can only merge CountStatistics with counts of the same length")
            if part._dense is not None:
                total += part._dense
            else:
                indices, values = part.nonzero()
                total[indices] += values
            n += part.n
        total.flags.writeable = False  # a sum of non-negative counts: valid as it stands
        merged = CountStatistics.__new__(CountStatistics)
        merged._set(n, self.length, total, None, None)
        return merged

    def __add__(self, other: CountStatistics) -> CountStatistics:
        return self.merge(other)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CountStatistics):
            return NotImplemented
        if self.n != other.n or self.length != other.length:
            return False
        if self._dense is not None and other._dense is not None:
            return bool(np.array_equal(self._dense, other._dense))
        (i, v), (j, w) = self.nonzero(), other.nonzero()
        return bool(np.array_equal(i, j) and np.array_equal(v, w))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        indices, _ = self.nonzero()
        return f"CountStatistics(n={self.n}, length={self.length}, nonzero={indices.size})"

    def to_bytes(self) -> bytes:
        """The smaller of the dense and the sparse format (the dense one when equal).

        Dense: 21 + 8 * length bytes. Sparse: 29 + 12 * nnz bytes, where nnz is the number
        of nonzero counts. Statistics of r reports of which each touches at most b counts
        have nnz <= r * b, so their bytes are at most 29 + 12 r b whatever the length.
        Sparse indices rather than general compression (zlib of the dense vector): its
        cost is O(nnz) to write and read instead of O(length), it needs no
        decompression-bomb guard, and on a 2^22-cell RAPPOR table with one report it is
        about 24 KiB against zlib's 32+ KiB (a run of zeros compresses at most ~1000:1).
        """
        indices, values = self.nonzero()
        sparse_size = _SPARSE_HEADER + _SPARSE_ENTRY * indices.size
        if sparse_size < _DENSE_HEADER + 8 * self.length and self.length <= _MAX_SPARSE_LENGTH:
            header = _SPARSE_MAGIC + struct.pack("<qqq", self.n, self.length, indices.size)
            return header + indices.astype("<u4").tobytes() + values.astype("<i8").tobytes()
        header = _COUNT_MAGIC + struct.pack("<qq", self.n, self.length)
        return header + self.counts.astype("<i8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> CountStatistics:
        """Read either format (``to_bytes``); refuse truncated, padded or corrupt bytes."""
        if data.startswith(_SPARSE_MAGIC) and len(data) >= _SPARSE_HEADER:
            n, length, nnz = struct.unpack("<qqq", data[len(_SPARSE_MAGIC) : _SPARSE_HEADER])
            if not 0 <= nnz <= length <= _MAX_SPARSE_LENGTH:
                raise ValueError("serialized CountStatistics has an impossible size")
            if len(data) != _SPARSE_HEADER + _SPARSE_ENTRY * nnz:
                raise ValueError("serialized CountStatistics has the wrong length")
            indices = np.frombuffer(data, dtype="<u4", count=nnz, offset=_SPARSE_HEADER)
            values = np.frombuffer(data, dtype="<i8", count=nnz, offset=_SPARSE_HEADER + 4 * nnz)
            return cls.sparse(n, length, indices.astype(np.int64), values.astype(np.int64))
        if not data.startswith(_COUNT_MAGIC) or len(data) < _DENSE_HEADER:
            raise ValueError("not a serialized CountStatistics")
        n, length = struct.unpack("<qq", data[len(_COUNT_MAGIC) : _DENSE_HEADER])
        if length < 0 or len(data) != _DENSE_HEADER + 8 * length:
            raise ValueError("serialized CountStatistics has the wrong length")
        return cls(n, np.frombuffer(data, dtype="<i8", offset=_DENSE_HEADER).astype(np.int64))


def read_dense_rows(data: Sequence[bytes], length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The report counts (int64, shape (r,)) and count vectors (int64, shape (r, length)) of
    serialized ``CountStatistics`` that are all in the dense format of ``length`` counts,
    read by one ``np.frombuffer`` over their concatenation; None when any one is not (read
    those one by one with ``from_bytes``). A row whose header is corrupt is refused."""
    size = _DENSE_HEADER + 8 * length
    if not data or any(len(item) != size for item in data):
        return None
    layout = np.dtype(
        [
            ("magic", f"S{len(_COUNT_MAGIC)}"),
            ("n", "<i8"),
            ("length", "<i8"),
            ("counts", "<i8", (length,)),
        ]
    )
    rows = np.frombuffer(b"".join(data), dtype=layout)
    if not (np.all(rows["magic"] == _COUNT_MAGIC) and np.all(rows["length"] == length)):
        return None
    n, counts = rows["n"].astype(np.int64), rows["counts"].astype(np.int64).reshape(-1, length)
    if np.any(n < 0) or np.any(counts < 0):
        raise ValueError("serialized CountStatistics hold negative counts")
    return n, counts


@dataclass(frozen=True)
class MomentStatistics:
    """``n`` debiased values summarized by their sum and sum of squares."""

    n: int
    total: float
    total_squares: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.total) and math.isfinite(self.total_squares)):
            raise ValueError("total and total_squares must be finite")
        if self.n < 0 or self.total_squares < 0:
            raise ValueError("n and total_squares must be non-negative")
        object.__setattr__(self, "n", int(self.n))
        object.__setattr__(self, "total", float(self.total))
        object.__setattr__(self, "total_squares", float(self.total_squares))

    @classmethod
    def empty(cls) -> MomentStatistics:
        return cls(0, 0.0, 0.0)

    @classmethod
    def of(cls, values: np.ndarray) -> MomentStatistics:
        values = np.asarray(values, dtype=np.float64)
        return cls(values.size, float(values.sum()), float(np.dot(values, values)))

    def merge(self, other: MomentStatistics) -> MomentStatistics:
        if not isinstance(other, MomentStatistics):
            raise ValueError("can only merge MomentStatistics with MomentStatistics")
        return MomentStatistics(
            self.n + other.n, self.total + other.total, self.total_squares + other.total_squares
        )

    def merge_many(self, parts: Iterable[MomentStatistics]) -> MomentStatistics:
        """``self`` merged with every part, in order."""
        total = self
        for part in parts:
            total = total.merge(part)
        return total

    def __add__(self, other: MomentStatistics) -> MomentStatistics:
        return self.merge(other)

    def to_bytes(self) -> bytes:
        return _MOMENT_MAGIC + struct.pack("<qdd", self.n, self.total, self.total_squares)

    @classmethod
    def from_bytes(cls, data: bytes) -> MomentStatistics:
        if len(data) != len(_MOMENT_MAGIC) + 24 or not data.startswith(_MOMENT_MAGIC):
            raise ValueError("not a serialized MomentStatistics")
        n, total, squares = struct.unpack("<qdd", data[len(_MOMENT_MAGIC) :])
        return cls(n, total, squares)


Statistics = CountStatistics | MomentStatistics
