"""OLH aggregation: exact support counts, at a cost that grows with the reports.

``OptimizedLocalHashing.aggregate`` must return C_v = #{i : H_{a_i, b_i}(v) = y_i} for
every v < d (``shared.mechanisms.olh``). Every test here compares with that definition
evaluated directly (one hash per report and item), on uniformly random valid reports
(every (a, b, y), not only those ``encode`` draws), at small and medium d: powers of two,
primes (P = d) and d just below a prime, where "mod P mod g" leaves some buckets short.
Each path the aggregate can take (hash table, sparse items, dense blocks) is checked on
its own, also with tiny chunks and blocks so that chunk, block and progression ends fall
everywhere.

Cost: a report supports at most ceil(P / g) items, so aggregating n reports should
touch O(n P / g + P) entries whatever n is. The tests count what the aggregation hands
to ``np.bincount`` (its input plus its output length) and bound the memory one report
at d = 2^20 takes; the former quadratic walk (about P / g passes over P counts per
chunk) fails both. The service's ingest (``aggregator.ingest.prepare``) folds reports with
the same ``aggregate``, checked on one report. No test times anything.
"""

from __future__ import annotations

import math
import tracemalloc
import uuid
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aggregator.ingest import prepare
from shared.mechanisms import make_mechanism, olh
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.schemas import MechanismSpec, ReportBatch
from shared.statistics import CountStatistics

#: Domain sizes: tiny, P = d (primes), d = P - 1 (1008: P = 1009), powers of two, others.
DOMAINS = (2, 3, 10, 11, 96, 97, 1000, 1008, 1009, 1024, 4099, 5000, 16_385)
EPSILONS = (0.5, 1.0, 4.0, 8.0)  # g = 3, 4, 56, 2982 (g > P for the smallest domains)


def build(epsilon: float, d: int) -> OptimizedLocalHashing:
    mech = make_mechanism(MechanismSpec(mechanism="olh", epsilon=epsilon, domain_size=d))
    assert isinstance(mech, OptimizedLocalHashing)
    return mech


def random_reports(mech: OptimizedLocalHashing, n: int, label: str) -> np.ndarray:
    """n uniformly random valid rows (a, b, y), seeded by ``label``."""
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    a = rng.integers(1, mech.prime, n)
    b = rng.integers(0, mech.prime, n)
    y = rng.integers(0, mech.buckets, n)
    return np.stack([a, b, y], axis=1)


def brute_force(mech: OptimizedLocalHashing, reports: np.ndarray) -> np.ndarray:
    """C_v = #{i : H_{a_i, b_i}(v) = y_i}, one hash per (report, item)."""
    counts = np.zeros(mech.domain_size, dtype=np.int64)
    items = np.arange(mech.domain_size)
    for a, b, y in reports:
        counts += mech.hash(a, b, items) == y
    return counts


def cases() -> Iterator[tuple[int, float, int]]:
    for d in DOMAINS:
        for epsilon in EPSILONS:
            for n in (1, 2, 37, 300):
                if n * d <= 5_000_000:
                    yield d, epsilon, n


@pytest.mark.parametrize(("d", "epsilon", "n"), list(cases()))
def test_aggregate_equals_brute_force(d: int, epsilon: float, n: int) -> None:
    mech = build(epsilon, d)
    reports = random_reports(mech, n, f"{d} {epsilon} {n}")
    expected = CountStatistics(n, brute_force(mech, reports))
    stats = mech.aggregate(reports)
    assert stats == expected
    assert stats.to_bytes() == expected.to_bytes()
    assert np.array_equal(mech._support_by_progressions(reports), expected.counts)
    assert mech._sparse_support(reports) == expected
    if (mech.prime - 1) * mech.prime * d <= 1 << 22:
        assert np.array_equal(mech._support_by_hash_table(reports), expected.counts)


@pytest.mark.parametrize(("chunk", "block"), [(1, 1), (7, 1), (7, 5), (64, 3)])
@pytest.mark.parametrize(("d", "epsilon"), [(10, 0.5), (97, 1.0), (1008, 0.5), (1024, 4.0)])
def test_chunk_and_block_ends(
    monkeypatch: pytest.MonkeyPatch, chunk: int, block: int, d: int, epsilon: float
) -> None:
    """Tiny chunks and blocks: every boundary the walk has, against the definition."""
    monkeypatch.setattr(olh, "_AGGREGATE_CHUNK", chunk)
    monkeypatch.setattr(olh, "_BLOCK_ITEMS", block)
    mech = build(epsilon, d)
    reports = random_reports(mech, 150, f"ends {chunk} {block} {d} {epsilon}")
    expected = brute_force(mech, reports)
    assert np.array_equal(mech._support_by_progressions(reports), expected)
    assert np.array_equal(mech._sparse_support(reports).counts, expected)


