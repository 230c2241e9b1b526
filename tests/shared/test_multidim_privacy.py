"""Exact privacy of one whole multi-attribute report (``spl``, ``smp``, ``rsfd``).

The law of a report is enumerated from its views' exact laws (the inner mechanisms'
``transition_matrix``, and the fake laws of ``rsfd``) over every output of the whole report,
for every input of a small domain (categorical values, numeric inputs at the ends and the
middle of the range); the largest likelihood ratio between two inputs must not exceed
e^eps. And the counterexample: ``rsfd`` with the paper's amplified inner epsilon
ln(k (e^eps - 1) + 1) exceeds e^eps on inputs that differ in every attribute.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, cast

import numpy as np
import pytest

from shared.mechanisms import MechanismSpec, make_mechanism
from shared.mechanisms.multidim import MultiAttributeMechanism, View

ATTRIBUTES = [
    {"name": "a", "domain_size": 2},
    {"name": "b", "domain_size": 2},
    {"name": "c", "lower": 0.0, "upper": 1.0},
]
NUMERIC_INPUTS = (0.0, 0.5, 1.0)


def build(
    protocol: str, epsilon: float, oracle: str, attributes: list[Any] = ATTRIBUTES
) -> MultiAttributeMechanism:
    spec = MechanismSpec.model_validate(
        {
            "mechanism": protocol,
            "epsilon": epsilon,
            "attributes": attributes,
            "pairs": [["a", "b"]],
            "oracle": oracle,
        }
    )
    return cast(MultiAttributeMechanism, make_mechanism(spec))


def view_laws(view: View) -> tuple[np.ndarray, np.ndarray]:
    """(rows: P(output | input) per view input, the fake law) of one view."""
    inner: Any = view.inner
    if view.plan.is_numeric:
        rows = inner.transition_matrix(np.array(NUMERIC_INPUTS))
        if view.oracle == "duchi":
            fake = inner.transition_matrix(np.array([inner.lower, inner.upper])).mean(axis=0)
        else:
            grid = inner.lower + inner.step * np.arange(inner.grid_steps + 1)
            fake = view._piecewise_rows(np.arange(inner.grid_steps + 1)).mean(axis=0)
            assert np.allclose(fake, inner.transition_matrix(grid).mean(axis=0), atol=1e-12)
        return rows, fake
    rows = inner.transition_matrix()
    if view.oracle == "grr":
        return rows, np.full(view.plan.cells, 1.0 / view.plan.cells)
    ones = ((np.arange(rows.shape[1])[:, None] >> np.arange(view.plan.cells)) & 1).sum(axis=1)
    return rows, inner.q**ones * (1 - inner.q) ** (view.plan.cells - ones)


def outer(vectors: list[np.ndarray]) -> np.ndarray:
    result = np.ones(1)
    for vector in vectors:
        result = np.multiply.outer(result, vector).ravel()
    return result


def report_law(mech: MultiAttributeMechanism) -> np.ndarray:
    """P(whole report | input) for every input (rows) and report (columns)."""
    laws = [view_laws(view) for view in mech.views]
    choices = [range(rows.shape[0]) for rows, _ in laws]
    k = mech.k
    out = []
    for inputs in itertools.product(*choices):
        true = [laws[v][0][inputs[v]] for v in range(k)]
        if mech.name == "spl":
            out.append(outer(true))
        elif mech.name == "smp":
            out.append(np.concatenate(true) / k)
        else:
            fakes = [laws[v][1] for v in range(k)]
            terms = [outer([true[j] if j == s else fakes[j] for j in range(k)]) for s in range(k)]
            out.append(np.mean(terms, axis=0))
    return np.array(out)


def largest_ratio(law: np.ndarray) -> float:
    assert np.allclose(law.sum(axis=1), 1.0)
    assert law.min() > 0
    return float((law.max(axis=0) / law.min(axis=0)).max())


@pytest.mark.parametrize("protocol", ["spl", "smp", "rsfd"])
@pytest.mark.parametrize("oracle", ["grr", "oue"])
@pytest.mark.parametrize("epsilon", [1.0, 6.0])
def test_whole_report_is_epsilon_ldp(protocol: str, oracle: str, epsilon: float) -> None:
    mech = build(protocol, epsilon, oracle)
    ratio = largest_ratio(report_law(mech))
    assert ratio <= math.exp(epsilon) * (1 + 1e-12)


def test_both_numeric_mechanisms_are_enumerated() -> None:
    assert build("spl", 1.0, "grr").views[-1].oracle == "duchi"
    assert build("smp", 6.0, "grr").views[-1].oracle == "piecewise"


def test_three_views_with_a_direct_categorical_attribute() -> None:
    attributes = [*ATTRIBUTES, {"name": "d", "domain_size": 3}]
    for protocol in ("spl", "smp", "rsfd"):
        mech = build(protocol, 3.0, "oue", attributes)
        assert mech.k == 3
        assert largest_ratio(report_law(mech)) <= math.exp(3.0) * (1 + 1e-12)


def test_rsfd_with_grr_reaches_the_bound_at_inputs_differing_everywhere() -> None:
    """With eps_inner = eps the bound is tight (module docstring of multidim)."""
    ratio = largest_ratio(report_law(build("rsfd", 1.0, "grr")))
    assert ratio == pytest.approx(math.exp(1.0), rel=1e-9)


def test_the_papers_amplified_inner_epsilon_breaks_the_whole_report_bound() -> None:
    """RS+FD's eps' = ln(k (e^eps - 1) + 1) as the inner epsilon (here: a spec whose
    epsilon is eps'): two inputs that differ in both views give a ratio of e^eps' > e^eps."""
    epsilon, k = 1.0, 2
    amplified = math.log(k * math.expm1(epsilon) + 1)
    mech = build("rsfd", amplified, "grr")
    assert mech.k == k
    law = report_law(mech)
    ratio = largest_ratio(law)
    assert ratio > math.exp(epsilon) * 1.5
    assert ratio == pytest.approx(math.exp(amplified), rel=1e-9)
    # The pair that reaches it differs in every view: (a, b) = (0, 0) vs (1, 1), c at the
    # two ends (input order: pair cell major, numeric input minor).
    numeric = len(NUMERIC_INPUTS)
    first, second = 0 * numeric + 0, 3 * numeric + 2
    assert (law[first] / law[second]).max() == pytest.approx(ratio, rel=1e-9)
