"""MechanismSpec validation, its JSON form, and what ``auto`` resolves to.

A spec is the public privacy promise of a metric, so an invalid one must be refused
when it is built, with a pydantic ValidationError (a ValueError) that names the field.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from shared.mechanisms import MECHANISMS, make_mechanism
from shared.mechanisms.memoized import ChainedReport, ChainedSpec
from shared.mechanisms.spec import MAX_GRID_STEPS, spec_models
from shared.schemas import (
    ATTRIBUTE_MECHANISMS,
    CATEGORICAL_MECHANISMS,
    DISTRIBUTION_MECHANISMS,
    MAX_DOMAIN_SIZE,
    MAX_EPSILON,
    MEMOIZED_MECHANISMS,
    MIN_EPSILON,
    NUMERIC_MECHANISMS,
    STRING_MECHANISMS,
    MechanismSpec,
)

CATEGORICAL = sorted(CATEGORICAL_MECHANISMS)
NUMERIC = sorted(NUMERIC_MECHANISMS)
#: Mechanisms over strings (rappor); their specs are tested in detail in test_rappor_spec.py.
STRING = sorted(STRING_MECHANISMS)
#: The concrete frequency oracles ``auto`` chooses among.
AUTO_CANDIDATES = ("grr", "sue", "oue", "olh", "hr")

RAPPOR_FIELDS = ("num_bits", "num_hashes", "num_cohorts", "f", "p", "q")
CHAINED_MECHANISMS = frozenset(
    name for name, model in spec_models().items() if issubclass(model, ChainedSpec)
)
#: The multi-attribute protocols (spl, smp, rsfd; kind "attributes"): their specs are
#: tested in detail in test_multidim.py.


def valid_fields(name: str) -> dict[str, Any]:
    """A minimal valid spec for ``name``, as keyword arguments."""
    if name in ATTRIBUTE_MECHANISMS:
        return {
            "mechanism": name,
            "epsilon": 1.0,
            "attributes": [{"name": "a", "domain_size": 2}, {"name": "b", "lower": 0, "upper": 1}],
        }
    if name in CHAINED_MECHANISMS:
        return {"mechanism": name, "epsilon": 1.0, "epsilon_report": MIN_EPSILON, "domain_size": 4}
    if name in CATEGORICAL_MECHANISMS:
        return {"mechanism": name, "epsilon": 1.0, "domain_size": 4}
    if name in ("cms", "hcms"):
        return {"mechanism": name, "epsilon": 1.0, "sketch_width": 64, "sketch_depth": 4}
    if name == "pem":
        return {"mechanism": name, "epsilon": 1.0, "max_length": 8}
    if name == "sfp":
        return {
            "mechanism": name,
            "epsilon": 1.0,
            "sketch_width": 64,
            "sketch_depth": 4,
            "max_length": 8,
        }
    if name in STRING_MECHANISMS:  # epsilon is derived from (num_hashes, f, p, q)
        return {
            "mechanism": name,
            "num_bits": 32,
            "num_hashes": 1,
            "num_cohorts": 64,
            "f": 0.5,
            "p": 0.25,
            "q": 0.75,
        }
    bounded = {"mechanism": name, "epsilon": 1.0, "lower": -1.0, "upper": 2.0}
    if issubclass(spec_models()[name], ChainedReport):  # lhh: a chained distribution
        return bounded | {"epsilon_report": MIN_EPSILON}
    return bounded


def error_text(error: ValidationError) -> str:
    """Each error's location and message, without the echoed input (which names every field)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
    )


def assert_refused(fields: dict[str, Any], *named: str) -> None:
    """Building the spec fails with a ValidationError whose messages name every ``named`` field."""
    with pytest.raises(ValidationError) as info:
        MechanismSpec(**fields)
    assert isinstance(info.value, ValueError)
    text = error_text(info.value)
    for field in named:
        assert field in text, text


