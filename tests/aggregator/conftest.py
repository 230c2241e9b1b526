"""Fixtures of the aggregator tests: databases (SQLite and PostgreSQL) and server processes.

``database_url`` runs a test once on a fresh SQLite file and once on PostgreSQL, in a
schema of its own (``search_path``) that is dropped afterwards. PostgreSQL is found at
``LDP_TEST_POSTGRES`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``);
where none answers, the PostgreSQL cases skip and say why.

``start_server(...)`` runs a real ``ldp-aggregator serve`` process on a free loopback
port and returns a ``ServerProcess`` (``tests.support.AggregatorProcess``: base URL,
keys, ``kill()``, ``stop()``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support import POSTGRES_URL, postgres_problem
from tests.support import AggregatorProcess as ServerProcess

ADMIN_KEY = "test-admin-key-0123456789"
ANALYST_KEY = "test-analyst-key-0123456789"
DEVICE_KEY = "test-device-key-0123456789"


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


KEYS = {"admin": ADMIN_KEY, "analyst": ANALYST_KEY, "device": DEVICE_KEY}


def launch_server(
    database: str,
    log_path: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> ServerProcess:
    """Start ``ldp-aggregator serve`` and wait until ``/healthz`` answers."""
    return ServerProcess(database, log_path, KEYS, args, port=port, env=env).start(timeout)


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
