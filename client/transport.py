"""Uploading the outbox: a background thread posts batches and removes what was acknowledged.

Every ``interval`` seconds, or as soon as ``batch_size`` reports wait, the uploader
posts the oldest reports to ``POST /v1/reports``, at most ``batch_size`` of them in a body
of at most ``max_batch_bytes`` (the aggregator's default limit is 2,560,000 bytes; a
report alone larger than that still goes alone). A report was paid for with privacy
budget before it was queued, so it leaves the outbox only when the aggregator has it or
has said precisely that it can never take it:

* 200: removed (accepted or duplicate: either way the aggregator has them).
* Connection errors, timeouts, 401, 403, 408, 429 and every 5xx: kept, and the same
  batch goes again (same ids, never perturbed anew) after exponential backoff with full
  jitter, never sooner than a ``Retry-After`` header says (``RetryPolicy``). A key that
  is refused or a server that fails may be fixed later; the reports wait in the outbox,
  across restarts, until then (bounded by the outbox's own limits).
* 422 naming reports (the problem document's ``errors[].report``, the index of a report
  in the batch): only the named reports are removed, the reason logged, and the rest
  sent again at once (a batch is stored all or nothing, so none of it was counted).
* 413 for a batch of several reports: the server takes smaller bodies than this device
  sends; ``max_batch_bytes`` is halved (to the body's size at most) and the same reports
  go again at once, in smaller batches.
* Any other answer (400, 404, 413 for one report alone, a 422 naming no report, ...): the
  batch can never be accepted as it is; it is removed and the reason logged.

Offline, everything waits in the outbox.

``ServerClock`` keeps the offset between the device's clock and the aggregator's, read
from the HTTP ``Date`` header of every response, so that a device whose clock is wrong
still stamps its reports with an hour the aggregator accepts.

``post`` receives the request body as the outbox assembles it (``Outbox.take``: SQLite
joins the stored JSON texts), so that the thread posting in the background neither
fetches rows one by one nor parses or re-serializes reports: it shares the interpreter
with ``record``, and its work is their wait. Only a 422 makes it parse the batch.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from client.outbox import Outbox

logger = logging.getLogger("ldp.client")

#: Transient answers: the same request may well succeed later, for any client.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
#: Further answers after which the uploader keeps a batch and sends it again later: the
#: key may be restored (401, 403), the server repaired (every 5xx), the request was slow.
_UPLOAD_RETRY_STATUS = RETRYABLE_STATUS | {401, 403, 408}
#: Largest body the uploader sends by default: under the aggregator's default limit.
DEFAULT_MAX_BATCH_BYTES = 2_500_000


def upload_retries(status: int) -> bool:
    """Whether the uploader keeps a batch answered with ``status`` and sends it again."""
    return status in _UPLOAD_RETRY_STATUS or 500 <= status <= 599


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: wait U(0, min(cap, base * 2^attempt))."""

    base: float = 0.5
    cap: float = 60.0
    #: Longest ``Retry-After`` obeyed (a larger or infinite value is treated as this).
    max_retry_after: float = 3600.0

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """The wait before the next attempt: the jittered backoff, or longer if the server
        asked (``Retry-After``, honoured up to ``max_retry_after``)."""
        backoff = rng.uniform(0.0, min(self.cap, self.base * 2.0 ** min(attempt, 30)))
        return max(backoff, min(retry_after or 0.0, self.max_retry_after))