def test_validation_error_is_a_value_error() -> None:
    assert issubclass(ValidationError, ValueError)


def test_schema_names_match_the_registry() -> None:
    assert CATEGORICAL_MECHANISMS.isdisjoint(NUMERIC_MECHANISMS)
    assert STRING_MECHANISMS.isdisjoint(CATEGORICAL_MECHANISMS | NUMERIC_MECHANISMS)
    others = CATEGORICAL_MECHANISMS | NUMERIC_MECHANISMS | STRING_MECHANISMS
    assert DISTRIBUTION_MECHANISMS.isdisjoint(others)
    assert ATTRIBUTE_MECHANISMS.isdisjoint(others | DISTRIBUTION_MECHANISMS)
    assert others | DISTRIBUTION_MECHANISMS | ATTRIBUTE_MECHANISMS == set(MECHANISMS) | {"auto"}
    for name, cls in MECHANISMS.items():
        assert cls.name == name
        assert cls.kind == MechanismSpec(**valid_fields(name)).kind


# ---------------------------------------------------------------------------------------
# Refused specs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CATEGORICAL + NUMERIC)
@pytest.mark.parametrize(
    "epsilon",
    [
        0.0,
        -0.0,
        -1.0,
        1e-300,
        MIN_EPSILON * (1 - 1e-12),
        -math.inf,
        math.nan,
        math.inf,
        MAX_EPSILON * (1 + 1e-12),
        1e300,
    ],
)
def test_epsilon_must_be_positive_finite_and_at_most_the_maximum(name: str, epsilon: float) -> None:
    assert_refused({**valid_fields(name), "epsilon": epsilon}, "epsilon")


@pytest.mark.parametrize("name", CATEGORICAL + NUMERIC)
@pytest.mark.parametrize("epsilon", [MIN_EPSILON, 0.5, MAX_EPSILON])
def test_epsilon_bounds_are_inclusive_where_they_should_be(name: str, epsilon: float) -> None:
    fields = {**valid_fields(name), "epsilon": epsilon}
    if name in CHAINED_MECHANISMS and epsilon == MIN_EPSILON:
        # One report must reveal less than the lifetime bound, and no less than MIN_EPSILON.
        assert_refused(fields, "epsilon_report")
        return
    assert MechanismSpec(**fields).epsilon == epsilon


@pytest.mark.parametrize("name", CATEGORICAL)
@pytest.mark.parametrize("domain_size", [1, 0, -3, MAX_DOMAIN_SIZE + 1])
def test_domain_size_out_of_range(name: str, domain_size: int) -> None:
    assert_refused({**valid_fields(name), "domain_size": domain_size}, "domain_size")


@pytest.mark.parametrize("name", CATEGORICAL)
@pytest.mark.parametrize("domain_size", [2, MAX_DOMAIN_SIZE])
def test_domain_size_bounds_are_inclusive(name: str, domain_size: int) -> None:
    assert MechanismSpec(**{**valid_fields(name), "domain_size": domain_size}).domain_size == (
        domain_size
    )


@pytest.mark.parametrize("name", CATEGORICAL)
def test_categorical_needs_domain_size(name: str) -> None:
    fields = valid_fields(name)
    del fields["domain_size"]
    assert_refused(fields, "domain_size")
    assert_refused({**fields, "domain_size": None}, "domain_size")


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize(("lower", "upper"), [(1.0, 1.0), (2.0, 1.0), (0.0, -1e-300)])
def test_lower_must_be_below_upper(name: str, lower: float, upper: float) -> None:
    assert_refused({**valid_fields(name), "lower": lower, "upper": upper}, "lower", "upper")


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("missing", ["lower", "upper"])
def test_numeric_needs_both_bounds(name: str, missing: str) -> None:
    fields = valid_fields(name)
    del fields[missing]
    assert_refused(fields, missing)
    assert_refused({**fields, missing: None}, missing)


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize(
    ("lower", "upper", "named"),
    [
        (-math.inf, 1.0, "lower"),
        (0.0, math.inf, "upper"),
        (math.nan, 1.0, "lower"),
        (0.0, math.nan, "upper"),
        (-1e308, 1e308, "upper - lower"),  # each finite, the width overflows
    ],
)
def test_bounds_must_be_finite(name: str, lower: float, upper: float, named: str) -> None:
    assert_refused({**valid_fields(name), "lower": lower, "upper": upper}, named)


