"""Stable hashes used identically on the device and on the server.

Every hash here is fixed by a standard and by the bytes it is given, never by Python's
``hash`` (salted per process) or by a library version, so a report hashed on a device
today decodes on a server years later.

* :func:`rappor_bloom_digests`: the Bloom hashes of the reference RAPPOR client,
  ``MD5(BE32(cohort) || UTF-8(value))``; byte ``i`` of the digest modulo ``k`` is the
  ``i``-th Bloom bit (Erlingsson, Pihur and Korolova, CCS 2014, and the reference
  client's ``get_bloom_bits``). MD5 serves as a fixed public hash here, not for secrecy.
* :func:`keyed_digest`: ``HMAC-SHA256(key, message)`` (RFC 2104, FIPS 180-4), the PRF
  that derives per-purpose secrets from a device secret: a metric's RAPPOR secret, a
  cohort, a permanent randomized response.
* :func:`keyed_stream`: ``SHAKE-256(HMAC-SHA256(key, message))`` truncated to the bytes
  asked for (FIPS 202), a deterministic pseudorandom stream for memoized randomness.
* :class:`SketchHash`: the k hash functions h_0..h_{k-1} of a count sketch of k rows
  and m columns (``cms``, ``hcms``, ``sfp``): one SHA-256 fingerprint per string, then
  every row's column by arithmetic in GF(2^32), so a server evaluates all k rows of a
  million strings in numpy.

Sketch hash family
------------------
For a sketch of ``k`` rows (depth) and ``m`` columns (width), 1 <= k <= 2^24 and
2 <= m <= 2^31, and a string s:

1. key ``K = "LDP sketch v1" || 0x00 || BE32(k) || BE32(m)`` (``sketch_key``: 22 bytes,
   fixed by the spec, so every device and server of a metric uses the same functions);
2. fingerprint ``D = SHA-256(K || UTF-8(s))``; ``a = BE32(D[0:4])``,
   ``b = BE32(D[4:8])``, read as elements of GF(2^32) = GF(2)[x] / (x^32 + x^7 + x^3 +
   x^2 + 1): bit i of the unsigned 32-bit integer is the coefficient of x^i (the
   polynomial is irreducible; the tests check it with Rabin's test);
3. row multipliers ``G_0, ..., G_{k-1}``: the big-endian 32-bit words of
   ``SHAKE-256(K)`` in order, a word equal to an earlier one skipped, so they are distinct
   (``SketchHash.multipliers``);
4. row j (0 <= j < k): ``x_j = a + b * G_j`` (field addition is XOR; multiplication is
   carry-less multiplication reduced by the polynomial: to multiply by x, shift left by
   one and, if bit 32 is set, clear it and XOR 0x8D);
5. ``h_j(s) = floor(x_j * m / 2^32)``, the unsigned 32-bit x_j scaled to 0..m-1
   (for m = 2^w: the top w bits of x_j).

Test vector: k = 4, m = 2048, s = "abc" gives columns (69, 1922, 1137, 1402); more in
``tests/shared/test_sketch.py``.

Why this family. Model SHA-256 and SHAKE-256 as random functions: distinct strings
s != s' have independent uniform (a, b) and (a', b'). In one row x_j is uniform (a is),
so two strings collide there with probability

    kappa = sum_c (|C_c| / 2^32)^2,   C_c = {x : floor(x m / 2^32) = c},

exactly 1/m when m is a power of two, otherwise within a relative m^2 / 2^66 of it
(``SketchHash.collision_probability`` gives it exactly). For two rows j != j', the map
(a, b) -> (x_j, x_j') is a bijection of GF(2^32)^2 (its determinant is G_j - G_j' != 0),
so x_j and x_j' are independent and uniform, and so are x_j(s), x_j'(s), x_j(s'),
x_j'(s'): the collision events [h_j(s) = h_j(s')] are pairwise independent across rows.
That is all the variance of a count-mean-sketch estimate depends on
(``shared.mechanisms.sketch``), so the estimator behaves as with k independent random
functions, at the cost of one cryptographic hash per string.

Many rows. For m = 2^w, s and s' collide in row j iff da + db G_j lies in the subspace L
of the elements whose top w bits are 0 (da = a + a', db = b + b', independent and
uniform). For db != 0 the rows they share are the j whose multiplier lies in the coset
db^-1 (da + L) of the (32 - w)-dimensional subspace db^-1 L, so rows j_1..j_r all collide
with probability m^-1 P(db D_i in L for i = 2..r), D_i = G_{j_i} - G_{j_1}: that is m^-r
when the linear map db -> (top w bits of db D_i)_i is onto, as it is for all but a few
sets of r <= 1 + 32/w random multipliers, and on average over them. Multipliers with
linear structure lose this: with G_j = j every set of shared rows is an affine subspace
of row indices, so pairs of strings sharing 4, 8, ... or all k rows abound (at k = 32,
m = 256 about 4e-4 of all pairs share 4 rows or more, against 8e-6 for independent rows,
and about one in a million shares all 32); random multipliers keep the counts binomial
(``tests/shared/test_sketch.py`` counts them).

Evaluating all rows. The top bits of b G_j are GF(2)-linear in b: they are the XOR over
the four bytes b_0..b_3 of b (b = sum_i b_i x^(8 i)) of T_j[i][b_i], T_j[i][v] the top
bits of (v x^(8 i)) G_j. ``SketchHash`` packs these tables for a group of rows into
128-bit entries, one lane of 8, 16 or 32 bits per row (16, 8 or 4 rows), so four gathers
of 16 bytes and four XORs per string give a whole group's columns. A lane holds the top
w bits of x_j for m = 2^w, with room above them for the lane's index; for other m (and
m = 2^31) it holds all 32 bits, scaled to a column afterwards. ``walk`` yields the
columns row by row; ``row_sums`` adds up a table's entries at every row's column
(sum_j A[j, h_j(s)], a sketch query): with the lane index l folded in above the column,
each group's lanes index the group's rows laid end to end (l m + h_j(s)) directly, so a
group costs those four gathers, one conversion, one gather and one add per string.
Blocks of strings are independent, so ``row_sums`` sums them on up to ``SKETCH_THREADS``
threads at once: numpy releases the GIL inside these gathers, XORs and adds. The SHA-256
fingerprints stay on the calling thread (``hashlib`` keeps the GIL for inputs this short);
``query_sums`` hashes the next block there while the threads sum the blocks before it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from functools import cached_property

import numpy as np

__all__ = [
    "GF32_REDUCTION",
    "MAX_SKETCH_DEPTH",
    "SKETCH_LABEL",
    "SKETCH_THREADS",
    "SketchHash",
    "gf32_multiply",
    "keyed_digest",
    "keyed_stream",
    "rappor_bloom_digests",
    "sketch_key",
]

#: Domain separation of the sketch hash family's key.
SKETCH_LABEL = b"LDP sketch v1\x00"
#: x^32 mod (x^32 + x^7 + x^3 + x^2 + 1): what a carry out of bit 31 is reduced to.
GF32_REDUCTION = 0x8D
#: Most rows of a sketch hash family (its multipliers are distinct 32-bit words).
MAX_SKETCH_DEPTH = 1 << 24
_LOW32 = 0xFFFF_FFFF
#: Elements multiplied together by ``gf32_multiply`` (its work arrays stay in cache).
_MULTIPLY_CHUNK = 1 << 15
#: Rows whose byte tables are built together (8 KiB of int64 per row while building),
#: rounded up to whole groups of rows.
_TABLE_ROWS = 1 << 10
#: Most 64-bit table words a ``SketchHash`` keeps built; larger families build them anew
#: on each walk, ``_TABLE_ROWS`` rows at a time.
_KEPT_TABLE_WORDS = 1 << 21
#: One table entry: a group of rows' lanes, 128 bits, gathered as one item.
_ENTRY = np.dtype("V16")
#: Strings whose row sums ``SketchHash.row_sums`` computes together (their indices, lanes
#: and partial sums take about 6 MiB).
_SUM_BLOCK = 1 << 15
#: Threads ``SketchHash.row_sums`` sums blocks of strings on unless told otherwise: one per
#: core, at most 8 (each holds a block's arrays, about 6 MiB).
SKETCH_THREADS: int = min(os.cpu_count() or 1, 8)


def rappor_bloom_digests(pairs: Iterable[tuple[int, bytes]]) -> bytes:
    """The 16-byte MD5 digests of ``BE32(cohort) || value`` for each (cohort, UTF-8 value)."""
    return b"".join(
        hashlib.md5(cohort.to_bytes(4, "big") + value).digest() for cohort, value in pairs
    )


def keyed_digest(key: bytes, message: bytes) -> bytes:
    """``HMAC-SHA256(key, message)``: 32 bytes."""
    return hmac.digest(key, message, "sha256")


def keyed_stream(key: bytes, message: bytes, size: int) -> bytes:
    """``size`` bytes of ``SHAKE-256(HMAC-SHA256(key, message))``."""
    return hashlib.shake_256(keyed_digest(key, message)).digest(size)


def sketch_key(depth: int, width: int) -> bytes:
    """``"LDP sketch v1" || 0x00 || BE32(depth) || BE32(width)``: the sketch family's key."""
    return SKETCH_LABEL + depth.to_bytes(4, "big") + width.to_bytes(4, "big")