class ServerClock:
    """The aggregator's time, estimated as the device's clock plus an offset.

    The offset is ``Date - local`` at each response carrying an HTTP ``Date`` header
    (RFC 9110, section 6.6.1: whole seconds, the time the response was generated).
    ``Date`` truncates, and the response reaches the device after it was stamped, so
    ``now()`` lags the aggregator's clock by at most one second plus the response's
    transit time: a time read from it is never ahead of the aggregator's.
    """

    def __init__(self, offset: float = 0.0, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.offset = offset
        #: Whether a response has set the offset since this object was made.
        self.observed = False

    def now(self) -> float:
        """The aggregator's estimated time (seconds since the epoch)."""
        return self._clock() + self.offset

    def observe(self, response: httpx.Response) -> None:
        """Take the offset from ``response``'s ``Date`` header (kept if there is none or it
        does not parse). An ``httpx`` response event hook."""
        server = _http_date(response.headers.get("date"))
        if server is not None:
            self.offset, self.observed = server - self._clock(), True


@dataclass
class UploadStats:
    batches_sent: int = 0
    reports_acknowledged: int = 0
    reports_refused: int = 0
    retries: int = 0
    last_error: str | None = None


class Uploader:
    """The background thread that drains an ``Outbox`` into the aggregator."""

    def __init__(
        self,
        outbox: Outbox,
        post: Callable[[bytes], httpx.Response],
        batch_size: int = 512,
        interval: float = 5.0,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        on_tick: Callable[[], None] | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        """``on_tick`` runs on the background thread at every wake-up (before any post)."""
        if batch_size < 1 or interval <= 0 or max_batch_bytes < 1:
            raise ValueError("batch_size and max_batch_bytes must be >= 1 and interval > 0")
        self._outbox, self._post = outbox, post
        self.batch_size, self.interval = batch_size, interval
        self.max_batch_bytes = max_batch_bytes
        self._retry = retry or RetryPolicy()
        self._on_tick = on_tick
        self._rng = rng or random.Random()
        self._wake = threading.Condition()
        self._pending_wake = False
        self._stopping = False
        self._attempt = 0
        self._not_before = 0.0
        self.stats = UploadStats()
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ldp-uploader", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A report was queued: upload now if it completed a batch (not during a backoff:
        offline, a device must not wake its radio for every report)."""
        if len(self._outbox) % self.batch_size == 0 and time.monotonic() >= self._not_before:
            self._kick()

    def flush(self, timeout: float) -> bool:
        """Upload until the outbox is empty or ``timeout`` passes; True when empty."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._outbox) == 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if time.monotonic() >= self._not_before:
                self._send_once(timeout=remaining)
            else:
                time.sleep(min(remaining, self._not_before - time.monotonic(), 0.05))

    def stop(self, timeout: float) -> bool:
        """Deliver what can be delivered within ``timeout``, then stop the thread."""
        delivered = self.flush(timeout)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=max(1.0, timeout))
        return delivered

    def _kick(self) -> None:
        with self._wake:
            self._pending_wake = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._pending_wake and not self._stopping:
                    self._wake.wait(timeout=self._wait_seconds())
                self._pending_wake = False
                if self._stopping:
                    return
            if self._on_tick is not None:
                self._on_tick()  # e.g. refresh the metric specs when due
            if time.monotonic() >= self._not_before and len(self._outbox):
                self._send_once(timeout=None)

    def _wait_seconds(self) -> float:
        """Until the next periodic upload, or the end of a backoff if that comes first."""
        backoff = self._not_before - time.monotonic()
        return max(0.01, min(self.interval, backoff)) if backoff > 0 else self.interval

    def _send_once(self, timeout: float | None) -> None:
        """Post one batch of the oldest reports and act on the answer."""
        with self._send_lock:
            if time.monotonic() < self._not_before:  # another sender just met a backoff
                return
            batch = self._outbox.take(self.batch_size, self.max_batch_bytes)
            if batch is None:
                return
            try:
                response = self._post(batch.body)
            except httpx.TransportError as error:
                self._back_off(f"{type(error).__name__}: {error}", None)
                return
            self.stats.batches_sent += 1
            status = response.status_code
            if status == 200:
                self._outbox.discard(batch)
                self.stats.reports_acknowledged += batch.count
                self._attempt, self._not_before = 0, 0.0
                if len(self._outbox) >= self.batch_size:
                    self._kick()
            elif upload_retries(status):
                self._back_off(f"HTTP {status}", retry_after_seconds(response))
            elif status == 413 and batch.count > 1:
                self.max_batch_bytes = max(1, min(self.max_batch_bytes, len(batch.body)) // 2)
                logger.warning(
                    "the aggregator refused a body of %d bytes as too large (HTTP 413); "
                    "sending the same reports again in bodies of at most %d bytes",
                    len(batch.body),
                    self.max_batch_bytes,
                )
                self._kick()
            elif status == 422 and (named := _named_reports(response, batch.body)):
                dropped = self._outbox.discard_ids(batch, set(named.values()))
                if not dropped:  # named reports already gone: do not spin on the same answer
                    self._back_off("HTTP 422 naming no queued report", None)
                    return
                self.stats.reports_refused += dropped
                logger.error(
                    "the aggregator refused %d of a batch of %d reports (HTTP 422, reports %s); "
                    "dropped those, sending the rest again: %s",
                    dropped,
                    batch.count,
                    sorted(named),
                    response.text[:500],
                )
                self._kick()
            else:
                self._outbox.discard(batch)
                self.stats.reports_refused += batch.count
                logger.error(
                    "the aggregator refused a batch of %d reports (HTTP %d); dropped: %s",
                    batch.count,
                    status,
                    response.text[:500],
                )

    def _back_off(self, reason: str, retry_after: float | None) -> None:
        delay = self._retry.delay(self._attempt, retry_after, self._rng)
        self._attempt += 1
        self._not_before = time.monotonic() + delay
        self.stats.retries += 1
        self.stats.last_error = reason
        logger.warning("upload failed (%s); retrying in %.2f s", reason, delay)


def retry_after_seconds(response: httpx.Response) -> float | None:
    """Seconds from a ``Retry-After`` header, if any: delta-seconds, or an HTTP-date
    (RFC 9110, section 10.2.3) counted from the response's own ``Date`` (so that the
    device's clock does not matter), or from the device's clock if it has none."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        until = _http_date(value)
        if until is None:
            return None  # unreadable: the jittered backoff applies
        now = _http_date(response.headers.get("date"))
        return max(0.0, until - (time.time() if now is None else now))
    return None if math.isnan(seconds) else max(0.0, seconds)  # inf: capped by the policy


def _http_date(value: str | None) -> float | None:
    """An HTTP-date (IMF-fixdate or the obsolete forms) as seconds since the epoch."""
    if not value:
        return None
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if moment.tzinfo is None:  # the obsolete forms carry no zone: HTTP dates are GMT
        return None
    return moment.timestamp()


def _named_reports(response: httpx.Response, body: bytes) -> dict[int, str]:
    """The reports a 422 problem document names (``errors[].report``): index -> id of the
    report at that index of the batch ``body``. Empty if it names none it could mean."""
    try:
        problem: Any = response.json()
        errors = problem.get("errors") if isinstance(problem, dict) else None
        indices = {
            item["report"]
            for item in errors or []
            if isinstance(item, dict) and type(item.get("report")) is int
        }
    except ValueError:
        return {}
    if not indices:
        return {}
    reports = json.loads(body)["reports"]
    return {i: reports[i]["report_id"] for i in indices if 0 <= i < len(reports)}
