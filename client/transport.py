"""Uploading the outbox: a background thread posts batches and removes what was acknowledged.

Every ``interval`` seconds, or as soon as ``batch_size`` reports wait, the uploader
posts the oldest reports to ``POST /v1/reports``, at most ``batch_size`` of them in a body
of at most ``max_batch_bytes`` (the aggregator's default limit is 2,560,000 bytes; a
report alone larger than that still goes alone). A report was paid for with privacy
budget before it was queued, so it leaves the outbox only when the aggregator has it or
has said precisely that it can never take it:

* 200: removed (accepted or duplicate: either way the aggregator has them).
* Connection errors, timeouts, 408, 429 and every 5xx: kept, and the same batch goes
  again (same ids, never perturbed anew) after exponential backoff with full jitter,
  never sooner than a ``Retry-After`` header says (``RetryPolicy``); each retry is logged
  at WARNING.
* 401, 403 (the key is unknown, revoked, or of another role), 404 and 405 (no aggregator
  at this endpoint: ``POST /v1/reports`` exists on every one): a refusal of the device,
  not of its reports, and no network blip: it stays until someone fixes the key or the
  endpoint. The reports are kept, across restarts (bounded by the outbox's own limits),
  for a corrected key or endpoint, or a key restored on the server, to deliver; the same
  batch goes again only after ``RetryPolicy.refused_delay`` (jittered), the refusal is
  logged once at WARNING with the server's reason, and ``flush`` returns False at once
  rather than waiting out its timeout.
* 422 naming reports (the problem document's ``errors[].report``, the index of a report
  in the batch): only the named reports are removed, the reason logged, and the rest
  sent again at once (a batch is stored all or nothing, so none of it was counted).
* 413 for a batch of several reports: the server takes smaller bodies than this device
  sends; ``max_batch_bytes`` is halved (to the body's size at most) and the same reports
  go again at once, in smaller batches.
* Any other answer (400, 409, 413 for one report alone, a 422 naming no report, ...): the
  batch can never be accepted as it is; it is removed and the reason logged.

Offline, everything waits in the outbox. Every failed upload leaves an ``UploadError``
(``Uploader.last_error``: the status, the problem document's ``detail`` (RFC 9457),
whether it is permanent, when, and how many reports it cost) until an upload succeeds.

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
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from client.outbox import Outbox

logger = logging.getLogger("ldp.client")

#: Transient answers: the same request may well succeed later, for any client.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
#: Further answers after which the uploader keeps a batch and soon sends it again: the
#: server may be repaired (every 5xx), the request was slow.
_UPLOAD_RETRY_STATUS = RETRYABLE_STATUS | {408}
#: Answers that refuse the device, not its reports: its key (401: unknown or revoked; 403:
#: of another role) or its endpoint (404, 405: no aggregator there). Only a person can
#: lift them (or a key restored on the server): the batch is kept and sent again rarely.
REFUSED_STATUS = frozenset({401, 403, 404, 405})
#: Largest body the uploader sends by default: under the aggregator's default limit.
DEFAULT_MAX_BATCH_BYTES = 2_500_000


def upload_retries(status: int) -> bool:
    """Whether the uploader keeps a batch answered with ``status`` and soon sends it again
    (with backoff; a refusal of the device, ``REFUSED_STATUS``, waits much longer)."""
    return status in _UPLOAD_RETRY_STATUS or 500 <= status <= 599


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: wait U(0, min(cap, base * 2^attempt))."""

    base: float = 0.5
    cap: float = 60.0
    #: Longest ``Retry-After`` obeyed (a larger or infinite value is treated as this).
    max_retry_after: float = 3600.0
    #: Wait after a refusal of the device (``REFUSED_STATUS``) before the same reports go
    #: again: long, since a key or an endpoint is fixed by a person, not by waiting; but
    #: finite, since a key may be restored on the server.
    refused_delay: float = 900.0

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.cap > 0 and self.refused_delay > 0):
            raise ValueError(
                f"RetryPolicy needs base, cap and refused_delay > 0, got base={self.base!r}, "
                f"cap={self.cap!r}, refused_delay={self.refused_delay!r}"
            )

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """The wait before the next attempt: the jittered backoff, or longer if the server
        asked (``Retry-After``, honoured up to ``max_retry_after``)."""
        backoff = rng.uniform(0.0, min(self.cap, self.base * 2.0 ** min(attempt, 30)))
        return max(backoff, min(retry_after or 0.0, self.max_retry_after))

    def refused(self, retry_after: float | None, rng: random.Random) -> float:
        """The wait after a refusal of the device: U(refused_delay / 2, refused_delay), so
        that a fleet whose key was revoked at once does not come back at once; or longer
        if the server asked (``Retry-After``, up to ``max_retry_after``)."""
        wait = rng.uniform(0.5 * self.refused_delay, self.refused_delay)
        return max(wait, min(retry_after or 0.0, self.max_retry_after))


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


@dataclass(frozen=True)
class UploadError:
    """Why the last upload failed (``TelemetryClient.last_error``, until one succeeds).

    ``status`` is the HTTP status, None when no answer came (offline, a timeout);
    ``detail`` the reason: the ``detail`` of the server's problem document (RFC 9457),
    e.g. "the key is unknown or revoked", or the connection error. ``permanent``: the same
    upload would get the same answer until someone acts, either because the device is
    refused (401, 403: its key; 404, 405: its endpoint), its reports kept and sent again
    only every ``RetryPolicy.refused_delay``, or because the aggregator can never take
    the reports (``dropped`` of them were dropped). ``time``: when (UTC, by the device's
    clock).
    """

    status: int | None
    detail: str
    permanent: bool
    time: datetime
    dropped: int = 0

    def __str__(self) -> str:
        answer = "no answer" if self.status is None else f"HTTP {self.status}"
        return f"{answer}: {self.detail}"


