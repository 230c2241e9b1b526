"""The JSON of a multi-attribute metric's estimate (``aggregator.attribute_estimates``).

Built from hand-made ``AttributesEstimate`` objects (no mechanism needed): every number
is the estimate's own, intervals at the confidence level asked, labels from the
attribute's labels or the index as a string, cells and conditional shares row-major,
a share with no answer null, and the whole answer valid for its pydantic model (the
fields every estimate has, ``EstimateBase``, plus ``AttributesEstimateFields``), with a
description on every field for the OpenAPI document.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

from aggregator.attribute_estimates import (
    AttributesEstimateFields,
    CategoricalAttributeOut,
    ConditionalCellOut,
    JointCellOut,
    MarginalOut,
    NumericAttributeOut,
    attributes_estimate,
    listed_values,
)
from aggregator.estimates import EstimateBase
from shared.attributes import (
    AttributesEstimate,
    CategoricalAttribute,
    NumericAttribute,
    PairMarginal,
)
from shared.estimates import z_value

Z95 = z_value(0.95)


class AttributesEstimateOut(AttributesEstimateFields, EstimateBase):
    """The whole answer, as ``aggregator.estimates`` composes it."""


BASE: dict[str, Any] = {
    "metric": "prefs",
    "version": 1,
    "mechanism": "smp",
    "epsilon": 2.0,
    "n": 1000,
    "window": {"start": None, "end": None},
    "min_reports": 1,
    "buckets": 3,
    "suppressed_buckets": 0,
    "suppressed_reports": 0,
    "pending_reports": 0,
}


def fields_of(result: AttributesEstimate, oracle: str = "auto", level: float = 0.95) -> Any:
    """``attributes_estimate``'s answer, as JSON is read (untyped)."""
    return attributes_estimate(result, oracle, level)


def example() -> AttributesEstimate:
    """theme (3 labelled values) x font (2 unlabelled), and a numeric attribute; the
    second row of the joint estimated negative, so given_first has no answer there."""
    joint = np.array([[0.30, 0.10], [-0.02, 0.01], [0.35, 0.26]])
    joint_std = np.array([[0.02, 0.015], [0.01, 0.012], [0.021, 0.018]])
    rows, columns = joint.sum(axis=1), joint.sum(axis=0)
    given_first = np.where(
        rows[:, None] > 0, joint / np.where(rows > 0, rows, 1.0)[:, None], np.nan
    )
    given_second = joint / columns[None, :]
    theme = CategoricalAttribute(
        name="theme",
        labels=("light", "dark", "auto"),
        n=1000,
        frequencies=rows,
        std=np.array([0.025, 0.016, 0.028]),
        postprocessed=np.array([0.40, 0.0, 0.60]),
        method="consistent",
    )
    font = CategoricalAttribute(
        name="font",
        labels=None,
        n=1000,
        frequencies=columns,
        std=np.array([0.03, 0.03]),
        postprocessed=columns,
        method="consistent",
    )
    minutes = NumericAttribute(
        name="session_min",
        lower=0.0,
        upper=120.0,
        n=480,
        mean=130.5,
        std=4.0,
        postprocessed_mean=120.0,
    )
    pair = PairMarginal(
        attributes=("theme", "font"),
        n=1000,
        frequencies=joint,
        std=joint_std,
        postprocessed=np.array([[0.3, 0.1], [0.0, 0.0], [0.34, 0.26]]),
        given_first=given_first,
        given_first_std=np.where(np.isfinite(given_first), 0.05, np.nan),
        given_second=given_second,
        given_second_std=np.full((3, 2), 0.04),
    )
    return AttributesEstimate(
        protocol="smp", n=1000, attributes=(theme, font, minutes), marginals=(pair,)
    )


def test_the_answer_is_its_models_json() -> None:
    fields = attributes_estimate(example(), oracle="auto", confidence=0.95)
    answer = BASE | fields
    parsed = AttributesEstimateOut.model_validate(answer)
    # Serialized as it is, the dict is exactly the JSON its model gives.
    assert json.loads(json.dumps(fields)) == parsed.model_dump(mode="json", include=set(fields))
    assert fields["kind"] == "attributes" and fields["protocol"] == "smp"
    assert fields["oracle"] == "auto"


def test_each_categorical_value_carries_its_estimate_and_interval() -> None:
    result = example()
    theme, font, _ = fields_of(result, "grr")["attributes"]
    source = result.attribute("theme")
    assert isinstance(source, CategoricalAttribute)
    assert theme["name"] == "theme" and theme["n"] == 1000 and theme["method"] == "consistent"
    assert [item["label"] for item in theme["estimates"]] == ["light", "dark", "auto"]
    assert [item["index"] for item in theme["estimates"]] == [0, 1, 2]
    for item, f, s in zip(theme["estimates"], source.frequencies, source.std, strict=True):
        assert item["frequency"] == f and item["std"] == s
        assert item["ci_low"] == pytest.approx(f - Z95 * s, abs=1e-15)
        assert item["ci_high"] == pytest.approx(f + Z95 * s, abs=1e-15)
        assert item["count"] == pytest.approx(1000 * f)
    assert [item["frequency"] for item in theme["postprocessed"]] == [0.4, 0.0, 0.6]
    # An attribute without labels names its values by index.
    assert [item["label"] for item in font["estimates"]] == ["0", "1"]
    assert [item["label"] for item in font["postprocessed"]] == ["0", "1"]


