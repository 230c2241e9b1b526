"""The integer lattice of federated updates: its step, the rounded norm bound (the lattice
sensitivity), unbiased rounding, the discrete noise and where it is used.

Statistical tests have fixed seeds and fail, when the code is right, with probability at
most ALPHA = 1e-6 each (the bound used is stated beside each).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from shared.federated import lattice as lattice_module
from shared.federated.fedavg import FedAvg
from shared.federated.lattice import (
    COUNT_SCALE,
    LATTICE_BITS,
    MAX_COUNT_NOISE,
    ROUNDING_FAILURE,
    Lattice,
    count_scale,
    noise_variance,
    noisy_count,
)
from shared.federated.privacy import AdaptiveClipping, DPConfig, PrivateAggregation, privatize

ALPHA = 1e-6


@pytest.mark.parametrize("clip_norm", [1e-6, 0.7, 1.0, 3.0, 1e6])
def test_the_step_is_a_power_of_two_with_2_to_the_16_steps_per_clip_norm(
    clip_norm: float,
) -> None:
    lattice = Lattice(clip_norm, 10)
    mantissa, _ = math.frexp(lattice.step)
    assert mantissa == 0.5  # a power of two: scaling by it is exact
    assert 2**LATTICE_BITS <= lattice.scaled_clip < 2 ** (LATTICE_BITS + 1)


@pytest.mark.parametrize("dim", [1, 7, 650, 20_000])
def test_every_rounded_update_is_within_the_bound(dim: int) -> None:
    """Worst cases for the rounding: rows at the clip norm whose scaled coordinates all
    have fractional part 1/2 (the largest rounding variance), and random directions; every
    rounded row's squared norm, computed exactly in integers, is at most Delta^2."""
    lattice = Lattice(0.7, dim)
    rng = np.random.default_rng(21)
    c = lattice.scaled_clip
    halves = np.full(dim, math.floor(c / math.sqrt(dim)) + 0.5)
    halves *= c / np.linalg.norm(halves)  # at the clip norm exactly, in lattice units
    random = rng.normal(size=(40, dim))
    random *= (c / np.linalg.norm(random, axis=1))[:, None]
    rows = np.vstack([np.tile(halves, (40, 1)), random]) * lattice.step
    rounded = lattice.round(rows, rng)
    assert rounded.dtype == np.int64
    squared = [sum(int(v) ** 2 for v in row) for row in rounded]
    assert max(squared) <= Fraction(lattice.bound) ** 2
    assert c < lattice.bound <= (c + math.sqrt(dim)) * (1 + 1e-12)


def test_the_bound_is_the_smaller_of_the_two_norm_bounds() -> None:
    """Delta = min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))
    (Kairouz, Liu and Steinke 2021), a hair above: what rounding adds to the sensitivity."""
    for dim in (1, 100, 500_000):
        lattice = Lattice(1.0, dim)
        c, d = lattice.scaled_clip, dim
        hoeffding = math.sqrt(
            c * c + d / 4 + math.sqrt(2 * math.log(1 / ROUNDING_FAILURE)) * (c + math.sqrt(d) / 2)
        )
        assert lattice.bound == pytest.approx(min(c + math.sqrt(d), hoeffding), rel=1e-11)
        assert lattice.bound >= min(c + math.sqrt(d), hoeffding)
    assert Lattice(1.0, 500_000).bound / Lattice(1.0, 500_000).scaled_clip < 1.0001


def test_rounding_is_unbiased() -> None:
    """The mean of 4,000 roundings of one row is the row: each coordinate's rounding error
    has mean 0 and std at most 1/2, so the mean of 4,000 is within 5.5 / (2 sqrt(4000))
    of it but for a chance below 4e-8 per coordinate (normal approximation), 1e-6 over the
    20 coordinates; conditioning on the norm bound changes nothing at this dimension
    (Delta is the worst case c + sqrt(d))."""
    lattice = Lattice(1.0, 20)
    rng = np.random.default_rng(22)
    row = rng.normal(size=20)
    row *= 0.9 / np.linalg.norm(row)
    rounded = lattice.round(np.tile(row, (4_000, 1)), rng)
    error = rounded.mean(axis=0) - row / lattice.step
    assert np.all(np.abs(error) < 5.5 / (2 * math.sqrt(4_000)))


def test_rounding_falls_back_to_rounding_toward_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the draws allowed (here none), the row is rounded toward zero: norm at most
    the row's own."""
    monkeypatch.setattr(lattice_module, "MAX_ROUNDING_DRAWS", 0)
    lattice = Lattice(1.0, 5)
    row = np.array([[0.6, -0.5, 0.3, 0.2, -0.4999]])
    rounded = lattice.round(row)
    np.testing.assert_array_equal(rounded, np.trunc(row / lattice.step).astype(np.int64))


def test_rows_must_be_clipped_and_of_the_right_width() -> None:
    lattice = Lattice(1.0, 3)
    with pytest.raises(ValueError, match="clipped"):
        lattice.round(np.array([[1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="rows must be"):
        lattice.round(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="clip_norm"):
        Lattice(0.0, 3)
    with pytest.raises(ValueError, match="dim"):
        Lattice(1.0, 0)


def test_the_noise_variance_is_rounded_up() -> None:
    for std in (0.3, 1.7, 65_537.123, 1e11):
        variance = noise_variance(std)
        assert variance >= Fraction(std) ** 2
        assert variance - Fraction(std) ** 2 < Fraction(1, 2**20)
    with pytest.raises(ValueError, match="std"):
        noise_variance(0.0)


def test_noisy_counts_live_on_the_counts_lattice() -> None:
    rng = np.random.default_rng(23)
    assert noisy_count(np.array([1.0, 0.0, 1.0]), 0.0) == 2.0  # no noise: the sum
    value = noisy_count(np.array([1.0, 0.0, 1.0]), 2.0, rng) * COUNT_SCALE
    assert value == round(value)
    assert count_scale(1.0) == COUNT_SCALE and count_scale(MAX_COUNT_NOISE) == 4
    with pytest.raises(ValueError, match="count"):
        count_scale(2 * MAX_COUNT_NOISE)
    with pytest.raises(ValueError, match="count_noise"):
        AdaptiveClipping(2 * MAX_COUNT_NOISE)


def test_the_central_noise_is_discrete_on_the_lattice() -> None:
    """The central mode's mean update times q W is g times integers: the server's noise is
    the discrete Gaussian on the lattice of the re-clipped updates."""
    config = DPConfig("central", 1.0, 0.9, expected_clients=8, sample_rate=0.5)
    updates = np.random.default_rng(24).normal(size=(6, 50))
    outcome = PrivateAggregation(FedAvg(), config).aggregate(
        updates, np.ones(6), np.ones(6), 1.0, np.random.default_rng(25)
    )
    units = outcome.mean_update * 8 / Lattice(1.0, 50).step
    assert np.array_equal(units, np.round(units))


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_a_devices_upload_is_within_the_norm_it_is_checked_against(mode: str) -> None:
    """Even the rounding's worst case: an update at the clip norm, noise included, stays
    below :meth:`DPConfig.max_upload_norm` (which counts Delta g, not C)."""
    config = DPConfig(mode, 1.0, 1.5, expected_clients=4)  # type: ignore[arg-type]
    rng = np.random.default_rng(26)
    update = np.full(400, 1.0 / 20.0)  # norm exactly 1
    norms = [np.linalg.norm(privatize(update, config, 1.0, rng).update) for _ in range(50)]
    assert max(norms) <= config.max_upload_norm(1.0, 400)
