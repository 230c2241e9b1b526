"""Attack: telling two inputs apart from the floating-point representation of one report.

Mironov ("On Significance of the Least Significant Bits for Differential Privacy",
CCS 2012) showed that a mechanism whose output is a double computed from the input,
such as ``l(t) + u (C - 1)`` for a 53-bit uniform u, reaches a set of doubles that
depends on the input: an observer who sees an output that one input cannot produce
learns the input with certainty (an infinite likelihood ratio), whatever epsilon the
mechanism claims. A continuous piecewise mechanism on [0, 120] at epsilon 1 did this
for 263 of 2,000 outputs of 30.0 against 31.0.

Defence: every numeric mechanism reports an element of a discrete output set that all
inputs share (a cell index for ``piecewise``, an integer grid index for ``laplace``, a
sign for ``duchi``), drawn by exact integer sampling, so the exact output distribution
is known and every output has positive probability under every input. These tests

1. encode two nearby inputs many times (seeded, and with the OS CSPRNG) and check that
   every output of one is an output of the other's exact pmf with positive mass;
2. rebuild the piecewise pmf from its realized integer thresholds in exact integer
   arithmetic and check the largest likelihood ratio over a grid of input pairs is at
   most e^epsilon (decided with 60-digit logarithms) and tight;
3. fit encoded cells against the pmf (chi-square);
4. check the debiased reports' mean and variance against the analytical ones;
5. check that a report outside the output set is refused, saying why.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal, localcontext
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import make_mechanism
from shared.randomness import BITS53, threshold53
from shared.schemas import MechanismSpec

NUMERIC = ("piecewise", "laplace", "duchi")
EPSILONS = (0.5, 1.0, 4.0)
#: Significance of each statistical assertion: a correct sampler fails one with
#: probability at most 1e-6 (seeds are fixed, so a pass is stable).
ALPHA = 1e-6
#: Two-sided normal quantile for ALPHA, rounded up (P(|Z| > 5) = 5.7e-7).
Z = 5.0


def build(**fields: Any) -> Any:
    return make_mechanism(MechanismSpec.model_validate(fields))


def pmf_at(mech: Any, value: float, outputs: np.ndarray) -> np.ndarray:
    """P(output | value) from the mechanism's exact ``transition_matrix`` at each output."""
    row = mech.transition_matrix(np.array([value]))[0]
    if mech.name == "piecewise":  # columns: cells 0..M-1
        return row[outputs]
    if mech.name == "duchi":  # columns: -1, +1
        return row[(outputs + 1) // 2]
    # laplace: columns m = -1..K+1; beyond them P(m | x) is P(-1 | x) or P(K+1 | x) times
    # e^(-g) per further step, positive exactly when the end column is.
    return row[np.clip(outputs, -1, mech.grid_steps + 1) + 1]


# --- 1. every output is possible under a nearby input -----------------------------------


@pytest.mark.parametrize("secure", [False, True], ids=["seeded", "os-csprng"])
@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("name", NUMERIC)
def test_no_output_rules_out_a_nearby_input(name: str, epsilon: float, secure: bool) -> None:
    mech = build(mechanism=name, epsilon=epsilon, lower=0.0, upper=120.0)
    size = 300 if secure else 2000
    for seed, (value, other) in enumerate([(30.0, 31.0), (31.0, 30.0), (0.0, 120.0)]):
        rng = None if secure else np.random.default_rng(1000 * seed + 7)
        outputs = mech.encode(np.full(size, value), rng=rng)
        assert np.issubdtype(outputs.dtype, np.integer), f"{name} reports {outputs.dtype}"
        impossible = np.flatnonzero(pmf_at(mech, other, outputs) <= 0)
        assert impossible.size == 0, (
            f"{name}: {impossible.size} of {size} outputs of {value} cannot come from {other}"
        )
        assert np.all(pmf_at(mech, value, outputs) > 0)


# --- 2. exact enumeration of the piecewise likelihood ratio -----------------------------


def exact_pmf(mech: Any, values: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows P(m | x) times D = 2^106 w (M - w), as exact Python integers, built from the
    realized integer thresholds: the window T / 2^53, rounding up F / 2^53 (F the floor
    of phi 2^53, as ``bernoulli`` realizes it)."""
    k, w, cells, t = mech.grid_steps, mech.window, mech.cells, mech.threshold
    high, low = t * (cells - w), (BITS53 - t) * w  # H and L times 2^53 w (M - w)
    position = mech.grid_position(values)  # (clip(x) - lower) / step, as encode computes it
    below = np.minimum(np.floor(position), k)
    up = threshold53(position - below, "down")
    m = np.arange(cells)
    rows = []
    for base, f in zip(below.astype(int), up.astype(object), strict=True):

        def column(i: int) -> np.ndarray:
            return np.where((m >= i) & (m < i + w), high, low).astype(object)

        rows.append(column(base) * (BITS53 - f) + column(min(base + 1, k)) * f)
    return np.array(rows, dtype=object), BITS53 * BITS53 * w * (cells - w)


def log_ratio(numerator: int, denominator: int) -> Decimal:
    with localcontext(Context(prec=60)):
        return Decimal(numerator).ln() - Decimal(denominator).ln()


PIECEWISE_CASES = [
    (epsilon, steps) for epsilon in (0.01, 0.5, 1.0, 2.3, 5.0) for steps in (1, 3, 16, None)
]


@pytest.mark.parametrize(("epsilon", "steps"), PIECEWISE_CASES)
def test_piecewise_likelihood_ratio_is_at_most_and_exactly_epsilon(
    epsilon: float, steps: int | None
) -> None:
    lower, upper = -3.7, 11.2
    mech = build(mechanism="piecewise", epsilon=epsilon, lower=lower, upper=upper, grid_steps=steps)
    k = mech.grid_steps
    width = upper - lower
    values = np.concatenate(
        [
            lower + width * np.arange(k + 1) / k if k <= 16 else [lower, upper],  # grid points
            lower + width * np.array([1e-12, 0.01, 0.3141592653589793, 0.5, 0.77, 1 - 1e-12]),
            [lower - 1.0, upper + 1e6],
        ]
    )
    pmf, scale = exact_pmf(mech, values)
    assert all(sum(row) == scale for row in pmf), "a row is not a distribution"
    assert all(v > 0 for v in pmf.flat), "an output has probability 0 under some input"
    np.testing.assert_allclose(
        mech.transition_matrix(values), pmf.astype(np.float64) / scale, rtol=1e-12, atol=0
    )
    top, bottom = pmf.max(axis=0), pmf.min(axis=0)
    worst = max(range(mech.cells), key=lambda m: top[m] * 10**40 // bottom[m])
    ratio = log_ratio(int(top[worst]), int(bottom[worst]))
    assert ratio <= Decimal(epsilon), f"privacy loss {ratio} exceeds epsilon {epsilon}"
    assert float(ratio) >= epsilon + math.log1p(-1e-9), "the bound is not tight"
    assert float(ratio) == pytest.approx(mech.effective_epsilon, abs=1e-12)
    assert mech.effective_epsilon <= epsilon


# --- 3. the sampler draws from the pmf ---------------------------------------------------


@pytest.mark.parametrize(
    ("epsilon", "steps", "value"),
    [(1.0, 16, 0.0), (1.0, 16, 47.3), (4.0, 64, 120.0), (0.5, 5, 61.0)],
)
def test_piecewise_cells_fit_the_pmf(epsilon: float, steps: int, value: float) -> None:
    """Pearson chi-square of 200,000 cells against the exact row (every cell expects at
    least 100 counts here), rejected at ALPHA: false-failure rate 1e-6."""
    mech = build(mechanism="piecewise", epsilon=epsilon, lower=0.0, upper=120.0, grid_steps=steps)
    row = mech.transition_matrix(np.array([value]))[0]
    samples = 200_000
    assert samples * row.min() >= 100
    cells = mech.encode(np.full(samples, value), rng=np.random.default_rng(int(value * 10) + steps))
    observed = np.bincount(cells, minlength=mech.cells)
    assert observed.size == mech.cells
    assert stats.chisquare(observed, samples * row).pvalue > ALPHA


# --- 4. unbiased, with the analytical variance -------------------------------------------


@pytest.mark.parametrize(("epsilon", "steps"), [(1.0, None), (2.0, 4), (0.5, 3)])
def test_piecewise_debiased_mean_and_variance(epsilon: float, steps: int | None) -> None:
    """For each input, 200,000 debiased reports: the mean within Z sqrt(m2 / n) of clip(x)
    and the sample variance within Z sqrt((m4 - m2^2) / n) of ``report_variance`` (m2, m4
    from ``report_central_moments``). Each check fails with probability ~5.7e-7."""
    mech = build(mechanism="piecewise", epsilon=epsilon, lower=-3.0, upper=10.0, grid_steps=steps)
    values = np.array([-3.0, -2.9, 0.123, 3.5, 9.99, 10.0, 25.0])
    moments = mech.report_central_moments(values)
    np.testing.assert_allclose(moments[:, 0], mech.report_variance(values), rtol=1e-9)
    rng = np.random.default_rng(2024 + (steps or 0))
    n = 200_000
    for value, (m2, _, m4) in zip(values, moments, strict=True):
        reports = mech.debias(mech.encode(np.full(n, value), rng=rng))
        truth = min(max(value, -3.0), 10.0)
        assert abs(reports.mean() - truth) <= Z * math.sqrt(m2 / n)
        assert abs(reports.var() - m2) <= Z * math.sqrt((m4 - m2 * m2) / n)


# --- 5. reports outside the output set ---------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"value": 1.5}, "integer"),
        ({"value": 3.0}, "integer"),
        ({"value": True}, "integer"),
        ({"value": "3"}, "integer"),
        ({"value": -1}, "0..{last}"),
        ({"value": "cells"}, "0..{last}"),
    ],
)
def test_piecewise_refuses_reports_outside_its_cells(payload: dict[str, Any], message: str) -> None:
    mech = build(mechanism="piecewise", epsilon=1.0, lower=0.0, upper=120.0)
    if payload["value"] == "cells":
        payload = {"value": mech.cells}
    good = {"value": mech.cells - 1}
    with pytest.raises(ValueError, match="report 1") as info:
        mech.from_payloads([good, payload, good])
    assert message.format(last=mech.cells - 1) in str(info.value)
    assert mech.from_payloads([good, {"value": 0}]).tolist() == [mech.cells - 1, 0]
