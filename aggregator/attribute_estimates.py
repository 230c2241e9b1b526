"""The published estimate of a multi-attribute metric (``spl``, ``smp``, ``rsfd``).

A multi-attribute metric's statistics estimate an ``AttributesEstimate``
(``shared.attributes``): one estimate per attribute and the 2-way marginal of every
declared pair. This module gives its JSON (``AttributesEstimateFields``, the fields an
``attributes`` estimate adds to the ones every estimate has):

* a categorical attribute: per value its unbiased share f^_v with std and the normal
  interval f^_v ± z std (z the two-sided normal quantile of the confidence level), the
  estimated count n f^_v, and the post-processed valid distribution beside it (biased);
  ``method`` says whether the one-way estimate is the attribute's own ("direct") or the
  consistent combination of the declared pairs holding it ("consistent", CALM: Zhang,
  Wang, Li, He and Chen, CCS 2018);
* a numeric attribute: the unbiased mean with std and interval, and the mean clipped to
  its bounds (biased);
* a declared pair (i, j): the cells of the joint distribution in row-major order (row i
  of the first attribute, column j of the second), each with its unbiased share, std,
  interval and post-processed share, and the conditional shares P(second = j | first = i)
  (``given_first``) and P(first = i | second = j) (``given_second``) with their
  delta-method std and intervals; a share whose denominator is not estimated positive
  has no answer (null).

Values are named by the attribute's labels, or by their index as a string. Each column
is computed as one numpy vector; only the final list of objects is built in Python. A
series step carries the attributes and no marginals (ask the estimate endpoint for one
step's marginals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from shared.attributes import (
    AttributesEstimate,
    CategoricalAttribute,
    NumericAttribute,
    OneWayMethod,
    PairMarginal,
    normal_interval,
)

__all__ = [
    "AttributeOut",
    "AttributesEstimateFields",
    "CategoricalAttributeOut",
    "ConditionalCellOut",
    "JointCellOut",
    "MarginalOut",
    "NumericAttributeOut",
    "attributes_estimate",
    "listed_values",
]

_INTERVAL = "Normal interval at the estimate's confidence level: estimate ± z std."


class AttributeFrequencyItem(BaseModel):
    index: int = Field(description="The value's index in the attribute's domain.")
    label: str = Field(description="The value's label, or its index as a string.")
    frequency: float = Field(
        description="Unbiased estimate of the share of devices with this value (may be "
        "negative or above 1)."
    )
    std: float = Field(description="Its standard error.")
    ci_low: float = Field(description=_INTERVAL)
    ci_high: float = Field(description=_INTERVAL)
    count: float = Field(description="n * frequency: the estimated number of devices.")


class AttributePostprocessedItem(BaseModel):
    index: int
    label: str
    frequency: float = Field(
        description="The value's share in the closest valid distribution (non-negative, "
        "summing to 1); biased, no interval."
    )


class CategoricalAttributeOut(BaseModel):
    name: str
    kind: Literal["categorical"] = "categorical"
    n: int = Field(
        description="Reports that inform this attribute (all of them under spl and rsfd; "
        "under smp those that sampled a view holding it)."
    )
    method: OneWayMethod = Field(
        description="'direct': estimated from the attribute's own view; 'consistent': the "
        "inverse-variance weighted combination of the declared pairs holding it, with which "
        "the pairs were made consistent (CALM)."
    )
    estimates: list[AttributeFrequencyItem] = Field(description="One item per value, by index.")
    postprocessed: list[AttributePostprocessedItem] = Field(
        description="The closest valid distribution, the same values in the same order."
    )


class NumericAttributeOut(BaseModel):
    name: str
    kind: Literal["numeric"] = "numeric"
    n: int = Field(description="Reports that inform this attribute.")
    lower: float = Field(description="Values are clipped to [lower, upper].")
    upper: float
    mean: float = Field(description="Unbiased estimate of the mean of the clipped values.")
    std: float = Field(description="Its standard error.")
    ci_low: float = Field(description=_INTERVAL)
    ci_high: float = Field(description=_INTERVAL)
    postprocessed_mean: float = Field(description="The mean clipped to [lower, upper]; biased.")


AttributeOut = CategoricalAttributeOut | NumericAttributeOut


class JointCellOut(BaseModel):
    row: str = Field(description="The first attribute's value (a label of rows).")
    column: str = Field(description="The second attribute's value (a label of columns).")
    frequency: float = Field(
        description="Unbiased estimate of the share of devices with both values, consistent "
        "with the one-way estimates (summing a row gives the first attribute's frequency)."
    )
    std: float = Field(description="Its standard error.")
    ci_low: float = Field(description=_INTERVAL)
    ci_high: float = Field(description=_INTERVAL)
    postprocessed: float = Field(
        description="The cell's share in a valid joint distribution (non-negative, summing "
        "to 1); biased, no interval."
    )


class ConditionalCellOut(BaseModel):
    row: str = Field(description="The first attribute's value.")
    column: str = Field(description="The second attribute's value.")
    share: float | None = Field(
        description="The conditional share (see the list's description) from the unbiased "
        "joint: a ratio of unbiased estimates, biased at order 1/n. Null where the "
        "denominator's estimate is not positive."
    )
    std: float | None = Field(
        description="Its delta-method standard error (first order in the joint's "
        "covariance); null with share."
    )
    ci_low: float | None = Field(description=_INTERVAL + " Null with share.")
    ci_high: float | None = Field(description=_INTERVAL + " Null with share.")


class MarginalOut(BaseModel):
    attributes: tuple[str, str] = Field(description="The declared pair: (first, second).")
    n: int = Field(description="Reports that inform the pair's joint distribution.")
    rows: list[str] = Field(description="The first attribute's values (labels or indices).")
    columns: list[str] = Field(description="The second attribute's values.")
    cells: list[JointCellOut] = Field(
        description="Every cell of the joint distribution, row-major: cell (i, j) is item "
        "i * len(columns) + j."
    )
    conditional_method: Literal["delta"] = Field(
        description="How the conditional shares' std was obtained: 'delta' (the delta method)."
    )
    given_first: list[ConditionalCellOut] = Field(
        description="P(second = column | first = row) = f(row, column) / sum over columns "
        "of f(row, .), row-major."
    )
    given_second: list[ConditionalCellOut] = Field(
        description="P(first = row | second = column) = f(row, column) / sum over rows of "
        "f(., column), row-major."
    )


class AttributesEstimateFields(BaseModel):
    """What a multi-attribute metric's estimate adds to the fields every estimate has."""

    kind: Literal["attributes"] = "attributes"
    protocol: str = Field(
        description="How one report protects all attributes: 'spl' (the budget split over "
        "the views), 'smp' (each device reports one sampled view with the whole budget) or "
        "'rsfd' (one sampled view reported truly, the others with fake data)."
    )
    oracle: str = Field(
        description="The frequency oracle of the categorical views: 'grr', 'oue' or 'auto' "
        "(the lower variance per view)."
    )
    attributes: list[AttributeOut] = Field(description="One estimate per attribute, in spec order.")
    marginals: list[MarginalOut] = Field(
        description="The joint distribution of each declared pair, in spec order. Empty in a "
        "series: ask the estimate endpoint for one step's marginals."
    )


