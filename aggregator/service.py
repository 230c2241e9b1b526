"""The aggregator's operations, independent of HTTP: define metrics, ingest, estimate, compact.

Routes (``aggregator/routes/``) validate and delegate here, and the exceptions raised
here are plain domain errors (``aggregator/errors.py`` answers them); the math is the
mechanisms' (``shared/mechanisms``); the state is the metrics and reports repositories'
(``aggregator/repositories/``). ``Services.open(settings)`` opens the database and builds
one ``Aggregator``, ``Federated`` and ``KeyRing`` over it, each given the repositories it
uses; one set per process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from aggregator.auth import KeyRing
from aggregator.catalog import Catalog
from aggregator.estimates import (
    MAX_HEAVY_HITTERS,
    EstimateWindow,
    ReleasedBuckets,
    Selection,
    SeriesGrid,
    SeriesIntegrity,
    SeriesStepName,
    breakdown,
    build_estimate,
    build_heavy_hitters,
    build_series,
    check_breakdown,
    current_bucket,
    grouped_statistics,
    merged_statistics,
    series_strings,
)
from aggregator.federated import Federated
from aggregator.ingest import BatchTooLargeError, ReportsRefusedError, prepare, utc_now
from aggregator.integrity import integrity_fields
from aggregator.quotas import KeyQuotas, Reservation
from aggregator.registry import check_metric_name
from aggregator.repositories.metrics import MetricsRepository
from aggregator.repositories.reports import PROFILE, STATS, PartialRow, ReportsRepository
from aggregator.settings import Settings
from aggregator.storage import Repositories, StorageHealth, StorageUnavailableError
from aggregator.value_listing import DEFAULT_VIEW, ValueView
from shared.mechanisms import Mechanism, as_discovery, make_mechanism
from shared.schemas import (
    IngestResult,
    MetricDefinition,
    MetricDocument,
    MetricSpec,
    ReportBatch,
)
from shared.statistics import CountStatistics

__all__ = [
    "Aggregator",
    "CompactionResult",
    "InvalidEstimateError",
    "InvalidMetricError",
    "NotDiscoveryMetricError",
    "NotEnoughReportsError",
    "Services",
    "StorageUnavailableError",
    "UnknownMetricError",
]


class UnknownMetricError(LookupError):
    """No such metric, or no such version of it."""


class InvalidMetricError(ValueError):
    """A metric definition the service refuses (its name, its spec or its labels)."""


class InvalidEstimateError(ValueError):
    """An estimate request the service refuses (its window, its candidates or its k)."""


class NotDiscoveryMetricError(InvalidEstimateError):
    """Heavy hitters asked of a metric whose mechanism cannot find strings by itself."""


class NotEnoughReportsError(Exception):
    """No time bucket in the window holds the release threshold's number of reports
    (``pending`` of the window's ``n`` reports are in the current bucket, still filling).
    For a metric with dimensions (``per_cell``) the threshold applies to each time bucket
    of each cell, and the message says so."""

    def __init__(
        self, n: int, needed: int, buckets: int, pending: int = 0, per_cell: bool = False
    ) -> None:
        unit = "time bucket of one cell" if per_cell else "time bucket"
        units = "time buckets of one cell" if per_cell else "time buckets"
        where = f" in {buckets} {unit if buckets == 1 else units}" if buckets else ""
        waiting = (
            f" ({pending} of them in the current time bucket, which is still filling: they "
            f"are released once it holds {needed})"
            if pending
            else ""
        )
        super().__init__(
            f"the window holds {n} reports{where}; an estimate is built only from {units} "
            f"holding at least {needed} reports each, and the window has none{waiting}"
        )
        self.n, self.needed, self.buckets, self.pending = n, needed, buckets, pending


@dataclass
class CompactionResult:
    groups: int
    rows_merged: int


class Aggregator:
    """Define metrics, ingest batches exactly once, publish estimates, compact statistics.

    Over the ``catalog`` of the ``metrics`` repository (which stores definitions), the
    ``reports`` repository (ids and statistics) and the storage's ``health`` check.
    """

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        metrics: MetricsRepository,
        reports: ReportsRepository,
        health: StorageHealth,
        quotas: KeyQuotas | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self._metrics = metrics
        self._reports = reports
        self._health = health
        self._quotas = quotas

    def ping(self) -> str:
        """The storage dialect's name when the storage can serve now, else
        ``StorageUnavailableError`` (``StorageHealth.check``)."""
        return self._health.check()

    def holds_statistics(self) -> bool:
        """Whether any report statistics are stored."""
        return self._reports.holds_statistics()

    def define(self, name: str, definition: MetricDefinition) -> tuple[MetricSpec, bool]:
        check_metric_name(name)
        make_mechanism(definition.mechanism)  # refuse a spec the mechanism cannot serve
        metric, created = self._metrics.define_metric(name, definition)
        self.catalog.reload()
        return metric, created

    def define_document(self, name: str, document: MetricDocument) -> tuple[MetricSpec, bool]:
        """``define`` from a document as PUT sends it, whose ``name`` (if any) must be
        ``name``; every refusal is an ``InvalidMetricError``."""
        if document.name is not None and document.name != name:
            raise InvalidMetricError(
                f"the body names metric {document.name!r} but the path names {name!r}; "
                "they must agree (omit name from the body, or PUT to its own path)"
            )
        try:
            return self.define(name, document.definition())
        except ValueError as error:
            raise InvalidMetricError(str(error)) from None

    def define_missing(self, definitions: dict[str, MetricDefinition]) -> None:
        """Define each metric that does not exist yet (never a new version of one that does)."""
        for name, definition in definitions.items():
            if self.catalog.get(name) is None:
                self.define(name, definition)

    def ingest(
        self, batch: ReportBatch, now: datetime | None = None, key_id: str | None = None
    ) -> IngestResult:
        """Validate, then store every report of ``batch`` or none: ``BatchTooLargeError``
        past ``max_batch_reports``, ``InvalidBatchError`` naming every invalid report, and
        with quotas set ``QuotaExceededError`` when the device key ``key_id`` would pass
        its hourly quota of a metric (a batch then not stored is refunded)."""
        if len(batch.reports) > self.settings.max_batch_reports:
            raise BatchTooLargeError(
                [
                    {
                        "report": None,
                        "field": "reports",
                        "message": f"{len(batch.reports)} reports; at most "
                        f"{self.settings.max_batch_reports} per batch",
                    }
                ]
            )
        now = now or utc_now()
        oldest = now - timedelta(hours=self.settings.dedupe_retention_hours)
        try:
            prepared, repeated = prepare(
                batch, self.catalog, self.settings.bucket_seconds, now, oldest
            )
        except ReportsRefusedError as refused:
            self._record_refusals(refused)
            raise
        reservation = None
        if self._quotas is not None and key_id is not None:
            counts = Counter(report.metric for report in batch.reports)
            reservation = self._quotas.reserve(key_id, dict(counts), now.timestamp())
        try:
            accepted, duplicates = self._reports.ingest(prepared.ids, prepared.fold)
        except StorageUnavailableError:
            if reservation is not None:
                _refund(reservation)
            raise
        return IngestResult(accepted=accepted, duplicates=duplicates + repeated)

    def _record_refusals(self, refused: ReportsRefusedError) -> None:
        """Count a refused batch's reports by rule (the estimates' ``refused``). The batch
        is answered 422 whether or not this is recorded: with the storage down the count
        is lost, never the answer."""
        try:
            self._reports.record_refusals(refused.refused)
        except StorageUnavailableError:
            pass

    def estimate(
        self,
        name: str,
        version: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        candidates: list[str] | None = None,
        view: ValueView = DEFAULT_VIEW,
        now: datetime | None = None,
        where: list[str] | None = None,
        by: str | None = None,
    ) -> dict[str, object]:
        """The estimate of one metric version over ``start <= time < end`` (JSON-ready),
        listing the categories ``view`` chooses (``aggregator.value_listing``), of the cells
        matching every ``where=NAME:VALUE`` item, and with ``by=NAME[,NAME2]`` one estimate
        per group of those dimensions' values (``breakdown``).

        Only the units (time buckets per cell) holding at least ``min_reports`` reports are
        used (``ReleasedBuckets``; the bucket of ``now``, default the present, is the one
        still filling); ``NotEnoughReportsError`` when the window has none. Each partial
        row is read once and summed into its group and the total (``grouped_statistics``),
        not pairwise. A window, candidates or dimensions that cannot be used raise
        ``InvalidEstimateError``.
        """
        metric, mechanism = self._metric(name, version)
        try:
            selection = Selection.of(metric, where or (), by)
            check_breakdown(metric, mechanism, selection, candidates, view)
            window, released, rows, current = self._released(
                metric, mechanism, start, end, now, selection
            )
            stats, each = grouped_statistics(
                mechanism, released.rows, selection.group_of(released.rows), selection.groups
            )
            return (
                build_estimate(metric, mechanism, stats, window, released, candidates, view)
                | self._integrity(metric, mechanism, window, released.rows, stats)
                | breakdown(
                    metric,
                    mechanism,
                    rows,
                    window,
                    selection,
                    self.settings.min_reports,
                    current,
                    each,
                    candidates,
                    view,
                )
            )
        except ValueError as error:
            raise InvalidEstimateError(str(error)) from None

    def series(
        self,
        name: str,
        step: SeriesStepName = "1h",
        version: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        candidates: list[str] | None = None,
        now: datetime | None = None,
        view: ValueView = DEFAULT_VIEW,
        where: list[str] | None = None,
        by: str | None = None,
    ) -> dict[str, object]:
        """One estimate per step of one metric version over ``[start, end)`` widened to whole
        steps (``SeriesGrid``; JSON-ready in the ``SeriesOut`` shape), each step listing the
        categories ``view`` chooses, of the cells ``where`` keeps and with the groups of
        ``by`` (as ``estimate``).

        Each step's estimate is what ``estimate`` gives for the step's window, or None where
        that is refused for want of reports (the step's ``n`` is still given). The range's
        partial rows are read in one query. A range, step or size that cannot be served
        raises ``InvalidEstimateError``.
        """
        metric, mechanism = self._metric(name, version)
        try:
            now = now or utc_now()
            selection = Selection.of(metric, where or (), by)
            grid = SeriesGrid.of(start, end, step, self.settings.bucket_seconds, now)
            strings = series_strings(metric, mechanism, grid, candidates, view, selection.groups)
            rows = self._reports.partial_rows(metric.name, metric.version, grid.first, grid.stop)
            current = current_bucket(now, self.settings.bucket_seconds)
            integrity = SeriesIntegrity(
                self._reports.partial_rows(
                    metric.name, metric.version, grid.first, grid.stop, PROFILE
                ),
                self._reports.refused_counts(metric.name, metric.version, grid.first, grid.stop),
            )
            return build_series(
                metric,
                mechanism,
                rows,
                grid,
                self.settings.min_reports,
                current,
                strings,
                view,
                selection,
                integrity,
            )
        except ValueError as error:
            raise InvalidEstimateError(str(error)) from None

    def heavy_hitters(
        self,
        name: str,
        k: int,
        version: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        where: list[str] | None = None,
    ) -> dict[str, object]:
        """The ``k`` most frequent strings of a discovery metric (``pem``, ``sfp``) over
        ``start <= time < end``, found without candidates (JSON-ready), among the reports
        of the cells matching every ``where=NAME:VALUE`` item.

        The window, version and release threshold are the estimate's (``estimate``).
        ``NotDiscoveryMetricError`` for a metric of another mechanism, and
        ``InvalidEstimateError`` for a k outside 1..``MAX_HEAVY_HITTERS`` or a window that
        cannot be used.
        """
        metric, mechanism = self._metric(name, version)
        finder = as_discovery(mechanism)
        if finder is None:
            hint = (
                f"; estimate given strings with GET /v1/metrics/{metric.name}/estimate"
                "?candidates=..."
                if metric.mechanism.kind == "string"
                else ""
            )
            raise NotDiscoveryMetricError(
                f"metric {metric.name!r} uses {mechanism.name!r}, which does not find strings "
                f"by itself: heavy hitters need a discovery mechanism (pem or sfp){hint}"
            )
        if not 1 <= k <= MAX_HEAVY_HITTERS:
            raise InvalidEstimateError(f"k must lie in 1..{MAX_HEAVY_HITTERS}, got {k}")
        try:
            selection = Selection.of(metric, where or ())
            window, released, _, _ = self._released(metric, mechanism, start, end, None, selection)
            stats = merged_statistics(mechanism, released.rows)
            assert isinstance(stats, CountStatistics)  # string mechanisms keep counts
            found = build_heavy_hitters(metric, finder, stats, window, released, k)
            return found | selection.as_json()
        except ValueError as error:
            raise InvalidEstimateError(str(error)) from None

    def _metric(self, name: str, version: int | None) -> tuple[MetricSpec, Mechanism[Any]]:
        """The metric version (latest by default) and its mechanism, or ``UnknownMetricError``."""
        metric = self.catalog.get(name, version)
        if metric is None:
            what = f"metric {name!r}" + (f" version {version}" if version is not None else "")
            raise UnknownMetricError(f"no {what}")
        mechanism = self.catalog.mechanism(metric.name, metric.version)
        assert mechanism is not None
        return metric, mechanism

    def _released(
        self,
        metric: MetricSpec,
        mechanism: Mechanism[Any],
        start: datetime | None,
        end: datetime | None,
        now: datetime | None,
        selection: Selection,
    ) -> tuple[EstimateWindow, ReleasedBuckets, list[PartialRow], int]:
        """The window, its released units of the cells ``selection`` keeps (the bucket of
        ``now``, default the present, still filling; ``NotEnoughReportsError`` when there
        are none), the window's rows of those cells, and the start of the current bucket."""
        window = EstimateWindow.of(start, end, self.settings.bucket_seconds)
        rows = selection.rows(
            self._reports.partial_rows(metric.name, metric.version, window.first, window.stop)
        )
        current = current_bucket(now or utc_now(), self.settings.bucket_seconds)
        released = ReleasedBuckets.of(rows, self.settings.min_reports, current)
        if not released.rows:
            raise NotEnoughReportsError(
                released.suppressed_reports,
                released.min_reports,
                released.suppressed_buckets,
                released.pending_reports,
                per_cell=bool(metric.dimension_set),
            )
        return window, released, rows, current

    def _integrity(
        self,
        metric: MetricSpec,
        mechanism: Mechanism[Any],
        window: EstimateWindow,
        released: list[PartialRow],
        stats: object,
    ) -> dict[str, object]:
        """The estimate's ``integrity`` object (``aggregator.integrity``), and ``robust``
        for a numeric metric with a bounded-influence mean."""
        first, stop = window.first, window.stop
        return integrity_fields(
            mechanism,
            released,
            self._reports.partial_rows(metric.name, metric.version, first, stop, PROFILE),
            self._reports.refused_counts(metric.name, metric.version, first, stop),
            stats,
            first if first is not None else -(2**62),
            stop if stop is not None else 2**62,
        )

    def compact(self) -> CompactionResult:
        """Merge each (metric, version, bucket, cell)'s partial rows into one, and each
        one's profile rows into one."""
        groups = merged = 0
        for kind in (STATS, PROFILE):
            for metric, version, bucket, cell in self._reports.groups_to_compact(kind=kind):
                mechanism = self.catalog.mechanism(metric, version)
                if mechanism is None:
                    continue
                rows = self._reports.compact_group(
                    metric, version, bucket, cell, _merger(mechanism, kind), kind
                )
                groups += rows > 0
                merged += rows
        return CompactionResult(groups, merged)


def _refund(reservation: Reservation) -> None:
    """Refund a batch the storage did not take, if the storage takes the refund (else the
    reports stay counted: a quota errs towards refusing)."""
    try:
        reservation.refund()
    except StorageUnavailableError:
        pass


def _merger(mechanism: Mechanism[Any], kind: str) -> Callable[[list[bytes]], tuple[int, bytes]]:
    """How compaction merges serialized rows of ``kind``: the mechanism's statistics, or
    profiles (count vectors)."""

    def merge(blobs: list[bytes]) -> tuple[int, bytes]:
        if kind == PROFILE:
            parts = [CountStatistics.from_bytes(blob) for blob in blobs]
            total: Any = parts[0].merge_many(parts[1:])
        else:
            total = mechanism.empty_statistics().merge_many(
                mechanism.statistics_from_bytes(blob) for blob in blobs
            )
        return total.n, total.to_bytes()  # the smaller of dense and sparse

    return merge


@dataclass(frozen=True)
class Services:
    """The service objects of one process over one set of ``repositories``, each given
    only the repositories it uses; ``close`` closes the repositories."""

    repositories: Repositories
    aggregator: Aggregator
    federated: Federated
    keys: KeyRing

    @classmethod
    def open(cls, settings: Settings, create: bool = True) -> Services:
        """The services over the settings' database; with ``create=False`` a database that
        does not exist yet is refused (``DatabaseNotFoundError``), not created."""
        repositories = Repositories.open(settings.database, settings.database_timeout, create)
        try:
            return cls.over(settings, repositories)
        except BaseException:
            repositories.close()
            raise

    @classmethod
    def over(cls, settings: Settings, repositories: Repositories) -> Services:
        """The services over ``repositories`` (which the caller closes)."""
        health = StorageHealth(repositories.database, repositories.reports)
        catalog = Catalog(repositories.metrics)
        limit = settings.reports_per_key_per_hour
        quotas = KeyQuotas(repositories.key_usage, limit) if limit else None
        aggregator = Aggregator(
            settings, catalog, repositories.metrics, repositories.reports, health, quotas
        )
        return cls(
            repositories, aggregator, Federated(repositories.tasks), KeyRing(repositories.keys)
        )

    def close(self) -> None:
        self.repositories.close()
