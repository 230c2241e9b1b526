"""Column sums of packed bit matrices: the sufficient statistics of bit-vector reports.

``bit_sums(packed, bits)`` equals ``np.unpackbits(packed, axis=1, count=bits).sum(axis=0)``
exactly, without unpacking every bit (8 bytes of work per byte of input).

Layout. Eight consecutive rows of ``row_bytes`` bytes are 8 * row_bytes bytes, i.e.
``row_bytes`` 64-bit words, so the (rows, row_bytes) matrix is viewed, without a
copy, as a (rows // 8, row_bytes) matrix of words in which each bit position is one
column of one of the eight rows; the 64 * row_bytes position sums fold back to the
8 * row_bytes columns at the end. The last ``rows % 8`` rows are unpacked directly.

Counting. Each bit position of a word is a 1-bit lane, so bitwise operations on
whole arrays of words add all lanes at once (bit slicing; Harley and Seal's
carry-save popcount, Warren, *Hacker's Delight*, 2nd ed., section 5-1, applied
per lane as in Klarqvist and Lemire's positional popcount). A carry-save adder
(CSA) takes three numbers of equal weight, a, x, y, to a sum and a carry,

    sum = a ^ x ^ y,    carry = (a & x) | ((a ^ x) & y)    (the majority),

in five word operations. Rows are taken in blocks of B rows; a counter keeps, per
lane, bit planes P_k of weight 2^k. Each pair of input blocks goes through one CSA
into P_0; its carry (weight 2) waits for a second carry and the two go through a
CSA into P_1, and so on, like a binary counter, so the amortized cost is 5/2 + 5/4
+ ... = 5 word operations per input word, read once from memory. At the end the
planes (and the carries still waiting) are stacked and each is summed over its B
rows by a halving tree of ripple adders, and ``sum_k 2^k colsum(P_k)`` is the
answer. Blocks are at most ``BLOCK_BYTES`` (cache-sized and below the allocator's
mmap threshold, so buffers are reused without page faults).

Memory: besides the input (copied only if not C-contiguous) the counter holds at
most 3 (log2(rows / (8 B)) + 2) buffers of B * row_bytes words, each at most
``BLOCK_BYTES``: under 6 MiB for any rows < 2^32, and a 2-block padded tail.
"""

from __future__ import annotations

import numpy as np

#: Bytes of one block of rows (a power of two): 64 KiB stays in cache and is reused by malloc.
BLOCK_BYTES = 1 << 16


def bit_sums(packed: np.ndarray, bits: int) -> np.ndarray:
    """Column sums (int64) of the first ``bits`` columns of a packed bit matrix.

    ``packed`` is a (rows, row_bytes) uint8 matrix in ``np.packbits`` layout (column c is
    bit 7 - c % 8 of byte c // 8); the result equals
    ``np.unpackbits(packed, axis=1, count=bits).sum(axis=0)``.
    """
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise ValueError(f"expected a 2-d uint8 matrix, got {packed.ndim}-d {packed.dtype}")
    rows, row_bytes = packed.shape
    if not 0 <= bits <= 8 * row_bytes:
        raise ValueError(f"bits must be in 0..{8 * row_bytes} for rows of {row_bytes} bytes")
    packed = np.ascontiguousarray(packed)
    groups = rows // 8
    sums = np.unpackbits(packed[groups * 8 :], axis=1).sum(axis=0, dtype=np.int64)
    if groups and row_bytes:
        words = packed[: groups * 8].reshape(groups, 8 * row_bytes).view(np.uint64)
        sums += _lane_sums(words).reshape(8, 8 * row_bytes).sum(axis=0)
    return sums[:bits]


def _lane_sums(words: np.ndarray) -> np.ndarray:
    """Per bit lane, the number of rows of ``words`` (m >= 1, width W) with that bit set.

    Returned in the byte order of a row of words: lane sums for the bits of
    ``words[0].view(np.uint8)``, most significant bit of each byte first.
    """
    rows, width = words.shape
    block = _block_rows(rows, width)
    counter = _CarrySaveCounter(block, width)
    paired = rows // (2 * block) * 2 * block
    for start in range(0, paired, 2 * block):
        middle = start + block
        counter.add_pair(words[start:middle], words[middle : middle + block])
    if paired < rows:
        tail = np.zeros((2 * block, width), dtype=np.uint64)
        tail[: rows - paired] = words[paired:]
        counter.add_pair(tail[:block], tail[block:])
    weights, planes = counter.weighted_planes()
    return weights @ _stacked_sums(np.stack(planes, axis=1))


