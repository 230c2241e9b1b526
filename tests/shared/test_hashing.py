"""The stable hashes against published test vectors."""

from __future__ import annotations

import hashlib

from shared.hashing import keyed_digest, keyed_stream, rappor_bloom_digests


def test_keyed_digest_is_hmac_sha256_rfc4231_case_2() -> None:
    digest = keyed_digest(b"Jefe", b"what do ya want for nothing?")
    assert digest.hex() == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"


def test_keyed_stream_extends_the_digest_with_shake256() -> None:
    stream = keyed_stream(b"Jefe", b"what do ya want for nothing?", 100)
    assert len(stream) == 100
    assert stream == hashlib.shake_256(
        keyed_digest(b"Jefe", b"what do ya want for nothing?")
    ).digest(100)
    assert keyed_stream(b"Jefe", b"other", 100) != stream


def test_rappor_bloom_digest_of_cohort_and_value() -> None:
    """MD5 of the 4-byte big-endian cohort followed by the UTF-8 value (RFC 1321 MD5)."""
    digests = rappor_bloom_digests([(0, b""), (1, b"abc")])
    assert digests[:16].hex() == hashlib.md5(b"\x00\x00\x00\x00").hexdigest()
    assert digests[:16].hex() == "f1d3ff8443297732862df21dc4e57262"
    assert digests[16:] == hashlib.md5(b"\x00\x00\x00\x01abc").digest()
