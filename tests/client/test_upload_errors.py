"""Why an upload failed reaches the app: ``last_error``, one warning, a prompt ``flush``.

A key the aggregator refuses (unknown, revoked: 401; of another role: 403) or an endpoint
with no aggregator (404, 405) is no network blip: the reports are kept for a corrected or
restored key to deliver, the same batch goes again only after ``RetryPolicy.refused_delay``,
the refusal is logged once at WARNING with the server's problem ``detail``, and ``flush``
returns False at once with the reason in ``last_error``. A transient failure (5xx, no
answer) is retried soon, and is not permanent; a batch the aggregator can never take is
dropped, and says how many reports it cost.

Scripted answers come from ``httpx.MockTransport``; the key tests run against a real
aggregator process over loopback HTTP (fixture ``aggregator``, ``conftest.py``). Time
checks only say "not sooner than"; waits on the background thread have a deadline only a
hang would reach.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import (
    BudgetLimits,
    FederatedClient,
    FederatedError,
    RetryPolicy,
    TelemetryClient,
    UploadError,
)
from client.outbox import Outbox
from client.transport import Uploader

#: Every test here starts a real server process or CLI: the slow lane.
pytestmark = pytest.mark.slow

#: Upload interval that keeps the background thread asleep unless it is woken.
QUIET = 3600.0
#: Deadline for waiting on the background thread (reached only if it hangs).
PATIENCE = 20.0
#: Fast retries of transient failures; a refusal waits an hour unless a test says less.
FAST = RetryPolicy(base=0.002, cap=0.02, refused_delay=3600.0)
LIMITS = BudgetLimits(per_metric_per_period=100.0, total_per_period=100.0)
UNKNOWN_KEY = "the key is unknown or revoked"

#: A scripted answer: (status, problem detail), or an httpx transport error class.
Answer = tuple[int, str] | type[httpx.TransportError]


class Script:
    """Answers ``POST /v1/reports`` with the next scripted answer (the last one repeats),
    as the aggregator does (a problem document with a ``detail``); counts the posts."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = list(answers)
        self.posts: list[float] = []  # the monotonic time of each post

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/metrics":
            return httpx.Response(200, json=[THEME])
        assert request.method == "POST" and request.url.path == "/v1/reports"
        self.posts.append(time.monotonic())
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, type):
            raise answer("scripted failure", request=request)
        status, detail = answer
        if status == 200:
            count = len(json.loads(request.content)["reports"])
            return httpx.Response(200, json={"accepted": count, "duplicates": 0})
        problem = {"type": "about:blank", "title": "scripted", "status": status, "detail": detail}
        body = json.dumps(problem).encode()
        return httpx.Response(
            status, content=body, headers={"Content-Type": "application/problem+json"}
        )


THEME = {
    "name": "app.theme",
    "version": 1,
    "description": "",
    "mechanism": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 3},
    "labels": ["light", "dark", "system"],
}


def report(number: int) -> dict[str, Any]:
    return {
        "report_id": f"00000000-0000-4000-8000-{number:012d}",
        "metric": "app.theme",
        "version": 1,
        "payload": {"value": number % 3},
        "time": "2024-05-01T12:00:00Z",
    }


@pytest.fixture
def start(outbox: Outbox) -> Iterator[Callable[..., tuple[Uploader, Script]]]:
    """Start an uploader on ``outbox`` against scripted answers; stopped afterwards."""
    started: list[Uploader] = []

    def start_uploader(answers: list[Answer], **options: Any) -> tuple[Uploader, Script]:
        script = Script(answers)
        http = httpx.Client(
            base_url="http://aggregator.test", transport=httpx.MockTransport(script.handle)
        )
        options.setdefault("interval", QUIET)
        options.setdefault("retry", FAST)
        options.setdefault("rng", random.Random(5))
        uploader = Uploader(outbox, lambda body: http.post("/v1/reports", content=body), **options)
        started.append(uploader)
        return uploader, script

    yield start_uploader
    for uploader in started:
        uploader.stop(0.0)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, "the uploader did not get there"
        time.sleep(0.01)


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "ldp.client" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