@pytest.mark.parametrize("mechanism", ["GRR", "rappor_v2", "", "gaussian", 3, None])
def test_unknown_mechanism_names(mechanism: Any) -> None:
    assert_refused({"mechanism": mechanism, "epsilon": 1.0, "domain_size": 4}, "mechanism")


@pytest.mark.parametrize("name", NUMERIC + STRING)
def test_domain_size_does_not_apply_to_numeric(name: str) -> None:
    assert_refused({**valid_fields(name), "domain_size": 4}, "domain_size")


@pytest.mark.parametrize("name", CATEGORICAL + STRING)
@pytest.mark.parametrize("field", ["lower", "upper"])
def test_bounds_do_not_apply_to_categorical(name: str, field: str) -> None:
    assert_refused({**valid_fields(name), field: 0.0}, field)


@pytest.mark.parametrize(
    "name",
    [n for n in CATEGORICAL + NUMERIC + STRING if n not in ("laplace", "piecewise", "onebitmean")],
)
def test_grid_steps_applies_only_to_gridded_mechanisms(name: str) -> None:
    assert_refused({**valid_fields(name), "grid_steps": 16}, "grid_steps")


@pytest.mark.parametrize("grid_steps", [0, -1, MAX_GRID_STEPS + 1])
def test_laplace_grid_steps_out_of_range(grid_steps: int) -> None:
    assert_refused({**valid_fields("laplace"), "grid_steps": grid_steps}, "grid_steps")


@pytest.mark.parametrize("name", CATEGORICAL + NUMERIC + STRING)
@pytest.mark.parametrize("extra", ["cohorts", "delta", "Epsilon", "labels"])
def test_unknown_fields_are_refused(name: str, extra: str) -> None:
    assert_refused({**valid_fields(name), extra: 1}, extra)


@pytest.mark.parametrize("name", CATEGORICAL + NUMERIC)
@pytest.mark.parametrize("field", RAPPOR_FIELDS)
def test_rappor_fields_apply_only_to_rappor(name: str, field: str) -> None:
    value = {"num_bits": 8, "num_hashes": 2, "num_cohorts": 4, "f": 0.5, "p": 0.25, "q": 0.75}
    assert_refused({**valid_fields(name), field: value[field]}, field)


@pytest.mark.parametrize("name", CATEGORICAL + NUMERIC)
def test_epsilon_is_required_except_for_rappor(name: str) -> None:
    fields = valid_fields(name)
    del fields["epsilon"]
    assert_refused(fields, "epsilon")


# ---------------------------------------------------------------------------------------
# Valid specs: JSON round trip, immutability
# ---------------------------------------------------------------------------------------


VALID_SPECS = [
    {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4},
    {"mechanism": "auto", "epsilon": 2.3, "domain_size": MAX_DOMAIN_SIZE},
    {"mechanism": "olh", "epsilon": 0.1, "domain_size": 1000},
    {"mechanism": "laplace", "epsilon": 1.5, "lower": -3.7, "upper": 11.2, "grid_steps": 16},
    {"mechanism": "laplace", "epsilon": MAX_EPSILON, "lower": 0.0, "upper": 1e-3},
    {"mechanism": "piecewise", "epsilon": 0.30000000000000004, "lower": -1e300, "upper": 1e300},
    {"mechanism": "piecewise", "epsilon": 2.0, "lower": 0.0, "upper": 120.0, "grid_steps": 64},
    *(valid_fields(name) for name in CATEGORICAL + NUMERIC + STRING),
    {
        "mechanism": "rappor",
        "num_bits": 1024,
        "num_hashes": 16,
        "num_cohorts": 1,
        "f": 0.9,
        "p": 0.0,
        "q": 1.0,
    },
]


