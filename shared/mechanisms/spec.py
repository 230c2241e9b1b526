"""``MechanismSpec``: the base of every mechanism's spec model, and the limits all share.

A spec is the public privacy promise of a metric: which mechanism, at which epsilon,
with which parameters. Each mechanism module defines its own spec model, a subclass
whose ``mechanism`` field is the literal wire name and whose other fields are exactly
the parameters that mechanism takes (``GrrSpec`` in ``grr.py``: ``epsilon`` and
``domain_size``), registered with its mechanism (``shared.mechanisms.registry``). The
wire form is one JSON object ``{"mechanism": NAME, ...fields}``; which model reads it is
decided by ``mechanism`` alone (a discriminated union, ``shared.schemas.AnyMechanismSpec``
as a field type).

``MechanismSpec`` itself builds whichever model a name selects, so that callers need
not know the subclasses:

    >>> MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=4)
    GrrSpec(mechanism='grr', epsilon=1.0, domain_size=4)
    >>> MechanismSpec.model_validate({"mechanism": "duchi", "epsilon": 1, "lower": 0, "upper": 1})

Rules every spec follows, checked here once:

* a field that the named mechanism does not take is refused, naming it ("lower does not
  apply to the 'grr' mechanism"), and so is a missing required one;
* numbers are numbers: ``true`` is not 1;
* fields that default to ``None`` are left out of the wire form, so that the published
  spec (and its hash, ``shared.spec_hash``) lists only what the mechanism uses; a new
  field must therefore default to ``None``.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, Union, cast

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
    model_validator,
)

#: What a mechanism's values are and what is estimated of them: category indices
#: (frequencies), real numbers (a mean), strings (frequencies of strings), real numbers
#: estimated as a distribution (histogram, CDF, quantiles), or several private attributes
#: in one report (per-attribute frequencies or means, and 2-way marginals of declared pairs).
ValueKind: TypeAlias = Literal["categorical", "numeric", "string", "distribution", "attributes"]

#: Largest epsilon a spec may carry. Beyond it local noise is negligible and
#: e^epsilon-sized parameters (OLH's bucket count) stop fitting in 64 bits.
MAX_EPSILON = 20.0
#: Smallest epsilon a spec may carry. Below it a mechanism's two output probabilities
#: agree to ~1e-3, the estimates' variance exceeds 10^6 / n, and in floating point
#: e^epsilon rounds towards 1 (the debiasing divides by e^epsilon - 1).
MIN_EPSILON = 1e-3
#: Largest categorical domain: a unary-encoding report is domain_size bits.
MAX_DOMAIN_SIZE = 1 << 20
#: Largest grid of the numeric mechanisms that round their input.
MAX_GRID_STEPS = 1 << 16
#: Most buckets of a distribution metric: an estimate lists every bucket and edge.
MAX_BUCKETS = 4096

#: A privacy budget: finite, in [MIN_EPSILON, MAX_EPSILON].
Epsilon = Annotated[
    float,
    Field(
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description="Privacy budget of one report (pure epsilon-LDP).",
    ),
]

#: Spec models by wire name, filled as the mechanism modules define them.
_SPEC_MODELS: dict[str, type[MechanismSpec]] = {}


def spec_models() -> dict[str, type[MechanismSpec]]:
    """Every registered spec model by wire name. (Importing this module imports the package
    ``shared.mechanisms`` first, whose plug-ins define, and so register, them all.)"""
    return dict(_SPEC_MODELS)


def any_spec_type() -> Any:
    """The discriminated union of every registered spec model, on ``mechanism``: the field
    type wherever a spec is read (``shared.schemas.AnyMechanismSpec``)."""
    return Annotated[Union[tuple(_SPEC_MODELS.values())], Field(discriminator="mechanism")]  # noqa: UP007


@functools.cache
def _any_spec_adapter() -> TypeAdapter[MechanismSpec]:
    return TypeAdapter(any_spec_type())


def wire_name(model: type[MechanismSpec]) -> str | None:
    """The one literal of a model's ``mechanism`` annotation, or None for a family base."""
    annotation = model.model_fields["mechanism"].annotation
    if typing.get_origin(annotation) is Literal and len(typing.get_args(annotation)) == 1:
        name = typing.get_args(annotation)[0]
        return name if isinstance(name, str) else None
    return None


def register_spec_model(model: type[MechanismSpec]) -> str:
    """Make ``model`` the spec model of its wire name (``shared.mechanisms.registry``
    calls this when a mechanism registers); TypeError for a name already taken."""
    name = wire_name(model)
    if name is None:
        raise TypeError(f"{model.__name__}.mechanism is not one literal wire name")
    if _SPEC_MODELS.setdefault(name, model) is not model:
        raise TypeError(f"the mechanism name {name!r} is registered twice")
    _any_spec_adapter.cache_clear()
    return name