def test_encoded_reports_and_merge() -> None:
    """Reports from ``encode``; statistics of parts merge to those of the whole."""
    mech = build(2.0, 3000)
    rng = np.random.default_rng(5)
    reports = mech.encode(rng.integers(0, 3000, 500), rng=rng)
    whole = mech.aggregate(reports)
    assert np.array_equal(whole.counts, brute_force(mech, reports))
    parts = [mech.aggregate(reports[i : i + 1]) for i in range(20)] + [mech.aggregate(reports[20:])]
    assert parts[0].merge_many(parts[1:]) == whole


def test_no_reports() -> None:
    mech = build(1.0, 5000)
    stats = mech.aggregate(np.zeros((0, 3), dtype=np.int64))
    assert stats == CountStatistics(0, np.zeros(5000, dtype=np.int64))


class BincountMeter:
    """Wraps ``np.bincount`` and sums, over calls, input length plus output length."""

    def __init__(self) -> None:
        self.entries = 0
        self.inner = np.bincount

    def __call__(self, x: np.ndarray, minlength: int = 0) -> np.ndarray:
        result = self.inner(x, minlength=minlength)
        self.entries += int(np.size(x)) + int(np.size(result))
        return result


@pytest.mark.parametrize(
    ("d", "epsilon", "n"),
    [(1 << 14, 4.0, 64), (1 << 16, 4.0, 64), (1 << 16, 1.0, 1000), (1 << 12, 0.5, 5000)],
)
def test_dense_work_is_linear_in_reports(
    monkeypatch: pytest.MonkeyPatch, d: int, epsilon: float, n: int
) -> None:
    """Counting n reports densely touches at most 3 (n ceil(P / g) + P) entries.

    Each block holds at least P items (``olh._supported_items``), so the P-long count
    vectors add at most as much as the items: about 2 (n P / g + P). The former walk
    counted P entries for each of the P / g steps, so it failed whenever n << P (64
    reports at d = 2^14: 4.8 * 10^6 entries where 1.1 * 10^5 are allowed); the last case
    (n > P) checks that many reports stay linear too.
    """
    mech = build(epsilon, d)
    reports = random_reports(mech, n, f"work {d} {epsilon} {n}")
    meter = BincountMeter()
    monkeypatch.setattr(np, "bincount", meter)
    stats = mech.aggregate(reports)
    monkeypatch.undo()
    bound = 3 * (n * math.ceil(mech.prime / mech.buckets) + mech.prime)
    assert 0 < meter.entries <= bound
    assert np.array_equal(stats.counts, brute_force(mech, reports))


@pytest.mark.parametrize("d", [1 << 14, 1 << 20])
def test_one_report_costs_its_items_not_the_domain(d: int) -> None:
    """One report at epsilon 4 supports at most ceil(P / 56) items (about d / 56): it is
    counted sparsely, with peak memory at most 64 bytes per item plus 8 KiB (about 1.1 d
    bytes, against the 16 d bytes of the two P-long vectors the former walk held)."""
    mech = build(4.0, d)
    reports = random_reports(mech, 1, f"one {d}")
    expected = brute_force(mech, reports)
    tracemalloc.start()
    try:
        stats = mech.aggregate(reports)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * math.ceil(mech.prime / mech.buckets) + 8192
    assert np.array_equal(stats.counts, expected)


class OneMetric:
    """A catalog of one metric version (what ``aggregator.ingest.prepare`` looks up)."""

    def __init__(self, name: str, mech: OptimizedLocalHashing) -> None:
        self.name, self.mech = name, mech

    def mechanism(self, name: str, version: int) -> OptimizedLocalHashing | None:
        return self.mech if (name, version) == (self.name, 1) else None

    def versions(self, name: str) -> list[Any]:
        return [SimpleNamespace(version=1)] if name == self.name else []

    def get(self, name: str, version: int | None = None) -> None:
        """Its metrics have no dimensions (no spec to read them from)."""
        return None


def test_ingest_folds_one_report_by_its_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service folds a batch through the mechanism's ``aggregate``: one report of a
    2^18-value metric is counted from its items alone (no length-P count vector), and the
    stored row is the statistics the definition gives."""
    mech = build(4.0, 1 << 18)
    ((a, b, y),) = random_reports(mech, 1, "ingest")
    payload = {"a": int(a), "b": int(b), "value": int(y)}
    item = {"report_id": str(uuid.UUID(int=7)), "metric": "m", "version": 1, "payload": payload}
    batch = ReportBatch.model_validate({"reports": [item]})
    meter = BincountMeter()
    monkeypatch.setattr(np, "bincount", meter)
    prepared, _ = prepare(batch, OneMetric("m", mech), 3600, datetime.now(UTC))
    monkeypatch.undo()
    assert meter.entries == 0
    expected = CountStatistics(1, brute_force(mech, np.array([[a, b, y]])))
    (row,) = prepared.fold([True])
    assert (row.n, row.stats) == (1, expected.to_bytes())
