"""RAPPOR on the device: Bloom hashing, bit layout, memoized PRR, fresh IRR, cohorts, reports.

* the Bloom filter matches the reference client byte for byte (MD5 of BE32(cohort) ||
  UTF-8(value), byte i mod k) on fixed digests and the reference client's test vector;
* bit i of a Bloom filter or report is ``1 << i`` of its integer and bit ``i % 8`` of byte
  ``i // 8``, for k up to 1024;
* the permanent response is memoized (same secret and Bloom filter, same PRR, whatever the
  random generator and the value's spelling), independent across secrets and filters,
  and flips each bit with probability f/2; the instantaneous response is fresh;
* the whole pipeline draws reports from ``transition_matrix`` (the matrix the privacy
  tests check);
* cohorts derived from secrets are stable and uniform; aggregation equals a naive count.

Statistical assertions use fixed seeds and alpha = 1e-6 each (Bonferroni inside a test
where it makes several), so each test fails falsely with probability at most 1e-6.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import DeviceContext, make_mechanism
from shared.mechanisms.rappor import (
    Rappor,
    from_integers,
    pack_little,
    to_integers,
    unpack_little,
)
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics

ALPHA = 1e-6
CHROME = {"f": 0.5, "p": 0.25, "q": 0.75}


def rappor(k: int, h: int, m: int, f: float = 0.5, p: float = 0.25, q: float = 0.75) -> Rappor:
    mech = make_mechanism(
        MechanismSpec(mechanism="rappor", num_bits=k, num_hashes=h, num_cohorts=m, f=f, p=p, q=q)
    )
    assert isinstance(mech, Rappor)
    return mech


def secrets_for(count: int, seed: int) -> np.ndarray:
    """``count`` distinct 16-byte device secrets (rows of a uint8 array)."""
    return np.random.default_rng(seed).integers(0, 256, (count, 16), dtype=np.uint8)


def binomial_ok(successes: int, trials: int, probability: float, alpha: float = ALPHA) -> bool:
    return bool(stats.binomtest(successes, trials, probability).pvalue > alpha)


# ---------------------------------------------------------------------------------------
# Bloom filter: the reference client's hashing
# ---------------------------------------------------------------------------------------


def test_reference_test_vector() -> None:
    """The reference client (google/rappor): k = 16, h = 2, cohort 0, "abc" sets bits {6, 13}."""
    mech = rappor(16, 2, 4)
    assert mech.bloom(["abc"], [0])[0] == (1 << 6) | (1 << 13)
    assert mech.bloom_bit_indices(["abc"], [0]).tolist() == [[6, 13]]


#: MD5(BE32(cohort) || UTF-8(value)), computed once by hand (hashlib) and fixed here.
DIGESTS = [
    (0, "abc", "768d874c756cf609c842aabf090340b1"),
    (1, "www.google.com", "1555610995310568298689d8119910e0"),
    (63, "", "38fc9331271e16f0e5586a0fc993be00"),
    (5, "\u00e9t\u00e9", "0c9fada00ebdf74784bf9faa503b45d5"),
]


@pytest.mark.parametrize(("cohort", "value", "digest"), DIGESTS)
@pytest.mark.parametrize(("k", "h"), [(16, 2), (13, 4), (128, 2), (256, 16), (1024, 3), (1, 1)])
def test_bloom_bits_are_md5_bytes_mod_k(
    cohort: int, value: str, digest: str, k: int, h: int
) -> None:
    mech = rappor(k, h, 64)
    raw = bytes.fromhex(digest)
    assert hashlib.md5(struct.pack(">I", cohort) + value.encode("utf-8")).digest() == raw
    expected = [raw[i] % k for i in range(h)]
    assert mech.bloom_bit_indices([value], [cohort]).tolist() == [expected]
    assert mech.bloom([value], [cohort])[0] == sum(1 << b for b in set(expected))


def test_bloom_of_many_values_is_vectorized_per_distinct_pair() -> None:
    """Repeated (value, cohort) pairs hash alike; each row equals its one-value computation."""
    mech = rappor(32, 3, 5)
    rng = np.random.default_rng(1)
    values = [f"v{i}" for i in rng.integers(0, 7, 300)]
    cohorts = rng.integers(0, 5, 300)
    bits = mech.bloom_bit_indices(values, cohorts)
    for value, cohort in {(v, int(c)) for v, c in zip(values, cohorts, strict=True)}:
        raw = hashlib.md5(struct.pack(">I", cohort) + value.encode()).digest()
        rows = bits[[v == value and c == cohort for v, c in zip(values, cohorts, strict=True)]]
        assert (rows == np.array([raw[i] % 32 for i in range(3)])).all()


@pytest.mark.parametrize("k", [1, 8, 13, 128, 256, 1024])
def test_bloom_integers_and_packed_rows_agree(k: int) -> None:
    """Bit i is ``1 << i`` of the integer and bit i % 8 (LSB first) of byte i // 8."""
    mech = rappor(k, 4, 3)
    values = [f"string-{i}" for i in range(200)]
    cohorts = np.arange(200) % 3
    packed = mech.bloom_packed(values, cohorts)
    integers = mech.bloom(values, cohorts)
    assert packed.shape == (200, (k + 7) // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(from_integers(integers, k), packed)
    assert list(to_integers(packed)) == list(integers)
    indices = mech.bloom_bit_indices(values, cohorts)
    for row, number, bits in zip(packed, integers, indices, strict=True):
        assert number == sum(1 << int(b) for b in set(bits.tolist()))
        assert number.to_bytes((k + 7) // 8, "little") == row.tobytes()
    unpacked = unpack_little(packed, k)
    np.testing.assert_array_equal(pack_little(unpacked), packed)
    if k > 256:  # one MD5 byte per hash: bits past 255 are never set
        assert not unpacked[:, 256:].any()


def test_from_integers_refuses_integers_too_wide() -> None:
    with pytest.raises(ValueError, match="position 1"):
        from_integers([3, 1 << 8], 8)


# ---------------------------------------------------------------------------------------
# Reports and their wire form
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [5, 16, 128, 1024])
def test_report_layout_and_payload(k: int) -> None:
    mech = rappor(k, 2, 4)
    reports = mech.encode(
        ["a", "b", "a"],
        rng=np.random.default_rng(3),
        context=DeviceContext(secrets=Rappor.new_secret(), cohorts=[0, 3, 2]),
    )
    assert reports.dtype == mech.report_dtype and reports.shape == (3,)
    assert reports["cohort"].tolist() == [0, 3, 2]
    payloads = mech.to_payloads(reports)
    for payload, row, number in zip(
        payloads, reports["bits"], to_integers(reports["bits"]), strict=True
    ):
        raw = base64.b64decode(payload["bits"])
        assert raw == row.tobytes() == number.to_bytes((k + 7) // 8, "little")
        assert number < 1 << k
    np.testing.assert_array_equal(mech.from_payloads(payloads), reports)


# ---------------------------------------------------------------------------------------
# Permanent randomized response: memoized, independent across secrets
# ---------------------------------------------------------------------------------------


def test_same_secret_and_value_give_the_same_prr() -> None:
    """With p = 0, q = 1 the IRR is the identity, so a report is its PRR: reports of one
    value by one device are identical across calls and generators (and the OS CSPRNG)."""
    mech = rappor(64, 2, 8, f=0.5, p=0.0, q=1.0)
    secret = b"device secret 0123456789"
    first = mech.encode(
        ["home.example"] * 5,
        rng=np.random.default_rng(1),
        context=DeviceContext(secrets=secret, cohorts=[3] * 5),
    )
    again = mech.encode(
        ["home.example"], rng=None, context=DeviceContext(secrets=secret, cohorts=[3])
    )
    assert (first["bits"] == first["bits"][0]).all()
    np.testing.assert_array_equal(again["bits"][0], first["bits"][0])
    prr = mech.permanent_response(mech.bloom_packed(["home.example"], [3]), secret)
    np.testing.assert_array_equal(prr[0], first["bits"][0])
    # And the PRR does differ from the Bloom filter (f = 1/2 flips ~16 of 64 bits).
    assert (prr != mech.bloom_packed(["home.example"], [3])).any()


def test_prr_depends_only_on_secret_and_bloom_filter() -> None:
    """Two different strings with the same Bloom filter get the same PRR (HMAC of the bits)."""
    mech = rappor(4, 1, 1, f=0.8, p=0.0, q=1.0)
    values = [f"s{i}" for i in range(40)]
    bits = mech.bloom_bit_indices(values, [0] * 40)[:, 0]
    first, second = (values[i] for i in np.flatnonzero(bits == bits[0])[:2])
    reports = mech.encode(
        [first, second],
        rng=np.random.default_rng(0),
        context=DeviceContext(secrets=b"s" * 16, cohorts=[0, 0]),
    )
    assert first != second
    np.testing.assert_array_equal(reports["bits"][0], reports["bits"][1])


def test_prr_is_deterministic_hmac_of_secret_and_bits() -> None:
    """The documented derivation, recomputed here from hmac and hashlib."""
    import hmac

    mech = rappor(20, 2, 2, f=0.35)
    secret = bytes(range(32))
    bloom = mech.bloom_packed(["value"], [1])
    key = hmac.digest(
        secret, b"RAPPOR PRR v1\x00" + (20).to_bytes(2, "big") + bloom.tobytes(), "sha256"
    )
    stream = hashlib.shake_256(key).digest(8 * 20)
    threshold = math.floor(0.35 / 2 * 2**53)
    flips = [
        (int.from_bytes(stream[8 * i : 8 * i + 8], "little") >> 11) < threshold for i in range(20)
    ]
    expected = int.from_bytes(bloom.tobytes(), "little") ^ sum(
        1 << i for i, x in enumerate(flips) if x
    )
    assert to_integers(mech.permanent_response(bloom, secret))[0] == expected


def test_prr_flips_each_bit_with_probability_half_f_independently() -> None:
    """Over many secrets: P(flip) = f/2 per bit; independent across secrets, bits, filters."""
    devices, k, f = 40_000, 16, 0.45
    mech = rappor(k, 2, 1, f=f)
    secrets = secrets_for(devices, 5)
    blooms = mech.bloom_packed(["one", "two"], [0, 0])
    assert (blooms[0] != blooms[1]).any()
    flips = [
        unpack_little(
            mech.permanent_response(np.repeat(bloom[None], devices, 0), secrets) ^ bloom, k
        )
        for bloom in blooms
    ]
    flip = f / 2
    checks = 3 * k + 2
    first, second = flips
    for bit in range(k):  # 1e-6 over all the binomial tests of this function
        assert binomial_ok(int(first[:, bit].sum()), devices, flip, ALPHA / checks)
        # the same secret's PRRs of two different filters are independent
        assert binomial_ok(
            int((first[:, bit] & second[:, bit]).sum()), devices, flip**2, ALPHA / checks
        )
        # two different secrets (devices i and i + 1) flip independently
        assert binomial_ok(
            int((first[:-1:2, bit] & first[1::2, bit]).sum()), devices // 2, flip**2, ALPHA / checks
        )
    # two bits of one PRR flip independently
    assert binomial_ok(int((first[:, 0] & first[:, 1]).sum()), devices, flip**2, ALPHA / checks)
    assert binomial_ok(int((first[:, 2] & first[:, 9]).sum()), devices, flip**2, ALPHA / checks)


# ---------------------------------------------------------------------------------------
# Instantaneous randomized response and the joint output distribution
# ---------------------------------------------------------------------------------------


def test_irr_is_fresh_with_probabilities_q_and_p() -> None:
    """One device reporting one value many times: bit i is 1 w.p. q where the PRR is 1, p else."""
    reports_count, k = 50_000, 24
    mech = rappor(k, 3, 2, f=0.5, p=0.3, q=0.8)
    secret = b"a fixed device secret"
    reports = mech.encode(
        ["x"] * reports_count,
        rng=np.random.default_rng(9),
        context=DeviceContext(secrets=secret, cohorts=[1] * reports_count),
    )
    prr = unpack_little(mech.permanent_response(mech.bloom_packed(["x"], [1]), secret), k)[0]
    assert 0 < prr.sum() < k
    ones = unpack_little(reports["bits"], k).sum(axis=0)
    for bit in range(k):  # 24 binomial tests sharing 1e-6
        assert binomial_ok(int(ones[bit]), reports_count, 0.8 if prr[bit] else 0.3, ALPHA / k), bit
    assert len({row.tobytes() for row in reports["bits"][:100]}) > 90  # fresh per report


@pytest.mark.parametrize(
    ("k", "h", "f", "p", "q"), [(4, 2, 0.5, 0.25, 0.75), (5, 1, 0.3, 0.5, 0.75)]
)
@pytest.mark.slow
def test_reports_of_fresh_devices_follow_the_transition_matrix(
    k: int, h: int, f: float, p: float, q: float
) -> None:
    """Each device (fresh secret) reports one value once: the 2^k report histogram matches
    the row of ``transition_matrix`` for the value's Bloom filter (chi-square, 1e-6)."""
    devices = 200_000
    mech = rappor(k, h, 2, f=f, p=p, q=q)
    value, cohort = "www.example.com", 1
    bloom = unpack_little(mech.bloom_packed([value], [cohort]), k)[0]
    filters = mech.bloom_filters()
    row = int(np.flatnonzero((filters == bloom).all(axis=1))[0])
    probabilities = mech.transition_matrix()[row]
    reports = mech.encode(
        [value] * devices,
        rng=np.random.default_rng(2),
        context=DeviceContext(secrets=secrets_for(devices, 17), cohorts=[cohort] * devices),
    )
    observed = np.bincount(to_integers(reports["bits"]).astype(np.int64), minlength=2**k)
    assert probabilities.min() * devices >= 100  # chi-square approximation accurate
    result = stats.chisquare(observed, probabilities * devices)
    assert result.pvalue > ALPHA, result


# ---------------------------------------------------------------------------------------
# Cohorts, validation, aggregation
# ---------------------------------------------------------------------------------------


def test_cohorts_from_secrets_are_stable_and_uniform() -> None:
    mech = rappor(8, 1, 7)
    secrets = [row.tobytes() for row in secrets_for(14_000, 23)]
    cohorts = np.array([mech.assign_cohort(secret) for secret in secrets])
    assert [mech.assign_cohort(secret) for secret in secrets[:50]] == cohorts[:50].tolist()
    assert cohorts.min() >= 0 and cohorts.max() < 7
    assert stats.chisquare(np.bincount(cohorts, minlength=7)).pvalue > ALPHA
    assert isinstance(Rappor.new_secret(), bytes) and len(Rappor.new_secret()) == 32


@pytest.mark.parametrize(
    ("values", "cohorts", "secrets", "message"),
    [
        (["a", 3, "b"], [0, 0, 0], b"s" * 16, "position 1"),
        (["a", "b", ["c"]], [0, 0, 0], b"s" * 16, "position 2"),
        (["a", "\ud800"], [0, 0], b"s" * 16, "position 1"),
        (np.array([["a"]], dtype=object), [0], b"s" * 16, "(1, 1)"),
        (["a", "b"], [0, 4], b"s" * 16, "cohort 4 at position 1"),
        (["a", "b"], [0, -1], b"s" * 16, "cohort -1"),
        (["a", "b"], [0.5, 1], b"s" * 16, "position 0"),
        (["a", "b"], [0], b"s" * 16, "cohorts"),
        (["a", "b"], [0, 1], b"short", "at least 16"),
        (["a", "b"], [0, 1], [b"s" * 16], "secrets"),
        (["a", "b"], [0, 1], [b"s" * 16, "text secret 0123"], "position 1"),
        (["a", "b"], [0, 1], np.zeros((2, 8), dtype=np.uint8), "at least 16"),
        (["a", "b"], [0, 1], np.zeros((3, 16), dtype=np.uint8), "shape"),
    ],
)
def test_encode_refuses_bad_inputs_saying_why(
    values: Any, cohorts: Any, secrets: Any, message: str
) -> None:
    mech = rappor(16, 2, 4)
    with pytest.raises(ValueError) as info:
        mech.encode(
            values,
            rng=np.random.default_rng(0),
            context=DeviceContext(secrets=secrets, cohorts=cohorts),
        )
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(("k", "m"), [(13, 3), (1024, 2), (1, 1)])
def test_aggregate_equals_a_naive_count(k: int, m: int) -> None:
    mech = rappor(k, 2, m)
    rng = np.random.default_rng(k)
    n = 3000
    reports = mech.encode(
        [f"v{i}" for i in rng.integers(0, 30, n)],
        rng=rng,
        context=DeviceContext(secrets=secrets_for(n, 1), cohorts=rng.integers(0, m, n)),
    )
    table = mech.aggregate(reports).counts.reshape(m, k + 1)
    bits = unpack_little(reports["bits"], k)
    for j in range(m):
        mine = reports["cohort"] == j
        assert table[j, 0] == mine.sum()
        np.testing.assert_array_equal(table[j, 1:], bits[mine].sum(axis=0))


def test_statistics_that_no_reports_produce_are_refused() -> None:
    mech = rappor(4, 1, 2)
    table = np.array([[3, 1, 2, 0, 3], [2, 0, 0, 1, 1]])
    assert mech.statistics_from_bytes(CountStatistics(5, table.reshape(-1)).to_bytes()).n == 5
    with pytest.raises(ValueError, match="cohort counts"):
        mech.statistics_from_bytes(CountStatistics(6, table.reshape(-1)).to_bytes())
    table[1, 2] = 3  # more reports with a bit set than the cohort has
    with pytest.raises(ValueError, match="exceeds"):
        mech.statistics_from_bytes(CountStatistics(5, table.reshape(-1)).to_bytes())


def test_reports_with_padding_bits_or_wrong_dtype_are_refused() -> None:
    mech = rappor(12, 2, 2)
    reports = mech.encode(
        ["a", "b"],
        rng=np.random.default_rng(0),
        context=DeviceContext(secrets=b"x" * 16, cohorts=[0, 1]),
    )
    spoiled = reports.copy()
    spoiled["bits"][1, 1] |= 0x10  # bit 12: padding
    with pytest.raises(ValueError, match="report 1"):
        mech.aggregate(spoiled)
    spoiled = reports.copy()
    spoiled["cohort"][0] = 2
    with pytest.raises(ValueError, match="cohort"):
        mech.aggregate(spoiled)
    with pytest.raises(ValueError, match="dtype"):
        mech.aggregate(reports["bits"])
