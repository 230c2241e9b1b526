"""The identity of a published metric spec: a SHA-256 of its canonical JSON.

A device binds everything it keeps for a metric (the permanent randomness of a memoized
mechanism, RAPPOR's secret and cohort, the ledger's record of which values it has paid
for) to the exact spec it reported under, never to the metric's name and version alone:
a server that serves two different specs under one name and version (by mistake, after
its database was recreated, or on purpose) then gets two independent memos, charged
separately, instead of one permanent response read against two thresholds. This module
defines that identity once, for the device and for simulations alike.

The spec document of a ``MetricSpec`` is the JSON object

    {"labels": [...] or null, "mechanism": {...}, "name": "...", "version": N}

where ``mechanism`` is the ``MechanismSpec`` as the wire serializes it (the fields its
mechanism takes, after validation: derived fields such as RAPPOR's ``epsilon`` or
``dbitflip``'s ``bits_per_device`` filled in, unused ones left out), ``labels`` the
category names or RAPPOR candidates in order, ``name`` and ``version`` the metric's.
The description is not part of it: the aggregator keeps a version when only the
description changes, so a device must not tell such versions apart.

    spec_hash(spec) = SHA-256(UTF-8(canonical_json(document)))   (32 bytes)

``canonical_json`` is the JSON Canonicalization Scheme (RFC 8785), so an SDK in another
language computes the same bytes: object members sorted by key (every key here is ASCII,
where RFC 8785's UTF-16 order is byte order), no whitespace, strings escaped as
ECMAScript's ``JSON.stringify`` escapes them (``"`` and ``\\``, the control characters
below U+0020 as ``\\b \\t \\n \\f \\r`` or ``\\u00xx``, a lone surrogate as ``\\udxxx``;
everything else as itself), a float written as ECMAScript's ``Number.prototype.toString``
writes it (the shortest decimal that reads back to the same double: ``2`` for 2.0,
``0.5``, ``1e-7``, ``1e+21``) and an integer as its decimal digits (RFC 8785 writes
integers as doubles; the two agree below 2^53, which holds for every integer a valid
spec carries except, possibly, a version past 2^53).

Stability. The hash changes exactly when the document changes. A future field of
``MechanismSpec`` must therefore default to ``None`` (left out of the wire form), or the
devices that upgrade would see every spec they pinned change under them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from decimal import Decimal
from typing import Any

from shared.schemas import MetricSpec

__all__ = ["SPEC_HASH_BYTES", "canonical_json", "spec_document", "spec_hash"]

#: Length of ``spec_hash`` (SHA-256).
SPEC_HASH_BYTES = 32
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def spec_document(spec: MetricSpec) -> dict[str, Any]:
    """The part of ``spec`` its hash covers (module docstring), as JSON-ready values."""
    return {
        "labels": None if spec.labels is None else list(spec.labels),
        "mechanism": spec.mechanism.model_dump(mode="json"),
        "name": spec.name,
        "version": spec.version,
    }


def spec_hash(spec: MetricSpec) -> bytes:
    """SHA-256 of the canonical JSON of ``spec_document(spec)``: the spec's identity."""
    return hashlib.sha256(canonical_json(spec_document(spec)).encode("utf-8")).digest()


def canonical_json(value: Any) -> str:
    """``value`` (None, bool, int, float, str, list, tuple, or dict with str keys) as
    RFC 8785 canonical JSON (module docstring). ``ValueError`` for a non-finite float,
    ``TypeError`` for anything else."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(canonical_json(item) for item in value) + "]"
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError("canonical JSON objects have string keys only")
        members = sorted(value.items(), key=lambda item: item[0].encode("utf-16-be"))
        return "{" + ",".join(f"{_string(k)}:{canonical_json(v)}" for k, v in members) + "}"
    raise TypeError(f"no canonical JSON for {type(value).__name__}")


def _string(text: str) -> str:
    """``JSON.stringify(text)``: Python's escaping without ``ensure_ascii`` is the same
    except for lone surrogates, which ECMAScript writes as ``\\udxxx``."""
    escaped = json.dumps(text, ensure_ascii=False)
    return _LONE_SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", escaped)


def _number(value: float) -> str:
    """ECMAScript's ``Number::toString(value)`` (ECMA-262, section 6.1.6.1.20): with the
    shortest digits s (k of them) and n such that value = 0.s x 10^n, write s padded with
    zeros when k <= n <= 21, with a point inside when 0 < n <= 21, as 0.000s when
    -6 < n <= 0, and otherwise as d.ddd e+-(n - 1). Python's ``repr`` gives the shortest
    digits that read back to the same double, the closest such when there are several."""
    if not math.isfinite(value):
        raise ValueError(f"canonical JSON has no form for {value!r}")
    if value == 0:
        return "0"
    if value < 0:
        return "-" + _number(-value)
    _, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)  # finite
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    exponent += len(digit_tuple) - len(digits)
    k = len(digits)
    n = exponent + k
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return f"{digits[:n]}.{digits[n:]}"
    if -6 < n <= 0:
        return "0." + "0" * -n + digits
    mantissa = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
    return f"{mantissa}e{'+' if n - 1 >= 0 else '-'}{abs(n - 1)}"
