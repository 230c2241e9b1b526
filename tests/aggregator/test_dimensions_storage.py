"""Statistics kept per (metric, version, bucket, cell): the upgrade of a version-2 database,
ingest folding per cell, compaction per cell, and estimates by cell, on SQLite and on
PostgreSQL (``database_url`` runs each test on both; PostgreSQL cases skip, saying why,
where none answers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import inspect, select

from aggregator.repositories.database import Database
from aggregator.repositories.reports import PartialRow, ReportsRepository
from aggregator.repositories.schema import SCHEMA_VERSION, partial_stats, schema_info
from aggregator.service import Services
from aggregator.settings import Settings
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec, MetricDefinition, ReportBatch
from shared.statistics import CountStatistics

GRR3 = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}
DIMS: dict[str, tuple[str, ...]] = {"platform": ("android", "ios", "web")}
NOW = datetime.now(UTC).replace(minute=30, second=0, microsecond=0)
HOUR = timedelta(hours=1)


@pytest.fixture
def services(database_url: str) -> Iterator[Services]:
    opened = Services.open(Settings(database=database_url, min_reports=5, compaction_interval=0))
    try:
        yield opened
    finally:
        opened.close()


def define(services: Services) -> None:
    definition = MetricDefinition(mechanism=MechanismSpec.model_validate(GRR3), dimensions=DIMS)
    services.aggregator.define("m", definition)


def hour_of(offset: int) -> datetime:
    return NOW.replace(minute=0) - offset * HOUR


def batch(values: list[int], platforms: list[str], hours: list[int]) -> ReportBatch:
    return ReportBatch.model_validate(
        {
            "reports": [
                {
                    "report_id": str(uuid.uuid4()),
                    "metric": "m",
                    "version": 1,
                    "payload": {"value": value},
                    "time": hour_of(hour).isoformat(),
                    "dimensions": {"platform": platform},
                }
                for value, platform, hour in zip(values, platforms, hours, strict=True)
            ]
        }
    )


def counts_of(rows: list[PartialRow]) -> dict[tuple[int, int], list[int]]:
    """{(bucket, cell): summed counts} of ``rows``."""
    mechanism = make_mechanism(MechanismSpec.model_validate(GRR3))
    summed: dict[tuple[int, int], np.ndarray] = {}
    for row in rows:
        stats = mechanism.statistics_from_bytes(row.stats)
        assert isinstance(stats, CountStatistics) and stats.n == row.n
        key = (row.bucket, row.cell)
        summed[key] = summed.get(key, np.zeros(3, dtype=np.int64)) + stats.counts
    return {key: value.tolist() for key, value in summed.items()}


def test_ingest_folds_one_row_per_bucket_and_cell(services: Services) -> None:
    define(services)
    platforms = ["android", "ios", "android", "web", "ios", "ios"]
    result = services.aggregator.ingest(
        batch([0, 1, 2, 0, 1, 1], platforms, [1, 1, 1, 1, 2, 2]), NOW
    )
    assert result.accepted == 6
    rows = services.repositories.reports.partial_rows("m", 1)
    first, second = (int(hour_of(h).timestamp()) for h in (1, 2))
    assert counts_of(rows) == {
        (first, 0): [1, 0, 1],
        (first, 1): [0, 1, 0],
        (first, 2): [1, 0, 0],
        (second, 1): [0, 2, 0],
    }
    assert len(rows) == 4


def test_compaction_merges_per_cell(services: Services) -> None:
    define(services)
    for platforms in (["android", "ios", "ios"], ["android", "web"], ["ios"]):
        services.aggregator.ingest(
            batch([1] * len(platforms), platforms, [1] * len(platforms)), NOW
        )
    reports = services.repositories.reports
    before = counts_of(reports.partial_rows("m", 1))
    bucket = int(hour_of(1).timestamp())
    assert sorted(reports.groups_to_compact()) == [("m", 1, bucket, 0), ("m", 1, bucket, 1)]
    result = services.aggregator.compact()
    assert (result.groups, result.rows_merged) == (2, 4)
    rows = reports.partial_rows("m", 1)
    assert sorted(row.cell for row in rows) == [0, 1, 2]  # one row per cell, never mixed
    assert (
        counts_of(rows)
        == before
        == {
            (bucket, 0): [0, 2, 0],
            (bucket, 1): [0, 3, 0],
            (bucket, 2): [0, 1, 0],
        }
    )
    assert reports.groups_to_compact() == []


def test_estimates_by_cell_on_either_database(services: Services) -> None:
    """The release threshold (5 here) per (bucket, cell), and by= over stored cells."""
    define(services)
    platforms = ["android"] * 6 + ["ios"] * 5 + ["web"] * 4
    services.aggregator.ingest(batch([0] * 6 + [1] * 5 + [2] * 4, platforms, [1] * 15), NOW)
    body = services.aggregator.estimate("m", by="platform", now=NOW)
    assert (body["n"], body["suppressed_buckets"], body["suppressed_reports"]) == (11, 1, 4)
    groups = body["groups"]
    assert isinstance(groups, list)
    assert [(g["dimensions"], g["n"]) for g in groups] == [
        ({"platform": "android"}, 6),
        ({"platform": "ios"}, 5),
    ]
    assert body["withheld_groups"] == 1


def test_a_version_2_database_is_upgraded(database_url: str) -> None:
    """Version 2 had no ``cell`` column and grouped by (metric, version, bucket): the
    upgrade adds the column (its rows are cell 0) and puts it in the group index."""
    database = Database(database_url)
    try:
        with database.write() as conn:
            conn.exec_driver_sql("DROP INDEX partial_stats_group")
            conn.exec_driver_sql("ALTER TABLE partial_stats DROP COLUMN cell")
            conn.exec_driver_sql(
                "CREATE INDEX partial_stats_group ON partial_stats (metric, version, bucket)"
            )
            conn.execute(  # the columns of version 2 only
                partial_stats.insert().values(metric="m", version=1, bucket=3600, n=2, stats=b"x")
            )
            conn.execute(
                schema_info.update().where(schema_info.c.key == "schema_version").values(value="2")
            )
    finally:
        database.close()
    upgraded = Database(database_url)
    try:
        with upgraded.read() as conn:
            version = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one()
            indexes = {
                index["name"]: index["column_names"]
                for index in inspect(conn).get_indexes(partial_stats.name)
            }
        assert version == str(SCHEMA_VERSION)
        assert indexes["partial_stats_group"] == ["metric", "version", "bucket", "cell"]
        reports = ReportsRepository(upgraded)
        try:
            assert reports.partial_rows("m", 1) == [PartialRow("m", 1, 3600, 2, b"x", 0)]
            reports.add_partial_rows([PartialRow("m", 1, 3600, 1, b"y", 7)])
            assert sorted(row.cell for row in reports.partial_rows("m", 1)) == [0, 7]
        finally:
            reports.close()
    finally:
        upgraded.close()
