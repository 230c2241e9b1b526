"""Pydantic models of the contracts the device and the server share.

``MechanismSpec`` is the privacy promise of a metric: which mechanism, at which
epsilon, over which domain. It is public (anyone may audit it) and it is all a
device needs to perturb a value and all the server needs to debias the reports.
"""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

CategoricalName: TypeAlias = Literal["grr", "sue", "oue", "olh", "hr", "auto"]
NumericName: TypeAlias = Literal["laplace", "duchi", "piecewise"]
MechanismName: TypeAlias = Literal[
    "grr", "sue", "oue", "olh", "hr", "auto", "laplace", "duchi", "piecewise"
]

CATEGORICAL_MECHANISMS: frozenset[str] = frozenset(CategoricalName.__args__)  # type: ignore[attr-defined]
NUMERIC_MECHANISMS: frozenset[str] = frozenset(NumericName.__args__)  # type: ignore[attr-defined]

#: Largest epsilon a spec may carry. Beyond it local noise is negligible and
#: e^epsilon-sized parameters (OLH's bucket count) stop fitting in 64 bits.
MAX_EPSILON = 20.0
#: Largest categorical domain: a unary-encoding report is domain_size bits.
MAX_DOMAIN_SIZE = 1 << 20
#: Largest grid for the discrete-Laplace mechanism.
MAX_GRID_STEPS = 1 << 16


class MechanismSpec(BaseModel):
    """A mechanism and its parameters: ``{"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}``.

    Categorical mechanisms (``grr``, ``sue``, ``oue``, ``olh``, ``hr``, ``auto``)
    take ``domain_size`` (categories are indices 0..domain_size-1). Numeric
    mechanisms (``laplace``, ``duchi``, ``piecewise``) take ``lower`` < ``upper``,
    the clipping range; ``laplace`` also takes ``grid_steps``, the number of grid
    intervals the clipped range is rounded to (default 1024).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mechanism: MechanismName = Field(description="Wire name of the mechanism.")
    epsilon: float = Field(
        gt=0.0,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description="Privacy budget of one report (pure epsilon-LDP).",
    )
    domain_size: int | None = Field(
        default=None,
        ge=2,
        le=MAX_DOMAIN_SIZE,
        description="Number of categories (categorical mechanisms only).",
    )
    lower: float | None = Field(
        default=None, allow_inf_nan=False, description="Clipping lower bound (numeric only)."
    )
    upper: float | None = Field(
        default=None, allow_inf_nan=False, description="Clipping upper bound (numeric only)."
    )
    grid_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GRID_STEPS,
        description="Grid intervals of [lower, upper] for the laplace mechanism.",
    )

    @field_validator("epsilon", "lower", "upper", "domain_size", "grid_steps", mode="before")
    @classmethod
    def _not_bool(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be a number, not a boolean")
        return value

    @model_validator(mode="after")
    def _fits_mechanism(self) -> MechanismSpec:
        name = self.mechanism
        if name in CATEGORICAL_MECHANISMS:
            if self.domain_size is None:
                raise ValueError(f"domain_size is required for the {name!r} mechanism")
            for field in ("lower", "upper", "grid_steps"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field} does not apply to the categorical {name!r} mechanism"
                    )
        else:
            if self.domain_size is not None:
                raise ValueError(f"domain_size does not apply to the numeric {name!r} mechanism")
            if self.lower is None or self.upper is None:
                raise ValueError(f"lower and upper are required for the {name!r} mechanism")
            if not self.lower < self.upper:
                raise ValueError(
                    f"lower must be < upper, got lower={self.lower}, upper={self.upper}"
                )
            if not math.isfinite(self.upper - self.lower):
                raise ValueError("upper - lower must be finite")
            if self.grid_steps is not None and name != "laplace":
                raise ValueError(f"grid_steps applies only to 'laplace', not {name!r}")
        return self

    @property
    def is_categorical(self) -> bool:
        return self.mechanism in CATEGORICAL_MECHANISMS