def test_a_numeric_attribute_carries_its_mean_and_interval_at_the_level() -> None:
    *_, minutes = fields_of(example(), "oue", 0.9)["attributes"]
    z90 = z_value(0.9)
    assert minutes == {
        "name": "session_min",
        "kind": "numeric",
        "n": 480,
        "lower": 0.0,
        "upper": 120.0,
        "mean": 130.5,
        "std": 4.0,
        "ci_low": pytest.approx(130.5 - z90 * 4.0),
        "ci_high": pytest.approx(130.5 + z90 * 4.0),
        "postprocessed_mean": 120.0,
    }


def test_a_marginal_lists_its_cells_row_major_with_intervals() -> None:
    result = example()
    (marginal,) = fields_of(result)["marginals"]
    pair = result.marginals[0]
    assert marginal["attributes"] == ["theme", "font"] and marginal["n"] == 1000
    assert marginal["rows"] == ["light", "dark", "auto"] and marginal["columns"] == ["0", "1"]
    assert marginal["conditional_method"] == "delta"
    cells = marginal["cells"]
    assert [(c["row"], c["column"]) for c in cells] == [
        (row, column) for row in ("light", "dark", "auto") for column in ("0", "1")
    ]
    assert [c["frequency"] for c in cells] == pair.frequencies.ravel().tolist()
    assert [c["std"] for c in cells] == pair.std.ravel().tolist()
    assert [c["postprocessed"] for c in cells] == pair.postprocessed.ravel().tolist()
    low = (pair.frequencies - Z95 * pair.std).ravel()
    high = (pair.frequencies + Z95 * pair.std).ravel()
    assert np.allclose([c["ci_low"] for c in cells], low, rtol=0, atol=1e-15)
    assert np.allclose([c["ci_high"] for c in cells], high, rtol=0, atol=1e-15)
    # Cells sum by row to the first attribute's one-way estimate (consistency).
    theme = result.attribute("theme")
    assert isinstance(theme, CategoricalAttribute)
    row_sums = np.array([c["frequency"] for c in cells]).reshape(3, 2).sum(axis=1)
    assert np.allclose(row_sums, theme.frequencies)


def test_conditional_shares_with_no_answer_are_null() -> None:
    result = example()
    (marginal,) = fields_of(result)["marginals"]
    pair = result.marginals[0]
    given_first = marginal["given_first"]
    # The row "dark" sums to -0.01: no share of a column among it.
    dark = [item for item in given_first if item["row"] == "dark"]
    assert [(i["share"], i["std"], i["ci_low"], i["ci_high"]) for i in dark] == [(None,) * 4] * 2
    light = [item for item in given_first if item["row"] == "light"]
    assert [item["share"] for item in light] == pytest.approx([0.75, 0.25])
    assert light[0]["ci_low"] == pytest.approx(0.75 - Z95 * 0.05)
    shares = [item["share"] for item in marginal["given_second"]]
    assert shares == pair.given_second.ravel().tolist()
    assert all(math.isfinite(share) for share in shares)
    # Null is valid for the model, and never a NaN in the JSON.
    json.dumps(marginal, allow_nan=False)
    MarginalOut.model_validate(marginal)


def test_a_series_step_carries_no_marginals() -> None:
    fields = attributes_estimate(example(), "auto", 0.95, marginals=False)
    assert fields["marginals"] == []
    assert len(fields["attributes"]) == 3  # type: ignore[arg-type]
    AttributesEstimateOut.model_validate(BASE | fields)


def test_a_pair_of_mismatched_shape_is_refused() -> None:
    result = example()
    pair = result.marginals[0]
    wrong = PairMarginal(
        attributes=pair.attributes,
        n=pair.n,
        frequencies=pair.frequencies.T,
        std=pair.std.T,
        postprocessed=pair.postprocessed.T,
        given_first=pair.given_first.T,
        given_first_std=pair.given_first_std.T,
        given_second=pair.given_second.T,
        given_second_std=pair.given_second_std.T,
    )
    broken = AttributesEstimate("smp", 1000, result.attributes, (wrong,))
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*3 and 2 values"):
        attributes_estimate(broken, "auto", 0.95)


@pytest.mark.parametrize(
    "model",
    [
        AttributesEstimateFields,
        CategoricalAttributeOut,
        NumericAttributeOut,
        MarginalOut,
        JointCellOut,
        ConditionalCellOut,
    ],
)
def test_the_estimate_specific_fields_are_described(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    plain = {"name", "kind", "index", "label", "upper"}  # self-explanatory or told beside
    undescribed = [
        name
        for name, field in schema["properties"].items()
        if name not in plain and "description" not in field
    ]
    assert not undescribed, undescribed


def test_the_values_an_estimate_lists_are_counted_from_the_spec() -> None:
    spec = {
        "mechanism": "smp",
        "epsilon": 2.0,
        "attributes": [
            {"name": "theme", "domain_size": 3, "labels": ["light", "dark", "auto"]},
            {"name": "font", "domain_size": 2},
            {"name": "session_min", "lower": 0.0, "upper": 120.0},
        ],
        "pairs": [["theme", "font"]],
    }
    step = attributes_estimate(example(), "auto", 0.95, marginals=False)
    whole = attributes_estimate(example(), "auto", 0.95)
    assert listed_values(spec, marginals=False) == 2 * (3 + 2) + 1 == leaves(step)
    assert listed_values(spec, marginals=True) == 11 + 3 * 6 == leaves(whole)
    assert listed_values(spec | {"pairs": None}, marginals=True) == 11


def leaves(fields: Any) -> int:
    """The estimated values an answer lists: each share, conditional share and mean."""
    count = 0
    for attribute in fields["attributes"]:
        numeric = attribute["kind"] == "numeric"
        count += 1 if numeric else len(attribute["estimates"]) + len(attribute["postprocessed"])
    for marginal in fields["marginals"]:
        count += sum(len(marginal[key]) for key in ("cells", "given_first", "given_second"))
    return count