def attributes_estimate(
    result: AttributesEstimate, oracle: str, confidence: float, marginals: bool = True
) -> dict[str, object]:
    """The ``AttributesEstimateFields`` of ``result`` (JSON-ready), intervals at
    ``confidence``; ``oracle`` is the spec's. ``marginals=False`` (a series step) leaves
    ``marginals`` empty."""
    attributes = [
        _categorical(attribute, confidence)
        if isinstance(attribute, CategoricalAttribute)
        else _numeric(attribute, confidence)
        for attribute in result.attributes
    ]
    joint = [_marginal(result, pair, confidence) for pair in result.marginals] if marginals else []
    return {
        "kind": "attributes",
        "protocol": result.protocol,
        "oracle": oracle,
        "attributes": attributes,
        "marginals": joint,
    }


def listed_values(spec: Mapping[str, Any], marginals: bool) -> int:
    """How many values one estimate of the multi-attribute ``spec`` (its JSON: the
    ``attributes`` and ``pairs`` lists) lists: two per categorical value (the unbiased
    share and the post-processed one), one per numeric attribute, and with ``marginals``
    three per cell of each declared pair (the joint share and the two conditional
    ones). What a series or a breakdown bounds (``MAX_SERIES_VALUES``)."""
    sizes = {attribute["name"]: attribute.get("domain_size") for attribute in spec["attributes"]}
    count = sum(2 * size if size else 1 for size in sizes.values())
    if marginals:
        count += sum(3 * sizes[first] * sizes[second] for first, second in spec.get("pairs") or ())
    return count


