"""PostgreSQL behind a loopback TCP proxy the test controls: a partition, a reset, a lost commit.

A real ``ldp-aggregator serve`` process reaches PostgreSQL (127.0.0.1:5432 or
``LDP_TEST_POSTGRES``; a fresh schema per test, skipped where none answers) only through
a ``TcpProxy`` (``simulations/tcp_proxy.py``), with its default database timeout.
While the proxy black-holes or resets every connection, a batch must be answered, in
bounded time, with 503 and ``Retry-After`` (never a hang, never an acknowledgement), and
``/healthz`` must answer 503 too; once the database is back the same batch must be
stored. When a commit's answer is lost (the server committed, the reply never came) the
batch gets 503, and sent again it is counted once, as a duplicate. In every case the
estimate counts each report acknowledged exactly once.

The bounds below are liveness bounds for a service that recovers by itself (its waits
are a few database timeouts of 5 s), not performance targets; the recovery time is
measured by ``simulations/benchmarks/partition.py``.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from simulations.server import Server, start_server
from simulations.tcp_proxy import TcpProxy
from tests.support import POSTGRES_URL, postgres_problem

pytestmark = pytest.mark.slow

METRIC, VERSION, DOMAIN = "app.theme", 1, 3  # a demo metric: GRR over three categories
#: Longest any one request may take: a few database timeouts (5 s each), generously.
ANSWER_BOUND = 60.0
#: Longest the service may take to store a batch again once the database is back.
RECOVERY_BOUND = 60.0


@dataclass
class Ledger:
    """The report ids sent and what the service acknowledged."""

    ids: set[str] = field(default_factory=set)
    accepted: int = 0

    def batch(self, size: int) -> list[dict[str, Any]]:
        reports: list[dict[str, Any]] = [
            {
                "report_id": str(uuid.uuid4()),
                "metric": METRIC,
                "version": VERSION,
                "payload": {"value": index % DOMAIN},
            }
            for index in range(size)
        ]
        self.ids.update(report["report_id"] for report in reports)
        return reports


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[TcpProxy, Server]]:
    """A proxy in front of PostgreSQL, and the service on a fresh schema through it."""
    problem = postgres_problem()
    if problem is not None:
        pytest.skip(problem)
    url = make_url(POSTGRES_URL)
    admin = create_engine(url, connect_args={"connect_timeout": 3})
    schema = f"t_{secrets.token_hex(6)}"
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    proxy = TcpProxy(url.port or 5432, url.host or "127.0.0.1")
    through = url.set(port=proxy.port).update_query_dict({"options": f"-csearch_path={schema}"})
    database = through.render_as_string(hide_password=False)
    server = None
    try:
        server = start_server(database, tmp_path, extra=("--compaction-interval", "0"))
        yield proxy, server
    finally:
        if server is not None:
            server.stop()
        proxy.close()
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def post(server: Server, reports: list[dict[str, Any]]) -> httpx.Response:
    """One POST of a batch; a hang past ``ANSWER_BOUND`` fails the test."""
    try:
        return httpx.post(
            f"{server.url}/v1/reports",
            json={"reports": reports},
            headers=server.headers("device"),
            timeout=ANSWER_BOUND,
        )
    except httpx.TimeoutException:
        pytest.fail(f"a batch was not answered within {ANSWER_BOUND} s")


def deliver(server: Server, ledger: Ledger, reports: list[dict[str, Any]]) -> dict[str, int]:
    """Send the batch (the same ids each time) until acknowledged; its reply."""
    deadline = time.monotonic() + RECOVERY_BOUND
    while True:
        response = post(server, reports)
        if response.status_code == 200:
            reply: dict[str, int] = response.json()
            assert reply["accepted"] + reply["duplicates"] == len(reports)
            ledger.accepted += reply["accepted"]
            return reply
        assert_unavailable(response)
        assert time.monotonic() < deadline, "the batch was never stored after recovery"
        time.sleep(0.2)


def assert_unavailable(response: httpx.Response) -> dict[str, Any]:
    """503, ``storage-unavailable``, with a ``Retry-After`` of whole seconds."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert int(response.headers["retry-after"]) >= 1
    body: dict[str, Any] = response.json()
    assert body["type"] == "/problems/storage-unavailable"
    return body


def healthz(server: Server) -> httpx.Response:
    try:
        return httpx.get(f"{server.url}/healthz", timeout=ANSWER_BOUND)
    except httpx.TimeoutException:
        pytest.fail(f"/healthz was not answered within {ANSWER_BOUND} s")


def counted(server: Server) -> int:
    response = httpx.get(
        f"{server.url}/v1/metrics/{METRIC}/estimate",
        params={"version": VERSION},
        headers=server.headers("analyst"),
        timeout=ANSWER_BOUND,
    )
    assert response.status_code == 200, response.text
    return int(response.json()["n"])


def check_counted_once(server: Server, ledger: Ledger) -> None:
    """Every report acknowledged once and counted once: nothing lost, nothing twice."""
    assert ledger.accepted == len(ledger.ids)
    assert counted(server) == len(ledger.ids)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["blackhole", "reset"])
def test_a_partitioned_database_answers_503_then_recovers_by_itself(
    proxied: tuple[TcpProxy, Server], fault: str
) -> None:
    proxy, server = proxied
    ledger = Ledger()
    deliver(server, ledger, ledger.batch(50))

    getattr(proxy, fault)()
    stranded = ledger.batch(50)
    body = assert_unavailable(post(server, stranded))
    assert "send it again" in body["detail"]
    assert_unavailable(healthz(server))
    time.sleep(2.0)  # still down: a second batch is refused in bounded time as well
    later = ledger.batch(50)
    assert_unavailable(post(server, later))

    proxy.recover()
    recovered = time.monotonic()
    deliver(server, ledger, stranded)
    print(f"{fault}: stored again {time.monotonic() - recovered:.1f} s after recovery")
    deliver(server, ledger, later)
    assert healthz(server).status_code == 200
    check_counted_once(server, ledger)


def test_a_commit_whose_answer_is_lost_is_refused_and_counted_once_when_sent_again(
    proxied: tuple[TcpProxy, Server],
) -> None:
    proxy, server = proxied
    ledger = Ledger()
    deliver(server, ledger, ledger.batch(50))

    # The next transaction that inserts and commits has its commit made by the server
    # and the answer dropped: the service cannot know whether the batch is stored.
    proxy.lose_replies_after(b"INSERT 0 ", b"COMMIT\x00")
    ambiguous = ledger.batch(50)
    assert_unavailable(post(server, ambiguous))
    assert proxy.tripped.is_set()
    health = healthz(server)  # the database answers; the writer's last commit failed
    assert "writer cannot commit" in assert_unavailable(health)["detail"]

    reply = deliver(server, ledger, ambiguous)
    assert reply == {"accepted": 0, "duplicates": 50}  # it was committed the first time
    ledger.accepted += len(ambiguous)  # acknowledged now, as duplicates of that commit
    assert healthz(server).status_code == 200
    check_counted_once(server, ledger)
