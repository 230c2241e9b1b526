"""The metric catalog (``aggregator/catalog.py``): lookups that do not reload, change
detection across processes, and the cached public listing with ETag and 304.

Reloads are counted (``Catalog.reloads`` and calls of ``MetricsRepository.metrics``), never timed.
A batch that names thousands of unknown metrics must cost no reload at all (before, each
such report reread and reparsed every definition); a metric defined by another process
on the same database must still be seen once the refresh interval has passed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.catalog import Catalog
from aggregator.ingest import BatchRejected, prepare
from aggregator.service import Services
from aggregator.settings import Settings
from aggregator.storage import Repositories
from shared.schemas import MechanismSpec, MetricDefinition, ReportBatch

ADMIN_KEY = "catalog-admin-key-0123456789"
GRR3 = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})
#: The RAPPOR spec of the big metric (its labels are the candidate strings).
RAPPOR = MechanismSpec.model_validate(
    {
        "mechanism": "rappor",
        "num_bits": 32,
        "num_hashes": 1,
        "num_cohorts": 4,
        "f": 0.5,
        "p": 0.25,
        "q": 0.75,
    }
)


def grr(description: str = "", labels: tuple[str, ...] = ("a", "b", "c")) -> MetricDefinition:
    return MetricDefinition(description=description, mechanism=GRR3, labels=labels)


def counted(monkeypatch: pytest.MonkeyPatch, storage: object, method: str) -> list[int]:
    """Count the calls of ``storage.<method>`` (one list element per call)."""
    calls: list[int] = []
    original = getattr(storage, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(storage, method, wrapper)
    return calls


def batch_naming(names: list[tuple[str, int]]) -> ReportBatch:
    return ReportBatch.model_validate(
        {
            "reports": [
                {"report_id": str(uuid.uuid4()), "metric": m, "version": v, "payload": {}}
                for m, v in names
            ]
        }
    )


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    opened = Services.open(Settings(database=str(tmp_path / "catalog.sqlite3")))
    opened.aggregator.define("known", grr())
    yield opened
    opened.close()


def test_a_batch_of_unknown_metrics_reloads_nothing(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 reports naming 1,000 unknown metrics and an unknown version: no reload."""
    service = services.aggregator
    definitions = counted(monkeypatch, services.repositories.metrics, "metrics")
    reloads = service.catalog.reloads
    names = [(f"missing-{i % 1000}", 1) for i in range(1999)] + [("known", 7)]
    with pytest.raises(BatchRejected) as rejected:
        service.ingest(batch_naming(names))
    problems = rejected.value.problems
    assert len(problems) == 2000
    assert problems[0] == {"report": 0, "field": "metric", "message": "unknown metric 'missing-0'"}
    assert problems[-1] == {
        "report": 1999,
        "field": "version",
        "message": "metric 'known' has no version 7 (it has [1])",
    }
    assert definitions == [] and service.catalog.reloads == reloads
    assert services.repositories.reports.report_count() == 0


