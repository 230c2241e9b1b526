"""Mechanisms are plug-ins: each module owns its spec model, abilities and registration.

What is checked here holds for every registered mechanism, so a new one is held to it by
being registered: its abilities are real (each declared protocol is satisfied), its
``encode`` takes what every other one takes, its spec round-trips through the wire form,
and a mechanism defined outside the package registers with nothing but its own code.
Outside ``shared/``, nothing tests a value for a mechanism class: callers ask for
abilities (an AST scan of the other packages).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pytest
from pydantic import ValidationError

import shared.mechanisms as mechanisms
from shared.mechanisms import (
    FRESH,
    MECHANISMS,
    CandidateQueries,
    CategoricalValues,
    DeviceContext,
    Discovery,
    Memoized,
    NumericValues,
    as_attributes,
    as_candidate_queries,
    as_categorical,
    as_discovery,
    as_distribution,
    as_memoized,
    as_numeric,
    make_mechanism,
    register,
)
from shared.mechanisms.base import Mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.grr import CountedIndices, k_ary_keep_threshold, k_ary_response
from shared.mechanisms.spec import CategoricalSpec, MechanismSpec, spec_models
from shared.randomness import Rng, as_source, realized_probability
from shared.schemas import MetricDefinition, MetricSpec
from shared.spec_hash import spec_hash

ROOT = Path(__file__).resolve().parents[2]

#: One valid spec per wire name.
SPECS: dict[str, dict[str, Any]] = {
    "hh": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0, "buckets": 64, "branching": 4},
    "sw": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0, "buckets": 64},
    "lhh": {"epsilon": 2.0, "epsilon_report": 1.0, "lower": 0.0, "upper": 10.0, "buckets": 64},
    "grr": {"epsilon": 1.0, "domain_size": 4},
    "sue": {"epsilon": 1.0, "domain_size": 4},
    "oue": {"epsilon": 1.0, "domain_size": 4},
    "olh": {"epsilon": 1.0, "domain_size": 4},
    "hr": {"epsilon": 1.0, "domain_size": 4},
    "auto": {"epsilon": 1.0, "domain_size": 4},
    "lgrr": {"epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "lsue": {"epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "loue": {"epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "losue": {"epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "dbitflip": {"epsilon": 1.0, "domain_size": 4},
    "laplace": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0},
    "duchi": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0},
    "piecewise": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0},
    "onebitmean": {"epsilon": 1.0, "lower": 0.0, "upper": 10.0},
    "rappor": {"num_bits": 16, "num_hashes": 2, "num_cohorts": 4, "f": 0.5, "p": 0.25, "q": 0.75},
    "cms": {"epsilon": 2.0, "sketch_width": 16, "sketch_depth": 4},
    "hcms": {"epsilon": 2.0, "sketch_width": 16, "sketch_depth": 4},
    "pem": {"epsilon": 2.0, "max_length": 4},
    "sfp": {"epsilon": 2.0, "sketch_width": 16, "sketch_depth": 4, "max_length": 4},
    **{
        protocol: {
            "epsilon": 2.0,
            "attributes": [
                {"name": "a", "domain_size": 4},
                {"name": "b", "domain_size": 3},
                {"name": "c", "lower": 0.0, "upper": 10.0},
            ],
            "pairs": [["a", "b"]],
        }
        for protocol in ("spl", "smp", "rsfd")
    },
}
VALUES: dict[str, Any] = {
    "categorical": np.array([0, 3, 1]),
    "numeric": np.array([0.5, 9.0, 4.2]),
    "distribution": np.array([0.5, 9.0, 4.2]),
    "string": ["ab", "c", "ab"],
    "attributes": np.array([[0, 2, 0.5], [3, 0, 9.0], [1, 1, 4.2]]),
}
CONTEXT = DeviceContext(secrets=[bytes([i]) * 32 for i in range(3)])


def build(name: str) -> Mechanism[Any]:
    return make_mechanism(MechanismSpec(mechanism=name, **SPECS[name]))


def test_every_registered_name_has_a_spec_model_and_a_test_spec() -> None:
    assert set(spec_models()) == set(MECHANISMS) | {"auto"} == set(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_spec_is_the_named_model_and_round_trips(name: str) -> None:
    spec = MechanismSpec(mechanism=name, **SPECS[name])
    assert type(spec) is spec_models()[name]
    assert MechanismSpec.model_validate(spec.model_dump()) == spec
    assert MechanismSpec.model_validate_json(spec.model_dump_json()) == spec
    definition = MetricDefinition.model_validate({"mechanism": spec.model_dump()})
    assert definition.mechanism == spec


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_declared_abilities_are_satisfied(name: str) -> None:
    mech = build(name)
    assert type(mech).abilities, f"{name} declares no ability"
    for ability in type(mech).abilities:
        assert isinstance(mech, ability), f"{name} declares {ability.__name__} without it"


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_exactly_one_kind_of_value_each(name: str) -> None:
    mech = build(name)
    kinds = {
        "categorical": as_categorical(mech) is not None,
        "numeric": as_numeric(mech) is not None,
        "distribution": as_distribution(mech) is not None,
        "string": as_candidate_queries(mech) is not None,
        "attributes": as_attributes(mech) is not None,
    }
    assert [kind for kind, has in kinds.items() if has] == [mech.kind]
    assert mech.kind == mech.spec.kind


def test_memoized_and_discovery_are_what_the_specs_say() -> None:
    built = {name: build(name) for name in MECHANISMS}
    memoized = {name for name, mech in built.items() if as_memoized(mech) is not None}
    spec_memoized = {name for name, mech in built.items() if mech.spec.is_memoized}
    assert memoized == spec_memoized | {"rappor"}  # RAPPOR memoizes its PRR per value
    assert {name for name, mech in built.items() if as_discovery(mech)} == {"pem", "sfp"}


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_encode_takes_one_context_the_same_way_everywhere(name: str) -> None:
    cls = MECHANISMS[name]
    parameters = list(inspect.signature(cls.encode).parameters.values())
    assert [p.name for p in parameters] == ["self", "values", "rng", "context"]
    assert parameters[2].default is None and parameters[3].default is FRESH
    mech = build(name)
    values = VALUES[mech.kind]
    reports = mech.encode(values, np.random.default_rng(1), CONTEXT)
    assert mech.aggregate(reports).n == len(values)


def test_ledger_keys_are_the_memo_keys_or_the_string() -> None:
    lgrr, rappor = build("lgrr"), build("rappor")
    lifelong = as_memoized(lgrr)
    assert lifelong is not None
    assert lifelong.ledger_keys(np.array([2]), FRESH) == [(2).to_bytes(8, "big", signed=True)]
    strings = as_memoized(rappor)
    assert strings is not None
    assert strings.ledger_keys(["é", "a"], CONTEXT) == ["é".encode(), b"a"]


#: (a definition's spec, its published form, the first 8 bytes of its metric's spec hash),
#: as the wire format had them before the spec models moved into the mechanism modules:
#: a device pinned to one of these must see the same spec, and the same hash, after.
PUBLISHED: list[tuple[str, str, str]] = [
    (
        '{"mechanism":"grr","epsilon":1,"domain_size":4}',
        '{"mechanism":"grr","epsilon":1.0,"domain_size":4}',
        "9e39c3badcc235e1",
    ),
    (
        '{"mechanism":"sue","epsilon":2.5,"domain_size":64}',
        '{"mechanism":"sue","epsilon":2.5,"domain_size":64}',
        "78ea3099287851ed",
    ),
    (
        '{"mechanism":"oue","epsilon":1.0,"domain_size":1024}',
        '{"mechanism":"oue","epsilon":1.0,"domain_size":1024}',
        "6ce592c5894c8ab3",
    ),
    (
        '{"mechanism":"olh","epsilon":3,"domain_size":100}',
        '{"mechanism":"olh","epsilon":3.0,"domain_size":100}',
        "3ad647dedd1af267",
    ),
    (
        '{"mechanism":"hr","epsilon":4.0,"domain_size":33}',
        '{"mechanism":"hr","epsilon":4.0,"domain_size":33}',
        "690ba10f33d08af4",
    ),
    (
        '{"mechanism":"auto","epsilon":1.0,"domain_size":8}',
        '{"mechanism":"auto","epsilon":1.0,"domain_size":8}',
        "7956d349c31c73f5",
    ),
    (
        '{"mechanism":"lgrr","epsilon":2.0,"epsilon_report":1.0,"domain_size":8}',
        '{"mechanism":"lgrr","epsilon":2.0,"domain_size":8,"epsilon_report":1.0}',
        "f8e64ff27b2be370",
    ),
    (
        '{"mechanism":"lsue","epsilon":2.0,"epsilon_report":1.0,"domain_size":8}',
        '{"mechanism":"lsue","epsilon":2.0,"domain_size":8,"epsilon_report":1.0}',
        "2c502dd7188e5268",
    ),
    (
        '{"mechanism":"loue","epsilon":2.0,"epsilon_report":1.0,"domain_size":8}',
        '{"mechanism":"loue","epsilon":2.0,"domain_size":8,"epsilon_report":1.0}',
        "92fda59d376396a1",
    ),
    (
        '{"mechanism":"losue","epsilon":2.0,"epsilon_report":1.0,"domain_size":8}',
        '{"mechanism":"losue","epsilon":2.0,"domain_size":8,"epsilon_report":1.0}',
        "6598899e360e3b03",
    ),
    (
        '{"mechanism":"dbitflip","epsilon":1.0,"domain_size":16}',
        '{"mechanism":"dbitflip","epsilon":1.0,"domain_size":16,"epsilon_report":1.0,"bits_per_device":1}',
        "8d4ad360a1052f98",
    ),
    (
        '{"mechanism":"dbitflip","epsilon":1.0,"domain_size":16,"bits_per_device":3}',
        '{"mechanism":"dbitflip","epsilon":1.0,"domain_size":16,"epsilon_report":1.0,"bits_per_device":3}',
        "cb8ca78580854680",
    ),
    (
        '{"mechanism":"laplace","epsilon":1,"lower":0,"upper":100}',
        '{"mechanism":"laplace","epsilon":1.0,"lower":0.0,"upper":100.0}',
        "a1cc02343bd07d79",
    ),
    (
        '{"mechanism":"laplace","epsilon":1,"lower":0,"upper":100,"grid_steps":64}',
        '{"mechanism":"laplace","epsilon":1.0,"lower":0.0,"upper":100.0,"grid_steps":64}',
        "0bbff6e7dde80e24",
    ),
    (
        '{"mechanism":"duchi","epsilon":1,"lower":-1,"upper":1}',
        '{"mechanism":"duchi","epsilon":1.0,"lower":-1.0,"upper":1.0}',
        "c6402ed363d85c5b",
    ),
    (
        '{"mechanism":"piecewise","epsilon":1,"lower":0,"upper":10}',
        '{"mechanism":"piecewise","epsilon":1.0,"lower":0.0,"upper":10.0}',
        "4d9fc9668fb53c91",
    ),
    (
        '{"mechanism":"onebitmean","epsilon":1,"lower":0,"upper":10}',
        '{"mechanism":"onebitmean","epsilon":1.0,"lower":0.0,"upper":10.0,"epsilon_report":1.0}',
        "d41930d8306fefe9",
    ),
    (
        '{"mechanism":"onebitmean","epsilon":1,"lower":0,"upper":10,"flip_probability":0.1,"grid_steps":4}',
        '{"mechanism":"onebitmean","epsilon":1.0,"lower":0.0,"upper":10.0,"grid_steps":4,"epsilon_report":0.7761365852607373,"flip_probability":0.1}',
        "5e86ff40b7ae1ced",
    ),
    (
        '{"mechanism":"rappor","num_bits":32,"num_hashes":2,"num_cohorts":64,"f":0.5,"p":0.25,"q":0.75}',
        '{"mechanism":"rappor","epsilon":2.0433024950639624,"num_bits":32,"num_hashes":2,"num_cohorts":64,"f":0.5,"p":0.25,"q":0.75}',
        "93eebdf6a910e310",
    ),
    (
        '{"mechanism":"cms","epsilon":4,"sketch_width":1024,"sketch_depth":64}',
        '{"mechanism":"cms","epsilon":4.0,"sketch_width":1024,"sketch_depth":64}',
        "0dcd88e6097fe6b8",
    ),
    (
        '{"mechanism":"hcms","epsilon":4,"sketch_width":1024,"sketch_depth":64}',
        '{"mechanism":"hcms","epsilon":4.0,"sketch_width":1024,"sketch_depth":64}',
        "fdeaf457449fd625",
    ),
    (
        '{"mechanism":"pem","epsilon":4,"max_length":8}',
        '{"mechanism":"pem","epsilon":4.0,"max_length":8}',
        "fceb70713c0e57bd",
    ),
    (
        '{"mechanism":"sfp","epsilon":4,"sketch_width":256,"sketch_depth":16,"max_length":8}',
        '{"mechanism":"sfp","epsilon":4.0,"sketch_width":256,"sketch_depth":16,"max_length":8}',
        "1ea7dd64b3e52405",
    ),
]


@pytest.mark.parametrize(("given", "published", "digest"), PUBLISHED)
def test_published_specs_and_their_hashes_are_unchanged(
    given: str, published: str, digest: str
) -> None:
    spec = MechanismSpec.model_validate_json(given)
    assert spec.model_dump_json() == published
    metric = MetricSpec(name="m", version=1, mechanism=spec.model_dump(), labels=None)
    assert spec_hash(metric).hex()[:16] == digest


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        MechanismSpec(mechanism="no-such-mechanism", epsilon=1.0)
    with pytest.raises(ValidationError, match="domain_size does not apply to the 'duchi'"):
        MechanismSpec(mechanism="duchi", epsilon=1.0, lower=0, upper=1, domain_size=3)
    with pytest.raises(ValidationError, match="domain_size is required for the 'grr'"):
        MechanismSpec(mechanism="grr", epsilon=1.0)


# --- a mechanism from outside the package: its own code and one registration -------------


class CoinSpec(CategoricalSpec):
    """Binary randomized response on two categories, for this test only."""

    mechanism: Literal["test-coin"]


class Coin(CountedIndices):
    """Warner's randomized response, kept or flipped uniformly (GRR with d = 2)."""

    name = "test-coin"
    spec_model = CoinSpec

    @property
    def keep_threshold(self) -> int:
        return k_ary_keep_threshold(self.epsilon, 2)

    @property
    def keep_fraction(self) -> float:
        return realized_probability(self.keep_threshold)

    @property
    def p(self) -> float:
        return self.keep_fraction + (1 - self.keep_fraction) / 2

    @property
    def q(self) -> float:
        return (1 - self.keep_fraction) / 2

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        return k_ary_response(self.check_reports(values), 2, self.keep_threshold, as_source(rng))

    def transition_matrix(self) -> np.ndarray:
        return np.array([[self.p, self.q], [self.q, self.p]])


