"""Exactly once under crashes: kill -9 the aggregator while devices upload, repeatedly.

Client threads upload batches of reports with fresh ids and retry each batch, with the
same ids, on any connection error or 5xx until it is acknowledged, the way the device
SDK's outbox does. Meanwhile the test SIGKILLs the server at seeded random moments and
restarts it on the same port and database. Afterwards every batch has been
acknowledged, so the number of reports counted must equal the number of distinct
report ids sent: exactly, with nothing lost and nothing counted twice. The second test
does the same with two aggregator processes sharing one PostgreSQL database, some
batches sent to both at once.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from aggregator.storage import Repositories

StartServer = Callable[..., Any]

METRIC, VERSION, DOMAIN = "app.theme", 1, 3  # a demo metric: GRR over three categories
#: Server options: estimates from one report on, compaction often (so kills hit it too),
#: and no rate limit in the way of the uploaders.
SERVER_ARGS = ("--min-reports", "1", "--compaction-interval", "0.3")
SERVER_ENV = {"LDP_RATE_LIMIT_PER_SECOND": "1000000", "LDP_RATE_LIMIT_BURST": "1000000"}
#: Longest a batch may take to be acknowledged before the test gives up on it.
DELIVERY_DEADLINE = 120.0


@dataclass
class Uploads:
    """What the uploader threads sent and what the servers acknowledged."""

    ids: set[str] = field(default_factory=set)
    replies: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    retries: int = 0
    failures: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Uploaders:
    """Threads that upload batches until stopped, each batch retried until acknowledged.

    ``route(rng)`` picks the base URLs a batch goes to: one, or several (the same batch,
    sent to each at once). A failed attempt is retried at the next URL of ``failover``.
    """

    def __init__(
        self,
        failover: list[str],
        headers: dict[str, str],
        route: Callable[[random.Random], list[str]],
        threads: int = 4,
        batch_size: int = 250,
        seed: int = 0,
    ) -> None:
        self.failover, self.headers, self.route = failover, headers, route
        self.batch_size = batch_size
        self.uploads = Uploads()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(seed + i,), daemon=True)
            for i in range(threads)
        ]

    def __enter__(self) -> Uploads:
        for thread in self.threads:
            thread.start()
        return self.uploads

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=DELIVERY_DEADLINE + 30)
            assert not thread.is_alive(), "an uploader never got its batch acknowledged"

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            with httpx.Client(headers=self.headers, timeout=30.0) as client:
                while not self.stopping.is_set():
                    reports: list[dict[str, Any]] = [
                        {
                            "report_id": str(uuid.uuid4()),
                            "metric": METRIC,
                            "version": VERSION,
                            "payload": {"value": rng.randrange(DOMAIN)},
                        }
                        for _ in range(self.batch_size)
                    ]
                    with self.uploads.lock:
                        self.uploads.ids.update(r["report_id"] for r in reports)
                    targets = self.route(rng)
                    extra = [
                        threading.Thread(target=self._deliver, args=(reports, url, None))
                        for url in targets[1:]
                    ]
                    for thread in extra:
                        thread.start()
                    self._deliver(reports, targets[0], client)
                    for thread in extra:
                        thread.join()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            with self.uploads.lock:
                self.uploads.failures.append(error)

    def _deliver(
        self, reports: list[dict[str, Any]], url: str, client: httpx.Client | None
    ) -> None:
        """POST the batch until a server acknowledges it; retries keep the same ids."""
        try:
            if client is None:
                with httpx.Client(headers=self.headers, timeout=30.0) as own:
                    self._post_until_acknowledged(own, reports, url)
            else:
                self._post_until_acknowledged(client, reports, url)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            with self.uploads.lock:
                self.uploads.failures.append(error)

    def _post_until_acknowledged(
        self, client: httpx.Client, reports: list[dict[str, Any]], url: str
    ) -> None:
        deadline = time.monotonic() + DELIVERY_DEADLINE
        while True:
            assert time.monotonic() < deadline, "a batch was never acknowledged"
            try:
                response = client.post(f"{url}/v1/reports", json={"reports": reports})
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 200:
                with self.uploads.lock:
                    self.uploads.replies.append((len(reports), response.json()))
                return
            if response is not None and response.status_code < 500:
                raise AssertionError(f"{response.status_code}: {response.text}")
            with self.uploads.lock:
                self.uploads.retries += 1
            url = self.failover[(self.failover.index(url) + 1) % len(self.failover)]
            time.sleep(0.05)


def counted(server: Any) -> int:
    response = httpx.get(
        f"{server.url}/v1/metrics/{METRIC}/estimate",
        params={"version": VERSION},
        headers=server.headers("analyst"),
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    return int(response.json()["n"])


def port_of(server: Any) -> int:
    return int(server.url.rsplit(":", 1)[1])


def check_exactly_once(uploads: Uploads, kills: int) -> None:
    """Every reply is whole, and the crashes did hit uploads in progress."""
    assert not uploads.failures, uploads.failures
    for size, reply in uploads.replies:
        assert reply["accepted"] + reply["duplicates"] == size
    # Each report is accepted by exactly one commit, and a reply reports only its own.
    assert sum(reply["accepted"] for _, reply in uploads.replies) <= len(uploads.ids)
    assert uploads.retries >= kills, "the kills never interrupted an upload"


@pytest.mark.slow
def test_kill_9_loses_and_double_counts_nothing(start_server: StartServer, tmp_path: Path) -> None:
    database = str(tmp_path / "faults.sqlite3")
    server = start_server(database, *SERVER_ARGS, env=SERVER_ENV)
    port = port_of(server)
    chaos = random.Random(2026)
    kills = 5
    url = server.url
    with Uploaders([url], server.headers("device"), lambda _: [url]) as uploads:
        for _ in range(kills):
            time.sleep(chaos.uniform(0.3, 1.0))
            server.kill()
            time.sleep(chaos.uniform(0.0, 0.3))
            server = start_server(database, *SERVER_ARGS, port=port, env=SERVER_ENV)
        time.sleep(0.5)
    check_exactly_once(uploads, kills)
    assert len(uploads.ids) > 0
    assert counted(server) == len(uploads.ids)
    storage = Repositories.open(database)
    try:
        assert storage.reports.report_count() == len(uploads.ids)
    finally:
        storage.close()


@pytest.mark.slow
def test_two_processes_on_one_postgresql_count_every_report_once(
    start_server: StartServer, postgres_url: str
) -> None:
    """Two aggregators share one PostgreSQL database. Batches go to either, a quarter of
    them to both at once (the same ids racing in two processes), failed attempts retry
    at the other server; each server is SIGKILLed once midway and restarted."""
    servers = [start_server(postgres_url, *SERVER_ARGS, env=SERVER_ENV) for _ in range(2)]
    urls = [s.url for s in servers]
    ports = [port_of(s) for s in servers]

    def route(rng: random.Random) -> list[str]:
        if rng.random() < 0.25:
            return rng.sample(urls, 2)
        return [rng.choice(urls)]

    chaos = random.Random(4242)
    kills = 0
    with Uploaders(urls, servers[0].headers("device"), route, seed=100) as uploads:
        for victim in (1, 0):
            time.sleep(chaos.uniform(0.8, 1.5))
            servers[victim].kill()
            kills += 1
            time.sleep(chaos.uniform(0.3, 0.8))  # the survivor carries the load meanwhile
            servers[victim] = start_server(
                postgres_url, *SERVER_ARGS, port=ports[victim], env=SERVER_ENV
            )
        time.sleep(0.8)
    check_exactly_once(uploads, kills)
    assert sum(reply["duplicates"] > 0 for _, reply in uploads.replies) > 0
    for server in servers:
        assert counted(server) == len(uploads.ids)
    storage = Repositories.open(postgres_url)
    try:
        assert storage.reports.report_count() == len(uploads.ids)
    finally:
        storage.close()
