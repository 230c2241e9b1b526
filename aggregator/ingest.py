"""Validating a batch of reports and folding it into sufficient statistics.

The wire batch is ``{"reports": [{"report_id", "metric", "version", "payload", "time"}]}``
(``report_id`` a UUID, ``time`` an optional ISO-8601 UTC hour). ``prepare`` checks
everything that can be checked without the database: the envelope (pydantic), the
metric version, the time bucket and every payload (the mechanism's own
``from_payloads``), and groups the reports by metric version. It raises ``BatchRejected`` listing what was wrong, by report index and field,
before anything is written. ``fold`` then turns the reports whose ids turned out new
into ``PartialRow``s: one per (metric, version, time bucket), inside the transaction
that records the ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import numpy as np

from aggregator.storage import PartialRow
from shared.mechanisms import Mechanism
from shared.schemas import ReportBatch

#: Reports may be stamped up to this far ahead of the server's clock (clock skew).
FUTURE_TOLERANCE = timedelta(hours=1)


@dataclass
class BatchRejected(Exception):
    """A batch that cannot be stored, with every problem found (report index, field, why)."""

    title: str
    problems: list[dict[str, Any]]
    status: int = 422
    reason: str = "invalid"

    def __str__(self) -> str:
        return f"{self.title}: " + "; ".join(
            f"report {p['report']}: {p['message']}" if p.get("report") is not None else p["message"]
            for p in self.problems[:5]
        )


@dataclass
class Group:
    """The reports of one metric version within a batch, in the mechanism's array form."""

    metric: str
    version: int
    mechanism: Mechanism
    positions: np.ndarray  # indices into the batch's distinct ids; -1 for a repeated id
    buckets: np.ndarray  # time bucket (start, unix seconds) of each report
    reports: np.ndarray


@dataclass
class PreparedBatch:
    ids: list[bytes]
    groups: list[Group] = field(default_factory=list)

    def fold(self, new: list[bool]) -> list[PartialRow]:
        """Statistics of the reports whose id is new, one row per (metric, version, bucket)."""
        mask = np.asarray(new, dtype=bool)
        rows = []
        for group in self.groups:
            keep = (group.positions >= 0) & mask[np.maximum(group.positions, 0)]
            if not keep.any():
                continue
            reports, buckets = group.reports[keep], group.buckets[keep]
            for bucket in np.unique(buckets):
                stats = group.mechanism.aggregate(reports[buckets == bucket])
                rows.append(
                    PartialRow(group.metric, group.version, int(bucket), stats.n, stats.to_bytes())
                )
        return rows


class MechanismLookup(Protocol):
    """Where ``prepare`` finds metric versions (``aggregator.catalog.Catalog``)."""

    def mechanism(self, name: str, version: int) -> Mechanism | None: ...

    def versions(self, name: str) -> list[Any]: ...


