"""The interface every mechanism implements, device side and server side together.

A mechanism is built from its spec model (``shared.mechanisms.spec``) and offers:

* ``encode(values, rng=None, context=FRESH)``: perturb a batch of values (device side),
  with what the devices keep for the spec in one ``DeviceContext`` (memo, secrets, cohorts);
* ``aggregate(reports)``: fold reports into mergeable sufficient statistics;
* ``variance(n)``: analytical variance of one estimate, for planning;
* ``to_payloads`` / ``from_payloads``: the JSON wire form of reports.

How its statistics are estimated depends on what its values are, and is an ability
(``shared.mechanisms.abilities``): frequencies of categories, a mean of numbers,
frequencies of candidate strings, heavy hitters. A class states the abilities it
provides in ``provides``; ``abilities`` collects them over its bases.

A mechanism module registers its class with ``@register`` (``shared.mechanisms.registry``)
and defines its spec model beside it.
"""

from __future__ import annotations

import base64
import binascii
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from shared.integrity import RefusalRule, ReportRefusedError
from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.spec import MechanismSpec
from shared.randomness import Rng
from shared.statistics import CountStatistics, MomentStatistics

StatsT = TypeVar("StatsT", CountStatistics, MomentStatistics)

#: JSON schemas of a payload field's value: an integer, or a base64 string.
INTEGER: dict[str, Any] = {"type": "integer"}
BASE64: dict[str, Any] = {"type": "string", "contentEncoding": "base64"}