@pytest.fixture
def coin() -> Iterator[type[Coin]]:
    """Register ``Coin`` for one test, then remove it from every registry."""
    from shared.mechanisms import registry, spec

    register(Coin)
    try:
        yield Coin
    finally:
        registry.MECHANISMS.pop(Coin.name)
        registry._BUILDERS.pop(Coin.name)
        spec._SPEC_MODELS.pop(Coin.name)


def test_a_mechanism_registers_with_its_own_module_only(coin: type[Coin]) -> None:
    spec = MechanismSpec(mechanism="test-coin", epsilon=1.0, domain_size=2)
    assert isinstance(spec, CoinSpec)
    mech = make_mechanism(spec)
    assert isinstance(mech, CategoricalMechanism)
    assert as_categorical(mech) is not None and as_memoized(mech) is None
    reports = mech.encode(np.zeros(20_000, dtype=np.int64), np.random.default_rng(3))
    frequency = as_categorical(mech).estimate(mech.aggregate(reports)).frequencies[0]  # type: ignore[union-attr]
    assert abs(frequency - 1.0) < 6 * np.sqrt(mech.variance(20_000))  # false failure < 1e-8


def test_registering_a_taken_name_is_refused() -> None:
    class Again(Coin):
        name = "grr"
        spec_model: ClassVar[type[MechanismSpec]] = CoinSpec

    class GrrAgain(CoinSpec):
        mechanism: Literal["grr"]  # type: ignore[assignment]

    class Twin(Coin):
        name = "grr"
        spec_model: ClassVar[type[MechanismSpec]] = GrrAgain

    with pytest.raises(TypeError, match="does not take mechanism='grr'"):
        register(Again)
    with pytest.raises(TypeError, match="'grr' is registered twice"):
        register(Twin)
    assert MECHANISMS["grr"].spec_model is not GrrAgain


