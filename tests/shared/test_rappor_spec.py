"""The RAPPOR MechanismSpec: its six fields, their validation, and the derived epsilon.

k = num_bits >= 1, h = num_hashes in 1..16, m = num_cohorts >= 1, 0 <= f < 1,
0 <= p < q <= 1, every message naming the field; epsilon is optional and derived
(epsilon_one), or checked against it when given; the fields are refused elsewhere
(test_schemas.py) and other mechanisms' fields are refused here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import MAX_NUM_BITS, MAX_NUM_COHORTS, Rappor, rappor_epsilon_one
from shared.schemas import MAX_EPSILON, MechanismSpec

RAPPOR_FIELDS = ("num_bits", "num_hashes", "num_cohorts", "f", "p", "q")

CHROME: dict[str, Any] = {
    "mechanism": "rappor",
    "num_bits": 128,
    "num_hashes": 2,
    "num_cohorts": 64,
    "f": 0.5,
    "p": 0.25,
    "q": 0.75,
}


def error_text(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
    )


def assert_refused(fields: dict[str, Any], *named: str) -> str:
    with pytest.raises(ValidationError) as info:
        MechanismSpec(**fields)
    text = error_text(info.value)
    for field in named:
        assert field in text, text
    return text


def test_the_documented_interface() -> None:
    """Issue 3, point 5: the spec carries no epsilon; the mechanism exposes both guarantees."""
    mech = make_mechanism(MechanismSpec(**CHROME))
    assert isinstance(mech, Rappor)
    assert mech.spec.epsilon == mech.epsilon == mech.epsilon_one
    assert mech.epsilon_one == pytest.approx(2 * math.log(0.625 * 0.625 / (0.375 * 0.375)))
    assert mech.epsilon_infinity == pytest.approx(4 * math.log(3))
    assert (mech.num_bits, mech.num_hashes, mech.num_cohorts) == (128, 2, 64)
    assert MechanismSpec(**CHROME).kind == "string" and not MechanismSpec(**CHROME).is_categorical


def test_json_round_trip_keeps_the_derived_epsilon() -> None:
    spec = MechanismSpec(**CHROME)
    again = MechanismSpec.model_validate_json(spec.model_dump_json())
    assert again == spec and again.epsilon == spec.epsilon
    assert "epsilon" in spec.model_dump()


def test_a_given_epsilon_must_agree() -> None:
    exact = rappor_epsilon_one(2, 0.5, 0.25, 0.75)
    assert MechanismSpec(**CHROME, epsilon=exact).epsilon == exact
    assert MechanismSpec(**CHROME, epsilon=exact * (1 + 1e-12)).epsilon == exact * (1 + 1e-12)
    text = assert_refused({**CHROME, "epsilon": 2.0}, "epsilon", "num_hashes", "f", "p", "q")
    assert f"{exact!r}" in text
    assert_refused({**CHROME, "epsilon": None}, "epsilon")


@pytest.mark.parametrize("field", RAPPOR_FIELDS)
def test_every_rappor_field_is_required(field: str) -> None:
    fields = {key: value for key, value in CHROME.items() if key != field}
    assert_refused(fields, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_bits", 0),
        ("num_bits", MAX_NUM_BITS + 1),
        ("num_bits", 2.5),
        ("num_bits", True),
        ("num_hashes", 0),
        ("num_hashes", 17),
        ("num_cohorts", 0),
        ("num_cohorts", MAX_NUM_COHORTS + 1),
        ("f", -0.1),
        ("f", 1.0),
        ("f", math.nan),
        ("p", -0.01),
        ("p", math.inf),
        ("q", 1.01),
        ("q", False),
    ],
)
def test_out_of_range_fields_are_named(field: str, value: Any) -> None:
    assert_refused({**CHROME, field: value}, field)


@pytest.mark.parametrize(("p", "q"), [(0.75, 0.25), (0.5, 0.5), (1.0, 1.0)])
def test_p_must_be_below_q(p: float, q: float) -> None:
    assert_refused({**CHROME, "p": p, "q": q}, "p", "q")


@pytest.mark.parametrize(
    "update",
    [
        {"num_hashes": 16, "f": 0.0},  # 16 ln 9 = 35 > MAX_EPSILON
        {"f": 0.0, "p": 0.0},  # p* = 0: a reported 1 proves the bit: infinite
        {"f": 0.0, "q": 1.0},
    ],
)
def test_epsilon_one_must_be_finite_and_at_most_the_maximum(update: dict[str, Any]) -> None:
    text = assert_refused({**CHROME, **update}, "epsilon_one")
    assert str(MAX_EPSILON) in text


@pytest.mark.parametrize(
    "update",
    [
        {"num_bits": 1, "num_hashes": 1, "num_cohorts": 1},
        {"num_bits": MAX_NUM_BITS, "num_cohorts": 1023},
        {"num_hashes": 16, "f": 0.9},
        {"f": 0.0},
        {"p": 0.0, "q": 1.0, "f": 0.5},
    ],
)
def test_boundary_specs_are_accepted(update: dict[str, Any]) -> None:
    spec = MechanismSpec(**{**CHROME, **update})
    assert 0 < spec.epsilon <= MAX_EPSILON


def test_statistics_size_is_bounded() -> None:
    assert_refused({**CHROME, "num_bits": MAX_NUM_BITS, "num_cohorts": 4096}, "num_cohorts")


@pytest.mark.parametrize(
    ("field", "value"), [("domain_size", 4), ("lower", 0.0), ("upper", 1.0), ("grid_steps", 8)]
)
def test_other_mechanisms_fields_are_refused(field: str, value: Any) -> None:
    assert_refused({**CHROME, field: value}, field)
