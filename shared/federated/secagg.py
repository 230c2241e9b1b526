"""Secure aggregation: the server learns the sum of a round's masked inputs and nothing else.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint and Raykova, *Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead*, CCS 2020) on SecAgg (Bonawitz et al., *Practical Secure
Aggregation for Privacy-Preserving Machine Learning*, CCS 2017), for ``n`` devices of one
round attempt (:class:`RoundContext`), inputs in the ring ``Z_(2^b)`` of ``L`` coordinates:

1. **Keys.** Device ``u`` draws two X25519 key pairs, ``(c_u^SK, c_u^PK)`` to encrypt its
   shares and ``(s_u^SK, s_u^PK)`` for pairwise masks, and a 32-byte self-mask seed ``b_u``,
   and advertises the public keys. The :class:`Roster` (every advertised key, in order) fixes
   the **graph**: a random Harary graph ``H(n, k)`` (SecAgg+ §3), i.e. the ``n`` devices put
   on a ring in a pseudorandom order drawn from ``Roster.seed()``, each adjacent to the
   ``k / 2`` nearest on either side (``k = n - 1``: the complete graph). The seed is
   SHA-256 of the context, the parameters and every key, so the server cannot choose the
   graph except by choosing who is in the roster.
2. **Shares.** ``u`` Shamir-shares ``s_u^SK`` and ``b_u`` (threshold ``t`` among its ``k``
   neighbours ``N(u)``, evaluation point ``v + 1`` for neighbour ``v``;
   :mod:`shared.federated.shamir`) and sends neighbour ``v`` both shares in one AES-GCM
   ciphertext under ``HKDF(X25519(c_u^SK, c_v^PK))``, associated data ``context || u || v``.
3. **Masked input.** ``u`` masks with exactly the neighbours ``v`` whose shares reached it
   (the inbox), with ``s_uv = HKDF(X25519(s_u^SK, s_v^PK), context || min || max)``::

       y_u = x_u + PRG(b_u) + sum_(v > u) PRG(s_uv) - sum_(v < u) PRG(s_uv)   (mod 2^b)

   ``PRG`` is the AES-256-CTR keystream under an HKDF of the seed, read as little-endian
   ``uint32`` (``b <= 32``) or ``uint64`` words: uniform on ``Z_(2^b)`` coordinatewise.
4. **Unmasking.** With ``M`` the devices whose masked input arrived and ``S`` those that
   sent shares, each ``w`` in ``M`` is asked, for its neighbours in ``S``, for the ``b_v``
   share of those in ``M`` and the ``s_v^SK`` share of the others; it answers one request
   only, never both shares of one neighbour. The server rebuilds ``b_u`` for ``u`` in ``M``
   and ``s_v^SK`` for ``v`` in ``S \\ M`` (checked against ``s_v^PK``) and gets

       sum_(u in M) x_u = sum_(u in M) y_u - sum_(u in M) PRG(b_u)
                          - sum_(v in S \\ M) sum_(u in N(v) & M) sign(v - u) PRG(s_uv),

   since the pairwise masks of two devices in ``M`` cancel. Its work is
   ``O((|M| + |S \\ M| k) L)``.

**Why the server learns only the sum.** ``t > k / 2``: the ``k`` holders of ``u``'s shares
each reveal one of ``u``'s two secrets, so no server gets ``t`` shares of both (``2 t > k``),
even one that tells different holders different stories. Given ``t - 1`` shares a secret is
information-theoretically hidden, and an ``s_uv`` between two devices in the sum is never
revealed; so every ``y_u`` looks uniform to the server, and the sum of the inputs is all
that the unmasked total exposes, as long as the devices in the sum form one connected
piece of the graph (else the sum of each piece would show). :func:`plan_parameters` picks
``k`` so that this holds but with probability ``2^-SECURITY_BITS``; the server is assumed
not to collude with devices (devices it controls would hold shares of their neighbours).
This is the honest-but-curious guarantee. A server that tells the holders of ``u``'s
shares that ``u`` survived, and the holders of each neighbour's shares that the neighbour
dropped, rebuilds ``b_u`` and every ``s_uv``, hence ``x_u``, without any holder revealing
both shares of one device: SecAgg's consistency round (devices sign the set of survivors)
stops that, and needs signing keys the server cannot forge, which are not part of this
protocol.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.federated import shamir
from shared.federated.task import SecureAggregationSpec

__all__ = [
    "FAILURE_BITS",
    "MAX_DEVICES",
    "SECURITY_BITS",
    "Dropouts",
    "NotEnoughSharesError",
    "PublicKeys",
    "RoundContext",
    "Roster",
    "SecAggClient",
    "SecAggError",
    "SecAggParameters",
    "SecAggRefusal",
    "SimulatedRound",
    "Transcript",
    "decode_ring",
    "dropout_failure_bound",
    "encode_ring",
    "from_ring",
    "plan_parameters",
    "reconstruct_sum",
    "simulate_round",
    "to_ring",
    "unmask_request",
]

#: A planned round fails (some neighbourhood keeps fewer than t devices) with probability
#: at most ``2^-FAILURE_BITS`` at the planned dropout rate.
FAILURE_BITS = 20
#: The devices in a planned round's sum stay connected in the graph but with probability
#: ``2^-SECURITY_BITS`` (statistical security of SecAgg+'s sparse graph).
SECURITY_BITS = 40

#: Most devices one round may hold: the service refuses larger secure tasks, and a device
#: refuses a larger roster (every device fetches the whole roster, and the shares' wire
#: model holds at most 10,000 neighbours).
MAX_DEVICES = 10_000

#: Bytes of a raw X25519 key and of a self-mask seed.
KEY_BYTES = 32
_NONCE_BYTES = 12
_INDEX = struct.Struct(">Q")
#: Plaintext of an encrypted share: sender, recipient, share of s^SK, share of b.
_SHARE_PLAINTEXT = 2 * _INDEX.size + 2 * shamir.SHARE_BYTES
_PROTOCOL = b"secagg+/1"


class SecAggError(ValueError):
    """Malformed or inconsistent secure-aggregation input."""


class SecAggRefusal(SecAggError):
    """An honest device refuses a request that could reveal more than the sum."""


class NotEnoughSharesError(SecAggError):
    """Some device's secret has fewer than ``t`` revealed shares: the sum cannot be
    unmasked (the round is restarted; nothing about any input was revealed)."""

    def __init__(self, owner: int, secret: str, available: int, threshold: int) -> None:
        super().__init__(
            f"device {owner}'s {secret} has {available} revealed shares, needs {threshold}"
        )
        self.owner = owner
        self.secret = secret
        self.available = available
        self.threshold = threshold


# ---------------------------------------------------------------------------------------
# Public parameters


@dataclass(frozen=True)
class RoundContext:
    """One attempt of one round of a task: every key derivation and ciphertext is bound
    to it, so nothing carries over between attempts."""

    task: str
    round: int
    attempt: int

    def __post_init__(self) -> None:
        if not self.task:
            raise SecAggError("the round context needs a task name")
        for name in ("round", "attempt"):
            value = getattr(self, name)
            if not 0 <= value < 1 << 63:
                raise SecAggError(f"the round context's {name} must lie in 0..2^63-1, got {value}")

    def tag(self) -> bytes:
        """``"secagg+/1" || len(task) || task || round || attempt`` (UTF-8, big-endian
        lengths and counters): distinct contexts give distinct tags."""
        name = self.task.encode()
        return (
            _PROTOCOL
            + struct.pack(">I", len(name))
            + name
            + _INDEX.pack(self.round)
            + _INDEX.pack(self.attempt)
        )


@dataclass(frozen=True)
class SecAggParameters:
    """A round's public parameters: ``L`` coordinates in ``Z_(2^b)``, ``k`` neighbours
    per device and threshold ``t``."""

    vector_length: int
    modulus_bits: int
    neighbours: int
    threshold: int

    def __post_init__(self) -> None:
        if self.vector_length < 1:
            raise SecAggError(f"vector_length must be at least 1, got {self.vector_length}")
        if not 1 <= self.modulus_bits <= 64:
            raise SecAggError(f"modulus_bits must lie in 1..64, got {self.modulus_bits}")
        if self.neighbours < 1:
            raise SecAggError(f"neighbours (k) must be at least 1, got {self.neighbours}")
        if not 1 <= self.threshold <= self.neighbours:
            raise SecAggError(
                f"threshold (t) must lie in 1..k = {self.neighbours}, got {self.threshold}"
            )

    @property
    def dtype(self) -> np.dtype:
        """``uint32`` for ``b <= 32``, else ``uint64``."""
        return _ring_dtype(self.modulus_bits)

    def encode(self) -> bytes:
        """``L || b || k || t``, 8 bytes each, big-endian."""
        return b"".join(
            _INDEX.pack(v)
            for v in (self.vector_length, self.modulus_bits, self.neighbours, self.threshold)
        )


def dropout_failure_bound(
    participants: int, neighbours: int, threshold: int, dropout: float
) -> float:
    """``n P(Binomial(k, 1 - delta) < t)``: the union bound over the ``n`` devices on the
    chance that some device keeps fewer than ``t`` of its ``k`` neighbours when each drops
    out independently with probability ``delta``. Summed in log space from the exact
    binomial terms (log-factorials from ``math.lgamma``), capped at 1."""
    if not 0 <= dropout <= 1:
        raise SecAggError(f"dropout must lie in [0, 1], got {dropout}")
    log_factorials = _log_factorials(neighbours)
    return _failure_bound(participants, neighbours, threshold, dropout, log_factorials)


def plan_parameters(
    participants: int, vector_length: int, modulus_bits: int, spec: SecureAggregationSpec
) -> SecAggParameters:
    """``k`` and ``t = floor(threshold_fraction k) + 1`` for a round of ``n`` devices.

    ``spec.neighbours`` is taken if given, clamped to ``n - 1`` (an odd value below it is
    raised to the next even number, as the Harary graph needs). Otherwise ``k`` is the
    smallest even number (or ``n - 1``, the complete graph, when none below it will do)
    meeting both requirements at the dropout rate ``delta = spec.max_dropout``:

    * **reliability**: ``dropout_failure_bound(n, k, t, delta) <= 2^-FAILURE_BITS``;
    * **security** (SecAgg+ §3-4): the devices that stay in the sum must be connected in
      the graph, or the server learns the sum of each piece. On the ring of the random
      Harary graph a device reaches the next surviving device unless ``k / 2`` consecutive
      devices between them dropped; the graph falls apart only if that happens twice, so
      ``n delta^(k/2) <= 2^-SECURITY_BITS`` bounds the chance (a union bound over the ``n``
      starting positions of such a run); i.e. ``k >= 2 (SECURITY_BITS ln 2 + ln n) /
      ln(1 / delta)``.

    The complete graph meets the security requirement always and the reliability one only
    if the round is large enough: a small round may be planned complete and still fail
    more often than ``2^-FAILURE_BITS``.
    """
    n = participants
    if n < 2:
        raise SecAggError(f"secure aggregation needs at least 2 devices, got {n}")
    fraction = spec.threshold_fraction
    if spec.neighbours is not None:
        k = min(spec.neighbours, n - 1)
        if k % 2 and k < n - 1:
            k += 1
        return SecAggParameters(vector_length, modulus_bits, k, math.floor(fraction * k) + 1)
    delta = spec.max_dropout
    secure_from = 2 * math.ceil(_secure_half_degree(n, delta))
    log_factorials = _log_factorials(n - 1)
    chosen = n - 1
    for k in range(max(2, secure_from), n - 1, 2):
        t = math.floor(fraction * k) + 1
        if _failure_bound(n, k, t, delta, log_factorials) <= 2.0**-FAILURE_BITS:
            chosen = k
            break
    return SecAggParameters(vector_length, modulus_bits, chosen, math.floor(fraction * chosen) + 1)


def _secure_half_degree(participants: int, dropout: float) -> float:
    """``(SECURITY_BITS ln 2 + ln n) / ln(1 / delta)``: ``k / 2`` at least this keeps the
    survivors connected but with probability ``2^-SECURITY_BITS`` (``plan_parameters``)."""
    if dropout <= 0:
        return 1.0
    return (SECURITY_BITS * math.log(2) + math.log(participants)) / -math.log(dropout)


def _log_factorials(k: int) -> np.ndarray:
    return np.array([math.lgamma(i + 1) for i in range(k + 1)])


def _failure_bound(
    participants: int, neighbours: int, threshold: int, dropout: float, log_factorials: np.ndarray
) -> float:
    """``dropout_failure_bound`` with the log-factorials given (``0..k`` at least)."""
    k, t = neighbours, threshold
    if not 1 <= t <= k:
        raise SecAggError(f"threshold {t} must lie in 1..{k}")
    if dropout == 0:
        return 0.0
    if dropout == 1:
        return float(min(1, participants))
    i = np.arange(t)  # surviving neighbours: fewer than t
    logs = (
        log_factorials[k]
        - log_factorials[i]
        - log_factorials[k - i]
        + i * math.log1p(-dropout)
        + (k - i) * math.log(dropout)
    )
    peak = float(logs.max())
    log_tail = peak + math.log(float(np.exp(logs - peak).sum()))
    return min(1.0, math.exp(math.log(participants) + log_tail))


# ---------------------------------------------------------------------------------------
# The roster and its graph


@dataclass(frozen=True)
class PublicKeys:
    """A device's two advertised X25519 public keys (raw, 32 bytes each)."""

    encryption_key: bytes
    masking_key: bytes

    def __post_init__(self) -> None:
        for name in ("encryption_key", "masking_key"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise SecAggError(f"{name} must be {KEY_BYTES} raw bytes")

    def encode(self) -> bytes:
        """``encryption_key || masking_key``."""
        return self.encryption_key + self.masking_key


@dataclass(frozen=True)
class Roster:
    """Every device of a round attempt with its keys (index ``i`` -> ``keys[i]``), and the
    round's parameters: the graph and every derivation follow from it alone."""

    context: RoundContext
    parameters: SecAggParameters
    keys: tuple[PublicKeys, ...]

    def __post_init__(self) -> None:
        if not all(isinstance(keys, PublicKeys) for keys in self.keys):
            raise SecAggError("a roster's keys must be PublicKeys, one per device")
        n, k = len(self.keys), self.parameters.neighbours
        if n < 2:
            raise SecAggError(f"a roster needs at least 2 devices, got {n}")
        if k > n - 1:
            raise SecAggError(f"k = {k} neighbours exceeds the other devices ({n - 1})")
        if k % 2 and k != n - 1:
            raise SecAggError(f"k = {k} must be even (or n - 1 = {n - 1}, the complete graph)")

    def __len__(self) -> int:
        return len(self.keys)

    def seed(self) -> bytes:
        """SHA-256 of ``"secagg+/1 roster" || context.tag() || parameters || n ||`` every
        device's ``encryption_key || masking_key`` in index order."""
        digest = hashlib.sha256(_PROTOCOL + b" roster")
        digest.update(self.context.tag())
        digest.update(self.parameters.encode())
        digest.update(_INDEX.pack(len(self.keys)))
        for keys in self.keys:
            digest.update(keys.encode())
        return digest.digest()

    def neighbours(self, index: int) -> tuple[int, ...]:
        """The sorted neighbours of device ``index`` in the random Harary graph ``H(n, k)``
        (SecAgg+ §3): on the ring ordered by the permutation drawn from ``seed()``, the
        ``k / 2`` devices on either side; every other device when ``k = n - 1``."""
        n, k = len(self.keys), self.parameters.neighbours
        if not 0 <= index < n:
            raise SecAggError(f"device {index} is not in the roster of {n}")
        if k == n - 1:
            return tuple(v for v in range(n) if v != index)
        order, position = self._ring
        half = k // 2
        offsets = np.concatenate([np.arange(-half, 0), np.arange(1, half + 1)])
        return tuple(sorted(int(v) for v in order[(position[index] + offsets) % n]))

    @functools.cached_property
    def _ring(self) -> tuple[np.ndarray, np.ndarray]:
        """The ring: ``order[p]`` is the device at position ``p``, ``position`` its inverse.
        The order sorts ``n`` 64-bit words of the AES-CTR keystream keyed by the seed (a
        uniformly random permutation up to ties of probability ``n^2 / 2^65``, which the
        stable sort breaks by index, the same for every device)."""
        n = len(self.keys)
        words = np.frombuffer(_keystream(self.seed(), b"graph", 8 * n), dtype="<u8")
        order = np.argsort(words, kind="stable")
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)
        return order, position


