"""The spec hash (``shared.spec_hash``): RFC 8785 canonical JSON, what it covers, and what not.

Numbers are checked against the test vectors of RFC 8785, Appendix B (IEEE 754 bit
patterns and their ECMAScript form); the whole document against one written out by hand,
so that an SDK in another language has a fixed example to agree with.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest

from shared.schemas import MetricSpec
from shared.spec_hash import SPEC_HASH_BYTES, canonical_json, spec_document, spec_hash

#: RFC 8785, Appendix B: a double's bits (hex) and its canonical form.
NUMBERS = {
    "0000000000000000": "0",
    "8000000000000000": "0",
    "0000000000000001": "5e-324",
    "8000000000000001": "-5e-324",
    "7fefffffffffffff": "1.7976931348623157e+308",
    "ffefffffffffffff": "-1.7976931348623157e+308",
    "4340000000000000": "9007199254740992",
    "c340000000000000": "-9007199254740992",
    "4430000000000000": "295147905179352830000",
    "44b52d02c7e14af5": "9.999999999999997e+22",
    "44b52d02c7e14af6": "1e+23",
    "44b52d02c7e14af7": "1.0000000000000001e+23",
    "444b1ae4d6e2ef4e": "999999999999999700000",
    "444b1ae4d6e2ef4f": "999999999999999900000",
    "444b1ae4d6e2ef50": "1e+21",
    "3eb0c6f7a0b5ed8c": "9.999999999999997e-7",
    "3eb0c6f7a0b5ed8d": "0.000001",
    "41b3de4355555553": "333333333.3333332",
    "41b3de4355555554": "333333333.33333325",
    "41b3de4355555555": "333333333.3333333",
    "41b3de4355555556": "333333333.3333334",
    "41b3de4355555557": "333333333.33333343",
    "becbf647612f3696": "-0.0000033333333333333333",
    "43143ff3c1cb0959": "1424953923781206.2",
}

THEME: dict[str, Any] = {
    "name": "app.theme",
    "version": 1,
    "description": "Colour theme the user chose.",
    "mechanism": {"mechanism": "grr", "epsilon": 2.0, "domain_size": 3},
    "labels": ["light", "dark", "system"],
}


def hash_of(**changes: Any) -> bytes:
    return spec_hash(MetricSpec.model_validate({**THEME, **changes}))


@pytest.mark.parametrize("bits", NUMBERS)
def test_numbers_follow_rfc_8785(bits: str) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(bits))
    assert canonical_json(value) == NUMBERS[bits]


def test_strings_objects_and_arrays_follow_rfc_8785() -> None:
    document = {"b": [1, 2.0, None, True, False], "a": '\u20ac\n\t\x01"\\/', "é": {}}
    assert canonical_json(document) == (
        '{"a":"\u20ac\\n\\t\\u0001\\"\\\\/","b":[1,2,null,true,false],"é":{}}'
    )
    assert canonical_json("half \ud800 pair") == '"half \\ud800 pair"'
    for bad, error in ((float("nan"), ValueError), (b"bytes", TypeError), ({1: 2}, TypeError)):
        with pytest.raises(error):
            canonical_json(bad)


def test_a_spec_hash_is_sha256_of_its_written_out_canonical_document() -> None:
    spec = MetricSpec.model_validate(THEME)
    written = (
        '{"labels":["light","dark","system"],'
        '"mechanism":{"domain_size":3,"epsilon":2,"mechanism":"grr"},'
        '"name":"app.theme","version":1}'
    )
    assert canonical_json(spec_document(spec)) == written
    assert spec_hash(spec) == hashlib.sha256(written.encode()).digest()
    assert len(spec_hash(spec)) == SPEC_HASH_BYTES


@pytest.mark.parametrize(
    "changes",
    [
        {"name": "app.themes"},
        {"version": 2},
        {"mechanism": {"mechanism": "grr", "epsilon": 2.5, "domain_size": 3}},
        {"mechanism": {"mechanism": "grr", "epsilon": 2.0 + 2**-50, "domain_size": 3}},
        {"mechanism": {"mechanism": "oue", "epsilon": 2.0, "domain_size": 3}},
        {"labels": ["light", "system", "dark"]},
        {"labels": None},
    ],
    ids=["name", "version", "epsilon", "last bit of epsilon", "mechanism", "labels", "no labels"],
)
def test_everything_a_device_uses_changes_the_hash(changes: dict[str, Any]) -> None:
    assert hash_of(**changes) != hash_of()


def test_the_description_and_equivalent_spellings_do_not() -> None:
    """The aggregator keeps a version when only the description changes; an integer epsilon,
    a filled-in default or a derived field given explicitly is the same spec."""
    assert hash_of(description="another description") == hash_of()
    assert hash_of(mechanism={"mechanism": "grr", "epsilon": 2, "domain_size": 3}) == hash_of()
    dbitflip = {"mechanism": "dbitflip", "epsilon": 1.0, "domain_size": 3}
    assert hash_of(mechanism=dbitflip) == hash_of(mechanism={**dbitflip, "bits_per_device": 1})
    rappor = {"mechanism": "rappor", "num_bits": 32, "num_hashes": 1, "num_cohorts": 64}
    rappor |= {"f": 0.5, "p": 0.25, "q": 0.75}
    derived = MetricSpec.model_validate({**THEME, "mechanism": rappor}).mechanism.epsilon
    assert hash_of(mechanism=rappor) == hash_of(mechanism={**rappor, "epsilon": derived})
