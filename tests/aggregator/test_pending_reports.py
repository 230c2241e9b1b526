"""Reports waiting below the release threshold are announced, not silently missing.

A device's first reports of the hour went in (``flush()`` succeeded) and the estimate's
``n`` did not move: the current hour's bucket held fewer than ``min_reports`` reports and
was suppressed. The estimate now says how many reports of the window are in that bucket,
still filling (``pending_reports``), apart from those of closed small buckets, and a
refusal for want of reports says the same. The service runs at a fixed ``now``, so no
test depends on the hour it runs in.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from aggregator.app import create_app
from aggregator.service import Aggregator, NotEnoughReportsError, Services
from aggregator.settings import Settings
from shared.schemas import MechanismSpec, MetricDefinition, ReportBatch

MIN_REPORTS = 10
NOW = datetime(2026, 11, 22, 10, 25, tzinfo=UTC)
HOUR = NOW.replace(minute=0)
GRR = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Aggregator]:
    settings = Settings(database=str(tmp_path / "pending.sqlite3"), min_reports=MIN_REPORTS)
    services = Services.open(settings)
    services.aggregator.define("colour", MetricDefinition(mechanism=GRR))
    yield services.aggregator
    services.close()


def send(service: Aggregator, count: int, hours_ago: int, now: datetime = NOW) -> None:
    """``count`` GRR reports (as sent; their values do not matter here) stamped
    ``hours_ago`` hours before ``NOW``'s hour, received at ``now``."""
    time = (HOUR - timedelta(hours=hours_ago)).isoformat()
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": "colour", "version": 1,
         "payload": {"value": i % 3}, "time": time}
        for i in range(count)
    ]  # fmt: skip
    result = service.ingest(ReportBatch.model_validate({"reports": reports}), now=now)
    assert result.accepted == count


def counts(estimate: dict[str, Any]) -> tuple[object, ...]:
    return (estimate["n"], estimate["suppressed_reports"], estimate["pending_reports"])


def only_step(series: dict[str, Any]) -> dict[str, Any]:
    (step,) = series["steps"]
    return step  # type: ignore[no-any-return]


def test_the_current_bucket_below_the_threshold_is_pending(service: Aggregator) -> None:
    send(service, 12, hours_ago=2)  # released
    send(service, 3, hours_ago=1)  # closed and small: suppressed, not pending
    send(service, 4, hours_ago=0)  # the current hour, still filling
    assert counts(service.estimate("colour", now=NOW)) == (12, 7, 4)
    # A window that ends before the current hour has nothing pending.
    assert counts(service.estimate("colour", end=HOUR, now=NOW)) == (12, 3, 0)
    # Once the current hour reaches the threshold, its reports are released.
    send(service, MIN_REPORTS - 4, hours_ago=0)
    assert counts(service.estimate("colour", now=NOW)) == (22, 3, 0)
    # An hour later the same bucket is closed: a small one there is no longer pending.
    later = NOW + timedelta(hours=1)
    send(service, 2, hours_ago=-1, now=later)
    assert counts(service.estimate("colour", now=later)) == (22, 5, 2)
    assert counts(service.estimate("colour", now=later + timedelta(hours=1))) == (22, 5, 0)


def test_a_series_step_says_what_is_pending(service: Aggregator) -> None:
    send(service, 12, hours_ago=0)
    send(service, 3, hours_ago=0)
    send(service, 5, hours_ago=1)
    step = only_step(service.series("colour", "1d", start=HOUR - timedelta(hours=2), now=NOW))
    assert step["n"] == 20
    assert counts(step["estimate"]) == (15, 5, 0)  # the day's current hour is released
    later = NOW + timedelta(hours=1)
    send(service, 4, hours_ago=-1, now=later)
    step = only_step(service.series("colour", "1d", start=HOUR - timedelta(hours=2), now=later))
    assert counts(step["estimate"]) == (15, 9, 4)


def test_a_refusal_for_want_of_reports_names_the_pending_ones(service: Aggregator) -> None:
    send(service, 3, hours_ago=1)
    send(service, 4, hours_ago=0)
    with pytest.raises(NotEnoughReportsError) as refused:
        service.estimate("colour", now=NOW)
    assert (refused.value.n, refused.value.pending) == (7, 4)
    message = str(refused.value)
    assert "4 of them in the current time bucket, which is still filling" in message
    assert f"released once it holds {MIN_REPORTS}" in message
    with pytest.raises(NotEnoughReportsError) as closed:
        service.estimate("colour", end=HOUR, now=NOW)
    assert closed.value.pending == 0 and "current time bucket" not in str(closed.value)


def test_the_field_is_documented(tmp_path: Path) -> None:
    settings = Settings(database=str(tmp_path / "doc.sqlite3"), compaction_interval=0)
    schemas = create_app(settings).openapi()["components"]["schemas"]
    for model in ("CategoricalEstimateOut", "NumericEstimateOut", "StringEstimateOut"):
        field = schemas[model]["properties"]["pending_reports"]
        assert field["type"] == "integer" and "still filling" in field["description"]
        assert "pending_reports" in schemas[model]["required"]