# ---------------------------------------------------------------------------------------
# Ring encoding


def _ring_dtype(bits: int) -> np.dtype:
    if not 1 <= bits <= 64:
        raise SecAggError(f"modulus_bits must lie in 1..64, got {bits}")
    return np.dtype(np.uint32) if bits <= 32 else np.dtype(np.uint64)


def _ring_mask(bits: int) -> np.unsignedinteger:
    return _ring_dtype(bits).type((1 << bits) - 1)


def to_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers (e.g. int64 lattice points, negative ones too) reduced mod ``2^b``, as the
    ring dtype (two's complement: ``-1`` becomes ``2^b - 1``)."""
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        raise SecAggError(f"ring values must be integers, got dtype {values.dtype}")
    wide = values.astype(np.uint64) if values.dtype.kind == "u" else values.astype(np.int64)
    dtype = _ring_dtype(bits)
    return (wide.view(np.uint64) & np.uint64((1 << bits) - 1)).astype(dtype)


def from_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements ``0 <= r < 2^b`` as int64 in ``[-2^(b-1), 2^(b-1))`` (``r - 2^b`` for
    ``r >= 2^(b-1)``)."""
    ring = _checked_ring(np.asarray(values), bits).astype(np.uint64)
    spare = np.uint64(64 - bits)  # sign-extend bit b - 1: shift it to the top and back
    return (ring << spare).view(np.int64) >> np.int64(64 - bits)


def encode_ring(values: np.ndarray, bits: int) -> bytes:
    """Ring elements as little-endian words, 4 bytes each for ``b <= 32``, else 8."""
    ring = _checked_ring(np.asarray(values), bits)
    return ring.astype(_ring_dtype(bits).newbyteorder("<")).tobytes()


def decode_ring(data: bytes, bits: int, length: int) -> np.ndarray:
    """The inverse of ``encode_ring`` for ``length`` elements; ``SecAggError`` if ``data``
    is not ``length`` words or holds a value ``>= 2^b``."""
    dtype = _ring_dtype(bits)
    if len(data) != length * dtype.itemsize:
        raise SecAggError(
            f"a ring vector of {length} elements has {length * dtype.itemsize} bytes, "
            f"got {len(data)}"
        )
    values = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype)
    return _checked_ring(values, bits)


def _checked_ring(values: np.ndarray, bits: int) -> np.ndarray:
    dtype = _ring_dtype(bits)
    if values.dtype.kind not in "iu":
        raise SecAggError(f"ring values must be integers, got dtype {values.dtype}")
    if values.size and (
        (values.dtype.kind == "i" and int(values.min()) < 0) or int(values.max()) >> bits
    ):
        raise SecAggError(f"ring values must lie in 0..2^{bits}-1")
    return values.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------
# Primitives bound to the protocol


def _hkdf(secret: bytes, info: bytes) -> bytes:
    """32 bytes of HKDF-SHA256 (RFC 5869) of ``secret``, no salt, with ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _keystream(seed: bytes, purpose: bytes, size: int) -> bytes:
    """``size`` bytes of the AES-256-CTR keystream (zero counter block) under
    ``HKDF(seed, "secagg+/1 prg " || purpose)``."""
    key = _hkdf(seed, _PROTOCOL + b" prg " + purpose)
    return Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(size))


