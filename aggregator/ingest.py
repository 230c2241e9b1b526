"""Validating a batch of reports and folding it into sufficient statistics.

The wire batch is ``{"reports": [{"report_id", "metric", "version", "payload", "time",
"dimensions"}]}`` (``report_id`` a UUID, ``time`` an optional ISO-8601 UTC hour,
``dimensions`` the report's public dimension values, required for a metric that declares
dimensions and refused for one that does not). ``prepare`` checks everything that can be
checked without the database: the envelope (pydantic), the metric version, the time
bucket, the dimension values (against the metric version's, ``shared.dimensions``: a
problem's field is ``dimensions.NAME`` for an unknown or missing dimension or a value not
allowed, ``dimensions`` for values sent to a metric without dimensions) and every payload
(the mechanism's own ``from_payloads``), and groups the reports by metric version. It
raises ``InvalidBatchError`` listing what was wrong, by report index and field, before
anything is written (one bad report refuses the whole batch), and folds the reports into
``PartialRow``s (one per metric, version, time bucket and cell). Inside the transaction
that records the ids, ``PreparedBatch.fold`` hands over those rows when every id turned
out new, or folds the new reports again when some were not.

Integrity (``shared.integrity``). A decoded report that breaks its mechanism's refusal rule
(a report no honest device sends but with probability at most 2^-40) refuses the batch
like any invalid report, with a problem naming the ``rule``; the refused reports are
counted by (metric, version, bucket, rule) in ``ReportsRefusedError.refused`` for the
service to record. For a mechanism with a report profile (``Profiled``), each unit's
profile is folded beside its statistics as a ``PROFILE`` row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Protocol

import numpy as np

from aggregator.repositories.reports import PROFILE, UNIT_RADIX, PartialRow
from shared.dimensions import NO_DIMENSIONS, DimensionError, Dimensions
from shared.integrity import ReportRefusedError, as_profiled
from shared.mechanisms import Mechanism
from shared.schemas import MetricSpec, Report, ReportBatch

#: Reports may be stamped up to this far ahead of the server's clock (clock skew).
FUTURE_TOLERANCE = timedelta(hours=1)
#: Refused reports listed one by one per metric version in a refusal's problems (the
#: rest are counted in the last problem).
LISTED_REFUSALS = 20


class BatchRejected(Exception):
    """A batch that cannot be stored, with every problem found (report index, field, why).

    The message is the kind's ``summary`` and the first five problems.
    """

    #: What is wrong with the batch, in a few words.
    summary: ClassVar[str]
    #: The label of such refusals in the service's counters.
    reason: ClassVar[str]

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        self.problems = problems
        super().__init__(
            f"{self.summary}: "
            + "; ".join(
                f"report {p['report']}: {p['message']}"
                if p.get("report") is not None
                else p["message"]
                for p in problems[:5]
            )
        )


class InvalidBatchError(BatchRejected):
    """Reports of the batch are invalid (their metric, version, time or payload)."""

    summary = "The batch has invalid reports; none was stored"
    reason = "invalid"


class ReportsRefusedError(InvalidBatchError):
    """Reports of the batch break their mechanism's refusal rules (``shared.integrity``:
    reports no honest device sends but with probability at most 2^-40), maybe beside other
    invalid reports. ``refused`` counts them by (metric, version, bucket, rule name), for
    the service to record; ``by_rule`` by (metric, rule), for the counters."""

    summary = "The batch has reports no honest device sends; none was stored"

    def __init__(
        self, problems: list[dict[str, Any]], refused: dict[tuple[str, int, int, str], int]
    ) -> None:
        super().__init__(problems)
        self.refused = refused

    @property
    def by_rule(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for (metric, _, _, rule), reports in self.refused.items():
            counts[(metric, rule)] = counts.get((metric, rule), 0) + reports
        return counts


class BatchTooLargeError(BatchRejected):
    """The batch holds more reports than the service takes in one."""

    summary = "Batch too large"
    reason = "too_large"


@dataclass
class Group:
    """The reports of one metric version within a batch, in the mechanism's array form."""

    metric: str
    version: int
    mechanism: Mechanism
    positions: np.ndarray  # indices into the batch's distinct ids; -1 for a repeated id
    buckets: np.ndarray  # time bucket (start, unix seconds) of each report
    reports: np.ndarray
    cells: np.ndarray  # the cell of each report's dimension values (0 without dimensions)


