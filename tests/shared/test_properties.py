"""Property tests (hypothesis) of every registered mechanism's contract.

Parametrized over ``shared.mechanisms.MECHANISMS`` plus ``auto``, so a mechanism is
covered as soon as it is registered:

* sufficient statistics merge associatively and commutatively, equal the aggregate of
  the union of the reports, and have the empty statistics as identity;
* statistics round-trip through bytes; short, corrupt or wrong-length bytes are refused;
* reports round-trip through JSON payloads; malformed payloads are refused with a
  ValueError naming the report's position;
* ``encode`` refuses values outside the domain (naming them), clips numeric values
  to [lower, upper], accepts an empty batch and the OS CSPRNG (``rng=None``).

String mechanisms (``rappor``) take strings, and ``encode`` also takes cohorts and
device secrets: ``encode_with`` supplies them (cohorts and a small pool of secrets
drawn from the test's seed, so memoized permanent responses repeat), and
``build`` picks one of ``STRING_CONFIGS`` for them.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import re
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.mechanisms import MECHANISMS, DeviceContext, Mechanism, make_mechanism
from shared.mechanisms.memoized import ChainedReport
from shared.mechanisms.spec import spec_models
from shared.schemas import (
    CATEGORICAL_MECHANISMS,
    NUMERIC_MECHANISMS,
    STRING_MECHANISMS,
    MechanismSpec,
)
from shared.statistics import CountStatistics, MomentStatistics

NAMES = (*sorted(MECHANISMS), "auto")
CATEGORICAL_NAMES = tuple(name for name in NAMES if name in CATEGORICAL_MECHANISMS)
NUMERIC_NAMES = tuple(name for name in NAMES if name in NUMERIC_MECHANISMS)
STRING_NAMES = tuple(name for name in NAMES if name in STRING_MECHANISMS)
DISTRIBUTION_NAMES = tuple(
    name for name in NAMES if name != "auto" and spec_models()[name].kind == "distribution"
)
#: Multi-attribute protocols: values are rows (a in 0..3, b in 0..2, c real).
ATTRIBUTE_NAMES = tuple(
    name for name in NAMES if name != "auto" and spec_models()[name].kind == "attributes"
)
#: Mechanisms whose values are real numbers (estimated as a mean or as a distribution).
REAL_NAMES = NUMERIC_NAMES + DISTRIBUTION_NAMES
#: RAPPOR parameters (k, h, m, f, p, q) for the string mechanisms: one bit, padding bits,
#: one cohort, no PRR, 16 hashes, more than 128 bits.
STRING_CONFIGS = (
    (1, 1, 1, 0.5, 0.25, 0.75),
    (5, 2, 3, 0.5, 0.25, 0.75),
    (16, 2, 4, 0.45, 0.39, 0.61),
    (13, 3, 2, 0.0, 0.3, 0.6),
    (32, 16, 5, 0.9, 0.0, 1.0),
    (130, 4, 7, 0.2, 0.1, 0.9),
)
#: Spec fields of the open-domain string mechanisms. Sketches (sketch_width, sketch_depth):
#: one row, padding bits, k > m. Discovery: max_length at least the 32 UTF-8 bytes of the
#: longest value drawn (8 characters).
OPEN_CONFIGS: dict[str, tuple[dict[str, Any], ...]] = {
    "cms": tuple(
        {"sketch_width": m, "sketch_depth": k}
        for m, k in ((2, 1), (13, 3), (64, 8), (3, 40), (130, 2), (8, 5))
    ),
    "hcms": tuple(
        {"sketch_width": m, "sketch_depth": k}
        for m, k in ((2, 1), (16, 3), (64, 8), (4, 40), (128, 2), (8, 5))
    ),
    "pem": ({"max_length": 32}, {"max_length": 40}, {"max_length": 64}),
    **{
        protocol: tuple(
            {
                "attributes": [
                    {"name": "a", "domain_size": 4},
                    {"name": "b", "domain_size": 3},
                    {"name": "c", "lower": -3.0, "upper": 7.0},
                ],
                "pairs": [["a", "b"]],
                "oracle": oracle,
            }
            for oracle in ("grr", "oue")
        )
        for protocol in ("spl", "smp", "rsfd")
    },
    "sfp": (
        {"max_length": 32, "sketch_width": 64, "sketch_depth": 8},
        {"max_length": 33, "sketch_width": 16, "sketch_depth": 3},
    ),
}
#: Device secrets the string mechanisms' reports are drawn from (few: PRRs repeat).
SECRETS = tuple(bytes([i]) * 16 for i in range(3))
EPSILONS = (0.5, 1.0, 2.3, 5.0)
LOWER, UPPER = -2.5, 7.0
#: Largest batch drawn: properties of the contract do not need big batches.
MAX_BATCH = 24
#: Relative tolerance on merged float moments. Float addition is not associative: the
#: merged sums and the one-shot sum add the same <= 3 * MAX_BATCH terms in different
#: orders, so they differ by at most ~(number of terms) * 2^-53 * sum |y| ~ 1e-14 sum |y|,
#: far below 1e-12 sum |y|; integer fields (n, counts) must match exactly.
MOMENT_RTOL = 1e-12

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CHAINED_MECHANISMS = frozenset(
    name for name, model in spec_models().items() if issubclass(model, ChainedReport)
)


@functools.cache
def build(name: str, epsilon: float, domain_size: int) -> Mechanism[Any]:
    """The mechanism ``name`` at ``epsilon``, over 0..domain_size-1 or [LOWER, UPPER].

    A string mechanism ignores ``epsilon`` (its parameters imply it) and takes
    ``STRING_CONFIGS[domain_size % len(STRING_CONFIGS)]``.
    """
    if name in OPEN_CONFIGS:
        fields = OPEN_CONFIGS[name][domain_size % len(OPEN_CONFIGS[name])]
        return make_mechanism(
            MechanismSpec.model_validate({"mechanism": name, "epsilon": epsilon, **fields})
        )
    if name in STRING_MECHANISMS:
        k, h, m, f, p, q = STRING_CONFIGS[domain_size % len(STRING_CONFIGS)]
        spec = MechanismSpec(mechanism=name, num_bits=k, num_hashes=h, num_cohorts=m, f=f, p=p, q=q)
        return make_mechanism(spec)
    if name in CATEGORICAL_MECHANISMS:
        fields: dict[str, Any] = {"domain_size": domain_size}
    else:
        fields = {"lower": LOWER, "upper": UPPER}
    if name in CHAINED_MECHANISMS:  # one report reveals half the lifetime bound
        fields["epsilon_report"] = epsilon / 2
    return make_mechanism(
        MechanismSpec.model_validate({"mechanism": name, "epsilon": epsilon, **fields})
    )


@st.composite
def mechanisms(draw: st.DrawFn, name: str) -> Mechanism[Any]:
    epsilon = draw(st.sampled_from(EPSILONS))
    if name in STRING_MECHANISMS:
        return build(name, epsilon, draw(st.integers(0, len(STRING_CONFIGS) - 1)))
    domain_size = draw(st.integers(2, 20)) if name in CATEGORICAL_MECHANISMS else 0
    return build(name, epsilon, domain_size)


def values_for(
    mech: Mechanism[Any], min_size: int = 0, max_size: int = MAX_BATCH
) -> st.SearchStrategy[np.ndarray]:
    """Valid inputs: categories 0..d-1, reals in and beyond [LOWER, UPPER] (clipped), or
    strings (repeated ones, the empty one, non-ASCII ones)."""
    if mech.spec.kind == "string":
        common = ["", "a", "abc", "www.example.com", "\u00e9t\u00e9", "\x00"]
        text = st.sampled_from(common) | st.text(max_size=8)
        return st.lists(text, min_size=min_size, max_size=max_size).map(
            lambda v: np.array(v, dtype=object)
        )
    if mech.spec.kind == "attributes":
        row = st.tuples(st.integers(0, 3), st.integers(0, 2), st.floats(-1e6, 1e6, allow_nan=False))
        return st.lists(row, min_size=min_size, max_size=max_size).map(
            lambda v: np.array(v, dtype=np.float64).reshape(-1, 3)
        )
    if mech.spec.is_categorical:
        d = mech.spec.domain_size
        assert d is not None
        items = st.lists(st.integers(0, d - 1), min_size=min_size, max_size=max_size)
        return items.map(lambda v: np.array(v, dtype=np.int64))
    reals = st.floats(LOWER - 5, UPPER + 5, allow_nan=False) | st.sampled_from(
        [LOWER, UPPER, -1e12, 1e12]
    )
    return st.lists(reals, min_size=min_size, max_size=max_size).map(
        lambda v: np.array(v, dtype=np.float64)
    )


def encode_with(mech: Mechanism[Any], values: np.ndarray, rng: Any, seed: int = 0) -> Any:
    """``mech.encode(values, rng=rng)``; for a string mechanism, values become strings and
    each gets a cohort and one of ``SECRETS``, drawn from ``seed`` (not from ``rng``)."""
    if mech.spec.kind != "string":
        return mech.encode(values, rng=rng)
    strings = np.asarray(values)
    if strings.dtype.kind != "O":
        strings = strings.astype(str).astype(object)
    if mech.name in OPEN_CONFIGS:
        return mech.encode(strings, rng=rng)
    count = strings.shape[0] if strings.ndim else 0
    picks = np.random.default_rng(seed)
    assert mech.spec.num_cohorts is not None
    cohorts = picks.integers(0, mech.spec.num_cohorts, count)
    secrets = [SECRETS[i] for i in picks.integers(0, len(SECRETS), count)]
    return mech.encode(strings, rng=rng, context=DeviceContext(secrets=secrets, cohorts=cohorts))  # type: ignore[call-arg]


def encode(mech: Mechanism[Any], values: np.ndarray, seed: int) -> np.ndarray:
    return encode_with(mech, values, np.random.default_rng(seed), seed)  # type: ignore[no-any-return]


seeds = st.integers(0, 2**32 - 1)


def assert_same_statistics(left: Any, right: Any) -> None:
    """Exact equality for counts; MOMENT_RTOL (scaled by sum |y|) for float moments."""
    assert type(left) is type(right)
    if isinstance(left, CountStatistics):
        assert left == right
        return
    assert isinstance(left, MomentStatistics)
    assert left.n == right.n
    # sum |y| <= sqrt(n * sum y^2) (Cauchy-Schwarz) bounds the scale of the rounding.
    scale = math.sqrt(max(left.n, 1) * max(left.total_squares, right.total_squares))
    assert math.isclose(left.total, right.total, rel_tol=MOMENT_RTOL, abs_tol=MOMENT_RTOL * scale)
    assert math.isclose(left.total_squares, right.total_squares, rel_tol=MOMENT_RTOL)


def names_position(message: str, position: int) -> bool:
    """Does an error message name report ``position`` ("report 3: ..." or "at position 3")?"""
    return re.search(rf"\b(report|position) {position}\b", message) is not None


def test_registry_names() -> None:
    """The parametrization below covers exactly the registry plus ``auto``."""
    assert set(NAMES) == set(MECHANISMS) | {"auto"}
    kinds = (CATEGORICAL_NAMES, NUMERIC_NAMES, STRING_NAMES, DISTRIBUTION_NAMES, ATTRIBUTE_NAMES)
    assert set().union(*kinds) == set(NAMES)
    assert sum(len(names) for names in kinds) == len(NAMES)
    assert all(kinds)


# ---------------------------------------------------------------------------------------
# Mergeable sufficient statistics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@FAST
@pytest.mark.slow
def test_merge_is_associative_commutative_and_equals_union(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    parts = [encode(mech, data.draw(values_for(mech)), data.draw(seeds)) for _ in range(3)]
    a, b, c = (mech.aggregate(part) for part in parts)
    union = mech.aggregate(np.concatenate(parts))
    assert union.n == sum(part.shape[0] for part in parts)
    assert_same_statistics(a.merge(b).merge(c), a.merge(b.merge(c)))
    assert_same_statistics(a.merge(b), b.merge(a))
    assert_same_statistics(a.merge(b).merge(c), union)
    assert_same_statistics(c.merge(a).merge(b), union)
    assert_same_statistics(a + b + c, union)


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@FAST
def test_empty_statistics_is_the_identity(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    stats = mech.aggregate(encode(mech, data.draw(values_for(mech)), data.draw(seeds)))
    empty = mech.empty_statistics()
    assert empty.n == 0
    # x + 0 is exact in floating point too, so the identity holds exactly for both kinds.
    assert empty.merge(stats) == stats
    assert stats.merge(empty) == stats
    assert empty.merge(empty) == empty


@pytest.mark.parametrize("name", CATEGORICAL_NAMES)
def test_merge_refuses_counts_of_another_length(name: str) -> None:
    mech = build(name, 1.0, 5)
    stats = mech.aggregate(mech.encode(np.array([0, 1, 4]), rng=np.random.default_rng(1)))
    other = CountStatistics.empty(stats.counts.size + 1)
    with pytest.raises(ValueError):
        stats.merge(other)
    with pytest.raises(ValueError):
        other.merge(stats)


# ---------------------------------------------------------------------------------------
# Statistics as bytes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@FAST
def test_statistics_round_trip_through_bytes(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    stats = mech.aggregate(encode(mech, data.draw(values_for(mech)), data.draw(seeds)))
    raw = stats.to_bytes()
    assert isinstance(raw, bytes)
    loaded = mech.statistics_from_bytes(raw)
    assert type(loaded) is type(stats)
    assert loaded == stats  # exact: the bytes hold every bit of n, counts and the doubles
    assert loaded.to_bytes() == raw


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@FAST
def test_short_or_corrupt_bytes_are_refused(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    raw = mech.aggregate(encode(mech, data.draw(values_for(mech)), data.draw(seeds))).to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(raw[:cut])
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(raw + data.draw(st.binary(min_size=1, max_size=9)))
    spot = data.draw(st.integers(0, 4))  # inside the 5-byte magic
    flipped = bytearray(raw)
    flipped[spot] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(bytes(flipped))


@pytest.mark.parametrize("name", NAMES)
def test_negative_counts_in_bytes_are_refused(name: str) -> None:
    """A corrupt record whose n (or a count, or a sum of squares) is negative is refused."""
    mech = build(name, 1.0, 5)
    values = np.array([[1, 2, 3.0]]) if name in ATTRIBUTE_NAMES else np.array([1, 2, 3])
    raw = bytearray(mech.aggregate(encode_with(mech, values, None)).to_bytes())
    with_negative_n = bytes(raw[:5]) + struct.pack("<q", -3) + bytes(raw[13:])
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(with_negative_n)
    if isinstance(mech.empty_statistics(), CountStatistics):
        raw[-8:] = struct.pack("<q", -1)  # the last count
    else:
        raw[-8:] = struct.pack("<d", -1.0)  # the sum of squares
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(bytes(raw))


@pytest.mark.parametrize("name", NUMERIC_NAMES)
@pytest.mark.parametrize(("total", "squares"), [(math.nan, 4.0), (1.0, math.nan)])
def test_nan_moments_in_bytes_are_refused(name: str, total: float, squares: float) -> None:
    """Sums of finite debiased values are never NaN: such bytes can only be corrupt."""
    mech = build(name, 1.0, 0)
    raw = MomentStatistics(3, 1.0, 4.0).to_bytes()
    corrupt = raw[:-16] + struct.pack("<dd", total, squares)
    with pytest.raises(ValueError):
        mech.statistics_from_bytes(corrupt)


@pytest.mark.parametrize("name", NAMES)
def test_statistics_of_the_wrong_shape_are_refused(name: str) -> None:
    """Counts of another length, or statistics of the other kind, do not load."""
    mech = build(name, 1.0, 5)
    own = mech.empty_statistics()
    if isinstance(own, CountStatistics):
        for length in (own.counts.size - 1, own.counts.size + 1):
            with pytest.raises(ValueError, match="counts"):
                mech.statistics_from_bytes(CountStatistics.empty(length).to_bytes())
        with pytest.raises(ValueError):
            mech.statistics_from_bytes(MomentStatistics(2, 1.0, 1.0).to_bytes())
    else:
        with pytest.raises(ValueError):
            mech.statistics_from_bytes(CountStatistics.empty(5).to_bytes())


# ---------------------------------------------------------------------------------------
# Reports as JSON payloads
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@FAST
def test_payloads_round_trip_through_json(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    reports = encode(mech, data.draw(values_for(mech)), data.draw(seeds))
    payloads = mech.to_payloads(reports)
    assert len(payloads) == reports.shape[0]
    assert all(isinstance(payload, dict) for payload in payloads)
    assert all(payload.keys() == mech.payload_fields for payload in payloads)
    text = json.dumps(payloads, allow_nan=False)  # strict JSON, as the HTTP API sends it
    back = mech.from_payloads(json.loads(text))
    assert back.shape == reports.shape
    np.testing.assert_array_equal(back, reports)
    assert mech.aggregate(back) == mech.aggregate(reports)


def smallest_prime_at_least(n: int) -> int:
    candidate = max(n, 2)
    while any(candidate % k == 0 for k in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def out_of_range_updates(mech: Mechanism[Any]) -> list[dict[str, Any]]:
    """Field values of the right type that lie outside the mechanism's report space."""
    name, eps = mech.name, mech.epsilon
    d = getattr(mech.spec, "domain_size", 0)
    if name in ("grr", "lgrr"):
        return [{"value": d}, {"value": -1}, {"value": 2**40}]
    if name == "hr":
        return [{"value": 1 << d.bit_length()}, {"value": -1}]  # K: the smallest 2^k > d
    if name == "olh":
        prime, g = smallest_prime_at_least(d), round(math.exp(eps)) + 1
        return [{"a": 0}, {"a": prime}, {"b": -1}, {"b": prime}, {"value": g}, {"value": -1}]
    if name in ("sue", "oue", "lsue", "loue", "losue"):
        row = (d + 7) // 8
        updates = [
            {"bits": base64.b64encode(bytes(row + 1)).decode()},
            {"bits": base64.b64encode(bytes(row - 1)).decode()},
            {"bits": "not base64!"},
            {"bits": "AA="},  # bad base64 padding
        ]
        if d % 8:  # set the first padding bit past bit d - 1
            padded = bytes(row - 1) + bytes([0x80 >> (d % 8)])
            updates.append({"bits": base64.b64encode(padded).decode()})
        return updates
    if name == "rappor":
        k, m = mech.spec.num_bits or 0, mech.spec.num_cohorts or 0
        row = (k + 7) // 8
        updates = [
            {"cohort": m},
            {"cohort": -1},
            {"cohort": 2**40},
            {"bits": base64.b64encode(bytes(row + 1)).decode()},
            {"bits": base64.b64encode(bytes(row - 1)).decode()},
            {"bits": "not base64!"},
            {"bits": "AA="},
        ]
        if k % 8:  # set the first padding bit past bit k - 1 (little-endian bit order)
            padded = bytes(row - 1) + bytes([1 << (k % 8)])
            updates.append({"bits": base64.b64encode(padded).decode()})
        return updates
    if name == "cms":
        k, m = mech.spec.sketch_depth or 0, mech.spec.sketch_width or 0
        row = (m + 7) // 8
        updates = [
            {"row": k},
            {"row": -1},
            {"bits": base64.b64encode(bytes(row + 1)).decode()},
            {"bits": "not base64!"},
        ]
        if m % 8:
            updates.append(
                {"bits": base64.b64encode(bytes(row - 1) + bytes([0x80 >> (m % 8)])).decode()}
            )
        return updates
    if name == "pem":
        groups, seeds, buckets = mech.groups, mech.seeds, mech.buckets  # type: ignore[attr-defined]
        return [
            {"group": groups},
            {"group": -1},
            {"seed": seeds},
            {"seed": -1},
            {"value": buckets},
            {"value": -1},
        ]
    if name == "sfp":
        k, m = mech.spec.sketch_depth or 0, mech.spec.sketch_width or 0
        positions = ((mech.spec.max_length or 0) + 1) // 2
        row = (m + 7) // 8
        return [
            {"kind": 2},
            {"kind": -1},
            {"kind": 1, "position": positions},
            {"position": -1},
            {"row": k},
            {"row": -1},
            {"bits": base64.b64encode(bytes(row + 1)).decode()},
            {"bits": "not base64!"},
        ]
    if name == "hcms":
        k, m = mech.spec.sketch_depth or 0, mech.spec.sketch_width or 0
        return [{"row": k}, {"row": -1}, {"column": m}, {"column": -1}, {"bit": 2}, {"bit": -1}]
    if name == "dbitflip":  # s sorted distinct little-endian uint32 buckets, s packed bits
        s = mech.spec.bits_per_device or 1

        def packed(*buckets: int) -> str:
            return base64.b64encode(struct.pack(f"<{len(buckets)}I", *buckets)).decode()

        updates = [
            {"buckets": packed(*range(d - s + 1, d + 1))},  # the last bucket is d
            {"buckets": packed(*range(s + 1))},  # one bucket too many
            {"buckets": "not base64!"},
            {"bits": base64.b64encode(bytes((s + 7) // 8 + 1)).decode()},
        ]
        if s >= 2:
            updates.append({"buckets": packed(*([0] * s))})  # a repeated bucket
        if s % 8:
            pad = bytes((s + 7) // 8 - 1) + bytes([0x80 >> (s % 8)])
            updates.append({"bits": base64.b64encode(pad).decode()})
        return updates
    if name == "laplace":
        return [{"value": 2**53}, {"value": -(2**53)}, {"value": 2**63}, {"value": -(2**70)}]
    if name == "duchi":
        return [{"value": 0}, {"value": 2}, {"value": -2}]
    if name == "onebitmean":  # a bit
        return [{"value": -1}, {"value": 2}, {"value": 2**40}]
    if name == "hh":  # (level, a, b, value): level 1..h; a = b = 0 at a GRR level
        height = mech.height  # type: ignore[attr-defined]
        grr_level = next(
            level
            for level in range(1, height + 1)
            if not mech.uses_hash(level)  # type: ignore[attr-defined]
        )
        return [
            {"level": 0},
            {"level": height + 1},
            {"level": grr_level, "a": 1, "b": 0, "value": 0},
            {"level": grr_level, "a": 0, "b": 0, "value": -1},
            {"level": 1, "value": 2**40},
        ]
    if name == "lhh":  # (level, value, bits): value at an lgrr level, bits at a losue level
        tree: Any = mech
        levels = range(1, tree.height + 1)
        index = next(level for level in levels if not tree.is_unary(level))
        refused: list[dict[str, Any]] = [
            {"level": 0},
            {"level": tree.height + 1},
            {"level": index, "value": tree.branching**index, "bits": ""},
            {"level": index, "value": -1, "bits": ""},
            {"level": index, "value": 0, "bits": "AA=="},  # an lgrr level reports no bits
        ]
        for level in [level for level in levels if tree.is_unary(level)][:1]:
            nodes = tree.branching**level
            size = (nodes + 7) // 8
            refused += [
                {"level": level, "value": 1, "bits": base64.b64encode(bytes(size)).decode()},
                {"level": level, "value": 0, "bits": base64.b64encode(bytes(size + 1)).decode()},
                {"level": level, "value": 0, "bits": "not base64!"},
            ]
            if nodes % 8:  # the first padding bit
                padding = base64.b64encode(bytes(size - 1) + bytes([0x80 >> (nodes % 8)])).decode()
                refused.append({"level": level, "value": 0, "bits": padding})
        return refused
    if name in ATTRIBUTE_NAMES:  # value bytes all 0xFF: past every view's range or padding
        if name != "smp":
            return [{"report": base64.b64encode(bytes([255]) * mech.report_width).decode()}]  # type: ignore[attr-defined]
        width = mech.views[0].width  # type: ignore[attr-defined]
        return [
            {"view": mech.k, "report": base64.b64encode(bytes(width)).decode()},  # type: ignore[attr-defined]
            {"view": 0, "report": base64.b64encode(bytes([255]) * width).decode()},
            {"view": 0, "report": base64.b64encode(bytes(width + 1)).decode()},
        ]
    if name in ("piecewise", "sw"):  # cell indices 0..M-1
        cells = mech.cells  # type: ignore[attr-defined]
        return [{"value": cells}, {"value": -1}, {"value": 2**40}]
    raise AssertionError(f"add out-of-range payloads for the new mechanism {name!r}")


def malformed_payloads(mech: Mechanism[Any], valid: dict[str, Any]) -> list[Any]:
    """Every way to spoil one valid payload: missing field, wrong type, bool, range."""
    spoiled: list[Any] = [None, [], "payload", 7]
    for field, value in valid.items():
        spoiled.append({k: v for k, v in valid.items() if k != field})  # missing
        for wrong in ("1", None, [1], {"v": 1}, True, False):  # wrong type, bool for int
            spoiled.append({**valid, field: wrong})
        if isinstance(value, int):
            spoiled.append({**valid, field: value + 0.5})  # a non-integer number
    spoiled.extend({**valid, **update} for update in out_of_range_updates(mech))
    return spoiled


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
@pytest.mark.slow
def test_malformed_payload_is_refused_naming_its_position(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    reports = encode(mech, data.draw(values_for(mech, min_size=1)), data.draw(seeds))
    payloads = mech.to_payloads(reports)
    position = data.draw(st.integers(0, len(payloads) - 1))
    payloads[position] = data.draw(st.sampled_from(malformed_payloads(mech, payloads[position])))
    with pytest.raises(ValueError) as info:
        mech.from_payloads(payloads)
    assert names_position(str(info.value), position), str(info.value)


# ---------------------------------------------------------------------------------------
# encode: the domain, clipping, empty batches, the secure default
# ---------------------------------------------------------------------------------------


def mentions(message: str, value: int) -> bool:
    """Does the message name ``value`` (not counting a "position N" that happens to match)?"""
    text = re.sub(r"\bposition \d+", "", message)
    return re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", text) is not None


@pytest.mark.parametrize("name", CATEGORICAL_NAMES)
@given(data=st.data())
@FAST
def test_encode_rejects_indices_outside_the_domain(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    d = mech.spec.domain_size
    assert d is not None
    values = data.draw(values_for(mech, max_size=10))
    bad = data.draw(st.integers(-(10**6), -1) | st.integers(d, d + 10**6))
    position = data.draw(st.integers(0, values.size))
    spoiled = np.insert(values, position, bad)
    with pytest.raises(ValueError) as info:
        mech.encode(spoiled, rng=np.random.default_rng(0))
    assert mentions(str(info.value), bad), str(info.value)


@pytest.mark.parametrize("name", CATEGORICAL_NAMES)
@pytest.mark.parametrize("bad", [1.5, -0.25, math.nan, math.inf])
def test_encode_rejects_non_integer_categories(name: str, bad: float) -> None:
    mech = build(name, 1.0, 5)
    with pytest.raises(ValueError):
        mech.encode(np.array([0.0, 1.0, bad]), rng=np.random.default_rng(0))


@pytest.mark.parametrize("name", CATEGORICAL_NAMES)
@pytest.mark.parametrize("bad", [1.5, math.nan])
def test_non_integer_category_error_names_the_value(name: str, bad: float) -> None:
    mech = build(name, 1.0, 5)
    with pytest.raises(ValueError) as info:
        mech.encode(np.array([0.0, 1.0, bad]), rng=np.random.default_rng(0))
    assert str(bad) in str(info.value).lower(), str(info.value)


@pytest.mark.parametrize("name", REAL_NAMES)
@given(data=st.data())
@FAST
def test_encode_rejects_nan(name: str, data: st.DataObject) -> None:
    mech = data.draw(mechanisms(name))
    values = data.draw(values_for(mech, max_size=10))
    position = data.draw(st.integers(0, values.size))
    with pytest.raises(ValueError) as info:
        mech.encode(np.insert(values, position, math.nan), rng=np.random.default_rng(0))
    message = str(info.value)
    assert "nan" in message.lower() and names_position(message, position), message


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(ATTRIBUTE_NAMES)))
@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (2, 0, 2)])
def test_encode_rejects_arrays_that_are_not_one_dimensional(
    name: str, shape: tuple[int, ...]
) -> None:
    mech = build(name, 1.0, 5)
    with pytest.raises(ValueError) as info:
        encode_with(mech, np.ones(shape, dtype=np.int64), np.random.default_rng(0))
    assert str(shape) in str(info.value), str(info.value)


@pytest.mark.parametrize("name", REAL_NAMES)
@given(data=st.data())
@FAST
def test_numeric_values_are_clipped_to_the_range(name: str, data: st.DataObject) -> None:
    """Out-of-range values encode exactly as their clipped values (same random stream)."""
    mech = data.draw(mechanisms(name))
    values = data.draw(values_for(mech, min_size=1))
    seed = data.draw(seeds)
    reports = encode(mech, values, seed)
    clipped = encode(mech, np.clip(values, LOWER, UPPER), seed)
    np.testing.assert_array_equal(reports, clipped)
    assert mech.aggregate(reports) == mech.aggregate(clipped)
    estimate = mech.estimate(mech.aggregate(reports))
    if name in DISTRIBUTION_NAMES:
        assert np.all(np.isfinite(estimate.cdf)) and np.all(np.isfinite(estimate.cdf_std()))
        for quantile in estimate.quantiles([0.5, 0.95]):
            assert LOWER <= quantile.ci_low <= quantile.value <= quantile.ci_high <= UPPER
        return
    assert math.isfinite(estimate.mean) and math.isfinite(estimate.std)
    assert LOWER <= estimate.postprocessed() <= UPPER


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_empty_batch(name: str, dtype: type) -> None:
    mech = build(name, 1.0, 5)
    reports = encode_with(mech, np.array([], dtype=dtype), np.random.default_rng(0))
    assert reports.shape[0] == 0
    stats = mech.aggregate(reports)
    assert stats.n == 0
    assert stats == mech.empty_statistics()
    assert mech.to_payloads(reports) == []
    assert mech.from_payloads([]).shape == reports.shape
    with pytest.raises(ValueError):
        mech.estimate(stats)
    with pytest.raises(ValueError):
        mech.estimate(mech.empty_statistics())


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
@settings(max_examples=10, deadline=None)
def test_secure_default_rng(name: str, data: st.DataObject) -> None:
    """``rng=None`` draws from the OS CSPRNG; the reports are valid and aggregate."""
    mech = data.draw(mechanisms(name))
    values = data.draw(values_for(mech))
    reports = encode_with(mech, values, None)
    assert reports.shape[0] == len(values)
    np.testing.assert_array_equal(mech.check_reports(reports), reports)
    assert mech.aggregate(reports).n == len(values)
    assert mech.from_payloads(json.loads(json.dumps(mech.to_payloads(reports)))).shape == (
        reports.shape
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rng", [42, np.random.RandomState(0)], ids=["int", "RandomState"])
def test_seeds_that_are_not_generators_are_refused(name: str, rng: Any) -> None:
    """Only a numpy Generator (simulations) or None (devices) is accepted as ``rng``."""
    mech = build(name, 1.0, 5)
    with pytest.raises(TypeError):
        encode_with(mech, np.array([1, 2]), rng)
