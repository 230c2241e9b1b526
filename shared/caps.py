"""Epsilon caps under basic composition: does a total stay within its cap?

Releasing the outputs of mechanisms that are eps_1-, ..., eps_k-DP about the same data
is (eps_1 + ... + eps_k)-DP (basic sequential composition; Dwork and Roth, *The
Algorithmic Foundations of Differential Privacy*, 2014, Theorem 3.16). A budget is a
cap on that sum: the device's ledgers and a federated task's round check all compare a
running total against a cap with :func:`within_cap`, so they share one tolerance.

A leaf module (standard library only): the on-device client imports it, and must not
pull in scipy or dp-accounting.
"""

from __future__ import annotations

__all__ = ["BUDGET_RELATIVE_TOLERANCE", "within_cap"]

#: Relative slack allowed when checking ``total <= cap``, so that floating-point rounding
#: of a sum of epsilons (0.1 + 0.2 is 0.30000000000000004) does not reject a spend that
#: fits exactly (against a cap of 0.3). It is far below any epsilon that matters: 1e-12
#: of the cap.
BUDGET_RELATIVE_TOLERANCE = 1e-12


def within_cap(total: float, cap: float) -> bool:
    """Whether ``total <= cap * (1 + BUDGET_RELATIVE_TOLERANCE)``.

    ``cap = math.inf`` admits every finite total; a NaN total is never within a cap.
    """
    return total <= cap * (1.0 + BUDGET_RELATIVE_TOLERANCE)
