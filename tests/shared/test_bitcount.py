"""``shared.bitcount.bit_sums`` equals the unpack-and-sum reference bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import bitcount
from shared.bitcount import bit_sums
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec


def reference(packed: np.ndarray, bits: int) -> np.ndarray:
    return np.unpackbits(packed, axis=1, count=bits).sum(axis=0, dtype=np.int64)


def random_packed(rng: np.random.Generator, rows: int, bits: int, density: float) -> np.ndarray:
    """Rows of ``bits`` Bernoulli(density) bits in packbits layout (padding bits 0)."""
    return np.packbits(rng.random((rows, bits)) < density, axis=1)


@contextmanager
def block_bytes(size: int) -> Iterator[None]:
    """Small blocks, so that a few hundred rows already run through many counter levels."""
    saved = bitcount.BLOCK_BYTES
    bitcount.BLOCK_BYTES = size
    try:
        yield
    finally:
        bitcount.BLOCK_BYTES = saved


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 700),
    bits=st.integers(1, 200),
    density=st.sampled_from([0.0, 0.03, 0.5, 0.97, 1.0]),
    block=st.sampled_from([8, 16, 64, 1 << 16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference(rows: int, bits: int, density: float, block: int, seed: int) -> None:
    """Any rows (0, 1, not a multiple of 8 or of a block), any width (not a multiple of
    8 or 64), sparse to all-ones, and blocks from 1 word (deep carry chains) up."""
    packed = random_packed(np.random.default_rng(seed), rows, bits, density)
    with block_bytes(block):
        got = bit_sums(packed, bits)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, reference(packed, bits))


@pytest.mark.parametrize(("rows", "bits"), [(50_003, 1000), (262_147, 16), (3_001, 16_384)])
@pytest.mark.slow
def test_matches_reference_at_scale(rows: int, bits: int) -> None:
    """Default blocks, many blocks: an odd number of pairs, waiting carries and a tail."""
    packed = random_packed(np.random.default_rng([rows, bits]), rows, bits, 0.3)
    np.testing.assert_array_equal(bit_sums(packed, bits), reference(packed, bits))


def test_all_ones_counts_every_row() -> None:
    """Every lane carries at every level: the count is exactly the number of rows."""
    rows, bits = 100_001, 77
    packed = np.packbits(np.ones((rows, bits), dtype=bool), axis=1)
    np.testing.assert_array_equal(bit_sums(packed, bits), np.full(bits, rows))


def test_fewer_bits_than_row_and_non_contiguous_input() -> None:
    packed = random_packed(np.random.default_rng(7), 1_000, 96, 0.5)
    view = packed[::3, 2:10]  # strided rows, a column slice
    np.testing.assert_array_equal(bit_sums(view, 61), reference(view, 61))
    np.testing.assert_array_equal(bit_sums(packed[:0], 96), np.zeros(96, dtype=np.int64))


def test_input_is_not_modified() -> None:
    packed = random_packed(np.random.default_rng(8), 5_000, 130, 0.5)
    copy = packed.copy()
    with block_bytes(16):
        bit_sums(packed, 130)
    np.testing.assert_array_equal(packed, copy)


@pytest.mark.parametrize(
    ("packed", "bits", "message"),
    [
        (np.zeros((4, 2), dtype=np.int64), 16, "uint8"),
        (np.zeros(16, dtype=np.uint8), 16, "2-d"),
        (np.zeros((4, 2), dtype=np.uint8), 17, "bits must be in 0..16"),
        (np.zeros((4, 2), dtype=np.uint8), -1, "bits must be in 0..16"),
    ],
)
def test_bad_input_is_refused(packed: np.ndarray, bits: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bit_sums(packed, bits)


@pytest.mark.parametrize(("name", "d"), [("oue", 1024), ("sue", 13), ("oue", 100)])
def test_unary_aggregate_is_the_bit_sums(name: str, d: int) -> None:
    mechanism = make_mechanism(MechanismSpec(mechanism=name, epsilon=1.0, domain_size=d))
    rng = np.random.default_rng(11)
    reports = mechanism.encode(rng.integers(0, d, 20_011), rng)
    stats = mechanism.aggregate(reports)
    assert stats.n == 20_011
    np.testing.assert_array_equal(stats.counts, reference(reports, d))