@dataclass
class UploadStats:
    batches_sent: int = 0
    reports_acknowledged: int = 0
    reports_refused: int = 0
    retries: int = 0


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``on_tick`` runs on the background thread at every wake-up (before any post);
        ``clock`` (seconds since the epoch) dates each ``UploadError``."""
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
        self._clock = clock
        self._last_error: UploadError | None = None
        #: The last answer refused the device (``REFUSED_STATUS``): ``flush`` returns at once.
        self._refused = False
        #: The refusal last logged at WARNING, as (status, detail): logged once, not per retry.
        self._logged_refusal: tuple[int, str] | None = None
        self.stats = UploadStats()
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ldp-uploader", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A report was queued: upload now if it completed a batch (not during a backoff:
        offline, a device must not wake its radio for every report)."""
        if len(self._outbox) % self.batch_size == 0 and time.monotonic() >= self._not_before:
            self._kick()

    @property
    def last_error(self) -> UploadError | None:
        """Why the last upload failed; None before any failed and once one succeeded."""
        return self._last_error

    def flush(self, timeout: float) -> bool:
        """Upload until the outbox is empty or ``timeout`` passes; True when empty. False
        at once when the aggregator refuses the device (``last_error`` says why): waiting
        would not lift a refusal that only a person can (a new key, a restored one)."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._outbox) == 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._refused and time.monotonic() < self._not_before):
                return False
            if time.monotonic() >= self._not_before:
                self._send_once(timeout=remaining)
                if self._refused:
                    return False
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
                try:
                    self._on_tick()  # e.g. refresh the metric specs when due
                except Exception:  # noqa: BLE001 - the thread must go on uploading
                    logger.exception("the uploader's periodic task failed; uploading goes on")
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
                self._back_off(self._error(None, f"{type(error).__name__}: {error}"), None)
                return
            self.stats.batches_sent += 1
            status = response.status_code
            self._refused = status in REFUSED_STATUS
            if status == 200:
                self._outbox.discard(batch)
                self.stats.reports_acknowledged += batch.count
                self._attempt, self._not_before = 0, 0.0
                self._last_error, self._logged_refusal = None, None
                if len(self._outbox) >= self.batch_size:
                    self._kick()
            elif self._refused:
                self._refuse(response)
            elif upload_retries(status):
                failure = self._error(status, problem_detail(response))
                self._back_off(failure, retry_after_seconds(response))
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
                    self._back_off(self._error(status, "it names no report still queued"), None)
                    return
                self.stats.reports_refused += dropped
                self._last_error = self._error(
                    status, problem_detail(response), permanent=True, dropped=dropped
                )
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
                self._last_error = self._error(
                    status, problem_detail(response), permanent=True, dropped=batch.count
                )
                logger.error(
                    "the aggregator refused a batch of %d reports (HTTP %d); dropped: %s",
                    batch.count,
                    status,
                    response.text[:500],
                )

    def _error(
        self, status: int | None, detail: str, permanent: bool = False, dropped: int = 0
    ) -> UploadError:
        """An ``UploadError`` dated now by the device's clock."""
        moment = datetime.fromtimestamp(self._clock(), UTC)
        return UploadError(status, detail, permanent, moment, dropped)

    def _back_off(self, error: UploadError, retry_after: float | None) -> None:
        """A transient failure: the same batch again after the jittered backoff."""
        delay = self._retry.delay(self._attempt, retry_after, self._rng)
        self._attempt += 1
        self._not_before = time.monotonic() + delay
        self.stats.retries += 1
        self._last_error, self._refused = error, False
        logger.warning("upload failed (%s); retrying in %.2f s", error, delay)

    def _refuse(self, response: httpx.Response) -> None:
        """A refusal of the device: the batch is kept and goes again only after
        ``RetryPolicy.refused_delay``; logged at WARNING once until the answer changes
        or an upload succeeds (at DEBUG on each later attempt)."""
        status, detail = response.status_code, problem_detail(response)
        error = self._last_error = self._error(status, detail, permanent=True)
        delay = self._retry.refused(retry_after_seconds(response), self._rng)
        self._not_before = time.monotonic() + delay
        self.stats.retries += 1
        if self._logged_refusal == (status, detail):
            logger.debug("upload refused again (%s); trying again in %.0f s", error, delay)
            return
        self._logged_refusal = (status, detail)
        what = "API key" if status in (401, 403) else "endpoint"
        logger.warning(
            "the aggregator refuses this device's uploads (%s); fix the %s: the %d queued "
            "reports are kept and sent again every %.3g-%.3g s (TelemetryClient.last_error)",
            error,
            what,
            len(self._outbox),
            self._retry.refused_delay / 2,
            self._retry.refused_delay,
        )


def problem_detail(response: httpx.Response) -> str:
    """The server's reason for an error answer: its problem document's ``detail`` (RFC
    9457), else its ``title``, else the start of its body, else the status's phrase."""
    try:
        problem: Any = response.json()
    except ValueError:  # not JSON (a proxy's HTML page, say), or not text
        problem = None
    if isinstance(problem, dict):
        for field in ("detail", "title"):
            text = problem.get(field)
            if isinstance(text, str) and text.strip():
                return text.strip()[:500]
    text = response.text.strip()
    return text[:200] if text else response.reason_phrase


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