class MechanismSpec(BaseModel):
    """A mechanism and its parameters: ``{"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}``.

    The fields besides ``mechanism`` and ``epsilon`` belong to the mechanism: see the
    spec model in its module (``shared.mechanisms.<name>``) or the OpenAPI schema.
    Building ``MechanismSpec(...)`` or ``MechanismSpec.model_validate(...)`` returns the
    named mechanism's model; an unknown name is a ``ValidationError`` listing the known.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: What the mechanism's values are (set by each family of spec models).
    kind: ClassVar[ValueKind]
    #: Whether reports carry a memoized (permanent) response: ``epsilon`` is then the
    #: lifetime bound per distinct value and ``epsilon_report`` what one report reveals.
    is_memoized: ClassVar[bool] = False

    mechanism: str = Field(description="Wire name of the mechanism.")
    epsilon: Epsilon

    def __new__(cls, *args: Any, **data: Any) -> MechanismSpec:
        if cls is MechanismSpec:
            return super().__new__(_model_for(data))
        return super().__new__(cls)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # noqa: D102 - pydantic's
        if cls is MechanismSpec and not isinstance(obj, MechanismSpec):
            return _model_for(obj).model_validate(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Any:
        if cls is MechanismSpec:
            return _any_spec_adapter().validate_json(json_data, **kwargs)
        return super().model_validate_json(json_data, **kwargs)

    @model_validator(mode="before")
    @classmethod
    def _fields_of_this_mechanism(cls, data: Any) -> Any:
        """Refuse, with a sentence naming them, fields this mechanism does not take (a
        null one is taken as left out), missing required ones, and booleans given for
        numbers."""
        if not isinstance(data, dict) or cls is MechanismSpec:
            return data
        name = data.get("mechanism")
        foreign = [field for field in data if field not in cls.model_fields]
        for field in foreign:
            if data[field] is not None:
                raise ValueError(f"{field} does not apply to the {name!r} mechanism")
        data = {field: value for field, value in data.items() if field not in foreign}
        for field, value in data.items():
            if isinstance(value, bool):
                raise ValueError(f"{field} must be a number, not a boolean")
        missing = [
            field
            for field, info in cls.model_fields.items()
            if info.is_required() and field not in data
        ]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ValueError(f"{', '.join(missing)} {verb} required for the {name!r} mechanism")
        return data

    @model_serializer(mode="wrap")
    def _without_unused_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Serialize only the fields this mechanism uses: ``{"mechanism": "grr", ...}``."""
        return {key: value for key, value in handler(self).items() if value is not None}

    @property
    def report_epsilon(self) -> float:
        """What one report reveals: ``epsilon`` (a memoized spec: ``epsilon_report``)."""
        return self.epsilon

    @property
    def is_categorical(self) -> bool:
        return self.kind == "categorical"

    def with_changes(self, **changes: Any) -> MechanismSpec:
        """A new spec, validated, with some fields replaced (``mechanism`` included: the
        result is then the other mechanism's model)."""
        return MechanismSpec.model_validate(self.model_dump() | changes)


def _model_for(data: Any) -> type[MechanismSpec]:
    """The spec model ``data["mechanism"]`` names, or the ``ValidationError`` that the
    discriminated union gives for it (unknown or missing name)."""
    name = data.get("mechanism") if isinstance(data, dict) else None
    model = spec_models().get(name) if isinstance(name, str) else None
    if model is None:
        _any_spec_adapter().validate_python(data)  # raises: no model takes this name
        raise AssertionError("unreachable: the union accepted an unknown mechanism")
    return model


# --- families of spec models -----------------------------------------------------------


class CategoricalSpec(MechanismSpec):
    """A mechanism over categories 0..domain_size-1."""

    kind: ClassVar[ValueKind] = "categorical"

    domain_size: int = Field(
        ge=2, le=MAX_DOMAIN_SIZE, description="Number of categories (indices 0..d-1)."
    )


