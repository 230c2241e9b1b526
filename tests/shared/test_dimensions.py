"""Public dimensions (``shared.dimensions``): bounds, cell numbering, the server's helpers,
and the metric definition's field (``shared.schemas.MetricDefinition.dimensions``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from shared.dimensions import (
    MAX_CELLS,
    NO_DIMENSIONS,
    DimensionError,
    Dimensions,
    parse_by,
    parse_where,
)
from shared.mechanisms import make_mechanism
from shared.schemas import MetricDefinition, MetricSpec, Report

DECLARED = {"platform": ["android", "ios", "web"], "version": ["1.0", "1.1", "2.0", "2.1"]}
GRR = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}


@pytest.fixture
def dims() -> Dimensions:
    return Dimensions(DECLARED)


def test_cells_are_mixed_radix_with_the_first_dimension_most_significant(
    dims: Dimensions,
) -> None:
    assert dims.cell_count == 12 and dims.sizes == (3, 4) and dims.strides == (4, 1)
    for cell, (p, v) in enumerate(itertools.product(range(3), range(4))):
        values = {"platform": DECLARED["platform"][p], "version": DECLARED["version"][v]}
        assert dims.cell_of(values) == cell
        assert dims.values_of(cell) == values
    assert dims.digits().tolist() == [[p, v] for p in range(3) for v in range(4)]
    assert NO_DIMENSIONS.cell_count == 1 and NO_DIMENSIONS.cell_of(None) == 0
    assert not NO_DIMENSIONS and dims


@pytest.mark.parametrize(
    ("given", "field", "words"),
    [
        ({"platform": "ios"}, "dimensions.version", "missing"),
        ({"platform": "ios", "version": "9.9"}, "dimensions.version", "'9.9' is not a value"),
        ({"platform": "ios", "version": "1.0", "os": "x"}, "dimensions.os", "unknown dimension"),
        ({"platform": 3, "version": "1.0"}, "dimensions.platform", "is not a value"),
        (None, "dimensions.platform", "missing"),
    ],
)
def test_a_report_s_values_are_refused_naming_the_dimension(
    dims: Dimensions, given: dict[str, object] | None, field: str, words: str
) -> None:
    with pytest.raises(DimensionError) as caught:
        dims.cell_of(given)
    assert caught.value.field == field and words in str(caught.value)


def test_a_refused_value_lists_at_most_ten_allowed_values() -> None:
    many = Dimensions({"build": [f"b{i}" for i in range(40)]})
    with pytest.raises(DimensionError) as caught:
        many.cell_of({"build": "nope"})
    assert "'b9'" in str(caught.value) and "'b10'" not in str(caught.value)
    assert "and 30 more" in str(caught.value)


def test_values_given_to_a_metric_without_dimensions_are_refused() -> None:
    with pytest.raises(DimensionError) as caught:
        NO_DIMENSIONS.cell_of({"platform": "ios"})
    assert caught.value.field == "dimensions"
    assert NO_DIMENSIONS.cell_of({}) == 0


@pytest.mark.parametrize(
    ("declared", "field", "words"),
    [
        ({"Platform": ["a"]}, "dimensions.Platform", "lower-case"),
        ({"9lives": ["a"]}, "dimensions.9lives", "lower-case"),
        ({"x" * 33: ["a"]}, "dimensions." + "x" * 33, "lower-case"),
        ({"p": []}, "dimensions.p", "1..64"),
        ({"p": [str(i) for i in range(65)]}, "dimensions.p", "1..64"),
        ({"p": ["a", "a"]}, "dimensions.p", "more than once"),
        ({"p": [""]}, "dimensions.p", "1..64 characters"),
        ({"p": ["x" * 65]}, "dimensions.p", "1..64 characters"),
        ({"p": "abc"}, "dimensions.p", "list"),
        ({f"d{i}": ["a"] for i in range(9)}, "dimensions", "at most 8"),
        (
            {
                "a": [str(i) for i in range(64)],
                "b": [str(i) for i in range(65 - 1)],
                "c": ["x", "y"],
            },
            "dimensions",
            "8,192 cells",
        ),
    ],
)
def test_declarations_past_the_bounds_are_refused_naming_the_field(
    declared: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(DimensionError) as caught:
        Dimensions(declared)  # type: ignore[arg-type]
    assert caught.value.field == field and words in str(caught.value)


def test_the_largest_declaration_has_max_cells() -> None:
    largest = Dimensions({"a": [str(i) for i in range(64)], "b": [str(i) for i in range(64)]})
    assert largest.cell_count == MAX_CELLS == 4096
    assert largest.cells_of([{"a": "63", "b": "63"}, {"a": "0", "b": "1"}]).tolist() == [4095, 1]


def test_cells_where_and_groups_by_are_vectorized_over_the_cells(dims: Dimensions) -> None:
    digits = dims.digits()
    assert np.array_equal(dims.cells_where({}), np.ones(12, dtype=bool))
    ios = dims.cells_where({"platform": "ios"})
    assert np.flatnonzero(ios).tolist() == [4, 5, 6, 7]
    both = dims.cells_where({"platform": "web", "version": "1.1"})
    assert np.flatnonzero(both).tolist() == [dims.cell_of({"platform": "web", "version": "1.1"})]

    group, labels = dims.groups_by(["version"])
    assert group.tolist() == digits[:, 1].tolist()
    assert labels == [{"version": v} for v in DECLARED["version"]]
    group, labels = dims.groups_by(["version", "platform"])  # order of by= numbers groups
    assert group.tolist() == (digits[:, 1] * 3 + digits[:, 0]).tolist()
    assert labels[1] == {"version": "1.0", "platform": "ios"} and len(labels) == 12
    for cell in range(12):
        assert labels[group[cell]] == {
            name: dims.values_of(cell)[name] for name in ("version", "platform")
        }


@pytest.mark.parametrize(
    ("call", "field", "words"),
    [
        (lambda d: d.cells_where({"os": "x"}), "where", "unknown dimension 'os'"),
        (lambda d: d.cells_where({"platform": "tv"}), "where", "'tv' is not a value"),
        (lambda d: d.groups_by(["os"]), "by", "unknown dimension 'os'"),
        (lambda d: d.groups_by(["version", "version"]), "by", "twice"),
        (lambda d: parse_where(["platform"]), "where", "NAME:VALUE"),
        (lambda d: parse_where(["platform:ios", "platform:web"]), "where", "twice"),
        (lambda d: parse_by("platform,"), "by", "empty"),
        (lambda d: parse_by("platform,platform"), "by", "twice"),
    ],
)
def test_query_refusals_name_the_parameter_and_the_dimension(
    dims: Dimensions, call: object, field: str, words: str
) -> None:
    with pytest.raises(DimensionError) as caught:
        call(dims)  # type: ignore[operator]
    assert caught.value.field == field and words in str(caught.value)


def test_where_items_split_at_the_first_colon() -> None:
    assert parse_where(["version:2.0", "build:a:b"]) == {"version": "2.0", "build": "a:b"}
    assert parse_by(None) is None and parse_by("a, b") == ["a", "b"]


def test_the_definition_validates_dimensions_and_versions_by_them() -> None:
    definition = MetricDefinition.model_validate({"mechanism": GRR, "dimensions": DECLARED})
    assert definition.dimension_set == Dimensions(DECLARED)
    published = MetricSpec.model_validate(definition.model_dump() | {"name": "m", "version": 1})
    assert published.dimensions == {k: tuple(v) for k, v in DECLARED.items()}
    assert published.same_spec(definition)
    reordered = MetricDefinition.model_validate(
        {
            "mechanism": GRR,
            "dimensions": {"version": DECLARED["version"], "platform": DECLARED["platform"]},
        }
    )
    assert not published.same_spec(reordered)  # the order numbers the cells
    assert not published.same_spec(MetricDefinition.model_validate({"mechanism": GRR}))
    plain = MetricDefinition.model_validate({"mechanism": GRR, "dimensions": {}})
    assert plain.dimensions is None and plain.dimension_set is NO_DIMENSIONS
    with pytest.raises(ValidationError, match="dimensions.platform: 65 values"):
        MetricDefinition.model_validate(
            {"mechanism": GRR, "dimensions": {"platform": [str(i) for i in range(65)]}}
        )


def test_dimensions_never_enter_the_mechanism() -> None:
    """The mechanism is built from the spec alone, which holds no dimensions: the same
    spec with and without dimensions makes equal mechanisms (same transition matrix)."""
    with_dims = MetricDefinition.model_validate({"mechanism": GRR, "dimensions": DECLARED})
    without = MetricDefinition.model_validate({"mechanism": GRR})
    assert with_dims.mechanism == without.mechanism
    assert "dimensions" not in with_dims.mechanism.model_dump()
    assert np.array_equal(
        make_mechanism(with_dims.mechanism).transition_matrix(),  # type: ignore[attr-defined]
        make_mechanism(without.mechanism).transition_matrix(),  # type: ignore[attr-defined]
    )


def test_a_report_s_dimensions_are_bounded_on_the_wire() -> None:
    base = {"report_id": "00000000-0000-4000-8000-000000000000", "metric": "m", "version": 1}
    report = Report.model_validate(base | {"payload": {"value": 1}, "dimensions": {"p": "ios"}})
    assert report.dimensions == {"p": "ios"}
    assert Report.model_validate(base | {"payload": {"value": 1}}).dimensions is None
    for bad in ({f"d{i}": "a" for i in range(9)}, {"p": "x" * 65}, {"p" * 33: "a"}, {"p": 1}):
        with pytest.raises(ValidationError):
            Report.model_validate(base | {"payload": {"value": 1}, "dimensions": bad})
