"""What the open-domain string mechanisms (``cms``, ``hcms``, ``pem``, ``sfp``) share.

Values are Python strings, taken as their UTF-8 bytes; nobody lists them in advance.
Every such mechanism estimates the frequency of any candidate string the analyst asks
about (``estimate(stats, candidates)``, an ``Estimate`` whose entry i is
``candidates[i]``); the discovery mechanisms (``pem``, ``sfp``) also find the most
frequent strings without candidates (``heavy_hitters(stats, k)``, a ``HeavyHitters``).

``encode(values, rng=None, context=FRESH)``: ``values`` a sequence of strings, one per
device; ``context.memo`` the devices' permanent randomness (``shared.memo``), used where a
mechanism assigns a device something for life (``pem``: its group); ``None`` draws it
fresh, which gives one report the same law.

Padded values. The discovery mechanisms read a value of at most ``max_length`` bytes as
its UTF-8 bytes padded with ``PAD`` = 0xFF to a fixed length (``padded_matrix``). UTF-8
never uses the byte 0xFF, so the padding is unambiguous (a NUL byte is a character like
any other). Which byte strings begin such a padded value is decided by a byte automaton
for well-formed UTF-8 (Unicode Standard, Table 3-7) followed only by padding:
``well_formed_prefixes`` tests whole rows, ``utf8_extensions`` extends prefixes by one
byte at a time, keeping those some padded value of at most ``max_length`` bytes begins
with (a character cut by the prefix must still fit).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field

from shared.estimates import Estimate
from shared.mechanisms.abilities import FRESH, CandidateQueries, DeviceContext
from shared.mechanisms.categorical import check_true_counts
from shared.mechanisms.rappor_common import factorize_strings
from shared.mechanisms.spec import MechanismSpec, ValueKind
from shared.randomness import Rng

#: The padding byte, which UTF-8 never uses.
PAD = 0xFF
#: Longest string a discovery mechanism takes (UTF-8 bytes).
MAX_STRING_BYTES = 256
#: The longest string (UTF-8 bytes) a device may report, for the discovery mechanisms.
MaxLength = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_STRING_BYTES,
        description="pem, sfp: the longest string (UTF-8 bytes) a device may report.",
    ),
]

# The automaton's states: a whole character read, 1..3 continuation bytes still due (with
# the special ranges after E0, ED, F0, F4), padding begun, rejected.
_ACCEPT, _TAIL1, _TAIL2, _TAIL3, _E0, _ED, _F0, _F4, _PADDED, _REJECT = range(10)
#: The state of the empty prefix.
UTF8_START = _ACCEPT
#: Bytes each state still needs to complete its character.
_NEEDS = np.array([0, 1, 2, 3, 2, 2, 3, 3, 0, 0], dtype=np.int64)


def _utf8_automaton() -> np.ndarray:
    """``next[state, byte]`` of the automaton (every unlisted move rejects)."""
    table = np.full((10, 256), _REJECT, dtype=np.int64)
    table[_ACCEPT, 0x00:0x80] = _ACCEPT
    table[_ACCEPT, 0xC2:0xE0] = _TAIL1
    table[_ACCEPT, 0xE0] = _E0
    table[_ACCEPT, 0xE1:0xED] = _TAIL2
    table[_ACCEPT, 0xED] = _ED
    table[_ACCEPT, 0xEE:0xF0] = _TAIL2
    table[_ACCEPT, 0xF0] = _F0
    table[_ACCEPT, 0xF1:0xF4] = _TAIL3
    table[_ACCEPT, 0xF4] = _F4
    table[_ACCEPT, PAD] = _PADDED
    table[_TAIL1, 0x80:0xC0] = _ACCEPT
    table[_TAIL2, 0x80:0xC0] = _TAIL1
    table[_TAIL3, 0x80:0xC0] = _TAIL2
    table[_E0, 0xA0:0xC0] = _TAIL1
    table[_ED, 0x80:0xA0] = _TAIL1
    table[_F0, 0x90:0xC0] = _TAIL2
    table[_F4, 0x80:0x90] = _TAIL2
    table[_PADDED, PAD] = _PADDED
    return table


_NEXT = _utf8_automaton()


def _completable(states: np.ndarray, length: int, max_length: int) -> np.ndarray:
    """Whether prefixes of ``length`` bytes in ``states`` begin some padded value: not
    rejected, and their last character fits within max_length bytes."""
    return (states != _REJECT) & (length + _NEEDS[states] <= max_length)


def well_formed_prefixes(prefixes: np.ndarray, max_length: int) -> np.ndarray:
    """For each row of a (n, bytes) uint8 matrix: is it the first bytes of the padded
    encoding of some value of at most ``max_length`` bytes? (Well-formed UTF-8, Unicode
    Standard Table 3-7, then only 0xFF padding; a split character must fit.)"""
    states = np.full(prefixes.shape[0], UTF8_START)
    for column in prefixes.T:
        states = _NEXT[states, column]
    return _completable(states, prefixes.shape[1], max_length)


def utf8_extensions(
    states: np.ndarray, length: int, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every one-byte extension, to ``length`` bytes, of prefixes in automaton ``states``
    (``UTF8_START`` for the empty one) that still begins some padded value of at most
    ``max_length`` bytes: (the prefix's index, the byte, the new state), in that order."""
    following = _NEXT[states]  # (prefixes, 256): the state after each next byte
    parent, byte = np.nonzero(_completable(following, length, max_length))
    return parent, byte, following[parent, byte]


