"""Fixtures of the adversarial tests: a real ``ldp-aggregator serve`` to attack.

``hostile_target(*extra)`` starts the service on a free loopback port
(``simulations.server.start_server``: fresh admin, analyst and device keys, SQLite in
the test's directory, ``--min-reports 1`` unless ``extra`` says otherwise) and stops it
when the test ends. The tests in this directory each reproduce one attack, by a
malicious device or a malicious server, and assert that it no longer works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simulations.server import Server, start_server


@pytest.fixture
def hostile_target(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*extra: str) -> Server:
        server = start_server(str(tmp_path / f"target-{len(servers)}.db"), tmp_path, extra=extra)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
