"""Uploading the outbox: acknowledgement, retries with backoff and Retry-After, refusals.

A scripted aggregator behind ``httpx.MockTransport`` answers ``POST /v1/reports`` (a
status, with a ``Retry-After`` or a problem document if scripted) and records every
request (its time on the monotonic clock, its body). Time checks only
ever say "not sooner than" a delay the uploader was told to wait (never an upper
bound on how long anything takes); waiting for the background thread has a generous
deadline that only a hang would reach.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from client.outbox import Outbox
from client.transport import RetryPolicy, ServerClock, Uploader, retry_after_seconds

#: Upload interval that keeps the background thread asleep unless it is woken.
QUIET = 3600.0
#: Deadline for waiting on the background thread (reached only if it hangs).
PATIENCE = 20.0

Answer = int | tuple[int, str] | tuple[int, dict[str, Any]] | type[httpx.TransportError]


@dataclass
class Call:
    at: float
    content: bytes
    queued: int

    @property
    def report_ids(self) -> list[str]:
        return [report["report_id"] for report in json.loads(self.content)["reports"]]


class ScriptedAggregator:
    """Answers each upload with the next scripted answer (the last one repeats): a status,
    ``(status, retry_after)``, ``(status, problem document)``, or an httpx transport error
    class to raise."""

    def __init__(self, answers: list[Answer], outbox: Outbox) -> None:
        self.answers = list(answers)
        self.outbox = outbox
        self.calls: list[Call] = []
        self.http = httpx.Client(
            base_url="http://aggregator.test", transport=httpx.MockTransport(self._handle)
        )

    def post(self, body: bytes) -> httpx.Response:
        return self.http.post(
            "/v1/reports", content=body, headers={"Content-Type": "application/json"}
        )

    def _handle(self, request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/v1/reports"
        self.calls.append(Call(time.monotonic(), request.content, len(self.outbox)))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, type):
            raise answer("scripted failure", request=request)
        status, extra = answer if isinstance(answer, tuple) else (answer, None)
        headers = {"Retry-After": extra} if isinstance(extra, str) else {}
        if status == 200:
            count = len(json.loads(request.content)["reports"])
            return httpx.Response(200, json={"accepted": count, "duplicates": 0})
        problem = {"type": "about:blank", "title": "scripted", "status": status}
        if isinstance(extra, dict):
            problem.update(extra)
        return httpx.Response(status, json=problem, headers=headers)


@dataclass(frozen=True)
class RecordingPolicy(RetryPolicy):
    """The default policy, noting each (attempt, retry_after, delay) it is asked for."""

    log: list[tuple[int, float | None, float]] = field(default_factory=list, compare=False)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        chosen = super().delay(attempt, retry_after, rng)
        self.log.append((attempt, retry_after, chosen))
        return chosen


FAST = RetryPolicy(base=0.002, cap=0.02)


def report(number: int) -> dict[str, Any]:
    return {
        "report_id": str(uuid.uuid4()),
        "metric": "app.theme",
        "version": 1,
        "payload": {"value": number % 4},
        "time": "2024-05-01T12:00:00Z",
    }


@pytest.fixture
def start(outbox: Outbox) -> Iterator[Callable[..., tuple[Uploader, ScriptedAggregator]]]:
    """Start an uploader on ``outbox`` against a scripted aggregator; stopped afterwards."""
    started: list[Uploader] = []

    def start_uploader(
        answers: list[Answer], **options: Any
    ) -> tuple[Uploader, ScriptedAggregator]:
        aggregator = ScriptedAggregator(answers, outbox)
        options.setdefault("interval", QUIET)
        options.setdefault("retry", FAST)
        options.setdefault("rng", random.Random(7))
        uploader = Uploader(outbox, aggregator.post, **options)
        started.append(uploader)
        return uploader, aggregator

    yield start_uploader
    for uploader in started:
        uploader.stop(0.0)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, "the uploader did not get there"
        time.sleep(0.01)


def test_acknowledged_batch_is_removed(outbox: Outbox, start: Callable) -> None:
    reports = [report(n) for n in range(3)]
    outbox.add(reports)
    uploader, aggregator = start([200])
    assert uploader.flush(5.0) is True
    assert len(outbox) == 0
    assert len(aggregator.calls) == 1
    assert json.loads(aggregator.calls[0].content) == {"reports": reports}
    assert uploader.stats.reports_acknowledged == 3


RETRYABLE: list[Answer] = [
    408,
    429,
    500,
    501,
    502,
    503,
    504,
    507,
    httpx.ConnectError,
    httpx.ReadTimeout,
]


@pytest.mark.parametrize("failure", RETRYABLE, ids=lambda f: getattr(f, "__name__", str(f)))
def test_retryable_failures_keep_the_batch_and_resend_it_unchanged(
    outbox: Outbox, start: Callable, failure: Answer
) -> None:
    reports = [report(n) for n in range(3)]
    outbox.add(reports)
    uploader, aggregator = start([failure, failure, 200])
    assert uploader.flush(10.0) is True
    assert len(outbox) == 0
    calls = aggregator.calls
    assert len(calls) == 3
    assert [call.queued for call in calls] == [3, 3, 3]  # kept until acknowledged
    assert calls[0].content == calls[1].content == calls[2].content  # same ids, same bits
    assert calls[0].report_ids == [r["report_id"] for r in reports]
    assert uploader.stats.retries == 2
    assert uploader.stats.reports_acknowledged == 3


@pytest.mark.parametrize(
    "answer",
    [400, 409, 422, (422, {"errors": [{"report": None, "field": None, "message": "x"}]})],
    ids=["400", "409", "422-bare", "422-naming-no-report"],
)
def test_other_answers_drop_the_batch_and_log_why(
    outbox: Outbox, start: Callable, answer: Answer, caplog: pytest.LogCaptureFixture
) -> None:
    status = answer[0] if isinstance(answer, tuple) else answer
    reports = [report(n) for n in range(4)]
    outbox.add(reports)
    uploader, aggregator = start([answer, 200], batch_size=2)
    with caplog.at_level(logging.ERROR, logger="ldp.client"):
        assert uploader.flush(10.0) is True
    assert len(aggregator.calls) == 2  # no retry of the refused batch
    assert aggregator.calls[0].report_ids == [r["report_id"] for r in reports[:2]]
    assert aggregator.calls[1].report_ids == [r["report_id"] for r in reports[2:]]
    assert uploader.stats.reports_refused == 2
    assert uploader.stats.reports_acknowledged == 2
    refusals = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and str(status) in refusals[0].getMessage()


def test_a_422_drops_only_the_reports_it_names_and_resends_the_rest(
    outbox: Outbox, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    reports = [report(n) for n in range(5)]
    outbox.add(reports)
    named = {"errors": [{"report": 1, "field": "time", "message": "in the future"}] * 2}
    named["errors"].append({"report": 3, "field": "payload", "message": "bad"})
    named["errors"].append({"report": 99, "field": "payload", "message": "not in the batch"})
    uploader, aggregator = start([(422, named), 200])
    with caplog.at_level(logging.ERROR, logger="ldp.client"):
        assert uploader.flush(10.0) is True
    ids = [r["report_id"] for r in reports]
    assert [call.report_ids for call in aggregator.calls] == [ids, [ids[0], ids[2], ids[4]]]
    assert uploader.stats.reports_refused == 2
    assert uploader.stats.reports_acknowledged == 3
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and "[1, 3]" in refusals[0]


def test_a_422_naming_reports_no_longer_queued_backs_off(outbox: Outbox) -> None:
    """The report it names was evicted while the batch was in flight: nothing to drop, so
    the uploader backs off rather than resending the same batch in a tight loop."""
    outbox.add([report(n) for n in range(2)])
    answers: list[httpx.Response] = []

    def post(body: bytes) -> httpx.Response:
        reports = json.loads(body)["reports"]
        if not answers:  # first upload: the outbox evicts report 0 meanwhile
            batch = outbox.take(2)
            assert batch is not None
            outbox.discard_ids(batch, {reports[0]["report_id"]})
            named = {"errors": [{"report": 0, "field": "time", "message": "x"}]}
            answers.append(httpx.Response(422, json=named))
        else:
            answers.append(httpx.Response(200, json={"accepted": len(reports), "duplicates": 0}))
        return answers[-1]

    uploader = Uploader(outbox, post, interval=QUIET, retry=FAST, rng=random.Random(3))
    try:
        assert uploader.flush(10.0) is True
    finally:
        uploader.stop(0.0)
    assert [a.status_code for a in answers] == [422, 200]
    assert uploader.stats.retries == 1
    assert uploader.stats.reports_refused == 0 and uploader.stats.reports_acknowledged == 1


def test_retry_after_as_an_http_date_counts_from_the_response_date() -> None:
    """RFC 9110: ``Retry-After`` may be an HTTP-date; it is read against the server's own
    ``Date`` (the device's clock may be hours off)."""
    date = "Sun, 06 Nov 1994 08:49:37 GMT"
    headers = {"Date": date, "Retry-After": "Sun, 06 Nov 1994 08:50:07 GMT"}
    assert retry_after_seconds(httpx.Response(503, headers=headers)) == 30.0
    past = {"Date": date, "Retry-After": "Sun, 06 Nov 1994 08:00:00 GMT"}
    assert retry_after_seconds(httpx.Response(503, headers=past)) == 0.0
    assert retry_after_seconds(httpx.Response(503, headers={"Retry-After": "soon"})) is None
    assert retry_after_seconds(httpx.Response(503, headers={"Retry-After": "2.5"})) == 2.5


def test_server_clock_takes_the_offset_from_the_date_header() -> None:
    device = [1_000_000_000.0 + 7200.0]  # two hours fast
    clock = ServerClock(clock=lambda: device[0])
    assert clock.now() == device[0] and not clock.observed
    clock.observe(httpx.Response(200))  # no Date: nothing learnt
    assert not clock.observed
    clock.observe(httpx.Response(200, headers={"Date": "Sun, 09 Sep 2001 01:46:40 GMT"}))
    assert clock.observed and clock.offset == -7200.0
    assert clock.now() == 1_000_000_000.0
    clock.observe(httpx.Response(200, headers={"Date": "not a date"}))  # unreadable: kept
    assert clock.offset == -7200.0


def test_backoff_is_full_jitter_below_an_exponential_cap() -> None:
    policy = RetryPolicy(base=0.5, cap=10.0)
    rng = random.Random(12345)
    for attempt in range(10):
        bound = min(policy.cap, policy.base * 2.0**attempt)
        delays = [policy.delay(attempt, None, rng) for _ in range(400)]
        assert all(0.0 <= delay <= bound for delay in delays)
        # Spread over the whole range: P(no draw in the top or bottom tenth) = 0.9^400 < 1e-18.
        assert max(delays) > 0.9 * bound
        assert min(delays) < 0.1 * bound
    # A Retry-After is a floor, whatever the draw.
    assert all(policy.delay(0, 3.0, rng) >= 3.0 for _ in range(100))
    assert all(policy.delay(30, 3.0, rng) <= policy.cap for _ in range(100))


def test_uploader_backs_off_longer_after_each_failure_and_resets_on_success(
    outbox: Outbox, start: Callable
) -> None:
    policy = RecordingPolicy(base=0.001, cap=0.004)
    outbox.add([report(n) for n in range(2)])
    uploader, aggregator = start([503, 503, 503, 503, 200, 502, 200], retry=policy, batch_size=1)
    assert uploader.flush(10.0) is True
    assert [attempt for attempt, _, _ in policy.log] == [0, 1, 2, 3, 0]
    for attempt, retry_after, delay in policy.log:
        assert retry_after is None
        assert 0.0 <= delay <= min(policy.cap, policy.base * 2**attempt)
    assert len(aggregator.calls) == 7
    for before, after, (_, _, delay) in zip(
        aggregator.calls, aggregator.calls[1:], policy.log[:4], strict=False
    ):
        assert after.at - before.at >= delay  # never sooner than the drawn backoff


def test_flush_honours_retry_after(outbox: Outbox, start: Callable) -> None:
    outbox.add([report(n) for n in range(2)])
    uploader, aggregator = start([(503, "0.3"), (429, "0.2"), 200])
    assert uploader.flush(10.0) is True
    calls = aggregator.calls
    assert len(calls) == 3
    assert calls[1].at - calls[0].at >= 0.3
    assert calls[2].at - calls[1].at >= 0.2
    assert calls[0].content == calls[2].content


def test_background_thread_honours_retry_after(outbox: Outbox, start: Callable) -> None:
    outbox.add([report(n) for n in range(2)])
    uploader, aggregator = start([(503, "0.3"), (429, "0.25"), 200], interval=0.02)
    wait_until(lambda: len(outbox) == 0)
    calls = aggregator.calls
    assert len(calls) == 3
    assert calls[1].at - calls[0].at >= 0.3
    assert calls[2].at - calls[1].at >= 0.25


def test_retry_after_holds_when_flush_and_the_background_thread_meet(
    outbox: Outbox, start: Callable
) -> None:
    """``flush`` decides to send while the background thread's upload is in flight; that
    upload then gets 503 with Retry-After. The next upload must still wait: ``flush``
    checks the backoff before taking the send lock, so ``_send_once`` checks it again.
    """
    outbox.add([report(n) for n in range(2)])
    in_flight, answer = threading.Event(), threading.Event()
    calls: list[float] = []

    def post(body: bytes) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:  # the background thread's upload
            in_flight.set()
            answer.wait(PATIENCE)
            return httpx.Response(503, headers={"Retry-After": "0.5"})
        return httpx.Response(200, json={"accepted": 2, "duplicates": 0})

    uploader = Uploader(outbox, post, interval=0.01, retry=FAST, rng=random.Random(1))
    try:
        assert in_flight.wait(PATIENCE)
        result: list[bool] = []
        flusher = threading.Thread(target=lambda: result.append(uploader.flush(PATIENCE)))
        flusher.start()
        _wait_for_frame(flusher, "_send_once")  # flush is queued behind the upload
        answer.set()
        flusher.join(PATIENCE)
        assert result == [True]
        assert len(calls) >= 2
        assert calls[1] - calls[0] >= 0.5
    finally:
        answer.set()
        uploader.stop(0.0)


def _wait_for_frame(thread: threading.Thread, function: str) -> None:
    """Until ``thread`` is inside ``function`` (gives up quietly after a while)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            if frame.f_code.co_name == function:
                return
            frame = frame.f_back
        time.sleep(0.005)


def test_flush_returns_false_on_timeout_while_the_aggregator_is_down(
    outbox: Outbox, start: Callable
) -> None:
    reports = [report(n) for n in range(3)]
    outbox.add(reports)
    uploader, aggregator = start([503])
    assert uploader.flush(0.3) is False
    assert len(outbox) == 3
    assert len(aggregator.calls) >= 1
    assert len({call.content for call in aggregator.calls}) == 1  # retries resend the same

    aggregator.answers = [httpx.ConnectError]
    assert uploader.flush(0.2) is False
    assert len(outbox) == 3

    aggregator.answers = [200]  # back up
    assert uploader.flush(10.0) is True
    assert len(outbox) == 0
    assert aggregator.calls[-1].report_ids == [r["report_id"] for r in reports]


def test_batch_size_is_respected_in_fifo_order(outbox: Outbox, start: Callable) -> None:
    reports = [report(n) for n in range(7)]
    outbox.add(reports)
    uploader, aggregator = start([200], batch_size=3)
    assert uploader.flush(10.0) is True
    ids = [r["report_id"] for r in reports]
    assert [call.report_ids for call in aggregator.calls] == [ids[0:3], ids[3:6], ids[6:7]]


def test_a_full_batch_wakes_the_background_thread(outbox: Outbox, start: Callable) -> None:
    uploader, aggregator = start([200], batch_size=4)
    outbox.add([report(n) for n in range(3)])
    uploader.notify()  # not a full batch yet: nothing is sent before the interval
    outbox.add([report(3)])
    uploader.notify()
    wait_until(lambda: len(outbox) == 0)
    assert [len(call.report_ids) for call in aggregator.calls] == [4]


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"interval": 0.0}])
def test_nonsense_settings_are_refused(outbox: Outbox, bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Uploader(outbox, lambda body: httpx.Response(200), **bad)
