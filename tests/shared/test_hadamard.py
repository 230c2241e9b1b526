"""The fast Walsh-Hadamard transform (``shared.hadamard``), exactly.

* Against the Sylvester-Hadamard matrix itself (``scipy.linalg.hadamard``): int64 rows of
  every length 1..2^10, with rows transformed together; float64 the same.
* Long vectors, read as R x block matrices whose rows are transformed a block at a time
  and whose columns a slice of columns at a time: outputs against their defining sums at
  sampled points, and H H x = 2^r x exactly in int64, with blocks of 2^5 elements (R =
  4096, slices of 4 and of 32 columns) and of 2^16 (R = 2).
* dtypes, ``out`` (in place and into another array), bad input refused with a message.

No statistics: every assertion is exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import hadamard

from shared import hadamard as hadamard_module
from shared.hadamard import walsh_hadamard


@pytest.mark.parametrize("size", [1 << r for r in range(11)])
def test_rows_are_multiplied_by_the_sylvester_matrix(size: int) -> None:
    rng = np.random.default_rng(size)
    matrix = rng.integers(-1000, 1000, size=(3, 5, size))
    expected = matrix @ hadamard(size).T
    result = walsh_hadamard(matrix)
    assert result.dtype == np.int64 and result.shape == matrix.shape
    np.testing.assert_array_equal(result, expected)
    reals = rng.standard_normal((7, size))
    np.testing.assert_allclose(walsh_hadamard(reals), reals @ hadamard(size).T, atol=1e-9)


@pytest.mark.parametrize(("block", "columns"), [(1 << 5, 4), (1 << 5, 64), (1 << 16, 64)])
def test_long_vectors_are_transformed_exactly(
    block: int, columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2^17 elements: the defining sums at 40 sampled outputs, and the involution."""
    monkeypatch.setattr(hadamard_module, "_BLOCK", block)
    monkeypatch.setattr(hadamard_module, "_MIN_COLUMNS", columns)
    size = 1 << 17
    rng = np.random.default_rng(block)
    vector = rng.integers(-9, 10, size)
    transformed = walsh_hadamard(vector)
    points = rng.integers(0, size, 40)
    parity = np.bitwise_count(points[:, None] & np.arange(size)[None, :]) & 1
    signs = 1 - 2 * parity.astype(np.int64)
    np.testing.assert_array_equal(transformed[points], signs @ vector)
    np.testing.assert_array_equal(walsh_hadamard(transformed), size * vector)
    reals = vector.astype(np.float64)
    np.testing.assert_array_equal(walsh_hadamard(reals, out=reals), transformed)


def test_dtypes_and_out() -> None:
    vector = np.array([1, 0, 1, 1], dtype=np.int32)
    expected = [3, 1, -1, 1]
    assert walsh_hadamard(vector).tolist() == expected
    assert walsh_hadamard(vector).dtype == np.int64
    assert walsh_hadamard(vector.astype(bool)).tolist() == expected
    assert walsh_hadamard(np.zeros((0, 8))).shape == (0, 8)
    assert walsh_hadamard(vector.astype(np.float32)).dtype == np.float64
    target = np.zeros(4, dtype=np.int64)
    assert walsh_hadamard(vector, out=target) is target and target.tolist() == expected
    assert vector.tolist() == [1, 0, 1, 1]  # the input is left alone unless it is ``out``
    inplace = np.array([1.0, 2.0])
    assert walsh_hadamard(inplace, out=inplace) is inplace and inplace.tolist() == [3.0, -1.0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        walsh_hadamard(np.zeros(12))
    with pytest.raises(ValueError, match="power of two"):
        walsh_hadamard(np.zeros((3, 0)))
    with pytest.raises(ValueError, match="power of two"):
        walsh_hadamard(np.float64(1.0))
    with pytest.raises(TypeError, match="integers or reals"):
        walsh_hadamard(np.zeros(4, dtype=complex))
    with pytest.raises(ValueError, match="out must be"):
        walsh_hadamard(np.zeros(4), out=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="out must be"):
        walsh_hadamard(np.zeros(4), out=np.zeros(8)[::2])