def _block_rows(rows: int, width: int) -> int:
    """B: a power of two with B * width * 8 <= ``BLOCK_BYTES`` (at least 1), and no more
    than two blocks' worth of padding for a small input (B < rows unless rows <= 2)."""
    cap = max(1, BLOCK_BYTES // (8 * width))
    cap = 1 << (cap.bit_length() - 1)
    half = max(1, (rows + 1) // 2)
    return min(cap, 1 << (half - 1).bit_length())


def _carry_save(
    acc: np.ndarray, x: np.ndarray, y: np.ndarray, scratch: np.ndarray, carry: np.ndarray
) -> None:
    """In place: acc <- acc ^ x ^ y and carry <- majority(acc, x, y). ``carry`` and
    ``scratch`` must not alias the inputs."""
    np.bitwise_xor(acc, x, out=scratch)
    np.bitwise_and(acc, x, out=carry)
    np.bitwise_xor(scratch, y, out=acc)
    np.bitwise_and(scratch, y, out=scratch)
    np.bitwise_or(carry, scratch, out=carry)


class _CarrySaveCounter:
    """Per-lane binary counter of (block, width) word arrays added two at a time.

    ``planes[k]`` holds bit k of each lane's count; ``waiting[k]`` is a carry of
    weight 2^k not yet added into ``planes[k]`` (it is added together with the next
    one). Counted value per lane: sum_k 2^k (planes[k] + waiting[k]).
    """

    def __init__(self, block: int, width: int) -> None:
        self.shape = (block, width)
        self.planes: list[np.ndarray] = [np.zeros(self.shape, dtype=np.uint64)]
        self.waiting: list[np.ndarray | None] = [None]
        self.scratch = np.empty(self.shape, dtype=np.uint64)
        self.free: list[np.ndarray] = []

    def _buffer(self) -> np.ndarray:
        return self.free.pop() if self.free else np.empty(self.shape, dtype=np.uint64)

    def add_pair(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add two blocks: one CSA into plane 0, then carries up like a binary counter."""
        carry = self._buffer()
        _carry_save(self.planes[0], x, y, self.scratch, carry)
        level = 1
        while level < len(self.planes):
            waiting = self.waiting[level]
            if waiting is None:
                self.waiting[level] = carry
                return
            higher = self._buffer()
            _carry_save(self.planes[level], waiting, carry, self.scratch, higher)
            self.free += [waiting, carry]
            self.waiting[level] = None
            carry = higher
            level += 1
        self.planes.append(carry)
        self.waiting.append(None)

    def weighted_planes(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """(weights 2^k as int64, planes): the count is sum_i weights[i] * planes[i]."""
        weights = [1 << k for k in range(len(self.planes))]
        planes = list(self.planes)
        for k, waiting in enumerate(self.waiting):
            if waiting is not None:
                weights.append(1 << k)
                planes.append(waiting)
        return np.array(weights, dtype=np.int64), planes


def _stacked_sums(stack: np.ndarray) -> np.ndarray:
    """Column sums over axis 0 of a (B, P, W) uint64 stack (B a power of two), as (P, 64 W).

    A halving tree, in place: the top half of the rows is added to the bottom half
    with a ripple-carry adder (bit planes of the partial sums, one more per level),
    so after log2(B) levels one row of log2(B) + 1 planes holds each count.
    """
    planes = [stack]
    while planes[0].shape[0] > 1:
        half = planes[0].shape[0] // 2
        low, high = planes[0][:half], planes[0][half:]
        carry = np.bitwise_and(low, high)
        np.bitwise_xor(low, high, out=low)
        summed = [low]
        scratch, spare = np.empty_like(carry), np.empty_like(carry)
        for plane in planes[1:]:
            low = plane[:half]
            _carry_save(low, plane[half:], carry, scratch, spare)
            carry, spare = spare, carry
            summed.append(low)
        summed.append(carry)
        planes = summed
    counts = np.zeros((stack.shape[1], 64 * stack.shape[2]), dtype=np.int64)
    for weight, plane in enumerate(planes):
        counts += np.unpackbits(plane[0].view(np.uint8), axis=1).astype(np.int64) << weight
    return counts
