"""Permanent (memoized) randomness: the same device and value draw the same bits forever.

A memoized mechanism (``lgrr``, ``lsue``, ``loue``, ``losue``, ``dbitflip``,
``onebitmean``) answers a value with a *permanent* response that must not change
between reports, or the average of a device's reports would converge to its value.
Storing the response would mean storing something derived from the value on the
device, so, as RAPPOR's permanent response here does, the response is recomputed on
every report from a per-device secret: its random draws are words of a keyed stream,

    stream(purpose, key) = SHAKE-256(HMAC-SHA256(secret,
        "LDP memo v1" || 0x00 || BE16(len(scope)) || scope || BE16(len(purpose)) || purpose
        || BE64(key)))

read as little-endian 64-bit words (word j is bytes 8j..8j+7; SHAKE's output is a
prefix of any longer output, so a stream is extended without changing what was read).
``scope`` names the exact spec the memo serves (``spec_scope``: a label and the spec's
SHA-256, ``shared.spec_hash``), ``purpose`` the use (a mechanism's permanent response, a
device's bucket sample, its rounding offset) and ``key`` the memoized input (a category
index, a grid point; 0 for per-device draws). A device's scope is never the metric's
name and version alone: two different specs served under one name and version would
then read the same words against different thresholds, and wherever their permanent
responses differ the one with the larger epsilon would be the true value (a joint loss
with no bound, not the sum of the two epsilons). With the spec's hash in the scope, two
specs draw independent words and compose by addition, as the ledger charges them.
Under the HMAC and SHAKE pseudorandomness assumption the words are uniform and
independent across (secret, scope, purpose, key), and the same secret gives the same
words forever: lose the secret and the memo is lost with it (the next reports draw a
new permanent response, and what the two reveal together composes).

Three ``Memo`` implementations, one interface:

* ``KeyedMemo``: the construction above, one secret per row (or one for all rows): what
  devices use, and what the tests use to check stability across restarts and processes.
* ``SimulatedMemo``: a vectorized counter-based hash (SplitMix64's finalizer,
  Steele, Lea and Flood, OOPSLA 2014) of (seed, device id, purpose, key, word index):
  the same per-device permanence for simulations of millions of devices, without an
  HMAC per device. Not a secret PRF: simulations only, never on a device.
* ``FreshMemo``: words straight from a ``RandomSource``, a new permanent response for
  every report. It is a mechanism's default (``memo=None``): one report's law is the
  same as with memoization, which is all a one-period simulation needs, and it is what
  a *stateless* implementation does across periods (its reports of one value average
  to the value: the leak memoization exists to stop).

``MemoDraws`` reads a purpose's words row by row and offers the exact samplers the
mechanisms need: Bernoulli(T / 2^53) from the top 53 bits of a word (as
``RandomSource.bernoulli_below``) and integers exactly uniform on {0, .., k-1} by
rejection below the next power of two (as ``RandomSource.integers``), each row
reading further along its own stream while it is rejected.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.hashing import keyed_stream
from shared.randomness import BITS53, RandomSource

__all__ = [
    "FreshMemo",
    "KeyedMemo",
    "Memo",
    "MemoDraws",
    "MemoStreams",
    "SimulatedMemo",
    "memo_scope",
    "spec_scope",
    "splitmix64",
]

#: Domain separation of the memo streams from every other use of a device secret.
MEMO_LABEL = b"LDP memo v1\x00"
#: Least secret length: the memo is only as unpredictable as the secret.
MIN_SECRET_BYTES = 16
_WORD = np.dtype("<u8")


#: Prefix of a spec's memo scope (``spec_scope``).
SPEC_SCOPE_LABEL = b"spec sha-256\x00"
_SPEC_HASH_BYTES = 32


def spec_scope(spec_hash: bytes) -> bytes:
    """The scope of the memo of the spec whose ``shared.spec_hash.spec_hash`` is
    ``spec_hash``: ``"spec sha-256" || 0x00 || spec_hash`` (45 bytes). What a device uses."""
    if len(spec_hash) != _SPEC_HASH_BYTES:
        raise ValueError(f"a spec hash has {_SPEC_HASH_BYTES} bytes, got {len(spec_hash)}")
    return SPEC_SCOPE_LABEL + bytes(spec_hash)


def memo_scope(metric: str, version: int) -> bytes:
    """A scope named by a metric and version alone: ``UTF-8(metric) || 0x00 ||
    BE32(version)``, for tests of a mechanism on its own. Not a device's scope: it does
    not change when a spec changes under the same version (``spec_scope`` does)."""
    return metric.encode("utf-8") + b"\x00" + version.to_bytes(4, "big")


class MemoStreams(ABC):
    """The streams of one purpose, one per row of a memo, keyed by each row's memo key."""

    @abstractmethod
    def words(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        """``(len(rows), count)`` uint64: words ``starts[i] .. starts[i] + count - 1`` of
        row ``rows[i]``'s stream."""


class Memo(ABC):
    """The permanent randomness of the devices behind a batch of ``size`` values."""

    size: int

    @abstractmethod
    def open(self, purpose: bytes, keys: np.ndarray) -> MemoStreams:
        """The streams of (each row's device, ``purpose``, ``keys[row]``)."""

    def draws(self, purpose: bytes, keys: npt.ArrayLike | None = None) -> MemoDraws:
        """Sequential draws for ``purpose``; ``keys`` (one per row, default 0) is the
        memoized input each row's stream is keyed by."""
        return MemoDraws(self, purpose, keys)


class KeyedMemo(Memo):
    """``SHAKE-256(HMAC-SHA256(secret, ...))`` streams (module docstring): the device's memo.

    ``secrets`` is one secret for every row (one device) or one per row; ``size`` is the
    number of rows (required with one secret). Streams are cached per (secret, purpose,
    key) while the object lives, so repeated draws cost one HMAC each.
    """

    def __init__(self, secrets: bytes | Sequence[bytes], scope: bytes, size: int = 1) -> None:
        if isinstance(secrets, bytes | bytearray):
            self._secrets: list[bytes] = [bytes(secrets)]
            self.size = size
        else:
            self._secrets = [bytes(secret) for secret in secrets]
            self.size = len(self._secrets)
        for index, secret in enumerate(self._secrets):
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"secret {index} has {len(secret)} bytes; a memo needs at least "
                    f"{MIN_SECRET_BYTES}"
                )
        if len(scope) >= 1 << 16:
            raise ValueError("a memo scope must be shorter than 65536 bytes")
        self._prefix = MEMO_LABEL + len(scope).to_bytes(2, "big") + scope
        self._streams: dict[tuple[int, bytes, int], bytes] = {}

    def open(self, purpose: bytes, keys: np.ndarray) -> MemoStreams:
        return _KeyedStreams(self, purpose, keys)

    def stream(self, row: int, purpose: bytes, key: int, size: int) -> bytes:
        """At least ``size`` bytes of row ``row``'s stream for (purpose, key)."""
        device = 0 if len(self._secrets) == 1 else row
        cache_key = (device, purpose, key)
        stream = self._streams.get(cache_key, b"")
        if len(stream) < size:
            message = (
                self._prefix
                + len(purpose).to_bytes(2, "big")
                + purpose
                + (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
            )
            # Read ahead (at least 32 words) so a rejection's next words need no new hash.
            stream = keyed_stream(self._secrets[device], message, max(size, 2 * len(stream), 256))
            self._streams[cache_key] = stream
        return stream


class _KeyedStreams(MemoStreams):
    def __init__(self, memo: KeyedMemo, purpose: bytes, keys: np.ndarray) -> None:
        self._memo, self._purpose, self._keys = memo, purpose, keys.tolist()

    def words(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        out = np.empty((len(rows), count), dtype=np.uint64)
        for i, (row, start) in enumerate(zip(rows.tolist(), starts.tolist(), strict=True)):
            stream = self._memo.stream(row, self._purpose, self._keys[row], 8 * (start + count))
            out[i] = np.frombuffer(stream, dtype=_WORD, count=count, offset=8 * start)
        return out


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (a bijection of uint64 with full avalanche), vectorized and in
    place (``x`` is overwritten and returned: no temporaries beyond one scratch array)."""
    scratch = np.empty_like(x)
    with np.errstate(over="ignore"):
        np.right_shift(x, np.uint64(30), out=scratch)
        x ^= scratch
        x *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(x, np.uint64(27), out=scratch)
        x ^= scratch
        x *= np.uint64(0x94D049BB133111EB)
        np.right_shift(x, np.uint64(31), out=scratch)
        x ^= scratch
    return x


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class SimulatedMemo(Memo):
    """Per-device permanent words from a vectorized hash of (seed, device, purpose, key, j).

    ``devices[i]`` is the device id of row i (any int64; rows of one device share its
    memo). Word j of a stream is ``mix(h + (j + 1) * G)`` with ``h = mix(mix(mix(seed')
    ^ device) ^ key)``, ``seed' = seed ^ digest(purpose)`` and ``mix`` the SplitMix64
    finalizer, ``G`` the golden-ratio increment: SplitMix64's generator started at a
    hashed state per stream. Statistically uniform (it passes BigCrush as a generator),
    not unpredictable: simulations only.
    """

    def __init__(self, devices: npt.ArrayLike, seed: int) -> None:
        self._devices = np.asarray(devices, dtype=np.int64).astype(np.uint64)
        if self._devices.ndim != 1:
            raise ValueError("devices must be a one-dimensional array of device ids")
        self.size = self._devices.size
        self._seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF

    def open(self, purpose: bytes, keys: np.ndarray) -> MemoStreams:
        tag = int.from_bytes(keyed_stream(b"simulated memo seed", purpose, 8), "little")
        state = splitmix64(np.full(self.size, np.uint64(self._seed ^ tag)))
        state ^= self._devices
        state = splitmix64(state)
        state ^= keys.astype(np.uint64)
        return _SimulatedStreams(splitmix64(state))


class _SimulatedStreams(MemoStreams):
    def __init__(self, state: np.ndarray) -> None:
        self._state = state  # h, one per row

    def words(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            # h + (start + j + 1) G for j = 0..count-1, one row per stream.
            offsets = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
            base = self._state[rows] + starts.astype(np.uint64) * _GOLDEN
            return splitmix64(np.add.outer(base, offsets))


class FreshMemo(Memo):
    """No memoization: every row's words are fresh from ``source`` (see the module docstring)."""

    def __init__(self, source: RandomSource, size: int) -> None:
        self._source = source
        self.size = size

    def open(self, purpose: bytes, keys: np.ndarray) -> MemoStreams:
        return _FreshStreams(self._source)


class _FreshStreams(MemoStreams):
    def __init__(self, source: RandomSource) -> None:
        self._source = source

    def words(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        return self._source.words(len(rows) * count).reshape(len(rows), count)


class MemoDraws:
    """Each row's words for one purpose, read in order: the exact samplers over a memo."""

    def __init__(self, memo: Memo, purpose: bytes, keys: npt.ArrayLike | None = None) -> None:
        size = memo.size
        array = np.zeros(size, dtype=np.int64) if keys is None else np.asarray(keys, np.int64)
        if array.shape != (size,):
            raise ValueError(f"memo keys must be {size} integers, one per row")
        self._size = size
        self._streams = memo.open(purpose, array)
        self._position = np.zeros(size, dtype=np.int64)

    def words(self, count: int, rows: np.ndarray | None = None) -> np.ndarray:
        """The next ``count`` words of each row (of ``rows``, default all): (rows, count)."""
        rows = np.arange(self._size) if rows is None else rows
        out = self._streams.words(rows, self._position[rows], count)
        self._position[rows] += count
        return out

    def bernoulli_below(self, thresholds: npt.ArrayLike, count: int = 1) -> np.ndarray:
        """(rows, count) booleans, True with probability ``T / 2^53`` (``thresholds``
        broadcast against that shape): a word's top 53 bits compared with T."""
        limits = np.asarray(thresholds, dtype=np.uint64)
        if np.any(limits > np.uint64(BITS53)):
            raise ValueError(f"thresholds must lie in 0..2**53, got {thresholds!r}")
        return (self.words(count) >> np.uint64(11)) < limits

    def integers(self, high: npt.ArrayLike) -> np.ndarray:
        """One integer per row, exactly uniform on {0, .., high - 1} (``high`` per row or
        one for all): a word masked below the next power of two, rejected while >= high."""
        size = self._size
        bounds = np.broadcast_to(np.asarray(high, dtype=np.int64), (size,))
        if np.any(bounds < 1):
            raise ValueError(f"integers() needs high >= 1, got {high!r}")
        masks = np.empty(size, dtype=np.uint64)
        for bound in np.unique(bounds).tolist():
            masks[bounds == bound] = (1 << (bound - 1).bit_length()) - 1
        out = np.empty(size, dtype=np.int64)
        pending = np.arange(size)
        while pending.size:
            draws = (self.words(1, pending)[:, 0] & masks[pending]).astype(np.int64)
            accepted = draws < bounds[pending]
            out[pending[accepted]] = draws[accepted]
            pending = pending[~accepted]
        return out
