"""Metric specs on the device: fetched, cached on disk, usable offline, refused when unsafe.

``SpecCache`` is driven directly with a fetch function; ``TelemetryClient`` against a
fake aggregator behind ``httpx.MockTransport`` that serves ``GET /v1/metrics`` and
accepts ``POST /v1/reports``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import BudgetLimits, SpecError, TelemetryClient
from client.specs import SPECS_FILE, SpecCache
from shared.spec_hash import spec_hash

#: Deadline for waiting on the background thread (reached only if it hangs).
PATIENCE = 20.0
RAPPOR = {"mechanism": "rappor", "num_bits": 32, "num_hashes": 2, "num_cohorts": 8}


def metric(
    name: str, mechanism: dict[str, Any], labels: list[str] | None = None, version: int = 1
) -> dict[str, Any]:
    """A metric as ``GET /v1/metrics`` lists it."""
    return {
        "name": name,
        "version": version,
        "description": f"{name} for the tests",
        "mechanism": mechanism,
        "labels": labels,
    }


THEME = metric(
    "app.theme",
    {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3},
    ["light", "dark", "contrast"],
)


class FakeAggregator:
    """Serves ``metrics``; accepts and records report batches; raises when ``offline``."""

    def __init__(self, metrics: list[dict[str, Any]]) -> None:
        self.metrics = metrics
        self.offline = False
        self.metric_fetches = 0
        self.batches: list[list[dict[str, Any]]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.offline:
            raise httpx.ConnectError("no route to host", request=request)
        assert request.headers["authorization"] == "Bearer device-key"
        if request.method == "GET" and request.url.path == "/v1/metrics":
            self.metric_fetches += 1
            body = json.dumps(self.metrics)  # as Python writes it: NaN passes, as a bad server's
            return httpx.Response(200, text=body, headers={"content-type": "application/json"})
        if request.method == "POST" and request.url.path == "/v1/reports":
            reports = json.loads(request.content)["reports"]
            self.batches.append(reports)
            return httpx.Response(200, json={"accepted": len(reports), "duplicates": 0})
        return httpx.Response(404, json={"title": "not found", "status": 404})

    def client(self, state_dir: Path, **options: Any) -> TelemetryClient:
        options.setdefault("upload_interval", 3600.0)
        return TelemetryClient(
            "http://aggregator.test",
            "device-key",
            state_dir,
            transport=httpx.MockTransport(self.handle),
            **options,
        )


@pytest.fixture
def clients() -> Iterator[list[TelemetryClient]]:
    """Clients a test opens, closed afterwards (quickly, whatever is left queued)."""
    opened: list[TelemetryClient] = []
    yield opened
    for client in opened:
        client.close(timeout=0.1)


def nothing_spent_or_queued(client: TelemetryClient) -> None:
    status = client.budget()
    assert status.spent_lifetime == 0.0
    assert status.spent_per_metric == {}
    assert client.queued == 0


# --- SpecCache ---------------------------------------------------------------------------


def test_specs_are_fetched_once_and_cached_on_disk(tmp_path: Path) -> None:
    served = [THEME]
    fetches: list[int] = []

    def fetch() -> list[dict[str, Any]]:
        fetches.append(1)
        return served

    cache = SpecCache(tmp_path, fetch, refresh_seconds=3600.0)
    spec = cache.get("app.theme")
    assert (spec.name, spec.version, spec.labels) == ("app.theme", 1, ("light", "dark", "contrast"))
    assert spec.mechanism.mechanism == "grr" and spec.mechanism.epsilon == 1.0
    assert cache.get("app.theme") == spec
    assert len(fetches) == 1
    assert json.loads((tmp_path / SPECS_FILE).read_text()) == served

    assert cache.refresh() is True  # not due yet
    assert len(fetches) == 1
    assert cache.refresh(force=True) is True
    assert len(fetches) == 2


def test_offline_start_works_from_the_cache(tmp_path: Path) -> None:
    SpecCache(tmp_path, lambda: [THEME]).get("app.theme")

    def offline() -> list[dict[str, Any]]:
        raise httpx.ConnectError("offline")

    cache = SpecCache(tmp_path, offline)
    assert cache.get("app.theme").labels == ("light", "dark", "contrast")
    assert cache.refresh(force=True) is False
    assert cache.get("app.theme").version == 1
    with pytest.raises(SpecError, match="no metric"):
        cache.get("app.unknown")
    assert json.loads((tmp_path / SPECS_FILE).read_text()) == [THEME]  # kept


def test_refresh_installs_new_versions_when_due(tmp_path: Path) -> None:
    served = [THEME]
    cache = SpecCache(tmp_path, lambda: served, refresh_seconds=0.0)
    assert cache.get("app.theme").version == 1
    served = [metric("app.theme", {"mechanism": "oue", "epsilon": 0.5, "domain_size": 3}, None, 2)]
    assert cache.refresh() is True
    spec = cache.get("app.theme")
    assert (spec.version, spec.mechanism.mechanism, spec.labels) == (2, "oue", None)
    assert SpecCache(tmp_path, lambda: []).get("app.theme").version == 2  # on disk too


def test_each_spec_is_installed_with_its_hash(tmp_path: Path) -> None:
    """``get_hashed`` gives the spec and its ``spec_hash``, the same from the cache on disk."""
    cache = SpecCache(tmp_path, lambda: [THEME])
    spec, digest = cache.get_hashed("app.theme")
    assert digest == spec_hash(spec) and spec == cache.get("app.theme")
    assert SpecCache(tmp_path, lambda: []).get_hashed("app.theme") == (spec, digest)


# --- through TelemetryClient ---------------------------------------------------------------


def test_client_fetches_specs_and_records_offline_from_the_cache(
    tmp_path: Path, clients: list[TelemetryClient]
) -> None:
    aggregator = FakeAggregator([THEME])
    first = aggregator.client(tmp_path)
    clients.append(first)
    first.record("app.theme", "dark")
    assert aggregator.metric_fetches == 1
    assert (tmp_path / SPECS_FILE).exists()
    assert first.close(timeout=5.0) is True

    aggregator.offline = True
    offline = aggregator.client(tmp_path)
    clients.append(offline)
    offline.record("app.theme", "light")
    offline.record("app.theme", 2)
    assert offline.queued == 2
    assert offline.flush(timeout=0.2) is False  # nothing reaches the aggregator
    assert offline.close(timeout=0.1) is False

    aggregator.offline = False
    online = aggregator.client(tmp_path)
    clients.append(online)
    assert online.queued == 2  # waited in the outbox
    assert online.flush(timeout=5.0) is True
    assert [len(batch) for batch in aggregator.batches] == [1, 2]


def test_unknown_metric_is_refused(tmp_path: Path, clients: list[TelemetryClient]) -> None:
    aggregator = FakeAggregator([THEME])
    client = aggregator.client(tmp_path)
    clients.append(client)
    with pytest.raises(SpecError, match="app.missing"):
        client.record("app.missing", 1)
    with pytest.raises(SpecError, match="app.missing"):
        client.record_string("app.missing", "x")
    nothing_spent_or_queued(client)


UNVERIFIABLE = {
    "unknown mechanism": {"mechanism": "quantum", "epsilon": 1.0, "domain_size": 3},
    "no epsilon": {"mechanism": "grr", "domain_size": 3},
    "no domain size": {"mechanism": "grr", "epsilon": 1.0},
    "unknown parameter": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3, "boost": 2},
    "epsilon not a number": {"mechanism": "grr", "epsilon": math.nan, "domain_size": 3},
    "epsilon as text": {"mechanism": "grr", "epsilon": "lots", "domain_size": 3},
    "rappor epsilon that does not follow": {**RAPPOR, "f": 0.5, "p": 0.25, "q": 0.75, "epsilon": 1},
    "not an object": "grr",
}


@pytest.mark.parametrize("mechanism", UNVERIFIABLE.values(), ids=list(UNVERIFIABLE))
def test_unverifiable_spec_is_refused(
    tmp_path: Path, clients: list[TelemetryClient], mechanism: Any
) -> None:
    aggregator = FakeAggregator([metric("app.bad", mechanism), THEME])
    client = aggregator.client(tmp_path)
    clients.append(client)
    with pytest.raises(SpecError, match="app.bad.*cannot verify"):
        client.record("app.bad", 1)
    nothing_spent_or_queued(client)
    client.record("app.theme", "dark")  # the others are still usable
    assert client.queued == 1


def test_metric_with_a_nonsense_version_is_refused(
    tmp_path: Path, clients: list[TelemetryClient]
) -> None:
    bad = metric("app.bad", {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3}, version=0)
    client = FakeAggregator([bad]).client(tmp_path)
    clients.append(client)
    with pytest.raises(SpecError, match="app.bad"):
        client.record("app.bad", 1)
    nothing_spent_or_queued(client)


def test_labels_that_do_not_match_the_domain_are_refused(
    tmp_path: Path, clients: list[TelemetryClient]
) -> None:
    """Three labels for a two-category mechanism: the SDK cannot tell what a label means,
    so it refuses the spec before anything is spent (not, say, debit the budget and then
    fail in the mechanism on index 2 of a domain 0..1)."""
    bad = metric("app.bad", {"mechanism": "grr", "epsilon": 1.0, "domain_size": 2}, ["a", "b", "c"])
    client = FakeAggregator([bad]).client(tmp_path)
    clients.append(client)
    with pytest.raises(SpecError, match="app.bad"):
        client.record("app.bad", "c")
    nothing_spent_or_queued(client)


ABOVE_LIMITS = {
    "grr above the default 4": (
        {"mechanism": "grr", "epsilon": 5.0, "domain_size": 3},
        BudgetLimits(),
    ),
    "laplace above a strict device": (
        {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 10.0},
        BudgetLimits(max_epsilon_per_report=0.5),
    ),
    "rappor whose epsilon_one is above the default 4": (
        {**RAPPOR, "num_hashes": 8, "f": 0.2, "p": 0.25, "q": 0.75},
        BudgetLimits(),
    ),
}


@pytest.mark.parametrize("case", ABOVE_LIMITS, ids=list(ABOVE_LIMITS))
def test_spec_above_the_device_limit_is_refused(
    tmp_path: Path, clients: list[TelemetryClient], case: str
) -> None:
    mechanism, limits = ABOVE_LIMITS[case]
    client = FakeAggregator([metric("app.greedy", mechanism)]).client(tmp_path, limits=limits)
    clients.append(client)
    with pytest.raises(SpecError, match="app.greedy.*limit"):
        if mechanism["mechanism"] == "rappor":
            client.record_string("app.greedy", "example.com")
        else:
            client.record("app.greedy", 1)
    nothing_spent_or_queued(client)


def test_a_raised_epsilon_is_refused_once_the_specs_are_refreshed(
    tmp_path: Path, clients: list[TelemetryClient]
) -> None:
    aggregator = FakeAggregator([THEME])
    client = aggregator.client(tmp_path, upload_interval=0.02, spec_refresh_seconds=0.0)
    clients.append(client)
    client.record("app.theme", "dark")
    spent = client.budget().spent_lifetime

    greedy = {"mechanism": "grr", "epsilon": 9.0, "domain_size": 3}
    aggregator.metrics = [metric("app.theme", greedy, THEME["labels"], version=2)]
    fetched = aggregator.metric_fetches
    deadline = time.monotonic() + PATIENCE
    while aggregator.metric_fetches < fetched + 2:  # a whole refresh after the change
        assert time.monotonic() < deadline, "the specs were never refreshed"
        time.sleep(0.01)
    with pytest.raises(SpecError, match="version 2.*limit"):
        client.record("app.theme", "dark")
    assert client.budget().spent_lifetime == spent


def test_a_new_description_under_the_same_version_is_not_a_changed_spec(
    tmp_path: Path, clients: list[TelemetryClient]
) -> None:
    """The aggregator keeps a version when only the description changes, and may spell a
    default out: neither is a different spec, and the device keeps recording."""
    aggregator = FakeAggregator([THEME])
    client = aggregator.client(tmp_path)
    clients.append(client)
    client.record("app.theme", "dark")
    aggregator.metrics = [
        {**THEME, "description": "reworded", "mechanism": {**THEME["mechanism"], "epsilon": 1}}
    ]
    client.close(timeout=5.0)
    (tmp_path / SPECS_FILE).unlink()  # fetch the new list at the next start
    restarted = aggregator.client(tmp_path)
    clients.append(restarted)
    restarted.record("app.theme", "light")
    assert restarted.budget().spent_lifetime == 2.0
