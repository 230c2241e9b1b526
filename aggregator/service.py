"""The aggregator's operations, independent of HTTP: define metrics, ingest, estimate, compact.

Routes (``aggregator/app.py``) validate and delegate here; the math is the mechanisms'
(``shared/mechanisms``); the state is ``Storage``'s. One ``Aggregator`` per process.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from aggregator.estimates import EstimateWindow, build_estimate
from aggregator.ingest import BatchRejected, prepare, utc_now
from aggregator.registry import check_metric_name
from aggregator.settings import Settings
from aggregator.storage import Storage
from shared.mechanisms import Mechanism, make_mechanism
from shared.schemas import IngestResult, MetricDefinition, MetricSpec, ReportBatch

logger = logging.getLogger("ldp.aggregator")


class UnknownMetricError(LookupError):
    """No such metric, or no such version of it."""


class NotEnoughReportsError(Exception):
    """Fewer reports in the window than the release threshold."""

    def __init__(self, n: int, needed: int) -> None:
        super().__init__(
            f"the window holds {n} reports; at least {needed} are needed before an estimate "
            "is released"
        )
        self.n, self.needed = n, needed


class Catalog:
    """Every metric version, cached in memory with its mechanism.

    Another process may define a version this one has not seen: a lookup that misses
    reloads from storage (at most once per ``refresh_seconds``), so reports for a new
    version are accepted by every process without a restart.
    """

    def __init__(self, storage: Storage, refresh_seconds: float = 1.0) -> None:
        self._storage = storage
        self._refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._metrics: dict[tuple[str, int], MetricSpec] = {}
        self._mechanisms: dict[tuple[str, int], Mechanism] = {}
        self._loaded_at = -float("inf")
        self.reload()

    def reload(self) -> None:
        """Read every metric version; one whose mechanism cannot be built is left out (logged)."""
        with self._lock:
            known_metrics, known = dict(self._metrics), dict(self._mechanisms)
        metrics: dict[tuple[str, int], MetricSpec] = {}
        mechanisms: dict[tuple[str, int], Mechanism] = {}
        for metric in self._storage.metrics():
            key = (metric.name, metric.version)
            if key in known and known_metrics[key].mechanism == metric.mechanism:
                mechanisms[key] = known[key]
            else:
                try:
                    mechanisms[key] = make_mechanism(metric.mechanism)
                except ValueError as error:
                    logger.error("metric %s version %s is unusable: %s", *key, error)
                    continue
            metrics[key] = metric
        with self._lock:
            self._metrics, self._mechanisms = metrics, mechanisms
            self._loaded_at = time.monotonic()

    def get(self, name: str, version: int | None = None) -> MetricSpec | None:
        """A version of ``name`` (its latest when ``version`` is None), or None."""
        found = self._lookup(name, version)
        if found is None and time.monotonic() - self._loaded_at >= self._refresh_seconds:
            self.reload()
            found = self._lookup(name, version)
        return found

    def _lookup(self, name: str, version: int | None) -> MetricSpec | None:
        with self._lock:
            if version is not None:
                return self._metrics.get((name, version))
            versions = [m for (n, _), m in self._metrics.items() if n == name]
        return max(versions, key=lambda m: m.version) if versions else None

    def mechanism(self, name: str, version: int) -> Mechanism | None:
        if self.get(name, version) is None:
            return None
        with self._lock:
            return self._mechanisms[(name, version)]

    def latest(self) -> list[MetricSpec]:
        """The current version of every metric, by name."""
        self.reload()
        with self._lock:
            best: dict[str, MetricSpec] = {}
            for metric in self._metrics.values():
                if metric.name not in best or metric.version > best[metric.name].version:
                    best[metric.name] = metric
        return [best[name] for name in sorted(best)]

    def versions(self, name: str) -> list[MetricSpec]:
        self.reload()
        with self._lock:
            found = [m for (n, _), m in self._metrics.items() if n == name]
        return sorted(found, key=lambda m: m.version)


@dataclass
class CompactionResult:
    groups: int
    rows_merged: int


class Aggregator:
    """Define metrics, ingest batches exactly once, publish estimates, compact statistics."""

    def __init__(self, settings: Settings, storage: Storage | None = None) -> None:
        self.settings = settings
        self.storage = storage or Storage(settings.database)
        self.catalog = Catalog(self.storage)

    def close(self) -> None:
        self.storage.close()

    def define(self, name: str, definition: MetricDefinition) -> tuple[MetricSpec, bool]:
        check_metric_name(name)
        make_mechanism(definition.mechanism)  # refuse a spec the mechanism cannot serve
        metric, created = self.storage.define_metric(name, definition)
        self.catalog.reload()
        return metric, created

    def define_missing(self, definitions: dict[str, MetricDefinition]) -> None:
        """Define each metric that does not exist yet (never a new version of one that does)."""
        for name, definition in definitions.items():
            if self.catalog.get(name) is None:
                self.define(name, definition)

    def ingest(self, batch: ReportBatch, now: datetime | None = None) -> IngestResult:
        """Validate, then store every report of ``batch`` or none (``BatchRejected``)."""
        if len(batch.reports) > self.settings.max_batch_reports:
            raise BatchRejected(
                "Batch too large",
                [
                    {
                        "report": None,
                        "field": "reports",
                        "message": f"{len(batch.reports)} reports; at most "
                        f"{self.settings.max_batch_reports} per batch",
                    }
                ],
                status=413,
                reason="too_large",
            )
        now = now or utc_now()
        oldest = now - timedelta(hours=self.settings.dedupe_retention_hours)
        prepared, repeated = prepare(batch, self.catalog, self.settings.bucket_seconds, now, oldest)
        accepted, duplicates = self.storage.ingest(prepared.ids, prepared.fold)
        return IngestResult(accepted=accepted, duplicates=duplicates + repeated)

    def estimate(
        self,
        name: str,
        version: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        candidates: list[str] | None = None,
    ) -> dict[str, object]:
        """The estimate of one metric version over ``start <= time < end`` (JSON-ready)."""
        metric = self.catalog.get(name, version)
        if metric is None:
            what = f"metric {name!r}" + (f" version {version}" if version is not None else "")
            raise UnknownMetricError(f"no {what}")
        mechanism = self.catalog.mechanism(metric.name, metric.version)
        assert mechanism is not None
        window = EstimateWindow.of(start, end, self.settings.bucket_seconds)
        rows = self.storage.partial_rows(metric.name, metric.version, window.first, window.stop)
        stats = mechanism.empty_statistics()
        for row in rows:
            stats = stats.merge(mechanism.statistics_from_bytes(row.stats))
        if stats.n < self.settings.min_reports:
            raise NotEnoughReportsError(stats.n, self.settings.min_reports)
        return build_estimate(metric, mechanism, stats, window, candidates)

    def compact(self) -> CompactionResult:
        """Merge each (metric, version, bucket)'s partial rows into one."""
        groups = merged = 0
        for metric, version, bucket in self.storage.groups_to_compact():
            mechanism = self.catalog.mechanism(metric, version)
            if mechanism is None:
                continue

            def merge(blobs: list[bytes], mechanism: Mechanism = mechanism) -> tuple[int, bytes]:
                total = mechanism.empty_statistics()
                for blob in blobs:
                    total = total.merge(mechanism.statistics_from_bytes(blob))
                return total.n, total.to_bytes()

            rows = self.storage.compact_group(metric, version, bucket, merge)
            groups += rows > 0
            merged += rows
        return CompactionResult(groups, merged)
