"""Shamir secret sharing over the prime field ``F_p``, ``p = 2^521 - 1`` (a Mersenne prime).

A secret ``s < p`` (here a 32-byte key or seed read as a big-endian integer) is shared
with threshold ``t`` by drawing a uniformly random polynomial ``f(x) = s + a_1 x + ... +
a_(t-1) x^(t-1)`` over ``F_p`` (``a_i`` from the OS CSPRNG) and handing out ``f(x_j)`` at
distinct nonzero points ``x_j`` (Shamir, *How to share a secret*, CACM 1979). Any ``t``
shares determine ``f`` and so ``s = f(0)`` by Lagrange interpolation,

    ``s = sum_j y_j lambda_j``,  ``lambda_j = prod_(m != j) x_m / (x_m - x_j)``  (mod p),

while any ``t - 1`` shares are uniformly distributed whatever ``s`` is (for every
candidate secret exactly one polynomial of degree ``t - 1`` passes through them and
``(0, s)``): they reveal nothing about it.

A share travels as its value ``f(x_j)``, ``SHARE_BYTES`` big-endian bytes; its point is
known from who holds it. The evaluation points are small integers (participant index + 1),
so the denominators ``prod (x_m - x_j)`` are exact products of small integers, reduced
mod ``p`` once, and all ``t`` of them are inverted with a single modular inverse
(Montgomery's batch inversion).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence

__all__ = ["PRIME", "SHARE_BYTES", "combine", "split"]

#: The field's modulus, the Mersenne prime ``2^521 - 1``.
PRIME = (1 << 521) - 1

#: Bytes of one share: a field element, big-endian.
SHARE_BYTES = (PRIME.bit_length() + 7) // 8


def split(secret: bytes, threshold: int, points: Sequence[int]) -> list[bytes]:
    """Shares of ``secret`` (read as a big-endian integer) at ``points``, ``threshold`` of
    which rebuild it; one ``SHARE_BYTES`` value per point, in the order given."""
    value = int.from_bytes(secret, "big")
    if value >= PRIME:
        raise ValueError(f"a secret of {len(secret)} bytes does not fit the field")
    _check_points(points)
    if not 1 <= threshold <= len(points):
        raise ValueError(f"threshold {threshold} must lie in 1..{len(points)} (the shares)")
    # Highest coefficient first, for Horner's rule; the constant term is the secret.
    coefficients = [secrets.randbelow(PRIME) for _ in range(threshold - 1)] + [value]
    shares = []
    for x in points:
        y = 0
        for a in coefficients:
            y = (y * x + a) % PRIME
        shares.append(y.to_bytes(SHARE_BYTES, "big"))
    return shares


def combine(shares: Mapping[int, bytes], length: int) -> bytes:
    """The secret of ``length`` bytes whose polynomial passes through every share given
    (point -> share value): pass exactly ``t`` of them.

    Raises ``ValueError`` for a malformed share, a repeated or zero point, or when the
    interpolated value does not fit ``length`` bytes (the shares are not of one secret
    of that size)."""
    points = list(shares)
    _check_points(points)
    values = []
    for x in points:
        raw = shares[x]
        if len(raw) != SHARE_BYTES:
            raise ValueError(f"the share at point {x} has {len(raw)} bytes, not {SHARE_BYTES}")
        y = int.from_bytes(raw, "big")
        if y >= PRIME:
            raise ValueError(f"the share at point {x} is not a field element")
        values.append(y)
    numerator = math.prod(points) % PRIME
    denominators = [x * math.prod(m - x for m in points if m != x) % PRIME for x in points]
    inverses = _batch_inverse(denominators)
    secret = numerator * sum(y * inv for y, inv in zip(values, inverses, strict=True)) % PRIME
    if secret.bit_length() > 8 * length:
        raise ValueError(f"the shares do not rebuild a secret of {length} bytes")
    return secret.to_bytes(length, "big")


def _batch_inverse(values: list[int]) -> list[int]:
    """The inverses mod ``PRIME`` of nonzero ``values`` with one modular inverse:
    prefix products ``P_i = v_0 ... v_i``, then ``1 / v_i = P_(i-1) / P_i`` walking back."""
    prefix = []
    running = 1
    for v in values:
        running = running * v % PRIME
        prefix.append(running)
    inverse = pow(running, -1, PRIME)
    result = [0] * len(values)
    for i in range(len(values) - 1, 0, -1):
        result[i] = inverse * prefix[i - 1] % PRIME
        inverse = inverse * values[i] % PRIME
    if values:
        result[0] = inverse
    return result


def _check_points(points: Sequence[int]) -> None:
    """Distinct evaluation points in ``1..p-1`` (a share at 0 would be the secret)."""
    if len(set(points)) != len(points):
        raise ValueError("the evaluation points repeat")
    bad = [x for x in points if not 0 < x < PRIME]
    if bad:
        raise ValueError(f"evaluation points must lie in 1..p-1, got {bad[:3]}")