def _times_x(values: np.ndarray) -> np.ndarray:
    """Each GF(2^32) element (int64 holding 32 bits) multiplied by x."""
    return ((values << 1) & _LOW32) ^ ((values >> 31) * GF32_REDUCTION)


def gf32_multiply(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Elementwise product in GF(2^32) of int64 arrays holding 32-bit elements (broadcast):
    shift-and-add over the 32 bits of ``right``, in place on chunks that stay in cache."""
    left, right = np.broadcast_arrays(np.asarray(left, np.int64), np.asarray(right, np.int64))
    product = np.zeros(left.shape, dtype=np.int64)
    flat_left, flat_right, flat_product = left.reshape(-1), right.reshape(-1), product.reshape(-1)
    for start in range(0, flat_left.size, _MULTIPLY_CHUNK):
        chunk = slice(start, start + _MULTIPLY_CHUNK)
        power = flat_left[chunk].copy()  # left * x^bit
        factor, out = flat_right[chunk], flat_product[chunk]
        term, carry = np.empty_like(power), np.empty_like(power)
        for bit in range(32):
            np.right_shift(factor, bit, out=term)
            np.bitwise_and(term, 1, out=term)
            np.negative(term, out=term)  # all ones where the bit is set
            np.bitwise_and(term, power, out=term)
            np.bitwise_xor(out, term, out=out)
            np.right_shift(power, 31, out=carry)
            np.multiply(carry, GF32_REDUCTION, out=carry)
            np.left_shift(power, 1, out=power)
            np.bitwise_and(power, _LOW32, out=power)
            np.bitwise_xor(power, carry, out=power)
    return product


def _distinct_words(seed: bytes, count: int) -> np.ndarray:
    """The first ``count`` distinct big-endian 32-bit words of SHAKE-256(seed), in order."""
    size = count
    while True:
        words = np.frombuffer(hashlib.shake_256(seed).digest(4 * size), dtype=">u4")
        _, first = np.unique(words, return_index=True)
        if first.size >= count:
            return words[np.sort(first)[:count]].astype(np.int64)
        size += 2 * (count - first.size) + 16


class SketchHash:
    """The k hash functions of a k x m count sketch (module docstring, "Sketch hash family")."""

    def __init__(self, depth: int, width: int) -> None:
        bounds = (("depth", depth, 1, MAX_SKETCH_DEPTH), ("width", width, 2, 1 << 31))
        for name, value, low, high in bounds:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"sketch {name} must be an int, got {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"sketch {name} must lie in {low}..{high}, got {value}")
        self.depth = depth
        self.width = width
        self.key = sketch_key(depth, width)
        #: The top bits of x_j a lane holds, and the bits of a lane (module docstring,
        #: "Evaluating all rows").
        self.kept_bits, self.lane_bits = _lane_layout(width)
        #: Lanes (rows) per group: per 128-bit table entry.
        self.lanes: int = 128 // self.lane_bits
        self._lane = np.dtype(f"u{self.lane_bits // 8}")

    @property
    def collision_probability(self) -> Fraction:
        """kappa = P(h_j(s) = h_j(s')) for distinct strings: sum_c (|C_c| / 2^32)^2, where
        the r = 2^32 mod m cells of ``floor(x m / 2^32)`` hold q + 1 values and the others q
        (q = floor(2^32 / m)); exactly 1/m for m a power of two."""
        whole, extra = divmod(1 << 32, self.width)
        cells = extra * (whole + 1) ** 2 + (self.width - extra) * whole**2
        return Fraction(cells, 1 << 64)

    @cached_property
    def multipliers(self) -> np.ndarray:
        """(k,) int64: G_0..G_{k-1}, the first k distinct big-endian 32-bit words of
        SHAKE-256(K)."""
        return _distinct_words(self.key, self.depth)

    def fingerprints(self, values: Sequence[bytes]) -> np.ndarray:
        """(n, 2) int64: (a, b) of each UTF-8 string, from ``SHA-256(key || value)``."""
        base = hashlib.sha256(self.key)

        def digest(value: bytes) -> bytes:
            state = base.copy()
            state.update(value)
            return state.digest()[:8]

        raw = b"".join([digest(value) for value in values])
        return np.frombuffer(raw, dtype=">u4").astype(np.int64).reshape(-1, 2)

    def positions(self, fingerprints: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``h_{rows[i]}(s_i)`` for each fingerprint (one row per string; int64)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.depth):
            raise ValueError(f"sketch rows must lie in 0..{self.depth - 1}")
        values = fingerprints[:, 0] ^ gf32_multiply(fingerprints[:, 1], self.multipliers[rows])
        return (values * self.width) >> 32

    def columns(self, fingerprints: np.ndarray) -> np.ndarray:
        """(k, n) int64: every row's column of every fingerprint (``walk``, collected)."""
        out = np.empty((self.depth, fingerprints.shape[0]), dtype=np.int64)
        for row, columns in enumerate(self.walk(fingerprints)):
            out[row] = columns
        return out

    def walk(self, fingerprints: np.ndarray) -> Iterator[np.ndarray]:
        """The columns of every string in rows 0, 1, ..., k - 1, one int64 array per row.

        Four gathers and four XORs per string and group of rows (module docstring,
        "Evaluating all rows"). The arrays yielded are one buffer reused: use each before
        asking for the next group's rows.
        """
        columns = np.empty((self.lanes, fingerprints.shape[0]), dtype=np.int64)
        row = 0
        for lanes in self._group_lanes(fingerprints, indexed=False):
            np.copyto(columns, lanes.T)
            if self.kept_bits == 32:  # all of x_j: scaled to 0..m-1
                columns *= self.width
                columns >>= 32
            for lane in range(min(self.lanes, self.depth - row)):
                yield columns[lane]
            row += self.lanes

    def row_sums(
        self, table: np.ndarray, fingerprints: np.ndarray, threads: int | None = None
    ) -> np.ndarray:
        """sum_j table[j, h_j(s)] for each fingerprint: int64 for an integer ``table``
        (k, m), float64 for a real one.

        The partial sums are kept in ``table``'s dtype, so it must hold
        sum_j max_c |table[j, c]| (a sketch of n reports in int32 for n < 2^31). In blocks
        of ``_SUM_BLOCK`` strings, a group of rows at a time (module docstring,
        "Evaluating all rows").

        Blocks are independent, so up to ``threads`` of them (``None``: ``SKETCH_THREADS``)
        are summed at once on a thread pool made for the call. Threads help because the
        work is numpy's gathers (``np.take``), XORs and adds on arrays of a block, and
        numpy releases the GIL inside each of them: with a block's arrays thousands of
        strings long, the threads spend almost all their time outside the GIL. Every block
        runs the same operations in the same order whichever thread runs it, so the
        result is bitwise the same for any number of threads.
        """
        blocks = (
            (start, fingerprints[start : start + _SUM_BLOCK])
            for start in range(0, fingerprints.shape[0], _SUM_BLOCK)
        )
        return self._sums(table, blocks, fingerprints.shape[0], threads)

    def query_sums(
        self, table: np.ndarray, values: Sequence[bytes], threads: int | None = None
    ) -> np.ndarray:
        """``row_sums(table, fingerprints(values), threads)``, bitwise, with the hashing
        overlapped: each block of strings is hashed on the calling thread while the pool
        sums the blocks hashed before it. SHA-256 of short strings keeps the GIL, so the
        hashing runs alongside the other threads' numpy work, not alongside more hashing."""
        blocks = (
            (start, self.fingerprints(values[start : start + _SUM_BLOCK]))
            for start in range(0, len(values), _SUM_BLOCK)
        )
        return self._sums(table, blocks, len(values), threads)

    def _sums(
        self,
        table: np.ndarray,
        blocks: Iterator[tuple[int, np.ndarray]],
        count: int,
        threads: int | None,
    ) -> np.ndarray:
        """The row sums of ``count`` strings given as (first position, fingerprints) blocks
        of ``_SUM_BLOCK`` (``row_sums``), on up to ``threads`` threads."""
        if table.shape != (self.depth, self.width):
            raise ValueError(
                f"a table of this family is ({self.depth}, {self.width}), got {table.shape}"
            )
        if threads is None:
            threads = SKETCH_THREADS
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise TypeError(f"threads must be an int, got {type(threads).__name__}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        groups = -(-self.depth // self.lanes)
        laid = np.zeros((groups * self.lanes, self.width), dtype=table.dtype)
        laid[: self.depth] = table  # the last group's missing rows add zeros
        laid = laid.reshape(groups, self.lanes * self.width)  # a group's rows end to end
        total_type = np.float64 if table.dtype.kind == "f" else np.int64
        out = np.empty(count, dtype=total_type)

        def sum_block(start: int, block: np.ndarray) -> None:
            out[start : start + block.shape[0]] = self._block_sums(laid, block, total_type)

        workers = min(threads, -(-count // _SUM_BLOCK))
        if workers <= 1:
            for start, block in blocks:
                sum_block(start, block)
            return out
        _ = self._kept_tables  # built once here, not raced for by the workers
        with ThreadPoolExecutor(max_workers=workers) as pool:
            pending = [pool.submit(sum_block, start, block) for start, block in blocks]
            for done in pending:
                done.result()  # re-raises a worker's error
        return out

    def _block_sums(self, laid: np.ndarray, block: np.ndarray, total_type: type) -> np.ndarray:
        """The row sums of one block of fingerprints: ``laid`` holds each group's rows of the
        table end to end, so a lane (row r of the group, column c) indexes r m + c."""
        index = np.empty((block.shape[0], self.lanes), dtype=np.int64)
        gathered = np.empty(index.shape, dtype=laid.dtype)
        sums = np.zeros(index.shape, dtype=laid.dtype)
        indexed = self.kept_bits < 32
        row_starts = np.arange(self.lanes) * self.width
        for rows, lanes in zip(laid, self._group_lanes(block, indexed), strict=True):
            np.copyto(index, lanes)
            if not indexed:  # all of x_j: scaled to a column, then the row's start
                index *= self.width
                index >>= 32
                index += row_starts
            np.take(rows, index, out=gathered, mode="wrap")  # in range: never wraps
            sums += gathered
        return sums.sum(axis=1, dtype=total_type)

    def _group_lanes(self, fingerprints: np.ndarray, indexed: bool) -> Iterator[np.ndarray]:
        """Each group's (n, lanes) lanes in order: lane r of string i holds the kept top bits
        of x_j, j the group's row r, plus r m when ``indexed`` (which needs kept_bits < 32).
        The arrays yielded are one buffer reused."""
        n = fingerprints.shape[0]
        b = fingerprints[:, 1]
        chunks = [(b >> (8 * byte)) & 0xFF for byte in range(4)]
        top = np.empty((n, self.lanes), dtype=self._lane)
        top[:] = (fingerprints[:, 0] >> (32 - self.kept_bits)).astype(self._lane)[:, None]
        if indexed:
            top += np.arange(self.lanes, dtype=self._lane) * self._lane.type(self.width)
        top_words = top.view(np.uint64)  # the same bits as (n, 2) words, for the XORs
        entries, scratch = np.empty(n, dtype=_ENTRY), np.empty(n, dtype=_ENTRY)
        words = entries.view(np.uint64).reshape(n, 2)
        scratch_words = scratch.view(np.uint64).reshape(n, 2)
        lanes = entries.view(self._lane).reshape(n, self.lanes)
        for tables in self._group_tables():
            np.take(tables[0], chunks[0], out=entries, mode="wrap")  # bytes: never wrap
            for byte in range(1, 4):
                np.take(tables[byte], chunks[byte], out=scratch, mode="wrap")
                np.bitwise_xor(words, scratch_words, out=words)
            np.bitwise_xor(words, top_words, out=words)
            yield lanes

    def _group_tables(self) -> Iterator[np.ndarray]:
        """The (4, 256) byte tables of each group of ``lanes`` rows, in order."""
        if self._kept_tables is not None:
            yield from self._kept_tables
            return
        for start, stop in self._table_batches():
            yield from self._build_tables(start, stop)

    def _table_batches(self) -> list[tuple[int, int]]:
        """Rows [start, stop) whose tables are built together: about ``_TABLE_ROWS``, whole
        groups."""
        step = -(-_TABLE_ROWS // self.lanes) * self.lanes
        return [(start, min(start + step, self.depth)) for start in range(0, self.depth, step)]

    @cached_property
    def _kept_tables(self) -> np.ndarray | None:
        """All groups' byte tables when they take at most ``_KEPT_TABLE_WORDS`` words."""
        groups = -(-self.depth // self.lanes)
        if groups * 4 * 256 * 2 > _KEPT_TABLE_WORDS:
            return None
        return np.concatenate([self._build_tables(*rows) for rows in self._table_batches()])

    def _build_tables(self, start: int, stop: int) -> np.ndarray:
        """(groups, 4, 256) entries for rows start..stop - 1 (start a multiple of ``lanes``):
        lane r of entry [g, i, v] holds the top ``kept_bits`` bits of (v x^(8 i)) G_j,
        j = start + g lanes + r (rows past ``stop``: 0)."""
        groups = -(-(stop - start) // self.lanes)
        multipliers = np.zeros(groups * self.lanes, dtype=np.int64)
        multipliers[: stop - start] = self.multipliers[start:stop]
        tables = np.zeros((4, 256, multipliers.size), dtype=np.int64)
        power = multipliers  # G_j x^(8 i + t)
        for byte in range(4):
            for bit in range(8):  # entries v < 2^(bit + 1) from those below 2^bit
                tables[byte, 1 << bit : 2 << bit] = tables[byte, : 1 << bit] ^ power
                power = _times_x(power)
        tables >>= 32 - self.kept_bits
        lanes = tables.astype(self._lane).reshape(4, 256, groups, self.lanes)
        return np.ascontiguousarray(lanes.transpose(2, 0, 1, 3)).view(_ENTRY)[..., 0]


def _lane_layout(width: int) -> tuple[int, int]:
    """(kept bits, lane bits): for m = 2^w, the narrowest lane of 8, 16 or 32 bits with room
    for w bits and the index of a lane among 128 / lane bits; else (32, 32)."""
    if width & (width - 1) == 0:
        kept = width.bit_length() - 1
        for lane_bits in (8, 16, 32):
            if kept + (128 // lane_bits).bit_length() - 1 <= lane_bits:
                return kept, lane_bits
    return 32, 32
