"""Estimates as published: the JSON shapes of ``GET /v1/metrics/{name}/estimate``.

The numbers are the mechanisms' (``Mechanism.estimate``): unbiased frequencies or mean
with standard errors, the 95% normal interval ``estimate ± 1.96 std`` (for a mean: around
the users' own mean, with the interval around the mean of the population they came from,
``± 1.96 population_std``, beside it), and beside them
the post-processed estimate (a valid distribution, or a mean inside the bounds), which
is biased and marked so. String metrics (``rappor``, and the open-domain ``cms``,
``hcms``, ``pem`` and ``sfp``) are estimated at candidate strings: the metric's labels,
or the ones the request lists; RAPPOR's decoding adds its detection fields, which the
others leave null. The discovery mechanisms (``pem``, ``sfp``) also find the most
frequent strings without candidates: ``GET /v1/metrics/{name}/heavy-hitters``
(``build_heavy_hitters``).

The release threshold applies per stored time bucket and cell (``ReleasedBuckets``): a
unit's reports enter an estimate only if the unit holds at least ``min_reports`` of them
in all (the sum over its partial rows, so compaction changes nothing). A unit is a time
bucket of one cell, one combination of the metric's public dimension values
(``shared.dimensions``); a metric without dimensions has one cell, so its unit is the
time bucket. A threshold on the
window's total alone could be bypassed by differencing: the estimates over ``[h-3, h)``
and ``[h-3, h+1)`` differ by exactly the reports of hour ``h``, however few. With the
threshold per bucket, adding a bucket below it to a window leaves that window's estimate
unchanged. The estimate says what was left out (``suppressed_buckets``,
``suppressed_reports``, and of those reports the ``pending_reports`` of the current
bucket, which is still filling and enters once it reaches the threshold): report counts
are public in this design (``n`` is released), so this tells the size of a small bucket,
never anything about its reports' values. The same argument holds across cells: with the
threshold per (bucket, cell), the estimates ``where=version:2.0`` and the whole metric
differ by released units only, and a cell's small bucket enters none of them.

Breakdowns (``Selection``): ``where=NAME:VALUE`` keeps the cells matching every filter;
``by=NAME[,NAME2]`` adds one estimate per combination of those dimensions' values
(``groups``), each exactly what ``where=`` the group's values answers (the same code,
over the group's released units). The statistics of all groups are summed in one pass
(``grouped_statistics``: each stored row read once and added into its group's row of a
(groups x length) count matrix; moments by three ``np.bincount``), so a breakdown over
4,096 cells costs one read per stored row and one estimate per group, not one merge per
row per group.

A categorical estimate lists a bounded selection of its categories (``ValueView``,
``aggregator.value_listing``): all of them up to 4,096, else the 1,000 largest estimates by
default; chosen ones (``values``), pages (``order``, ``offset``, ``limit``) or the whole
vector compactly encoded (``format=vectors``) on request. It says which it listed
(``domain_size``, ``partial``, ``order``, ``offset``, ``next_offset``). The estimate itself is
computed as numpy vectors over the whole domain (the simplex projection too); only what is
listed becomes JSON.

A distribution estimate (``hh``, ``sw``: ``DistributionEstimateOut``, from the mechanism's
``DistributionEstimate``, ``shared.distributions``) lists every one of its D <= 4,096
buckets (``histogram``) and D + 1 edges (``cdf``): the unbiased shares F^_{b+1} - F^_b and
CDF values F^_k with their std and 95% normal intervals, beside the mechanism's
post-processed valid distribution (biased, made by ``method``); the quantile levels the
request asks for (``quantiles=``, default ``DEFAULT_QUANTILES``), each with its point where
the post-processed CDF crosses q and its interval by test inversion of the CDF's pointwise
one-sided bounds at the edges, in whole buckets; and the share of a range (``range=``)
whose ends snap to the nearest edges. Every column is a numpy vector over the buckets,
computed once (the mechanism's CDF variances are O(D log D) for ``hh``), so an estimate
costs O(D) plus O(D) per quantile level, never O(D^2).

A series (``GET /v1/metrics/{name}/series``, ``build_series``) is one estimate per time
step on the UTC grid of the step (whole hours for ``1h``, UTC days for ``1d``): each
step's estimate is the one the estimate endpoint publishes for that step's window,
built by the same code from the step's released buckets, or null when none of them
reaches the threshold (the step still says how many reports it holds). It reads the
stored buckets of the range once, so its cost grows with the number of buckets and
steps, never with the number of reports. It holds at most ``MAX_SERIES_VALUES`` listed
values in all, one step alone included: a larger request is refused, saying what to narrow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal, cast

import numpy as np
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from aggregator.attribute_estimates import (
    AttributesEstimateFields,
    attributes_estimate,
    listed_values,
)
from aggregator.integrity import integrity_fields
from aggregator.repositories.reports import UNIT_RADIX, PartialRow
from aggregator.value_listing import (
    DEFAULT_TOP_VALUES,
    DEFAULT_VIEW,
    FULL_LIST_DOMAIN,
    Listing,
    ListingOrder,
    ValueView,
    encode_vector,
)
from shared.dimensions import DimensionError, parse_by, parse_where
from shared.distributions import DistributionEstimate
from shared.estimates import (
    Estimate,
    MeanEstimate,
    StdMethod,
    project_rows_to_simplex,
    z_value,
)
from shared.integrity import ALERT_P_VALUE
from shared.mechanisms import (
    Discovery,
    Mechanism,
    as_attributes,
    as_candidate_queries,
    as_categorical,
    as_distribution,
    as_memoized,
    as_numeric,
    pem,
    sfp,
)
from shared.mechanisms.rappor_common import RapporEstimate
from shared.mechanisms.spec import DistributionSpec, Scale, as_distribution_spec
from shared.schemas import DISTRIBUTION_MECHANISMS, MetricSpec
from shared.statistics import CountStatistics, MomentStatistics, read_dense_rows

CONFIDENCE = 0.95
#: The most heavy hitters one request may ask for: as many as every discovery mechanism
#: returns.
MAX_HEAVY_HITTERS = min(pem.MAX_HEAVY_HITTERS, sfp.MAX_HEAVY_HITTERS)

#: The steps of a series, by name, in seconds.
SeriesStepName = Literal["1h", "1d"]
STEP_SECONDS: dict[str, int] = {"1h": 3600, "1d": 86400}
#: Steps a series covers when its request gives no start: a week of hours, 30 days.
DEFAULT_SERIES_STEPS: dict[str, int] = {"1h": 168, "1d": 30}
#: Most steps in one series (100 days of hours).
MAX_SERIES_STEPS = 2400
#: Most estimated values in one series (steps times the values listed by one step's
#: estimate: categories twice, for the post-processed twin, candidate strings, or one
#: mean), whatever the number of steps.
MAX_SERIES_VALUES = 100_000
#: The quantile levels a distribution estimate lists when the request names none.
DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99)
#: Most quantile levels one request may ask for.
MAX_QUANTILES = 32
#: The Unix seconds a published time may take (years 1 to 9999).
_FIRST_SECOND = int(datetime(1, 1, 1, tzinfo=UTC).timestamp())
_LAST_SECOND = int(datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp())


@dataclass(frozen=True)
class EstimateWindow:
    """Buckets ``first <= bucket < stop`` (unix seconds; None: unbounded)."""

    first: int | None
    stop: int | None

    @classmethod
    def of(
        cls, start: datetime | None, end: datetime | None, bucket_seconds: int
    ) -> EstimateWindow:
        """The buckets that start in ``[start, end)``; a bucket holds reports stamped in it."""
        first = stop = None
        if start is not None:
            seconds = int(_utc(start, "start").timestamp())
            first = -(-seconds // bucket_seconds) * bucket_seconds  # round up to a bucket
        if end is not None:
            seconds = int(_utc(end, "end").timestamp())
            stop = -(-seconds // bucket_seconds) * bucket_seconds
        if first is not None and stop is not None and stop <= first:
            raise ValueError("end must be later than start (by at least one bucket)")
        return cls(first, stop)

    def as_json(self) -> dict[str, str | None]:
        return {"start": _iso(self.first), "end": _iso(self.stop)}


@dataclass(frozen=True)
class ReleasedBuckets:
    """The partial rows of a window that the release threshold per unit, one time bucket
    of one cell, lets through (a metric without dimensions has one cell: a unit is then
    a time bucket)."""

    rows: list[PartialRow]
    min_reports: int
    #: Units with at least ``min_reports`` reports (their rows are ``rows``).
    buckets: int
    #: Units with reports, but fewer than ``min_reports``, and those reports.
    suppressed_buckets: int
    suppressed_reports: int
    #: Of the suppressed reports, those in buckets from ``current`` on (still filling).
    pending_reports: int

    @classmethod
    def of(cls, rows: Sequence[PartialRow], min_reports: int, current: int) -> ReleasedBuckets:
        """Keep the rows of the (bucket, cell) units whose rows hold ``sum n >= min_reports``
        reports; ``current`` is the start of the bucket that holds the present moment."""
        one_group = np.zeros(UNIT_RADIX, dtype=np.int64)
        (released,) = cls.grouped(rows, one_group, 1, min_reports, current)
        return released

    @classmethod
    def grouped(
        cls,
        rows: Sequence[PartialRow],
        group_of_cell: np.ndarray,
        count: int,
        min_reports: int,
        current: int,
    ) -> list[ReleasedBuckets]:
        """``of`` for each of ``count`` groups of cells at once (``group_of_cell[c]``: the
        group of cell c): the units' sizes are summed once (``np.unique`` of the keys
        ``bucket * UNIT_RADIX + cell``, ``np.add.at``), and the groups' tallies are bincounts
        over the units; each group's rows keep their order."""
        size = len(rows)
        buckets = np.fromiter((row.bucket for row in rows), dtype=np.int64, count=size)
        cells = np.fromiter((row.cell for row in rows), dtype=np.int64, count=size)
        counts = np.fromiter((row.n for row in rows), dtype=np.int64, count=size)
        distinct, which = np.unique(buckets * UNIT_RADIX + cells, return_inverse=True)
        sizes = np.zeros(distinct.size, dtype=np.int64)
        np.add.at(sizes, which, counts)
        large = sizes >= min_reports
        small = ~large & (sizes > 0)
        pending = small & (distinct // UNIT_RADIX >= current)
        unit_group = group_of_cell[distinct % UNIT_RADIX]

        def tally(mask: np.ndarray, weights: np.ndarray | None = None) -> list[int]:
            chosen = None if weights is None else weights[mask]
            summed = np.bincount(unit_group[mask], weights=chosen, minlength=count)
            return summed.astype(np.int64).tolist()

        released, suppressed = tally(large), tally(small)
        suppressed_reports, pending_reports = tally(small, sizes), tally(pending, sizes)
        kept = np.flatnonzero(large[which])
        row_group = unit_group[which[kept]]
        by_group = np.argsort(row_group, kind="stable")
        positions = kept[by_group].tolist()
        edge = np.searchsorted(row_group[by_group], np.arange(count + 1)).tolist()
        return [
            cls(
                rows=[rows[i] for i in positions[edge[g] : edge[g + 1]]],
                min_reports=min_reports,
                buckets=released[g],
                suppressed_buckets=suppressed[g],
                suppressed_reports=suppressed_reports[g],
                pending_reports=pending_reports[g],
            )
            for g in range(count)
        ]

    def as_json(self) -> dict[str, int]:
        return {
            "min_reports": self.min_reports,
            "buckets": self.buckets,
            "suppressed_buckets": self.suppressed_buckets,
            "suppressed_reports": self.suppressed_reports,
            "pending_reports": self.pending_reports,
        }


@dataclass(frozen=True)
class Selection:
    """What a request selects of a metric's cells (``shared.dimensions``): the cells
    matching every ``where`` filter (name -> value), and with ``by`` (dimension names)
    one group per combination of their values, numbered in mixed radix over ``by``."""

    where: dict[str, str]
    by: tuple[str, ...] | None
    #: Over the cells: those the filters keep.
    mask: np.ndarray
    #: Over the cells: the group of each (all 0 without ``by``).
    group_of_cell: np.ndarray
    #: Each group's dimension values (one group, ``{}``, without ``by``).
    labels: list[dict[str, str]]

    @classmethod
    def of(cls, metric: MetricSpec, where: Sequence[str] = (), by: str | None = None) -> Selection:
        """The request's ``where=NAME:VALUE`` items and ``by=NAME[,NAME2]`` for ``metric``;
        ``DimensionError`` (a ValueError) naming the parameter and the dimension for an
        unknown dimension or value, a repeat, a dimension both in ``by`` and ``where``,
        or either on a metric without dimensions."""
        dimensions = metric.dimension_set
        if not dimensions and (where or by is not None):
            parameter = "where" if where else "by"
            raise DimensionError(
                parameter,
                f"metric {metric.name!r} declares no dimensions: {parameter}= breaks down by "
                "a metric's dimensions",
            )
        filters = parse_where(where)
        mask = dimensions.cells_where(filters)
        names = parse_by(by)
        if names is None:
            return cls(filters, None, mask, np.zeros(dimensions.cell_count, np.int64), [{}])
        for name in names:
            if name in filters:
                raise DimensionError(
                    "by", f"dimension {name!r} is also in where=: break down by another one"
                )
        group_of_cell, labels = dimensions.groups_by(names)
        return cls(filters, tuple(names), mask, group_of_cell, labels)

    @property
    def groups(self) -> int:
        """How many groups ``by`` makes (1 without it)."""
        return len(self.labels)

    def group_of(self, rows: Sequence[PartialRow]) -> np.ndarray:
        """The group of each row (of its cell)."""
        cells = np.fromiter((row.cell for row in rows), dtype=np.int64, count=len(rows))
        return self.group_of_cell[cells]

    def rows(self, rows: Sequence[PartialRow]) -> list[PartialRow]:
        """The rows of the cells the filters keep."""
        if not self.where:
            return list(rows)
        mask = self.mask
        return [row for row in rows if mask[row.cell]]

    def as_json(self) -> dict[str, object]:
        """The request's ``where`` (echoed, ``{}`` when none) and ``by`` (null without)."""
        return {"where": dict(self.where), "by": list(self.by) if self.by else None}


@dataclass(frozen=True)
class EstimateView(ValueView):
    """What a request lists of an estimate: a categorical metric's categories
    (``ValueView``), or a distribution metric's quantile levels and range.

    ``quantiles``: the levels asked for, None when the request named none (then
    ``DEFAULT_QUANTILES`` are listed); ``range``: (LOW, HIGH) in value units, or None.
    Either one given for a metric that is not a distribution is refused (``check_view``).
    """

    quantiles: tuple[float, ...] | None = None
    range: tuple[float, float] | None = None

    @property
    def categories(self) -> ValueView:
        """The categorical part alone."""
        return ValueView(self.values, self.order, self.offset, self.limit, self.format)

    @property
    def is_default(self) -> bool:
        """Whether the request chose no categories (quantiles and range aside)."""
        return self.categories.is_default

    @property
    def asks_distribution(self) -> bool:
        """Whether the request named quantile levels or a range."""
        return self.quantiles is not None or self.range is not None

    @property
    def levels(self) -> tuple[float, ...]:
        """The quantile levels a distribution estimate lists."""
        return DEFAULT_QUANTILES if self.quantiles is None else self.quantiles


def as_estimate_view(view: ValueView) -> EstimateView:
    """``view`` as an ``EstimateView`` (a plain ``ValueView`` asks no quantiles or range)."""
    if isinstance(view, EstimateView):
        return view
    return EstimateView(view.values, view.order, view.offset, view.limit, view.format)


def parse_quantiles(text: str) -> tuple[float, ...]:
    """The levels of ``quantiles=0.5,0.95``: 1..``MAX_QUANTILES`` distinct numbers, each
    strictly between 0 and 1, in the order given; ValueError saying what is wrong."""
    items = [item.strip() for item in text.split(",")]
    if len(items) > MAX_QUANTILES:
        raise ValueError(f"at most {MAX_QUANTILES} quantile levels, got {len(items)}")
    levels: list[float] = []
    for item in items:
        level = _number(item, "quantile level", "0.5,0.95")
        if not 0.0 < level < 1.0:
            raise ValueError(f"each quantile level must lie strictly between 0 and 1, got {item}")
        if level in levels:
            raise ValueError(f"the quantile level {item} is listed twice")
        levels.append(level)
    return tuple(levels)


def parse_range(text: str) -> tuple[float, float]:
    """(LOW, HIGH) of ``range=LOW,HIGH``: two finite numbers, LOW < HIGH; ValueError saying
    what is wrong. (That they span a bucket is checked against the metric: ``check_view``.)"""
    items = [item.strip() for item in text.split(",")]
    if len(items) != 2:
        raise ValueError(f"a range is LOW,HIGH (two numbers), got {text!r}")
    low, high = (_number(item, "range end", "10,250") for item in items)
    if not math.isfinite(low) or not math.isfinite(high):
        raise ValueError(f"a range's ends must be finite, got {text}")
    if not low < high:
        raise ValueError(f"a range needs LOW < HIGH, got {low:g},{high:g}")
    return low, high


def _number(item: str, what: str, example: str) -> float:
    try:
        return float(item)
    except ValueError:
        raise ValueError(f"the {what} {item!r} is not a number (e.g. {example})") from None


def merged_statistics(
    mechanism: Mechanism[Any], rows: Iterable[PartialRow]
) -> CountStatistics | MomentStatistics:
    """The statistics of ``rows`` summed into one accumulator (``merge_many``, not pairwise)."""
    return mechanism.empty_statistics().merge_many(
        mechanism.statistics_from_bytes(row.stats) for row in rows
    )


#: Most int64 counts the scatter matrix of ``grouped_statistics`` holds at once (32 MiB).
_GROUPED_CELLS = 1 << 22


def statistics_reader(
    mechanism: Mechanism[Any],
) -> Callable[[bytes], CountStatistics | MomentStatistics]:
    """``Mechanism.statistics_from_bytes`` with the mechanism's empty statistics made once
    rather than once per row: the same type's ``from_bytes``, and for counts the
    mechanism's length checked."""
    empty = mechanism.empty_statistics()
    if isinstance(empty, MomentStatistics):
        return MomentStatistics.from_bytes
    length = empty.length

    def read(data: bytes) -> CountStatistics:
        stats = CountStatistics.from_bytes(data)
        if stats.length != length:
            raise ValueError(
                f"statistics have {stats.length} counts, this mechanism keeps {length}"
            )
        return stats

    return read


def grouped_statistics(
    mechanism: Mechanism[Any], rows: Sequence[PartialRow], group: np.ndarray, count: int
) -> tuple[CountStatistics | MomentStatistics, list[CountStatistics | MomentStatistics]]:
    """The statistics of all ``rows`` and of each of ``count`` groups (``group[i]``: the
    group of row i): each row read once, and summed into its group's row of a (groups x
    length) count matrix.

    Count statistics: the rows are taken in group order, one at a time (so memory is one
    row and one slice of the matrix, at most ``_GROUPED_CELLS`` counts: a breakdown of a
    large-domain metric never holds every row's vector at once); row i's nonzero entries
    are added to row ``group[i]`` of the slice (``matrix[g, indices] += values``, exact:
    its indices are distinct); the total is the sum of the groups' vectors. Moments: n,
    sum and sum of squares by three ``np.bincount`` over the groups. Equal to
    ``merged_statistics`` of each group (sums are associative; for moments up to
    floating-point rounding).
    """
    read = statistics_reader(mechanism)
    group = np.asarray(group, dtype=np.int64)
    empty = mechanism.empty_statistics()
    each: list[CountStatistics | MomentStatistics] = []
    if isinstance(empty, MomentStatistics):
        moments = [read(row.stats) for row in rows]
        n, totals, squares = (
            np.bincount(group, weights=[getattr(m, field) for m in moments], minlength=count)
            for field in ("n", "total", "total_squares")
        )
        sizes = n.astype(np.int64).tolist()
        each.extend(
            MomentStatistics(size, total, square)
            for size, total, square in zip(sizes, totals.tolist(), squares.tolist(), strict=True)
        )
        return MomentStatistics(sum(sizes), float(totals.sum()), float(squares.sum())), each
    length = empty.length
    order = np.argsort(group, kind="stable")
    owners = group[order].tolist()
    positions = order.tolist()
    per_slice = max(1, _GROUPED_CELLS // max(length, 1))
    edges = np.searchsorted(group[order], np.arange(0, count + per_slice, per_slice)).tolist()
    total = np.zeros(length, dtype=np.int64) if count > 1 else None
    for number, first in enumerate(range(0, count, per_slice)):
        span = min(per_slice, count - first)
        matrix = np.zeros((span, length), dtype=np.int64)
        chosen = positions[edges[number] : edges[number + 1]]
        dense = read_dense_rows([rows[k].stats for k in chosen], length)
        if dense is not None:  # every row dense: one vectorized read and scatter
            owner = group[chosen] - first
            np.add.at(matrix, owner, dense[1])
            counted = np.zeros(span, dtype=np.int64)
            np.add.at(counted, owner, dense[0])
            sizes = counted.tolist()
        else:
            sizes = [0] * span
            for k in range(edges[number], edges[number + 1]):
                stats = read(rows[positions[k]].stats)
                assert isinstance(stats, CountStatistics)
                indices, values = stats.nonzero()
                matrix[owners[k] - first, indices] += values
                sizes[owners[k] - first] += stats.n
        if total is not None:
            total += matrix.sum(axis=0)
        each.extend(CountStatistics.of_rows(sizes, matrix))
    whole = each[0] if total is None else CountStatistics(sum(s.n for s in each), total)
    return whole, each


@dataclass(frozen=True)
class SeriesGrid:
    """``count`` steps of ``seconds`` each from ``first`` (Unix seconds, a multiple of
    ``seconds``): the steps of one series."""

    step: SeriesStepName
    seconds: int
    first: int
    count: int

    @property
    def stop(self) -> int:
        """The end of the last step (exclusive)."""
        return self.first + self.count * self.seconds

    @classmethod
    def of(
        cls,
        start: datetime | None,
        end: datetime | None,
        step: SeriesStepName,
        bucket_seconds: int,
        now: datetime,
    ) -> SeriesGrid:
        """The steps on the UTC grid of ``step`` that overlap ``[start, end)``.

        ``end`` defaults to ``now`` (so the current step is the last), ``start`` to
        ``DEFAULT_SERIES_STEPS[step]`` steps before the end. Raises ValueError for a start
        not before the end, more than ``MAX_SERIES_STEPS`` steps, times outside years
        1..9999, or a step that is not a whole number of the storage's time buckets.
        """
        seconds = STEP_SECONDS[step]
        if seconds % bucket_seconds:
            raise ValueError(
                f"step={step} is not a whole number of the storage's {bucket_seconds} s time "
                f"buckets; use a step that is (the buckets are {bucket_seconds} s long)"
            )
        last = _utc(end, "end") if end is not None else now
        stop = -(-math.ceil(last.timestamp()) // seconds) * seconds
        if start is None:
            first = stop - DEFAULT_SERIES_STEPS[step] * seconds
        else:
            begin = _utc(start, "start")
            if begin >= last:
                shown = "end" if end is not None else "end (by default now)"
                raise ValueError(f"start must be earlier than {shown}")
            first = math.floor(begin.timestamp()) // seconds * seconds
        count = (stop - first) // seconds
        if count > MAX_SERIES_STEPS:
            raise ValueError(
                f"the range holds {count} steps of {step}; a series has at most "
                f"{MAX_SERIES_STEPS}: choose a shorter range or step=1d"
            )
        if first < _FIRST_SECOND or stop > _LAST_SECOND:
            raise ValueError("a series must lie between the years 1 and 9999 (UTC)")
        return cls(step, seconds, first, count)

    def window(self, index: int) -> EstimateWindow:
        """The window of step ``index`` (0-based)."""
        first = self.first + index * self.seconds
        return EstimateWindow(first, first + self.seconds)


def current_bucket(now: datetime, bucket_seconds: int) -> int:
    """The start of the time bucket ``now`` falls in: the one still filling."""
    return int(now.timestamp()) // bucket_seconds * bucket_seconds


def _utc(value: datetime, name: str) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{name} must carry a time zone, e.g. 2026-11-22T00:00:00Z")
    return value


def _iso(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class Window(BaseModel):
    start: str | None = Field(description="First bucket included (UTC), or null: from the first.")
    end: str | None = Field(description="First bucket excluded (UTC), or null: to the last.")


class FrequencyItem(BaseModel):
    index: int
    label: str | None
    frequency: float = Field(description="Unbiased estimate of the share of reports.")
    std: float
    ci_low: float
    ci_high: float
    count: float = Field(description="n * frequency: the estimated number of reports.")


class PostprocessedItem(BaseModel):
    index: int
    label: str | None
    frequency: float


class FitOut(BaseModel):
    """A goodness-of-fit test of the window's reports against the honest model
    (``shared.integrity.FitTest``)."""

    test: str = Field(
        description="Which statistic of the reports was tested against which law; whether "
        "the p-value is uniform under no attack or conservative."
    )
    statistic: float
    degrees_of_freedom: int
    p_value: float = Field(description="Small: the reports do not look like honest ones.")
    reports: int = Field(description="Reports tested (those of the window with a profile).")


class IntegrityOut(BaseModel):
    """How honest the window's reports look (``aggregator.integrity``)."""

    fit: FitOut | None = Field(
        description="The window's report profile tested against the mechanism's honest law; "
        "null for a mechanism without a profile, or with too few reports."
    )
    refused: dict[str, int] = Field(
        description="Reports refused at ingest in the window, by the refusal rule they broke "
        "(reports no honest device sends but with probability at most 2^-40)."
    )
    refused_share: float = Field(description="refused / (refused + n).")
    alert: bool = Field(description=f"Whether fit.p_value is below {ALERT_P_VALUE:g}.")
    message: str | None = Field(description="Why the estimate looks attacked, or null.")


class RobustMeanOut(BaseModel):
    """The mean with every report winsorized to the honest noise's quantiles
    (``shared.integrity.RobustMean``): one report moves it at most (high - low) / n."""

    mean: float
    std: float = Field(description="The plain estimate's std (a winsorized value varies less).")
    ci_low: float = Field(description="mean - z std - bias_bound.")
    ci_high: float = Field(description="mean + z std + bias_bound.")
    bias_bound: float = Field(
        description="The largest bias the winsorizing can add, over every set of inputs."
    )
    winsorized: int = Field(description="Reports moved to low or high.")
    low: float = Field(description="Every report's debiased value is clipped to [low, high].")
    high: float


class EstimateBase(BaseModel):
    @model_serializer(mode="wrap")
    def _integrity_only_where_given(self, handler: SerializerFunctionWrapHandler) -> Any:
        """A breakdown's groups carry no ``integrity`` (nor ``robust``): leave them out."""
        data = handler(self)
        for key in ("integrity", "robust"):
            if isinstance(data, dict) and data.get(key, 0) is None:
                del data[key]
        return data

    metric: str
    version: int
    mechanism: str
    epsilon: float = Field(
        description="The metric's epsilon: per report, or for memoized mechanisms the lifetime "
        "bound per distinct value (see epsilon_report)."
    )
    epsilon_report: float | None = Field(
        default=None,
        description="Memoized mechanisms only: what one report reveals. Their estimates are "
        "per period: in a window where each device reports once, n counts devices.",
    )
    n: int
    confidence: float = CONFIDENCE
    window: Window
    min_reports: int = Field(
        description="Release threshold: a unit's reports enter the estimate only if the "
        "unit holds at least this many. A unit is a time bucket of one cell (combination "
        "of the metric's dimension values); without dimensions, a time bucket."
    )
    buckets: int = Field(description="Units (time buckets per cell) that make up n.")
    suppressed_buckets: int = Field(
        description="Units (time buckets per cell) of the window left out: they hold "
        "reports, fewer than min_reports."
    )
    suppressed_reports: int = Field(
        description="Reports in the suppressed buckets (report counts are public, as n is; "
        "the suppressed reports' values are never used)."
    )
    pending_reports: int = Field(
        description="Of suppressed_reports, those in the current time bucket (the one now "
        "falls in), which is still filling: they enter the estimate once the bucket holds "
        "min_reports reports. Reports that arrived but are not in n yet."
    )
    where: dict[str, str] = Field(
        default_factory=dict,
        description="The request's where= filters (dimension -> value), echoed; {} when "
        "none. The estimate is of the cells matching all of them.",
    )
    by: list[str] | None = Field(
        default=None,
        description="The request's by= dimensions, or null: then groups is null.",
    )
    groups: list[EstimateGroup] | None = Field(
        default=None,
        description="With by=: one estimate per combination of the by= dimensions' values "
        "that has a released unit (time bucket of a cell holding min_reports reports), in "
        "mixed radix order (the first dimension most significant): its dimensions, then "
        "exactly what where=<its values> answers. Null without by=.",
    )
    withheld_groups: int = Field(
        default=0,
        description="With by=: groups that hold reports in the window but no released unit "
        "(left out of groups; their size is public as n is, their values never used).",
    )
    integrity: IntegrityOut | None = Field(
        default=None,
        description="How honest the window's reports look: the fit of their profile, the "
        "reports refused by rule, and an alert. Absent from a breakdown's groups.",
    )


class EstimateVectors(BaseModel):
    """A page of a categorical estimate in index order, as base64 float32 vectors
    (``format=vectors``): category ``first + i`` is element i of each vector."""

    encoding: Literal["base64-float32-le"] = Field(
        description="Each vector is base64 (RFC 4648, padded) of little-endian IEEE 754 "
        "binary32 numbers, count of them (e.g. numpy.frombuffer(base64.b64decode(text), "
        "'<f4'))."
    )
    first: int = Field(description="Index of the category of element 0 (the offset).")
    count: int = Field(description="Elements in each vector.")
    z: float = Field(
        description="The normal quantile of the confidence level: the interval of element i "
        "is frequency[i] ± z std[i], and its estimated count n frequency[i]."
    )
    frequency: str = Field(description="Unbiased estimates of the categories' shares.")
    std: str = Field(description="Their standard errors.")
    postprocessed: str = Field(
        description="The closest valid distribution (simplex projection of the whole "
        "vector); biased."
    )


class CategoricalEstimateOut(EstimateBase):
    kind: Literal["categorical"] = "categorical"
    resolved_mechanism: str = Field(description="The mechanism 'auto' resolved to.")
    estimates: list[FrequencyItem] = Field(
        description="The listed categories (see order and partial), with their unbiased "
        "estimates; empty for format=vectors."
    )
    postprocessed: list[PostprocessedItem] = Field(
        description="The closest valid distribution (simplex projection of the whole "
        "vector); biased. The same categories as estimates, in the same order."
    )
    domain_size: int = Field(description="How many categories the metric has.")
    partial: bool = Field(
        description="Whether some categories are not listed: by default a metric of more than "
        f"{FULL_LIST_DOMAIN:,} categories lists its {DEFAULT_TOP_VALUES:,} largest estimates "
        "(see order, next_offset)."
    )
    order: ListingOrder = Field(
        description="How the listed categories were chosen: 'index' (a page in index order), "
        "'frequency' (a page of the largest unbiased estimates first, ties by index) or "
        "'values' (exactly those the request named, in its order)."
    )
    offset: int = Field(description="Position in that order of the first category listed.")
    next_offset: int | None = Field(
        description="The offset of the next page in the same order; null after the last."
    )
    vectors: EstimateVectors | None = Field(
        default=None, description="format=vectors only: the page as compact vectors."
    )


class NumericEstimateOut(EstimateBase):
    kind: Literal["numeric"] = "numeric"
    mean: float = Field(description="Unbiased estimate of the mean of the clipped values.")
    std: float = Field(
        description="Standard error around the users' own mean (the mean of the reporting "
        "users' clipped values): the privacy noise alone. See std_method."
    )
    std_method: StdMethod = Field(
        description="How std was obtained: 'known' (the noise variance does not depend on the "
        "values), 'estimated' (unbiasedly, from the reports' sum of squares) or 'upper-bound' "
        "(not identifiable from the reports, e.g. duchi: the interval is conservative)."
    )
    ci_low: float = Field(description="Lower end of the interval mean ± z std (users' own mean).")
    ci_high: float = Field(description="Upper end of the interval mean ± z std (users' own mean).")
    population_std: float = Field(
        description="Standard error around the mean of the population the users were drawn "
        "from: the noise plus the spread of the users' values (sample variance of the "
        "debiased reports over n)."
    )
    population_ci_low: float = Field(description="Lower end of mean ± z population_std.")
    population_ci_high: float = Field(description="Upper end of mean ± z population_std.")
    lower: float
    upper: float
    postprocessed_mean: float = Field(description="The mean clipped to [lower, upper]; biased.")
    robust: RobustMeanOut | None = Field(
        default=None,
        description="laplace: the bounded-influence mean (reports winsorized at the honest "
        "noise's quantiles) with its bias bound; absent for other mechanisms.",
    )


class CandidateItem(BaseModel):
    string: str
    frequency: float = Field(description="Unbiased estimate of the candidate's share of reports.")
    std: float = Field(
        description="Standard error (cms, hcms, pem, sfp: with the hash-collision term)."
    )
    ci_low: float
    ci_high: float
    count: float = Field(description="n * frequency: the estimated number of reports.")
    detected: bool | None = Field(
        default=None,
        description="RAPPOR only: whether the decoder detected the candidate; null for cms, "
        "hcms, pem and sfp.",
    )


_RAPPOR_ONLY = "RAPPOR only (null for cms, hcms, pem and sfp): "
#: The fields of a string estimate that only RAPPOR's decoding fills.
_RAPPOR_FIELDS = (
    "epsilon_infinity",
    "detected",
    "explained_mass",
    "unexplained_mass",
    "smallest_detectable_frequency",
    "correction",
    "alpha",
)


class StringEstimateOut(EstimateBase):
    """Candidate strings' frequencies: RAPPOR decoded, or an open-domain mechanism's
    (cms, hcms, pem, sfp) unbiased estimates."""

    kind: Literal["string"] = "string"
    epsilon_infinity: float | None = Field(
        default=None,
        description=_RAPPOR_ONLY + "bound over any number of reports of one value.",
    )
    candidates: list[CandidateItem]
    detected: list[str] | None = Field(
        default=None, description=_RAPPOR_ONLY + "detected candidates, most frequent first."
    )
    explained_mass: float | None = Field(
        default=None,
        description=_RAPPOR_ONLY + "the total frequency the candidates take.",
    )
    unexplained_mass: float | None = Field(
        default=None,
        description=_RAPPOR_ONLY + "1 - explained_mass: strings that are not candidates.",
    )
    smallest_detectable_frequency: float | None = Field(
        default=None, description=_RAPPOR_ONLY + "the decoder's detection limit."
    )
    correction: str | None = Field(
        default=None,
        description=_RAPPOR_ONLY + "the detection's multiple-testing correction.",
    )
    alpha: float | None = Field(
        default=None, description=_RAPPOR_ONLY + "the significance level of detection."
    )


class HeavyHitterItem(BaseModel):
    string: str
    frequency: float = Field(description="Estimated share of reports holding the string.")
    std: float
    ci_low: float
    ci_high: float
    count: float = Field(description="n * frequency: the estimated number of reports.")


class HeavyHittersOut(EstimateBase):
    """The most frequent strings a discovery mechanism (pem, sfp) found without candidates."""

    kind: Literal["heavy-hitters"] = "heavy-hitters"
    k: int = Field(description="Strings asked for; fewer come back when fewer were found.")
    heavy_hitters: list[HeavyHitterItem] = Field(
        description="The strings found, most frequent first, with their estimates: the "
        "std and interval are of the estimate given the string was found (see the "
        "mechanism's documentation for how discovery and estimation share the reports)."
    )


_INTERVAL = "The 95% normal interval (see confidence): estimate ± z std."
_QUANTILE_METHOD = (
    "point: where the post-processed CDF crosses q, interpolated within its bucket (by width "
    "on a linear scale, by ratio on a log scale); interval: test inversion of the CDF's "
    "pointwise one-sided bounds at the bucket edges, in whole buckets (a bucket is ruled out "
    "when the lower bound of the CDF at its low edge is >= q, or the upper bound at its high "
    "edge is < q; the interval is the hull of the buckets left), covering the quantile with "
    "probability >= confidence to the normal approximation."
)


class HistogramItem(BaseModel):
    low: float = Field(description="The bucket's lower edge (inclusive), in value units.")
    high: float = Field(
        description="The bucket's upper edge (exclusive; the last bucket also holds upper)."
    )
    fraction: float = Field(
        description="Unbiased estimate of the share of values in the bucket, F^(high) - "
        "F^(low); may be negative or above 1."
    )
    std: float = Field(description="Its standard error (from the mechanism's own law).")
    ci_low: float = Field(description=_INTERVAL)
    ci_high: float = Field(description=_INTERVAL)
    postprocessed: float = Field(
        description="The bucket's share in the post-processed valid distribution "
        "(non-negative, summing to 1 over the buckets; made by method); biased."
    )


class CdfItem(BaseModel):
    value: float = Field(description="A bucket edge, in value units (lower first, upper last).")
    fraction: float = Field(
        description="Unbiased estimate of the share of values below value, F^(value): exactly "
        "0 at lower and 1 at upper."
    )
    std: float = Field(description="Its standard error (0 at lower and upper).")
    ci_low: float = Field(description="Pointwise 95% interval: fraction - z std.")
    ci_high: float = Field(description="Pointwise 95% interval: fraction + z std.")
    postprocessed: float = Field(
        description="The CDF of the post-processed distribution at value (non-decreasing); biased."
    )


class QuantileItem(BaseModel):
    q: float = Field(description="The level, strictly between 0 and 1.")
    value: float = Field(description="Point estimate of the q-quantile: " + _QUANTILE_METHOD)
    ci_low: float = Field(description="The interval's low end, a bucket edge.")
    ci_high: float = Field(description="The interval's high end, a bucket edge.")


class RangeOut(BaseModel):
    requested_low: float = Field(description="LOW as the request gave it.")
    requested_high: float = Field(description="HIGH as the request gave it.")
    low: float = Field(
        description="LOW snapped to the nearest bucket edge (within [lower, upper])."
    )
    high: float = Field(description="HIGH snapped to the nearest bucket edge.")
    fraction: float = Field(
        description="Unbiased estimate of the share of values in [low, high): F^(high) - F^(low)."
    )
    std: float = Field(description="Its standard error (the mechanism's Var[F^(high) - F^(low)]).")
    ci_low: float = Field(description=_INTERVAL)
    ci_high: float = Field(description=_INTERVAL)
    postprocessed: float = Field(
        description="The share of [low, high) under the post-processed distribution; biased, "
        "usually the smaller error (see method)."
    )


class DistributionEstimateOut(EstimateBase):
    """A distribution metric's (hh, sw) histogram, CDF, quantiles and range share."""

    kind: Literal["distribution"] = "distribution"
    lower: float = Field(description="Values are clipped to [lower, upper].")
    upper: float
    scale: Scale = Field(
        description="How [lower, upper] is cut into buckets: 'linear' (equal widths) or 'log' "
        "(equal ratios)."
    )
    value_buckets: int = Field(
        description="D, the value buckets of the histogram (buckets counts time buckets)."
    )
    method: str = Field(
        description="How the post-processed distribution was made from the unbiased one "
        "(e.g. 'consistency+isotonic': weighted isotonic regression of the CDF)."
    )
    histogram: list[HistogramItem] = Field(
        description="One item per value bucket, lowest first (D). Empty in a series: a series "
        "carries the quantiles and range per step; ask the estimate endpoint for one step's "
        "histogram."
    )
    cdf: list[CdfItem] = Field(
        description="One item per bucket edge, lower first (D + 1). Empty in a series, as "
        "histogram."
    )
    quantiles: list[QuantileItem] = Field(
        description="The levels the request named (quantiles=), in its order, else "
        f"{', '.join(f'{q:g}' for q in DEFAULT_QUANTILES)}. " + _QUANTILE_METHOD
    )
    range: RangeOut | None = Field(
        description="The share of values in the request's range=LOW,HIGH, its ends snapped "
        "to the nearest bucket edges; null without range=."
    )


class AttributesEstimateOut(AttributesEstimateFields, EstimateBase):
    """A multi-attribute metric's (spl, smp, rsfd) estimate of each attribute and the joint
    distribution of each declared pair (``aggregator.attribute_estimates``)."""


EstimateOut = (
    CategoricalEstimateOut
    | NumericEstimateOut
    | StringEstimateOut
    | DistributionEstimateOut
    | AttributesEstimateOut
)

_GROUP_DIMENSIONS = "The group's value of each by= dimension."


class CategoricalGroupOut(CategoricalEstimateOut):
    dimensions: dict[str, str] = Field(description=_GROUP_DIMENSIONS)


class NumericGroupOut(NumericEstimateOut):
    dimensions: dict[str, str] = Field(description=_GROUP_DIMENSIONS)


class StringGroupOut(StringEstimateOut):
    dimensions: dict[str, str] = Field(description=_GROUP_DIMENSIONS)


class DistributionGroupOut(DistributionEstimateOut):
    dimensions: dict[str, str] = Field(description=_GROUP_DIMENSIONS)


class AttributesGroupOut(AttributesEstimateOut):
    dimensions: dict[str, str] = Field(description=_GROUP_DIMENSIONS)


#: One group of a breakdown (``EstimateBase.groups``).
EstimateGroup = (
    CategoricalGroupOut
    | NumericGroupOut
    | StringGroupOut
    | DistributionGroupOut
    | AttributesGroupOut
)
for _model in (
    EstimateBase,
    CategoricalEstimateOut,
    NumericEstimateOut,
    StringEstimateOut,
    HeavyHittersOut,
    DistributionEstimateOut,
    CategoricalGroupOut,
    NumericGroupOut,
    StringGroupOut,
    DistributionGroupOut,
    AttributesEstimateOut,
    AttributesGroupOut,
):
    _model.model_rebuild()


class SeriesStep(BaseModel):
    start: str = Field(description="The step's first instant (UTC, inclusive).")
    end: str = Field(description="The step's end (UTC, exclusive).")
    n: int = Field(
        description="Reports stored in the step for this version, released or not (report "
        "counts are public, as an estimate's n is). With an estimate, n is its n plus its "
        "suppressed_reports."
    )
    estimate: EstimateOut | None = Field(
        description="Exactly the body GET /v1/metrics/{name}/estimate answers for this "
        "step's window (start, end) and version; null when no time bucket of the step holds "
        "min_reports reports (where the estimate endpoint answers 409)."
    )


class SeriesOut(BaseModel):
    """One estimate per time step of one metric version (``GET .../series``)."""

    metric: str
    version: int = Field(
        description="The version every step is estimated for: reports made under another "
        "version never enter (pick one with version=; the default is the current one)."
    )
    mechanism: str
    kind: Literal["categorical", "numeric", "string", "distribution", "attributes"] = Field(
        description="The kind of the steps' estimates (also for the steps with none)."
    )
    epsilon: float
    where: dict[str, str] = Field(
        default_factory=dict, description="The request's where= filters, echoed ({} when none)."
    )
    by: list[str] | None = Field(
        default=None,
        description="The request's by= dimensions, or null; each step's estimate then "
        "carries its groups.",
    )
    step: SeriesStepName
    start: str = Field(description="The first step's start (UTC): the range widened to steps.")
    end: str = Field(description="The last step's end (UTC, exclusive).")
    min_reports: int = Field(description="Release threshold per time bucket, as for estimates.")
    confidence: float = CONFIDENCE
    steps: list[SeriesStep] = Field(description="Every step of the range, oldest first.")


def build_estimate(
    metric: MetricSpec,
    mechanism: Mechanism[Any],
    stats: CountStatistics | MomentStatistics,
    window: EstimateWindow,
    released: ReleasedBuckets,
    candidates: list[str] | None = None,
    view: ValueView = DEFAULT_VIEW,
    value_buckets: bool = True,
) -> dict[str, object]:
    """The published estimate of ``stats``, the statistics of ``released.rows`` (JSON-ready,
    one of the ``*EstimateOut`` shapes, with every field of it: serialized as it is, it is
    the JSON its model gives); a categorical one lists the categories ``view`` chooses
    (``Listing``), a distribution the quantiles and range it names (``EstimateView``), and
    its histogram and CDF unless ``value_buckets`` is False (a series step). ValueError for
    a view that cannot be served."""
    check_view(metric, view)
    base = _base(metric, stats.n, window, released)
    if (strings := as_candidate_queries(mechanism)) is not None:
        assert isinstance(stats, CountStatistics)  # string mechanisms keep counts
        listed = estimated_strings(metric, candidates)
        return base | _string_estimate(mechanism, strings.estimate(stats, listed), listed)
    if (numbers := as_numeric(mechanism)) is not None:
        assert isinstance(stats, MomentStatistics)  # numeric mechanisms keep moments
        return base | _mean_estimate(numbers.estimate(stats))
    if (distribution := as_distribution(mechanism)) is not None:
        assert isinstance(stats, CountStatistics)  # distribution mechanisms keep counts
        shares = distribution.estimate(stats)
        return base | _distribution_estimate(shares, as_estimate_view(view), value_buckets)
    if (attributes := as_attributes(mechanism)) is not None:
        assert isinstance(stats, CountStatistics)  # multi-attribute mechanisms keep counts
        oracle = str(metric.mechanism.model_dump().get("oracle", "auto"))
        estimated = attributes.estimate(stats)
        return base | attributes_estimate(estimated, oracle, CONFIDENCE, marginals=value_buckets)
    categories = as_categorical(mechanism)
    assert categories is not None and isinstance(stats, CountStatistics)  # the last kind
    result = categories.estimate(stats)
    projected = result.postprocessed().frequencies
    return base | _categorical_estimate(metric, mechanism.name, result, projected, view)


def _categorical_estimate(
    metric: MetricSpec, resolved: str, result: Estimate, projected: np.ndarray, view: ValueView
) -> dict[str, object]:
    """A categorical estimate's own fields (``CategoricalEstimateOut``) from its unbiased
    ``result`` and post-processed ``projected`` frequencies: the categories ``view`` lists."""
    listing = Listing.of(metric, result.frequencies, view)
    answer: dict[str, object] = {"kind": "categorical", "resolved_mechanism": resolved}
    if view.format == "vectors":
        answer |= {
            "estimates": [],
            "postprocessed": [],
            "vectors": _vectors(result, projected, listing),
        }
    else:
        answer |= _frequency_items(metric, result, projected, listing.indices) | {"vectors": None}
    return answer | listing.as_json()


def check_breakdown(
    metric: MetricSpec,
    mechanism: Mechanism[Any],
    selection: Selection,
    candidates: list[str] | None,
    view: ValueView,
) -> None:
    """ValueError unless a ``by=`` estimate lists at most ``MAX_SERIES_VALUES`` values in
    all: its groups times the values one estimate lists (``series_values``, plus a
    distribution's histogram and CDF, 2 D + 1), so that a breakdown's work is bounded as a
    series' is."""
    if selection.by is None:
        return
    strings = (
        estimated_strings(metric, candidates)
        if as_candidate_queries(mechanism) is not None
        else None
    )
    values = series_values(mechanism, strings, view)
    if (spec := as_distribution_spec(metric.mechanism)) is not None:
        values += 2 * spec.bucket_count + 1
    if as_attributes(mechanism) is not None:
        values = listed_values(metric.mechanism.model_dump(), marginals=True)
    total = selection.groups * values
    if total > MAX_SERIES_VALUES:
        raise DimensionError(
            "by",
            f"by={','.join(selection.by)} makes {selection.groups:,} groups x {values:,} values "
            f"= {total:,}; at most {MAX_SERIES_VALUES:,}: break down by fewer or smaller "
            "dimensions, or fix some with where=",
        )


def breakdown(
    metric: MetricSpec,
    mechanism: Mechanism[Any],
    rows: Sequence[PartialRow],
    window: EstimateWindow,
    selection: Selection,
    min_reports: int,
    current: int,
    statistics: Sequence[CountStatistics | MomentStatistics],
    candidates: list[str] | None = None,
    view: ValueView = DEFAULT_VIEW,
    value_buckets: bool = True,
) -> dict[str, object]:
    """The breakdown fields of an estimate over ``rows`` (the window's rows of the cells
    ``selection`` keeps): ``where``, ``by``, and with ``by`` one estimate per group that
    has a released unit (``groups``: its ``dimensions``, then exactly the fields
    ``build_estimate`` gives for the group's released units, as ``where=`` its values
    answers) and how many groups hold reports but no released unit (``withheld_groups``).
    ``statistics``: each group's statistics of its released units (``grouped_statistics``
    of the released rows, by ``Selection.group_of``).

    The units are released for all groups at once (``ReleasedBuckets.grouped``); then one
    ``build_estimate`` per listed group."""
    fields = selection.as_json()
    if selection.by is None:
        return fields | {"groups": None, "withheld_groups": 0}
    released = ReleasedBuckets.grouped(
        rows, selection.group_of_cell, selection.groups, min_reports, current
    )
    listed = [g for g, group in enumerate(released) if group.rows]
    categories = as_categorical(mechanism) if as_candidate_queries(mechanism) is None else None
    results: list[Estimate] = []
    if categories is not None and listed:  # every group's frequencies as one matrix
        check_view(metric, view)
        counts = [statistics[g] for g in listed]
        results = categories.estimate_many(cast(list[CountStatistics], counts))
        projected = project_rows_to_simplex(np.stack([result.frequencies for result in results]))
    groups = []
    for position, g in enumerate(listed):
        group, values = released[g], selection.labels[g]
        if results:
            estimate = _base(metric, statistics[g].n, window, group) | _categorical_estimate(
                metric, mechanism.name, results[position], projected[position], view
            )
        else:
            estimate = build_estimate(
                metric, mechanism, statistics[g], window, group, candidates, view, value_buckets
            )
        estimate.update(where=selection.where | values, by=None, groups=None, withheld_groups=0)
        groups.append({"dimensions": values, **estimate})
    withheld = sum(1 for group in released if not group.rows and group.suppressed_reports)
    return fields | {"groups": groups, "withheld_groups": withheld}


def _mean_estimate(result: MeanEstimate) -> dict[str, object]:
    """A numeric estimate's own fields (``NumericEstimateOut``)."""
    low, high = result.ci(CONFIDENCE)
    population_low, population_high = result.ci(CONFIDENCE, population=True)
    return {
        "kind": "numeric",
        "mean": result.mean,
        "std": result.std,
        "std_method": result.std_method,
        "ci_low": low,
        "ci_high": high,
        "population_std": result.population_std,
        "population_ci_low": population_low,
        "population_ci_high": population_high,
        "lower": result.lower,
        "upper": result.upper,
        "postprocessed_mean": result.postprocessed(),
    }


def _distribution_estimate(
    result: DistributionEstimate, view: EstimateView, value_buckets: bool
) -> dict[str, object]:
    """A distribution estimate's own fields (``DistributionEstimateOut``): the histogram and
    CDF columns as vectors over the buckets (unless ``value_buckets`` is False), the
    quantiles and range ``view`` names (``DistributionEstimate.quantiles``,
    ``range_fraction``)."""
    chosen = view.range
    return {
        "kind": "distribution",
        "lower": float(result.edges[0]),
        "upper": float(result.edges[-1]),
        "scale": result.scale,
        "value_buckets": result.buckets,
        "method": result.method,
        "histogram": _histogram_items(result) if value_buckets else [],
        "cdf": _cdf_items(result) if value_buckets else [],
        "quantiles": [asdict(item) for item in result.quantiles(view.levels, CONFIDENCE)],
        "range": asdict(result.range_fraction(*chosen, CONFIDENCE)) if chosen else None,
    }


def _histogram_items(result: DistributionEstimate) -> list[dict[str, object]]:
    """One ``HistogramItem`` per bucket: x^_b = F^_{b+1} - F^_b, its std, x^_b ± z std, and
    the post-processed share."""
    fractions, std = result.fractions(), result.fraction_std()
    return _items(
        ("low", "high", "fraction", "std", "ci_low", "ci_high", "postprocessed"),
        result.edges[:-1],
        result.edges[1:],
        *_with_interval(fractions, std),
        result.postprocessed,
    )


def _cdf_items(result: DistributionEstimate) -> list[dict[str, object]]:
    """One ``CdfItem`` per edge: F^_k, its std, F^_k ± z std, and the post-processed CDF."""
    return _items(
        ("value", "fraction", "std", "ci_low", "ci_high", "postprocessed"),
        result.edges,
        *_with_interval(result.cdf, result.cdf_std()),
        result.postprocessed_cdf(),
    )


def _with_interval(estimate: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, ...]:
    """(estimate, std, estimate - z std, estimate + z std) at ``CONFIDENCE``."""
    half = z_value(CONFIDENCE) * std
    return estimate, std, estimate - half, estimate + half


def _items(keys: Sequence[str], *columns: np.ndarray) -> list[dict[str, object]]:
    """One object per row of the equally long ``columns``, named ``keys`` (only here do the
    vectors become Python objects)."""
    rows = zip(*(np.asarray(column, dtype=np.float64).tolist() for column in columns), strict=True)
    return [dict(zip(keys, row, strict=True)) for row in rows]


def _frequency_items(
    metric: MetricSpec, result: Estimate, projected: np.ndarray, indices: np.ndarray
) -> dict[str, list[dict[str, object]]]:
    """``estimates`` and ``postprocessed`` items of the categories ``indices``: the columns
    are sliced as vectors, and only the listed categories become objects."""
    frequencies = result.frequencies[indices]
    half = z_value(CONFIDENCE) * result.std[indices]
    order = indices.tolist()
    labels = [metric.labels[i] for i in order] if metric.labels is not None else [None] * len(order)
    estimates = [
        {
            "index": index,
            "label": label,
            "frequency": frequency,
            "std": std,
            "ci_low": low,
            "ci_high": high,
            "count": count,
        }
        for index, label, frequency, std, low, high, count in zip(
            order,
            labels,
            frequencies.tolist(),
            result.std[indices].tolist(),
            (frequencies - half).tolist(),
            (frequencies + half).tolist(),
            (frequencies * result.n).tolist(),
            strict=True,
        )
    ]
    postprocessed = [
        {"index": index, "label": label, "frequency": valid}
        for index, label, valid in zip(order, labels, projected[indices].tolist(), strict=True)
    ]
    return {"estimates": estimates, "postprocessed": postprocessed}


def _vectors(result: Estimate, projected: np.ndarray, listing: Listing) -> dict[str, object]:
    """The ``EstimateVectors`` of ``listing`` (a range of indices, ``format=vectors``)."""
    chosen = listing.indices
    return {
        "encoding": "base64-float32-le",
        "first": listing.offset,
        "count": int(chosen.size),
        "z": z_value(CONFIDENCE),
        "frequency": encode_vector(result.frequencies[chosen]),
        "std": encode_vector(result.std[chosen]),
        "postprocessed": encode_vector(projected[chosen]),
    }


def check_view(metric: MetricSpec, view: ValueView) -> None:
    """ValueError unless ``view`` can be served for ``metric`` (``ValueView.check``; only a
    categorical metric's categories can be chosen, only a distribution's quantiles and
    range, and the range must span at least one of its buckets)."""
    kind = metric.mechanism.kind
    if kind != "categorical" and not view.is_default:
        raise ValueError(
            "values, order, offset, limit and format choose categories of a categorical "
            f"metric; {metric.name!r} is a {kind} metric"
        )
    asked = as_estimate_view(view)
    spec = as_distribution_spec(metric.mechanism)
    if asked.asks_distribution and spec is None:
        names = ", ".join(sorted(DISTRIBUTION_MECHANISMS))
        raise ValueError(
            f"quantiles and range apply to distribution metrics ({names}); {metric.name!r} is "
            f"a {kind} metric"
        )
    if asked.range is not None:
        assert spec is not None  # refused above otherwise
        _bucket_grid(spec).range_fraction(*asked.range)  # raises if too narrow
    view.check()


def _bucket_grid(spec: DistributionSpec) -> DistributionEstimate:
    """The spec's buckets as an estimate of no reports (uniform, no variance): how a range
    snaps to the edges depends on them alone, so it is checked before any report is read."""
    buckets = spec.bucket_count
    return DistributionEstimate(
        edges=spec.edges(),
        scale=spec.scale or "linear",
        n=0,
        cdf=np.linspace(0.0, 1.0, buckets + 1),
        range_variance=lambda low, high: np.zeros(np.shape(low)),
        postprocessed=np.full(buckets, 1.0 / buckets),
        method="none",
    )


def estimated_strings(metric: MetricSpec, candidates: list[str] | None) -> list[str]:
    """The strings a string metric's estimate is made at: ``candidates``, else the metric's
    labels (ValueError when there are none)."""
    listed = candidates or list(metric.labels or ())
    if not listed:
        raise ValueError(
            f"this {metric.mechanism.mechanism} metric lists no candidate strings: pass "
            "candidates=... to estimate them"
        )
    return listed


def series_strings(
    metric: MetricSpec,
    mechanism: Mechanism[Any],
    grid: SeriesGrid,
    candidates: list[str] | None,
    view: ValueView = DEFAULT_VIEW,
    groups: int = 1,
) -> list[str] | None:
    """The strings a string metric's series estimates (``estimated_strings``; None for the
    other metrics), once the series is known to fit: ValueError when it would hold more
    than ``MAX_SERIES_VALUES`` values (steps times ``series_values`` times the ``groups``
    of a breakdown, each with its own values beside the step's) or, with groups, more than
    ``MAX_SERIES_STEPS`` group estimates (steps times groups: each costs an estimate's
    work, whatever it lists), or for a view that is not a series' (``format=vectors``).
    """
    if view.format != "json":
        raise ValueError("a series lists its categories as JSON: omit format")
    check_view(metric, view)
    listed = (
        estimated_strings(metric, candidates)
        if as_candidate_queries(mechanism) is not None
        else None
    )
    if groups > 1 and grid.count * groups > MAX_SERIES_STEPS:
        raise DimensionError(
            "by",
            f"the series would hold {grid.count:,} steps x {groups:,} groups = "
            f"{grid.count * groups:,} group estimates; at most {MAX_SERIES_STEPS:,}: choose a "
            "shorter range, step=1d, a by= of fewer groups, or fix some with where=",
        )
    each = series_values(mechanism, listed, view)
    values = each * (groups + (groups > 1))
    if grid.count * values > MAX_SERIES_VALUES:
        narrower = {
            "categorical": f"fewer categories (values=..., or limit=; each estimate lists "
            f"{each // 2:,})",
            "distribution": "fewer quantiles",
        }.get(metric.mechanism.kind, "fewer candidates")
        if groups > 1:
            narrower += ", or a by= of fewer groups"
        raise ValueError(
            f"the series would hold {grid.count} step{'s' * (grid.count != 1)} x {values} "
            f"values = {grid.count * values:,}; at most {MAX_SERIES_VALUES:,}: choose a "
            f"shorter range, step=1d, or {narrower}"
        )
    return listed


@dataclass(frozen=True)
class SeriesIntegrity:
    """What a series' steps need for their ``integrity`` (``aggregator.integrity``): the
    range's profile rows and its refused reports by bucket and rule."""

    profiles: Sequence[PartialRow]
    refused: dict[int, dict[str, int]]


def build_series(
    metric: MetricSpec,
    mechanism: Mechanism[Any],
    rows: Sequence[PartialRow],
    grid: SeriesGrid,
    min_reports: int,
    current: int,
    strings: list[str] | None = None,
    view: ValueView = DEFAULT_VIEW,
    selection: Selection | None = None,
    integrity: SeriesIntegrity | None = None,
) -> dict[str, object]:
    """One estimate per step of ``grid`` from ``rows`` (the range's partial rows), JSON-ready
    in the ``SeriesOut`` shape; a string metric's at ``strings`` (``series_strings``), a
    categorical one's listing the categories ``view`` chooses, of the cells ``selection``
    keeps and with its groups (``breakdown``). ``current`` is the start of the bucket
    still filling (``current_bucket``).

    The rows are grouped by step in one pass (a stable sort of their step indices); each
    step's estimate is ``build_estimate`` of its released units (``ReleasedBuckets``), or
    None when no unit of the step holds ``min_reports`` reports. With ``integrity`` each
    step's estimate carries its window's ``integrity`` (and ``robust``), as ``estimate``'s.
    """
    selection = selection or Selection.of(metric)
    rows = selection.rows(rows)
    buckets = np.fromiter((row.bucket for row in rows), dtype=np.int64, count=len(rows))
    sizes = np.fromiter((row.n for row in rows), dtype=np.int64, count=len(rows))
    step_of = (buckets - grid.first) // grid.seconds
    order = np.argsort(step_of, kind="stable")
    edges = np.searchsorted(step_of[order], np.arange(grid.count + 1)).tolist()
    totals = np.bincount(step_of, weights=sizes, minlength=grid.count).astype(np.int64).tolist()
    steps: list[dict[str, object]] = []
    for index in range(grid.count):
        window = grid.window(index)
        step_rows = [rows[i] for i in order[edges[index] : edges[index + 1]].tolist()]
        released = ReleasedBuckets.of(step_rows, min_reports, current)
        estimate = None
        if released.rows:
            stats, each = grouped_statistics(
                mechanism, released.rows, selection.group_of(released.rows), selection.groups
            )
            estimate = build_estimate(
                metric, mechanism, stats, window, released, strings, view, value_buckets=False
            ) | breakdown(
                metric,
                mechanism,
                step_rows,
                window,
                selection,
                min_reports,
                current,
                each,
                strings,
                view,
                value_buckets=False,
            )
            if integrity is not None:
                estimate |= integrity_fields(
                    mechanism, released.rows, integrity.profiles, integrity.refused, stats,
                    grid.first + index * grid.seconds, grid.first + (index + 1) * grid.seconds,
                )  # fmt: skip
        steps.append({**window.as_json(), "n": totals[index], "estimate": estimate})
    return {
        "metric": metric.name,
        "version": metric.version,
        "mechanism": metric.mechanism.mechanism,
        "kind": metric.mechanism.kind,
        "epsilon": metric.mechanism.epsilon,
        **selection.as_json(),
        "step": grid.step,
        "start": _iso(grid.first),
        "end": _iso(grid.stop),
        "min_reports": min_reports,
        "confidence": CONFIDENCE,
        "steps": steps,
    }


def series_values(
    mechanism: Mechanism[Any], candidates: list[str] | None, view: ValueView = DEFAULT_VIEW
) -> int:
    """How many values one step's estimate holds: the categories ``view`` lists (each with
    its post-processed twin, so two per category), its candidate strings, a distribution's
    quantiles (and its range, one more), or one mean."""
    if candidates is not None:
        return len(candidates)
    if (categories := as_categorical(mechanism)) is not None:
        return 2 * view.listed_count(categories.domain_size)
    if as_distribution(mechanism) is not None:
        asked = as_estimate_view(view)
        return len(asked.levels) + (asked.range is not None)
    if as_attributes(mechanism) is not None:
        return listed_values(mechanism.spec.model_dump(), marginals=False)
    return 1


def build_heavy_hitters(
    metric: MetricSpec,
    mechanism: Discovery,
    stats: CountStatistics,
    window: EstimateWindow,
    released: ReleasedBuckets,
    k: int,
) -> dict[str, object]:
    """The ``k`` most frequent strings ``mechanism`` finds in ``stats`` (the statistics of
    ``released.rows``) without candidates, JSON-ready in the ``HeavyHittersOut`` shape."""
    found = mechanism.heavy_hitters(stats, k)
    return _base(metric, stats.n, window, released) | {
        "kind": "heavy-hitters",
        "k": k,
        "heavy_hitters": _string_items(found.strings, found),
    }


def _base(
    metric: MetricSpec, n: int, window: EstimateWindow, released: ReleasedBuckets
) -> dict[str, object]:
    """What every estimate says: the metric version, its privacy promise, n and the window."""
    return {
        "metric": metric.name,
        "version": metric.version,
        "mechanism": metric.mechanism.mechanism,
        "epsilon": metric.mechanism.epsilon,
        "epsilon_report": metric.mechanism.report_epsilon if metric.mechanism.is_memoized else None,
        "n": n,
        "confidence": CONFIDENCE,
        "window": window.as_json(),
        **released.as_json(),
    }


def _string_items(strings: Sequence[str], result: Estimate) -> list[dict[str, object]]:
    """One item per string: its estimate, std, 95% interval and n * frequency."""
    low, high = result.ci(CONFIDENCE)
    counts = result.counts
    return [
        {
            "string": string,
            "frequency": float(result.frequencies[i]),
            "std": float(result.std[i]),
            "ci_low": float(low[i]),
            "ci_high": float(high[i]),
            "count": float(counts[i]),
        }
        for i, string in enumerate(strings)
    ]


def _string_estimate(
    mechanism: Mechanism[Any], result: Estimate, listed: list[str]
) -> dict[str, object]:
    """A string estimate's own fields (``StringEstimateOut``): the candidates' estimates,
    and what a decoder with detection (RAPPOR's ``RapporEstimate``) adds; null otherwise."""
    if not isinstance(result, RapporEstimate):
        items = _string_items(listed, result)
        return dict.fromkeys(_RAPPOR_FIELDS) | {
            "kind": "string",
            "candidates": [item | {"detected": None} for item in items],
        }
    lifelong = as_memoized(mechanism)
    items = _string_items(result.candidates, result)
    for item, detected in zip(items, result.detected.tolist(), strict=True):
        item["detected"] = bool(detected)
    return {
        "kind": "string",
        "epsilon_infinity": lifelong.epsilon_lifetime if lifelong is not None else None,
        "candidates": items,
        "detected": [item.string for item in result.detected_strings(CONFIDENCE)],
        "explained_mass": result.explained_mass,
        "unexplained_mass": result.unexplained_mass,
        "smallest_detectable_frequency": result.smallest_detectable_frequency,
        "correction": result.correction,
        "alpha": result.alpha,
    }
