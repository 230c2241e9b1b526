"""Pydantic models of the contracts the device and the server share.

``MechanismSpec`` is the privacy promise of a metric: which mechanism, at which
epsilon, over which domain. It is public (anyone may audit it) and it is all a
device needs to perturb a value and all the server needs to debias the reports.
Each mechanism module owns its spec model (``shared.mechanisms.spec``); here they
meet as one discriminated union, ``AnyMechanismSpec``.

The federated learning messages live in ``shared.federated.messages``: they are built
on the federated task model, which itself uses the names and bounds defined here, so
this module does not import them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, cast
from uuid import UUID

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict

from shared.dimensions import (
    MAX_DIMENSIONS,
    MAX_VALUE_LENGTH,
    NO_DIMENSIONS,
    DimensionError,
    Dimensions,
)
from shared.estimates import Estimate, MeanEstimate  # noqa: F401 - part of the contract
from shared.mechanisms.multidim import resolve_protocol
from shared.mechanisms.registry import MECHANISMS
from shared.mechanisms.spec import (  # noqa: F401 - part of the contract
    MAX_DOMAIN_SIZE,
    MAX_EPSILON,
    MIN_EPSILON,
    CategoricalSpec,
    MechanismSpec,
    any_spec_type,
    spec_models,
)

#: Names of metrics and federated tasks: lower-case letters, digits, '.', '_' and '-',
#: starting with a letter or digit, at most 64 characters.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")

_SPEC_MODELS = spec_models()
if TYPE_CHECKING:
    AnyMechanismSpec: TypeAlias = MechanismSpec
else:
    #: Any registered mechanism's spec, told apart by ``mechanism``.
    AnyMechanismSpec = any_spec_type()


def error_location(location: Sequence[int | str]) -> list[str]:
    """A validation error's location, without the mechanism name that the discriminated
    union inserts after ``mechanism`` (``mechanism.grr.epsilon`` reads ``mechanism.epsilon``)."""
    parts = [str(part) for part in location]
    return [
        part
        for i, part in enumerate(parts)
        if not (i and parts[i - 1] == "mechanism" and part in _SPEC_MODELS)
    ]


#: The wire names by kind of value, and the memoized ones (from the spec models).
CATEGORICAL_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.kind == "categorical"
)
NUMERIC_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.kind == "numeric"
)
DISTRIBUTION_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.kind == "distribution"
)
ATTRIBUTE_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.kind == "attributes"
)
STRING_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.kind == "string"
)
MEMOIZED_MECHANISMS: frozenset[str] = frozenset(
    name for name, model in _SPEC_MODELS.items() if model.is_memoized
)


# --- metrics ---------------------------------------------------------------------------

#: Longest label (category name or RAPPOR candidate string).
MAX_LABEL_LENGTH = 512
#: Most RAPPOR candidate strings a metric may list.
MAX_CANDIDATES = 100_000


class MetricDefinition(BaseModel):
    """A metric as its definer gives it: one metric of a TOML file, and the core of the
    body of ``PUT /v1/metrics/{name}`` (``MetricDocument``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: str = Field(default="", max_length=2000)
    unit: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description=(
            "Optional unit of a metric's values (e.g. 'minutes', 'ms'), shown on the "
            "dashboard's axes and tables. Like the description, changing it keeps the version."
        ),
    )
    mechanism: AnyMechanismSpec
    labels: tuple[str, ...] | None = Field(
        default=None,
        description=(
            "Categorical metrics: the category names in index order (exactly domain_size of "
            "them). RAPPOR: the candidate strings to decode against. Numeric, distribution "
            "and multi-attribute (their attributes carry their labels): omit."
        ),
    )
    dimensions: dict[str, tuple[str, ...]] | None = Field(
        default=None,
        description=(
            "Optional public dimensions (breakdowns): name -> allowed values, e.g. "
            '{"platform": ["android", "ios", "web"]}. Reports carry their values in the '
            "clear (NOT protected by local privacy; each cell is a smaller crowd: keep them "
            "coarse); estimates answer by= and where= over them. Names match "
            "^[a-z][a-z0-9_]{0,31}$; at most 8 dimensions of 1..64 distinct values (1..64 "
            "characters each), at most 4,096 cells (the product of the sizes). The order "
            "numbers the cells; changing them makes a new version."
        ),
    )

    @field_validator("mechanism", mode="before")
    @classmethod
    def _attributes_auto_resolved(cls, mechanism: Any) -> Any:
        """A multi-attribute spec named ``auto`` (``{"mechanism": "auto", "attributes":
        [...]}``) becomes the protocol of least variance (``resolve_protocol``), at
        definition time: the published promise names the protocol the devices run."""
        if isinstance(mechanism, dict) and mechanism.get("attributes") is not None:
            return resolve_protocol(mechanism)
        return mechanism

    @field_validator("dimensions")
    @classmethod
    def _dimensions_are_bounded(
        cls, dimensions: dict[str, tuple[str, ...]] | None
    ) -> dict[str, tuple[str, ...]] | None:
        if not dimensions:
            return None
        try:
            Dimensions(dimensions)
        except DimensionError as error:
            raise ValueError(str(error)) from None
        return dimensions

    @cached_property
    def dimension_set(self) -> Dimensions:
        """The declared dimensions as a ``Dimensions`` (one cell when there are none)."""
        return Dimensions(self.dimensions) if self.dimensions else NO_DIMENSIONS

    @field_validator("labels")
    @classmethod
    def _labels_are_distinct(cls, labels: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if labels is None:
            return None
        seen: set[str] = set()
        for index, label in enumerate(labels):
            if not label or len(label) > MAX_LABEL_LENGTH:
                raise ValueError(f"label {index} must have 1..{MAX_LABEL_LENGTH} characters")
            if label in seen:
                raise ValueError(f"label {label!r} is listed more than once")
            seen.add(label)
        return labels

    @model_validator(mode="after")
    def _labels_fit_the_mechanism(self) -> MetricDefinition:
        kind, labels = self.mechanism.kind, self.labels
        if isinstance(self.mechanism, CategoricalSpec) and labels is not None:
            if len(labels) != self.mechanism.domain_size:
                raise ValueError(
                    f"labels: got {len(labels)} labels for domain_size "
                    f"{self.mechanism.domain_size}; give one per category"
                )
        elif kind == "numeric" and labels is not None:
            raise ValueError("labels: numeric metrics take no labels (their range is in the spec)")
        elif kind == "distribution" and labels is not None:
            raise ValueError(
                "labels: distribution metrics take no labels (their range and buckets are in "
                "the spec)"
            )
        elif kind == "attributes" and labels is not None:
            raise ValueError(
                "labels: multi-attribute metrics take no labels (each categorical attribute "
                "names its values in the spec's attributes)"
            )
        elif kind == "string" and labels is not None and len(labels) > MAX_CANDIDATES:
            raise ValueError(f"labels: at most {MAX_CANDIDATES} RAPPOR candidates")
        return self


class MetricSpec(MetricDefinition):
    """A published metric version, as ``GET /v1/metrics`` lists it: a definition with its
    name and the version the server assigned. Fields it does not know are ignored, so that
    a device keeps reading the list when a newer aggregator adds some."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    version: int = Field(ge=1)

    def label_of(self, index: int) -> str | None:
        return self.labels[index] if self.labels is not None else None

    def same_spec(self, definition: MetricDefinition) -> bool:
        """Whether ``definition`` can share this version (it differs at most in its
        description or unit): the same mechanism, labels and dimensions (in order: the
        order numbers the cells)."""
        return (
            self.mechanism == definition.mechanism
            and self.labels == definition.labels
            and self.dimension_set == definition.dimension_set
        )


class MetricDocument(MetricDefinition):
    """The body of ``PUT /v1/metrics/{name}``: a definition, or a ``GET /v1/metrics`` item
    as it is, so that metrics exported from one aggregator load into another unchanged.

    ``name``, when given, must equal the name in the path (the route checks; a different
    name is refused, never taken as a rename). ``version`` is read-only: the server assigns
    versions (a new one when the spec or labels change), so a version given is checked to
    be a version number and otherwise ignored; whatever it says, the reply carries the
    version the server assigned. Other fields are refused, so that a misspelt field is
    never silently dropped.
    """

    name: str | None = Field(
        default=None, description="Optional; when given, the same name as in the path."
    )
    version: int | None = Field(
        default=None,
        ge=1,
        description="Read-only, ignored: the server assigns versions (see the reply).",
    )

    def definition(self) -> MetricDefinition:
        """The definition alone, without the name and version it was sent with."""
        return MetricDefinition(
            **{field: getattr(self, field) for field in MetricDefinition.model_fields}
        )


# --- reports (the body of POST /v1/reports and its reply) ------------------------------


#: The payload shapes of the registered mechanisms, each once (OpenAPI documentation;
#: ``from_payloads`` checks them).
PAYLOAD_SCHEMAS: list[dict[str, Any]] = list(
    {cls.payload_schema["title"]: cls.payload_schema for cls in MECHANISMS.values()}.values()
)


#: Payload keys are short names; values are integers, finite numbers or (base64) strings,
#: checked by pydantic's compiled validators (NaN and infinities refused), then by the
#: mechanism's ``from_payloads``.
PayloadKey = Annotated[str, StringConstraints(max_length=32)]
PayloadValue = StrictInt | Annotated[float, Field(strict=True, allow_inf_nan=False)] | StrictStr


#: A dimension name in a report (checked against the metric's at ingest).
DimensionName = Annotated[str, StringConstraints(max_length=32)]


class Report(BaseModel):
    """One perturbed report. It carries nothing that identifies the device."""

    model_config = ConfigDict(extra="forbid")

    report_id: UUID = Field(description="Random UUID chosen by the device; retries reuse it.")
    metric: str = Field(min_length=1, max_length=64)
    version: int = Field(
        strict=True, ge=1, le=2**31 - 1, description="The metric version the report was made for."
    )
    payload: dict[PayloadKey, PayloadValue] = Field(
        description=(
            "The mechanism's report: one JSON object of the shape its mechanism defines "
            "(bit vectors as base64 of numpy.packbits bytes); the shapes are listed here."
        ),
        json_schema_extra=cast(JsonDict, {"anyOf": PAYLOAD_SCHEMAS}),
    )
    time: datetime | None = Field(
        default=None,
        description="UTC time truncated to the hour (ISO-8601); the server's hour if absent.",
    )
    dimensions: (
        dict[DimensionName, Annotated[str, StringConstraints(max_length=MAX_VALUE_LENGTH)]] | None
    ) = Field(
        default=None,
        max_length=MAX_DIMENSIONS,
        description=(
            "The report's values of its metric's dimensions, in the clear (not protected by "
            'local privacy), e.g. {"platform": "ios"}: every dimension of the metric, '
            "one of its allowed values each; omit for a metric without dimensions."
        ),
    )

    @field_validator("time")
    @classmethod
    def _coarse_utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() != timedelta(0):
            raise ValueError("time must be UTC, e.g. 2026-11-22T10:00:00Z")
        if (value.minute, value.second, value.microsecond) != (0, 0, 0):
            raise ValueError("time must be truncated to the hour (a precise time can identify)")
        return value


#: Most reports in one ``POST /v1/reports`` batch (a server may set a lower limit).
MAX_BATCH_REPORTS = 10_000


class ReportBatch(BaseModel):
    """The body of ``POST /v1/reports``: 1 to ``MAX_BATCH_REPORTS`` reports.

    The length is checked while the list is validated: the report after the limit stops
    the validation, so an oversized batch costs no more than a full one.
    """

    model_config = ConfigDict(extra="forbid")

    reports: list[Report] = Field(min_length=1, max_length=MAX_BATCH_REPORTS)


class IngestResult(BaseModel):
    """The reply to ``POST /v1/reports``: reports newly counted, and retries ignored."""

    accepted: int
    duplicates: int
