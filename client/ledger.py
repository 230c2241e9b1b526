"""The device's privacy ledger: epsilon is debited durably before any report exists.

Caps (``BudgetLimits``, set by the app; the server cannot raise them): per metric per
period, all metrics per period, and a lifetime total.

What a report costs. A mechanism without memory is pure epsilon-LDP per report, and
reports compose by addition (basic composition): each report adds its epsilon to the
period's counters and to the lifetime total (``debit``). A memoized mechanism (RAPPOR:
a permanent randomized response, PRR, fixed per device and value, re-randomized by a
fresh instantaneous response per report) is described by two numbers, ``MemoizedCost``:
``per_value``, what any number of reports of one value reveal (RAPPOR: epsilon_infinity
= 2 h ln((1 - f/2) / (f/2))), and ``per_report``, what one report reveals (RAPPOR:
epsilon_one). Its reports are correlated through the PRR, so adding epsilon_one per
report is *not* a bound on their joint privacy loss: with the demo spec (k = 32, h = 1,
f = 0.5, p = 0.25, q = 0.75), two reports of one value against two reports of two other
values already lose more than 2 epsilon_one. ``debit_memoized`` therefore charges:

* the lifetime total: ``per_value`` once per distinct value, the first time it is
  reported; a value already charged costs no more lifetime budget;
* the period's counters (this metric and all metrics): ``per_report`` per report, except
  the first report of a new value, which charges max(``per_value``, ``per_report``): the
  reports of that value in this period reveal at most ``per_value``, and its later
  reports add ``per_report`` each, so the sum bounds every period's loss.

Distinct values are recognised by a keyed hash, HMAC-SHA256(device secret, metric,
version, value), never by the value: the set of hashes is part of the ledger (same
checksum, same fsync and rename), and without the device secret a hash says nothing
about the value.

The guarantee, and its limit. Take two sequences of n values x and x' with the same
equality pattern (x_i = x_j exactly when x'_i = x'_j). The n reports are a
post-processing of one independent PRR per distinct value (the instantaneous responses
are fresh and independent), so the joint privacy loss of x against x' is at most
epsilon_infinity times the number of distinct values that differ, at most the
lifetime charge. The equality pattern itself is not protected: reports of one value are
correlated and reports of different values are not, so (v, v) against (u, w) is a
change of pattern, and its loss is bounded only by the instantaneous response over the
whole bit vector, n k ln(max(q / p, (1 - p) / (1 - q))); it grows with k and n (for the
demo spec, 10.73 at n = 2, more than the two sequences' charges together). RAPPOR
memoizes by Bloom filter, so two values whose Bloom filters coincide in the device's
cohort share one PRR: they are the same value as far as this guarantee goes (charging
each of them over-counts, never under). The exact figures are in
``tests/adversarial/test_memoized_ledger.py``.

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
reservation belongs to its period and is dropped when the period ends. Reports of a
memoized value already charged draw on a reservation that holds period budget only;
the first report of a new value is always its own durable debit.

Time. Periods are counted from the ledger's creation in whole ``period_seconds``; the
ledger keeps the latest time it has seen and never uses an earlier one, so setting the
clock back cannot reopen a spent period.

Failing closed. The ledger carries a SHA-256 checksum of its content; a ledger that
does not parse or does not match is ``LedgerCorruptError`` and nothing is reported.
``ledger.expected`` marks a state directory that has had a ledger: if the ledger is
then missing, that is an error too, not a fresh budget. The device secret (RAPPOR
memoization) lives in the ledger; losing it means losing the ledger, which fails
closed the same way.

Format. ``FORMAT`` 2 added the charged-value hashes; a format 1 ledger is read as one
with none charged yet (its memoized reports were charged per report), and written back
as format 2 at the next debit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
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

from shared.caps import within_cap

#: Most reports of one metric a single durable debit reserves for.
MAX_RESERVED_REPORTS = 1024
LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
MARKER_FILE = "ledger.expected"
FORMAT = 2
#: Formats this code reads (format 1 had no charged-value hashes).
READABLE_FORMATS = (1, 2)
#: Domain separation of the charged-value hashes from every other use of the secret.
_VALUE_LABEL = b"ldp ledger value v1\x00"


class LedgerError(Exception):
    """The ledger cannot be used; no report may be made."""


class LedgerCorruptError(LedgerError):
    """The ledger is unreadable, tampered with, or missing where one existed."""


class BudgetExhaustedError(LedgerError):
    """This report would exceed a cap; nothing was debited."""


@dataclass(frozen=True)
class BudgetLimits:
    """The device's caps on epsilon. ``math.inf`` means no cap of that kind."""

    per_metric_per_period: float = 4.0
    total_per_period: float = 16.0
    lifetime: float = math.inf
    period_seconds: float = 86_400.0
    #: Largest epsilon one report may carry: a spec above it is refused outright.
    max_epsilon_per_report: float = 4.0

    def __post_init__(self) -> None:
        for name in (
            "per_metric_per_period",
            "total_per_period",
            "lifetime",
            "period_seconds",
            "max_epsilon_per_report",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0) or math.isnan(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if math.isinf(self.period_seconds):
            raise ValueError("period_seconds must be finite")


@dataclass(frozen=True)
class MemoizedCost:
    """What a memoized mechanism's reports cost (see the module docstring).

    ``per_value``: the lifetime epsilon of one distinct value, whatever the number of
    its reports (RAPPOR: epsilon_infinity); ``per_report``: the epsilon of one report
    (RAPPOR: epsilon_one).
    """

    per_value: float
    per_report: float

    def __post_init__(self) -> None:
        for name in ("per_value", "per_report"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {value!r}")

    @property
    def first_report(self) -> float:
        """The period charge of a value's first report: max(per_value, per_report)."""
        return max(self.per_value, self.per_report)


@dataclass
class _Reservation:
    """Epsilon debited on disk for ``metric`` but not yet used by a report; ``lifetime``
    says whether it was also taken from the lifetime total (memoized repeats: not)."""

    period: int
    period_end: float
    remaining: float
    lifetime: bool
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
    #: Epsilon this client has reserved on disk and not yet used (counted as spent).
    reserved: float = 0.0

    def left_for(self, metric: str) -> float:
        """Epsilon ``metric`` may still spend this period (all caps considered)."""
        return min(self.left_in_period(metric), self.left_lifetime)

    def left_in_period(self, metric: str) -> float:
        """Epsilon ``metric`` may still spend this period, by the period caps alone (what
        repeated reports of a memoized value, which cost no lifetime budget, may spend)."""
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
        self._high_water: float = state["clock"]
        #: Hashes of the memoized values charged (a subset of the file's: never removed).
        self._charged: set[str] = set(state["charged_values"])

    # --- public --------------------------------------------------------------------

    def debit(self, metric: str, epsilon: float) -> None:
        """Spend ``epsilon`` on ``metric``, this period and for life (durably, see the
        module docstring), or raise ``BudgetExhaustedError`` and spend nothing."""
        self._check_report_epsilon(metric, epsilon)
        with self._memory:
            self._draw(metric, epsilon, lifetime=True)

    def debit_memoized(self, metric: str, version: int, value: bytes, cost: MemoizedCost) -> None:
        """Spend what one report of ``value`` by a memoized mechanism costs (the module
        docstring): ``cost.per_value`` for life and ``cost.first_report`` this period if
        the value is new, else ``cost.per_report`` this period only. Or raise
        ``BudgetExhaustedError`` and spend nothing."""
        self._check_report_epsilon(metric, cost.per_report)
        key = self.value_key(metric, version, value)
        with self._memory:
            if key in self._charged or not self._charge_value(metric, key, cost):
                self._draw(metric, cost.per_report, lifetime=False)

    def value_key(self, metric: str, version: int, value: bytes) -> str:
        """HMAC-SHA256(device secret, label || len-prefixed metric || version || value), hex:
        how the ledger recognises a value it has charged without keeping the value."""
        name = metric.encode()
        message = (
            _VALUE_LABEL
            + len(name).to_bytes(4, "big")
            + name
            + version.to_bytes(8, "big", signed=True)
            + value
        )
        return hmac.new(self.device_secret, message, hashlib.sha256).hexdigest()

    def _check_report_epsilon(self, metric: str, epsilon: float) -> None:
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be positive and finite, got {epsilon!r}")
        if epsilon > self.limits.max_epsilon_per_report:
            raise BudgetExhaustedError(
                f"{metric}: one report at epsilon {epsilon:g} exceeds this device's limit of "
                f"{self.limits.max_epsilon_per_report:g} per report"
            )

    def _draw(self, metric: str, epsilon: float, lifetime: bool) -> None:
        """Take ``epsilon`` from the metric's reservation, or reserve anew (holding
        ``_memory``). ``lifetime``: whether the lifetime total pays too."""
        now = self._high_water = max(self._high_water, self._clock())
        reservation = self._reservations.get(metric)
        if (
            reservation is not None
            and reservation.lifetime is lifetime
            and now < reservation.period_end
            and within_cap(epsilon, reservation.remaining)
        ):
            reservation.remaining = max(0.0, reservation.remaining - epsilon)
            return
        self._refill(metric, epsilon, lifetime, reservation)

    def _refill(
        self, metric: str, epsilon: float, lifetime: bool, previous: _Reservation | None
    ) -> None:
        """Give back what is left of ``previous`` and reserve for the next reports durably."""
        with self._locked():
            state = self._advance(self._read(create=False))
            self._give_back(state, metric)
            status = self._status(state)
            refusal = self._refusal(status, metric, epsilon, epsilon if lifetime else 0.0)
            if refusal is not None:
                self._write(state)
                raise BudgetExhaustedError(refusal)
            reports = (
                1
                if previous is None or previous.lifetime is not lifetime
                else min(2 * previous.next_reports, MAX_RESERVED_REPORTS)
            )
            room = status.left_for(metric) if lifetime else status.left_in_period(metric)
            amount = min(epsilon * reports, room)
            _credit(state, metric, -amount, lifetime)
            self._write(state)
            self._seen(state)
            self._reservations[metric] = _Reservation(
                state["period"], status.period_end, amount - epsilon, lifetime, reports
            )

    def _charge_value(self, metric: str, key: str, cost: MemoizedCost) -> bool:
        """Charge a memoized value's first report durably; False if the ledger on disk has
        charged it already (the caller then charges a repeat)."""
        with self._locked():
            state = self._advance(self._read(create=False))
            if key in state["charged_values"]:
                self._charged.add(key)
                return False
            self._give_back(state, metric)
            refusal = self._refusal(
                self._status(state), metric, cost.first_report, cost.per_value
            )
            if refusal is not None:
                self._write(state)
                raise BudgetExhaustedError(refusal + " (the first report of a new value)")
            _credit(state, metric, -cost.first_report, lifetime=False)
            state["spent_lifetime"] += cost.per_value
            state["charged_values"].append(key)
            self._write(state)
            self._seen(state)
            self._charged.add(key)
            return True

    def _give_back(self, state: dict[str, Any], metric: str) -> None:
        """Return the metric's unused reservation to ``state`` (if of its period)."""
        previous = self._reservations.pop(metric, None)
        if previous is not None and previous.period == state["period"]:
            _credit(state, metric, previous.remaining, previous.lifetime)

    def release(self) -> None:
        """Give back every unused reservation (durably). ``close`` of the client calls it."""
        with self._memory:
            if not self._reservations:
                return
            with self._locked():
                state = self._advance(self._read(create=False))
                for metric, reservation in self._reservations.items():
                    if reservation.period == state["period"]:
                        _credit(state, metric, reservation.remaining, reservation.lifetime)
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
        """Remember the ledger's clock, and drop reservations of periods that have ended."""
        self._high_water = max(self._high_water, state["clock"])
        for metric in [m for m, r in self._reservations.items() if r.period != state["period"]]:
            del self._reservations[metric]

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
                "charged_values": [],
            }
            self._write(state)
            _durable_touch(marker)
            return state
        return _parse(raw, path)

    def _write(self, state: dict[str, Any]) -> None:
        body = json.dumps(state, sort_keys=True, separators=(",", ":"))
        document = json.dumps({"checksum": _checksum(body), "state": body}).encode()
        path = self.directory / LEDGER_FILE
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as handle:
            handle.write(document)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_directory(self.directory)

    def _advance(self, state: dict[str, Any]) -> dict[str, Any]:
        """Move the ledger's clock forward to now (never back) and roll the period over."""
        state["clock"] = max(state["clock"], self._clock())
        period = int((state["clock"] - state["created"]) // self.limits.period_seconds)
        if period > state["period"]:
            state["period"] = period
            state["spent_per_metric"] = {}
            state["spent_this_period"] = 0.0
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


def _credit(state: dict[str, Any], metric: str, amount: float, lifetime: bool) -> None:
    """Add ``amount`` back to the period's counters, and to the lifetime total if
    ``lifetime`` (negative: spend it)."""
    spent = state["spent_per_metric"]
    spent[metric] = max(0.0, spent.get(metric, 0.0) - amount)
    state["spent_this_period"] = max(0.0, state["spent_this_period"] - amount)
    if lifetime:
        state["spent_lifetime"] = max(0.0, state["spent_lifetime"] - amount)


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


def _parse(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        document = json.loads(raw)
        body = document["state"]
        if not isinstance(body, str) or _checksum(body) != document["checksum"]:
            raise ValueError("checksum mismatch")
        state = json.loads(body)
        if state.get("format") not in READABLE_FORMATS:
            raise ValueError(f"unknown format {state.get('format')!r}")
        if state["format"] == 1:
            state["format"], state["charged_values"] = FORMAT, []
        for key in ("created", "clock", "spent_this_period", "spent_lifetime"):
            if not isinstance(state[key], int | float) or not math.isfinite(state[key]):
                raise ValueError(f"bad {key}")
        if not isinstance(state["spent_per_metric"], dict) or not isinstance(state["period"], int):
            raise ValueError("bad spending record")
        for key in ("spent_this_period", "spent_lifetime"):
            if state[key] < 0:
                raise ValueError(f"negative {key}")
        for metric, spent in state["spent_per_metric"].items():
            if not isinstance(spent, int | float) or not math.isfinite(spent) or spent < 0:
                raise ValueError(f"bad spending on {metric!r}")
        bytes.fromhex(state["device_secret"])
        charged = state["charged_values"]
        if not isinstance(charged, list) or not all(
            isinstance(key, str) and len(key) == 64 for key in charged
        ):
            raise ValueError("bad charged values")
        for key in charged:
            bytes.fromhex(key)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise LedgerCorruptError(
            f"the privacy ledger {path} is corrupt ({error}); refusing to report"
        ) from None
    return state


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
