"""The device ledger compares its totals with the caps as ``shared.caps.within_cap`` does:
a tolerance of 1e-12 of the cap, whatever the cap's scale."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from client.ledger import BudgetExhaustedError, BudgetLimits, PrivacyLedger


def limits(per_metric: float) -> BudgetLimits:
    return BudgetLimits(
        per_metric_per_period=per_metric,
        total_per_period=10 * per_metric,
        lifetime=math.inf,  # only the period caps are under test
        max_epsilon_per_report=per_metric * 2,
    )


def test_an_exact_fit_at_a_large_cap_is_accepted(tmp_path: Path) -> None:
    """10000.1 + 20000.2 rounds to 30000.300000000003, 3.6e-12 above the cap of 30000.3:
    rounding, not spending (1.2e-16 of the cap)."""
    ledger = PrivacyLedger(tmp_path, limits(30000.3))
    ledger.debit("a", 10000.1)
    ledger.debit("a", 20000.2)
    with pytest.raises(BudgetExhaustedError, match="above the cap of 30000.3"):
        ledger.debit("a", 0.01)


def test_an_overspend_of_a_small_cap_is_refused(tmp_path: Path) -> None:
    """5e-13 over a cap of 1e-3 is 5e-10 of the cap: far more than rounding, refused, and
    nothing is debited."""
    ledger = PrivacyLedger(tmp_path, limits(1e-3))
    with pytest.raises(BudgetExhaustedError, match="above the cap"):
        ledger.debit("a", 1e-3 + 5e-13)
    assert ledger.status().spent_this_period == 0.0
    ledger.debit("a", 1e-3)
    assert ledger.status().spent_per_metric == {"a": 1e-3}
