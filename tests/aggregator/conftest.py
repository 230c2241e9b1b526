"""Fixtures of the aggregator tests: databases (SQLite and PostgreSQL) and server processes.

``database_url`` runs a test once on a fresh SQLite file and once on PostgreSQL, in a
schema of its own (``search_path``) that is dropped afterwards. PostgreSQL is found at
``LDP_TEST_POSTGRES`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``);
where none answers, the PostgreSQL cases skip and say why.

``start_server(...)`` runs a real ``ldp-aggregator serve`` process on a free loopback
port and returns a ``ServerProcess`` (base URL, keys, ``kill()``, ``stop()``).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

POSTGRES_URL = os.environ.get(
    "LDP_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
ADMIN_KEY = "test-admin-key-0123456789"
ANALYST_KEY = "test-analyst-key-0123456789"
DEVICE_KEY = "test-device-key-0123456789"


def _postgres_problem() -> str | None:
    """None when PostgreSQL answers at POSTGRES_URL, else why not."""
    try:
        from sqlalchemy import create_engine, text

        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as error:  # noqa: BLE001 - any failure means "no server"
        return f"no PostgreSQL at {POSTGRES_URL}: {type(error).__name__}: {error}"
    return None


_POSTGRES_PROBLEM: list[str | None] = []


def postgres_problem() -> str | None:
    if not _POSTGRES_PROBLEM:
        _POSTGRES_PROBLEM.append(_postgres_problem())
    return _POSTGRES_PROBLEM[0]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL whose tables live in a fresh schema, dropped after the test."""
    problem = postgres_problem()
    if problem is not None:
        pytest.skip(problem)
    from sqlalchemy import create_engine, text

    schema = f"t_{secrets.token_hex(6)}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    separator = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database: a SQLite file, then a PostgreSQL schema."""
    if request.param == "sqlite":
        return str(tmp_path / "aggregator.sqlite3")
    return str(request.getfixturevalue("postgres_url"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A running ``ldp-aggregator serve`` process."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    keys: dict[str, str] = field(
        default_factory=lambda: {"admin": ADMIN_KEY, "analyst": ANALYST_KEY, "device": DEVICE_KEY}
    )

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def kill(self) -> None:
        """SIGKILL the whole process group: no shutdown, no flush."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM and wait (graceful shutdown); SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def launch_server(
    database: str,
    log_path: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> ServerProcess:
    """Start ``ldp-aggregator serve`` and wait until ``/healthz`` answers."""
    port = port or free_port()
    environment = {
        **os.environ,
        "LDP_ADMIN_KEYS": ADMIN_KEY,
        "LDP_ANALYST_KEYS": ANALYST_KEY,
        "LDP_DEVICE_KEYS": DEVICE_KEY,
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "aggregator.cli",
        "serve",
        "--database",
        database,
        "--port",
        str(port),
        *args,
    ]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"the server did not answer within {timeout} s:\n{server.log()}")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(database, *args, port=None, env=None)``; every server is stopped after."""
    started: list[ServerProcess] = []

    def start(database: str, *args: str, **options: object) -> ServerProcess:
        log_path = tmp_path / f"server-{len(started)}.log"
        server = launch_server(database, log_path, *args, **options)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
