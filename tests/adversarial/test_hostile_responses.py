"""Attack: make a device delete reports it already paid for with privacy budget.

A server (or a proxy in front of it) that answers 500, 401 or 403 for a while, a 422
about one report of a batch, or a device whose clock runs hours fast (its reports
look as if they came from the future) used to make the uploader drop whole batches:
the epsilon was spent, nothing was counted. The defence (``client/transport.py``,
``client/sdk.py``): 5xx are retried with bounded, jittered backoff and 401 and 403
are tried again after ``RetryPolicy.refused_delay``, while the reports stay in the
outbox (across restarts); a 422 drops only the reports its
problem document names; report hours follow the server's clock (its ``Date`` header).
Every report is still delivered exactly once, under its own id.

The scripted server is a real HTTP server on a loopback port (``http.server``, which
sends ``Date`` like uvicorn); the clock test runs against a real ``ldp-aggregator
serve`` (``hostile_target``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import BudgetLimits, RetryPolicy, TelemetryClient
from simulations.server import Server

METRIC = {
    "name": "app.theme",
    "version": 1,
    "description": "",
    "mechanism": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3},
    "labels": ["light", "dark", "auto"],
}
FAST = RetryPolicy(base=0.01, cap=0.05)
LIMITS = BudgetLimits(per_metric_per_period=100.0, total_per_period=100.0)


class HostileServer:
    """Answers ``POST /v1/reports`` with the scripted answers in turn (then 200), where an
    answer is a status or ``(422, [indices])``; stores every accepted report id once."""

    def __init__(self, answers: list[int | tuple[int, list[int]]]) -> None:
        self.answers = list(answers)
        self.posts: list[list[str]] = []
        self.accepted: list[str] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                owner.reply(self, 200, [METRIC])

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ids = [r["report_id"] for r in json.loads(body)["reports"]]
                with owner.lock:
                    owner.posts.append(ids)
                    answer = owner.answers.pop(0) if owner.answers else 200
                    if answer == 200:
                        new = [i for i in ids if i not in owner.accepted]
                        owner.accepted.extend(new)
                        document: Any = {"accepted": len(new), "duplicates": len(ids) - len(new)}
                        return owner.reply(self, 200, document)
                status, named = answer if isinstance(answer, tuple) else (answer, [])
                errors = [{"report": i, "field": "time", "message": "refused"} for i in named]
                owner.reply(self, status, {"title": "scripted", "status": status, "errors": errors})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        # A short poll interval: shutdown() waits up to one interval (0.5 s by default).
        self.thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @staticmethod
    def reply(handler: BaseHTTPRequestHandler, status: int, document: Any) -> None:
        body = json.dumps(document).encode()
        handler.send_response(status)  # adds the Date header
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def hostile() -> Iterator[Callable[..., HostileServer]]:
    servers: list[HostileServer] = []

    def start(answers: list[int | tuple[int, list[int]]]) -> HostileServer:
        servers.append(HostileServer(answers))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def client_for(url: str, key: str, state: Path, **options: Any) -> TelemetryClient:
    return TelemetryClient(
        url, key, state, limits=LIMITS, retry=FAST, upload_interval=3600.0, **options
    )


def queued_ids(client: TelemetryClient) -> list[str]:
    return [queued.report_id for queued in client._outbox.peek(1000)]


def test_500_401_403_keep_every_report_and_deliver_each_once(
    hostile: Callable[..., HostileServer], tmp_path: Path
) -> None:
    server = hostile([500, 401, 403, 503])
    client = client_for(server.url, "key", tmp_path)
    for value in ["light", "dark", "auto"]:
        client.record("app.theme", value)
    ids = queued_ids(client)
    assert client.flush(timeout=0.0) is False  # one attempt: 500, the reports stay
    assert queued_ids(client) == ids
    client.close(timeout=0.0)  # a restart while the server still fails

    for status in (401, 403):  # refused: flush returns at once, the reports stay
        client = client_for(server.url, "key", tmp_path)  # a restart tries again at once
        assert queued_ids(client) == ids  # kept across the restart
        assert client.flush(timeout=30.0) is False
        assert client.last_error is not None and client.last_error.status == status
        assert client.last_error.permanent
        client.close(timeout=0.0)
    client = client_for(server.url, "key", tmp_path)
    assert client.flush(timeout=30.0) is True  # 503, then accepted
    client.close()
    assert sorted(server.accepted) == sorted(ids)  # each once
    assert all(sorted(post) == sorted(ids) for post in server.posts)  # same ids each time
    assert len(server.posts) == 5


def test_422_drops_only_the_named_report(
    hostile: Callable[..., HostileServer], tmp_path: Path
) -> None:
    server = hostile([(422, [1])])
    client = client_for(server.url, "key", tmp_path)
    for value in ["light", "dark", "auto", "light"]:
        client.record("app.theme", value)
    assert client.flush(timeout=30.0) is True
    client.close()
    first = server.posts[0]
    assert sorted(server.accepted) == sorted(first[:1] + first[2:])
    assert first[1] not in server.accepted


@pytest.mark.slow
def test_device_clock_two_hours_fast_is_accepted(
    hostile_target: Callable[..., Server], tmp_path: Path
) -> None:
    server = hostile_target()
    fast = 2 * 3600.0
    client = client_for(
        server.url, server.keys["device"], tmp_path, clock=lambda: time.time() + fast
    )
    for value in ["light", "dark", "system", "dark", "dark"]:
        client.record("app.theme", value)
    assert client.flush(timeout=30.0) is True
    stats = client._uploader.stats
    client.close()
    assert stats.reports_refused == 0 and stats.reports_acknowledged == 5
    estimate = httpx.get(
        f"{server.url}/v1/metrics/app.theme/estimate", headers=server.headers("analyst")
    )
    assert estimate.status_code == 200, estimate.text
    assert estimate.json()["n"] == 5
