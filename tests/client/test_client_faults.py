"""Delivery under faults: the aggregator down, flapping, or answering 429 and 503.

Against a real aggregator process over loopback HTTP (``conftest.py``). For 429 and 503 a
small stdlib HTTP proxy sits between the SDK and the aggregator: it refuses the first
posts with ``Retry-After: 1`` and forwards everything else, and it keeps every request
it saw (arrival time, body, answer), which is also the traffic the raw-value scan reads.
"""

from __future__ import annotations

import json
import logging
import math
import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import BudgetLimits, RetryPolicy, SpecError, TelemetryClient

THEME, MINUTES = "app.theme", "app.session_minutes"
#: Many reports from one device: no caps in the way (the default lifetime total is finite).
ROOMY = BudgetLimits(per_metric_per_period=1e6, total_per_period=1e6, lifetime=math.inf)
#: Short backoff, so that a test waits for the aggregator, not for the backoff cap.
FAST_RETRY = RetryPolicy(base=0.02, cap=0.3)


# --- the aggregator down at start ---------------------------------------------------------


@pytest.mark.slow
def test_aggregator_down_at_start(make_aggregator: Callable[..., Any], tmp_path: Path) -> None:
    """A device that has seen the specs records while the aggregator is down: the reports
    wait in the outbox, across an app restart, and all arrive once it is up. A device that
    never reached the aggregator cannot know a metric's spec and refuses, queuing nothing."""
    aggregator = make_aggregator()  # not running yet
    with TelemetryClient(
        aggregator.url, aggregator.keys["device"], tmp_path / "new-device", retry=FAST_RETRY
    ) as client:
        with pytest.raises(SpecError):
            client.record(THEME, "dark")
        assert client.queued == 0

    state = tmp_path / "device"
    aggregator.start()
    with TelemetryClient(aggregator.url, aggregator.keys["device"], state, limits=ROOMY) as client:
        client.record(THEME, "light")  # fetches and caches the specs
        client.record(MINUTES, 3.0)
        assert client.flush(timeout=30.0)
    aggregator.kill()

    client = TelemetryClient(
        aggregator.url,
        aggregator.keys["device"],
        state,
        limits=ROOMY,
        batch_size=50,
        upload_interval=0.05,
        retry=FAST_RETRY,
    )
    try:
        for i in range(250):
            client.record(THEME, ["light", "dark", "system"][i % 3])
            client.record(MINUTES, float(i % 120))
        assert client.queued == 500
        assert not client.flush(timeout=0.5)  # nobody answers
        assert client.queued == 500 and client.dropped == 0

        aggregator.start()
        assert client.flush(timeout=60.0)
        assert client.queued == 0
    finally:
        client.close()
    assert aggregator.count(THEME) == 251
    assert aggregator.count(MINUTES) == 251


# --- a flapping aggregator ----------------------------------------------------------------


@pytest.mark.slow
def test_aggregator_flapping(aggregator: Any, tmp_path: Path) -> None:
    """The aggregator is killed with SIGKILL and restarted four times (seeded random
    moments) while a device records and uploads continuously: afterwards it has counted
    every report exactly once."""
    client = TelemetryClient(
        aggregator.url,
        aggregator.keys["device"],
        tmp_path / "device",
        limits=ROOMY,
        batch_size=25,
        upload_interval=0.05,
        retry=FAST_RETRY,
        timeout=5.0,
    )
    recorded = 0
    errors: list[BaseException] = []
    stop = threading.Event()

    def record_continuously() -> None:
        nonlocal recorded
        try:
            while not stop.is_set():
                for _ in range(25):
                    client.record(THEME, recorded % 3)
                    recorded += 1
                time.sleep(0.02)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    client.record(THEME, 0)  # the specs, while the aggregator is up
    recorded = 1
    recorder = threading.Thread(target=record_continuously)
    recorder.start()
    rng = random.Random(4242)
    while_down: list[int] = []
    try:
        for _ in range(4):
            time.sleep(rng.uniform(0.2, 0.6))
            aggregator.kill()
            before = recorded
            time.sleep(rng.uniform(0.0, 0.3))
            aggregator.start()
            while_down.append(recorded - before)
        time.sleep(0.3)
    finally:
        stop.set()
        recorder.join(timeout=60)
    try:
        assert not errors, errors
        assert client.flush(timeout=60.0)
    finally:
        client.close()
    assert all(count > 0 for count in while_down), while_down  # reports had to wait
    assert aggregator.count(THEME) == recorded