def prepare(
    batch: ReportBatch,
    catalog: MechanismLookup,
    bucket_seconds: int,
    now: datetime,
    oldest: datetime | None = None,
) -> tuple[PreparedBatch, int]:
    """Check every report of a batch and group them; ``(prepared, repeats within the batch)``.

    Reports stamped before ``oldest`` (when given) are refused: their ids may no longer
    be kept. A report id that occurs twice in the batch is checked both times and
    counted once (the repeat is a duplicate).
    """
    problems: list[dict[str, Any]] = []
    first_position: dict[bytes, int] = {}
    ids: list[bytes] = []
    members: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    current = int(now.timestamp()) // bucket_seconds * bucket_seconds
    latest = now + FUTURE_TOLERANCE
    resolved = _resolve(batch, catalog)
    buckets: dict[datetime, int] = {}  # a batch names few hours: each is converted once
    for index, report in enumerate(batch.reports):
        group_key = (report.metric, report.version)
        found = resolved[group_key]
        if isinstance(found, Missing):
            problems.append(_problem(index, found.field, found.message))
            continue
        if report.time is None:
            bucket = current
        elif (cached := buckets.get(report.time)) is not None:
            bucket = cached
        elif report.time > latest:
            problems.append(
                _problem(index, "time", f"time {report.time.isoformat()} is in the future")
            )
            continue
        elif oldest is not None and report.time < oldest:
            problems.append(
                _problem(
                    index, "time", f"time {report.time.isoformat()} is older than the server keeps"
                )
            )
            continue
        else:
            bucket = int(report.time.timestamp()) // bucket_seconds * bucket_seconds
            buckets[report.time] = bucket
        key = report.report_id.bytes
        position = first_position.get(key, -1)
        if position < 0:
            position = first_position[key] = len(ids)
            ids.append(key)
        else:
            position = -1  # a repeat: checked, never folded
        members.setdefault(group_key, []).append((index, position, bucket))
    prepared = PreparedBatch(ids)
    for (metric, version), items in members.items():
        mechanism = resolved[(metric, version)]
        assert not isinstance(mechanism, Missing)
        payloads = [batch.reports[index].payload for index, _, _ in items]
        unexpected = _unexpected_fields(mechanism, payloads, [index for index, _, _ in items])
        if unexpected is not None:
            problems.append(unexpected)
            continue
        try:
            reports = mechanism.from_payloads(payloads)
        except ValueError:
            problems.append(_first_bad_payload(mechanism, payloads, [i for i, _, _ in items]))
            continue
        prepared.groups.append(
            Group(
                metric,
                version,
                mechanism,
                np.array([position for _, position, _ in items], dtype=np.int64),
                np.array([bucket for _, _, bucket in items], dtype=np.int64),
                reports,
            )
        )
    if problems:
        problems.sort(key=lambda p: p["report"])
        raise BatchRejected("The batch has invalid reports; none was stored", problems)
    return prepared, len(batch.reports) - len(ids)


@dataclass(frozen=True)
class Missing:
    """A (metric, version) the catalog does not have: the report field at fault, and why."""

    field: str
    message: str


def _resolve(
    batch: ReportBatch, catalog: MechanismLookup
) -> dict[tuple[str, int], Mechanism | Missing]:
    """The mechanism of each distinct (metric, version) the batch names, or why there is none.

    One lookup per distinct pair, however many reports name it.
    """
    resolved: dict[tuple[str, int], Mechanism | Missing] = {}
    for metric, version in {(report.metric, report.version) for report in batch.reports}:
        mechanism = catalog.mechanism(metric, version)
        resolved[(metric, version)] = (
            mechanism if mechanism is not None else _missing(catalog, metric, version)
        )
    return resolved


def _missing(catalog: MechanismLookup, metric: str, version: int) -> Missing:
    known = [m.version for m in catalog.versions(metric)]
    if not known:
        return Missing("metric", f"unknown metric {metric!r}")
    return Missing("version", f"metric {metric!r} has no version {version} (it has {known})")


def _problem(index: int, field_name: str, message: str) -> dict[str, Any]:
    return {"report": index, "field": field_name, "message": message}


def _unexpected_fields(
    mechanism: Mechanism, payloads: list[dict[str, Any]], indices: list[int]
) -> dict[str, Any] | None:
    """The first payload with a key the mechanism's payload does not have, if any."""
    allowed = mechanism.payload_fields
    for payload, index in zip(payloads, indices, strict=True):
        extra = payload.keys() - allowed
        if extra:
            return _problem(
                index,
                "payload",
                f"{mechanism.name} payload: unexpected field(s) {sorted(extra)}; "
                f"expected {sorted(allowed)}",
            )
    return None


def _first_bad_payload(
    mechanism: Mechanism, payloads: list[dict[str, Any]], indices: list[int]
) -> dict[str, Any]:
    """The first report whose payload the mechanism refuses, and why (the error path only)."""
    for payload, index in zip(payloads, indices, strict=True):
        try:
            mechanism.from_payloads([payload])
        except ValueError as error:
            message = str(error).removeprefix("report 0: ").removeprefix("report 0 ")
            return _problem(index, "payload", f"{mechanism.name} payload: {message}")
    return _problem(indices[0], "payload", f"{mechanism.name} payloads are inconsistent")


def utc_now() -> datetime:
    return datetime.now(UTC)
