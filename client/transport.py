"""Uploading the outbox: a background thread posts batches and removes what was acknowledged.

Every ``interval`` seconds, or as soon as ``batch_size`` reports wait, the uploader
posts the oldest reports to ``POST /v1/reports``. On 200 it removes them (accepted or
duplicate: either way the aggregator has them). It retries, with exponential backoff
and full jitter (and never sooner than a ``Retry-After`` header says), only on
connection errors, timeouts, 429, 502, 503 and 504; the same reports go again with the
same ids, never perturbed anew. Any other answer (400-499 but 429, or 500) means the
batch can never be accepted: it is removed and the reason logged. Offline, everything
waits in the outbox.

``post`` receives the request body as the outbox assembles it (``Outbox.take``: SQLite
joins the stored JSON texts), so that the thread posting in the background neither
fetches rows one by one nor parses or re-serializes reports: it shares the interpreter
with ``record``, and its work is their wait.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from client.outbox import Outbox

logger = logging.getLogger("ldp.client")

#: Answers after which the same batch is sent again later.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


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
    ) -> None:
        if batch_size < 1 or interval <= 0:
            raise ValueError("batch_size must be >= 1 and interval > 0")
        self._outbox, self._post = outbox, post
        self.batch_size, self.interval = batch_size, interval
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
            batch = self._outbox.take(self.batch_size)
            if batch is None:
                return
            try:
                response = self._post(batch.body)
            except httpx.TransportError as error:
                self._back_off(f"{type(error).__name__}: {error}", None)
                return
            self.stats.batches_sent += 1
            if response.status_code == 200:
                self._outbox.discard(batch)
                self.stats.reports_acknowledged += batch.count
                self._attempt, self._not_before = 0, 0.0
                if len(self._outbox) >= self.batch_size:
                    self._kick()
            elif response.status_code in RETRYABLE_STATUS:
                self._back_off(f"HTTP {response.status_code}", retry_after_seconds(response))
            else:
                self._outbox.discard(batch)
                self.stats.reports_refused += batch.count
                logger.error(
                    "the aggregator refused a batch of %d reports (HTTP %d); dropped: %s",
                    batch.count,
                    response.status_code,
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
    """Seconds from a ``Retry-After`` header (delta-seconds form), if any."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # the HTTP-date form: the jittered backoff applies
    return None if math.isnan(seconds) else max(0.0, seconds)  # inf: capped by the policy
