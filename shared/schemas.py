"""Pydantic models of the contracts the device and the server share.

``MechanismSpec`` is the privacy promise of a metric: which mechanism, at which
epsilon, over which domain. It is public (anyone may audit it) and it is all a
device needs to perturb a value and all the server needs to debias the reports.

Mechanisms come in three kinds: categorical (values are indices 0..d-1),
numeric (values are reals clipped to [lower, upper]) and string (``rappor``:
values are strings, hashed into a Bloom filter; the spec carries the Bloom
filter and the randomized-response probabilities instead of an epsilon, and
epsilon is derived from them, see ``rappor_epsilon_one``).

The federated learning messages live in ``shared.federated.messages``: they are built
on the federated task model, which itself uses the names and bounds defined here, so
this module does not import them.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal, TypeAlias, cast
from uuid import UUID

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonDict

from shared.estimates import Estimate, MeanEstimate  # noqa: F401 - part of the contract

CategoricalName: TypeAlias = Literal[
    "grr", "sue", "oue", "olh", "hr", "auto", "lgrr", "lsue", "loue", "losue", "dbitflip"
]
NumericName: TypeAlias = Literal["laplace", "duchi", "piecewise", "onebitmean"]
StringName: TypeAlias = Literal["rappor", "cms", "hcms", "pem", "sfp"]
MechanismName: TypeAlias = Literal[
    "grr",
    "sue",
    "oue",
    "olh",
    "hr",
    "auto",
    "lgrr",
    "lsue",
    "loue",
    "losue",
    "dbitflip",
    "laplace",
    "duchi",
    "piecewise",
    "onebitmean",
    "rappor",
    "cms",
    "hcms",
    "pem",
    "sfp",
]

#: Names of metrics and federated tasks: lower-case letters, digits, '.', '_' and '-',
#: starting with a letter or digit, at most 64 characters.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")

CATEGORICAL_MECHANISMS: frozenset[str] = frozenset(CategoricalName.__args__)  # type: ignore[attr-defined]
NUMERIC_MECHANISMS: frozenset[str] = frozenset(NumericName.__args__)  # type: ignore[attr-defined]
#: Mechanisms whose values are strings (encode takes cohorts and per-device secrets).
STRING_MECHANISMS: frozenset[str] = frozenset(StringName.__args__)  # type: ignore[attr-defined]
#: The fields only ``rappor`` takes, and that ``rappor`` requires.
RAPPOR_FIELDS: tuple[str, ...] = ("num_bits", "num_hashes", "num_cohorts", "f", "p", "q")
#: Open-domain string mechanisms that keep a k x m count sketch (``sketch_width`` m,
#: ``sketch_depth`` k): Apple's Count Mean Sketch, its Hadamard variant, and SFP's.
SKETCH_MECHANISMS: frozenset[str] = frozenset({"cms", "hcms", "sfp"})
#: String mechanisms that find heavy hitters without candidates (``max_length`` bytes).
DISCOVERY_MECHANISMS: frozenset[str] = frozenset({"pem", "sfp"})
#: Largest count sketch: sketch_depth * sketch_width counts (32 MiB of int64).
MAX_SKETCH_CELLS = 1 << 22
#: Longest string a discovery mechanism takes (UTF-8 bytes).
MAX_STRING_BYTES = 256
#: Memoized (longitudinal) mechanisms: ``epsilon`` bounds what any number of reports of one
#: value reveal, ``epsilon_report`` what one report reveals.
MEMOIZED_MECHANISMS: frozenset[str] = frozenset(
    {"lgrr", "lsue", "loue", "losue", "dbitflip", "onebitmean"}
)
#: Memoized mechanisms with a fresh instantaneous response per report, whose
#: ``epsilon_report`` (< ``epsilon``) the spec chooses; the others derive it.
CHAINED_MECHANISMS: frozenset[str] = frozenset({"lgrr", "lsue", "loue", "losue"})

#: Largest epsilon a spec may carry. Beyond it local noise is negligible and
#: e^epsilon-sized parameters (OLH's bucket count) stop fitting in 64 bits.
MAX_EPSILON = 20.0
#: Smallest epsilon a spec may carry. Below it a mechanism's two output probabilities
#: agree to ~1e-3, the estimates' variance exceeds 10^6 / n, and in floating point
#: e^epsilon rounds towards 1 (the debiasing divides by e^epsilon - 1).
MIN_EPSILON = 1e-3
#: Largest categorical domain: a unary-encoding report is domain_size bits.
MAX_DOMAIN_SIZE = 1 << 20
#: Largest grid for the discrete-Laplace mechanism.
MAX_GRID_STEPS = 1 << 16
#: Largest RAPPOR Bloom filter (bits per report).
MAX_NUM_BITS = 4096
#: Most RAPPOR hash functions: each is one byte of an MD5 digest (16 bytes).
MAX_NUM_HASHES = 16
#: Most RAPPOR cohorts.
MAX_NUM_COHORTS = 1 << 16
#: Largest RAPPOR statistics: num_cohorts * (num_bits + 1) counts (32 MiB of int64).
MAX_RAPPOR_CELLS = 1 << 22


def rappor_report_probabilities(f: float, p: float, q: float) -> tuple[float, float]:
    """``(p*, q*)``: P(reported bit = 1) when the Bloom bit is 0, and when it is 1.

    The permanent randomized response keeps a Bloom bit with probability 1 - f
    and otherwise sets it to 1 or 0 with probability f/2 each; the instantaneous
    one reports 1 with probability q if the permanent bit is 1, p if it is 0.
    So (Erlingsson, Pihur, Korolova, CCS 2014, Section 3)

        q* = f (p + q) / 2 + (1 - f) q,    p* = f (p + q) / 2 + (1 - f) p.
    """
    shared = f * (p + q) / 2
    return shared + (1 - f) * p, shared + (1 - f) * q


def rappor_epsilon_one(num_hashes: int, f: float, p: float, q: float) -> float:
    """Epsilon of one RAPPOR report: ``h ln(q* (1 - p*) / (p* (1 - q*)))``.

    Two values' Bloom filters differ in at most h bits set in one and h in the
    other; each reported bit is an independent randomized response with
    P(1 | bit 1) = q*, P(1 | bit 0) = p*, so the likelihood ratio is at most
    (q* / p*)^h ((1 - p*) / (1 - q*))^h (tight when num_bits >= 2 h). Infinite
    when p* = 0 or q* = 1.
    """
    p_star, q_star = rappor_report_probabilities(f, p, q)
    if p_star <= 0.0 or q_star >= 1.0:
        return math.inf
    return num_hashes * math.log(q_star * (1 - p_star) / (p_star * (1 - q_star)))


def onebitmean_epsilon_report(epsilon: float, flip_probability: float) -> float:
    """Epsilon of one ``onebitmean`` report with output perturbation ``gamma``.

    The memoized bit is 1 with probability between 1 / (e^eps + 1) and e^eps / (e^eps + 1)
    (Ding, Kulkarni and Yekhanin, NeurIPS 2017, 1BitMean); flipping it with probability
    gamma before it is sent moves each probability pi to gamma + (1 - 2 gamma) pi, so one
    report is ``ln((e^eps (1 - gamma) + gamma) / (e^eps gamma + 1 - gamma))``-LDP (equal to
    eps at gamma = 0), while any number of reports stay post-processing of the memoized
    bits (eps per distinct rounded value).
    """
    grown = math.exp(epsilon)
    gamma = flip_probability
    return math.log((grown * (1 - gamma) + gamma) / (grown * gamma + 1 - gamma))


def rappor_epsilon_infinity(num_hashes: int, f: float) -> float:
    """Lifetime epsilon of one value: ``2 h ln((1 - f/2) / (f/2))`` (infinite for f = 0).

    The permanent randomized response is memoized, so any number of reports of
    the same value are post-processing of one PRR, whose per-bit likelihood
    ratio is (1 - f/2) / (f/2) over at most 2 h differing Bloom bits.
    """
    if f <= 0.0:
        return math.inf
    return 2 * num_hashes * math.log((1 - f / 2) / (f / 2))


class MechanismSpec(BaseModel):
    """A mechanism and its parameters: ``{"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}``.

    Categorical mechanisms (``grr``, ``sue``, ``oue``, ``olh``, ``hr``, ``auto``)
    take ``domain_size`` (categories are indices 0..domain_size-1). Numeric
    mechanisms (``laplace``, ``duchi``, ``piecewise``) take ``lower`` < ``upper``,
    the clipping range; ``laplace`` and ``piecewise`` also take ``grid_steps``, the
    number of grid intervals the clipped range is rounded to (default 1024).

    ``rappor`` takes ``num_bits`` (k), ``num_hashes`` (h), ``num_cohorts`` (m),
    ``f``, ``p`` and ``q``, all required, e.g. ``{"mechanism": "rappor",
    "num_bits": 32, "num_hashes": 1, "num_cohorts": 64, "f": 0.5, "p": 0.25,
    "q": 0.75}``. Its ``epsilon`` is the per-report epsilon_one these imply
    (``rappor_epsilon_one``): omit it and it is filled in; give it and it must
    agree (relative 1e-9). Every other mechanism requires ``epsilon``.

    Open-domain strings: ``cms`` and ``hcms`` (Apple's Count Mean Sketch and its Hadamard
    variant) take ``epsilon``, ``sketch_width`` (m; a power of two for ``hcms``) and
    ``sketch_depth`` (k) and answer the frequency of any candidate string; ``pem`` (prefix
    extension) and ``sfp`` (Apple's Sequence Fragment Puzzle, with a sketch too) take
    ``max_length`` (UTF-8 bytes) and find the most frequent strings without candidates.

    Memoized (longitudinal) mechanisms, for values reported again and again: categorical
    ``lgrr``, ``lsue``, ``loue``, ``losue`` and ``dbitflip``, numeric ``onebitmean``.
    Their ``epsilon`` is the lifetime bound per distinct value (what any number of
    reports of one value reveal) and ``epsilon_report`` what one report reveals.
    ``lgrr`` and the unary ones chain a memoized and a fresh response and require
    ``epsilon_report`` < ``epsilon``, e.g. ``{"mechanism": "lgrr", "epsilon": 2.0,
    "epsilon_report": 1.0, "domain_size": 8}``. ``dbitflip`` takes ``bits_per_device``
    (default 1, filled in) and reports only memoized bits (``epsilon_report`` =
    ``epsilon``, filled in); ``onebitmean`` takes ``lower``, ``upper``, ``grid_steps``
    (the rounding grid, default 8) and ``flip_probability`` (default 0), and its
    ``epsilon_report`` is filled in from them (``onebitmean_epsilon_report``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mechanism: MechanismName = Field(description="Wire name of the mechanism.")
    # Typed float for every caller: it is required for every mechanism but rappor,
    # whose validator fills it in, so the default None never survives validation.
    epsilon: float = Field(  # type: ignore[assignment]
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description=(
            "Privacy budget of one report (pure epsilon-LDP). Required, except for rappor, "
            "where it is derived from num_hashes, f, p and q."
        ),
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
        description="Grid intervals of [lower, upper] for the laplace and piecewise mechanisms.",
    )
    num_bits: int | None = Field(
        default=None, ge=1, le=MAX_NUM_BITS, description="RAPPOR: Bloom filter bits k."
    )
    num_hashes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NUM_HASHES,
        description="RAPPOR: hash functions h (bits set per value).",
    )
    num_cohorts: int | None = Field(
        default=None, ge=1, le=MAX_NUM_COHORTS, description="RAPPOR: cohorts m."
    )
    f: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="RAPPOR: probability that the permanent response replaces a Bloom bit.",
    )
    p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="RAPPOR: P(reported 1 | permanent bit 0).",
    )
    q: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="RAPPOR: P(reported 1 | permanent bit 1).",
    )
    sketch_width: int | None = Field(
        default=None,
        ge=2,
        le=MAX_SKETCH_CELLS,
        description="cms, hcms, sfp: columns m of the count sketch (hcms: a power of two).",
    )
    sketch_depth: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SKETCH_CELLS,
        description="cms, hcms, sfp: hash functions k, the rows of the count sketch.",
    )
    max_length: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STRING_BYTES,
        description="pem, sfp: the longest string (UTF-8 bytes) a device may report.",
    )
    epsilon_report: float | None = Field(
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description=(
            "Memoized mechanisms: what one report reveals. Required, and below epsilon, for "
            "lgrr, lsue, loue and losue (epsilon is then the lifetime bound per distinct "
            "value); derived for dbitflip (= epsilon) and onebitmean (from flip_probability)."
        ),
    )
    bits_per_device: int | None = Field(
        default=None,
        ge=1,
        le=MAX_DOMAIN_SIZE,
        description="dbitflip: buckets each device samples once and reports (default 1).",
    )
    flip_probability: float | None = Field(
        default=None,
        ge=0.0,
        lt=0.5,
        allow_inf_nan=False,
        description=(
            "onebitmean: output perturbation, the probability that each report's memoized "
            "bit is flipped before it is sent (default 0); hides when a memoized value changes."
        ),
    )

    @field_validator(
        "epsilon",
        "lower",
        "upper",
        "domain_size",
        "grid_steps",
        "num_bits",
        "num_hashes",
        "num_cohorts",
        "f",
        "p",
        "q",
        "epsilon_report",
        "bits_per_device",
        "flip_probability",
        "sketch_width",
        "sketch_depth",
        "max_length",
        mode="before",
    )
    @classmethod
    def _not_bool(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be a number, not a boolean")
        return value

    @model_validator(mode="after")
    def _fits_mechanism(self) -> MechanismSpec:
        name = self.mechanism
        if name == "rappor":
            return self._fits_rappor()
        if self.epsilon is None:
            raise ValueError(f"epsilon is required for the {name!r} mechanism")
        self._fits_open_strings()
        if name in STRING_MECHANISMS:
            return self
        for field in RAPPOR_FIELDS:
            if getattr(self, field) is not None:
                raise ValueError(f"{field} applies only to the 'rappor' mechanism, not {name!r}")
        self._fits_memoization()
        if name in CATEGORICAL_MECHANISMS:
            if self.domain_size is None:
                raise ValueError(f"domain_size is required for the {name!r} mechanism")
            if self.bits_per_device is not None and self.bits_per_device > self.domain_size:
                raise ValueError(
                    f"bits_per_device = {self.bits_per_device} exceeds domain_size = "
                    f"{self.domain_size}: a device samples at most every bucket once"
                )
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
            if self.grid_steps is not None and name not in ("laplace", "piecewise", "onebitmean"):
                raise ValueError(
                    f"grid_steps applies only to 'laplace', 'piecewise' and 'onebitmean', "
                    f"not {name!r}"
                )
        return self

    def _fits_open_strings(self) -> None:
        """The fields of the open-domain string mechanisms: required where they apply,
        refused elsewhere; the numeric, categorical and memoized fields refused for them."""
        name = self.mechanism
        owners = {
            "sketch_width": SKETCH_MECHANISMS,
            "sketch_depth": SKETCH_MECHANISMS,
            "max_length": DISCOVERY_MECHANISMS,
        }
        for field, names in owners.items():
            if name in names and getattr(self, field) is None:
                raise ValueError(f"{field} is required for the {name!r} mechanism")
            if name not in names and getattr(self, field) is not None:
                raise ValueError(
                    f"{field} applies only to the {', '.join(map(repr, sorted(names)))} "
                    f"mechanisms, not {name!r}"
                )
        if name not in STRING_MECHANISMS:
            return
        for field in (
            "domain_size",
            "lower",
            "upper",
            "grid_steps",
            *RAPPOR_FIELDS,
            "epsilon_report",
            "bits_per_device",
            "flip_probability",
        ):
            if getattr(self, field) is not None:
                raise ValueError(f"{field} does not apply to the {name!r} mechanism")
        if name in SKETCH_MECHANISMS:
            assert self.sketch_width is not None and self.sketch_depth is not None
            cells = self.sketch_width * self.sketch_depth
            if cells > MAX_SKETCH_CELLS:
                raise ValueError(
                    f"sketch_depth * sketch_width = {cells} counts exceeds {MAX_SKETCH_CELLS}; "
                    "use a smaller sketch"
                )
            if name in ("hcms", "sfp") and self.sketch_width & (self.sketch_width - 1):
                raise ValueError(
                    f"sketch_width must be a power of two for {name!r} (a Hadamard "
                    f"transform's size), got {self.sketch_width}"
                )
            if name == "sfp":
                assert self.max_length is not None
                sketches = (self.max_length + 1) // 2 + 1
                if sketches * cells > MAX_SKETCH_CELLS:
                    raise ValueError(
                        f"sfp keeps ceil(max_length / 2) + 1 = {sketches} sketches of "
                        f"sketch_depth * sketch_width = {cells} counts: {sketches * cells} "
                        f"exceeds {MAX_SKETCH_CELLS}; use a smaller sketch or max_length"
                    )

    def _fits_memoization(self) -> None:
        """Check the memoized mechanisms' fields, and fill in what they derive (frozen model:
        set once, here, during validation), so that the published spec states the promise."""
        name = self.mechanism
        owners = {"bits_per_device": "dbitflip", "flip_probability": "onebitmean"}
        for field, owner in owners.items():
            if getattr(self, field) is not None and name != owner:
                raise ValueError(f"{field} applies only to the {owner!r} mechanism, not {name!r}")
        if name not in MEMOIZED_MECHANISMS:
            if self.epsilon_report is not None:
                raise ValueError(
                    f"epsilon_report applies only to memoized mechanisms "
                    f"({', '.join(sorted(MEMOIZED_MECHANISMS))}), not {name!r}"
                )
            return
        if name in CHAINED_MECHANISMS:
            if self.epsilon_report is None:
                raise ValueError(
                    f"epsilon_report is required for the {name!r} mechanism (what one report "
                    "reveals; epsilon is the lifetime bound per distinct value)"
                )
            if not self.epsilon_report < self.epsilon:
                raise ValueError(
                    f"epsilon_report must be < epsilon (one report reveals less than the "
                    f"memoized response), got epsilon_report={self.epsilon_report}, "
                    f"epsilon={self.epsilon}"
                )
            if name == "loue":  # an OUE instantaneous response cannot reveal more than this
                limit = math.log((2 * math.exp(self.epsilon) + 1) / 3)
                if self.epsilon_report > limit:
                    raise ValueError(
                        f"epsilon_report = {self.epsilon_report} is more than one 'loue' report "
                        f"can reveal at epsilon = {self.epsilon} (at most ln((2 e^epsilon + 1) "
                        f"/ 3) = {limit:.6g}); lower epsilon_report or use 'losue'"
                    )
            return
        if name == "dbitflip":
            derived = self.epsilon
            if self.bits_per_device is None:
                object.__setattr__(self, "bits_per_device", 1)
        else:
            derived = onebitmean_epsilon_report(self.epsilon, self.flip_probability or 0.0)
            if derived < MIN_EPSILON:
                raise ValueError(
                    f"flip_probability = {self.flip_probability} leaves one report "
                    f"epsilon_report = {derived:.3g}, below {MIN_EPSILON}: lower it"
                )
        if self.epsilon_report is None:
            object.__setattr__(self, "epsilon_report", derived)
        elif not math.isclose(self.epsilon_report, derived, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"epsilon_report = {self.epsilon_report} disagrees with {derived!r}, what one "
                f"{name!r} report reveals with these parameters; omit it or give that value"
            )

    def _fits_rappor(self) -> MechanismSpec:
        """Require the six RAPPOR fields, refuse the others, derive or check epsilon."""
        name = self.mechanism
        for field in (
            "domain_size",
            "lower",
            "upper",
            "grid_steps",
            "epsilon_report",
            "bits_per_device",
            "flip_probability",
            "sketch_width",
            "sketch_depth",
            "max_length",
        ):
            if getattr(self, field) is not None:
                raise ValueError(f"{field} does not apply to the {name!r} mechanism")
        missing = [field for field in RAPPOR_FIELDS if getattr(self, field) is None]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ValueError(f"{', '.join(missing)} {verb} required for the {name!r} mechanism")
        assert self.num_bits is not None and self.num_hashes is not None
        assert self.num_cohorts is not None
        assert self.f is not None and self.p is not None and self.q is not None
        if not self.p < self.q:
            raise ValueError(f"p must be < q, got p={self.p}, q={self.q}")
        cells = self.num_cohorts * (self.num_bits + 1)
        if cells > MAX_RAPPOR_CELLS:
            raise ValueError(
                f"num_cohorts * (num_bits + 1) = {cells} counts exceeds {MAX_RAPPOR_CELLS}; "
                "use fewer cohorts or bits"
            )
        derived = rappor_epsilon_one(self.num_hashes, self.f, self.p, self.q)
        if not derived <= MAX_EPSILON:
            raise ValueError(
                f"epsilon_one = {derived} implied by num_hashes={self.num_hashes}, f={self.f}, "
                f"p={self.p}, q={self.q} exceeds {MAX_EPSILON}; raise f or bring p and q closer"
            )
        if derived < MIN_EPSILON:
            raise ValueError(
                f"epsilon_one = {derived} implied by num_hashes={self.num_hashes}, f={self.f}, "
                f"p={self.p}, q={self.q} is below {MIN_EPSILON}: the reports would carry no "
                "signal; lower f or move p and q apart"
            )
        if self.epsilon is None:
            # Frozen model: set the derived field once, here, during validation.
            object.__setattr__(self, "epsilon", derived)
        elif not math.isclose(self.epsilon, derived, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"epsilon = {self.epsilon} disagrees with epsilon_one = {derived!r} implied by "
                f"num_hashes={self.num_hashes}, f={self.f}, p={self.p}, q={self.q}; omit epsilon "
                "or give that value"
            )
        return self

    @property
    def is_categorical(self) -> bool:
        return self.mechanism in CATEGORICAL_MECHANISMS

    @property
    def is_memoized(self) -> bool:
        """Whether reports carry a memoized (permanent) response: ``epsilon`` is then the
        lifetime bound per distinct value and ``epsilon_report`` what one report reveals."""
        return self.mechanism in MEMOIZED_MECHANISMS

    @model_serializer(mode="wrap")
    def _without_unused_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Serialize only the fields this mechanism takes: ``{"mechanism": "grr", ...}``."""
        return {key: value for key, value in handler(self).items() if value is not None}

    @property
    def kind(self) -> Literal["categorical", "numeric", "string"]:
        """The kind of values the mechanism takes: category indices, reals, or strings."""
        if self.mechanism in CATEGORICAL_MECHANISMS:
            return "categorical"
        if self.mechanism in STRING_MECHANISMS:
            return "string"
        return "numeric"


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
    mechanism: MechanismSpec
    labels: tuple[str, ...] | None = Field(
        default=None,
        description=(
            "Categorical metrics: the category names in index order (exactly domain_size of "
            "them). RAPPOR: the candidate strings to decode against. Numeric: omit."
        ),
    )

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
        if kind == "categorical" and labels is not None:
            if len(labels) != self.mechanism.domain_size:
                raise ValueError(
                    f"labels: got {len(labels)} labels for domain_size "
                    f"{self.mechanism.domain_size}; give one per category"
                )
        elif kind == "numeric" and labels is not None:
            raise ValueError("labels: numeric metrics take no labels (their range is in the spec)")
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
        description or unit)."""
        return self.mechanism == definition.mechanism and self.labels == definition.labels


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


def _payload_schema(title: str, **properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "title": title,
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


_INTEGER: dict[str, Any] = {"type": "integer"}
_BASE64: dict[str, Any] = {"type": "string", "contentEncoding": "base64"}
#: The payload shapes of the mechanisms (OpenAPI documentation; ``from_payloads`` checks).
PAYLOAD_SCHEMAS: list[dict[str, Any]] = [
    _payload_schema("IndexPayload", value=_INTEGER),
    _payload_schema("BitsPayload", bits=_BASE64),
    _payload_schema("HashPayload", a=_INTEGER, b=_INTEGER, value=_INTEGER),
    _payload_schema("RapporPayload", cohort=_INTEGER, bits=_BASE64),
    _payload_schema("BucketBitsPayload", buckets=_BASE64, bits=_BASE64),
    _payload_schema("SketchBitsPayload", row=_INTEGER, bits=_BASE64),
    _payload_schema("SketchSignPayload", row=_INTEGER, column=_INTEGER, bit=_INTEGER),
    _payload_schema("PrefixPayload", group=_INTEGER, seed=_INTEGER, value=_INTEGER),
    _payload_schema(
        "FragmentPayload", kind=_INTEGER, position=_INTEGER, row=_INTEGER, bits=_BASE64
    ),
]


#: Payload keys are short names; values are integers, finite numbers or (base64) strings,
#: checked by pydantic's compiled validators (NaN and infinities refused), then by the
#: mechanism's ``from_payloads``.
PayloadKey = Annotated[str, StringConstraints(max_length=32)]
PayloadValue = StrictInt | Annotated[float, Field(strict=True, allow_inf_nan=False)] | StrictStr


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
            "The mechanism's report: {'value': int} (grr, lgrr, hr; laplace: grid index; "
            "duchi: +1/-1; piecewise: cell index; onebitmean: 0/1), {'bits': base64} (sue, "
            "oue, lsue, loue, losue: numpy.packbits bytes), {'a', 'b', 'value'} (olh), "
            "{'cohort': int, 'bits': base64} (rappor: bit i is bit i % 8 of byte i // 8), "
            "{'buckets': base64 of little-endian uint32 bucket indices, 'bits': base64 of "
            "numpy.packbits bytes, one bit per bucket} (dbitflip), {'row': int, 'bits': "
            "base64 of the sketch_width signs as numpy.packbits bytes, 1 for +1} (cms), "
            "{'row': int, 'column': int, 'bit': 0 or 1} (hcms: a Hadamard coefficient's "
            "sign), {'group': int, 'seed': int, 'value': int} (pem: the group's prefix "
            "hashed by the seed, then randomized over the buckets), {'kind': 0 or 1, "
            "'position': int, 'row': int, 'bits': base64} (sfp: a cms report of the whole "
            "string, kind 0 at position 0, or of the fragment at a position, kind 1)."
        ),
        json_schema_extra=cast(JsonDict, {"anyOf": PAYLOAD_SCHEMAS}),
    )
    time: datetime | None = Field(
        default=None,
        description="UTC time truncated to the hour (ISO-8601); the server's hour if absent.",
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
