"""The secure-aggregation benchmark's helpers, and a tiny run of it (both sides)."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.benchmarks import secagg_bench as bench


def test_flower_floats_quantize_back_exactly() -> None:
    """``(x + c) 2^22 / (2c)`` recovers every integer in ``[0, 2^22)`` exactly (the step
    ``2^-18`` is a power of two, so no rounding occurs): no tolerance."""
    values = np.array([0, 1, 2**21, 2**22 - 1, 12345])
    floats = bench.flower_floats(values)
    back = (floats + bench.CLIPPING_RANGE) * (
        2**bench.QUANTIZATION_BITS / (2 * bench.CLIPPING_RANGE)
    )
    assert np.array_equal(back, values.astype(np.float64))


def test_flower_floats_through_flowers_quantizer() -> None:
    """Flower's own stochastic quantizer leaves the integers unchanged (exactly)."""
    quantization = pytest.importorskip("flwr.common.secure_aggregation.quantization")
    values = np.random.default_rng(3).integers(0, 2**bench.QUANTIZATION_BITS, 1000)
    (quantized,) = quantization.quantize(
        [bench.flower_floats(values)], bench.CLIPPING_RANGE, 2**bench.QUANTIZATION_BITS
    )
    assert np.array_equal(quantized, values)


@pytest.mark.parametrize(("n", "shares"), [(10, 5), (9, 9), (12, 7)])
def test_flower_neighbours_are_symmetric_rings(n: int, shares: int) -> None:
    """Each device's neighbourhood holds itself and ``shares - 1`` others (all of them
    when ``shares = n``), and the relation is symmetric."""
    order = np.random.default_rng(n).permutation(n)
    neighbours = bench.flower_neighbours(order, shares)
    for i, mine in enumerate(neighbours):
        assert i in mine
        assert len(mine) == min(shares, n)
        assert all(i in neighbours[j] for j in mine)


def test_dropped_devices_count() -> None:
    rng = np.random.default_rng(1)
    dropped = bench.dropped_devices(300, 0.1, rng)
    assert len(dropped) == 30 and all(0 <= i < 300 for i in dropped)
    assert bench.dropped_devices(300, 0.0, rng) == frozenset()


@pytest.mark.slow
def test_tiny_run_checks_both_sums(capsys: pytest.CaptureFixture[str]) -> None:
    """A round of 8 devices on both sides (the sums are asserted inside), then the same
    with Flower sampled (budget 0): the table has a row per setting and the targets."""
    args = ["--clients", "8", "--lengths", "64", "--no-extra", "--peer-sample", "2"]
    assert bench.main(args) == 0
    assert bench.main([*args, "--peer-budget", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("| n=8 L=6e1 drop=10% |") == 2
    assert "targets (the target setting" in out
    if not bench.flower_status().startswith("unavailable"):
        assert "full (" in out and "extrap. (2 timed)" in out
