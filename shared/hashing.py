"""Stable hashes used identically on the device and on the server.

Every hash here is fixed by a standard and by the bytes it is given, never by Python's
``hash`` (salted per process) or by a library version, so a report hashed on a device
today decodes on a server years later.

* :func:`rappor_bloom_digests`: the Bloom hashes of the reference RAPPOR client,
  ``MD5(BE32(cohort) || UTF-8(value))``; byte ``i`` of the digest modulo ``k`` is the
  ``i``-th Bloom bit (Erlingsson, Pihur and Korolova, CCS 2014, and the reference
  client's ``get_bloom_bits``). MD5 serves as a fixed public hash here, not for secrecy.
* :func:`keyed_digest`: ``HMAC-SHA256(key, message)`` (RFC 2104, FIPS 180-4), the PRF
  that derives per-purpose secrets from a device secret: a metric's RAPPOR secret, a
  cohort, a permanent randomized response.
* :func:`keyed_stream`: ``SHAKE-256(HMAC-SHA256(key, message))`` truncated to the bytes
  asked for (FIPS 202), a deterministic pseudorandom stream for memoized randomness.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

__all__ = ["keyed_digest", "keyed_stream", "rappor_bloom_digests"]


def rappor_bloom_digests(pairs: Iterable[tuple[int, bytes]]) -> bytes:
    """The 16-byte MD5 digests of ``BE32(cohort) || value`` for each (cohort, UTF-8 value)."""
    return b"".join(
        hashlib.md5(cohort.to_bytes(4, "big") + value).digest() for cohort, value in pairs
    )


def keyed_digest(key: bytes, message: bytes) -> bytes:
    """``HMAC-SHA256(key, message)``: 32 bytes."""
    return hmac.digest(key, message, "sha256")


def keyed_stream(key: bytes, message: bytes, size: int) -> bytes:
    """``size`` bytes of ``SHAKE-256(HMAC-SHA256(key, message))``."""
    return hashlib.shake_256(keyed_digest(key, message)).digest(size)
