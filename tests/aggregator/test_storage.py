"""The storage layer, on SQLite and on PostgreSQL (``database_url`` runs every test on both).

Covers the schema and its version check, metric versioning, API key rows, exactly-once
ingest (including a fold that fails and concurrent writers of overlapping ids), partial
rows by time bucket, and compaction (including two compactors at once).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import inspect, update

from aggregator.repositories.database import SchemaMismatchError
from aggregator.repositories.reports import PartialRow
from aggregator.repositories.schema import METRICS_CHANGE, SCHEMA_VERSION, schema_info
from aggregator.storage import Repositories
from shared.schemas import MechanismSpec, MetricDefinition
from shared.statistics import CountStatistics

HOUR = 3600
#: Length of the count vectors the tests store (a metric with four categories).
WIDTH = 4


@pytest.fixture
def storage(database_url: str) -> Iterator[Repositories]:
    """The repositories over a fresh database, closed after the test."""
    store = Repositories.open(database_url)
    yield store
    store.close()


def definition(
    mechanism: str = "grr",
    epsilon: float = 1.0,
    domain_size: int = 3,
    labels: tuple[str, ...] | None = ("a", "b", "c"),
    description: str = "",
) -> MetricDefinition:
    spec = MechanismSpec.model_validate(
        {"mechanism": mechanism, "epsilon": epsilon, "domain_size": domain_size}
    )
    return MetricDefinition(description=description, mechanism=spec, labels=labels)


def ids(count: int, start: int = 0) -> list[bytes]:
    """``count`` distinct 16-byte report ids, deterministic (UUIDs start .. start + count - 1)."""
    return [uuid.UUID(int=start + i + 1).bytes for i in range(count)]


def count_row(metric: str, version: int, bucket: int, counts: Sequence[int]) -> PartialRow:
    """A partial row whose statistics are ``counts`` with n = their sum."""
    stats = CountStatistics(int(sum(counts)), np.array(counts, dtype=np.int64))
    return PartialRow(metric, version, bucket, stats.n, stats.to_bytes())


def merge_counts(blobs: list[bytes]) -> tuple[int, bytes]:
    """The ``merge`` callback of ``compact_group`` for CountStatistics."""
    total = CountStatistics.empty(WIDTH)
    for blob in blobs:
        total = total.merge(CountStatistics.from_bytes(blob))
    return total.n, total.to_bytes()


def counting_fold(metric: str = "m", bucket: int = 0) -> Callable[[list[bool]], list[PartialRow]]:
    """A fold that stores one row: n = the number of new ids, counts[0] = n."""

    def fold(new: list[bool]) -> list[PartialRow]:
        n = sum(new)
        return [count_row(metric, 1, bucket, [n, 0, 0, 0])] if n else []

    return fold


def total_n(storage: Repositories, metric: str = "m", version: int = 1) -> int:
    return sum(row.n for row in storage.reports.partial_rows(metric, version))


def merged(rows: Sequence[PartialRow]) -> CountStatistics:
    total = CountStatistics.empty(WIDTH)
    for row in rows:
        total = total.merge(CountStatistics.from_bytes(row.stats))
    return total


# --- schema ------------------------------------------------------------------------


def test_schema_is_created_with_its_version(storage: Repositories, database_url: str) -> None:
    tables = set(inspect(storage.database.engine).get_table_names())
    assert {"schema_info", "metric_versions", "api_keys", "report_ids", "partial_stats"} <= tables
    with storage.database.engine.connect() as conn:
        rows = conn.execute(schema_info.select()).all()
    values = {row.key: row.value for row in rows}
    assert values["schema_version"] == str(SCHEMA_VERSION)
    assert set(values) == {"schema_version", METRICS_CHANGE}
    storage.database.ping()
    # Opening the same database again finds the schema and changes nothing.
    again = Repositories.open(database_url)
    try:
        assert again.reports.report_count() == 0
        with again.database.engine.connect() as conn:
            assert conn.execute(schema_info.select()).all() == rows
    finally:
        again.close()


def test_a_different_schema_version_is_refused(storage: Repositories, database_url: str) -> None:
    with storage.database.engine.begin() as conn:
        conn.execute(
            update(schema_info)
            .where(schema_info.c.key == "schema_version")
            .values(value=str(SCHEMA_VERSION + 1))
        )
    storage.close()
    with pytest.raises(SchemaMismatchError, match=f"schema version {SCHEMA_VERSION + 1}"):
        Repositories.open(database_url)


# --- metrics -----------------------------------------------------------------------


def test_metric_versions(storage: Repositories) -> None:
    first, created = storage.metrics.define_metric("m", definition(description="first"))
    assert created and first.version == 1 and first.description == "first"

    # Same spec and labels: the same version, the description updated in place.
    same, created = storage.metrics.define_metric("m", definition(description="reworded"))
    assert not created and same.version == 1 and same.description == "reworded"

    changes = [
        definition(epsilon=2.0),  # epsilon
        definition(mechanism="oue", epsilon=2.0),  # mechanism
        definition(mechanism="oue", epsilon=2.0, labels=("x", "y", "z")),  # labels
        definition(mechanism="oue", epsilon=2.0, labels=None),  # labels dropped
        definition(mechanism="oue", epsilon=2.0, domain_size=4, labels=None),  # domain
    ]
    for expected, changed in enumerate(changes, start=2):
        metric, created = storage.metrics.define_metric("m", changed)
        assert created and metric.version == expected
        assert metric.mechanism == changed.mechanism and metric.labels == changed.labels

    storage.metrics.define_metric("other", definition())
    listed = storage.metrics.metrics()
    assert [(m.name, m.version) for m in listed] == [("m", v) for v in range(1, 7)] + [("other", 1)]
    # Every old version keeps its own spec.
    assert listed[0].mechanism == definition().mechanism
    assert listed[0].description == "reworded"
    assert listed[1].mechanism.epsilon == 2.0 and listed[1].mechanism.mechanism == "grr"
    assert listed[3].labels == ("x", "y", "z")
    # Going back to an earlier spec is a new version too: versions only ever grow.
    metric, created = storage.metrics.define_metric("m", definition())
    assert created and metric.version == 7


# --- API keys ----------------------------------------------------------------------


def test_keys_add_duplicate_and_revoke(storage: Repositories) -> None:
    assert storage.keys.count_keys() == 0
    assert storage.keys.add_key("k1", "a" * 64, "admin", "first")
    assert storage.keys.add_key("k2", "b" * 64, "device", "second")
    # The same hash again (under any id or role) is refused and changes nothing.
    assert not storage.keys.add_key("k3", "a" * 64, "device", "again")
    assert storage.keys.count_keys() == 2
    rows = {row["key_id"]: row for row in storage.keys.keys()}
    assert set(rows) == {"k1", "k2"}
    assert rows["k1"]["role"] == "admin" and rows["k1"]["key_hash"] == "a" * 64
    assert rows["k1"]["label"] == "first" and rows["k1"]["revoked_at"] is None

    assert storage.keys.revoke_key("k2")
    assert not storage.keys.revoke_key("k2")  # already revoked
    assert not storage.keys.revoke_key("missing")
    rows = {row["key_id"]: row for row in storage.keys.keys()}
    assert rows["k2"]["revoked_at"] is not None and rows["k1"]["revoked_at"] is None
    assert storage.keys.count_keys() == 2  # revoked keys stay on record


# --- ingest ------------------------------------------------------------------------


def test_ingest_counts_each_id_once(storage: Repositories) -> None:
    seen_masks: list[list[bool]] = []

    def fold(new: list[bool]) -> list[PartialRow]:
        seen_masks.append(list(new))
        return counting_fold()(new)

    first = ids(5)
    assert storage.reports.ingest(first, fold) == (5, 0)
    assert seen_masks[-1] == [True] * 5

    # A retry of the same ids: all duplicates, and the fold is not asked for anything.
    calls = len(seen_masks)
    assert storage.reports.ingest(first, fold) == (0, 5)
    assert len(seen_masks) == calls

    # Overlapping ids in another order: the mask marks exactly the new ones, by position.
    mixed = [ids(1, 7)[0], first[2], ids(1, 5)[0], first[0], ids(1, 6)[0]]
    assert storage.reports.ingest(mixed, fold) == (3, 2)
    assert seen_masks[-1] == [True, False, True, False, True]

    assert storage.reports.report_count() == 8
    assert total_n(storage) == 8


def test_a_failing_fold_writes_nothing(storage: Repositories) -> None:
    assert storage.reports.ingest(ids(3), counting_fold()) == (3, 0)

    def failing(new: list[bool]) -> list[PartialRow]:
        raise RuntimeError("fold failed")

    with pytest.raises(RuntimeError, match="fold failed"):
        storage.reports.ingest(ids(4, 100), failing)
    assert storage.reports.report_count() == 3
    assert total_n(storage) == 3

    # A fold that fails while writing (a row that cannot be stored) also leaves nothing.
    def unstorable(new: list[bool]) -> list[PartialRow]:
        good = count_row("m", 1, 0, [sum(new), 0, 0, 0])
        return [good, PartialRow("m", 1, 0, 1, None)]  # type: ignore[arg-type]

    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises
        storage.reports.ingest(ids(4, 100), unstorable)
    assert storage.reports.report_count() == 3
    assert len(storage.reports.partial_rows("m", 1)) == 1

    # The ids of the failed attempts were not recorded: they are new when sent again.
    assert storage.reports.ingest(ids(4, 100), counting_fold()) == (4, 0)
    assert storage.reports.report_count() == 7
    assert total_n(storage) == 7


def test_partial_rows_by_window(storage: Repositories) -> None:
    storage.reports.add_partial_rows(
        [
            count_row("m", 1, 0 * HOUR, [1, 0, 0, 0]),
            count_row("m", 1, 1 * HOUR, [0, 2, 0, 0]),
            count_row("m", 1, 1 * HOUR, [0, 0, 3, 0]),
            count_row("m", 1, 2 * HOUR, [0, 0, 0, 4]),
            count_row("m", 2, 1 * HOUR, [5, 0, 0, 0]),
            count_row("other", 1, 1 * HOUR, [6, 0, 0, 0]),
        ]
    )

    def ns(start: int | None, end: int | None) -> list[int]:
        return sorted(row.n for row in storage.reports.partial_rows("m", 1, start, end))

    assert ns(None, None) == [1, 2, 3, 4]
    assert ns(HOUR, None) == [2, 3, 4]
    assert ns(None, HOUR) == [1]
    assert ns(HOUR, 2 * HOUR) == [2, 3]
    assert ns(3 * HOUR, None) == []
    assert [row.n for row in storage.reports.partial_rows("m", 2)] == [5]
    assert storage.reports.partial_rows("m", 3) == []
    row = storage.reports.partial_rows("m", 1, 2 * HOUR)[0]
    assert (row.metric, row.version, row.bucket) == ("m", 1, 2 * HOUR)
    assert CountStatistics.from_bytes(row.stats) == CountStatistics(4, np.array([0, 0, 0, 4]))
    assert storage.reports.report_count() == 0  # add_partial_rows records no report ids


# --- compaction --------------------------------------------------------------------


def test_compaction_merges_each_group_into_one_row(storage: Repositories) -> None:
    rng = np.random.default_rng(11)
    groups = [("m", 1, 0), ("m", 1, HOUR), ("m", 2, 0), ("other", 1, 0)]
    added: dict[tuple[str, int, int], list[PartialRow]] = {}
    for group in groups:
        rows = [count_row(*group, rng.integers(0, 50, WIDTH).tolist()) for _ in range(5)]
        added[group] = rows
        storage.reports.add_partial_rows(rows)
    storage.reports.add_partial_rows([count_row("single", 1, 0, [1, 1, 1, 1])])

    assert sorted(storage.reports.groups_to_compact()) == sorted((*g, 0) for g in groups)
    for group in groups:
        assert storage.reports.compact_group(*group, 0, merge_counts) == 5

    assert storage.reports.groups_to_compact() == []
    for metric, version, bucket in groups:
        rows = storage.reports.partial_rows(metric, version, bucket, bucket + HOUR)
        assert len(rows) == 1
        assert rows[0].n == sum(row.n for row in added[(metric, version, bucket)])
        assert merged(rows) == merged(added[(metric, version, bucket)])
    # A group already compacted, or empty, merges nothing further.
    assert storage.reports.compact_group("m", 1, 0, 0, merge_counts) == 1
    assert storage.reports.compact_group("none", 1, 0, 0, merge_counts) == 0
    assert len(storage.reports.partial_rows("single", 1)) == 1


def test_concurrent_compactions_never_double_count(storage: Repositories) -> None:
    """Two compactors and a writer on one group at once: the merged total is exact."""
    rng = np.random.default_rng(12)
    batches = [
        [count_row("m", 1, 0, rng.integers(0, 20, WIDTH).tolist()) for _ in range(4)]
        for _ in range(30)
    ]
    storage.reports.add_partial_rows(batches[0])
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait()
                work()
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)

        return run

    def compactor() -> None:
        for _ in range(15):
            storage.reports.compact_group("m", 1, 0, 0, merge_counts)

    def writer() -> None:
        for batch in batches[1:]:
            storage.reports.add_partial_rows(batch)

    threads = [threading.Thread(target=guarded(f)) for f in (compactor, compactor, writer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []

    expected = merged([row for batch in batches for row in batch])
    assert merged(storage.reports.partial_rows("m", 1)) == expected
    assert total_n(storage) == expected.n
    storage.reports.compact_group("m", 1, 0, 0, merge_counts)
    rows = storage.reports.partial_rows("m", 1)
    assert len(rows) == 1 and merged(rows) == expected and rows[0].n == expected.n


# --- concurrent ingest ---------------------------------------------------------------


def test_concurrent_ingest_of_overlapping_ids_counts_each_once(storage: Repositories) -> None:
    """Several threads send overlapping id sets, in batches; every id is counted once."""
    writers, batches, size = 4, 6, 50
    universe = ids(400)
    rng = np.random.default_rng(13)
    plans = [
        [
            [universe[i] for i in rng.choice(len(universe), size, replace=False)]
            for _ in range(batches)
        ]
        for _ in range(writers)
    ]
    sent = {report_id for plan in plans for batch in plan for report_id in batch}
    replies: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(writers)

    def send(plan: list[list[bytes]]) -> None:
        try:
            start.wait()
            for batch in plan:
                reply = storage.reports.ingest(batch, counting_fold())
                with lock:
                    replies.append(reply)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=send, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []

    assert len(replies) == writers * batches
    assert sum(accepted for accepted, _ in replies) == len(sent)
    assert (
        sum(accepted + duplicates for accepted, duplicates in replies) == writers * batches * size
    )
    assert storage.reports.report_count() == len(sent)
    assert total_n(storage) == len(sent)
    # The overlap is real: some ids were sent by more than one writer.
    assert len(sent) < writers * batches * size


def test_two_storages_on_one_sqlite_file_take_turns_and_count_each_id_once(
    tmp_path: Path,
) -> None:
    """Two sets of repositories on one SQLite file stand for two worker processes: while
    one writes, the other's write waits on the writers' file lock (it does not fail or
    poll), and overlapping batches from both count every id once."""
    path = str(tmp_path / "shared.sqlite3")
    first, second = Repositories.open(path), Repositories.open(path)
    try:
        lock = first.database._writers_lock
        assert lock is not None
        finished = threading.Event()

        def write_from_second() -> None:
            second.reports.ingest(ids(10), counting_fold())
            finished.set()

        with lock:  # as if the other process were committing
            writer = threading.Thread(target=write_from_second)
            writer.start()
            assert not finished.wait(0.5)
        writer.join(timeout=30)
        assert finished.is_set()

        batches = [ids(300, start) for start in (0, 100, 200, 300)]
        replies: list[tuple[int, int]] = []
        threads = [
            threading.Thread(
                target=lambda s=s, b=b: replies.append(s.reports.ingest(b, counting_fold()))
            )
            for s, b in zip((first, second, first, second), batches, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(accepted for accepted, _ in replies) == 600 - 10
        assert first.reports.report_count() == second.reports.report_count() == 600
        assert total_n(first) == total_n(second) == 600
    finally:
        first.close()
        second.close()
