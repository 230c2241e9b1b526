"""Fixtures of the client SDK tests: a real aggregator process over loopback HTTP.

``aggregator`` is a running ``python -m aggregator.cli serve`` process on a free loopback
port, with a fresh SQLite database, ``--min-reports 1`` and known device, analyst and
admin keys (``LDP_DEVICE_KEYS`` / ``LDP_ANALYST_KEYS`` / ``LDP_ADMIN_KEYS``). It can be
killed with SIGKILL (``kill()``) and started again on the same port and database
(``start()``), which is what the crash and fault tests need. ``make_aggregator()`` builds
one that is not started yet (an aggregator that is down when the devices start). Every
process is stopped after the test.

Test modules reach these helpers only through the fixtures (test files are imported in
``importlib`` mode, so they cannot import this module).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

#: The repository root: servers started here run the checked-out code.
ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "admin": "client-tests-admin-key-0123456789",
    "analyst": "client-tests-analyst-key-0123456789",
    "device": "client-tests-device-key-0123456789",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class AggregatorProcess:
    """One ``aggregator.cli serve`` on a fixed port and database, started and killed at will."""

    def __init__(self, database: Path, log_path: Path, port: int | None = None) -> None:
        self.database = database
        self.log_path = log_path
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = dict(KEYS)
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # --- life cycle ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> AggregatorProcess:
        """Start the server (same port, same database) and wait until ``/healthz`` is 200."""
        if self.running:
            raise RuntimeError("the aggregator is already running")
        environment = {
            **{k: v for k, v in os.environ.items() if not k.startswith("LDP_")},
            "LDP_ADMIN_KEYS": self.keys["admin"],
            "LDP_ANALYST_KEYS": self.keys["analyst"],
            "LDP_DEVICE_KEYS": self.keys["device"],
            # Thousands of simulated devices share one device key: its rate limit would
            # only slow the tests down (429 handling has a test of its own, with a proxy).
            "LDP_RATE_LIMIT_PER_SECOND": "100000",
            "LDP_RATE_LIMIT_BURST": "100000",
        }
        environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
        command = [
            sys.executable,
            "-m",
            "aggregator.cli",
            "serve",
            "--database",
            str(self.database),
            "--port",
            str(self.port),
            "--min-reports",
            "1",
            "--log-level",
            "warning",
        ]
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=ROOT,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the aggregator exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the aggregator did not answer within {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the server's process group: no graceful shutdown, nothing flushed."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (graceful shutdown), SIGKILL after 30 s."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> AggregatorProcess:
        """Kill -9 and start again on the same port and database."""
        self.kill()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- API helpers ----------------------------------------------------------------------

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

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