def payload_shape(title: str, description: str, **fields: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one report's payload: an object with exactly ``fields`` (the
    OpenAPI document lists every mechanism's; ``from_payloads`` checks them)."""
    return {
        "title": title,
        "description": description,
        "type": "object",
        "properties": fields,
        "required": sorted(fields),
        "additionalProperties": False,
    }


class Mechanism(ABC, Generic[StatsT]):
    """An epsilon-LDP mechanism: randomizer, sufficient statistics and wire form."""

    name: ClassVar[str]
    #: The spec model this mechanism is built from.
    spec_model: ClassVar[type[MechanismSpec]]
    #: The JSON schema of one report's payload (``payload_shape``).
    payload_schema: ClassVar[dict[str, Any]]
    #: The keys of one report's JSON payload (``to_payloads``); no other key is accepted.
    payload_fields: ClassVar[frozenset[str]]
    #: The abilities (``shared.mechanisms.abilities`` protocols) this class adds.
    provides: ClassVar[tuple[type, ...]] = ()
    #: Every ability of the class: what it and its bases provide.
    abilities: ClassVar[frozenset[type]] = frozenset()
    #: Whether a report depends on what the device keeps for the spec (``DeviceContext``:
    #: a memoized response, a RAPPOR secret, a ``pem`` group), so that one device's
    #: reports are not independent draws.
    stateful: ClassVar[bool] = False

    #: What ``encode`` takes: ``"categorical"``, ``"numeric"`` or ``"string"`` (its spec
    #: model's kind).
    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec_model" in cls.__dict__:
            cls.kind = cls.spec_model.kind
        if hasattr(cls, "payload_schema"):
            cls.payload_fields = frozenset(cls.payload_schema["properties"])
        cls.abilities = frozenset(
            ability for base in cls.__mro__ for ability in base.__dict__.get("provides", ())
        )

    def __init__(self, spec: MechanismSpec) -> None:
        if spec.mechanism != self.name:
            raise ValueError(f"{type(self).__name__} needs a {self.name!r} spec, got {spec!r}")
        self.spec = spec

    @property
    def epsilon(self) -> float:
        return self.spec.epsilon

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    @abstractmethod
    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """Perturb a batch of values; ``rng=None`` uses the OS CSPRNG; ``context`` holds
        what the devices keep for this spec (read by the mechanisms that need it)."""

    @abstractmethod
    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        """Return ``reports`` as this mechanism's array form, or raise ValueError saying why not."""

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """The sets of reports no honest device sends but with probability at most 2^-40,
        whatever its input (``shared.integrity``); none unless the mechanism states some."""
        return ()

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        """Per report (already checked by ``check_reports``), the index in ``refusal_rules()``
        of the first rule it breaks, or -1 (int8)."""
        return np.full(len(reports), -1, dtype=np.int8)

    def first_refusal(self, reports: np.ndarray) -> ReportRefusedError | None:
        """The error naming the first report that breaks a rule, and the rule, or None."""
        codes = self.refusals(reports)
        broken = np.flatnonzero(codes >= 0)
        if not broken.size:
            return None
        index = int(broken[0])
        return ReportRefusedError(
            self.refusal_rules()[int(codes[index])], index, self.refusal_detail(reports[index])
        )

    def refusal_detail(self, report: np.ndarray) -> str:
        """What one refused report does, in a few words with its numbers (for the 422)."""
        return f"report {report!r}"

    @abstractmethod
    def empty_statistics(self) -> StatsT:
        """The statistics of zero reports (the identity of ``merge``)."""

    @abstractmethod
    def aggregate(self, reports: np.ndarray) -> StatsT:
        """Fold a batch of reports into sufficient statistics."""

    @abstractmethod
    def variance(self, n: int) -> float:
        """Analytical variance of one estimate from n reports (see the subclass)."""

    @abstractmethod
    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        """One JSON-ready dict per report."""

    @abstractmethod
    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        """Reports from their JSON dicts; raises ValueError naming the first bad one."""

    def statistics_from_bytes(self, data: bytes) -> StatsT:
        """Deserialize statistics produced by ``aggregate(...).to_bytes()``."""
        stats = self.empty_statistics()
        loaded = type(stats).from_bytes(data)
        if isinstance(loaded, CountStatistics) and isinstance(stats, CountStatistics):
            if loaded.length != stats.length:
                raise ValueError(
                    f"statistics have {loaded.length} counts, this mechanism keeps {stats.length}"
                )
        return loaded  # type: ignore[return-value]


class IndexReports:
    """Wire form of mechanisms whose report is one integer: payload ``{"value": int}``."""

    check_reports: Callable[[np.ndarray], np.ndarray]  # from the mechanism it is mixed into
    payload_schema: ClassVar[dict[str, Any]] = payload_shape(
        "IndexPayload",
        "grr, lgrr, hr: the reported category; laplace: the grid index; duchi: +1/-1; "
        "piecewise, sw: the cell index; onebitmean: the bit, 0 or 1.",
        value=INTEGER,
    )

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [{"value": int(v)} for v in self.check_reports(reports)]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        return self.check_reports(check_integer_field(payloads, "value"))


def check_packed_rows(
    packed: np.ndarray, bits: int, bit_order: str, what: str = "report"
) -> np.ndarray:
    """Check a (n, ceil(bits / 8)) uint8 matrix of packed bit rows with zero padding bits.

    ``bit_order`` is "big" (``np.packbits`` default: bit j is bit 7 - j % 8 of byte j // 8,
    padding in the low bits of the last byte) or "little" (bit j is bit j % 8, padding in
    the high bits).
    """
    row_bytes = (bits + 7) // 8
    array = np.asarray(packed)
    if array.ndim != 2 or array.shape[1] != row_bytes or array.dtype != np.uint8:
        raise ValueError(
            f"{what}s must be uint8 of shape (n, {row_bytes}), got {array.dtype} {array.shape}"
        )
    spare = row_bytes * 8 - bits
    if spare and array.size:
        last = array[:, -1]
        padding = last & np.uint8((1 << spare) - 1) if bit_order == "big" else last >> (8 - spare)
        bad = np.flatnonzero(padding)
        if bad.size:
            raise ValueError(f"{what} {bad[0]} sets padding bits past bit {bits - 1}")
    return array


def decode_base64_field(
    payload: object, index: int, field: str, size: int, unit: str = ""
) -> bytes:
    """The bytes of a payload's base64 string field ``field``, checked to be ``size`` long
    (``unit`` says what they hold, for the error)."""
    encoded = payload.get(field) if isinstance(payload, dict) else None
    if not isinstance(encoded, str):
        raise ValueError(f"report {index}: payload needs a base64 string {field!r}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"report {index}: {field!r} is not valid base64 ({error})") from None
    if len(raw) != size:
        raise ValueError(
            f"report {index}: {field!r} holds {len(raw)} bytes, expected {size}"
            + (f" ({unit})" if unit else "")
        )
    return raw


def decode_bits_field(payload: object, index: int, row_bytes: int) -> bytes:
    """The bytes of a payload's base64 ``"bits"`` field, checked to be ``row_bytes`` long."""
    return decode_base64_field(payload, index, "bits", row_bytes)


def check_integer_rows(
    reports: np.ndarray, what: str, fields: tuple[str, ...], low: list[int], high: list[int]
) -> np.ndarray:
    """``reports`` as an int64 (n, len(fields)) matrix whose column j lies in
    low[j]..high[j], or ValueError naming the first report and field outside."""
    array = np.asarray(reports)
    width = len(fields)
    if array.ndim != 2 or array.shape[1] != width or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{what} reports must be integer rows ({', '.join(fields)}), got {array.dtype} "
            f"of shape {array.shape}"
        )
    array = np.asarray(array, dtype=np.int64)
    if array.size and any(
        array[:, j].min() < low[j] or array[:, j].max() > high[j] for j in range(width)
    ):
        bad = (array < np.array(low)) | (array > np.array(high))
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        field = int(np.flatnonzero(bad[row])[0])
        raise ValueError(
            f"report {row}: {fields[field]} = {array[row, field]} is outside "
            f"{low[field]}..{high[field]}"
        )
    return array


def check_integer_field(payloads: list[dict[str, Any]], field: str) -> np.ndarray:
    """Pull an integer field out of every payload, naming the first payload that lacks one."""
    out = np.empty(len(payloads), dtype=np.int64)
    for i, payload in enumerate(payloads):
        value = payload.get(field) if isinstance(payload, dict) else None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"report {i}: payload needs an integer {field!r}, got {payload!r}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"report {i}: {field!r} = {value} is out of range")
        out[i] = value
    return out


def as_index_array(values: np.ndarray, size: int, what: str = "value") -> np.ndarray:
    """Validate category indices in 0..size-1 and return them as int64."""
    if type(values) is np.ndarray and values.shape == (1,) and values.dtype == np.int64:
        if 0 <= int(values[0]) < size:  # one device's value, already int64: nothing to convert
            return values
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{what}s must be a one-dimensional array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"{what}s must be integer category indices, got dtype {array.dtype}")
        fractional = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if fractional.size:
            position = fractional[0]
            raise ValueError(
                f"{what} {array[position].item()!r} at position {position} is not an integer"
                " category index"
            )
    if array.size and (array.min() < 0 or array.max() >= size):
        bad = np.flatnonzero((array < 0) | (array >= size))
        raise ValueError(
            f"{what} {array[bad[0]].item()!r} at position {bad[0]} is outside the domain "
            f"0..{size - 1} ({bad.size} out of range)"
        )
    return np.asarray(array, dtype=np.int64)
