"""The interface every mechanism implements, device side and server side together.

A mechanism is built from a ``MechanismSpec`` and offers:

* ``encode(values, rng=None)``: perturb a batch of values (device side);
* ``aggregate(reports)``: fold reports into mergeable sufficient statistics;
* ``estimate(stats)``: unbiased estimates with standard errors;
* ``variance(n)``: analytical variance of one estimate, for planning;
* ``to_payloads`` / ``from_payloads``: the JSON wire form of reports;
* ``transition_matrix(...)``: exact output probabilities, so tests can check
  the epsilon bound by enumeration instead of trusting it.
"""

from __future__ import annotations

import base64
import binascii
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from shared.estimates import Estimate, MeanEstimate
from shared.randomness import Rng
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics, MomentStatistics

StatsT = TypeVar("StatsT", CountStatistics, MomentStatistics)
EstimateT = TypeVar("EstimateT", Estimate, MeanEstimate)


class Mechanism(ABC, Generic[StatsT, EstimateT]):
    """An epsilon-LDP mechanism: randomizer, sufficient statistics and estimator."""

    name: ClassVar[str]
    #: The keys of one report's JSON payload (``to_payloads``); no other key is accepted.
    payload_fields: ClassVar[frozenset[str]]

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
    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
        """Perturb a batch of values; ``rng=None`` uses the OS CSPRNG."""

    @abstractmethod
    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        """Return ``reports`` as this mechanism's array form, or raise ValueError saying why not."""

    @abstractmethod
    def empty_statistics(self) -> StatsT:
        """The statistics of zero reports (the identity of ``merge``)."""

    @abstractmethod
    def aggregate(self, reports: np.ndarray) -> StatsT:
        """Fold a batch of reports into sufficient statistics."""

    @abstractmethod
    def estimate(self, stats: StatsT) -> EstimateT:
        """Unbiased estimate with standard errors from sufficient statistics."""

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
    payload_fields: ClassVar[frozenset[str]] = frozenset({"value"})

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


def decode_bits_field(payload: object, index: int, row_bytes: int) -> bytes:
    """The bytes of a payload's base64 ``"bits"`` field, checked to be ``row_bytes`` long."""
    encoded = payload.get("bits") if isinstance(payload, dict) else None
    if not isinstance(encoded, str):
        raise ValueError(f"report {index}: payload needs a base64 string 'bits'")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"report {index}: 'bits' is not valid base64 ({error})") from None
    if len(raw) != row_bytes:
        raise ValueError(f"report {index}: 'bits' holds {len(raw)} bytes, expected {row_bytes}")
    return raw


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
