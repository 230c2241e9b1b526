"""Several private attributes in one report: ``spl``, ``smp`` and ``rsfd``.

A report covers the spec's views (``shared.mechanisms.multidim_spec``: the declared
pairs, then each attribute in no pair; k views). Categorical views go through GRR or OUE
(``oracle``; "auto" picks per view the lower planning variance at the view's epsilon and
domain), numeric views through ``duchi`` or ``piecewise``, whichever has the lower
worst-case variance at the view's epsilon (the classes of those modules, built at it).

* ``spl`` (split): every view reported with epsilon / k. epsilon-LDP by sequential
  composition: the views are drawn independently.
* ``smp`` (sample): the device draws one view uniformly (secure randomness) and reports
  only it, with epsilon; the view index is in the clear. epsilon-LDP: the view choice does
  not depend on the values, and the chosen view's report is epsilon-LDP.
* ``rsfd`` (random sampling plus fake data; Arcolezi, Couchot, Al Bouna, Xiao, CIKM 2021):
  the device draws one view, reports it truly and every other view with fake data that
  does not depend on its values (GRR: a uniform value; OUE: the report of no value, every
  bit Bernoulli(q), "RS+FD[OUE-z]"; numeric: the inner mechanism's report of a uniform
  grid input: an end of the range for ``duchi``, a grid point for ``piecewise``). The view
  stays hidden. Every view is reported with the inner epsilon = epsilon itself, NOT the
  paper's amplified eps' = ln(k (e^eps - 1) + 1). Whole report: with s the sampled view,
  P(y | x) = (1 / k) sum_s P_s(y_s | x_s) prod_{j != s} Fake_j(y_j); the fake factors do not
  depend on x, so each term's ratio between x and x' is at most e^{eps_inner}, and so is
  the mixture's. The bound is reached: for x, x' that differ in every attribute and y_j = x_j
  in every (GRR) view, P(y | x) / P(y | x') = (p / D^(k-1)) / (q / D^(k-1)) = p / q =
  e^{eps_inner}. So eps_inner = eps' > eps breaks eps-LDP of the report; the amplified
  value bounds only neighbours that differ in ONE attribute
  (``tests/shared/test_multidim_privacy.py`` enumerates the counterexample).

Estimation (unbiased per view, ``shared.marginals`` for the covariances and consistency):
with C the view's counts over m reports, f = (C / m - q') / (p' - q'), where (p', q') are the
inner oracle's under ``spl`` and ``smp`` and, under ``rsfd``, the mixture's: GRR
p' = p / k + (k - 1) / (k D), q' = q / k + (k - 1) / (k D); OUE-z p' = (p + (k - 1) q) / k,
q' = q. Its covariance is exact for the observed devices (``frequency_covariance``, plugged
in at the view's Norm-Sub distribution g); under ``smp`` the view's m devices are a random
subset of the n, and the estimand is the share among all n: the covariance adds
rho (diag g - g g^T) / m, rho = (n - m) / (n - 1). Numeric views keep the histogram of
output indices; the mean of the debiased outputs (``rsfd``: z = k y - (k - 1) c, c the range's
centre, since a fake's debiased mean is c) is unbiased; its variance is the inner
mechanism's noise estimate (``spl``), mixed with the sample variance as
(1 - rho) noise + rho s^2 / m under ``smp`` (the finite-population term), and s_z^2 / n under
``rsfd`` (conservative: it includes the spread of the values).

Under ``smp`` and ``rsfd`` the views are dependent (each device samples one view): the
consistent estimates' std includes the covariance between views, exactly
(``shared.marginals``, ``ViewDependence``: ``smp`` -Cov_pop / (n - 1), the random partition
of the devices over the views; ``rsfd`` -(1/n) times the raw cross moment about the cell
averages: a device reports one view truly, so its views covary). Under ``smp`` a view without
reports (tiny n) is left out of the consistent combinations (weights renormalized over the
views with reports); an attribute whose every view is without reports, and such a pair,
answer NaN frequencies and std (serialized as null).

Report (array form): uint8 rows. ``spl``, ``rsfd``: every view's bytes concatenated in view
order; ``smp``: byte 0 the view index, then that view's bytes, zero padded to the widest.
A view's bytes: GRR: the value, 2 bytes big-endian; OUE: the packed bits (``np.packbits``);
duchi: 1 byte, 0 for -1 and 1 for +1; piecewise: the cell index, 2 bytes big-endian.
Payload: ``{"report": base64 of the view bytes}`` (``smp``: also ``"view": int`` and only
that view's bytes). Statistics: one ``CountStatistics``: (``smp`` only: the k reports per
view, then) per view its counts (GRR: histogram; OUE: bit sums; numeric: histogram of
output indices), concatenated in view order.

Refusal rules (``shared.integrity``): one per OUE view, ``"<protocol>.view<v>.ones_count"``,
the unary rule (``shared.mechanisms.unary``) on that view's bits: more than U ones is
refused, U the least count with P(Bernoulli(p) + Binomial(D - 1, q) > U) within the side
bound, and fewer than L, L the largest with the smallest honest law's P(count < L)
within it: that same law under ``spl`` and ``smp``, and under ``rsfd`` the fake view's
Binomial(D, q) (stochastically smaller: q < p). Under ``spl`` and ``rsfd`` every report
carries every view, so each side's bound is 2^-41 / (number of OUE views) and the union of
the rules refuses an honest report with probability at most 2^-40; under ``smp`` a report
carries one view and each side keeps 2^-41. GRR and numeric views have none (every output
is likely under some input: ``shared.mechanisms.grr``, ``duchi``, ``piecewise``).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, cast

import numpy as np

from shared.attributes import (
    AttributesEstimate,
    CategoricalAttribute,
    NumericAttribute,
    PairMarginal,
)
from shared.bitcount import bit_sums
from shared.integrity import RefusalRule
from shared.marginals import (
    INDEPENDENT,
    PairView,
    ViewCovariance,
    ViewDependence,
    conditional_shares,
    fit_margins,
    frequency_covariance,
    make_consistent,
    norm_sub,
    normalize,
    row_variances,
    sampling_covariance,
)
from shared.mechanisms.abilities import FRESH, AttributeValues, DeviceContext
from shared.mechanisms.base import BASE64, INTEGER, Mechanism, check_packed_rows, payload_shape
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.duchi import DuchiMean, DuchiSpec
from shared.mechanisms.grr import GeneralizedRandomizedResponse, GrrSpec
from shared.mechanisms.multidim_spec import (
    PROTOCOLS,
    MultiAttributeSpec,
    RsfdSpec,
    SmpSpec,
    SplSpec,
    ViewPlan,
)
from shared.mechanisms.numeric import NumericMechanism
from shared.mechanisms.piecewise import PiecewiseMechanism, PiecewiseSpec
from shared.mechanisms.registry import make_mechanism, register
from shared.mechanisms.spec import MechanismSpec
from shared.mechanisms.unary import (
    OnesCountBounds,
    OptimizedUnaryEncoding,
    OueSpec,
    binomial_sum_pmf,
    count_ones,
)
from shared.mechanisms.window import draw_window_cells
from shared.randomness import RandomSource, Rng, as_source
from shared.statistics import CountStatistics, MomentStatistics


def _u16_bytes(values: np.ndarray) -> np.ndarray:
    """Each value (0..65535) as 2 bytes, most significant first (big-endian uint16)."""
    return np.asarray(values).astype(">u2").view(np.uint8).reshape(-1, 2)


def _u16_values(block: np.ndarray) -> np.ndarray:
    return (block[:, 0].astype(np.int64) << 8) | block[:, 1].astype(np.int64)


#: One view's report bytes (a row per report) and the reports' positions in their batch.
ViewBlock = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class View:
    """One view with its inner mechanism: how its values become bytes and counts."""

    plan: ViewPlan
    inner: Mechanism[Any]

    @property
    def oracle(self) -> str:
        return self.inner.name

    @property
    def width(self) -> int:
        """Bytes of one report of this view."""
        if self.oracle == "oue":
            return (self.plan.cells + 7) // 8
        return 1 if self.oracle == "duchi" else 2

    @property
    def length(self) -> int:
        """Counts this view keeps: its categories, or its numeric output indices."""
        if self.oracle == "duchi":
            return 2
        if self.oracle == "piecewise":
            return cast(PiecewiseMechanism, self.inner).cells
        return self.plan.cells

    def inputs(self, rows: np.ndarray) -> np.ndarray:
        """The inner mechanism's values: the category (a pair's cell i d2 + j) or the number."""
        if self.plan.is_numeric:
            return rows[:, self.plan.columns[0]]
        index = rows[:, self.plan.columns[0]].astype(np.int64)
        if len(self.plan.columns) == 2:
            index = index * self.plan.shape[1] + rows[:, self.plan.columns[1]].astype(np.int64)
        return index

    def to_bytes(self, reports: np.ndarray) -> np.ndarray:
        if self.oracle == "oue":
            return np.asarray(reports, dtype=np.uint8).reshape(-1, self.width)
        if self.oracle == "duchi":
            return ((reports.astype(np.int64) + 1) // 2).astype(np.uint8)[:, None]
        return _u16_bytes(np.asarray(reports, dtype=np.int64))

    def encode(self, inputs: np.ndarray, source: RandomSource) -> np.ndarray:
        if inputs.size == 0:
            return np.zeros((0, self.width), np.uint8)
        return self.to_bytes(self.inner.encode(inputs, cast(Rng, source)))  # as_source takes it

    def fake(self, n: int, source: RandomSource) -> np.ndarray:
        """n reports that do not depend on any value (``rsfd``, module docstring)."""
        if self.oracle == "grr":
            return self.to_bytes(source.integers(self.plan.cells, n))
        if self.oracle == "oue":
            threshold = cast(OptimizedUnaryEncoding, self.inner).thresholds[1]
            return source.bernoulli_bits(threshold, n, self.plan.cells)
        if self.oracle == "duchi":
            duchi = cast(DuchiMean, self.inner)
            ends = np.where(source.integers(2, n) == 1, duchi.upper, duchi.lower)
            return self.to_bytes(duchi.encode(ends, cast(Rng, source)))
        pw = cast(PiecewiseMechanism, self.inner)
        index = source.integers(pw.grid_steps + 1, n)
        return self.to_bytes(draw_window_cells(index, pw.window, pw.cells, pw.threshold, source))

    def check(self, block: np.ndarray, rows: np.ndarray) -> None:
        """ValueError naming the first report (of ``rows``, their positions) out of range."""
        if self.oracle == "oue":
            try:
                check_packed_rows(block, self.plan.cells, "big", "bit row")
            except ValueError as error:
                raise ValueError(f"view {self.describe()}: {error}") from None
            return
        values = block[:, 0].astype(np.int64) if self.oracle == "duchi" else _u16_values(block)
        bad = np.flatnonzero(values >= self.length)
        if bad.size:
            raise ValueError(
                f"report {rows[bad[0]]}: view {self.describe()} value {values[bad[0]]} is "
                f"outside 0..{self.length - 1}"
            )

    def describe(self) -> str:
        return "(" + ", ".join(str(c) for c in self.plan.columns) + ")"

    def counts(self, block: np.ndarray) -> np.ndarray:
        if self.oracle == "oue":
            return bit_sums(block, self.plan.cells).astype(np.int64)
        values = block[:, 0].astype(np.int64) if self.oracle == "duchi" else _u16_values(block)
        return np.bincount(values, minlength=self.length).astype(np.int64)

    def simulate(self, inputs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The counts of these devices reporting this view truly, drawn from their law
        (categorical: the inner fast path, O(cells); numeric: exact, below)."""
        if not self.plan.is_numeric:
            histogram = np.bincount(inputs, minlength=self.plan.cells)
            inner = cast(CategoricalMechanism, self.inner)
            return inner.simulate_statistics(histogram, rng).counts
        levels, counts = np.unique(inputs, return_counts=True)
        if self.oracle == "duchi":
            plus = int(
                rng.binomial(counts, cast(DuchiMean, self.inner).plus_probability(levels)).sum()
            )
            return np.array([inputs.size - plus, plus], np.int64)
        pw = cast(PiecewiseMechanism, self.inner)
        below, phi = pw.rounding(levels)
        up = rng.binomial(counts, phi)
        grid = np.bincount(below, weights=counts - up, minlength=pw.grid_steps + 2)
        grid = (grid + np.bincount(below + 1, weights=up, minlength=pw.grid_steps + 2)).astype(
            np.int64
        )
        used = np.flatnonzero(grid)
        if used.size == 0:
            return np.zeros(self.length, np.int64)
        return rng.multinomial(grid[used], self._piecewise_rows(used)).sum(axis=0)

    def _piecewise_rows(self, index: np.ndarray) -> np.ndarray:
        """P(cell | grid index i): H on the window [i, i + w), L elsewhere (``piecewise``)."""
        pw = cast(PiecewiseMechanism, self.inner)
        cells = np.arange(pw.cells)[None, :]
        inside = (cells >= index[:, None]) & (cells < index[:, None] + pw.window)
        return np.where(inside, pw.high, pw.low)

    def simulate_fake(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """The counts of n fake reports, drawn from their law (exact)."""
        if self.oracle == "grr":
            return rng.multinomial(n, np.full(self.plan.cells, 1.0 / self.plan.cells))
        if self.oracle == "oue":
            return rng.binomial(n, cast(OptimizedUnaryEncoding, self.inner).q, self.plan.cells)
        if self.oracle == "duchi":
            plus = int(rng.binomial(n, 0.5))  # T_lo + T_hi = 2^53: exactly 1/2
            return np.array([n - plus, plus], np.int64)
        pw = cast(PiecewiseMechanism, self.inner)
        law = self._piecewise_rows(np.arange(pw.grid_steps + 1)).mean(axis=0)
        return rng.multinomial(n, law / law.sum())

    def output_values(self) -> np.ndarray:
        """The debiased value (original units) of each numeric output index."""
        numeric = cast(NumericMechanism, self.inner)
        if self.oracle == "duchi":
            return numeric.debias(np.array([-1, 1]))
        return numeric.debias(np.arange(self.length))


def _inner_categorical(oracle: str, epsilon: float, cells: int) -> CategoricalMechanism:
    grr = GeneralizedRandomizedResponse(
        GrrSpec(mechanism="grr", epsilon=epsilon, domain_size=cells)
    )
    oue = OptimizedUnaryEncoding(OueSpec(mechanism="oue", epsilon=epsilon, domain_size=cells))
    if oracle == "grr":
        return grr
    if oracle == "oue":
        return oue
    return grr if grr.variance(1) <= oue.variance(1) else oue


def _inner_numeric(epsilon: float, lower: float, upper: float) -> NumericMechanism:
    duchi = DuchiMean(DuchiSpec(mechanism="duchi", epsilon=epsilon, lower=lower, upper=upper))
    pw = PiecewiseMechanism(
        PiecewiseSpec(mechanism="piecewise", epsilon=epsilon, lower=lower, upper=upper)
    )
    return duchi if duchi.variance(1) <= pw.variance(1) else pw


class MultiAttributeMechanism(Mechanism[CountStatistics]):
    """The body the three protocols share (module docstring)."""

    provides: ClassVar[tuple[type, ...]] = (AttributeValues,)
    spec: MultiAttributeSpec
    payload_schema = payload_shape(
        "AttributesPayload",
        "spl, rsfd: base64 of every view's bytes concatenated in view order (GRR: the value, "
        "2 bytes big-endian; OUE: numpy.packbits bytes; duchi: 1 byte 0/1 for -1/+1; "
        "piecewise: the cell, 2 bytes big-endian).",
        report=BASE64,
    )

    def __init__(self, spec: MultiAttributeSpec) -> None:
        super().__init__(spec)
        epsilon = spec.view_epsilon
        oracle = spec.oracle or "auto"
        views = []
        for plan in spec.views:
            if plan.is_numeric:
                attribute = spec.attributes[plan.columns[0]]
                assert attribute.lower is not None and attribute.upper is not None
                inner: Mechanism[Any] = _inner_numeric(epsilon, attribute.lower, attribute.upper)
            else:
                inner = _inner_categorical(oracle, epsilon, plan.cells)
            views.append(View(plan, inner))
        self.views: tuple[View, ...] = tuple(views)
        self.k = len(views)
        self.offsets = np.cumsum([0] + [view.width for view in views])
        self.prefix = self.k if self.name == "smp" else 0
        self.block_starts = self.prefix + np.cumsum([0] + [view.length for view in views])

    # --- the AttributeValues ability -------------------------------------------------

    @property
    def attribute_names(self) -> tuple[str, ...]:
        return tuple(attribute.name for attribute in self.spec.attributes)

    def rows(self, records: Sequence[dict[str, Any]]) -> np.ndarray:
        """One float64 row per record (category index, or number)."""
        attributes = self.spec.attributes
        out = np.empty((len(records), len(attributes)), dtype=np.float64)
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"record {i} must be an object of attribute values")
            unknown = sorted(set(record) - set(self.attribute_names))
            if unknown:
                raise ValueError(f"record {i}: unknown attribute {unknown[0]!r}")
            for j, attribute in enumerate(attributes):
                where = f"record {i}, attribute {attribute.name!r}"
                if attribute.name not in record:
                    raise ValueError(f"{where}: missing")
                value = record[attribute.name]
                if isinstance(value, bool):
                    raise ValueError(f"{where}: a boolean is not a value")
                if attribute.domain_size is None:
                    if not isinstance(value, (int, float)) or not math.isfinite(value):
                        raise ValueError(f"{where}: needs a finite number, got {value!r}")
                    out[i, j] = float(value)
                elif isinstance(value, str):
                    if attribute.labels is None or value not in attribute.labels:
                        known = list(attribute.labels or ())[:10]
                        raise ValueError(f"{where}: unknown label {value!r} (labels: {known})")
                    out[i, j] = attribute.labels.index(value)
                elif isinstance(value, int) and 0 <= value < attribute.domain_size:
                    out[i, j] = value
                else:
                    raise ValueError(
                        f"{where}: needs a label or an index in 0..{attribute.domain_size - 1}, "
                        f"got {value!r}"
                    )
        return out

    def check_rows(self, values: Any) -> np.ndarray:
        """``values`` as a float64 (n, attributes) matrix with integer categories in range
        and no NaN; ValueError naming the row and attribute."""
        rows = np.asarray(values, dtype=np.float64)
        width = len(self.spec.attributes)
        if rows.size == 0:  # an empty batch, in whatever shape
            rows = rows.reshape(0, width)
        if rows.ndim != 2 or rows.shape[1] != width:
            raise ValueError(f"values must have shape (n, {width}), got {rows.shape}")
        for j, attribute in enumerate(self.spec.attributes):
            column = rows[:, j]
            if attribute.domain_size is None:
                bad = np.flatnonzero(np.isnan(column))
                problem = "is NaN"
            else:
                # NaN differs from its rounding; -inf is below 0 and inf beyond the domain
                bad = np.flatnonzero(
                    (column != np.round(column)) | (column < 0) | (column >= attribute.domain_size)
                )
                problem = f"is not a category index in 0..{attribute.domain_size - 1}"
            if bad.size:
                raise ValueError(
                    f"row {bad[0]}, attribute {attribute.name!r}: {column[bad[0]]!r} {problem}"
                )
        return rows

    # --- device side ------------------------------------------------------------------

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        source = as_source(rng)
        rows = self.check_rows(values)
        n = rows.shape[0]
        if self.name == "spl":
            out = np.empty((n, self.report_width), np.uint8)
            for v, view in enumerate(self.views):
                out[:, self.offsets[v] : self.offsets[v + 1]] = view.encode(
                    view.inputs(rows), source
                )
            return out
        chosen = source.integers(self.k, n) if n else np.zeros(0, np.int64)
        # the devices of each view, by position: one stable sort of the drawn views
        order = np.argsort(chosen.astype(np.uint8), kind="stable")
        edges = np.searchsorted(chosen[order], np.arange(self.k + 1)).tolist()
        members = [order[edges[v] : edges[v + 1]] for v in range(self.k)]
        if self.name == "smp":
            out = np.zeros((n, 1 + max(view.width for view in self.views)), np.uint8)
            out[:, 0] = chosen
            for view, picked in zip(self.views, members, strict=True):
                out[picked, 1 : 1 + view.width] = view.encode(view.inputs(rows)[picked], source)
            return out
        blocks = []
        for view, picked in zip(self.views, members, strict=True):
            block = view.fake(n, source) if n else np.zeros((0, view.width), np.uint8)
            block[picked] = view.encode(view.inputs(rows)[picked], source)
            blocks.append(block)
        return np.hstack(blocks)

    # --- refusal rules: the OUE views' ones counts ---------------------------------------

    @cached_property
    def _view_rules(self) -> tuple[tuple[int, OnesCountBounds, RefusalRule], ...]:
        """(view index, bounds, rule) of each OUE view with a ones-count rule (module
        docstring): sides within 2^-41 / (the OUE views) under ``spl`` and ``rsfd``, where
        every report carries all of them, 2^-41 under ``smp``, where it carries one."""
        unary = [v for v, view in enumerate(self.views) if view.oracle == "oue"]
        share = 1 if self.name == "smp" else max(1, len(unary))
        rules = []
        for v in unary:
            inner = cast(OptimizedUnaryEncoding, self.views[v].inner)
            true = binomial_sum_pmf(inner.ones_count_law())
            fake = binomial_sum_pmf(((inner.domain_size, inner.q),))
            bounds = OnesCountBounds.from_laws(true, fake if self.name == "rsfd" else true, share)
            if bounds.refuses:
                rule = RefusalRule(
                    f"{self.name}.view{v}.ones_count",
                    f"view {self.views[v].describe()}: {bounds.describe()}",
                    bounds.upper_tail + bounds.lower_tail,
                )
                rules.append((v, bounds, rule))
        return tuple(rules)

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """A ones-count rule per OUE view whose counts allow one (none for GRR and numeric
        views: every output is likely under some input, their modules say why)."""
        return tuple(rule for _, _, rule in self._view_rules)

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        """Per report, the first OUE view rule its view bytes break, else -1."""
        codes = np.full(len(reports), -1, dtype=np.int8)
        if not self._view_rules:
            return codes
        _, blocks = self._view_blocks(reports)
        for index in reversed(range(len(self._view_rules))):  # the first broken rule wins
            v, bounds, _ = self._view_rules[index]
            block, positions = blocks[v]
            codes[positions[bounds.breaks(count_ones(block))]] = index
        return codes

    def refusal_detail(self, report: np.ndarray) -> str:
        """The views whose counts of ones are refused (``"view (0): 60 of the 64 bits
        set"``)."""
        _, blocks = self._view_blocks(np.asarray(report)[np.newaxis])
        details = []
        for v, bounds, _ in self._view_rules:
            ones = count_ones(blocks[v][0])
            if ones.size and bounds.breaks(ones)[0]:
                view = self.views[v].describe()
                details.append(f"view {view}: {int(ones[0])} of the {bounds.bits} bits set")
        return "; ".join(details) or "no view's count of ones is refused"

    # --- server side ------------------------------------------------------------------

    @property
    def report_width(self) -> int:
        if self.name == "smp":
            return 1 + max(view.width for view in self.views)
        return int(self.offsets[-1])

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        array, blocks = self._view_blocks(reports)
        for view, (block, positions) in zip(self.views, blocks, strict=True):
            view.check(block, positions)
        return array

    def _view_blocks(self, reports: np.ndarray) -> tuple[np.ndarray, list[ViewBlock]]:
        """The reports as this mechanism's array, and each view's report bytes with their
        positions among the reports. ``spl``, ``rsfd``: every report's columns of the view.
        ``smp``: the reports of each view, contiguous after one stable sort by the view
        byte (a radix sort of uint8), its view index and zero padding checked first over
        the whole array; ValueError naming the first report at fault."""
        array = np.asarray(reports)
        if array.ndim != 2 or array.shape[1] != self.report_width or array.dtype != np.uint8:
            raise ValueError(
                f"{self.name} reports must be uint8 of shape (n, {self.report_width}), got "
                f"{array.dtype} {array.shape}"
            )
        positions = np.arange(array.shape[0])
        if self.name != "smp":
            return array, [
                (array[:, self.offsets[v] : self.offsets[v + 1]], positions) for v in range(self.k)
            ]
        chosen = array[:, 0]
        bad = np.flatnonzero(chosen >= self.k)
        if bad.size:
            raise ValueError(f"report {bad[0]}: view {chosen[bad[0]]} is outside 0..{self.k - 1}")
        order = np.argsort(chosen, kind="stable")
        edges = np.searchsorted(chosen[order], np.arange(self.k + 1)).tolist()
        ordered = array[order]
        blocks = []
        stray: list[int] = []  # reports of a narrower view with bytes set past it
        for v, view in enumerate(self.views):
            rows, positions = ordered[edges[v] : edges[v + 1]], order[edges[v] : edges[v + 1]]
            if 1 + view.width < self.report_width:
                stray += positions[rows[:, 1 + view.width :].any(axis=1)][:1].tolist()
            blocks.append((rows[:, 1 : 1 + view.width], positions))
        if stray:
            first = min(stray)
            raise ValueError(f"report {first}: bytes past view {chosen[first]}")
        return array, blocks

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(int(self.block_starts[-1]))

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Per view, its counts (after ``smp``'s k report counts); every report checked once.

        ``smp`` whose every view reports a 2-byte index (GRR, ``piecewise``) is counted in one
        ``np.bincount`` of (the view's first count + the index) over all reports, no sort;
        a batch with any report out of range takes the general path, which names it."""
        if self.name == "smp" and all(
            view.width == 2 and view.oracle != "oue" for view in self.views
        ):
            counted = self._index_counts(np.asarray(reports))
            if counted is not None:
                return counted
        array, blocks = self._view_blocks(reports)
        parts: list[np.ndarray] = []
        if self.name == "smp":
            parts.append(np.array([block.shape[0] for block, _ in blocks], dtype=np.int64))
        for view, (block, positions) in zip(self.views, blocks, strict=True):
            view.check(block, positions)
            parts.append(view.counts(block))
        return CountStatistics(array.shape[0], np.concatenate(parts))

    def _index_counts(self, array: np.ndarray) -> CountStatistics | None:
        """The statistics of ``smp`` reports whose views all report 2-byte indices, or None
        when the array is not such reports, all in range (``aggregate``)."""
        if array.ndim != 2 or array.shape[1] != 3 or array.dtype != np.uint8:
            return None
        chosen = array[:, 0]
        if chosen.size and int(chosen.max()) >= self.k:
            return None
        values = _u16_values(array[:, 1:])
        lengths = np.array([view.length for view in self.views])
        if np.any(values >= lengths[chosen]):
            return None
        starts = np.asarray(self.block_starts[:-1])
        counts = np.bincount(starts[chosen] + values, minlength=int(self.block_starts[-1]))
        counts[: self.k] = np.bincount(chosen, minlength=self.k)
        return CountStatistics(array.shape[0], counts.astype(np.int64))

    def simulate_statistics(self, rows: np.ndarray, rng: np.random.Generator) -> CountStatistics:
        """Exact law of encode + aggregate: per view the inner fast path (categorical,
        O(cells)) or the exact numeric draw; ``smp`` and ``rsfd`` first draw each device's
        view, ``rsfd`` adds the fakes of the others (``View.simulate_fake``)."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError("simulate_statistics needs a numpy.random.Generator (simulation only)")
        rows = self.check_rows(rows)
        n = rows.shape[0]
        parts: list[np.ndarray] = []
        if self.name == "spl":
            parts = [view.simulate(view.inputs(rows), rng) for view in self.views]
            return CountStatistics(n, np.concatenate(parts))
        chosen = rng.integers(self.k, size=n)
        if self.name == "smp":
            parts.append(np.bincount(chosen, minlength=self.k).astype(np.int64))
        for v, view in enumerate(self.views):
            picked = rows[chosen == v]
            counts = view.simulate(view.inputs(picked), rng)
            if self.name == "rsfd":
                counts = counts + view.simulate_fake(n - picked.shape[0], rng)
            parts.append(counts)
        return CountStatistics(n, np.concatenate(parts))

    # --- wire form --------------------------------------------------------------------

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        array = self.check_reports(reports)
        if self.name != "smp":
            return [{"report": base64.b64encode(row.tobytes()).decode("ascii")} for row in array]
        return [
            {
                "view": int(row[0]),
                "report": base64.b64encode(row[1 : 1 + self.views[row[0]].width].tobytes()).decode(
                    "ascii"
                ),
            }
            for row in array
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        out = np.zeros((len(payloads), self.report_width), np.uint8)
        for i, payload in enumerate(payloads):
            if not isinstance(payload, dict) or set(payload) != set(self.payload_fields):
                raise ValueError(
                    f"report {i}: payload must have exactly {sorted(self.payload_fields)}, "
                    f"got {payload!r}"[:300]
                )
            width = self.report_width
            start = 0
            if self.name == "smp":
                view = payload["view"]
                if isinstance(view, bool) or not isinstance(view, int) or not 0 <= view < self.k:
                    raise ValueError(f"report {i}: 'view' must be an integer in 0..{self.k - 1}")
                out[i, 0] = view
                width, start = self.views[view].width, 1
            encoded = payload["report"]
            if not isinstance(encoded, str):
                raise ValueError(f"report {i}: 'report' must be a base64 string")
            try:
                raw = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError) as error:
                raise ValueError(f"report {i}: 'report' is not valid base64 ({error})") from None
            if len(raw) != width:
                raise ValueError(f"report {i}: 'report' holds {len(raw)} bytes, expected {width}")
            out[i, start : start + width] = np.frombuffer(raw, np.uint8)
        return self.check_reports(out)

    # --- estimation -------------------------------------------------------------------

    def view_reports(self, stats: CountStatistics) -> np.ndarray:
        """Reports per view: the k counts of ``smp``, else n for every view."""
        if self.name == "smp":
            return stats.counts[: self.k].astype(np.int64)
        return np.full(self.k, stats.n, np.int64)

    def oracle_probabilities(self, view: View) -> tuple[float, float]:
        """(p', q') of the view's counts (module docstring: the rsfd mixtures)."""
        inner = cast(CategoricalMechanism, view.inner)
        p, q = inner.p, inner.q
        if self.name != "rsfd":
            return p, q
        k = self.k
        if view.oracle == "grr":
            fake = (k - 1) / (k * view.plan.cells)
            return p / k + fake, q / k + fake
        return (p + (k - 1) * q) / k, q

    def view_covariance(self, view: View, g: np.ndarray, m: float, n: float) -> ViewCovariance:
        """Cov of a categorical view's unbiased f at distribution g over m of n devices."""
        p, q = self.oracle_probabilities(view)
        cov = frequency_covariance(p, q, g, m, view.oracle == "grr")
        if self.name == "smp":
            diagonal, weight = sampling_covariance(g, m, n)
            cov = cov.plus(diagonal, g, weight)
        return cov

    def dependence(self, n: int) -> ViewDependence:
        """The covariance between two views' estimates (``shared.marginals``)."""
        if self.name == "smp":
            return ViewDependence(-1.0 / (n - 1) if n > 1 else 0.0, raw=False)
        if self.name == "rsfd":
            return ViewDependence(-1.0 / n, raw=True)
        return INDEPENDENT

    def estimate(self, stats: CountStatistics) -> AttributesEstimate:
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        if stats.length != self.block_starts[-1]:
            raise ValueError(
                f"statistics have {stats.length} counts, expected {self.block_starts[-1]}"
            )
        n = stats.n
        reports = self.view_reports(stats)
        counts = stats.counts
        attributes: dict[int, CategoricalAttribute | NumericAttribute] = {}
        pair_views: list[PairView] = []
        for v, view in enumerate(self.views):
            block = counts[self.block_starts[v] : self.block_starts[v + 1]].astype(np.float64)
            m = int(reports[v])
            column = view.plan.columns[0]
            if view.plan.is_numeric:
                attributes[column] = self.numeric_attribute(view, block, m, n)
                continue
            p, q = self.oracle_probabilities(view)
            with np.errstate(invalid="ignore", divide="ignore"):
                f = (block / m - q) / (p - q)
            g = norm_sub(f) if m else np.full(f.size, np.nan)
            cov = self.view_covariance(view, g, max(m, 1), n)
            planning = self.view_covariance(view, np.zeros(f.size), 1.0, 1.0)
            if len(view.plan.columns) == 2:
                shape = cast(tuple[int, int], view.plan.shape)
                pair_views.append(
                    PairView(view.plan.columns, f.reshape(shape), cov, planning, g.reshape(shape))
                )
                continue
            variance = row_variances(cov, (f.size, 1), 1.0, 0.0, 0.0)[:, 0]
            attributes[column] = self.categorical(column, normalize(f), variance, m, "direct")
        consistent = make_consistent(pair_views, self.dependence(n)) if pair_views else None
        marginals = []
        if consistent is not None:
            for column, (frequencies, variance) in consistent.one_way.items():
                m = int(
                    sum(
                        reports[v]
                        for v, view in enumerate(self.views)
                        if column in view.plan.columns
                    )
                )
                attributes[column] = self.categorical(
                    column, frequencies, variance, m if self.name == "smp" else n, "consistent"
                )
            for v, (pair, result) in enumerate(zip(pair_views, consistent.pairs, strict=True)):
                marginals.append(
                    self.marginal(
                        pair,
                        result,
                        consistent,
                        int(reports[v]) if self.name == "smp" else n,
                        attributes,
                    )
                )
        return AttributesEstimate(
            protocol=self.name,
            n=n,
            attributes=tuple(attributes[c] for c in range(len(self.spec.attributes))),
            marginals=tuple(marginals),
        )

    def categorical(
        self, column: int, frequencies: np.ndarray, variance: np.ndarray, n: int, method: str
    ) -> CategoricalAttribute:
        attribute = self.spec.attributes[column]
        return CategoricalAttribute(
            name=attribute.name,
            labels=attribute.labels,
            n=n,
            frequencies=frequencies,
            std=np.sqrt(np.maximum(variance, 0.0)),
            postprocessed=norm_sub(frequencies)
            if np.all(np.isfinite(frequencies))
            else frequencies,
            method="direct" if method == "direct" else "consistent",
        )

    def marginal(
        self,
        pair: PairView,
        result: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        consistent: Any,
        n: int,
        attributes: dict[int, CategoricalAttribute | NumericAttribute],
    ) -> PairMarginal:
        cells, variance, with_first, with_second = result
        first, second = pair.columns
        rows_f, rows_var = consistent.one_way[first]
        cols_f, cols_var = consistent.one_way[second]
        given_first, given_first_std = conditional_shares(
            cells, variance, rows_f, rows_var, with_first, 0
        )
        given_second, given_second_std = conditional_shares(
            cells, variance, cols_f, cols_var, with_second, 1
        )
        first_pp = cast(CategoricalAttribute, attributes[first]).postprocessed
        second_pp = cast(CategoricalAttribute, attributes[second]).postprocessed
        joint = norm_sub(cells).reshape(cells.shape) if np.all(np.isfinite(cells)) else cells
        postprocessed = (
            fit_margins(joint, first_pp, second_pp) if np.all(np.isfinite(cells)) else cells
        )
        return PairMarginal(
            attributes=(self.spec.attributes[first].name, self.spec.attributes[second].name),
            n=n,
            frequencies=cells,
            std=np.sqrt(np.maximum(variance, 0.0)),
            postprocessed=postprocessed,
            given_first=given_first,
            given_first_std=given_first_std,
            given_second=given_second,
            given_second_std=given_second_std,
        )

    def numeric_attribute(self, view: View, block: np.ndarray, m: int, n: int) -> NumericAttribute:
        """The unbiased mean from the output histogram (module docstring)."""
        inner = cast(NumericMechanism, view.inner)
        values = view.output_values()
        if self.name == "rsfd":
            values = self.k * values - (self.k - 1) * inner.centre
        attribute = self.spec.attributes[view.plan.columns[0]]
        if m == 0:
            return NumericAttribute(
                attribute.name, inner.lower, inner.upper, 0, math.nan, math.nan, math.nan
            )
        total, squares = float(block @ values), float(block @ values**2)
        mean = total / m
        spread = max(squares - m * mean * mean, 0.0)
        if self.name == "rsfd":
            sample = spread / (m - 1) if m > 1 else self.k**2 * float(inner.variance(1))
            variance = sample / m
        else:
            estimate = inner.estimate(MomentStatistics(m, total, squares))
            rho = (n - m) / (n - 1) if n > 1 else 0.0
            variance = (1 - rho) * estimate.std**2 + rho * estimate.population_std**2
        return NumericAttribute(
            name=attribute.name,
            lower=inner.lower,
            upper=inner.upper,
            n=m,
            mean=mean,
            std=math.sqrt(variance),
            postprocessed_mean=min(max(mean, inner.lower), inner.upper),
        )

    # --- planning ---------------------------------------------------------------------

    def variance(self, n: int) -> float:
        """Planning variance: the mean over attributes of a zero-frequency cell's variance
        (categorical: the mean over its cells, after consistency) or of the mean of a
        numeric attribute rescaled to [0, 1] (its worst case), from n reports (``smp``:
        n / k per view, no sampling term at zero frequency)."""
        m = n / self.k if self.name == "smp" else float(n)
        per_attribute: dict[int, float] = {}
        pairs = []
        for view in self.views:
            column = view.plan.columns[0]
            if view.plan.is_numeric:
                inner = cast(NumericMechanism, view.inner)
                worst = inner.variance(1)
                if self.name == "rsfd":
                    worst = self.k**2 * (worst + (self.k - 1) / self.k**2 * inner.half_range**2)
                per_attribute[column] = worst / m / (inner.upper - inner.lower) ** 2
                continue
            p, q = self.oracle_probabilities(view)
            cov = frequency_covariance(p, q, np.zeros(view.plan.cells), m, view.oracle == "grr")
            if len(view.plan.columns) == 2:
                f = np.full(view.plan.shape, 1.0 / view.plan.cells)
                pairs.append(PairView(view.plan.columns, f, cov, cov, f))
            else:
                shape = (view.plan.cells, 1)
                per_attribute[column] = float(row_variances(cov, shape, 1.0, 0.0, 0.0).mean())
        if pairs:
            for column, (_, variance) in make_consistent(pairs).one_way.items():
                per_attribute[column] = float(variance.mean())
        return float(np.mean(list(per_attribute.values())))


@register
class SplitMechanism(MultiAttributeMechanism):
    name = "spl"
    spec_model = SplSpec


@register
class SampleMechanism(MultiAttributeMechanism):
    name = "smp"
    spec_model = SmpSpec
    payload_schema = payload_shape(
        "SampledAttributePayload",
        "smp: the sampled view's index and base64 of that view's bytes (as for spl).",
        view=INTEGER,
        report=BASE64,
    )


@register
class RsfdMechanism(MultiAttributeMechanism):
    name = "rsfd"
    spec_model = RsfdSpec


def resolve_protocol(mechanism_json: dict[str, Any]) -> dict[str, Any]:
    """A multi-attribute spec with ``"mechanism": "auto"`` resolved to the protocol of least
    planning variance (``MultiAttributeMechanism.variance``, summed equivalently as the mean
    over attributes; ties keep the order spl, smp, rsfd); any other spec is returned as is.
    ValueError when no protocol accepts the spec (the last refusal's message)."""
    if mechanism_json.get("mechanism") != "auto":
        return dict(mechanism_json)
    best: tuple[float, str] | None = None
    error: Exception | None = None
    for protocol in PROTOCOLS:
        try:
            spec = MechanismSpec.model_validate(mechanism_json | {"mechanism": protocol})
        except ValueError as refusal:
            error = refusal
            continue
        cost = make_mechanism(spec).variance(1)
        if best is None or cost < best[0]:
            best = (cost, protocol)
    if best is None:
        raise ValueError(f"no multi-attribute protocol accepts this spec: {error}")
    return dict(mechanism_json) | {"mechanism": best[1]}