class _Prg:
    """``PRG(seed)``: the AES-256-CTR keystream under ``HKDF(seed, "... prg mask")`` read
    as ``L`` little-endian words of the ring dtype (uniform mod ``2^32`` or ``2^64``, so
    mod ``2^b`` too). Reuses one buffer: each expansion is valid until the next."""

    def __init__(self, parameters: SecAggParameters) -> None:
        self._dtype = parameters.dtype.newbyteorder("<")
        self._length = parameters.vector_length
        size = self._length * self._dtype.itemsize
        self._zeros = bytes(size)
        self._buffer = bytearray(size + 15)  # update_into wants block_size - 1 bytes spare

    def expand(self, seed: bytes) -> np.ndarray:
        key = _hkdf(seed, _PROTOCOL + b" prg mask")
        encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        encryptor.update_into(self._zeros, self._buffer)
        return np.frombuffer(self._buffer, dtype=self._dtype, count=self._length)


def _pair_info(label: bytes, context: RoundContext, u: int, v: int) -> bytes:
    """HKDF info for the pair ``{u, v}``: label, context tag, ``min || max``."""
    return (
        _PROTOCOL + b" " + label + context.tag() + _INDEX.pack(min(u, v)) + _INDEX.pack(max(u, v))
    )


def _agree(private: X25519PrivateKey, public: bytes, who: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as error:  # a low-order point: the shared secret would be zero
        raise SecAggError(f"{who} advertised an invalid X25519 key") from error


def _mask_seed(
    private: X25519PrivateKey, public: bytes, context: RoundContext, u: int, v: int
) -> bytes:
    """``s_uv = HKDF(X25519(s_u^SK, s_v^PK), "mask seed" || context || min || max)``."""
    secret = _agree(private, public, f"device {v}")
    return _hkdf(secret, _pair_info(b"mask seed", context, u, v))


def _share_key(
    private: X25519PrivateKey, public: bytes, context: RoundContext, u: int, v: int
) -> bytes:
    """The AES-256-GCM key of the pair, from the encryption keys as ``_mask_seed``."""
    secret = _agree(private, public, f"device {v}")
    return _hkdf(secret, _pair_info(b"share key", context, u, v))


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _share_ad(context: RoundContext, sender: int, recipient: int) -> bytes:
    """Associated data of an encrypted share: ``context || sender || recipient``."""
    return context.tag() + _INDEX.pack(sender) + _INDEX.pack(recipient)


# ---------------------------------------------------------------------------------------
# The device


@dataclass
class _Shared:
    """What ``share_keys`` fixed: the roster, the device's index and its neighbours."""

    roster: Roster
    index: int
    neighbours: frozenset[int]
    outbox: dict[int, bytes]


class SecAggClient:
    """The device's side of one round attempt.

    Call ``advertise``, then ``share_keys`` with the roster, ``mask`` with the shares
    addressed to it and its input, and ``unmask`` with the server's request. Each step
    answers one request only: repeating it with the same input returns the same answer,
    with other input it is refused (a second answer could reveal more).
    """

    def __init__(self, context: RoundContext) -> None:
        self.context = context
        self._encryption = X25519PrivateKey.generate()
        self._masking = X25519PrivateKey.generate()
        self._self_seed = os.urandom(KEY_BYTES)
        self._keys = PublicKeys(_raw_public(self._encryption), _raw_public(self._masking))
        self._shared: _Shared | None = None
        # sender -> (share of its masking key, share of its self-mask seed)
        self._held: dict[int, tuple[bytes, bytes]] | None = None
        self._mask_request: tuple[dict[int, bytes], np.ndarray, np.ndarray] | None = None
        self._unmask_request: tuple[frozenset[int], frozenset[int]] | None = None
        self._unmask_answer: tuple[dict[int, bytes], dict[int, bytes]] | None = None

    def advertise(self) -> PublicKeys:
        """The device's two public keys for this attempt."""
        return self._keys

    def share_keys(self, roster: Roster, index: int) -> dict[int, bytes]:
        """One AES-GCM ciphertext per neighbour (recipient -> ciphertext) holding its
        Shamir shares of the device's masking key and self-mask seed.

        Refuses a roster of another context, one without the device's keys at ``index``
        (or with them elsewhere too), or with ``t <= k / 2`` (then two disjoint groups of
        neighbours could rebuild both of its secrets)."""
        if self._shared is not None:
            if self._shared.roster == roster and self._shared.index == index:
                return dict(self._shared.outbox)
            raise SecAggRefusal("the device already shared its keys for another roster")
        self._check_roster(roster, index)
        parameters = roster.parameters
        neighbours = roster.neighbours(index)
        points = [v + 1 for v in neighbours]
        key_shares = shamir.split(_raw_private(self._masking), parameters.threshold, points)
        seed_shares = shamir.split(self._self_seed, parameters.threshold, points)
        outbox = {}
        for v, key_share, seed_share in zip(neighbours, key_shares, seed_shares, strict=True):
            plaintext = _INDEX.pack(index) + _INDEX.pack(v) + key_share + seed_share
            key = _share_key(
                self._encryption, roster.keys[v].encryption_key, self.context, index, v
            )
            nonce = os.urandom(_NONCE_BYTES)
            sealed = AESGCM(key).encrypt(nonce, plaintext, _share_ad(self.context, index, v))
            outbox[v] = nonce + sealed
        self._shared = _Shared(roster, index, frozenset(neighbours), outbox)
        return dict(outbox)

    def _check_roster(self, roster: Roster, index: int) -> None:
        if roster.context != self.context:
            raise SecAggRefusal(
                f"the roster is for {roster.context}, the device's keys for {self.context}"
            )
        n = len(roster)
        if not 0 <= index < n or roster.keys[index] != self._keys:
            raise SecAggRefusal(f"the roster does not hold the device's keys at index {index}")
        mine = {self._keys.encryption_key, self._keys.masking_key}
        copies = [
            i
            for i, keys in enumerate(roster.keys)
            if i != index and mine & {keys.encryption_key, keys.masking_key}
        ]
        if copies:
            raise SecAggRefusal(f"the roster repeats the device's keys at {copies[:3]}")
        k, t = roster.parameters.neighbours, roster.parameters.threshold
        if 2 * t <= k:
            raise SecAggRefusal(f"threshold t = {t} is not above k / 2 = {k / 2}")

    def mask(self, inbox: Mapping[int, bytes], values: np.ndarray) -> np.ndarray:
        """The masked input ``y_u`` (module doc, step 3) of ``values`` (the integer input,
        ``L`` coordinates, reduced mod ``2^b``), masked with exactly the inbox's senders.

        Every sender must be a neighbour and its ciphertext must decrypt, as addressed from
        it to this device, under the pair's key (``SecAggError`` otherwise). Refuses an
        inbox of fewer than ``t`` senders: the self-mask seed could not be rebuilt from the
        neighbours that hold its shares, so the round could not finish anyway."""
        shared = self._shared
        if shared is None:
            raise SecAggError("mask before share_keys: the device has no roster yet")
        parameters = shared.roster.parameters
        values = np.asarray(values)
        if values.shape != (parameters.vector_length,):
            raise SecAggError(
                f"the input must have shape ({parameters.vector_length},), got {values.shape}"
            )
        ring = to_ring(values, parameters.modulus_bits)
        if self._mask_request is not None:
            inbox_before, ring_before, masked = self._mask_request
            if dict(inbox) == inbox_before and np.array_equal(ring, ring_before):
                return masked.copy()
            raise SecAggRefusal("the device already masked another input or inbox")
        if len(inbox) < parameters.threshold:
            raise SecAggRefusal(
                f"only {len(inbox)} neighbours sent shares, fewer than t = {parameters.threshold}"
            )
        held = {sender: self._open(shared, sender, ct) for sender, ct in inbox.items()}
        masked = ring.copy()
        prg = _Prg(parameters)
        masked += prg.expand(self._self_seed)
        u = shared.index
        for v in sorted(held):
            public = shared.roster.keys[v].masking_key
            stream = prg.expand(_mask_seed(self._masking, public, self.context, u, v))
            if v > u:
                masked += stream
            else:
                masked -= stream
        masked &= _ring_mask(parameters.modulus_bits)
        self._held = held
        self._mask_request = (dict(inbox), ring, masked)
        return masked.copy()

    def _open(self, shared: _Shared, sender: int, ciphertext: bytes) -> tuple[bytes, bytes]:
        """Decrypt and check the share ``sender`` addressed to this device."""
        u = shared.index
        if sender not in shared.neighbours:
            raise SecAggError(f"device {sender} is not a neighbour of device {u}")
        if len(ciphertext) < _NONCE_BYTES + 16:
            raise SecAggError(f"the share from device {sender} is too short")
        key = _share_key(
            self._encryption, shared.roster.keys[sender].encryption_key, self.context, u, sender
        )
        try:
            plaintext = AESGCM(key).decrypt(
                ciphertext[:_NONCE_BYTES],
                ciphertext[_NONCE_BYTES:],
                _share_ad(self.context, sender, u),
            )
        except InvalidTag as error:
            raise SecAggError(
                f"the share from device {sender} to device {u} failed authentication"
            ) from error
        if len(plaintext) != _SHARE_PLAINTEXT:
            raise SecAggError(f"the share from device {sender} has the wrong size")
        claimed = (_INDEX.unpack_from(plaintext, 0)[0], _INDEX.unpack_from(plaintext, 8)[0])
        if claimed != (sender, u):
            raise SecAggError(
                f"the share from device {sender} to {u} claims to be from {claimed[0]} "
                f"to {claimed[1]}"
            )
        offset = 2 * _INDEX.size
        return (
            plaintext[offset : offset + shamir.SHARE_BYTES],
            plaintext[offset + shamir.SHARE_BYTES :],
        )

    def unmask(
        self, survivors: Sequence[int], dropped: Sequence[int]
    ) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """(self-mask seed shares of ``survivors``, masking-key shares of ``dropped``),
        by owner.

        Refuses (``SecAggRefusal``) a request naming a device twice or in both lists, a
        device whose shares this one does not hold, fewer than ``t`` survivors counting
        this device (SecAgg's rule), or a second request different from the first: so it
        never reveals both shares of one neighbour."""
        if self._held is None or self._shared is None:
            raise SecAggError("unmask before mask: the device holds no shares yet")
        alive, gone = [int(v) for v in survivors], [int(v) for v in dropped]
        if len(set(alive)) != len(alive) or len(set(gone)) != len(gone):
            raise SecAggRefusal("the unmask request names a device twice")
        request = (frozenset(alive), frozenset(gone))
        if self._unmask_request is not None and self._unmask_answer is not None:
            if request == self._unmask_request:
                return dict(self._unmask_answer[0]), dict(self._unmask_answer[1])
            raise SecAggRefusal("the device already answered another unmask request")
        both = request[0] & request[1]
        if both:
            raise SecAggRefusal(
                f"the unmask request names {sorted(both)[:3]} as both survived and dropped"
            )
        unknown = (request[0] | request[1]) - self._held.keys()
        if unknown:
            raise SecAggRefusal(
                f"the device holds no shares of {sorted(unknown)[:3]} (not neighbours that "
                "sent it shares)"
            )
        threshold = self._shared.roster.parameters.threshold
        if len(alive) + 1 < threshold:
            raise SecAggRefusal(
                f"{len(alive)} surviving neighbours and this device are fewer than t = {threshold}"
            )
        answer = (
            {v: self._held[v][1] for v in sorted(alive)},
            {v: self._held[v][0] for v in sorted(gone)},
        )
        self._unmask_request, self._unmask_answer = request, answer
        return dict(answer[0]), dict(answer[1])


# ---------------------------------------------------------------------------------------
# The server


def _check_sets(roster: Roster, shared: Set[int], masked: Set[int]) -> None:
    n = len(roster)
    outside = [i for i in shared if not 0 <= i < n]
    if outside:
        raise SecAggError(f"devices {sorted(outside)[:3]} are not in the roster of {n}")
    if not masked <= shared:
        raise SecAggError(f"devices {sorted(masked - shared)[:3]} sent masked inputs but no shares")


def unmask_request(
    roster: Roster, shared: Set[int], masked: Set[int], index: int
) -> tuple[list[int], list[int]]:
    """What the server asks device ``index`` (in ``masked``): of its neighbours in
    ``shared``, those in ``masked`` (survivors) and the others (dropped), each sorted."""
    _check_sets(roster, shared, masked)
    if index not in masked:
        raise SecAggError(f"device {index} sent no masked input: it is not asked to unmask")
    neighbours = [v for v in roster.neighbours(index) if v in shared]
    return [v for v in neighbours if v in masked], [v for v in neighbours if v not in masked]


def reconstruct_sum(
    roster: Roster,
    shared: Set[int],
    masked: Set[int],
    masked_sum: np.ndarray,
    mask_seed_shares: Mapping[int, Mapping[int, bytes]],
    secret_key_shares: Mapping[int, Mapping[int, bytes]],
) -> np.ndarray:
    """The sum mod ``2^b`` of the inputs of ``masked`` from the sum of their masked inputs
    and the revealed shares (owner -> holder -> share), by the formula of the module doc.

    Rebuilds ``b_u`` for every ``u`` in ``masked`` and ``s_v^SK`` for every ``v`` in
    ``shared - masked`` with a neighbour in ``masked``, each from the ``t`` shares of the
    lowest-indexed holders; ``NotEnoughSharesError`` names a secret with fewer than ``t``,
    ``SecAggError`` a rebuilt key that does not match its owner's advertised key."""
    _check_sets(roster, shared, masked)
    parameters = roster.parameters
    total = _checked_ring(np.asarray(masked_sum), parameters.modulus_bits)
    if total.shape != (parameters.vector_length,):
        raise SecAggError(
            f"masked_sum must have shape ({parameters.vector_length},), got {total.shape}"
        )
    total = total.copy()
    for owner in secret_key_shares:
        if owner in masked and secret_key_shares[owner]:
            raise SecAggError(f"masking-key shares of device {owner}, which is in the sum")
    for owner in mask_seed_shares:
        if owner not in masked and mask_seed_shares[owner]:
            raise SecAggError(f"self-mask seed shares of device {owner}, not in the sum")
    dropped = {v: [u for u in roster.neighbours(v) if u in masked] for v in sorted(shared - masked)}
    dropped = {v: users for v, users in dropped.items() if users}
    # Rebuild every secret first (cheap), so that a missing share costs no PRG work.
    seeds = {
        u: _rebuild(roster, u, mask_seed_shares.get(u, {}), "self-mask seed")
        for u in sorted(masked)
    }
    keys = {}
    for v in dropped:
        raw = _rebuild(roster, v, secret_key_shares.get(v, {}), "masking key")
        key = X25519PrivateKey.from_private_bytes(raw)
        if _raw_public(key) != roster.keys[v].masking_key:
            raise SecAggError(
                f"device {v}'s rebuilt masking key does not match its advertised public key"
            )
        keys[v] = key
    prg = _Prg(parameters)
    for seed in seeds.values():
        total -= prg.expand(seed)
    for v, users in dropped.items():
        for u in users:
            seed = _mask_seed(keys[v], roster.keys[u].masking_key, roster.context, v, u)
            stream = prg.expand(seed)
            if v > u:  # u added +PRG(s_uv)
                total -= stream
            else:
                total += stream
    total &= _ring_mask(parameters.modulus_bits)
    return total


def _rebuild(roster: Roster, owner: int, shares: Mapping[int, bytes], secret: str) -> bytes:
    """``owner``'s 32-byte ``secret`` from the ``t`` lowest-indexed of its holders."""
    neighbours = set(roster.neighbours(owner))
    strangers = [h for h in shares if h not in neighbours]
    if strangers:
        raise SecAggError(
            f"devices {sorted(strangers)[:3]} sent shares of device {owner}'s {secret} but "
            "are not its neighbours"
        )
    threshold = roster.parameters.threshold
    if len(shares) < threshold:
        raise NotEnoughSharesError(owner, secret, len(shares), threshold)
    chosen = {h + 1: shares[h] for h in sorted(shares)[:threshold]}
    try:
        return shamir.combine(chosen, KEY_BYTES)
    except ValueError as error:
        raise SecAggError(f"the shares of device {owner}'s {secret}: {error}") from error


# ---------------------------------------------------------------------------------------
# In-process driver


@dataclass(frozen=True)
class Dropouts:
    """Participant indices that stop before each step (a device stopped at one step takes
    no part in the later ones)."""

    shares: frozenset[int] = frozenset()  # advertised keys, never sent shares
    masked: frozenset[int] = frozenset()  # sent shares, never sent a masked input
    unmask: frozenset[int] = frozenset()  # sent a masked input, never answered the unmask request


@dataclass(frozen=True)
class Transcript:
    """Every message the server received or relayed, as bytes, per step."""

    keys: tuple[bytes, ...]  # index -> encryption_key || masking_key
    shares: Mapping[tuple[int, int], bytes]  # (sender, recipient) -> ciphertext
    masked: Mapping[int, bytes]  # sender -> encode_ring(masked input)
    unmask_requests: Mapping[int, bytes]  # recipient -> encoded (survivors, dropped)
    mask_seed_shares: Mapping[int, Mapping[int, bytes]]  # owner -> holder -> share
    secret_key_shares: Mapping[int, Mapping[int, bytes]]  # owner -> holder -> share

    def sizes(self) -> dict[str, int]:
        """Bytes per step (the keys, the shares, the masked inputs, the unmask requests and
        the revealed shares)."""
        revealed = [*self.mask_seed_shares.values(), *self.secret_key_shares.values()]
        return {
            "keys": sum(map(len, self.keys)),
            "shares": sum(map(len, self.shares.values())),
            "masked": sum(map(len, self.masked.values())),
            "unmask_requests": sum(map(len, self.unmask_requests.values())),
            "revealed": sum(len(s) for shares in revealed for s in shares.values()),
        }


@dataclass(frozen=True)
class SimulatedRound:
    """A round run in process: the unmasked ring sum of the inputs of ``included``, the
    roster, the server's transcript, and the devices that refused a step (index ->
    reason; they count as dropped out there)."""

    total: np.ndarray
    included: frozenset[int]
    roster: Roster
    transcript: Transcript
    refusals: Mapping[int, str]


def _encode_request(survivors: Sequence[int], dropped: Sequence[int]) -> bytes:
    """``len(survivors) || survivors || len(dropped) || dropped``, 8 bytes each."""
    parts = [len(survivors), *survivors, len(dropped), *dropped]
    return b"".join(_INDEX.pack(v) for v in parts)


def simulate_round(
    inputs: np.ndarray,
    parameters_spec: SecureAggregationSpec,
    modulus_bits: int,
    dropouts: Dropouts = Dropouts(),
    context: RoundContext | None = None,
) -> SimulatedRound:
    """Run one round for the integer ``inputs`` (one row per device) with ``dropouts``:
    every device a fresh :class:`SecAggClient`, the server the functions above, parameters
    from :func:`plan_parameters`. A device that refuses a step drops out there.
    ``NotEnoughSharesError`` if the sum cannot be unmasked."""
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or inputs.shape[0] < 2:
        raise SecAggError(f"inputs must be one row per device (>= 2), got shape {inputs.shape}")
    n, length = inputs.shape
    for step in ("shares", "masked", "unmask"):
        outside = [i for i in getattr(dropouts, step) if not 0 <= i < n]
        if outside:
            raise SecAggError(f"dropouts at {step}: {sorted(outside)[:3]} are not devices")
    context = context or RoundContext("simulation", 0, 0)
    parameters = plan_parameters(n, length, modulus_bits, parameters_spec)
    clients = [SecAggClient(context) for _ in range(n)]
    roster = Roster(context, parameters, tuple(c.advertise() for c in clients))
    refusals: dict[int, str] = {}

    shares: dict[tuple[int, int], bytes] = {}
    for u in range(n):
        if u not in dropouts.shares:
            for v, ciphertext in clients[u].share_keys(roster, u).items():
                shares[u, v] = ciphertext
    shared = frozenset(u for u in range(n) if u not in dropouts.shares)

    inboxes: dict[int, dict[int, bytes]] = {u: {} for u in range(n)}
    for (sender, recipient), ciphertext in shares.items():
        inboxes[recipient][sender] = ciphertext
    masked_inputs: dict[int, bytes] = {}
    masked_sum = np.zeros(length, dtype=parameters.dtype)
    for u in sorted(shared - dropouts.masked):
        try:
            y = clients[u].mask(inboxes[u], inputs[u])
        except SecAggRefusal as refusal:
            refusals[u] = str(refusal)
            continue
        masked_inputs[u] = encode_ring(y, modulus_bits)
        masked_sum += y
    masked_sum &= _ring_mask(modulus_bits)
    masked = frozenset(masked_inputs)

    requests: dict[int, bytes] = {}
    seed_shares: dict[int, dict[int, bytes]] = {}
    key_shares: dict[int, dict[int, bytes]] = {}
    for w in sorted(masked - dropouts.unmask):
        survivors, gone = unmask_request(roster, shared, masked, w)
        requests[w] = _encode_request(survivors, gone)
        try:
            seeds, keys = clients[w].unmask(survivors, gone)
        except SecAggRefusal as refusal:
            refusals[w] = str(refusal)
            continue
        for owner, share in seeds.items():
            seed_shares.setdefault(owner, {})[w] = share
        for owner, share in keys.items():
            key_shares.setdefault(owner, {})[w] = share

    transcript = Transcript(
        keys=tuple(k.encode() for k in roster.keys),
        shares=shares,
        masked=masked_inputs,
        unmask_requests=requests,
        mask_seed_shares=seed_shares,
        secret_key_shares=key_shares,
    )
    total = reconstruct_sum(roster, shared, masked, masked_sum, seed_shares, key_shares)
    return SimulatedRound(total, masked, roster, transcript, refusals)
