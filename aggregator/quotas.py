"""Per-key report quotas: a device key may send at most N reports per metric per hour.

One leaked device key could otherwise stand for any number of devices. With
``reports_per_key_per_hour`` set, ``KeyQuotas.reserve`` counts each batch's reports per
metric against its key's quota for the current hour (``key_usage``, shared by every
aggregator process over one database); a batch that would pass it is refused whole with
``QuotaExceededError`` (429, ``Retry-After``: the seconds to the next hour), nothing
stored. Reports are counted when offered: a retried batch counts again, so a quota should
leave room for retries. A batch the service then fails to store (503) is refunded.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from aggregator.repositories.quotas import KeyUsageRepository

__all__ = ["KeyQuotas", "QuotaExceededError", "Reservation"]

#: Hours of counts kept before the oldest are purged (they limit nothing any more).
_KEEP_HOURS = 2


class QuotaExceededError(Exception):
    """A device key's batch would pass its hourly quota of one metric."""

    def __init__(self, key_id: str, metric: str, used: int, limit: int, retry_after: int) -> None:
        self.key_id, self.metric, self.used, self.limit = key_id, metric, used, limit
        self.retry_after = retry_after
        super().__init__(
            f"device key {key_id} has sent {used} of its {limit} reports of metric "
            f"{metric!r} this hour, and this batch would pass that; nothing of it was stored. "
            f"The quota resets in {retry_after} s"
        )


@dataclass
class Reservation:
    """Reports counted against a key's quota, until the batch is stored (or refunded)."""

    quotas: KeyQuotas
    key_id: str
    counts: dict[str, int]
    hour: int

    def refund(self) -> None:
        self.quotas.repository.refund(self.key_id, self.counts, self.hour)


class KeyQuotas:
    """The hourly report quota of every device key (``limit`` reports per metric)."""

    def __init__(self, repository: KeyUsageRepository, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a quota must allow at least one report, got {limit}")
        self.repository, self.limit = repository, limit
        self._purged_before = 0

    def reserve(self, key_id: str, counts: dict[str, int], now: float | None = None) -> Reservation:
        """Count ``counts`` (metric -> reports) against ``key_id``'s quota this hour, or
        raise ``QuotaExceededError`` having counted nothing."""
        now = time.time() if now is None else now
        hour = int(now // 3600)
        if hour - _KEEP_HOURS > self._purged_before:
            self._purged_before = hour - _KEEP_HOURS
            self.repository.purge(self._purged_before)
        verdict = self.repository.reserve(key_id, counts, hour, self.limit)
        if not verdict.fits:
            assert verdict.metric is not None
            retry_after = max(1, math.ceil((hour + 1) * 3600 - now))
            raise QuotaExceededError(key_id, verdict.metric, verdict.used, self.limit, retry_after)
        return Reservation(self, key_id, counts, hour)
