"""Per-key report quotas: the repository's atomic reservation (SQLite and PostgreSQL,
concurrent writers) and the 429 over HTTP, with the per-key counters in /metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from aggregator.quotas import KeyQuotas, QuotaExceededError
from aggregator.repositories.availability import StorageUnavailableError
from aggregator.repositories.database import Database
from aggregator.repositories.quotas import KeyUsageRepository
from aggregator.settings import Settings
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from tests.aggregator.test_api import Api, assert_problem, hour, iso, reports, running

HOUR = 500_000
GRR = {"mechanism": "grr", "epsilon": 1.0, "domain_size": 4}
OUE = {"mechanism": "oue", "epsilon": 1.0, "domain_size": 64}


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


def sample(name: str, **labels: str) -> float:
    """A counter's value in the process's registry (0 before its first increment)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def key_ids(api: Api) -> dict[str, str]:
    """The device key ids by label."""
    listed = api.client.get("/v1/keys", headers=api.auth("admin")).json()
    return {entry["label"]: entry["key_id"] for entry in listed if entry["role"] == "device"}


def test_a_key_past_its_quota_is_answered_429_and_nothing_is_stored(quota_api: Api) -> None:
    assert quota_api.define("colour", GRR).status_code == 201
    (device,) = key_ids(quota_api).values()
    stamp = iso(hour(-1))
    offered = sample("ldp_reports_by_key_total", key=device)
    refusals = sample("ldp_quota_refusals_total", key=device, metric="colour")
    first = quota_api.post(reports("colour", 1, [{"value": 1}] * 3, stamp))
    assert first.json() == {"accepted": 3, "duplicates": 0}, first.text
    over = quota_api.post(reports("colour", 1, [{"value": 2}] * 3, stamp))
    body = assert_problem(over, 429, "quota-exceeded")
    assert body["title"] == "Too Many Requests"
    assert 1 <= int(over.headers["Retry-After"]) <= 3600
    assert f"device key {device} has sent 3 of its 5 reports of metric 'colour'" in body["detail"]
    assert quota_api.repositories.reports.report_count() == 3
    # another key has its own quota
    created = quota_api.client.post(
        "/v1/keys", json={"role": "device", "label": "other"}, headers=quota_api.auth("admin")
    ).json()
    other = {"Authorization": f"Bearer {created['key']}"}
    batch = {"reports": reports("colour", 1, [{"value": 3}] * 5, stamp)}
    assert quota_api.client.post("/v1/reports", json=batch, headers=other).status_code == 200
    # the rest of the first key's quota is still there
    assert quota_api.post(reports("colour", 1, [{"value": 0}] * 2, stamp)).status_code == 200
    assert quota_api.repositories.reports.report_count() == 10
    metrics = quota_api.client.get("/metrics", headers=quota_api.auth("admin")).text
    assert f'ldp_quota_refusals_total{{key="{device}",metric="colour"}}' in metrics
    assert f'ldp_reports_by_key_total{{key="{created["key_id"]}"}} 5.0' in metrics
    assert sample("ldp_reports_by_key_total", key=device) - offered == 5
    assert sample("ldp_quota_refusals_total", key=device, metric="colour") - refusals == 1


def test_a_batch_the_storage_fails_is_refunded(
    quota_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert quota_api.define("colour", GRR).status_code == 201
    stamp = iso(hour(-1))

    def unavailable(*_: object) -> None:
        raise StorageUnavailableError("the database is full", 1.0)

    with monkeypatch.context() as patch:
        patch.setattr(quota_api.repositories.reports, "ingest", unavailable)
        failed = quota_api.post(reports("colour", 1, [{"value": 1}] * 4, stamp))
        assert failed.status_code == 503 and "Retry-After" in failed.headers
    stored = quota_api.post(reports("colour", 1, [{"value": 1}] * 5, stamp))
    assert stored.json() == {"accepted": 5, "duplicates": 0}, stored.text  # all 5 are left


def test_forged_reports_are_counted_by_rule_in_metrics(quota_api: Api) -> None:
    assert quota_api.define("colour", OUE).status_code == 201
    mech = make_mechanism(MechanismSpec.model_validate(OUE))
    forged = mech.to_payloads(np.packbits(np.ones((2, 64), dtype=np.uint8), axis=1))
    before = sample("ldp_reports_refused_by_rule_total", metric="colour", rule="oue.ones_count")
    refused = quota_api.post(reports("colour", 1, forged, iso(hour(-1))))
    assert_problem(refused, 422)
    after = sample("ldp_reports_refused_by_rule_total", metric="colour", rule="oue.ones_count")
    assert after - before == 2
    # a refused batch takes nothing of the quota: 5 honest reports still fit
    honest = mech.to_payloads(mech.encode(np.arange(5), rng=np.random.default_rng(7)))
    assert quota_api.post(reports("colour", 1, honest, iso(hour(-1)))).status_code == 200


def test_the_quota_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="reports_per_key_per_hour"):
        Settings(reports_per_key_per_hour=-1)
    environ = {"LDP_REPORTS_PER_KEY_PER_HOUR": "1000"}
    assert Settings.from_environment(environ).reports_per_key_per_hour == 1000
    with pytest.raises(ValueError, match="LDP_REPORTS_PER_KEY_PER_HOUR='many'"):
        Settings.from_environment({"LDP_REPORTS_PER_KEY_PER_HOUR": "many"})
