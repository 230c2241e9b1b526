"""The device's privacy ledger: epsilon is debited durably before any report exists.

Caps (``BudgetLimits``, set by the app; the server cannot raise them): per metric per
period, all metrics per period, and a lifetime total.

What a report costs. A mechanism without memory is pure epsilon-LDP per report, and
reports compose by addition (basic composition): each report adds its epsilon to the
period's counters and to the lifetime total (``debit``).

A memoized mechanism (``shared.mechanisms.memoized``: ``lgrr``, ``lsue``, ``loue``,
``losue``, ``dbitflip``, ``onebitmean``; and ``rappor``) answers a value from a
*permanent* response, drawn once per (device, metric version, memo key) from the device
secret and the same for every later report of that key, with a fresh instantaneous
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

Memo keys are recognised by a keyed hash, HMAC-SHA256(device secret, metric, version,
memo key as 8 bytes big-endian; RAPPOR: the string's UTF-8), never by the value: the
hashes of the keys charged for life, and of those reported this period, are part of the
ledger (same checksum, same fsync and rename), and without the device secret a hash says
nothing about the value.

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
``ledger.expected`` marks a state directory that has had a ledger: if the ledger is
then missing, that is an error too, not a fresh budget. The device secret (RAPPOR's
cohort and permanent response, every memoized mechanism's memo) lives in the ledger:
lose the secret and the memo is lost with it. A device whose state is reset on purpose
draws new permanent responses, and what they reveal composes with what the old ones
did, which the new ledger no longer counts.

Format. ``FORMAT`` 2 added the charged-key hashes, 3 the lifetime epsilon and the
number of memoized values charged per metric and the keys reported this period. Older
ledgers are read as having none of what they lack (format 1: memoized reports charged
per report; format 2: the per-metric lifetime figures count from the upgrade), and
written back as format 3 at the next debit.
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
FORMAT = 3
#: Formats this code reads (1: no charged-key hashes; 2: no per-metric lifetime figures).
READABLE_FORMATS = (1, 2, 3)
#: Domain separation of the charged-key hashes from every other use of the secret.
_VALUE_LABEL = b"ldp ledger value v1\x00"
#: Reports of one memo key in a period past which the period charge stays the same.
_SATURATED = 2


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

    def debit_memoized(self, metric: str, version: int, value: bytes, cost: MemoizedCost) -> None:
        """Spend what one report of memo key ``value`` by a memoized mechanism costs (the
        module docstring): ``cost.per_value`` for life on the key's first report ever, and
        ``cost.period_charge`` this period. Or raise ``BudgetExhaustedError`` and spend
        nothing."""
        self._check_report_epsilon(metric, cost.per_report)
        key = self.value_key(metric, version, value)
        with self._memory:
            now = self._high_water = max(self._high_water, self._clock())
            period = int((now - self._created) // self.limits.period_seconds)
            if period == self._saturated_period and key in self._saturated:
                return
            self._charge_memoized(metric, key, cost)

    def value_key(self, metric: str, version: int, value: bytes) -> str:
        """HMAC-SHA256(device secret, label || len-prefixed metric || version || value), hex:
        how the ledger recognises a memo key it has charged without keeping the value."""
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
            state["charged_values"] = []
        if state["format"] < 3:
            state.update(_added_in_format_3())
        state["format"] = FORMAT
        _check_state(state)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise LedgerCorruptError(
            f"the privacy ledger {path} is corrupt ({error}); refusing to report"
        ) from None
    return state


def _check_state(state: dict[str, Any]) -> None:
    """Raise ValueError (or KeyError, TypeError) naming what is wrong with a parsed state."""
    for key in ("created", "clock", "spent_this_period", "spent_lifetime"):
        if not isinstance(state[key], int | float) or not math.isfinite(state[key]):
            raise ValueError(f"bad {key}")
    if not isinstance(state["period"], int):
        raise ValueError("bad period")
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
    """Whether ``key`` is a charged-key hash: 64 hexadecimal digits."""
    if not isinstance(key, str) or len(key) != 64:
        return False
    try:
        bytes.fromhex(key)
    except ValueError:
        return False
    return True


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