@pytest.mark.parametrize("fields", VALID_SPECS, ids=lambda f: str(f["mechanism"]))
def test_valid_specs_round_trip_through_json(fields: dict[str, Any]) -> None:
    spec = MechanismSpec(**fields)
    text = spec.model_dump_json()
    again = MechanismSpec.model_validate_json(text)
    assert again == spec
    assert again.model_dump_json() == text
    for key, value in fields.items():
        assert getattr(again, key) == value  # floats survive JSON bit for bit


def test_documented_json_form() -> None:
    """The MechanismSpec JSON that SDKs in other languages rely on."""
    spec = MechanismSpec.model_validate_json(
        '{"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}'
    )
    assert spec == MechanismSpec(mechanism="grr", epsilon=1.0, domain_size=4)
    assert spec.is_categorical


@pytest.mark.parametrize("fields", VALID_SPECS[:4], ids=lambda f: str(f["mechanism"]))
def test_specs_are_frozen_and_hashable(fields: dict[str, Any]) -> None:
    spec = MechanismSpec(**fields)
    with pytest.raises(ValidationError):
        spec.epsilon = 100.0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        spec.mechanism = "grr"  # type: ignore[misc]
    assert spec == MechanismSpec(**fields)
    assert hash(spec) == hash(MechanismSpec(**fields))


# ---------------------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("d", [2, 16, 1024, 16384])
def test_auto_resolves_to_the_least_variance(epsilon: float, d: int) -> None:
    spec = MechanismSpec(mechanism="auto", epsilon=epsilon, domain_size=d)
    chosen = make_mechanism(spec)
    variances = {
        name: make_mechanism(spec.model_copy(update={"mechanism": name})).variance(1)
        for name in AUTO_CANDIDATES
    }
    assert chosen.name in AUTO_CANDIDATES
    assert chosen.spec == MechanismSpec.model_validate(
        {"mechanism": chosen.name, "epsilon": epsilon, "domain_size": d}
    )
    assert chosen.variance(1) == variances[chosen.name]
    assert chosen.variance(1) == min(variances.values())
    for name, variance in variances.items():
        assert chosen.variance(1) <= variance, name


@pytest.mark.parametrize(
    ("epsilon", "d", "grr"),
    [
        # GRR's variance beats OUE's exactly when d < 3 e^eps + 2; far from the boundary:
        (0.5, 2, True),  # 3 e^0.5 + 2 = 6.9
        (1.0, 4, True),  # 3 e + 2 = 10.2
        (4.0, 100, True),  # 3 e^4 + 2 = 165.8
        (8.0, 4000, True),  # 3 e^8 + 2 = 8945
        (0.5, 16, False),
        (1.0, 40, False),
        (4.0, 1024, False),
        (8.0, 16384, False),
    ],
)
def test_auto_picks_grr_for_small_domains(epsilon: float, d: int, grr: bool) -> None:
    assert (d < 3 * math.exp(epsilon) + 2) == grr  # the cases are on the side they claim
    chosen = make_mechanism(MechanismSpec(mechanism="auto", epsilon=epsilon, domain_size=d))
    assert (chosen.name == "grr") == grr, chosen.name


# --- the wire contract: metrics, reports and the federated messages live here ----------