REFUSALS = [
    (401, UNKNOWN_KEY),
    (403, "this needs a device key; the key given is an analyst key"),
    (404, "Not Found"),
    (405, "Method Not Allowed"),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: str(r[0]))
def test_a_refusal_keeps_the_reports_and_flush_returns_at_once_saying_why(
    outbox: Outbox, start: Callable, refusal: tuple[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    outbox.add([report(n) for n in range(3)])
    uploader, script = start([refusal])
    before = datetime.now(UTC).replace(microsecond=0)
    with caplog.at_level(logging.WARNING, logger="ldp.client"):
        assert uploader.flush(PATIENCE) is False
        assert len(script.posts) == 1  # not retried at the transient rate within flush
        assert uploader.flush(PATIENCE) is False  # during the refusal's wait: no post at all
    assert len(script.posts) == 1
    assert len(outbox) == 3  # kept
    error = uploader.last_error
    assert isinstance(error, UploadError)
    assert (error.status, error.detail, error.permanent, error.dropped) == (*refusal, True, 0)
    assert error.time >= before and error.time.tzinfo is UTC
    assert str(error) == f"HTTP {refusal[0]}: {refusal[1]}"
    assert len(warnings_about(caplog, refusal[1])) == 1
    assert not [r for r in caplog.records if "upload failed" in r.getMessage()]


def test_a_refusal_is_tried_again_rarely_logged_once_and_a_restored_key_delivers(
    outbox: Outbox, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    """The background thread tries the refused batch again every refused_delay (never
    sooner than half of it), warns once however often it is refused the same way, and
    delivers the kept reports once the key works again; a success clears last_error."""
    policy = RetryPolicy(base=0.002, cap=0.02, refused_delay=0.2)
    outbox.add([report(n) for n in range(3)])
    caplog.set_level(logging.DEBUG, logger="ldp.client")
    uploader, script = start([(401, UNKNOWN_KEY)], retry=policy, interval=0.01)
    assert uploader.flush(PATIENCE) is False
    wait_until(lambda: len(script.posts) >= 4)
    gaps = np.diff(script.posts[:4])
    assert (gaps >= policy.refused_delay / 2).all(), gaps
    assert len(warnings_about(caplog, UNKNOWN_KEY)) == 1
    assert uploader.last_error is not None and uploader.last_error.status == 401

    script.answers = [(200, "")]  # the key is restored on the server
    wait_until(lambda: len(outbox) == 0)
    assert uploader.last_error is None
    assert uploader.stats.reports_acknowledged == 3

    script.answers = [(401, UNKNOWN_KEY)]  # revoked again: a new refusal, warned again
    outbox.add([report(3)])
    assert uploader.flush(PATIENCE) is False
    assert len(warnings_about(caplog, UNKNOWN_KEY)) == 2


def test_a_different_refusal_is_warned_again(
    outbox: Outbox, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RetryPolicy(base=0.002, cap=0.02, refused_delay=0.05)
    outbox.add([report(0)])
    forbidden = REFUSALS[1]
    uploader, script = start([(401, UNKNOWN_KEY), forbidden], retry=policy, interval=0.01)
    with caplog.at_level(logging.WARNING, logger="ldp.client"):
        wait_until(lambda: len(script.posts) >= 3)
    assert len(warnings_about(caplog, UNKNOWN_KEY)) == 1
    assert len(warnings_about(caplog, forbidden[1])) == 1
    assert uploader.last_error is not None and uploader.last_error.status == 403


TRANSIENT: list[Answer] = [(500, "boom"), (503, "the storage is unreachable"), httpx.ConnectError]


def test_a_failing_periodic_task_does_not_stop_the_uploads(outbox: Outbox, start: Callable) -> None:
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) == 1:
            raise OSError("the disk is full")

    uploader, script = start([(200, "")], interval=0.01, on_tick=tick)
    wait_until(lambda: len(ticks) >= 2)
    outbox.add([report(0)])
    wait_until(lambda: len(outbox) == 0)  # the background thread still uploads


@pytest.mark.parametrize("failure", TRANSIENT, ids=lambda f: getattr(f, "__name__", str(f)))
def test_transient_failures_are_retried_soon_and_not_permanent(
    outbox: Outbox, start: Callable, failure: Answer, caplog: pytest.LogCaptureFixture
) -> None:
    outbox.add([report(n) for n in range(2)])
    uploader, script = start([failure])
    with caplog.at_level(logging.WARNING, logger="ldp.client"):
        assert uploader.flush(0.3) is False  # flush keeps trying until its timeout
    assert len(script.posts) >= 2
    error = uploader.last_error
    assert error is not None and not error.permanent and error.dropped == 0
    if isinstance(failure, tuple):
        assert (error.status, error.detail) == failure
        assert str(error) in caplog.records[0].getMessage()  # the detail is in the log
    else:
        assert error.status is None and "ConnectError" in error.detail
    script.answers = [(200, "")]
    assert uploader.flush(PATIENCE) is True
    assert uploader.last_error is None


@pytest.mark.parametrize("status", [400, 422])
def test_a_batch_that_can_never_be_taken_is_dropped_and_says_how_many(
    outbox: Outbox, start: Callable, status: int
) -> None:
    outbox.add([report(n) for n in range(4)])
    uploader, script = start([(status, "the batch is malformed")], batch_size=4)
    assert uploader.flush(PATIENCE) is True  # nothing left: dropped, not retried
    assert len(script.posts) == 1
    error = uploader.last_error
    assert error is not None
    assert (error.status, error.detail, error.permanent, error.dropped) == (
        status,
        "the batch is malformed",
        True,
        4,
    )


def test_refused_waits_are_jittered_between_half_and_all_of_refused_delay() -> None:
    policy = RetryPolicy(refused_delay=100.0)
    rng = random.Random(99)
    waits = [policy.refused(None, rng) for _ in range(400)]
    assert all(50.0 <= wait <= 100.0 for wait in waits)
    # Spread over the range: P(no draw in the top or bottom tenth) = 0.9^400 < 1e-18.
    assert max(waits) > 95.0 and min(waits) < 55.0
    assert policy.refused(300.0, rng) == 300.0  # a longer Retry-After is obeyed
    with pytest.raises(ValueError, match="refused_delay"):
        RetryPolicy(refused_delay=0.0)


def test_a_refused_client_says_why_and_a_restored_key_delivers(tmp_path: Path) -> None:
    """Through ``TelemetryClient``: last_error and a prompt flush; the reports survive a
    restart and are delivered, each once, when the key works again."""
    script = Script([(401, UNKNOWN_KEY)])

    def client() -> TelemetryClient:
        return TelemetryClient(
            "http://aggregator.test",
            "device-key",
            tmp_path,
            limits=LIMITS,
            upload_interval=QUIET,
            retry=FAST,
            transport=httpx.MockTransport(script.handle),
        )

    telemetry = client()
    for label in ["light", "dark", "system"]:
        telemetry.record("app.theme", label)
    assert telemetry.flush(PATIENCE) is False
    assert len(script.posts) == 1
    error = telemetry.last_error
    assert error is not None and (error.status, error.detail, error.permanent) == (
        401,
        UNKNOWN_KEY,
        True,
    )
    assert telemetry.close(timeout=PATIENCE) is False  # close does not wait out the refusal
    assert len(script.posts) == 1

    script.answers = [(200, "")]
    telemetry = client()
    assert telemetry.queued == 3 and telemetry.last_error is None
    assert telemetry.flush(PATIENCE) is True
    telemetry.close()


# --- against a real aggregator ---------------------------------------------------------


def real_client(aggregator: Any, key: str, state_dir: Path, **options: Any) -> TelemetryClient:
    options.setdefault("retry", FAST)
    options.setdefault("upload_interval", QUIET)
    return TelemetryClient(aggregator.url, key, state_dir, limits=LIMITS, **options)


def test_a_wrong_key_is_reported_and_a_corrected_key_delivers_the_reports(
    aggregator: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RetryPolicy(base=0.002, cap=0.02, refused_delay=0.1)
    caplog.set_level(logging.DEBUG, logger="ldp.client")
    telemetry = real_client(aggregator, "not-a-key-0123456789", tmp_path, retry=policy)
    for index in range(5):
        telemetry.record("app.theme", index % 3)
    assert telemetry.flush(PATIENCE) is False
    error = telemetry.last_error
    assert error is not None
    assert (error.status, error.detail, error.permanent) == (401, UNKNOWN_KEY, True)
    # Each flush after a refusal's wait tries once more (and within one returns at once).
    wait_until(lambda: telemetry.flush(PATIENCE) or telemetry._uploader.stats.retries >= 3)
    assert len(warnings_about(caplog, UNKNOWN_KEY)) == 1  # once, not per attempt
    assert telemetry.queued == 5
    telemetry.close(timeout=0.0)
    assert aggregator.count("app.theme") == 0

    fixed = real_client(aggregator, aggregator.keys["device"], tmp_path)
    assert fixed.flush(PATIENCE) is True
    assert fixed.last_error is None
    fixed.close()
    assert aggregator.count("app.theme") == 5


def test_a_revoked_key_is_reported_and_keeps_the_reports(aggregator: Any, tmp_path: Path) -> None:
    admin = aggregator.headers("admin")
    created = httpx.post(
        f"{aggregator.url}/v1/keys", json={"role": "device", "label": "phone"}, headers=admin
    )
    assert created.status_code == 201, created.text
    telemetry = real_client(aggregator, created.json()["key"], tmp_path)
    telemetry.record("app.theme", "dark")
    assert telemetry.flush(PATIENCE) is True and telemetry.last_error is None
    key_id = created.json()["key_id"]
    revoked = httpx.delete(f"{aggregator.url}/v1/keys/{key_id}", headers=admin)
    assert revoked.status_code == 204, revoked.text

    telemetry.record("app.theme", "light")
    telemetry.record("app.theme", "system")
    assert telemetry.flush(PATIENCE) is False
    error = telemetry.last_error
    assert error is not None
    assert (error.status, error.detail, error.permanent) == (401, UNKNOWN_KEY, True)
    assert telemetry.queued == 2
    telemetry.close(timeout=0.0)
    assert aggregator.count("app.theme") == 1


def test_an_analyst_key_cannot_upload_reports_and_says_so(aggregator: Any, tmp_path: Path) -> None:
    telemetry = real_client(aggregator, aggregator.keys["analyst"], tmp_path)
    telemetry.record("app.theme", "dark")
    assert telemetry.flush(PATIENCE) is False
    error = telemetry.last_error
    assert error is not None and (error.status, error.permanent) == (403, True)
    assert error.detail == "this needs a device key; the key given is an analyst key"
    assert telemetry.queued == 1
    telemetry.close(timeout=0.0)


def test_the_federated_client_reports_a_refused_key_with_its_detail(aggregator: Any) -> None:
    data = (np.zeros((4, 2)), np.zeros(4, dtype=np.int64))
    with FederatedClient(aggregator.url, "not-a-key-0123456789", "any-task", data) as device:
        with pytest.raises(FederatedError) as refused:
            device.fetch_round()
    assert (refused.value.status, refused.value.detail) == (401, UNKNOWN_KEY)
    assert UNKNOWN_KEY in str(refused.value) and "401" in str(refused.value)


def test_the_federated_client_logs_why_an_upload_never_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        problem = {"title": "Unavailable", "status": 503, "detail": "the storage is unreachable"}
        return httpx.Response(503, json=problem)

    http = httpx.Client(transport=httpx.MockTransport(handle))
    data = (np.zeros((4, 2)), np.zeros(4, dtype=np.int64))
    device = FederatedClient(
        "http://aggregator.test", "key", "task", data, http=http, max_attempts=2,
        retry=RetryPolicy(base=0.001, cap=0.002),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ldp.federated"):
        assert device._upload({"update": "x"}) is False
    messages = [r.getMessage() for r in caplog.records if r.name == "ldp.federated"]
    assert len(messages) == 1 and "HTTP 503: the storage is unreachable" in messages[0]
    http.close()