@dataclass
class PreparedBatch:
    """A checked batch: its distinct ids and its reports grouped by metric version.

    ``prepare`` folds every report in advance (``folded``), on the request's thread, so
    that when all the ids turn out new (the common case) the storage's writer thread,
    which every batch passes through, only stores the rows.
    """

    ids: list[bytes]
    groups: list[Group] = field(default_factory=list)
    folded: list[PartialRow] | None = None

    def fold(self, new: list[bool]) -> list[PartialRow]:
        """Statistics of the reports whose id is new, one row per (metric, version, bucket,
        cell)."""
        if self.folded is not None and all(new):
            return self.folded
        return self._fold(np.asarray(new, dtype=bool))

    def _fold(self, mask: np.ndarray | None) -> list[PartialRow]:
        """The rows of the reports at the first occurrence of an id, and (given a ``mask``
        over the distinct ids) only of those it marks.

        A group's reports are sorted once by (bucket, cell) (a stable argsort of
        ``bucket * UNIT_RADIX + cell``) and each unit's run aggregated by one ``aggregate``
        call, so the work is O(n log n) plus one call per (bucket, cell) present."""
        rows = []
        for group in self.groups:
            keep = group.positions >= 0
            if mask is not None:
                keep &= mask[np.maximum(group.positions, 0)]
            if not keep.any():
                continue
            reports, buckets, cells = group.reports[keep], group.buckets[keep], group.cells[keep]
            keys = buckets * UNIT_RADIX + cells
            order = np.argsort(keys, kind="stable")
            units, starts = np.unique(keys[order], return_index=True)
            ends = [*starts[1:].tolist(), order.size]
            profiled = as_profiled(group.mechanism)
            for unit, start, end in zip(units.tolist(), starts.tolist(), ends, strict=True):
                unit_reports = reports[order[start:end]]
                stats = group.mechanism.aggregate(unit_reports)
                bucket, cell = divmod(unit, UNIT_RADIX)
                rows.append(
                    PartialRow(group.metric, group.version, bucket, stats.n, stats.to_bytes(), cell)
                )
                if profiled is not None:
                    profile = profiled.profile(unit_reports)
                    rows.append(
                        PartialRow(
                            group.metric,
                            group.version,
                            bucket,
                            profile.n,
                            profile.to_bytes(),
                            cell,
                            PROFILE,
                        )  # fmt: skip
                    )
        return rows


class MechanismLookup(Protocol):
    """Where ``prepare`` finds metric versions (``aggregator.catalog.Catalog``): their
    mechanisms, versions and (``get``) specs, whose dimensions the reports must match."""

    def mechanism(self, name: str, version: int) -> Mechanism | None: ...

    def versions(self, name: str) -> list[Any]: ...

    def get(self, name: str, version: int | None = None) -> MetricSpec | None: ...


