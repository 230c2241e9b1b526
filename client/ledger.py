"""The device's privacy ledger: epsilon is debited durably before any report exists.

Caps (``BudgetLimits``, set by the app; the server cannot raise them): per metric per
period, all metrics per period, a lifetime total, the largest epsilon one report may
carry, and the largest lifetime epsilon one memoized value may cost. Every one is finite
by default; an app raises them on purpose (``math.inf`` removes one). A spec above the
last two is refused before anything is spent.

What a report costs. A mechanism without memory is pure epsilon-LDP per report, and
reports compose by addition (basic composition): each report adds its epsilon to the
period's counters and to the lifetime total (``debit``).

A memoized mechanism (``shared.mechanisms.memoized``: ``lgrr``, ``lsue``, ``loue``,
``losue``, ``dbitflip``, ``onebitmean``; and ``rappor``) answers a value from a
*permanent* response, drawn once per (device, spec, memo key) from the device secret
and the same for every later report of that key, with a fresh instantaneous
response on top for some of them. It is described by two numbers, ``MemoizedCost``:
``per_value``, what any number of reports of one memo key reveal (the spec's
``epsilon``; RAPPOR: epsilon_infinity = 2 h ln((1 - f/2) / (f/2))), and ``per_report``,
what one report reveals (``epsilon_report``; RAPPOR: epsilon_one). Its reports are
correlated through the permanent response, so per-report epsilons do not add up to a
bound on them: n reports of n values can reveal more than n ``per_report`` (with the
demo RAPPOR spec, two reports already do), and so can two reports of *one* value
(``lgrr`` with d = 16, epsilon 2 and epsilon_report 0.5: 1.15, more than 2 x 0.5; exact
figures in ``tests/client/test_memoized_reporting.py``). ``debit_memoized`` therefore
charges, for a report of memo key x (the memo key, not the raw value: ``memo_keys``):

* the lifetime total, and the metric's lifetime figure: ``per_value`` on the first report
  of x ever, nothing on any later one. A device that reports one unchanging value daily
  for a year spends ``per_value`` for life; one that reports k distinct values, k times it;
* the period's counters (this metric and all metrics): ``per_report`` on the first report
  of x in the period; the second report of x in the same period tops x's charge for the
  period up to max(``per_value``, ``per_report``); later reports of x that period cost
  nothing more. One report reveals exactly ``per_report``; any number of reports of x
  reveal at most ``per_value`` (they are post-processing of one permanent response), so
  every period's charge bounds what its reports of x reveal, and a daily report costs its
  period exactly ``per_report``. Reports of distinct keys compose: the period pays for
  each key.

Memo keys are recognised by a keyed hash, HMAC-SHA256(device secret, label || spec hash
|| memo key as 8 bytes big-endian; RAPPOR: the string's UTF-8), never by the value: the
hashes of the keys charged for life, and of those reported this period, are part of the
ledger (same checksum, same fsync and rename), and without the device secret a hash says
nothing about the value.

Bound to the exact spec. The spec hash is ``shared.spec_hash.spec_hash``, SHA-256 of the
canonical JSON of the metric's name, version, mechanism spec and labels; the device's
memo (``shared.memo.spec_scope``) and RAPPOR secret derive from it too. So two different
specs never share permanent randomness, and each is charged for its own values: what
they reveal together is at most the sum of their charges. Before a metric version is
first used the ledger pins its spec hash (``pin``, durably, with the mechanism's fields
to say later what changed); a later different spec under the same name and version is
refused with ``client.specs.SpecChangedError`` before anything is debited or queued.
An honest aggregator whose database was recreated, so that its versions restart at 1,
is refused the same way: a spec changes only with a new version (or a new metric
name), never under one a device has used.

The guarantee, and its limit. Take two sequences of n values x and x' with the same
equality pattern of memo keys (key(x_i) = key(x_j) exactly when key(x'_i) = key(x'_j)).
The n reports are a post-processing of one independent permanent response per distinct
key (the instantaneous responses are fresh and independent; what a device draws once for
all values, dbitflip's buckets and onebitmean's rounding offset, does not depend on any
value), so the joint privacy loss
of x against x' is at most ``per_value`` times the number of distinct keys that differ,
at most the lifetime charge. The equality pattern itself is not protected: reports of
one key are correlated and reports of different keys are not, so *that a value changed*
is visible to whoever links a device's reports (for RAPPOR's demo spec, (v, v) against
(u, w) loses 10.73, more than the two sequences' charges together;
``tests/adversarial/test_memoized_ledger.py``). An instantaneous response, or
``onebitmean``'s output perturbation (``flip_probability``), blurs the change without
removing it; ``dbitflip`` and ``onebitmean`` without it report the permanent bits
themselves, so a change can show in a single pair of reports. Values that share a memo key
(``onebitmean``: one rounded grid point; RAPPOR: Bloom filters that coincide in the
cohort) share one permanent response: one value as far as this guarantee goes.

Durability. A durable debit holds an exclusive lock on ``ledger.lock``
(``fcntl.flock``, so a second process waits), reads the ledger, checks every cap,
writes the new state to a temporary file, fsyncs it, renames it over ``ledger.json``
and fsyncs the directory; only then may the caller perturb a value. A crash after the
debit loses that budget; none can spend it twice.

Reservations. One fsync per report would cost milliseconds, so a durable debit
reserves the epsilon of several reports of the metric at once (1, 2, 4, ... up to
``MAX_RESERVED_REPORTS``, never beyond a cap), and the following reports of that metric
draw on the reservation in memory. The reservation is spent as far as the file is
concerned, so every report's epsilon was on disk before the report existed; ``close``
gives the unused part back; a crash loses it (budget lost, never double spent). A
reservation belongs to its period and is dropped when the period ends. Memoized reports
reserve nothing: the first and second report of a key in a period are each their own
durable debit (at most two fsyncs per key and period), and the later ones cost nothing.

Time. Periods are counted from the ledger's creation in whole ``period_seconds``; the
ledger keeps the latest time it has seen and never uses an earlier one, so setting the
clock back cannot reopen a spent period.

Failing closed. The ledger carries a SHA-256 checksum of its content; a ledger that
does not parse or does not match is ``LedgerCorruptError`` and nothing is reported.
The checksum is not keyed: it detects accidental damage (a torn or truncated file, a
flipped bit), not an edit, since whoever can write the file can recompute it (keying it
with the device secret, which lives in the same file, would change nothing). The device
owner editing their own ledger is outside the threat model: the ledger protects the
owner from the server, not the server from the owner. ``ledger.expected`` marks a state
directory that has had a ledger: if the ledger is then missing, that is an error too,
not a fresh budget. The device secret (RAPPOR's cohort and permanent response, every
memoized mechanism's memo) lives in the ledger: lose the secret and the memo is lost
with it. A device whose state is reset on purpose draws new permanent responses, and
what they reveal composes with what the old ones did, which the new ledger no longer
counts.

Rollback. Restoring an older ``ledger.json`` (from a backup, a sync, a copy) is an
ordinary event, and it must not hand back budget already spent. The ledger carries a
``generation`` that every write increments, and every write also replaces
``ledger.mark`` (the high-water mark: the generation, the clock, the period's spending,
the lifetime figures and the spec pins, with its own checksum; written to a temporary
file, fsynced and renamed under the same lock, with one directory fsync after both
renames). Every read compares the two: a ledger whose generation is not above the
mark's is lifted to it, each figure to the larger of the two (the clock, the period,
that period's spending per metric and in total, the lifetime total and per metric, the
pins), written back, and logged. Lifting rather than refusing keeps the device usable
and loses nothing: every figure is at least what the device had spent, so no cap can be
overspent, and what the restored copy lacks (the hashes of values charged, or reported
this period, since it was taken) only makes a value pay again, an over-count. A refusal
would leave a device with a restored backup two ways out, neither better: never to
report again, or a reset, which starts a new ledger from nothing. A mark that does not
parse is ``LedgerCorruptError`` (delete it to trust the ledger as it is); a mark of
another ledger (another creation time) is too. Not covered: a whole state directory
restored together (ledger and mark from the same moment are consistent, and the budget
spent since is forgotten: nothing on the device remembers it), a mark deleted (the
next write recreates it from the ledger), and anything the owner does on purpose.

Format. ``FORMAT`` 2 added the charged-key hashes, 3 the lifetime epsilon and the
number of memoized values charged per metric and the keys reported this period, 4 the
spec pins, the generation, and charged-key hashes keyed by the spec hash instead of the
metric's name and version. Older ledgers are read as having none of what they lack
(format 1: memoized reports charged per report; format 2: the per-metric lifetime
figures count from the upgrade; format 3: no pins yet, generation 0), and written back
as format 4 at the next write. The charged-key hashes of formats 2 and 3 were keyed by
name and version and can never match a format 4 hash, so they are dropped: the lifetime
totals keep what they charged, and a value reported again is charged again under its
spec. That is not only safe but exact: the memo was keyed by name and version too, so
the device now draws a new permanent response for it, which composes with the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.specs import SpecChangedError
from shared.caps import within_cap
from shared.schemas import MetricSpec
from shared.spec_hash import SPEC_HASH_BYTES, canonical_json

#: Most reports of one metric a single durable debit reserves for.
MAX_RESERVED_REPORTS = 1024
LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
MARKER_FILE = "ledger.expected"
#: The high-water mark a restored older ledger is lifted to (module docstring).
MARK_FILE = "ledger.mark"
FORMAT = 4
#: Formats this code reads (1: no charged-key hashes; 2: no per-metric lifetime figures;
#: 3: no pins or generation, charged keys by name and version).
READABLE_FORMATS = (1, 2, 3, 4)
#: Format of ``ledger.mark``.
MARK_FORMAT = 1
#: Domain separation of the charged-key hashes from every other use of the secret
#: (v1, formats 2 and 3: keyed by metric name and version; v2: by spec hash).
_VALUE_LABEL = b"ldp ledger value v2\x00"
#: Reports of one memo key in a period past which the period charge stays the same.
_SATURATED = 2


class LedgerError(Exception):
    """The ledger cannot be used; no report may be made."""


class LedgerCorruptError(LedgerError):
    """The ledger is unreadable, tampered with, or missing where one existed."""


class BudgetExhaustedError(LedgerError):
    """This report would exceed a cap; nothing was debited."""


logger = logging.getLogger("ldp.client")


@dataclass(frozen=True)
class BudgetLimits:
    """The device's caps on epsilon. ``math.inf`` means no cap of that kind; every default
    is finite, and an app raises a cap on purpose.

    ``lifetime`` (default 1000) bounds everything the device ever spends. The period caps
    bound the spending of a day (16 by default), but not its sum over the device's life,
    and a memoized value's first report pays its period only ``epsilon_report`` while it
    costs ``epsilon`` for life: a server that publishes new versions of a memoized
    metric, each one a new memo charged anew, could otherwise raise the lifetime figure
    without end. 1000 is a ceiling against that, not a meaningful privacy bound on its
    own: about two months at the default period caps' ceiling, years at the few epsilon
    a day a typical app spends. An app that reports daily for years raises it knowingly.

    ``max_value_lifetime_epsilon`` (default 4) bounds what one memoized value may cost for
    life (a memoized spec's ``epsilon``; RAPPOR: epsilon_infinity): a spec above it is
    refused before anything is spent, however small its ``epsilon_report``. 4 is the
    default per-report limit and the default per-metric cap of a period: any number of
    reports of one value reveal no more than one report at the device's limit may, and a
    value's second report in a period, which tops its period charge up to that epsilon,
    fits the default period cap. The demo RAPPOR spec (h = 1, f = 0.5: epsilon_infinity =
    2 ln 3 = 2.20) fits; RAPPOR's common h = 2, f = 0.5 (4 ln 3 = 4.39) needs it raised.
    """

    per_metric_per_period: float = 4.0
    total_per_period: float = 16.0
    lifetime: float = 1000.0
    period_seconds: float = 86_400.0
    #: Largest epsilon one report may carry: a spec above it is refused outright.
    max_epsilon_per_report: float = 4.0
    #: Largest lifetime epsilon one memoized value may cost: a spec above it is refused.
    max_value_lifetime_epsilon: float = 4.0

    def __post_init__(self) -> None:
        for name in (
            "per_metric_per_period",
            "total_per_period",
            "lifetime",
            "period_seconds",
            "max_epsilon_per_report",
            "max_value_lifetime_epsilon",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0) or math.isnan(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if math.isinf(self.period_seconds):
            raise ValueError("period_seconds must be finite")


@dataclass(frozen=True)
class MemoizedCost:
    """What a memoized mechanism's reports cost (see the module docstring).

    ``per_value``: the lifetime epsilon of one memo key, whatever the number of its
    reports (the spec's ``epsilon``; RAPPOR: epsilon_infinity); ``per_report``: the
    epsilon of one report (``epsilon_report``; RAPPOR: epsilon_one).
    """

    per_value: float
    per_report: float

    def __post_init__(self) -> None:
        for name in ("per_value", "per_report"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value!r}")

    def period_charge(self, reported: int) -> float:
        """The period charge of a key's report after ``reported`` reports of it this
        period: ``per_report``, then up to max(``per_value``, ``per_report``), then 0."""
        if reported == 0:
            return self.per_report
        if reported == 1:
            return max(0.0, self.per_value - self.per_report)
        return 0.0


@dataclass
class _Reservation:
    """Epsilon debited on disk (this period and for life) for ``metric``, not yet used."""

    period: int
    period_end: float
    remaining: float
    next_reports: int = 1


@dataclass(frozen=True)
class BudgetStatus:
    """What ``TelemetryClient.budget()`` reports: spent and left, this period and for life."""

    period: int
    period_start: float
    period_end: float
    spent_per_metric: dict[str, float]
    spent_this_period: float
    spent_lifetime: float
    left_this_period: float
    left_lifetime: float
    limits: BudgetLimits
    #: Lifetime epsilon per metric (all of ``spent_lifetime`` since format 3): for a
    #: memoized metric its ``epsilon`` times the number of distinct values it reported.
    lifetime_per_metric: dict[str, float]
    #: Distinct memoized values (memo keys) each memoized metric has been charged for.
    memoized_values_per_metric: dict[str, int]
    #: Epsilon this client has reserved on disk and not yet used (counted as spent).
    reserved: float = 0.0

    def left_for(self, metric: str) -> float:
        """Epsilon ``metric`` may still spend this period (all caps considered)."""
        return min(self.left_in_period(metric), self.left_lifetime)

    def left_in_period(self, metric: str) -> float:
        """Epsilon ``metric`` may still spend this period, by the period caps alone (what
        reports of a memoized value already charged, which cost no lifetime budget, may
        spend)."""
        own = self.limits.per_metric_per_period - self.spent_per_metric.get(metric, 0.0)
        return max(0.0, min(own, self.left_this_period))


class PrivacyLedger:
    """The epsilon a device has spent, kept in ``state_dir`` (see the module docstring)."""

    def __init__(
        self,
        state_dir: Path | str,
        limits: BudgetLimits,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(state_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self._clock = clock
        self._memory = threading.Lock()
        self._reservations: dict[str, _Reservation] = {}
        with self._locked():
            state = self._read(create=True)
        self.device_secret = bytes.fromhex(state["device_secret"])
        #: The spec hash (hex) pinned per (metric, version), as far as this object knows.
        self._pins: dict[tuple[str, int], str] = {
            (name, int(version)): pin["sha256"]
            for name, versions in state["pins"].items()
            for version, pin in versions.items()
        }
        self._created: float = state["created"]
        self._high_water: float = state["clock"]
        #: Memo keys whose period charge is complete in period ``_saturated_period``.
        self._saturated: set[str] = set()
        self._saturated_period: int = state["period"]

    # --- public --------------------------------------------------------------------

    def debit(self, metric: str, epsilon: float) -> None:
        """Spend ``epsilon`` on ``metric``, this period and for life (durably, see the
        module docstring), or raise ``BudgetExhaustedError`` and spend nothing."""
        self._check_report_epsilon(metric, epsilon)
        with self._memory:
            self._draw(metric, epsilon)

    def pin(self, spec: MetricSpec, spec_hash: bytes) -> None:
        """Pin ``spec_hash`` (``shared.spec_hash.spec_hash(spec)``) as the spec of
        ``spec.name`` version ``spec.version`` on its first use (durably), or raise
        ``SpecChangedError`` if another spec is pinned there, writing nothing. A spec
        changes only with a new version: the module docstring."""
        digest = _spec_hash_hex(spec_hash)
        key = (spec.name, spec.version)
        with self._memory:
            if self._pins.get(key) == digest:
                return
            with self._locked():
                state = self._read(create=False)
                versions = state["pins"].setdefault(spec.name, {})
                pinned = versions.get(str(spec.version))
                if pinned is None:
                    versions[str(spec.version)] = _pin_record(spec, digest)
                    self._write(state)
                elif pinned["sha256"] != digest:
                    raise SpecChangedError(_spec_changed(spec, pinned, versions))
            self._pins[key] = digest

    def debit_memoized(
        self, metric: str, spec_hash: bytes, value: bytes, cost: MemoizedCost
    ) -> None:
        """Spend what one report of memo key ``value`` by a memoized mechanism of the spec
        ``spec_hash`` costs (the module docstring): ``cost.per_value`` for life on the
        key's first report ever, and ``cost.period_charge`` this period. Or raise
        ``BudgetExhaustedError`` and spend nothing."""
        self._check_report_epsilon(metric, cost.per_report)
        self._check_value_epsilon(metric, cost.per_value)
        key = self.value_key(spec_hash, value)
        with self._memory:
            now = self._high_water = max(self._high_water, self._clock())
            period = int((now - self._created) // self.limits.period_seconds)
            if period == self._saturated_period and key in self._saturated:
                return
            self._charge_memoized(metric, key, cost)

    def value_key(self, spec_hash: bytes, value: bytes) -> str:
        """HMAC-SHA256(device secret, label || spec hash (32 bytes) || value), hex: how the
        ledger recognises a memo key of a spec it has charged without keeping the value."""
        _spec_hash_hex(spec_hash)
        message = _VALUE_LABEL + bytes(spec_hash) + value
        return hmac.new(self.device_secret, message, hashlib.sha256).hexdigest()

    def _check_report_epsilon(self, metric: str, epsilon: float) -> None:
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be positive and finite, got {epsilon!r}")
        if epsilon > self.limits.max_epsilon_per_report:
            raise BudgetExhaustedError(
                f"{metric}: one report at epsilon {epsilon:g} exceeds this device's limit of "
                f"{self.limits.max_epsilon_per_report:g} per report"
            )

    def _check_value_epsilon(self, metric: str, epsilon: float) -> None:
        if epsilon > self.limits.max_value_lifetime_epsilon:
            raise BudgetExhaustedError(
                f"{metric}: one memoized value at lifetime epsilon {epsilon:g} exceeds this "
                f"device's limit of {self.limits.max_value_lifetime_epsilon:g} per value"
            )

    def _draw(self, metric: str, epsilon: float) -> None:
        """Take ``epsilon`` from the metric's reservation, or reserve anew (holding
        ``_memory``)."""
        now = self._high_water = max(self._high_water, self._clock())
        reservation = self._reservations.get(metric)
        if (
            reservation is not None
            and now < reservation.period_end
            and within_cap(epsilon, reservation.remaining)
        ):
            reservation.remaining = max(0.0, reservation.remaining - epsilon)
            return
        self._refill(metric, epsilon, reservation)

    def _refill(self, metric: str, epsilon: float, previous: _Reservation | None) -> None:
        """Give back what is left of ``previous`` and reserve for the next reports durably."""
        with self._locked():
            state = self._advance(self._read(create=False))
            self._give_back(state, metric)
            status = self._status(state)
            refusal = self._refusal(status, metric, epsilon, epsilon)
            if refusal is not None:
                self._write(state)
                raise BudgetExhaustedError(refusal)
            reports = (
                1 if previous is None else min(2 * previous.next_reports, MAX_RESERVED_REPORTS)
            )
            amount = min(epsilon * reports, status.left_for(metric))
            _credit(state, metric, -amount, lifetime=True)
            self._write(state)
            self._seen(state)
            self._reservations[metric] = _Reservation(
                state["period"], status.period_end, amount - epsilon, reports
            )

    def _charge_memoized(self, metric: str, key: str, cost: MemoizedCost) -> None:
        """Charge one report of memo key ``key`` durably, by what the ledger on disk says
        about the key (holding ``_memory``)."""
        with self._locked():
            state = self._advance(self._read(create=False))
            self._seen(state)
            reported = state["reported_this_period"].get(key, 0)
            period_charge = cost.period_charge(reported)
            new = key not in state["charged_values"]
            lifetime_charge = cost.per_value if new else 0.0
            if period_charge > 0 or new:
                self._give_back(state, metric)
                refusal = self._refusal(self._status(state), metric, period_charge, lifetime_charge)
                if refusal is not None:
                    self._write(state)
                    raise BudgetExhaustedError(f"{refusal} ({_report_kind(reported, new)})")
                _credit(state, metric, -period_charge, lifetime=False)
                if new:
                    state["spent_lifetime"] += lifetime_charge
                    _add(state["lifetime_per_metric"], metric, lifetime_charge)
                    _add(state["memoized_values_per_metric"], metric, 1)
                    state["charged_values"].append(key)
                state["reported_this_period"][key] = min(reported + 1, _SATURATED)
                self._write(state)
            if cost.period_charge(min(reported + 1, _SATURATED)) == 0:
                self._saturated.add(key)

    def _give_back(self, state: dict[str, Any], metric: str) -> None:
        """Return the metric's unused reservation to ``state`` (if of its period)."""
        previous = self._reservations.pop(metric, None)
        if previous is not None and previous.period == state["period"]:
            _credit(state, metric, previous.remaining, lifetime=True)

    def release(self) -> None:
        """Give back every unused reservation (durably). ``close`` of the client calls it."""
        with self._memory:
            if not self._reservations:
                return
            with self._locked():
                state = self._advance(self._read(create=False))
                for metric, reservation in self._reservations.items():
                    if reservation.period == state["period"]:
                        _credit(state, metric, reservation.remaining, lifetime=True)
                self._write(state)
            self._reservations.clear()
            self._high_water = max(self._high_water, state["clock"])

    def status(self) -> BudgetStatus:
        """Spent and left: this period, per metric and for life (reservations not yet used
        by a report are counted as spent, and shown as ``reserved``)."""
        with self._memory, self._locked():
            state = self._advance(self._read(create=False))
            self._write(state)
            self._seen(state)
            reserved = sum(
                r.remaining for r in self._reservations.values() if r.period == state["period"]
            )
            return replace(self._status(state), reserved=reserved)

    def _seen(self, state: dict[str, Any]) -> None:
        """Remember the ledger's clock, and drop what belongs to periods that have ended
        (reservations, saturated memo keys)."""
        self._high_water = max(self._high_water, state["clock"])
        for metric in [m for m, r in self._reservations.items() if r.period != state["period"]]:
            del self._reservations[metric]
        if state["period"] != self._saturated_period:
            self._saturated.clear()
            self._saturated_period = state["period"]

    # --- state ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / LOCK_FILE, "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _read(self, create: bool) -> dict[str, Any]:
        path = self.directory / LEDGER_FILE
        marker = self.directory / MARKER_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            if marker.exists() or not create:
                raise LedgerCorruptError(
                    f"the privacy ledger {path} is missing but this device had one; "
                    "refusing to report (restore it, or reset the device's state on purpose)"
                ) from None
            now = self._clock()
            state: dict[str, Any] = {
                "format": FORMAT,
                "created": now,
                "clock": now,
                "period": 0,
                "spent_per_metric": {},
                "spent_this_period": 0.0,
                "spent_lifetime": 0.0,
                "device_secret": secrets.token_bytes(32).hex(),
                **_added_in_format_3(),
                **_added_in_format_4(),
                "charged_values": [],
            }
            self._write(state)
            _durable_touch(marker)
            return state
        state = _parse(raw, path)
        mark_path = self.directory / MARK_FILE
        try:
            mark = _parse_mark(mark_path.read_bytes(), mark_path)
        except FileNotFoundError:
            return state  # a ledger older than marks, or a mark deleted: the next write makes one
        if _lift(state, mark, path):
            logger.warning(
                "the privacy ledger %s was older than its high-water mark %s (a restored "
                "copy?): lifted to the mark's spending (generation %d)",
                path,
                mark_path,
                mark["generation"],
            )
            self._write(state)
        return state

    def _write(self, state: dict[str, Any]) -> None:
        """Write the next generation of ``state`` and its mark, both durable on return."""
        state["generation"] += 1
        body = json.dumps(state, sort_keys=True, separators=(",", ":"))
        _replace(self.directory / LEDGER_FILE, {"checksum": _checksum(body), "state": body})
        mark = json.dumps(
            {"format": MARK_FORMAT, **{field: state[field] for field in _MARK_FIELDS}},
            sort_keys=True,
            separators=(",", ":"),
        )
        _replace(self.directory / MARK_FILE, {"checksum": _checksum(mark), "mark": mark})
        _fsync_directory(self.directory)

    def _advance(self, state: dict[str, Any]) -> dict[str, Any]:
        """Move the ledger's clock forward to now (never back) and roll the period over."""
        state["clock"] = max(state["clock"], self._clock())
        period = int((state["clock"] - state["created"]) // self.limits.period_seconds)
        if period > state["period"]:
            state["period"] = period
            state["spent_per_metric"] = {}
            state["spent_this_period"] = 0.0
            state["reported_this_period"] = {}
        return state

    def _status(self, state: dict[str, Any]) -> BudgetStatus:
        limits = self.limits
        start = state["created"] + state["period"] * limits.period_seconds
        return BudgetStatus(
            period=state["period"],
            period_start=start,
            period_end=start + limits.period_seconds,
            spent_per_metric=dict(state["spent_per_metric"]),
            spent_this_period=state["spent_this_period"],
            spent_lifetime=state["spent_lifetime"],
            left_this_period=max(0.0, limits.total_per_period - state["spent_this_period"]),
            left_lifetime=max(0.0, limits.lifetime - state["spent_lifetime"]),
            limits=limits,
            lifetime_per_metric=dict(state["lifetime_per_metric"]),
            memoized_values_per_metric=dict(state["memoized_values_per_metric"]),
        )

    def _refusal(
        self, status: BudgetStatus, metric: str, epsilon: float, lifetime: float
    ) -> str | None:
        """Why spending ``epsilon`` this period and ``lifetime`` for life breaks a cap."""
        limits = self.limits
        spent = status.spent_per_metric.get(metric, 0.0)
        if not within_cap(spent + epsilon, limits.per_metric_per_period):
            return (
                f"{metric}: epsilon {epsilon:g} would bring this period's spending on it to "
                f"{spent + epsilon:g}, above the cap of {limits.per_metric_per_period:g} "
                f"(the period ends at {_utc_text(status.period_end)})"
            )
        if not within_cap(status.spent_this_period + epsilon, limits.total_per_period):
            return (
                f"{metric}: epsilon {epsilon:g} would bring this period's total to "
                f"{status.spent_this_period + epsilon:g}, above {limits.total_per_period:g}"
            )
        if lifetime > 0 and not within_cap(status.spent_lifetime + lifetime, limits.lifetime):
            return (
                f"{metric}: epsilon {lifetime:g} would bring the lifetime total to "
                f"{status.spent_lifetime + lifetime:g}, above {limits.lifetime:g}"
            )
        return None


def _report_kind(reported: int, new: bool) -> str:
    """Which memoized report a refusal was about (for its message)."""
    if new:
        return "the first report of a new value"
    if reported == 0:
        return "the first report of a known value this period"
    return "a second report of one value this period, which pays up to its lifetime epsilon"


def _credit(state: dict[str, Any], metric: str, amount: float, lifetime: bool) -> None:
    """Add ``amount`` back to the period's counters, and to the lifetime figures if
    ``lifetime`` (negative: spend it)."""
    spent = state["spent_per_metric"]
    spent[metric] = max(0.0, spent.get(metric, 0.0) - amount)
    state["spent_this_period"] = max(0.0, state["spent_this_period"] - amount)
    if lifetime:
        state["spent_lifetime"] = max(0.0, state["spent_lifetime"] - amount)
        per_metric = state["lifetime_per_metric"]
        per_metric[metric] = max(0.0, per_metric.get(metric, 0.0) - amount)


def _add(counts: dict[str, Any], metric: str, amount: float) -> None:
    counts[metric] = counts.get(metric, 0) + amount


def _added_in_format_3() -> dict[str, dict[str, Any]]:
    """The fields format 3 added, empty: what a new ledger and an older one start with."""
    return {"lifetime_per_metric": {}, "memoized_values_per_metric": {}, "reported_this_period": {}}


def _added_in_format_4() -> dict[str, Any]:
    """The fields format 4 added, empty: what a new ledger and an older one start with."""
    return {"pins": {}, "generation": 0}


#: What ``ledger.mark`` keeps of the ledger: every figure a rollback could lower.
_MARK_FIELDS = (
    "generation",
    "created",
    "clock",
    "period",
    "spent_per_metric",
    "spent_this_period",
    "spent_lifetime",
    "lifetime_per_metric",
    "memoized_values_per_metric",
    "pins",
)


def _lift(state: dict[str, Any], mark: dict[str, Any], path: Path) -> bool:
    """Raise every figure of ``state`` to the mark's, unless the ledger is newer than the
    mark (module docstring); whether anything rose."""
    if mark["created"] != state["created"]:
        raise LedgerCorruptError(
            f"the privacy ledger {path} and its high-water mark {MARK_FILE} belong to different "
            "ledgers (created at different times); refusing to report (restore the matching "
            "pair, or reset the device's state on purpose)"
        )
    if state["generation"] > mark["generation"]:
        return False
    lifted = False

    def at_least(counts: dict[str, Any], key: str, value: Any) -> None:
        nonlocal lifted
        if counts.get(key, 0) < value:
            counts[key] = value
            lifted = True

    at_least(state, "clock", mark["clock"])
    if mark["period"] > state["period"]:
        state.update(period=mark["period"], spent_per_metric={}, spent_this_period=0.0)
        state["reported_this_period"] = {}
    if mark["period"] == state["period"]:
        at_least(state, "spent_this_period", mark["spent_this_period"])
        for metric, spent in mark["spent_per_metric"].items():
            at_least(state["spent_per_metric"], metric, spent)
    at_least(state, "spent_lifetime", mark["spent_lifetime"])
    for field in ("lifetime_per_metric", "memoized_values_per_metric"):
        for metric, figure in mark[field].items():
            at_least(state[field], metric, figure)
    for name, versions in mark["pins"].items():
        own = state["pins"].setdefault(name, {})
        for version, pin in versions.items():
            if own.get(version) != pin:
                own[version] = pin
                lifted = True
    state["generation"] = mark["generation"]
    return lifted


def _pin_record(spec: MetricSpec, digest: str) -> dict[str, Any]:
    """What the ledger keeps of a pinned spec: its hash, and enough to say what changed."""
    labels = None if spec.labels is None else list(spec.labels)
    return {
        "sha256": digest,
        "mechanism": spec.mechanism.model_dump(mode="json"),
        "labels_sha256": None if labels is None else _checksum(canonical_json(labels)),
    }


def _spec_changed(spec: MetricSpec, pinned: dict[str, Any], versions: dict[str, Any]) -> str:
    """The message of a ``SpecChangedError``: what changed and what to do."""
    served = _pin_record(spec, "")
    before, after = pinned["mechanism"], served["mechanism"]
    changes = [
        f"{field} {_shown(before.get(field))} -> {_shown(after.get(field))}"
        for field in sorted(before.keys() | after.keys())
        if before.get(field) != after.get(field)
    ]
    if pinned["labels_sha256"] != served["labels_sha256"]:
        changes.append("different labels")
    highest = max(int(version) for version in versions)
    return (
        f"{spec.name} version {spec.version} is now served with a different spec "
        f"({', '.join(changes) or 'its name or version encoding'}) from the one this device "
        "reported under that name and version; refused, nothing was spent or queued. A "
        "device never reuses a version's permanent randomness or budget for another spec: "
        "the aggregator must publish a changed spec as a new version (redefining the metric "
        "makes one). If its database was recreated and its versions restarted, publish the "
        f"metric under a new name, or with versions past {highest}, the highest this device "
        "has used."
    )


def _shown(value: object) -> str:
    """A spec field's value in a message: numbers as ``%g`` writes them, absent as unset."""
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _spec_hash_hex(spec_hash: bytes) -> str:
    if len(spec_hash) != SPEC_HASH_BYTES:
        raise ValueError(f"a spec hash has {SPEC_HASH_BYTES} bytes, got {len(spec_hash)}")
    return bytes(spec_hash).hex()


def _utc_text(seconds: float) -> str:
    """Unix ``seconds`` as an ISO 8601 UTC time to the nearest second, such as
    ``2026-11-22T10:00:00Z`` (past the year 9999, which ISO 8601 cannot write in four
    digits, the seconds themselves)."""
    try:
        return datetime.fromtimestamp(round(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:.0f} s after 1970-01-01T00:00:00Z"


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _checked_body(raw: bytes, field: str) -> dict[str, Any]:
    """The object a ledger or mark document (``{"checksum": ..., field: body}``) holds,
    once its checksum matches; ValueError (or KeyError, TypeError) otherwise."""
    document = json.loads(raw)
    body = document[field]
    if not isinstance(body, str) or _checksum(body) != document["checksum"]:
        raise ValueError("checksum mismatch")
    parsed = json.loads(body)
    if not isinstance(parsed, dict):
        raise ValueError(f"the {field} is not an object")
    return parsed


def _parse(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        state = _checked_body(raw, "state")
        if state.get("format") not in READABLE_FORMATS:
            raise ValueError(f"unknown format {state.get('format')!r}")
        if state["format"] < 3:
            state.update(_added_in_format_3())
        if state["format"] < 4:
            # Charged-key hashes by name and version (v1) never match a v2 one: dropped.
            state.update(_added_in_format_4(), charged_values=[], reported_this_period={})
        state["format"] = FORMAT
        _check_state(state)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise LedgerCorruptError(
            f"the privacy ledger {path} is corrupt ({error}); refusing to report"
        ) from None
    return state


def _parse_mark(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        mark = _checked_body(raw, "mark")
        if mark.get("format") != MARK_FORMAT:
            raise ValueError(f"unknown format {mark.get('format')!r}")
        _check_figures(mark)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise LedgerCorruptError(
            f"the privacy ledger's high-water mark {path} is corrupt ({error}); refusing to "
            "report (delete it to trust the ledger beside it as it is)"
        ) from None
    return mark


def _check_state(state: dict[str, Any]) -> None:
    """Raise ValueError (or KeyError, TypeError) naming what is wrong with a parsed state."""
    _check_figures(state)
    _check_keys(state)


def _check_figures(state: dict[str, Any]) -> None:
    """Check the fields a ledger and its mark share (``_MARK_FIELDS``)."""
    for key in ("created", "clock", "spent_this_period", "spent_lifetime"):
        if not isinstance(state[key], int | float) or not math.isfinite(state[key]):
            raise ValueError(f"bad {key}")
    for key in ("period", "generation"):
        if type(state[key]) is not int or state[key] < 0:
            raise ValueError(f"bad {key}")
    for key in ("spent_this_period", "spent_lifetime"):
        if state[key] < 0:
            raise ValueError(f"negative {key}")
    for key in ("spent_per_metric", "lifetime_per_metric"):
        if not isinstance(state[key], dict):
            raise ValueError(f"bad {key}")
        for metric, spent in state[key].items():
            if not isinstance(spent, int | float) or not math.isfinite(spent) or spent < 0:
                raise ValueError(f"bad {key} of {metric!r}")
    counts = state["memoized_values_per_metric"]
    if not isinstance(counts, dict) or not all(
        type(count) is int and count > 0 for count in counts.values()
    ):
        raise ValueError("bad memoized_values_per_metric")
    pins = state["pins"]
    if not isinstance(pins, dict) or not all(
        isinstance(versions, dict)
        and all(_is_version(version) and _is_pin(pin) for version, pin in versions.items())
        for versions in pins.values()
    ):
        raise ValueError("bad pins")


def _is_version(version: str) -> bool:
    """Whether ``version`` is a metric version as the pins write it: ASCII digits."""
    return version.isascii() and version.isdigit()


def _is_pin(pin: object) -> bool:
    """Whether ``pin`` is a pinned spec: ``{"sha256", "mechanism", "labels_sha256"}``."""
    return (
        isinstance(pin, dict)
        and pin.keys() == {"sha256", "mechanism", "labels_sha256"}
        and _is_key(pin["sha256"])
        and isinstance(pin["mechanism"], dict)
        and (pin["labels_sha256"] is None or _is_key(pin["labels_sha256"]))
    )


def _check_keys(state: dict[str, Any]) -> None:
    """Check the ledger's own fields: the secret and the charged-key hashes."""
    bytes.fromhex(state["device_secret"])
    charged = state["charged_values"]
    if not isinstance(charged, list) or not all(_is_key(key) for key in charged):
        raise ValueError("bad charged values")
    reported = state["reported_this_period"]
    if not isinstance(reported, dict) or not all(
        _is_key(key) and count in range(1, _SATURATED + 1) for key, count in reported.items()
    ):
        raise ValueError("bad reported_this_period")


def _is_key(key: object) -> bool:
    """Whether ``key`` is a SHA-256 in hexadecimal (a charged-key hash, a spec hash)."""
    if not isinstance(key, str) or len(key) != 64:
        return False
    try:
        bytes.fromhex(key)
    except ValueError:
        return False
    return True


def _replace(path: Path, document: dict[str, str]) -> None:
    """Write ``document`` as JSON to a temporary file beside ``path``, fsync it and rename
    it over ``path`` (the caller fsyncs the directory)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(json.dumps(document).encode())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _durable_touch(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
