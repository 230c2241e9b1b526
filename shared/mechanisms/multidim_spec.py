"""Spec models of the multi-attribute protocols ``spl``, ``smp`` and ``rsfd`` (kind
"attributes"), and the views a spec's report is made of.

    {"mechanism": "smp", "epsilon": 2.0,
     "attributes": [{"name": "theme", "domain_size": 3, "labels": ["light", "dark", "auto"]},
                    {"name": "font", "domain_size": 4},
                    {"name": "session_min", "lower": 0, "upper": 120}],
     "pairs": [["theme", "font"]],
     "oracle": "auto"}

* an attribute is categorical (``domain_size`` 2..4096, optional ``labels``: exactly
  domain_size distinct strings) or numeric (``lower`` < ``upper``); 2..32 attributes with
  distinct names ``^[a-z][a-z0-9_]{0,31}$``;
* ``pairs``: declared pairs of distinct categorical attributes whose joint distribution
  (2-way marginal) is estimated; no pair twice (in either order), d1 d2 <= 4096 cells per
  pair, at most 64 pairs and 16,384 pair cells in all;
* ``oracle``: the frequency oracle of the categorical views, "grr", "oue" or "auto"
  (filled in: the lower planning variance per view, at the view's epsilon and domain).

Views: the declared pairs (a pair's value is the cell i d2 + j), then every attribute in no
declared pair, in spec order. ``k`` is the number of views (``view_plan``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from shared.mechanisms.spec import MIN_EPSILON, MechanismSpec, ValueKind, fill_in

#: Attribute names: like metric dimension names.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
MIN_ATTRIBUTES = 2
MAX_ATTRIBUTES = 32
#: Largest domain of a categorical attribute, and most cells of a declared pair.
MAX_ATTRIBUTE_DOMAIN = 4096
MAX_PAIR_CELLS = 4096
MAX_PAIRS = 64
MAX_TOTAL_PAIR_CELLS = 16384

Oracle = Literal["grr", "oue", "auto"]
#: The protocols: their wire names.
PROTOCOLS: tuple[str, ...] = ("spl", "smp", "rsfd")


class AttributeSpec(BaseModel):
    """One private attribute: ``{"name", "domain_size", "labels"?}`` (categorical) or
    ``{"name", "lower", "upper"}`` (numeric)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Attribute name, ^[a-z][a-z0-9_]{0,31}$.")
    domain_size: int | None = Field(
        default=None, ge=2, le=MAX_ATTRIBUTE_DOMAIN, description="Categories (indices 0..d-1)."
    )
    labels: tuple[str, ...] | None = Field(
        default=None, description="One distinct label per category (categorical only)."
    )
    lower: float | None = Field(default=None, allow_inf_nan=False, description="Clip low.")
    upper: float | None = Field(default=None, allow_inf_nan=False, description="Clip high.")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field in ("domain_size", "lower", "upper"):
                if isinstance(data.get(field), bool):
                    raise ValueError(f"{field} must be a number, not a boolean")
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> AttributeSpec:
        if not NAME_PATTERN.match(self.name):
            raise ValueError(f"name {self.name!r} must match {NAME_PATTERN.pattern}")
        numeric = self.lower is not None or self.upper is not None
        if numeric == (self.domain_size is not None):
            raise ValueError(
                f"attribute {self.name!r} needs either domain_size (categorical) or lower and "
                "upper (numeric), not both"
            )
        if numeric:
            if self.lower is None or self.upper is None or not self.lower < self.upper:
                raise ValueError(f"attribute {self.name!r} needs lower < upper")
            if self.labels is not None:
                raise ValueError(f"attribute {self.name!r}: labels apply to categorical only")
        elif self.labels is not None:
            if len(self.labels) != self.domain_size or len(set(self.labels)) != len(self.labels):
                raise ValueError(
                    f"attribute {self.name!r}: labels must be exactly domain_size = "
                    f"{self.domain_size} distinct strings, got {len(self.labels)}"
                )
        return self

    @model_serializer(mode="wrap")
    def _without_unused_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return {key: value for key, value in handler(self).items() if value is not None}

    @property
    def is_categorical(self) -> bool:
        return self.domain_size is not None