# --- 429 and 503, behind a proxy ------------------------------------------------------------


@dataclass
class Exchange:
    """One request the proxy received, and its answer."""

    arrived: float  # time.monotonic() when the request line was read
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    reply: bytes = b""


class FaultProxy:
    """A loopback HTTP proxy to ``upstream`` that answers the first ``refuse`` posts of
    reports with ``status`` and ``Retry-After: retry_after``, and forwards all else."""

    def __init__(self, upstream: str, refuse: int, status: int, retry_after: str) -> None:
        self.refuse, self.status, self.retry_after = refuse, status, retry_after
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._upstream = httpx.Client(base_url=upstream, timeout=60.0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - the http.server naming
                proxy.handle(self)

            def do_POST(self) -> None:  # noqa: N802
                proxy.handle(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # A short poll interval: shutdown() waits up to one interval (0.5 s by default).
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        arrived = time.monotonic()
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        exchange = Exchange(
            arrived, request.command, request.path, dict(request.headers.items()), body
        )
        with self._lock:
            posts = sum(e.method == "POST" and e.path == "/v1/reports" for e in self.exchanges)
            self.exchanges.append(exchange)
        headers = {}
        if request.command == "POST" and request.path == "/v1/reports" and posts < self.refuse:
            exchange.status = self.status
            exchange.reply = json.dumps(
                {"type": "about:blank", "title": "Try again later", "status": self.status}
            ).encode()
            headers = {"Content-Type": "application/problem+json", "Retry-After": self.retry_after}
        else:
            forwarded = {
                name: value
                for name, value in request.headers.items()
                if name.lower() in ("authorization", "content-type", "accept")
            }
            answer = self._upstream.request(
                request.command, request.path, content=body, headers=forwarded
            )
            exchange.status, exchange.reply = answer.status_code, answer.content
            headers = {"Content-Type": answer.headers.get("content-type", "application/json")}
            if "retry-after" in answer.headers:
                headers["Retry-After"] = answer.headers["retry-after"]
        request.send_response(exchange.status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(exchange.reply)))
        request.end_headers()
        request.wfile.write(exchange.reply)

    def posts(self) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.method == "POST" and e.path == "/v1/reports"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._upstream.close()


COLOUR, LATENCY = "faults.colour", "faults.latency"
#: Distinctive raw values: the scan below looks for them everywhere a report went.
LABELS = ("Crimson-Marker-Alpha", "Teal-Marker-Beta", "Ochre-Marker-Gamma")
RAW_NUMBERS = (12.3456789, 45.6789123, 78.9123456)
LOWER, UPPER = 0.0, 100.0
REFUSED_POSTS = 2
PER_METRIC = 30


def raw_forms() -> list[bytes]:
    """Every form a raw value could take on disk or on the wire: the labels; each number as
    text (``repr``, what JSON writes), as a big- and little-endian double; and the same for
    its normalized form t = 2 (x - lower) / (upper - lower) - 1, which a mechanism sees."""
    forms = [label.encode() for label in LABELS]
    for x in RAW_NUMBERS:
        t = 2.0 * (x - LOWER) / (UPPER - LOWER) - 1.0
        for number in (x, t):
            forms += [repr(number).encode(), struct.pack("<d", number), struct.pack(">d", number)]
    return forms


def report_ids(exchange: Exchange) -> list[str]:
    return [report["report_id"] for report in json.loads(exchange.body)["reports"]]


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.slow
def test_retry_after_honoured_same_reports_no_raw_values(
    status: int, aggregator: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first two posts are refused with ``status`` and ``Retry-After: 1``: the SDK sends
    the very same reports again (same ids, same perturbed payloads), no sooner than one
    second later, and nothing is lost. Nothing it sent, logged or stored holds a raw value."""
    caplog.set_level(logging.DEBUG)
    aggregator.define(
        COLOUR,
        {
            "description": "fault test: a category",
            "mechanism": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3},
            "labels": list(LABELS),
        },
    )
    aggregator.define(
        LATENCY,
        {
            "description": "fault test: a number",
            "mechanism": {"mechanism": "piecewise", "epsilon": 1.0, "lower": LOWER, "upper": UPPER},
        },
    )
    proxy = FaultProxy(aggregator.url, REFUSED_POSTS, status, retry_after="1")
    state = tmp_path / "device"
    try:
        with TelemetryClient(
            proxy.url,
            aggregator.keys["device"],
            state,
            limits=ROOMY,
            batch_size=20,
            upload_interval=3600.0,  # posts when 20 reports wait, and at flush
            retry=FAST_RETRY,  # its backoff is far below Retry-After: 1
        ) as client:
            for i in range(PER_METRIC):
                client.record(COLOUR, LABELS[i % 3])
                client.record(LATENCY, RAW_NUMBERS[i % 3])
            assert client.flush(timeout=60.0)
            assert client.queued == 0
    finally:
        proxy.close()

    assert aggregator.count(COLOUR) == PER_METRIC
    assert aggregator.count(LATENCY) == PER_METRIC
    posts = proxy.posts()
    assert [e.status for e in posts[:REFUSED_POSTS]] == [status] * REFUSED_POSTS
    assert all(e.status == 200 for e in posts[REFUSED_POSTS:]), [e.status for e in posts]
    retries = list(zip(posts[:REFUSED_POSTS], posts[1 : REFUSED_POSTS + 1], strict=True))
    for refused, retry in retries:
        sent_before = json.loads(refused.body)["reports"]
        sent_again = json.loads(retry.body)["reports"]
        assert sent_again[: len(sent_before)] == sent_before  # same ids, same payloads
    answers = [json.loads(e.reply) for e in posts[REFUSED_POSTS:]]
    assert sum(a["accepted"] for a in answers) == 2 * PER_METRIC
    assert sum(a["duplicates"] for a in answers) == 0
    every_id = {i for e in posts for i in report_ids(e)}
    assert len(every_id) == 2 * PER_METRIC  # no report was made anew for a retry

    # No raw value anywhere: requests (lines, headers, bodies), the client's logs, and
    # the state directory, where the only labels are in the cached public specs.
    forms = raw_forms()
    for exchange in proxy.exchanges:
        request = (
            f"{exchange.method} {exchange.path}\n".encode()
            + json.dumps(exchange.headers).encode()
            + exchange.body
        )
        assert not [form for form in forms if form in request], exchange
    assert not [form for form in forms if form in caplog.text.encode()]
    files = sorted(path for path in state.rglob("*") if path.is_file())
    assert {"ledger.json", "outbox.sqlite3", "specs.json"} <= {path.name for path in files}
    for path in files:
        if path.name == "specs.json":
            assert json.loads(path.read_text()) == aggregator.metrics()
            continue
        content = path.read_bytes()
        assert not [form for form in forms if form in content], path

    # Retry-After honoured: each retry arrived at least a second after its refusal.
    gaps = [round(retry.arrived - refused.arrived, 3) for refused, retry in retries]
    assert all(gap >= 1.0 for gap in gaps), f"retried {gaps} s after 'Retry-After: 1'"
