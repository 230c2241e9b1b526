"""Fixtures of the client SDK tests: a real aggregator process over loopback HTTP.

``aggregator`` is a running ``python -m aggregator.cli serve`` process on a free loopback
port (``tests.support.AggregatorProcess``), with a fresh SQLite database,
``--min-reports 1`` and known device, analyst and admin keys. It can be killed with
SIGKILL (``kill()``) and started again on the same port and database (``start()``),
which is what the crash and fault tests need. ``make_aggregator()`` builds
one that is not started yet (an aggregator that is down when the devices start). Every
process is stopped after the test.

Test modules reach these helpers through the fixtures (test files are imported in
``importlib`` mode, so they cannot import this module; what they share is in
``tests.support``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client.outbox import Outbox
from tests.support import AggregatorProcess as ServerProcess

KEYS = {
    "admin": "client-tests-admin-key-0123456789",
    "analyst": "client-tests-analyst-key-0123456789",
    "device": "client-tests-device-key-0123456789",
}
ARGS = ("--min-reports", "1", "--log-level", "warning")
#: Thousands of simulated devices share one device key: its rate limit would only slow
#: the tests down (429 handling has a test of its own, with a proxy).
ENV = {"LDP_RATE_LIMIT_PER_SECOND": "100000", "LDP_RATE_LIMIT_BURST": "100000"}


class AggregatorProcess(ServerProcess):
    """The support module's server with the client tests' settings and API helpers."""

    def __init__(self, database: Path, log_path: Path, port: int | None = None) -> None:
        super().__init__(database, log_path, KEYS, ARGS, port=port, env=ENV)

    # --- API helpers ----------------------------------------------------------------------

    def metrics(self) -> list[dict[str, Any]]:
        """``GET /v1/metrics``: the public metric specs."""
        response = httpx.get(f"{self.url}/v1/metrics", timeout=30.0)
        assert response.status_code == 200, response.text
        return list(response.json())

    def define(self, name: str, definition: dict[str, Any]) -> dict[str, Any]:
        """``PUT /v1/metrics/{name}`` as the admin; returns the stored metric."""
        response = httpx.put(
            f"{self.url}/v1/metrics/{name}",
            json=definition,
            headers=self.headers("admin"),
            timeout=30.0,
        )
        assert response.status_code in (200, 201), response.text
        return dict(response.json())

    def estimate(self, metric: str, version: int | None = None) -> httpx.Response:
        """``GET /v1/metrics/{metric}/estimate`` as the analyst."""
        params = {} if version is None else {"version": version}
        return httpx.get(
            f"{self.url}/v1/metrics/{metric}/estimate",
            params=params,
            headers=self.headers("analyst"),
            timeout=60.0,
        )

    def count(self, metric: str, version: int | None = None) -> int:
        """Reports counted for a metric version (``--min-reports 1``: a 409 means none)."""
        response = self.estimate(metric, version)
        if response.status_code == 409:
            assert "holds 0 reports" in response.json()["detail"], response.text
            return 0
        assert response.status_code == 200, response.text
        return int(response.json()["n"])

    def prometheus(self) -> str:
        """The ``/metrics`` exposition (counters restart with the process)."""
        return httpx.get(f"{self.url}/metrics", timeout=30.0).text


@pytest.fixture
def make_aggregator(tmp_path: Path) -> Iterator[Callable[..., AggregatorProcess]]:
    """``make_aggregator(port=None)``: an aggregator on a fresh database, not started yet.
    Every one is stopped after the test."""
    made: list[AggregatorProcess] = []

    def make(port: int | None = None) -> AggregatorProcess:
        index = len(made)
        server = AggregatorProcess(
            tmp_path / f"aggregator-{index}.sqlite3", tmp_path / f"aggregator-{index}.log", port
        )
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def aggregator(make_aggregator: Callable[..., AggregatorProcess]) -> AggregatorProcess:
    """A running aggregator (demo metrics, ``--min-reports 1``) on a fresh database."""
    return make_aggregator().start()


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[Outbox]:
    """An outbox in the test's own directory, closed afterwards."""
    box = Outbox(tmp_path)
    yield box
    box.close()
