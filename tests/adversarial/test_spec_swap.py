"""Attack: change a metric's spec under the same name and version, and read the memo twice.

A memoized mechanism answers a value from a permanent response drawn once from the device
secret. A device that keyed that randomness and its lifetime charges by (metric,
version) alone would, when a server serves ``m`` version 1 as ``lgrr`` epsilon 0.5 and
later as ``lgrr`` epsilon 20, compare the same permanent words against a new threshold
and charge nothing new: wherever the two permanent responses differ, the epsilon-20 one
is the true value, while the ledger still reads 0.5. The defence (``client/ledger.py``,
``shared/spec_hash.py``): the device pins each (name, version)'s spec hash on first use
and refuses another spec there (``SpecChangedError``, nothing spent or queued), and its
memo scopes, RAPPOR secrets and ledger keys derive from the spec hash, so two specs
never share randomness and their charges add up.

* A hostile fake server (``httpx.MockTransport``) swaps the spec under version 1: refused,
  in the running client and after a restart, for a raise (0.5 to 20) and a smaller change
  (0.5 to 2) alike; the same change published as version 2 is accepted and charged anew.
* Two specs' permanent responses are independent (chi-square over 2,000 device secrets),
  where the name-and-version scope read one memo twice; their ledger keys differ.
* A real aggregator whose database is recreated restarts its versions at 1: an honest
  redefinition under version 1 is refused too, an unchanged metric is not, and versions
  past the device's are accepted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from scipy import stats

from client import BudgetLimits, SpecChangedError, SpecError, TelemetryClient
from client.ledger import PrivacyLedger
from shared.mechanisms import make_mechanism
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.memoized import memo_key_bytes
from shared.memo import KeyedMemo, memo_scope, spec_scope
from shared.schemas import MetricSpec
from shared.spec_hash import spec_hash
from simulations.server import Server

DAY = 86_400.0
#: Deadline for the background refresh of the specs (reached only if it hangs).
PATIENCE = 20.0
#: False-failure rate of each statistical check.
P_FLOOR = 1e-6
#: Limits that let every spec below through on its own, so that only the pin refuses.
ROOMY = BudgetLimits(
    per_metric_per_period=100.0,
    total_per_period=100.0,
    max_epsilon_per_report=20.0,
    max_value_lifetime_epsilon=20.0,
    period_seconds=DAY,
)
LABELS = ["north", "east", "south", "west"]


def lgrr(epsilon: float, epsilon_report: float) -> dict[str, Any]:
    return {
        "mechanism": "lgrr",
        "epsilon": epsilon,
        "epsilon_report": epsilon_report,
        "domain_size": len(LABELS),
    }


MODEST, GREEDY, MIDDLE = lgrr(0.5, 0.25), lgrr(20.0, 0.4), lgrr(2.0, 1.0)


def metric(mechanism: dict[str, Any], version: int = 1) -> dict[str, Any]:
    """``m`` as ``GET /v1/metrics`` lists it."""
    return {
        "name": "m",
        "version": version,
        "description": "the way the device faces",
        "mechanism": mechanism,
        "labels": LABELS,
    }


class SwappingServer:
    """Serves whatever ``metrics`` holds now, and accepts every batch."""

    def __init__(self, metrics: list[dict[str, Any]]) -> None:
        self.metrics = metrics
        self.fetches = 0
        self.reports: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/metrics":
            self.fetches += 1
            return httpx.Response(200, json=self.metrics)
        if request.method == "POST" and request.url.path == "/v1/reports":
            batch = json.loads(request.content)["reports"]
            self.reports.extend(batch)
            return httpx.Response(200, json={"accepted": len(batch), "duplicates": 0})
        return httpx.Response(404)

    def swap(self, metrics: list[dict[str, Any]]) -> None:
        """Serve ``metrics`` from now on, and wait until a whole refresh has fetched them."""
        self.metrics = metrics
        fetched = self.fetches
        deadline = time.monotonic() + PATIENCE
        while self.fetches < fetched + 2:
            assert time.monotonic() < deadline, "the device never refreshed its specs"
            time.sleep(0.01)


@pytest.fixture
def clients() -> Iterator[list[TelemetryClient]]:
    opened: list[TelemetryClient] = []
    yield opened
    for client in opened:
        client.close(timeout=0.1)


def open_client(
    server: SwappingServer, state: Path, clients: list[TelemetryClient]
) -> TelemetryClient:
    clients.append(
        TelemetryClient(
            "http://hostile.test",
            "device-key",
            state,
            limits=ROOMY,
            transport=httpx.MockTransport(server.handle),
            upload_interval=0.02,  # the uploader's tick refreshes the specs
            spec_refresh_seconds=0.0,
            batch_size=1_000,
        )
    )
    return clients[-1]


@pytest.mark.parametrize("changed", [GREEDY, MIDDLE], ids=["epsilon 20", "epsilon 2"])
def test_a_spec_changed_under_its_version_is_refused(
    tmp_path: Path, clients: list[TelemetryClient], changed: dict[str, Any]
) -> None:
    server = SwappingServer([metric(MODEST)])
    client = open_client(server, tmp_path, clients)
    client.record("m", "south")
    assert client.budget().spent_lifetime == 0.5

    server.swap([metric(changed)])
    epsilon = f"{changed['epsilon']:g}"
    for attempt in range(2):  # the running client, then a restarted one
        with pytest.raises(SpecChangedError) as refused:
            client.record("m", "south")
        message = str(refused.value)
        assert (
            f"m version 1 is now served with a different spec (epsilon 0.5 -> {epsilon}" in message
        )
        assert "nothing was spent or queued" in message and "new version" in message
        assert isinstance(refused.value, SpecError)  # what apps already catch
        status = client.budget()
        assert (status.spent_lifetime, status.spent_per_metric) == (0.5, {"m": 0.25})
        assert client.queued + len(server.reports) == 1
        if attempt == 0:
            client.close(timeout=5.0)
            client = open_client(server, tmp_path, clients)

    # Published as a new version, the change is accepted and charged on its own: 0.5 + new.
    server.swap([metric(changed, version=2)])
    client.record("m", "south")
    assert client.budget().spent_lifetime == 0.5 + changed["epsilon"]


def test_two_specs_never_share_memo_randomness_or_ledger_keys(tmp_path: Path) -> None:
    """``m`` version 1 as epsilon 0.5 and as epsilon 2: different spec hashes, memo scopes
    and ledger keys. Over 2,000 device secrets, the permanent responses of one value under
    the two specs are independent: their 4 x 4 table fits the product of the two permanent
    laws (chi-square, P_FLOOR; every cell expected 40 or more), and where they differ the
    epsilon-2 response is the true value in about 0.67 of the devices, as independence
    gives (the share is Binomial around it: 0.9 is more than 15 standard deviations away,
    a false-failure rate below 1e-50). The name-and-version scope the device used before
    fails both checks: one memo read against two thresholds (the same table's p-value
    below P_FLOOR, and the epsilon-2 response true wherever they differ)."""
    modest, middle = (
        MetricSpec.model_validate(metric(MODEST)),
        MetricSpec.model_validate(metric(MIDDLE)),
    )
    first, second = spec_hash(modest), spec_hash(middle)
    assert first != second and spec_scope(first) != spec_scope(second)
    ledger = PrivacyLedger(tmp_path, ROOMY)
    value = memo_key_bytes(2)
    assert ledger.value_key(first, value) != ledger.value_key(second, value)

    low, high = make_mechanism(modest.mechanism), make_mechanism(middle.mechanism)
    assert isinstance(low, LongitudinalGRR) and isinstance(high, LongitudinalGRR)
    devices, truth = 2_000, 2
    secrets = [os.urandom(32) for _ in range(devices)]
    values = np.full(devices, truth)

    def permanent_pair(scope_low: bytes, scope_high: bytes) -> tuple[np.ndarray, np.ndarray]:
        return (
            low.permanent(values, KeyedMemo(secrets, scope_low)),
            high.permanent(values, KeyedMemo(secrets, scope_high)),
        )

    expected = devices * np.outer(low.permanent_matrix()[truth], high.permanent_matrix()[truth])
    assert expected.min() >= 40

    def check(pair: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
        table = np.zeros((4, 4))
        np.add.at(table, pair, 1)
        differ = pair[0] != pair[1]
        share = float(np.mean(pair[1][differ] == truth))
        return float(stats.chisquare(table.ravel(), expected.ravel()).pvalue), share

    pvalue, share = check(permanent_pair(spec_scope(first), spec_scope(second)))
    assert pvalue > P_FLOOR and share < 0.9
    old = memo_scope("m", 1)
    pvalue, share = check(permanent_pair(old, old))
    assert pvalue < P_FLOOR and share == 1.0


@pytest.mark.slow
def test_a_recreated_database_restarting_versions_is_refused_too(
    hostile_target: Callable[..., Server], tmp_path: Path
) -> None:
    """An honest aggregator loses its database: versions restart at 1. A metric defined
    again with the same spec is the same spec hash, still accepted; one defined with
    another spec lands on version 1 again and is refused. Defined until its version
    passes the device's, it is accepted."""
    state = tmp_path / "device"

    def define(server: Server, mechanism: dict[str, Any]) -> int:
        body = {"description": "the way the device faces", "mechanism": mechanism, "labels": LABELS}
        response = httpx.put(
            f"{server.url}/v1/metrics/m", json=body, headers=server.headers("admin")
        )
        response.raise_for_status()
        return int(response.json()["version"])

    def device(server: Server) -> TelemetryClient:
        return TelemetryClient(server.url, server.keys["device"], state, limits=ROOMY)

    before = hostile_target()
    assert define(before, MODEST) == 1
    with device(before) as client:
        client.record("m", "east")
        client.record("app.theme", "dark")  # a demo metric, defined by every new database
        assert client.flush(timeout=30.0)
    before.stop()

    after = hostile_target()  # a new database file: versions restart
    assert define(after, MIDDLE) == 1
    with device(after) as client:
        client._specs.refresh(force=True)  # what its next scheduled refresh does
        client.record("app.theme", "dark")  # same spec as before: accepted
        with pytest.raises(SpecChangedError, match="database was recreated.*past 1"):
            client.record("m", "east")
        assert client.budget().spent_lifetime == 0.5 + 2 * 2.0  # app.theme: grr 2, twice
        assert define(after, MODEST) == 2  # the admin redefines past the device's version
        client._specs.refresh(force=True)
        client.record("m", "east")
        assert client.budget().spent_lifetime == 4.5 + 0.5
