"""Mergeable sufficient statistics: what the server keeps instead of reports.

Both kinds merge by addition (associative and commutative; equal to aggregating
the union of the reports) and serialize to a compact byte string:

* ``CountStatistics``: ``n`` reports and an integer count vector (support counts,
  bit sums or an output histogram, as the mechanism defines).
* ``MomentStatistics``: ``n`` reports and the sum and sum of squares of their
  debiased values.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

_COUNT_MAGIC = b"LDPC1"
_MOMENT_MAGIC = b"LDPM1"


@dataclass(frozen=True, eq=False)
class CountStatistics:
    """``n`` reports summarized by an int64 count vector."""

    n: int
    counts: np.ndarray

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError("counts must be a one-dimensional integer array")
        if self.n < 0 or np.any(counts < 0):
            raise ValueError("n and counts must be non-negative")
        counts = counts.astype(np.int64, copy=True)
        counts.flags.writeable = False
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "n", int(self.n))

    @classmethod
    def empty(cls, length: int) -> CountStatistics:
        return cls(0, np.zeros(length, dtype=np.int64))

    def merge(self, other: CountStatistics) -> CountStatistics:
        if not isinstance(other, CountStatistics) or other.counts.shape != self.counts.shape:
            raise ValueError("can only merge CountStatistics with counts of the same length")
        return CountStatistics(self.n + other.n, self.counts + other.counts)

    def __add__(self, other: CountStatistics) -> CountStatistics:
        return self.merge(other)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CountStatistics)
            and self.n == other.n
            and np.array_equal(self.counts, other.counts)
        )

    def to_bytes(self) -> bytes:
        header = _COUNT_MAGIC + struct.pack("<qq", self.n, self.counts.size)
        return header + self.counts.astype("<i8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> CountStatistics:
        size = len(_COUNT_MAGIC) + 16
        if len(data) < size or not data.startswith(_COUNT_MAGIC):
            raise ValueError("not a serialized CountStatistics")
        n, length = struct.unpack("<qq", data[len(_COUNT_MAGIC) : size])
        if len(data) != size + 8 * length:
            raise ValueError("serialized CountStatistics has the wrong length")
        return cls(n, np.frombuffer(data, dtype="<i8", offset=size).astype(np.int64))


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