@dataclass(frozen=True)
class ViewPlan:
    """One view of a report: a declared pair (``columns`` two attribute positions, value
    i d2 + j), a categorical attribute, or a numeric one (``shape`` empty)."""

    columns: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def is_numeric(self) -> bool:
        return not self.shape

    @property
    def cells(self) -> int:
        """Categories of the view's value (a pair: d1 d2)."""
        size = 1
        for d in self.shape:
            size *= d
        return size


class MultiAttributeSpec(MechanismSpec):
    """Several private attributes in one report under ``epsilon`` (see the module)."""

    kind: ClassVar[ValueKind] = "attributes"

    attributes: tuple[AttributeSpec, ...] = Field(
        min_length=MIN_ATTRIBUTES, max_length=MAX_ATTRIBUTES, description="The attributes."
    )
    pairs: tuple[tuple[str, str], ...] | None = Field(
        default=None, max_length=MAX_PAIRS, description="Declared pairs of categorical attributes."
    )
    oracle: Oracle | None = Field(
        default=None, description="Frequency oracle of the categorical views (default auto)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> MultiAttributeSpec:
        names = [attribute.name for attribute in self.attributes]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"attributes: names must be distinct, repeated: {repeated}")
        by_name = {attribute.name: attribute for attribute in self.attributes}
        seen: set[frozenset[str]] = set()
        total = 0
        for index, (first, second) in enumerate(self.pairs or ()):
            where = f"pairs[{index}]"
            for name in (first, second):
                if name not in by_name:
                    raise ValueError(f"{where}: no attribute {name!r}")
                if not by_name[name].is_categorical:
                    raise ValueError(f"{where}: {name!r} is numeric; pairs are categorical")
            if first == second:
                raise ValueError(f"{where}: a pair needs two distinct attributes")
            if frozenset((first, second)) in seen:
                raise ValueError(f"{where}: ({first!r}, {second!r}) is declared twice")
            seen.add(frozenset((first, second)))
            cells = (by_name[first].domain_size or 0) * (by_name[second].domain_size or 0)
            if cells > MAX_PAIR_CELLS:
                raise ValueError(f"{where}: {cells} cells, at most {MAX_PAIR_CELLS}")
            total += cells
        if total > MAX_TOTAL_PAIR_CELLS:
            raise ValueError(f"pairs: {total} cells in all, at most {MAX_TOTAL_PAIR_CELLS}")
        if self.oracle is None:
            fill_in(self, "oracle", "auto")
        if self.view_epsilon < MIN_EPSILON:
            raise ValueError(
                f"epsilon: {self.epsilon} split over {len(self.views)} views is "
                f"{self.view_epsilon:.3g} per view, below the least {MIN_EPSILON}"
            )
        return self

    @property
    def views(self) -> tuple[ViewPlan, ...]:
        """The declared pairs, then every attribute in no pair, in spec order."""
        position = {attribute.name: i for i, attribute in enumerate(self.attributes)}
        views = []
        paired: set[int] = set()
        for first, second in self.pairs or ():
            columns = (position[first], position[second])
            paired.update(columns)
            shape = tuple(self.attributes[c].domain_size or 0 for c in columns)
            views.append(ViewPlan(columns, shape))
        for column, attribute in enumerate(self.attributes):
            if column not in paired:
                size = attribute.domain_size
                views.append(ViewPlan((column,), (size,) if size is not None else ()))
        return tuple(views)

    @property
    def view_epsilon(self) -> float:
        """The epsilon each view is reported with: epsilon / k under ``spl``, else epsilon."""
        return self.epsilon / len(self.views) if self.mechanism == "spl" else self.epsilon


class SplSpec(MultiAttributeSpec):
    """``spl``: every view reported with epsilon / k."""

    mechanism: Literal["spl"]


class SmpSpec(MultiAttributeSpec):
    """``smp``: each device reports one uniformly sampled view with the whole epsilon."""

    mechanism: Literal["smp"]


class RsfdSpec(MultiAttributeSpec):
    """``rsfd``: one sampled view reported truly, every other with fake data, all with
    the whole epsilon (see ``shared.mechanisms.multidim`` on why not more)."""

    mechanism: Literal["rsfd"]
