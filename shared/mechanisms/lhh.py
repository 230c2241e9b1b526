"""Longitudinal hierarchical histogram (``lhh``): ``hh`` for values reported again and again.

``hh`` (``shared.mechanisms.hh``: Cormode, Kulkarni, Srivastava, VLDB 2019; Hay et al.,
VLDB 2010) reports a value's node at a uniformly drawn level of a B-ary tree over
D = B^h buckets through that level's frequency oracle. Reported every period, it would
leak: each report is fresh, so a device's reports of one value compose (their average
converges to the value), and reports at different levels reveal different nodes. ``lhh``
memoizes both random choices (``shared.mechanisms.memoized``):

1. the device's *level* l is permanent: drawn once per (device, spec) from its memo,
   exactly uniform on 1..h and independent of the value, so it reveals nothing;
2. at that level the node v = leaf // B^(h-l) is reported through a *memoized*
   categorical oracle over B^l nodes, ``lgrr`` or ``losue`` (``shared.mechanisms.lgrr``,
   ``shared.mechanisms.lue``): a permanent response at ``epsilon`` memoized per
   (device, spec, node), then a fresh instantaneous response per report, so that one
   report is ``epsilon_report``-LDP. Values in the same node share the permanent
   response.

Privacy. One report is (l, y) with P[(l, y) | x] = (1/h) P_l[y | v_l(x)], P_l the level
oracle's one-report law: the 1/h cancels from every likelihood ratio, which is at most
the level oracle's, e^epsilon_report (``transition_matrix``; tight, the leaf level
separates every pair of buckets). Any number of reports of values in one node v of the
device's level are post-processing of (l, the permanent response of v), whose law
(1/h) P1_l[z | v] is ``epsilon``-LDP (``permanent_matrix``). Values in k distinct nodes
at the device's level compose to at most k ``epsilon``: the memo key of a value is its
node there (``memo_keys``), which the device ledger charges ``epsilon`` once for life
and ``epsilon_report`` per report to the period (``client.ledger.PrivacyLedger.
debit_memoized``). A device's key for a value depends on its permanent level, so one
device's keys are coarse (level 1: B keys cover every value) or fine (level h: one key
per bucket): what a value's changes cost differs by device, never what one report or
one key reveals.

Level oracles. At each level, the one with the least one-report variance ``variance(1)``
(frequency-oracle variance at f = 0) at (epsilon, epsilon_report, B^l), ``lgrr`` on a
tie (a report of one integer). ``lgrr``'s report is GRR at epsilon_report,
(e^r + d - 2) / (e^r - 1)^2 with r = epsilon_report and d = B^l; ``losue``'s is OUE at
epsilon_report, 4 e^r / (e^r - 1)^2, the least of every unary encoding (Wang et al.,
USENIX Security 2017), so ``lsue`` (SUE at r: e^(r/2) / (e^(r/2) - 1)^2, at least OUE's)
and ``loue`` (larger than ``losue``'s for every pair, and infeasible beyond
r = ln((2 e^epsilon + 1) / 3)) never win and are not candidates: ``lgrr`` below
d = 3 e^r + 2, ``losue`` above. The registry has no memoized hashing oracle (a
longitudinal OLH would memoize a hash and its bucket per node), so the deep levels are
unary: a report is B^l bits there, at most D = 4096 bits (512 bytes, 684 base64
characters) at ``MAX_BUCKETS``. Not capped: OUE reports of that size are already in use
(``oue`` and ``losue`` allow d up to 2^20), and a cap would have to fall back to
``lgrr``, whose variance at d = 4096 and r = 1 is 377 times OUE's ((e^r + d - 2) / (4 e^r)).

Memo draws (what a client in another language reproduces; ``shared.memo``, the spec's
scope): the level reads purpose ``b"lhh level"``, key 0: l = 1 + the first of
w0 & m, w1 & m, ... below h, m = 2^ceil(log2 h) - 1 (``MemoDraws.integers``). The level
oracle's permanent response reads its own purpose (``b"lgrr prr"`` or ``b"losue prr"``)
keyed by the node index v at level l, as in its module; a device only ever uses one level,
so levels never share a stream. ``context.memo = None`` draws the level and the
permanent response fresh from ``rng`` for every value: one report's law, what one-period
simulations need.

Memo key (``memo_keys``, int64): the node's index in the breadth-first order of levels
1..h, k = (B + B^2 + ... + B^(l-1)) + v = ``offsets[l - 1]`` + v, which is also the
position of the node's count in the statistics; distinct nodes (of any level) have
distinct keys. ``ledger_keys``: ``memo_key_bytes`` of it (8 bytes, big-endian).

Report: a record (level, value, bits): an ``lgrr`` level reports its index in ``value``
(``bits`` all zero); a ``losue`` level its B^l bits packed (``np.packbits`` layout) in the
first ceil(B^l / 8) bytes of ``bits`` (``value`` = 0, the rest 0). ``bits`` has the width
of the widest unary level (0 if none). Payload ``{"level": int, "value": int, "bits":
base64}``, with ``bits`` exactly ceil(B^l / 8) bytes of the level's (empty at an ``lgrr``
level).

Refusal rules (``shared.integrity``): a report at a ``losue`` level is refused by that
level's oracle's ones-count rule (``shared.mechanisms.lue``: beyond the counts of ones no
honest device state reaches but with probability 2^-41 a side), named
``"lhh.level<l>.ones_count"``; ``lgrr`` levels have none (``shared.mechanisms.lgrr``). Each
rule's ``false_refusal`` is its oracle's: a report is tested only at its own level.

Statistics and estimate: ``hh``'s, unchanged: level 1's oracle statistics, ..., level
h's, then n_1..n_h; each level's estimate is its oracle's (unbiased at the one-report
law), then ``hh``'s consistency (``ConsistentTree``) and exact range variances
(``TreeRangeVariance``): the tree math does not depend on the oracles beyond their p and
q and whether a level's node estimates covary (one index per report, ``lgrr``: GRR's
multinomial law, exact since its one report is a keep/uniform GRR) or not (``losue``: its
bits are independent given the value, so hh's per-node branch is exact for it).

What a per-period estimate means. Devices are independent, each device's level is
uniform and independent of its value and of other devices, and its report given (level,
value) follows the one-report law, whatever it reported before: the reports of one
period are independent draws of the one-report law, so that period's estimate is
unbiased for that period's distribution with ``hh``'s variance at epsilon_report
(``simulate_statistics`` draws it). Estimates of different periods from the same
devices are correlated, through the permanent levels (the same n_l, the same devices at
each level) and the permanent responses: averaging periods does not average the
permanent noise away, which is the point.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal

import numpy as np

from shared.integrity import RefusalRule
from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import (
    BASE64,
    INTEGER,
    check_integer_field,
    decode_base64_field,
    payload_shape,
)
from shared.mechanisms.hh import HhSpec, HierarchicalHistogram
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.lue import LongitudinalOSUE, LongitudinalUnaryEncoding
from shared.mechanisms.memoized import ChainedReport, MemoizedMechanism
from shared.mechanisms.registry import register
from shared.memo import Memo, MemoStreams
from shared.randomness import Rng
from shared.statistics import CountStatistics

#: Memo purpose of the device's permanent level (key 0; module docstring).
LEVEL_PURPOSE = b"lhh level"

#: A level's memoized oracle: ``lgrr`` or ``losue``.
LevelOracle = LongitudinalGRR | LongitudinalOSUE
#: The candidates, in order of preference on a tie (smaller reports first).
CANDIDATES: tuple[type[LongitudinalGRR] | type[LongitudinalOSUE], ...] = (
    LongitudinalGRR,
    LongitudinalOSUE,
)


class LhhSpec(ChainedReport, HhSpec):
    """``{"mechanism": "lhh", "epsilon": 2.0, "epsilon_report": 1.0, "lower": 0, "upper":
    100}``: ``hh``'s fields and defaults (``branching`` 4, ``buckets`` the least power of
    it >= 256, ``scale`` linear), ``epsilon`` the lifetime bound per distinct node and
    ``epsilon_report`` (required, < epsilon) what one report reveals."""

    mechanism: Literal["lhh"]  # type: ignore[assignment]


def memoized_level_oracle(epsilon: float, epsilon_report: float, nodes: int) -> LevelOracle:
    """``lgrr`` or ``losue`` over ``nodes`` items at (epsilon, epsilon_report), whichever has
    the lower one-report variance ``variance(1)`` (``lgrr`` on a tie; module docstring)."""
    candidates = [
        cls(
            cls.spec_model.model_validate(
                {
                    "mechanism": cls.name,
                    "epsilon": epsilon,
                    "epsilon_report": epsilon_report,
                    "domain_size": nodes,
                }
            )  # type: ignore[arg-type]
        )
        for cls in CANDIDATES
    ]
    return min(candidates, key=lambda oracle: oracle.variance(1))  # the first on a tie


class RowsMemo(Memo):
    """Rows ``rows`` of ``memo``, as a memo of their own (row i is ``memo``'s row rows[i]):
    how one level's devices reach their oracle."""

    def __init__(self, memo: Memo, rows: np.ndarray) -> None:
        self._memo, self._rows = memo, rows
        self.size = rows.size

    def open(self, purpose: bytes, keys: np.ndarray) -> MemoStreams:
        full = np.zeros(self._memo.size, dtype=np.int64)
        full[self._rows] = keys
        return _RowsStreams(self._memo.open(purpose, full), self._rows)


class _RowsStreams(MemoStreams):
    def __init__(self, streams: MemoStreams, rows: np.ndarray) -> None:
        self._streams, self._rows = streams, rows

    def words(self, rows: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
        return self._streams.words(self._rows[rows], starts, count)


#: What a level's oracle answers for its nodes and its devices' memo (None: fresh).
Respond = Callable[[LevelOracle, np.ndarray, Memo | None], np.ndarray]


@register
class LongitudinalHierarchicalHistogram(MemoizedMechanism, HierarchicalHistogram):
    """``hh`` with a permanent level per device and memoized level oracles (module
    docstring). Statistics, estimate, simulation, law and planning are ``hh``'s."""

    name = "lhh"
    spec_model = LhhSpec  # type: ignore[assignment]  # pydantic's __init__: mechanism "lhh"
    payload_schema = payload_shape(
        "LongitudinalHierarchyPayload",
        "lhh: the device's tree level (1..h) and its oracle's report there: value the "
        "reported node at an lgrr level (else 0); bits the base64 of numpy.packbits bytes "
        "of the B^level bits at a losue level (else empty).",
        level=INTEGER,
        value=INTEGER,
        bits=BASE64,
    )
    spec: LhhSpec
    oracles: tuple[LevelOracle, ...]  # type: ignore[assignment]

    def __init__(self, spec: LhhSpec) -> None:
        super().__init__(spec)
        sizes = [self.branching**level for level in range(1, self.height + 1)]
        #: Bytes of level l's packed bits (index l - 1; 0 at an lgrr level).
        self.level_bytes: np.ndarray = np.array(
            [(size + 7) // 8 if self.is_unary(level) else 0 for level, size in enumerate(sizes, 1)]
        )
        self.report_dtype = np.dtype(
            [("level", "<i8"), ("value", "<i8"), ("bits", "u1", (int(self.level_bytes.max()),))]
        )

    def build_oracle(self, nodes: int) -> LevelOracle:
        """``memoized_level_oracle`` at (epsilon, epsilon_report)."""
        return memoized_level_oracle(self.epsilon, self.epsilon_report, nodes)

    def oracle(self, level: int) -> LevelOracle:
        """Level ``level``'s (1..h) memoized oracle."""
        return self.oracles[level - 1]

    def is_unary(self, level: int) -> bool:
        """Whether level ``level`` reports bits (``losue``) rather than an index (``lgrr``)."""
        return isinstance(self.oracle(level), LongitudinalUnaryEncoding)

    # --- device ------------------------------------------------------------------------

    def device_levels(self, memo: Memo) -> np.ndarray:
        """Each row's permanent level, exactly uniform on 1..h (purpose ``b"lhh level"``,
        key 0)."""
        return 1 + memo.draws(LEVEL_PURPOSE).integers(self.height)

    def nodes(self, leaves: np.ndarray, levels: np.ndarray | int) -> np.ndarray:
        """The node index leaf // B^(h - l) of each leaf at its level."""
        return leaves // self.branching ** (self.height - levels)

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """One report per value: its device's level (``context.memo`` row i = value i's
        device), the value's node there, through the level's oracle with the same memo
        (permanent response keyed by the node, then a fresh instantaneous one from
        ``rng``); no memo: level and permanent response fresh from ``rng``."""
        return self._per_level(
            values,
            rng,
            context.memo,
            lambda oracle, nodes, memo: oracle.encode(nodes, rng, DeviceContext(memo=memo)),
        )

    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The permanent responses (level, the level oracle's permanent response of the
        node), as reports (``check_reports``'s record)."""
        return self._per_level(
            values,
            None,
            memo,
            lambda oracle, nodes, devices: oracle.permanent(nodes, devices),
        )

    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """offsets[l - 1] + v: the node v of each value at its device's level l, in
        breadth-first order (module docstring)."""
        leaves = self.spec.bucket_of(values)
        levels = self.device_levels(self.memo_for(leaves, None, memo))
        return np.asarray(self.offsets, dtype=np.int64)[levels - 1] + self.nodes(leaves, levels)

    def _per_level(self, values: Any, rng: Rng, memo: Memo | None, respond: Respond) -> np.ndarray:
        """Reports of ``respond(oracle, nodes, memo of their devices)`` per level (the
        devices' memo rows; None when ``memo`` is None, so the oracle draws fresh)."""
        leaves = self.spec.bucket_of(values)
        devices = self.memo_for(leaves, rng, memo)
        levels = self.device_levels(devices)
        reports = np.zeros(leaves.size, dtype=self.report_dtype)
        reports["level"] = levels
        for level in range(1, self.height + 1):
            rows = np.flatnonzero(levels == level)
            if not rows.size:
                continue
            nodes = self.nodes(leaves[rows], level)
            response = respond(
                self.oracle(level), nodes, RowsMemo(devices, rows) if memo is not None else None
            )
            if self.is_unary(level):
                reports["bits"][rows, : response.shape[1]] = response
            else:
                reports["value"][rows] = response
        return reports

    # --- refusal rules: the level oracles' ---------------------------------------------

    @cached_property
    def _level_rules(self) -> tuple[tuple[int, int, RefusalRule], ...]:
        """(level, the rule's index in its oracle's rules, the rule renamed for ``lhh``)."""
        return tuple(
            (
                level,
                index,
                RefusalRule(
                    f"{self.name}.level{level}.{rule.name.split('.', 1)[1]}",
                    f"at level {level}: {rule.description}",
                    rule.false_refusal,
                ),
            )
            for level in range(1, self.height + 1)
            for index, rule in enumerate(self.oracle(level).refusal_rules())
        )

    def refusal_rules(self) -> tuple[RefusalRule, ...]:
        """Each level oracle's rules, level by level (a ``losue`` level's ones count)."""
        return tuple(rule for _, _, rule in self._level_rules)

    def refusals(self, reports: np.ndarray) -> np.ndarray:
        """Each report tested by its own level's oracle (``refusal_rules`` indices)."""
        codes = np.full(len(reports), -1, dtype=np.int8)
        first = 0
        for level in sorted({level for level, _, _ in self._level_rules}):
            rows = np.flatnonzero(reports["level"] == level)
            inner = self.oracle(level).refusals(self._oracle_reports(reports[rows], level))
            codes[rows] = np.where(inner >= 0, first + inner, -1)
            first += len(self.oracle(level).refusal_rules())
        return codes

    def refusal_detail(self, report: np.ndarray) -> str:
        """The level and what its oracle says of the report (``"level 3: 60 of the 64 bits
        set"``)."""
        level = int(report["level"])
        inner = self._oracle_reports(np.asarray(report)[np.newaxis], level)[0]
        return f"level {level}: {self.oracle(level).refusal_detail(inner)}"

    # --- reports and statistics --------------------------------------------------------

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        """Records (level, value, bits) of ``report_dtype``: level in 1..h; at an lgrr level
        value in 0..B^l - 1 and no bit set; at a losue level value 0 and no bit set past
        bit B^l - 1 (what the level's oracle accepts). The first bad report is named."""
        array = np.asarray(reports)
        if array.dtype != self.report_dtype or array.ndim != 1:
            raise ValueError(
                f"lhh reports must be a one-dimensional array of dtype {self.report_dtype}, "
                f"got {array.dtype} {array.shape}"
            )
        self._refuse_bad_records(array)
        return array

    def _refuse_bad_records(self, array: np.ndarray) -> None:
        """ValueError naming the first record of ``report_dtype`` outside its level's bounds."""
        if not array.size:
            return
        level, value, bits = array["level"], array["value"], array["bits"]
        known = (level >= 1) & (level <= self.height)
        at = np.clip(level, 1, self.height) - 1
        bad_value = known & ((value < 0) | (value > self._highest_value[at]))
        bad_bits = known & np.any(bits & ~self._allowed_bits[at], axis=1)
        bad = ~known | bad_value | bad_bits
        if not bad.any():
            return
        row = int(np.flatnonzero(bad)[0])
        if not known[row]:
            raise ValueError(f"report {row}: level = {level[row]} is outside 1..{self.height}")
        at_level = int(level[row])
        if bad_value[row]:
            problem = f"value = {value[row]} is outside 0..{self._highest_value[at[row]]}"
        elif self.is_unary(at_level):
            problem = f"sets bits past bit {self.branching**at_level - 1}"
        else:
            problem = "sets bits (an lgrr level reports none)"
        raise ValueError(
            f"report {row}: {problem} for level {at_level} "
            f"({self.oracle(at_level).name} over {self.branching**at_level} nodes)"
        )

    @cached_property
    def _highest_value(self) -> np.ndarray:
        """(h,) the largest ``value`` of a level's report: B^l - 1 (lgrr), 0 (losue)."""
        return np.array(
            [0 if self.is_unary(k) else self.branching**k - 1 for k in range(1, self.height + 1)]
        )

    @cached_property
    def _allowed_bits(self) -> np.ndarray:
        """(h, width) uint8: the bits a level's report may set (its B^l bits, packed)."""
        width = self.report_dtype["bits"].shape[0]
        allowed = np.zeros((self.height, width), dtype=np.uint8)
        for level in range(1, self.height + 1):
            if self.is_unary(level):
                packed = np.packbits(np.ones(self.branching**level, dtype=bool))
                allowed[level - 1, : packed.size] = packed
        return allowed

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Each level's reports through its oracle's ``aggregate``, concatenated, then the
        level report counts (``hh``'s statistics)."""
        reports = self.check_reports(reports)
        levels = reports["level"]
        parts = []
        for level in range(1, self.height + 1):
            rows = reports[levels == level]
            parts.append(self.oracle(level).aggregate(self._oracle_reports(rows, level)).counts)
        per_level = np.bincount(levels, minlength=self.height + 1)[1:]
        return CountStatistics(reports.size, np.concatenate([*parts, per_level]))

    def _oracle_reports(self, rows: np.ndarray, level: int) -> np.ndarray:
        """Level ``level``'s reports in its oracle's form: indices, or packed bit rows."""
        if self.is_unary(level):
            return np.ascontiguousarray(rows["bits"][:, : self.level_bytes[level - 1]])
        return np.asarray(rows["value"])

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        reports = self.check_reports(reports)
        sizes = self.level_bytes[reports["level"] - 1] if reports.size else []
        return [
            {
                "level": int(row["level"]),
                "value": int(row["value"]),
                "bits": base64.b64encode(row["bits"][:size].tobytes()).decode("ascii"),
            }
            for row, size in zip(reports, sizes, strict=True)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        """Records from ``{"level", "value", "bits"}`` payloads (``bits`` exactly the level's
        ceil(B^l / 8) bytes); the first bad payload is named."""
        for i, payload in enumerate(payloads):
            extra = set(payload) - self.payload_fields if isinstance(payload, dict) else set()
            if extra:
                raise ValueError(f"report {i}: unexpected payload keys {sorted(extra)}")
        reports = np.zeros(len(payloads), dtype=self.report_dtype)
        reports["level"] = check_integer_field(payloads, "level")
        reports["value"] = check_integer_field(payloads, "value")
        decoded, failure = len(payloads), None
        for i, (payload, level) in enumerate(zip(payloads, reports["level"].tolist(), strict=True)):
            if not 1 <= level <= self.height:
                continue  # refused below, in order
            size = int(self.level_bytes[level - 1])
            unit = f"{self.branching**level} bits of level {level}" if size else "an lgrr level"
            try:
                raw = decode_base64_field(payload, i, "bits", size, unit)
            except ValueError as error:
                decoded, failure = i, error
                break
            reports["bits"][i, :size] = np.frombuffer(raw, dtype=np.uint8)
        self._refuse_bad_records(reports[:decoded])  # a bad record before the bad bits
        if failure is not None:
            raise failure
        return reports

    # --- law ---------------------------------------------------------------------------

    def permanent_matrix(self) -> np.ndarray:
        """Exact P[permanent response | bucket]: rows the D buckets, columns every (level,
        permanent output), level 1's first: (1/h) times the row of the bucket's node in the
        level oracle's ``permanent_matrix``; its largest ratio is e^epsilon."""
        return self.level_law(lambda oracle: oracle.permanent_matrix(), np.arange(self.buckets))