def test_a_metric_spec_checks_its_labels_against_the_mechanism() -> None:
    import shared.schemas as schemas

    grr = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 2}
    spec = schemas.MetricSpec.model_validate(
        {"name": "m", "version": 1, "mechanism": grr, "labels": ["a", "b"], "added": "later"}
    )  # a field a newer aggregator adds is ignored by an older device
    assert spec.label_of(1) == "b" and not hasattr(spec, "added")
    for labels, message in ((["a", "b", "c"], "3 labels"), (["a", "a"], "more than once")):
        with pytest.raises(ValidationError, match=message):
            schemas.MetricSpec.model_validate(
                {"name": "m", "version": 1, "mechanism": grr, "labels": labels}
            )
    with pytest.raises(ValidationError, match="extra"):
        schemas.MetricDefinition.model_validate({"mechanism": grr, "labels": None, "added": 1})


def test_reports_and_estimates_import_from_the_schemas_module() -> None:
    import shared.schemas as schemas
    from shared.estimates import Estimate

    batch = schemas.ReportBatch.model_validate_json(
        '{"reports": [{"report_id": "3f0e5b8a-1111-4222-8333-444455556666", "metric": "m",'
        ' "version": 1, "payload": {"value": 2}, "time": "2026-11-24T10:00:00Z"}]}'
    )
    assert isinstance(batch.reports[0], schemas.Report)
    with pytest.raises(ValidationError, match="truncated to the hour"):
        schemas.Report.model_validate(
            batch.reports[0].model_dump() | {"time": "2026-11-24T10:30:00Z"}
        )
    assert schemas.Estimate is Estimate
    with pytest.raises(AttributeError, match="NoSuchModel"):
        _ = schemas.NoSuchModel  # type: ignore[attr-defined]


# --- memoized mechanisms -----------------------------------------------------------------

ONE_SHOT = sorted((CATEGORICAL_MECHANISMS | NUMERIC_MECHANISMS) - MEMOIZED_MECHANISMS)


@pytest.mark.parametrize("name", sorted(CHAINED_MECHANISMS))
def test_chained_mechanisms_need_a_smaller_epsilon_report(name: str) -> None:
    fields = valid_fields(name)
    del fields["epsilon_report"]
    assert_refused(fields, "epsilon_report")
    for report in (1.0, 1.5):
        assert_refused({**fields, "epsilon_report": report}, "epsilon_report")
    for report in (0.0, math.nan, MAX_EPSILON + 1):
        assert_refused({**fields, "epsilon_report": report}, "epsilon_report")
    spec = MechanismSpec(**{**fields, "epsilon_report": 0.25})
    assert (spec.epsilon, spec.epsilon_report, spec.is_memoized) == (1.0, 0.25, True)


@pytest.mark.parametrize("name", ONE_SHOT + STRING)
@pytest.mark.parametrize(
    "field, value", [("epsilon_report", 0.5), ("bits_per_device", 1), ("flip_probability", 0.1)]
)
def test_memoization_fields_apply_only_to_their_mechanisms(
    name: str, field: str, value: float
) -> None:
    assert_refused({**valid_fields(name), field: value}, field)
    assert not MechanismSpec(**valid_fields(name)).is_memoized


def test_dbitflip_fills_in_its_defaults_and_checks_its_buckets() -> None:
    spec = MechanismSpec(mechanism="dbitflip", epsilon=2.0, domain_size=8)
    assert (spec.bits_per_device, spec.epsilon_report) == (1, 2.0)
    assert spec.model_dump() == {
        "mechanism": "dbitflip",
        "epsilon": 2.0,
        "domain_size": 8,
        "epsilon_report": 2.0,
        "bits_per_device": 1,
    }
    assert MechanismSpec(mechanism="dbitflip", epsilon=2.0, domain_size=8, bits_per_device=8)
    for bits in (0, 9, True):
        assert_refused(
            {"mechanism": "dbitflip", "epsilon": 2.0, "domain_size": 8, "bits_per_device": bits},
            "bits_per_device",
        )
    assert_refused(
        {"mechanism": "dbitflip", "epsilon": 2.0, "domain_size": 8, "epsilon_report": 1.0},
        "epsilon_report",
    )
    assert_refused(
        {"mechanism": "dbitflip", "epsilon": 2.0, "domain_size": 8, "flip_probability": 0.1},
        "flip_probability",
    )


