"""The memo: permanent randomness that is stable per (secret, scope, purpose, key), uniform,
and independent across them; the exact samplers over it (``shared.memo``).

Goodness-of-fit tests use fixed seeds or fixed secrets and reject at p < 1e-4: a correct
sampler fails one of them with probability 1e-4 for a given seed, which the fixed inputs
turn into a fixed outcome.
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest
from scipy import stats

from shared.memo import FreshMemo, KeyedMemo, SimulatedMemo, memo_scope, spec_scope
from shared.randomness import BITS53, RandomSource

SECRET = bytes(range(32))
#: A spec's scope, as a device has it (any 32-byte spec hash).
SPEC_HASH = hashlib.sha256(b"a spec").digest()
SCOPE = spec_scope(SPEC_HASH)
P_FLOOR = 1e-4


def reference_words(secret: bytes, scope: bytes, purpose: bytes, key: int, count: int) -> list:
    """The stream as the module docstring specifies it, written out independently."""
    message = (
        b"LDP memo v1\x00"
        + len(scope).to_bytes(2, "big")
        + scope
        + len(purpose).to_bytes(2, "big")
        + purpose
        + key.to_bytes(8, "big")
    )
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    stream = hashlib.shake_256(digest).digest(8 * count)
    return [int.from_bytes(stream[8 * j : 8 * j + 8], "little") for j in range(count)]


def test_scope_names_the_spec_hash() -> None:
    assert spec_scope(SPEC_HASH) == b"spec sha-256\x00" + SPEC_HASH
    with pytest.raises(ValueError, match="32 bytes"):
        spec_scope(SPEC_HASH[:16])
    assert memo_scope("app.theme", 3) == b"app.theme\x00\x00\x00\x00\x03"


def test_keyed_memo_follows_its_specification() -> None:
    memo = KeyedMemo(SECRET, SCOPE, size=2)
    draws = memo.draws(b"lgrr prr", [5, 7])
    first = draws.words(3)
    later = draws.words(40)  # past the first read-ahead: the stream is extended, not redrawn
    for row, key in enumerate([5, 7]):
        expected = reference_words(SECRET, SCOPE, b"lgrr prr", key, 43)
        assert first[row].tolist() == expected[:3]
        assert later[row].tolist() == expected[3:]


def test_keyed_memo_is_stable_across_objects_and_rows() -> None:
    one = KeyedMemo(SECRET, SCOPE, size=3).draws(b"p", [1, 2, 1]).words(4)
    again = KeyedMemo(SECRET, SCOPE, size=3).draws(b"p", [1, 2, 1]).words(4)
    assert np.array_equal(one, again)
    assert np.array_equal(one[0], one[2])
    assert not np.array_equal(one[0], one[1])


@pytest.mark.parametrize(
    "other",
    [
        {"secret": bytes(32)},
        {"scope": spec_scope(hashlib.sha256(b"another spec").digest())},
        {"scope": memo_scope("app.theme", 3)},
        {"purpose": b"q"},
        {"key": 2},
    ],
)
def test_every_input_of_the_stream_matters(other: dict) -> None:
    base = {"secret": SECRET, "scope": SCOPE, "purpose": b"p", "key": 1}
    changed = {**base, **other}

    def word(args: dict) -> int:
        memo = KeyedMemo(args["secret"], args["scope"])
        return int(memo.draws(args["purpose"], [args["key"]]).words(1)[0, 0])

    assert word(base) != word(changed)


def test_one_secret_per_row() -> None:
    secrets = [bytes([i]) * 32 for i in range(3)]
    memo = KeyedMemo(secrets, SCOPE)
    words = memo.draws(b"p", [9, 9, 9]).words(1)[:, 0]
    for i, secret in enumerate(secrets):
        assert int(words[i]) == reference_words(secret, SCOPE, b"p", 9, 1)[0]


def test_integers_are_exactly_uniform_over_secrets() -> None:
    """integers(7) over 14,000 devices (a new secret each): chi-square against uniform."""
    secrets = [i.to_bytes(4, "big") * 8 for i in range(14_000)]
    draws = KeyedMemo(secrets, SCOPE).draws(b"category", np.full(14_000, 3))
    values = draws.integers(7)
    counts = np.bincount(values, minlength=7)
    assert stats.chisquare(counts).pvalue > P_FLOOR


def test_bernoulli_matches_its_threshold_over_secrets() -> None:
    secrets = [i.to_bytes(4, "big") * 8 for i in range(10_000)]
    threshold = BITS53 // 5
    ones = KeyedMemo(secrets, SCOPE).draws(b"bit").bernoulli_below(threshold, 2)
    # Two draws per device: both must be Bernoulli(1/5) and independent of each other.
    table = np.zeros((2, 2))
    np.add.at(table, (ones[:, 0].astype(int), ones[:, 1].astype(int)), 1)
    expected = np.outer([0.8, 0.2], [0.8, 0.2]) * 10_000
    assert stats.chisquare(table.ravel(), expected.ravel()).pvalue > P_FLOOR


def test_simulated_memo_is_stable_and_per_device() -> None:
    devices = np.array([4, 9, 4, 1])
    first = SimulatedMemo(devices, seed=11).draws(b"p", [0, 0, 0, 5]).words(3)
    again = SimulatedMemo(devices[::-1], seed=11).draws(b"p", [5, 0, 0, 0]).words(3)[::-1]
    assert np.array_equal(first, again)  # a device's words do not depend on its row
    assert np.array_equal(first[0], first[2])
    assert len({tuple(row) for row in first.tolist()}) == 3
    other_seed = SimulatedMemo(devices, seed=12).draws(b"p", [0, 0, 0, 5]).words(3)
    assert not np.array_equal(first, other_seed)


def test_simulated_memo_samplers_fit() -> None:
    memo = SimulatedMemo(np.arange(200_000), seed=3)
    values = memo.draws(b"category").integers(np.full(200_000, 6))
    assert stats.chisquare(np.bincount(values, minlength=6)).pvalue > P_FLOOR
    bits = memo.draws(b"bit").bernoulli_below(BITS53 // 4)[:, 0]
    assert stats.binomtest(int(bits.sum()), bits.size, 0.25).pvalue > P_FLOOR
    # Consecutive words of one stream are independent: lag-1 correlation of the top bits.
    words = memo.draws(b"walk").words(2) >> np.uint64(11)
    correlation = np.corrcoef(words[:, 0].astype(float), words[:, 1].astype(float))[0, 1]
    assert abs(correlation) < 4.5 / np.sqrt(200_000)  # |z| < 4.5: p ~ 7e-6


def test_fresh_memo_never_repeats_a_permanent_response() -> None:
    memo = FreshMemo(RandomSource(np.random.default_rng(1)), 2)
    words = memo.draws(b"p", [1, 1]).words(2)
    assert not np.array_equal(words[0], words[1])


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        KeyedMemo(b"short", SCOPE)
    with pytest.raises(ValueError, match="one per row"):
        KeyedMemo(SECRET, SCOPE, size=2).draws(b"p", [1, 2, 3])
    draws = KeyedMemo(SECRET, SCOPE).draws(b"p")
    with pytest.raises(ValueError, match="2\\*\\*53"):
        draws.bernoulli_below(BITS53 + 1)
    with pytest.raises(ValueError, match="high >= 1"):
        draws.integers(0)
    with pytest.raises(ValueError, match="one-dimensional"):
        SimulatedMemo(np.zeros((2, 2)), seed=1)
