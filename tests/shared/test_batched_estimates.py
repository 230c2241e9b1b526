"""The batched paths a breakdown takes give what the one-at-a-time paths give:
``estimate_many`` against ``estimate`` for every categorical mechanism, the row-wise simplex
projection against the single one, and ``CountStatistics.of_rows`` against its constructor."""

from __future__ import annotations

import numpy as np
import pytest

from shared.estimates import project_rows_to_simplex, project_to_simplex
from shared.mechanisms import MECHANISMS, as_categorical, make_mechanism
from shared.mechanisms.memoized import ChainedReport
from shared.mechanisms.spec import spec_models
from shared.schemas import CATEGORICAL_MECHANISMS, MechanismSpec
from shared.statistics import CountStatistics

NAMES = sorted(CATEGORICAL_MECHANISMS & set(MECHANISMS))


def _spec(name: str) -> MechanismSpec:
    """A spec of ``name`` over 6 categories (a chained memoized one: one report at 1)."""
    fields = {"mechanism": name, "epsilon": 1.5, "domain_size": 6}
    if issubclass(spec_models()[name], ChainedReport):
        fields["epsilon_report"] = 1.0
    return MechanismSpec.model_validate(fields)


@pytest.mark.parametrize("name", NAMES)
def test_estimate_many_is_estimate_of_each(name: str) -> None:
    mech = make_mechanism(_spec(name))
    categories = as_categorical(mech)
    assert categories is not None
    rng = np.random.default_rng(11)
    stats = [categories.simulate_statistics(rng.integers(1, 300, 6), rng) for _ in range(5)]
    for many, one in zip(
        categories.estimate_many(stats), map(categories.estimate, stats), strict=True
    ):
        np.testing.assert_allclose(many.frequencies, one.frequencies, rtol=0, atol=1e-12)
        np.testing.assert_allclose(many.std, one.std, rtol=1e-12)
        assert many.n == one.n


def test_estimate_many_refuses_statistics_of_no_reports() -> None:
    categories = as_categorical(make_mechanism(_spec("grr")))
    assert categories is not None
    with pytest.raises(ValueError, match="zero reports"):
        categories.estimate_many([CountStatistics(0, np.zeros(6, dtype=np.int64))])


def test_rows_project_as_each_row_does() -> None:
    rows = np.random.default_rng(3).normal(0.1, 0.4, size=(200, 9))
    rows[0] = 1 / 9  # already on the simplex
    rows[1] = -1.0  # all negative
    projected = project_rows_to_simplex(rows)
    for row, result in zip(rows, projected, strict=True):
        np.testing.assert_allclose(result, project_to_simplex(row), atol=1e-15)
    assert np.all(projected >= 0)
    np.testing.assert_allclose(projected.sum(axis=1), 1.0, atol=1e-12)


def test_of_rows_is_the_constructor_of_each_row() -> None:
    matrix = np.arange(12, dtype=np.int64).reshape(3, 4)
    made = CountStatistics.of_rows([5, 6, 7], matrix)
    assert made == [CountStatistics(n, row) for n, row in zip([5, 6, 7], matrix, strict=True)]
    matrix[0, 0] = 99  # a copy: later changes to the input do not reach them
    assert made[0].counts[0] == 0
    with pytest.raises(ValueError, match="non-negative"):
        CountStatistics.of_rows([1], np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="one count row per n"):
        CountStatistics.of_rows([1, 2], np.zeros((3, 2), dtype=np.int64))