@pytest.mark.parametrize("epsilon, gamma", [(0.5, 0.0), (1.0, 0.1), (4.0, 0.25), (8.0, 0.4)])
def test_onebitmean_derives_what_one_report_reveals(epsilon: float, gamma: float) -> None:
    fields = {"mechanism": "onebitmean", "epsilon": epsilon, "lower": 0.0, "upper": 10.0}
    if gamma:
        fields["flip_probability"] = gamma
    spec = MechanismSpec(**fields)
    # The memoized bit is 1 w.p. in [1/(e^eps+1), e^eps/(e^eps+1)]; a flip w.p. gamma maps
    # pi to gamma + (1 - 2 gamma) pi, and one report's ratio is that of the two ends.
    high = math.exp(epsilon) / (math.exp(epsilon) + 1)
    ratio = (gamma + (1 - 2 * gamma) * high) / (gamma + (1 - 2 * gamma) * (1 - high))
    assert spec.epsilon_report == pytest.approx(math.log(ratio), rel=1e-12)
    assert spec.epsilon_report <= epsilon
    assert MechanismSpec(**{**fields, "epsilon_report": spec.epsilon_report}) == spec
    assert_refused({**fields, "epsilon_report": spec.epsilon_report * 1.01}, "epsilon_report")


def test_onebitmean_flip_probability_range() -> None:
    fields = {"mechanism": "onebitmean", "epsilon": 1.0, "lower": 0.0, "upper": 1.0}
    for gamma in (-0.1, 0.5, 0.7, math.nan):
        assert_refused({**fields, "flip_probability": gamma}, "flip_probability")
    # A flip so close to 1/2 that one report would carry (almost) nothing is refused.
    assert_refused({**fields, "flip_probability": 0.49999}, "flip_probability")
    assert MechanismSpec(**{**fields, "grid_steps": 4}).grid_steps == 4


# --- open-domain strings -------------------------------------------------------------------

OPEN_STRINGS = ("cms", "hcms", "pem", "sfp")


@pytest.mark.parametrize("name", OPEN_STRINGS)
def test_open_string_specs_need_their_fields(name: str) -> None:
    fields = valid_fields(name)
    assert MechanismSpec(**fields).kind == "string"
    for field in ("epsilon", "sketch_width", "sketch_depth", "max_length"):
        if field in fields:
            assert_refused({k: v for k, v in fields.items() if k != field}, field)


@pytest.mark.parametrize("name", OPEN_STRINGS)
@pytest.mark.parametrize(
    "field, value",
    [("domain_size", 4), ("lower", 0.0), ("num_bits", 8), ("epsilon_report", 0.5)],
)
def test_open_string_specs_refuse_other_fields(name: str, field: str, value: Any) -> None:
    assert_refused({**valid_fields(name), field: value}, field)


@pytest.mark.parametrize("name", ["grr", "laplace", "rappor"])
@pytest.mark.parametrize("field", ["sketch_width", "sketch_depth", "max_length"])
def test_sketch_fields_apply_only_to_open_strings(name: str, field: str) -> None:
    assert_refused({**valid_fields(name), field: 8}, field)


def test_sketch_sizes_are_bounded() -> None:
    assert_refused({**valid_fields("cms"), "sketch_width": 1 << 20, "sketch_depth": 8}, "sketch")
    assert_refused({**valid_fields("hcms"), "sketch_width": 100}, "power of two")
    assert_refused({**valid_fields("sfp"), "sketch_width": 100}, "power of two")
    # sfp keeps ceil(max_length / 2) + 1 sketches.
    assert_refused(
        {**valid_fields("sfp"), "sketch_width": 1 << 16, "sketch_depth": 8, "max_length": 16},
        "sketches",
    )
    assert_refused({**valid_fields("pem"), "max_length": 0}, "max_length")
    assert_refused({**valid_fields("pem"), "max_length": 257}, "max_length")
