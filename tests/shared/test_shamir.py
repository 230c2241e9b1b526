"""Shamir sharing over F_(2^521 - 1): any t shares rebuild the secret, fewer do not, and
one share of a fixed secret is uniform (chi-square at ALPHA = 1e-6)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from scipy import stats

from shared.federated.shamir import PRIME, SHARE_BYTES, _batch_inverse, combine, split

ALPHA = 1e-6


def test_the_field_is_the_mersenne_prime_2_521_minus_1() -> None:
    assert PRIME == 2**521 - 1 and SHARE_BYTES == 66
    assert pow(3, PRIME - 1, PRIME) == 1  # Fermat: consistent with primality


@pytest.mark.parametrize(("threshold", "holders"), [(1, 3), (2, 3), (4, 7), (11, 20)])
def test_any_t_shares_rebuild_the_secret(threshold: int, holders: int) -> None:
    secret = os.urandom(32)
    points = [3 * i + 5 for i in range(holders)]  # any distinct nonzero points
    shares = dict(zip(points, split(secret, threshold, points), strict=True))
    assert all(len(s) == SHARE_BYTES for s in shares.values())
    rng = np.random.default_rng(threshold)
    subsets = [list(c) for c in itertools.islice(itertools.combinations(points, threshold), 20)]
    subsets += [rng.choice(points, threshold, replace=False).tolist() for _ in range(20)]
    for subset in subsets:
        assert combine({x: shares[x] for x in subset}, 32) == secret


def test_threshold_one_hands_out_the_secret() -> None:
    secret = os.urandom(32)
    assert {int.from_bytes(s, "big") for s in split(secret, 1, [1, 2, 3])} == {
        int.from_bytes(secret, "big")
    }


def test_fewer_than_t_shares_interpolate_something_else() -> None:
    """t - 1 shares define a polynomial of degree t - 2 whose value at 0 is uniform in F_p
    given the secret: it fits 32 bytes with probability 2^256 / p < 2^-264."""
    secret = os.urandom(32)
    points = list(range(1, 11))
    shares = dict(zip(points, split(secret, 6, points), strict=True))
    with pytest.raises(ValueError, match="do not rebuild a secret of 32 bytes"):
        combine({x: shares[x] for x in points[:5]}, 32)


def test_one_share_of_a_fixed_secret_is_uniform() -> None:
    """25,600 sharings of one secret (t = 2): the share at point 7 is f(7) = s + 7 a with
    a uniform on F_p, so uniform; its low byte is uniform on 256 values up to 256 / p.
    Chi-square at ALPHA."""
    secret = bytes(32)
    low = [split(secret, 2, [7, 8])[0][-1] for _ in range(25_600)]
    counts = np.bincount(low, minlength=256)
    assert stats.chisquare(counts).pvalue > ALPHA


def test_batch_inverse_matches_modular_inverse() -> None:
    values = [1, 2, 3, PRIME - 1, 2**300 + 17, 123456789]
    assert _batch_inverse(values) == [pow(v, -1, PRIME) for v in values]
    assert _batch_inverse([]) == []


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit the field"):
        split(b"\xff" * 66, 2, [1, 2])
    with pytest.raises(ValueError, match="repeat"):
        split(bytes(32), 2, [1, 1, 2])
    with pytest.raises(ValueError, match="1..p-1"):
        split(bytes(32), 2, [0, 1, 2])
    with pytest.raises(ValueError, match="threshold 3 must lie in 1..2"):
        split(bytes(32), 3, [1, 2])
    shares = split(bytes(32), 2, [1, 2])
    with pytest.raises(ValueError, match="has 65 bytes"):
        combine({1: shares[0][1:], 2: shares[1]}, 32)
    with pytest.raises(ValueError, match="not a field element"):
        combine({1: b"\xff" * SHARE_BYTES, 2: shares[1]}, 32)
