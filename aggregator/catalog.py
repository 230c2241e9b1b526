"""The metric catalog: every metric version and its mechanism, cached in memory.

Lookups (``get``, ``mechanism``, ``versions``, ``latest``) answer from memory. At most
once per ``refresh_seconds`` a lookup first reads the storage's change stamp
(``MetricsRepository.metrics_stamp``: one indexed row and a count), and only when the stamp
differs from the one the cache was built at does it read and parse every definition
again. So another process's new metric or version is seen by every lookup made
``refresh_seconds`` or more after it was committed, while a flood of lookups of names
that do not exist costs one cheap read per interval, not a reload each. A version's
spec never changes, so ``mechanism`` consults the stamp only on a miss.

The public documents (``GET /v1/metrics``, ``GET /v1/metrics/{name}/versions``) are
serialized once per catalog state and served as the same bytes with an entity tag
(``Published``), until the catalog changes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

from pydantic import TypeAdapter

from aggregator import observability as obs
from aggregator.repositories.metrics import MetricsRepository
from shared.mechanisms import Mechanism, make_mechanism
from shared.schemas import MetricSpec

logger = logging.getLogger("ldp.aggregator")

_SPECS = TypeAdapter(list[MetricSpec])


@dataclass(frozen=True)
class Published:
    """A JSON document as sent: its bytes and a strong entity tag (RFC 9110, 8.8.3).

    The tag is the quoted first 32 hex digits of SHA-256 of the bytes, so equal
    documents have equal tags in every process.
    """

    body: bytes
    etag: str

    @classmethod
    def of(cls, metrics: list[MetricSpec]) -> Published:
        body = _SPECS.dump_json(metrics)
        return cls(body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


@dataclass
class _Snapshot:
    """One state of the catalog, never changed once built (but for its document cache)."""

    stamp: tuple[str, int] | None
    metrics: dict[tuple[str, int], MetricSpec]
    mechanisms: dict[tuple[str, int], Mechanism]
    by_name: dict[str, list[MetricSpec]] = field(init=False)
    documents: dict[str | None, Published] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_name: dict[str, list[MetricSpec]] = {}
        for metric in sorted(self.metrics.values(), key=lambda m: (m.name, m.version)):
            by_name.setdefault(metric.name, []).append(metric)
        self.by_name = by_name

    def latest(self) -> list[MetricSpec]:
        return [self.by_name[name][-1] for name in sorted(self.by_name)]


class Catalog:
    """Every usable metric version with its mechanism, refreshed when storage changes.

    ``reloads`` counts the full reads of the definitions (also exported as the
    Prometheus counter ``ldp_catalog_reloads_total``).
    """

    def __init__(self, metrics: MetricsRepository, refresh_seconds: float = 1.0) -> None:
        self._metrics = metrics
        self._refresh_seconds = refresh_seconds
        self._refreshing = threading.Lock()  # one thread reads the storage at a time
        self._snapshot = _Snapshot(None, {}, {})
        self._checked_at = -float("inf")
        self.reloads = 0
        self.reload()

    def reload(self) -> None:
        """Read every metric version now; one whose mechanism cannot be built is left out.

        The stamp is read before the definitions, so a change committed in between
        makes the next check reload again rather than go unnoticed.
        """
        with self._refreshing:
            self._load(time.monotonic(), self._metrics.metrics_stamp())

    def _load(self, checked_at: float, stamp: tuple[str, int]) -> None:
        """Read the definitions into a new snapshot, built at ``stamp`` (read from
        ``checked_at`` on, before the definitions)."""
        known = self._snapshot
        metrics: dict[tuple[str, int], MetricSpec] = {}
        mechanisms: dict[tuple[str, int], Mechanism] = {}
        for metric in self._metrics.metrics():
            key = (metric.name, metric.version)
            previous = known.metrics.get(key)
            if previous is not None and previous.mechanism == metric.mechanism:
                mechanisms[key] = known.mechanisms[key]
            else:
                try:
                    mechanisms[key] = make_mechanism(metric.mechanism)
                except ValueError as error:
                    logger.error("metric %s version %s is unusable: %s", *key, error)
                    continue
            metrics[key] = metric
        self._snapshot = _Snapshot(stamp, metrics, mechanisms)
        self._checked_at = checked_at
        self.reloads += 1
        obs.CATALOG_RELOADS.inc()

    def _current(self) -> _Snapshot:
        """The snapshot, after checking the storage's stamp if ``refresh_seconds`` passed.

        While one thread checks, the others go on with the snapshot they have.
        """
        if time.monotonic() - self._checked_at >= self._refresh_seconds:
            if self._refreshing.acquire(blocking=False):
                try:
                    now = time.monotonic()
                    if now - self._checked_at >= self._refresh_seconds:
                        stamp = self._metrics.metrics_stamp()
                        if stamp != self._snapshot.stamp:
                            self._load(now, stamp)
                        else:
                            self._checked_at = now
                finally:
                    self._refreshing.release()
        return self._snapshot

    def get(self, name: str, version: int | None = None) -> MetricSpec | None:
        """A version of ``name`` (its latest when ``version`` is None), or None."""
        snapshot = self._current()
        if version is not None:
            return snapshot.metrics.get((name, version))
        versions = snapshot.by_name.get(name)
        return versions[-1] if versions else None

    def mechanism(self, name: str, version: int) -> Mechanism | None:
        """The mechanism of a version, or None. A version's spec never changes, so only a
        miss consults the storage's stamp (when due): the first report of a version
        defined elsewhere is not held back by the lookups of known ones."""
        found = self._snapshot.mechanisms.get((name, version))
        if found is None:
            found = self._current().mechanisms.get((name, version))
        return found

    def versions(self, name: str) -> list[MetricSpec]:
        """Every version of ``name``, oldest first (empty for an unknown name)."""
        return list(self._current().by_name.get(name, ()))

    def latest(self) -> list[MetricSpec]:
        """The current version of every metric, by name."""
        return self._current().latest()

    def published_latest(self) -> Published:
        """``latest()`` as JSON, serialized once per catalog state."""
        document = self._published(None)
        assert document is not None  # the listing always exists, if empty
        return document

    def published_versions(self, name: str) -> Published | None:
        """``versions(name)`` as JSON, serialized once per catalog state; None if unknown."""
        return self._published(name)

    def _published(self, name: str | None) -> Published | None:
        snapshot = self._current()
        document = snapshot.documents.get(name)
        if document is None:
            if name is None:
                metrics = snapshot.latest()
            elif name in snapshot.by_name:
                metrics = snapshot.by_name[name]
            else:
                return None  # unknown names are never cached: the cache holds known names only
            document = snapshot.documents[name] = Published.of(metrics)
        return document