def test_lookups_read_the_stamp_at_most_once_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the interval, one batch checks the stamp once (the interval bounds the rest)."""
    storage = Repositories.open(str(tmp_path / "stamp.sqlite3"))
    try:
        storage.metrics.define_metric("known", grr())
        refresh = 0.5
        catalog = Catalog(storage.metrics, refresh_seconds=refresh)
        stamps = counted(monkeypatch, storage.metrics, "metrics_stamp")
        time.sleep(refresh)
        started = time.monotonic()
        with pytest.raises(BatchRejected):
            prepare(
                batch_naming([(f"missing-{i}", 1) for i in range(5000)]),
                catalog,
                3600,
                datetime.now(UTC),
            )
        elapsed = time.monotonic() - started
        # One check when the batch starts, and one more per interval the batch outlasts.
        assert 1 <= len(stamps) <= 1 + int(elapsed / refresh)
        assert catalog.reloads == 1  # the one at construction
    finally:
        storage.close()


def test_another_process_definitions_are_seen_within_the_interval(tmp_path: Path) -> None:
    """A second set of repositories on the same file (another process's view): new metrics, new
    versions and description changes reach the first catalog after ``refresh_seconds``."""
    database = str(tmp_path / "shared.sqlite3")
    mine, theirs = Repositories.open(database), Repositories.open(database)
    try:
        mine.metrics.define_metric("known", grr())
        refresh = 0.3
        catalog = Catalog(mine.metrics, refresh_seconds=refresh)
        listing = catalog.published_latest()
        theirs.metrics.define_metric("fresh", grr())
        theirs.metrics.define_metric("known", grr(labels=("x", "y", "z")))  # version 2
        time.sleep(refresh)
        assert catalog.get("fresh") is not None
        assert [m.version for m in catalog.versions("known")] == [1, 2]
        assert catalog.mechanism("known", 2) is not None
        assert catalog.reloads == 2
        assert catalog.published_latest().etag != listing.etag
        # A description alone changes the stamp too.
        theirs.metrics.define_metric("fresh", grr(description="now described"))
        time.sleep(refresh)
        fresh = catalog.get("fresh")
        assert fresh is not None and fresh.description == "now described"
        assert catalog.reloads == 3
        # Nothing changed: later lookups do not reload.
        time.sleep(refresh)
        assert catalog.get("fresh") is not None and catalog.reloads == 3
    finally:
        mine.close()
        theirs.close()


def test_known_versions_do_not_hold_back_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups of a known version never read the stamp, so the first report of a version
    defined elsewhere finds it as soon as the interval since the last check has passed."""
    database = str(tmp_path / "shared.sqlite3")
    mine, theirs = Repositories.open(database), Repositories.open(database)
    try:
        mine.metrics.define_metric("known", grr())
        refresh = 0.3
        catalog = Catalog(mine.metrics, refresh_seconds=refresh)
        stamps = counted(monkeypatch, mine.metrics, "metrics_stamp")
        time.sleep(refresh)
        assert all(catalog.mechanism("known", 1) is not None for _ in range(100))
        assert stamps == []
        theirs.metrics.define_metric("fresh", grr())
        assert catalog.mechanism("fresh", 1) is not None
        assert len(stamps) == 1 and catalog.reloads == 2
    finally:
        mine.close()
        theirs.close()


def test_the_change_stamp(database_url: str) -> None:
    """``metrics_stamp`` changes with a new version or description, not with a no-op."""
    storage = Repositories.open(database_url)
    try:
        first = storage.metrics.metrics_stamp()
        storage.metrics.define_metric("m", grr())
        defined = storage.metrics.metrics_stamp()
        storage.metrics.define_metric("m", grr())  # the same definition again
        assert storage.metrics.metrics_stamp() == defined != first
        storage.metrics.define_metric("m", grr(description="d"))
        described = storage.metrics.metrics_stamp()
        storage.metrics.define_metric("m", grr(labels=("p", "q", "r")))
        assert len({first, defined, described, storage.metrics.metrics_stamp()}) == 4
        assert storage.metrics.metrics_stamp()[1] == 2  # two versions
    finally:
        storage.close()
    reopened = Repositories.open(database_url)  # a restart keeps the stamp (and does not fail)
    try:
        assert reopened.metrics.metrics_stamp()[1] == 2
    finally:
        reopened.close()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, Services]]:
    app = create_app(Settings(database=str(tmp_path / "api.sqlite3"), compaction_interval=0))
    services: Services = app.state.services
    service = services.aggregator
    bootstrap_keys(app.state.keys, services.repositories.keys, {"LDP_ADMIN_KEYS": ADMIN_KEY})
    service.define("colour", grr())
    service.define(
        "site",
        MetricDefinition(
            description="", mechanism=RAPPOR, labels=tuple(f"c{i}.example" for i in range(2000))
        ),
    )
    with TestClient(app) as test_client:
        yield test_client, services


def test_the_listing_is_served_from_cache_with_an_etag(
    client: tuple[TestClient, Services], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, services = client
    service = services.aggregator
    definitions = counted(monkeypatch, services.repositories.metrics, "metrics")
    reloads = service.catalog.reloads
    first = api.get("/v1/metrics")
    second = api.get("/v1/metrics")
    assert first.status_code == second.status_code == 200
    assert first.content == second.content
    etag = first.headers["etag"]
    assert etag == second.headers["etag"] and etag.startswith('"')
    assert first.headers["cache-control"] == "public, no-cache"
    assert first.headers["content-type"] == "application/json"
    body = first.json()
    assert [m["name"] for m in body] == ["colour", "site"]
    assert body[0] == {
        "name": "colour",
        "version": 1,
        "description": "",
        "mechanism": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3},
        "labels": ["a", "b", "c"],
        "unit": None,
        "dimensions": None,
    }
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        cached = api.get("/v1/metrics", headers={"If-None-Match": header})
        assert cached.status_code == 304 and cached.content == b""
        assert cached.headers["etag"] == etag
    assert api.get("/v1/metrics", headers={"If-None-Match": '"other"'}).status_code == 200
    assert definitions == [] and service.catalog.reloads == reloads
    # A new metric: a new listing and tag, and the old tag no longer matches.
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert api.put("/v1/metrics/more", json=grr().model_dump(), headers=headers).status_code == 201
    changed = api.get("/v1/metrics", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert [m["name"] for m in changed.json()] == ["colour", "more", "site"]


def test_the_versions_of_a_metric_are_cached_too(
    client: tuple[TestClient, Services], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, services = client
    definitions = counted(monkeypatch, services.repositories.metrics, "metrics")
    first = api.get("/v1/metrics/site/versions")
    assert first.status_code == 200 and [m["version"] for m in first.json()] == [1]
    again = api.get("/v1/metrics/site/versions", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304
    missing = api.get("/v1/metrics/nothing/versions")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert definitions == []
