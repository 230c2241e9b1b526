"""Per-key report quotas: the repository's atomic reservation (SQLite and PostgreSQL,
concurrent writers) and the 429 over HTTP, with the per-key counters in /metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.quotas import KeyQuotas, QuotaExceededError
from aggregator.repositories.database import Database
from aggregator.repositories.quotas import KeyUsageRepository
from aggregator.settings import Settings
from tests.aggregator.test_api import Api, assert_problem, hour, iso, reports, running

HOUR = 500_000
GRR = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}


@pytest.fixture
def usage(database_url: str) -> Iterator[KeyUsageRepository]:
    database = Database(database_url)
    try:
        yield KeyUsageRepository(database)
    finally:
        database.close()


def test_a_reservation_fits_whole_or_changes_nothing(usage: KeyUsageRepository) -> None:
    assert usage.reserve("k1", {"a": 3, "b": 2}, HOUR, 5).fits
    verdict = usage.reserve("k1", {"a": 2, "b": 4}, HOUR, 5)  # a fits, b does not
    assert (verdict.metric, verdict.used, verdict.limit) == ("b", 2, 5)
    assert usage.usage("k1", HOUR) == {"a": 3, "b": 2}  # a's 2 were rolled back
    assert usage.reserve("k1", {"a": 2}, HOUR, 5).fits
    assert not usage.reserve("k1", {"a": 1}, HOUR, 5).fits
    assert usage.reserve("k2", {"a": 5}, HOUR, 5).fits  # another key, its own quota
    assert usage.reserve("k1", {"a": 5}, HOUR + 1, 5).fits  # the next hour starts afresh
    assert not usage.reserve("k3", {"a": 6}, HOUR, 5).fits  # one batch past it alone
    usage.refund("k1", {"a": 2}, HOUR)
    assert usage.usage("k1", HOUR)["a"] == 3
    assert usage.purge(HOUR + 1) == 3 and usage.usage("k1", HOUR) == {}  # k1 a, b; k2 a


def test_concurrent_reservations_never_pass_the_quota(usage: KeyUsageRepository) -> None:
    granted: list[bool] = []
    lock = threading.Lock()

    def reserve() -> None:
        for _ in range(10):
            fits = usage.reserve("busy", {"m": 3}, HOUR, 50).fits
            with lock:
                granted.append(fits)

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == 16  # floor(50 / 3) batches of 3, whatever the interleaving
    assert usage.usage("busy", HOUR) == {"m": 48}


def test_the_quota_error_says_when_it_resets(tmp_path: Path) -> None:
    database = Database(str(tmp_path / "q.sqlite3"))
    try:
        quotas = KeyQuotas(KeyUsageRepository(database), 2)
        quotas.reserve("k", {"m": 2}, now=HOUR * 3600 + 100.5)
        with pytest.raises(QuotaExceededError) as refused:
            quotas.reserve("k", {"m": 1}, now=HOUR * 3600 + 100.5)
        assert refused.value.retry_after == 3500  # whole seconds to the next hour
        assert "2 of its 2 reports of metric 'm'" in str(refused.value)
    finally:
        database.close()


@pytest.fixture
def quota_api(tmp_path: Path) -> Iterator[Api]:
    with running(str(tmp_path / "quota.sqlite3"), reports_per_key_per_hour=5) as service:
        yield service


def test_a_key_past_its_quota_is_answered_429_and_nothing_is_stored(quota_api: Api) -> None:
    assert quota_api.define("colour", GRR).status_code == 201
    stamp = iso(hour(-1))
    first = quota_api.post(reports("colour", 1, [{"value": 1}] * 3, stamp))
    assert first.json() == {"accepted": 3, "duplicates": 0}, first.text
    over = quota_api.post(reports("colour", 1, [{"value": 2}] * 3, stamp))
    body = assert_problem(over, 429, "quota-exceeded")
    assert 1 <= int(over.headers["Retry-After"]) <= 3600
    assert "3 of its 5 reports of metric 'colour'" in body["detail"]
    assert quota_api.repositories.reports.report_count() == 3
    # the rest of the quota is still there
    assert quota_api.post(reports("colour", 1, [{"value": 0}] * 2, stamp)).status_code == 200
    metrics = quota_api.client.get("/metrics", headers=quota_api.auth("admin")).text
    assert 'ldp_quota_refusals_total{key="' in metrics and 'metric="colour"' in metrics
    assert "ldp_reports_by_key_total{key=" in metrics


def test_the_quota_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="reports_per_key_per_hour"):
        Settings(reports_per_key_per_hour=-1)