def _dimensions_of(catalog: MechanismLookup, metric: str, version: int) -> Dimensions:
    """The dimensions of a metric version (none for a version the lookup has no spec of)."""
    spec = catalog.get(metric, version)
    return spec.dimension_set if spec is not None else NO_DIMENSIONS


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

    The batch is handled as columns: each distinct (metric, version) is resolved once,
    each distinct time converted to its bucket once, and the reports of one metric
    version decoded by one ``from_payloads`` call, so the Python work per report is a
    few attribute reads.
    """
    reports = batch.reports
    keys = [(report.metric, report.version) for report in reports]
    times = [report.time for report in reports]
    resolved = _resolve(set(keys), catalog)
    buckets, refused_times = _buckets(set(times), bucket_seconds, now, oldest)
    problems = _report_problems(keys, times, resolved, refused_times)
    refused = {problem["report"] for problem in problems}
    if len(buckets) == 1:  # the common case: one hour, or no times at all
        bucket_of = np.full(len(reports), next(iter(buckets.values())), dtype=np.int64)
    else:
        bucket_of = np.array([buckets.get(moment, -1) for moment in times], dtype=np.int64)
    ids, positions = _distinct_ids(reports)
    prepared = PreparedBatch(ids)
    refused_counts: dict[tuple[str, int, int, str], int] = {}
    for (metric, version), indices in _members(keys, refused).items():
        mechanism = resolved[(metric, version)]
        assert not isinstance(mechanism, Missing)
        payloads = [reports[index].payload for index in indices]
        unexpected = _unexpected_fields(mechanism, payloads, indices)
        if unexpected is not None:
            problems.append(unexpected)
            continue
        try:
            decoded = mechanism.from_payloads(payloads)
        except ValueError:
            problems.append(_first_bad_payload(mechanism, payloads, indices))
            continue
        cells = _cells(
            _dimensions_of(catalog, metric, version),
            [reports[index].dimensions for index in indices],
            indices,
        )
        if isinstance(cells, dict):
            problems.append(cells)
            continue
        rows = np.asarray(indices, dtype=np.int64)
        codes = mechanism.refusals(decoded)
        if (codes >= 0).any():
            problems += _refusal_problems(mechanism, decoded, codes, indices)
            _count_refusals(refused_counts, mechanism, metric, version, codes, bucket_of[rows])
            continue
        prepared.groups.append(
            Group(metric, version, mechanism, positions[rows], bucket_of[rows], decoded, cells)
        )
    if problems:
        problems.sort(key=lambda p: p["report"])
        if refused_counts:
            raise ReportsRefusedError(problems, refused_counts)
        raise InvalidBatchError(problems)
    prepared.folded = prepared._fold(None)
    return prepared, len(reports) - len(ids)


def _refusal_problems(
    mechanism: Mechanism, decoded: np.ndarray, codes: np.ndarray, indices: list[int]
) -> list[dict[str, Any]]:
    """One problem per refused report (field ``payload``, with the ``rule`` it breaks), the
    first ``LISTED_REFUSALS`` of them, and one more counting the rest."""
    rules = mechanism.refusal_rules()
    broken = np.flatnonzero(codes >= 0)
    problems = []
    for position in broken[:LISTED_REFUSALS].tolist():
        error = ReportRefusedError(
            rules[int(codes[position])], indices[position],
            mechanism.refusal_detail(decoded[position]),
        )  # fmt: skip
        message = f"{mechanism.name} payload: {error.reason}"
        problem = _problem(indices[position], "payload", message)
        problems.append(problem | {"rule": error.rule.name})
    if broken.size > LISTED_REFUSALS:
        last = indices[int(broken[LISTED_REFUSALS])]
        problems.append(
            _problem(
                last,
                "payload",
                f"{mechanism.name} payload: {broken.size - LISTED_REFUSALS} more reports "
                "(from this one on) are refused by the same rules",
            )
        )
    return problems


def _count_refusals(
    counts: dict[tuple[str, int, int, str], int],
    mechanism: Mechanism,
    metric: str,
    version: int,
    codes: np.ndarray,
    buckets: np.ndarray,
) -> None:
    """Add the refused reports of one metric version to ``counts`` by (metric, version,
    bucket, rule name)."""
    rules = mechanism.refusal_rules()
    broken = codes >= 0
    pairs, tally = np.unique(
        np.stack([buckets[broken], codes[broken].astype(np.int64)]), axis=1, return_counts=True
    )
    for (bucket, code), reports in zip(pairs.T.tolist(), tally.tolist(), strict=True):
        key = (metric, version, int(bucket), rules[int(code)].name)
        counts[key] = counts.get(key, 0) + int(reports)


def _buckets(
    times: set[datetime | None], bucket_seconds: int, now: datetime, oldest: datetime | None
) -> tuple[dict[datetime | None, int], dict[datetime, str]]:
    """Each distinct time's bucket start (unix seconds; ``None``: now's), or why it is refused.

    A time past ``now + FUTURE_TOLERANCE`` or before ``oldest`` is refused.
    """
    latest = now + FUTURE_TOLERANCE
    buckets: dict[datetime | None, int] = {}
    refused: dict[datetime, str] = {}
    for moment in times:
        if moment is None:
            buckets[None] = int(now.timestamp()) // bucket_seconds * bucket_seconds
        elif moment > latest:
            refused[moment] = f"time {moment.isoformat()} is in the future"
        elif oldest is not None and moment < oldest:
            refused[moment] = f"time {moment.isoformat()} is older than the server keeps"
        else:
            buckets[moment] = int(moment.timestamp()) // bucket_seconds * bucket_seconds
    return buckets, refused


def _report_problems(
    keys: list[tuple[str, int]],
    times: list[datetime | None],
    resolved: dict[tuple[str, int], Mechanism | Missing],
    refused_times: dict[datetime, str],
) -> list[dict[str, Any]]:
    """One problem per report whose metric version is unknown or whose time is refused.

    Only when the batch has such a report does this look at the reports one by one.
    """
    if not refused_times and not any(isinstance(found, Missing) for found in resolved.values()):
        return []
    problems = []
    for index, (key, moment) in enumerate(zip(keys, times, strict=True)):
        found = resolved[key]
        if isinstance(found, Missing):
            problems.append(_problem(index, found.field, found.message))
        elif moment is not None and moment in refused_times:
            problems.append(_problem(index, "time", refused_times[moment]))
    return problems


def _distinct_ids(reports: list[Report]) -> tuple[list[bytes], np.ndarray]:
    """The batch's distinct report ids (16 bytes, first occurrence order), and for each
    report the index of its id among them, or -1 when an earlier report had the same id."""
    raw = [report.report_id.int.to_bytes(16) for report in reports]
    first = dict.fromkeys(raw)
    if len(first) == len(raw):
        return raw, np.arange(len(raw), dtype=np.int64)
    positions = np.full(len(raw), -1, dtype=np.int64)
    seen: dict[bytes, int] = {}
    for index, report_id in enumerate(raw):
        if report_id not in seen:
            positions[index] = seen[report_id] = len(seen)
    return list(seen), positions


def _members(keys: list[tuple[str, int]], refused: set[int]) -> dict[tuple[str, int], list[int]]:
    """The indices of the acceptable reports of each (metric, version), in batch order."""
    if not refused and len(distinct := set(keys)) == 1:
        return {distinct.pop(): list(range(len(keys)))}
    members: dict[tuple[str, int], list[int]] = {}
    for index, key in enumerate(keys):
        if index not in refused:
            members.setdefault(key, []).append(index)
    return members


@dataclass(frozen=True)
class Missing:
    """A (metric, version) the catalog does not have: the report field at fault, and why."""

    field: str
    message: str


def _resolve(
    keys: set[tuple[str, int]], catalog: MechanismLookup
) -> dict[tuple[str, int], Mechanism | Missing]:
    """The mechanism of each distinct (metric, version) the batch names, or why there is none."""
    resolved: dict[tuple[str, int], Mechanism | Missing] = {}
    for metric, version in keys:
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


def _cells(
    dimensions: Dimensions, given: list[dict[str, str] | None], indices: list[int]
) -> np.ndarray | dict[str, Any]:
    """The cell of each report's dimension values (``Dimensions.cells_of``: each distinct
    combination checked once), or the problem of the first report whose values the
    metric version refuses (field ``dimensions.NAME`` or ``dimensions``)."""
    try:
        return dimensions.cells_of(given)
    except DimensionError:
        pass
    for mapping, index in zip(given, indices, strict=True):
        try:
            dimensions.cell_of(mapping)
        except DimensionError as error:
            return _problem(index, error.field, error.reason)
    raise AssertionError("cells_of refused values that cell_of accepts")


def _unexpected_fields(
    mechanism: Mechanism, payloads: list[dict[str, Any]], indices: list[int]
) -> dict[str, Any] | None:
    """The first payload with a key the mechanism's payload does not have, if any.

    The union of all the payloads' keys is taken in one call; only when it holds a key
    not allowed are the payloads looked at one by one.
    """
    allowed = mechanism.payload_fields
    if set().union(*payloads) <= allowed:
        return None
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
