"""Tests for shared.caps: one cap comparison, with one relative tolerance."""

from __future__ import annotations

import math

import pytest

from shared.caps import BUDGET_RELATIVE_TOLERANCE, within_cap


def test_sums_that_round_above_an_exact_fit_are_within_the_cap() -> None:
    assert 0.1 + 0.2 > 0.3  # 0.30000000000000004
    assert within_cap(0.1 + 0.2, 0.3)
    assert 10000.1 + 20000.2 - 30000.3 > 1e-12  # one ulp at 3e4 is 3.6e-12
    assert within_cap(10000.1 + 20000.2, 30000.3)


@pytest.mark.parametrize("cap", [1e-6, 1e-3, 1.0, 30000.3, 1e9])
def test_the_tolerance_is_relative_to_the_cap(cap: float) -> None:
    slack = cap * BUDGET_RELATIVE_TOLERANCE
    assert within_cap(cap, cap)
    assert within_cap(cap + 0.5 * slack, cap)
    assert not within_cap(cap + 4 * slack, cap)
    assert not within_cap(math.nextafter(cap * (1 + BUDGET_RELATIVE_TOLERANCE), math.inf), cap)


def test_an_infinite_cap_admits_every_finite_total_and_nan_is_never_within() -> None:
    assert within_cap(1e300, math.inf)
    assert not within_cap(math.nan, 1.0)
    assert not within_cap(math.nan, math.inf)