def value_labels(attribute: CategoricalAttribute) -> list[str]:
    """An attribute's values by name: its labels, or each index as a string."""
    if attribute.labels is not None:
        return list(attribute.labels)
    return [str(index) for index in range(attribute.domain_size)]


def _categorical(attribute: CategoricalAttribute, confidence: float) -> dict[str, object]:
    """A ``CategoricalAttributeOut``: every value's f^, std, f^ ± z std, n f^, and the
    post-processed share."""
    labels = value_labels(attribute)
    indices = np.arange(attribute.domain_size)
    low, high = attribute.ci(confidence)
    estimates = _rows(
        ("index", "label", "frequency", "std", "ci_low", "ci_high", "count"),
        indices.tolist(),
        labels,
        *_floats(
            attribute.frequencies, attribute.std, low, high, attribute.n * attribute.frequencies
        ),
    )
    postprocessed = _rows(
        ("index", "label", "frequency"),
        indices.tolist(),
        labels,
        *_floats(attribute.postprocessed),
    )
    return {
        "name": attribute.name,
        "kind": "categorical",
        "n": int(attribute.n),
        "method": attribute.method,
        "estimates": estimates,
        "postprocessed": postprocessed,
    }


def _numeric(attribute: NumericAttribute, confidence: float) -> dict[str, object]:
    """A ``NumericAttributeOut``: the mean, its std and mean ± z std."""
    low, high = attribute.ci(confidence)
    return {
        "name": attribute.name,
        "kind": "numeric",
        "n": int(attribute.n),
        "lower": float(attribute.lower),
        "upper": float(attribute.upper),
        "mean": float(attribute.mean),
        "std": float(attribute.std),
        "ci_low": low,
        "ci_high": high,
        "postprocessed_mean": float(attribute.postprocessed_mean),
    }


def _marginal(
    result: AttributesEstimate, pair: PairMarginal, confidence: float
) -> dict[str, object]:
    """A ``MarginalOut``: the pair's cells and both conditional tables, row-major."""
    first, second = (result.attribute(name) for name in pair.attributes)
    if not isinstance(first, CategoricalAttribute) or not isinstance(second, CategoricalAttribute):
        raise ValueError(f"the declared pair {pair.attributes} must join categorical attributes")
    rows, columns = value_labels(first), value_labels(second)
    if (len(rows), len(columns)) != pair.shape:
        raise ValueError(
            f"the marginal of {pair.attributes} has shape {pair.shape}, its attributes have "
            f"{len(rows)} and {len(columns)} values"
        )
    row_of = np.repeat(np.asarray(rows, dtype=object), len(columns)).tolist()
    column_of = np.tile(np.asarray(columns, dtype=object), len(rows)).tolist()
    low, high = pair.ci(confidence)
    cells = _rows(
        ("row", "column", "frequency", "std", "ci_low", "ci_high", "postprocessed"),
        row_of,
        column_of,
        *_floats(pair.frequencies, pair.std, low, high, pair.postprocessed),
    )

    def conditional(share: np.ndarray, std: np.ndarray) -> list[dict[str, object]]:
        share_low, share_high = normal_interval(share, std, confidence)
        return _rows(
            ("row", "column", "share", "std", "ci_low", "ci_high"),
            row_of,
            column_of,
            *_floats(share, std, share_low, share_high, missing=~np.isfinite(share)),
        )

    return {
        "attributes": list(pair.attributes),
        "n": int(pair.n),
        "rows": rows,
        "columns": columns,
        "cells": cells,
        "conditional_method": pair.conditional_method,
        "given_first": conditional(pair.given_first, pair.given_first_std),
        "given_second": conditional(pair.given_second, pair.given_second_std),
    }


def _floats(*columns: np.ndarray, missing: np.ndarray | None = None) -> list[list[Any]]:
    """Each column flattened (row-major) as Python floats; where ``missing`` (flattened
    likewise) is true, None in every column (JSON null: no answer)."""
    flat = [np.asarray(column, dtype=np.float64).ravel() for column in columns]
    if missing is None or not np.any(missing):
        return [column.tolist() for column in flat]
    absent = np.asarray(missing).ravel()
    answers: list[list[Any]] = []
    for column in flat:
        values = column.astype(object)
        values[absent] = None
        answers.append(values.tolist())
    return answers


def _rows(keys: Sequence[str], *columns: Sequence[object]) -> list[dict[str, object]]:
    """One object per position of the equally long ``columns``, named ``keys``."""
    return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