def padded_matrix(raw: Sequence[bytes], max_length: int) -> np.ndarray:
    """UTF-8 values as a (len(raw), max_length) uint8 matrix, each padded with 0xFF."""
    filler = bytes([PAD]) * max_length
    joined = b"".join(value + filler[len(value) :] for value in raw)
    return np.frombuffer(joined, dtype=np.uint8).reshape(len(raw), max_length)


def _utf8_or_error(position: int, value: object) -> bytes:
    """``value`` as UTF-8, or the TypeError or ValueError that names it."""
    if not isinstance(value, str):
        raise TypeError(f"value at position {position} is a {type(value).__name__}, not a str")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"value at position {position} is not valid Unicode (a lone surrogate)"
        ) from None


def _check_lengths(encoded: Sequence[bytes], codes: np.ndarray | None, max_length: int) -> None:
    """ValueError naming the first value longer than ``max_length`` bytes; ``codes`` maps
    positions to entries of ``encoded`` when it holds distinct values only."""
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    too_long = lengths > max_length
    if codes is not None:
        too_long = too_long[codes]
        lengths = lengths[codes]
    if too_long.any():
        position = int(np.flatnonzero(too_long)[0])
        raise ValueError(
            f"value at position {position} has {lengths[position]} UTF-8 bytes, more than "
            f"the metric's max_length of {max_length}"
        )


def utf8_values(values: Sequence[str] | np.ndarray, max_length: int | None = None) -> list[bytes]:
    """Each value as UTF-8 bytes, checked: a ``str`` (no lone surrogates) of at most
    ``max_length`` bytes when given; TypeError for a single string or a value that is not
    one, ValueError for a bad one, naming its position. One C-level pass when all is well."""
    if isinstance(values, str | bytes):
        raise TypeError("expected a sequence of strings, got a single string")
    items = list(values)
    try:
        encoded = list(map(str.encode, items))
    except (TypeError, UnicodeEncodeError):
        encoded = [_utf8_or_error(position, value) for position, value in enumerate(items)]
    if max_length is not None:
        _check_lengths(encoded, None, max_length)
    return encoded


def factorize_utf8(
    values: Sequence[str] | np.ndarray, max_length: int | None = None
) -> tuple[list[bytes], np.ndarray]:
    """Distinct values (first-seen order) as UTF-8, checked against ``max_length`` when
    given, and each value's index among them; errors name a position in ``values``."""
    distinct, codes = factorize_strings(values)
    raw = [text.encode("utf-8") for text in distinct]  # checked by factorize_strings
    if max_length is not None:
        _check_lengths(raw, codes, max_length)
    return raw, codes


def string_population(
    values: Sequence[str] | np.ndarray,
    counts: Sequence[int] | np.ndarray,
    rng: np.random.Generator,
    max_length: int | None = None,
) -> tuple[list[bytes], np.ndarray]:
    """A simulated population, ``counts[i]`` devices holding ``values[i]``: its distinct
    strings as UTF-8 and each one's devices (the counts of a repeated string added).
    TypeError unless ``rng`` is a numpy Generator (simulation only)."""
    raw, codes = factorize_utf8(values, max_length)
    counts = check_true_counts(np.asarray(counts), codes.size, rng)
    totals = np.zeros(len(raw), dtype=np.int64)
    np.add.at(totals, codes, counts)
    return raw, totals


def require_candidates(
    name: str, candidates: Sequence[str] | np.ndarray | None
) -> Sequence[str] | np.ndarray:
    """``candidates``, or ValueError saying that an open-domain estimate needs them."""
    if candidates is None:
        raise ValueError(
            f"the {name} mechanism estimates the frequencies of candidate strings: call "
            "estimate(stats, candidates=[...])"
        )
    return candidates


class StringSpec(MechanismSpec):
    """The spec of a mechanism whose values are strings."""

    kind: ClassVar[ValueKind] = "string"


class OpenStringMechanism:
    """Mixin for the open-domain string mechanisms (see the module docstring)."""

    provides: ClassVar[tuple[type, ...]] = (CandidateQueries,)

    @abstractmethod
    def encode(
        self, values: Sequence[str] | np.ndarray, rng: Rng = None, context: DeviceContext = FRESH
    ) -> np.ndarray:
        """Reports of ``values`` (strings, one per device)."""

    @abstractmethod
    def estimate(self, stats: Any, candidates: Sequence[str] | None = None) -> Estimate:
        """Unbiased frequencies (with std) of ``candidates``, in their order; ValueError
        without candidates (there is no list of categories to estimate)."""