# --- callers ask for abilities ---------------------------------------------------------

#: Names of the mechanism classes, their spec models, and the bases of both.
MECHANISM_CLASSES = frozenset(
    {cls.__name__ for cls in MECHANISMS.values()}
    | {
        base.__name__
        for cls in MECHANISMS.values()
        for base in cls.__mro__
        if base.__module__.startswith("shared.mechanisms")
    }
    | {
        base.__name__
        for model in spec_models().values()
        for base in model.__mro__
        if base.__module__.startswith("shared.mechanisms")
    }
    | {CandidateQueries.__name__, CategoricalValues.__name__, Discovery.__name__}
    | {Memoized.__name__, NumericValues.__name__}
) - {"object", "ABC", "Generic", "Protocol"}


def _class_tests(path: Path) -> Iterator[str]:
    """``isinstance``/``issubclass`` calls in a file whose class argument names a mechanism
    class, as "path:line name"."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            for name in ast.walk(node.args[1]):
                if isinstance(name, ast.Name | ast.Attribute):
                    label = name.id if isinstance(name, ast.Name) else name.attr
                    if label in MECHANISM_CLASSES:
                        yield f"{path.relative_to(ROOT)}:{node.lineno} {label}"


def test_no_caller_outside_shared_tests_for_a_mechanism_class() -> None:
    found = [
        hit
        for package in ("client", "aggregator", "simulations")
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _class_tests(path)
    ]
    assert found == []


def test_the_scan_finds_a_class_test() -> None:
    """The scan is not vacuous: it finds the tests this package's own code makes."""
    package = Path(mechanisms.__file__).parent
    assert any(True for path in package.rglob("*.py") for _ in _class_tests(path))