class BoundedSpec(MechanismSpec):
    """A mechanism over reals clipped to [lower, upper] (the numeric and distribution
    families)."""

    lower: float = Field(allow_inf_nan=False, description="Clipping lower bound.")
    upper: float = Field(allow_inf_nan=False, description="Clipping upper bound.")

    @model_validator(mode="after")
    def _range_is_usable(self) -> BoundedSpec:
        if not self.lower < self.upper:
            raise ValueError(f"lower must be < upper, got lower={self.lower}, upper={self.upper}")
        if not math.isfinite(self.upper - self.lower):
            raise ValueError("upper - lower must be finite")
        return self

    def clip(self, values: object) -> np.ndarray:
        """``values`` as float64 clipped to [lower, upper]; ValueError for NaN (naming its
        position) or an array that is not one-dimensional."""
        array = np.asarray(values, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(f"values must be a one-dimensional array, got shape {array.shape}")
        bad = np.flatnonzero(np.isnan(array))
        if bad.size:
            raise ValueError(f"value at position {bad[0]} is NaN; numeric values must be numbers")
        return np.clip(array, self.lower, self.upper)


class NumericSpec(BoundedSpec):
    """A mechanism over reals clipped to [lower, upper], estimated as a mean."""

    kind: ClassVar[ValueKind] = "numeric"


class GridNumericSpec(NumericSpec):
    """A numeric mechanism that rounds the clipped value to a grid of ``grid_steps``
    intervals (its default is the mechanism's; left out of the wire form when not given)."""

    grid_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GRID_STEPS,
        description="Grid intervals the clipped range [lower, upper] is rounded to.",
    )


#: How a distribution's range is cut into buckets: equal widths, or equal ratios.
Scale: TypeAlias = Literal["linear", "log"]


class DistributionSpec(BoundedSpec):
    """A mechanism over reals clipped to [lower, upper], estimated as a distribution over
    ``buckets`` buckets: equal widths (``scale = "linear"``) or equal ratios (``"log"``,
    for latencies and sizes; it needs lower > 0). Edge k of D = ``buckets`` is

        linear: lower + (upper - lower) k / D,      log: lower (upper / lower)^(k / D),

    and a value x lies in bucket b when edge b <= clip(x) < edge b + 1 (the last bucket also
    holds ``upper``). A subclass fills in its default ``buckets``; ``scale`` defaults to
    linear, so that the published spec states both.
    """

    kind: ClassVar[ValueKind] = "distribution"

    buckets: int | None = Field(
        default=None,
        ge=2,
        le=MAX_BUCKETS,
        description="Buckets the range [lower, upper] is cut into (the histogram's resolution).",
    )
    scale: Scale | None = Field(
        default=None,
        description="'linear' (equal widths, the default) or 'log' (equal ratios; lower > 0).",
    )

    @model_validator(mode="after")
    def _scale_fits_the_range(self) -> DistributionSpec:
        if self.scale is None:
            fill_in(self, "scale", "linear")
        if self.scale == "log" and not self.lower > 0:
            raise ValueError(f"scale 'log' needs lower > 0, got lower={self.lower}")
        if self.scale == "log" and not math.isfinite(math.log(self.upper / self.lower)):
            raise ValueError("scale 'log' needs a finite upper / lower")
        return self

    @property
    def bucket_count(self) -> int:
        """D, the number of buckets (filled in by every registered model)."""
        assert self.buckets is not None, "a distribution spec model fills in its buckets"
        return self.buckets

    def edges(self) -> np.ndarray:
        """The D + 1 bucket edges, lower first and upper last (float64)."""
        position = np.arange(self.bucket_count + 1, dtype=np.float64) / self.bucket_count
        if self.scale == "log":
            edges = self.lower * np.exp(position * math.log(self.upper / self.lower))
        else:
            edges = self.lower + position * (self.upper - self.lower)
        edges[0], edges[-1] = self.lower, self.upper
        return edges

    def bucket_of(self, values: object) -> np.ndarray:
        """The bucket (int64, 0..D-1) of each value after clipping to [lower, upper];
        ValueError for NaN or an array that is not one-dimensional."""
        clipped = self.clip(values)
        if self.scale == "log":
            position = np.log(clipped / self.lower) / math.log(self.upper / self.lower)
        else:
            position = (clipped - self.lower) / (self.upper - self.lower)
        buckets = np.floor(position * self.bucket_count).astype(np.int64)
        return np.clip(buckets, 0, self.bucket_count - 1)


def as_distribution_spec(spec: MechanismSpec) -> DistributionSpec | None:
    """``spec`` as a distribution spec (buckets, scale, edges), or None for a spec of
    another kind: how callers read those fields without testing for a class."""
    return cast(DistributionSpec, spec) if spec.kind == "distribution" else None


def fill_in(spec: MechanismSpec, field: str, value: object) -> None:
    """Set a derived field during validation (the model is frozen: once, there only), so
    that the published spec states the whole promise."""
    object.__setattr__(spec, field, value)
