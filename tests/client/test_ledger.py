"""The privacy ledger: caps, reservations, crashes, periods, clock rollback, corruption.

Every test drives ``PrivacyLedger`` with an injected clock; "a crash" is dropping a
ledger object without ``release()`` and opening a new one on the same directory,
which is all a killed process leaves behind (every debit is on disk before it
returns). What a fresh object reads is what is on disk.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import multiprocessing
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.ledger import (
    LEDGER_FILE,
    MARK_FILE,
    MARKER_FILE,
    BudgetExhaustedError,
    BudgetLimits,
    BudgetStatus,
    LedgerCorruptError,
    MemoizedCost,
    PrivacyLedger,
)
from client.specs import SpecChangedError
from shared.schemas import MetricSpec

PERIOD = 1000.0
START = 1_000_000.0
#: Slack for sums of binary floating-point epsilons.
SLACK = 1e-9
#: Spec hashes, as ``shared.spec_hash.spec_hash`` gives them (any 32 bytes do here).
SPEC = hashlib.sha256(b"a spec").digest()
OTHER_SPEC = hashlib.sha256(b"another spec").digest()


class FakeClock:
    """A settable wall clock (seconds)."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_limits(**overrides: float) -> BudgetLimits:
    """Small caps and a short period, so that tests reach every cap quickly."""
    values: dict[str, float] = {
        "per_metric_per_period": 1.0,
        "total_per_period": 2.0,
        "lifetime": math.inf,
        "period_seconds": PERIOD,
        "max_epsilon_per_report": 1.0,
    }
    values.update(overrides)
    return BudgetLimits(**values)


def on_disk(directory: Path, limits: BudgetLimits, clock: FakeClock) -> BudgetStatus:
    """What a new ledger object (a restarted process) sees: every reservation counts as spent."""
    return PrivacyLedger(directory, limits, clock=clock).status()


def spending(status: BudgetStatus) -> tuple[int, dict[str, float], float, float]:
    return (
        status.period,
        dict(status.spent_per_metric),
        status.spent_this_period,
        status.spent_lifetime,
    )


def debit_until_refused(
    ledger: PrivacyLedger, metric: str, epsilon: float, most: int = 1000
) -> int:
    """How many debits succeed before the first refusal."""
    for done in range(most):
        try:
            ledger.debit(metric, epsilon)
        except BudgetExhaustedError:
            return done
    raise AssertionError(f"no refusal after {most} debits")


# --- caps ---------------------------------------------------------------------------------

CAP_CASES = {
    "per metric per period": (
        {"per_metric_per_period": 1.0, "total_per_period": 10.0},
        [("a", 0.25)] * 4,
        ("a", 0.25),
        ("b", 0.25),
    ),
    "total per period": (
        {"per_metric_per_period": 1.0, "total_per_period": 1.5},
        [("a", 0.5), ("a", 0.5), ("b", 0.5)],
        ("b", 0.5),
        None,
    ),
    "lifetime": (
        {"per_metric_per_period": 10.0, "total_per_period": 10.0, "lifetime": 1.0},
        [("a", 0.5), ("b", 0.5)],
        ("c", 0.5),
        None,
    ),
    "max per report": (
        {"max_epsilon_per_report": 0.5},
        [("a", 0.5)],
        ("a", 0.75),
        ("a", 0.5),
    ),
}


@pytest.mark.parametrize("case", CAP_CASES, ids=list(CAP_CASES))
def test_every_cap_refuses_and_debits_nothing(tmp_path: Path, case: str) -> None:
    overrides, allowed, refused, still_allowed = CAP_CASES[case]
    limits, clock = make_limits(**overrides), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    for metric, epsilon in allowed:
        ledger.debit(metric, epsilon)
    before = ledger.status()
    disk_before = on_disk(tmp_path, limits, clock)

    for _ in range(2):  # refused again: a refusal leaves nothing behind to draw on
        with pytest.raises(BudgetExhaustedError, match=refused[0]):
            ledger.debit(*refused)

    assert spending(ledger.status()) == spending(before)
    assert spending(on_disk(tmp_path, limits, clock)) == spending(disk_before)
    assert ledger.status().spent_lifetime - ledger.status().reserved == pytest.approx(
        sum(epsilon for _, epsilon in allowed), abs=SLACK
    )
    if still_allowed is not None:  # only the cap that was hit refuses
        ledger.debit(*still_allowed)


def test_the_period_cap_refusal_says_when_the_period_ends_in_utc(tmp_path: Path) -> None:
    # 1_795_626_000 s after the epoch is 2026-11-25T17:00:00Z; the first period ends PERIOD
    # seconds later.
    limits, clock = make_limits(), FakeClock(1_795_626_000.0)
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    assert ledger.status().period_end == 1_795_626_000.0 + PERIOD
    ledger.debit("a", 1.0)
    with pytest.raises(BudgetExhaustedError) as refused:
        ledger.debit("a", 0.5)
    assert str(refused.value).endswith("(the period ends at 2026-11-25T17:16:40Z)")


@pytest.mark.parametrize("epsilon", [0.0, -0.5, math.nan, math.inf])
def test_nonsense_epsilon_is_an_error_and_debits_nothing(tmp_path: Path, epsilon: float) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    with pytest.raises(ValueError):
        ledger.debit("a", epsilon)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {}, 0.0, 0.0)


def test_lifetime_cap_outlasts_periods(tmp_path: Path) -> None:
    limits = make_limits(per_metric_per_period=1.0, total_per_period=1.0, lifetime=1.5)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    assert debit_until_refused(ledger, "a", 0.5) == 2  # the period cap
    clock.now += PERIOD
    assert debit_until_refused(ledger, "a", 0.5) == 1  # the lifetime cap
    for _ in range(3):
        clock.now += PERIOD
        with pytest.raises(BudgetExhaustedError, match="lifetime"):
            ledger.debit("b", 0.5)
    status = on_disk(tmp_path, limits, clock)
    assert status.period == 4
    assert status.spent_this_period == 0.0
    assert status.spent_lifetime == pytest.approx(1.5, abs=SLACK)
    assert status.left_lifetime == pytest.approx(0.0, abs=SLACK)


# --- reservations -------------------------------------------------------------------------


def test_reservation_is_spent_on_disk_and_release_returns_exactly_the_unused_part(
    tmp_path: Path,
) -> None:
    limits = make_limits(per_metric_per_period=10.0, total_per_period=10.0)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    for _ in range(5):
        ledger.debit("a", 0.1)

    mine = ledger.status()
    disk = on_disk(tmp_path, limits, clock)
    assert mine.reserved > 0  # several reports were paid for at once
    # Reserved epsilon is spent as far as the file (and any other process) is concerned.
    assert disk.spent_per_metric["a"] == pytest.approx(0.5 + mine.reserved, abs=SLACK)
    assert disk.spent_lifetime == pytest.approx(0.5 + mine.reserved, abs=SLACK)

    ledger.release()
    disk = on_disk(tmp_path, limits, clock)
    assert disk.spent_per_metric["a"] == pytest.approx(0.5, abs=SLACK)
    assert disk.spent_this_period == pytest.approx(0.5, abs=SLACK)
    assert disk.spent_lifetime == pytest.approx(0.5, abs=SLACK)
    assert ledger.status().reserved == 0.0

    ledger.debit("a", 0.1)  # still usable after a release
    ledger.release()
    assert on_disk(tmp_path, limits, clock).spent_lifetime == pytest.approx(0.6, abs=SLACK)


def test_crash_loses_the_reservation_and_never_spends_it_twice(tmp_path: Path) -> None:
    limits = make_limits(per_metric_per_period=1.0, total_per_period=10.0)
    clock = FakeClock()
    crashed = PrivacyLedger(tmp_path, limits, clock=clock)
    for _ in range(5):
        crashed.debit("a", 0.1)
    reserved = crashed.status().reserved
    assert reserved > 0
    del crashed  # killed: no release

    restarted = PrivacyLedger(tmp_path, limits, clock=clock)
    status = restarted.status()
    assert status.spent_per_metric["a"] == pytest.approx(0.5 + reserved, abs=SLACK)
    assert status.reserved == 0.0
    more = debit_until_refused(restarted, "a", 0.1)
    assert more == round((1.0 - 0.5 - reserved) / 0.1)  # the reservation is lost, not reused
    assert 0.1 * (5 + more) <= limits.per_metric_per_period + SLACK
    restarted.release()
    assert on_disk(tmp_path, limits, clock).spent_per_metric["a"] <= 1.0 + SLACK


# --- periods and the clock -----------------------------------------------------------------


def test_period_rollover_resets_period_counters_and_lifetime_keeps_counting(
    tmp_path: Path,
) -> None:
    limits = make_limits(per_metric_per_period=0.3, total_per_period=0.5)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    assert debit_until_refused(ledger, "a", 0.1) == 3
    assert debit_until_refused(ledger, "b", 0.1) == 2  # the total cap
    clock.now += PERIOD - 1
    with pytest.raises(BudgetExhaustedError):
        ledger.debit("b", 0.1)  # still the same period

    clock.now += 1
    status = ledger.status()
    assert status.period == 1
    assert status.period_start == START + PERIOD
    assert status.spent_this_period == 0.0
    assert status.spent_per_metric == {}
    assert status.spent_lifetime == pytest.approx(0.5, abs=SLACK)
    assert debit_until_refused(ledger, "a", 0.1) == 3
    ledger.release()
    status = on_disk(tmp_path, limits, clock)
    assert status.spent_this_period == pytest.approx(0.3, abs=SLACK)
    assert status.spent_lifetime == pytest.approx(0.8, abs=SLACK)


def test_reservation_of_the_previous_period_is_not_usable_in_the_next(tmp_path: Path) -> None:
    limits = make_limits(per_metric_per_period=0.4, total_per_period=10.0)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit("a", 0.1)
    ledger.debit("a", 0.1)
    assert ledger.status().reserved == pytest.approx(0.1, abs=SLACK)

    clock.now += PERIOD
    assert debit_until_refused(ledger, "a", 0.1) == 4  # 0.4 of the new period, no more
    ledger.release()
    status = on_disk(tmp_path, limits, clock)
    assert status.period == 1
    assert status.spent_per_metric["a"] == pytest.approx(0.4, abs=SLACK)
    assert 0.6 - SLACK <= status.spent_lifetime <= 0.7 + SLACK


def test_clock_set_backwards_does_not_reopen_a_spent_period(tmp_path: Path) -> None:
    limits = make_limits(per_metric_per_period=0.2, total_per_period=10.0)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    assert debit_until_refused(ledger, "a", 0.1) == 2

    clock.now = START - 50 * PERIOD  # before the ledger existed
    with pytest.raises(BudgetExhaustedError):
        ledger.debit("a", 0.1)
    assert on_disk(tmp_path, limits, clock).period == 0
    with pytest.raises(BudgetExhaustedError):
        PrivacyLedger(tmp_path, limits, clock=clock).debit("a", 0.1)

    clock.now = START + PERIOD + 1
    assert debit_until_refused(ledger, "a", 0.1) == 2  # period 1, spent in full
    for back in (START + PERIOD - 1, START + 10, START - 1):
        clock.now = back
        with pytest.raises(BudgetExhaustedError):
            ledger.debit("a", 0.1)
        restarted = PrivacyLedger(tmp_path, limits, clock=clock)
        status = restarted.status()
        assert status.period == 1
        assert status.spent_per_metric["a"] == pytest.approx(0.2, abs=SLACK)
        with pytest.raises(BudgetExhaustedError):
            restarted.debit("a", 0.1)
    # The period ends where it would have: a rollback does not extend it either.
    clock.now = START + 2 * PERIOD
    assert debit_until_refused(ledger, "a", 0.1) == 2


def test_reservation_is_dropped_once_the_ledger_has_seen_its_period_end(tmp_path: Path) -> None:
    """The app reads the budget in the next period, then the clock is set back: the reports
    that follow belong to the next period, and may not draw on the old period's reservation.

    Fails at present: ``status()`` advances the ledger's clock on disk but not the
    object's in-memory high-water mark, so after the rollback ``debit`` still finds the
    old reservation valid and the next period admits one report more than its cap.
    """
    limits = make_limits(per_metric_per_period=0.3, total_per_period=10.0)
    clock = FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit("a", 0.1)
    ledger.debit("a", 0.1)  # 0.3 on disk, 0.1 of it reserved
    assert ledger.status().reserved == pytest.approx(0.1, abs=SLACK)

    clock.now = START + PERIOD + 500
    assert ledger.status().period == 1  # the device has seen period 1 begin
    clock.now = START + 500  # then its clock is set back
    assert debit_until_refused(ledger, "a", 0.1) == 3  # period 1's cap is 0.3


# --- corruption -----------------------------------------------------------------------------


def _rewrite_state(raw: bytes, edit: Callable[[dict], None], fix_checksum: bool) -> bytes:
    document = json.loads(raw)
    state = json.loads(document["state"])
    edit(state)
    body = json.dumps(state, sort_keys=True, separators=(",", ":"))
    checksum = hashlib.sha256(body.encode()).hexdigest() if fix_checksum else document["checksum"]
    return json.dumps({"checksum": checksum, "state": body}).encode()


def _flip_checksum(raw: bytes) -> bytes:
    document = json.loads(raw)
    digit = document["checksum"][0]
    document["checksum"] = ("1" if digit == "0" else "0") + document["checksum"][1:]
    return json.dumps(document).encode()


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "bad checksum": _flip_checksum,
    "edited spending": lambda raw: _rewrite_state(
        raw, lambda s: s.update(spent_lifetime=0.0, spent_this_period=0.0), False
    ),
    "edited metric spending": lambda raw: _rewrite_state(
        raw, lambda s: s["spent_per_metric"].update(a=0.0), False
    ),
    "edited clock": lambda raw: _rewrite_state(raw, lambda s: s.update(clock=0.0), False),
    "garbage": lambda raw: bytes(range(256)) * 3,
    "other json": lambda raw: b'{"checksum": "00", "state": 5}',
    "unknown format": lambda raw: _rewrite_state(raw, lambda s: s.update(format=99), True),
    "missing field": lambda raw: _rewrite_state(raw, lambda s: s.pop("spent_lifetime"), True),
    "forgotten charged value": lambda raw: _rewrite_state(
        raw, lambda s: s.update(charged_values=[]), False
    ),
    "bad charged value": lambda raw: _rewrite_state(
        raw, lambda s: s.update(charged_values=["not a hash"]), True
    ),
    "forgotten period report": lambda raw: _rewrite_state(
        raw, lambda s: s.update(reported_this_period={}), False
    ),
    "bad period report": lambda raw: _rewrite_state(
        raw, lambda s: s.update(reported_this_period={"0" * 64: 3}), True
    ),
    "edited lifetime per metric": lambda raw: _rewrite_state(
        raw, lambda s: s["lifetime_per_metric"].update(m=-1.0), True
    ),
    "bad memoized value count": lambda raw: _rewrite_state(
        raw, lambda s: s["memoized_values_per_metric"].update(m=1.5), True
    ),
    "missing format 3 field": lambda raw: _rewrite_state(
        raw, lambda s: s.pop("memoized_values_per_metric"), True
    ),
    "missing generation": lambda raw: _rewrite_state(raw, lambda s: s.pop("generation"), True),
    "bad pin": lambda raw: _rewrite_state(raw, lambda s: s["pins"].update(m={"1": "x"}), True),
    "bad pinned version": lambda raw: _rewrite_state(
        raw, lambda s: s["pins"].update(m={"v1": s["pins"]["p"]["1"]}), True
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_corrupt_ledger_fails_closed(tmp_path: Path, corruption: str) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit_memoized("m", SPEC, b"v", MemoizedCost(0.25, 0.125))  # a charged value on file
    ledger.pin(served("p", 0.5), SPEC)  # a pinned spec on file
    ledger.debit("a", 0.5)  # reserves exactly one report: the next debit reads the file
    path = tmp_path / LEDGER_FILE
    damaged = CORRUPTIONS[corruption](path.read_bytes())
    path.write_bytes(damaged)

    with pytest.raises(LedgerCorruptError):
        ledger.debit("a", 0.5)
    with pytest.raises(LedgerCorruptError):
        ledger.status()
    with pytest.raises(LedgerCorruptError, match="corrupt"):
        PrivacyLedger(tmp_path, limits, clock=clock)
    assert path.read_bytes() == damaged  # not "repaired" into a fresh budget


def test_deleted_ledger_with_marker_fails_closed(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit("a", 0.5)
    assert (tmp_path / MARKER_FILE).exists()
    (tmp_path / LEDGER_FILE).unlink()

    with pytest.raises(LedgerCorruptError, match="missing"):
        PrivacyLedger(tmp_path, limits, clock=clock)
    with pytest.raises(LedgerCorruptError, match="missing"):
        ledger.debit("a", 0.5)
    assert not (tmp_path / LEDGER_FILE).exists()


def test_device_secret_is_stable_across_reopen(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    first = PrivacyLedger(tmp_path / "one", limits, clock=clock)
    secret = first.device_secret
    assert isinstance(secret, bytes) and len(secret) >= 16
    first.debit("a", 0.5)
    first.release()
    clock.now += 5 * PERIOD
    assert PrivacyLedger(tmp_path / "one", limits, clock=clock).device_secret == secret
    assert PrivacyLedger(tmp_path / "two", limits, clock=clock).device_secret != secret


# --- rollback: a restored older ledger.json ------------------------------------------------


def test_a_restored_older_ledger_cannot_overspend_the_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Cap 20 a period: 10 spent, a backup of ledger.json taken, 10 more spent; the backup
    restored says 10. The ledger is lifted to its mark (20) and refuses another 10: the
    period's spending stays 20 (a ledger without a mark would have allowed 30)."""
    limits = make_limits(
        per_metric_per_period=20.0, total_per_period=20.0, max_epsilon_per_report=10.0
    )
    clock = FakeClock()
    path = tmp_path / LEDGER_FILE
    first = PrivacyLedger(tmp_path, limits, clock=clock)
    first.debit("a", 10.0)
    first.release()
    backup = path.read_bytes()
    first.debit("a", 10.0)
    first.release()
    path.write_bytes(backup)  # restored, valid: its own checksum matches

    restored = PrivacyLedger(tmp_path, limits, clock=clock)
    assert "older than its high-water mark" in caplog.text
    with pytest.raises(BudgetExhaustedError, match="above the cap of 20"):
        restored.debit("a", 10.0)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"a": 20.0}, 20.0, 20.0)


def test_a_ledger_restored_under_a_running_client_is_lifted_at_its_next_read(
    tmp_path: Path,
) -> None:
    limits = make_limits(lifetime=3.0, per_metric_per_period=4.0, total_per_period=8.0)
    clock = FakeClock()
    path = tmp_path / LEDGER_FILE
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    backup = path.read_bytes()
    ledger.debit("a", 1.0)
    clock.now += PERIOD
    ledger.debit("a", 1.0)
    ledger.debit("a", 1.0)  # lifetime 3: full
    path.write_bytes(backup)  # period 0, nothing spent
    with pytest.raises(BudgetExhaustedError, match="lifetime total"):
        ledger.debit("b", 1.0)
    status = ledger.status()
    assert spending(status) == (1, {"a": 2.0}, 2.0, 3.0)
    assert status.lifetime_per_metric == {"a": 3.0}


def test_a_restored_ledger_keeps_its_memoized_charges_and_pins(tmp_path: Path) -> None:
    """Restored from before a value's first charge and a spec's pin: the lifetime figures
    come back from the mark (the value, charged again, over-counts: never under), and the
    pin too, so a changed spec is still refused."""
    limits, clock = make_limits(per_metric_per_period=4.0, total_per_period=8.0), FakeClock()
    path = tmp_path / LEDGER_FILE
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    backup = path.read_bytes()
    ledger.pin(served("m", 0.5), SPEC)
    ledger.debit_memoized("m", SPEC, b"v", MEMO)
    path.write_bytes(backup)

    restored = PrivacyLedger(tmp_path, limits, clock=clock)
    status = restored.status()
    assert (status.spent_lifetime, status.memoized_values_per_metric) == (0.5, {"m": 1})
    with pytest.raises(SpecChangedError):
        restored.pin(served("m", 1.0), OTHER_SPEC)


def test_every_write_advances_the_generation_and_the_mark(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    generations = []
    for _ in range(3):
        ledger.debit("a", 0.25)
        ledger.release()
        state = json.loads(json.loads((tmp_path / LEDGER_FILE).read_bytes())["state"])
        mark = json.loads(json.loads((tmp_path / MARK_FILE).read_bytes())["mark"])
        assert mark["generation"] == state["generation"]
        assert mark["spent_lifetime"] == state["spent_lifetime"]
        generations.append(state["generation"])
    assert generations == sorted(set(generations))


def test_a_deleted_mark_is_written_again(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    PrivacyLedger(tmp_path, limits, clock=clock).debit("a", 0.5)
    (tmp_path / MARK_FILE).unlink()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit("a", 0.25)
    assert (tmp_path / MARK_FILE).exists()
    assert on_disk(tmp_path, limits, clock).spent_lifetime == 0.75


def _mark_of_another_ledger(tmp_path: Path) -> bytes:
    other = tmp_path / "other"
    PrivacyLedger(other, make_limits(), clock=FakeClock(START + 1.0)).debit("a", 0.5)
    return (other / MARK_FILE).read_bytes()


BAD_MARKS: dict[str, Callable[[Path, bytes], bytes]] = {
    "truncated": lambda _, raw: raw[: len(raw) // 2],
    "bad checksum": lambda _, raw: raw.replace(b'"checksum": "', b'"checksum": "0', 1),
    "unknown format": lambda _, raw: json.dumps(
        {
            "checksum": hashlib.sha256(b'{"format":9}').hexdigest(),
            "mark": '{"format":9}',
        }
    ).encode(),
    "another ledger's": lambda directory, _: _mark_of_another_ledger(directory),
}


@pytest.mark.parametrize("damage", BAD_MARKS, ids=list(BAD_MARKS))
def test_a_bad_mark_fails_closed(tmp_path: Path, damage: str) -> None:
    limits, clock = make_limits(), FakeClock()
    directory = tmp_path / "device"
    PrivacyLedger(directory, limits, clock=clock).debit("a", 0.5)
    mark = directory / MARK_FILE
    mark.write_bytes(BAD_MARKS[damage](tmp_path, mark.read_bytes()))
    with pytest.raises(LedgerCorruptError, match="high-water mark"):
        PrivacyLedger(directory, limits, clock=clock)


# --- spec pins -------------------------------------------------------------------------------


def served(name: str, epsilon: float, version: int = 1) -> MetricSpec:
    return MetricSpec.model_validate(
        {
            "name": name,
            "version": version,
            "mechanism": {"mechanism": "grr", "epsilon": epsilon, "domain_size": 3},
        }
    )


def test_a_pin_is_durable_and_refuses_another_spec_without_writing(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.pin(served("m", 0.5), SPEC)
    ledger.pin(served("m", 0.5), SPEC)  # the same spec again: nothing to do
    ledger.pin(served("m", 1.0, version=2), OTHER_SPEC)  # another version: its own pin
    before = (tmp_path / LEDGER_FILE).read_bytes()
    for opened in (ledger, PrivacyLedger(tmp_path, limits, clock=clock)):
        with pytest.raises(SpecChangedError, match=r"m version 1 .*\(epsilon 0.5 -> 1\)"):
            opened.pin(served("m", 1.0), OTHER_SPEC)
    assert (tmp_path / LEDGER_FILE).read_bytes() == before
    with pytest.raises(ValueError, match="32 bytes"):
        ledger.pin(served("n", 0.5), b"short")


# --- two processes --------------------------------------------------------------------------

_CHILD = """
import json
from pathlib import Path
from client.ledger import BudgetExhaustedError, BudgetLimits, PrivacyLedger

ledger = PrivacyLedger(directory, BudgetLimits(**limits))
start.wait(60)  # both processes begin together
done = {metric: 0 for metric in metrics}
refused = set()
turn = 0
while len(refused) < len(metrics) and sum(done.values()) < quota:
    metric = metrics[turn % len(metrics)]
    turn += 1
    if metric in refused:
        continue
    try:
        ledger.debit(metric, epsilon)
        done[metric] += 1
    except BudgetExhaustedError:
        refused.add(metric)
ledger.release()
Path(out).write_text(json.dumps(done))
"""


@pytest.mark.slow
def test_two_processes_never_exceed_the_caps_together(tmp_path: Path) -> None:
    limits = {
        "per_metric_per_period": 0.3,
        "total_per_period": 5.0,
        "lifetime": 100.0,
        "period_seconds": 1e7,
        "max_epsilon_per_report": 1.0,
    }
    metrics, epsilon = [f"m{i}" for i in range(40)], 0.05
    PrivacyLedger(tmp_path / "state", BudgetLimits(**limits))  # created before both start
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    processes = [
        context.Process(
            target=exec,
            args=(
                _CHILD,
                {
                    "directory": str(tmp_path / "state"),
                    "limits": limits,
                    "metrics": metrics,
                    "epsilon": epsilon,
                    "out": str(tmp_path / f"out{i}.json"),
                    # Neither may take it all alone: both processes have work to do.
                    "quota": 60,
                    "start": start,
                },
            ),
        )
        for i in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    counts = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]

    per_metric = {m: epsilon * (counts[0][m] + counts[1][m]) for m in metrics}
    total = sum(per_metric.values())
    assert all(spent <= limits["per_metric_per_period"] + SLACK for spent in per_metric.values())
    assert total <= limits["total_per_period"] + SLACK
    # No lost update: after both released, the file holds exactly what was used.
    status = PrivacyLedger(tmp_path / "state", BudgetLimits(**limits)).status()
    assert status.spent_lifetime == pytest.approx(total, abs=SLACK)
    for metric in metrics:
        assert status.spent_per_metric.get(metric, 0.0) == pytest.approx(
            per_metric[metric], abs=SLACK
        )


# --- property: random histories of debits, crashes, restarts and clock moves ----------------

PROPERTY_LIMITS = make_limits(
    per_metric_per_period=0.5,
    total_per_period=0.8,
    lifetime=2.5,
    max_epsilon_per_report=0.5,
)

_debit = st.tuples(
    st.just("debit"), st.sampled_from("ab"), st.sampled_from([0.05, 0.1, 0.1, 0.25, 0.6])
)
#: Clock settings: anywhere from before the ledger existed to a few periods on, often right
#: at a period boundary, so that a history goes forwards and back across periods.
_clock = st.builds(
    lambda period, offset: ("clock", START + period * PERIOD + offset),
    st.integers(-1, 2),
    st.sampled_from([0.0, 1.0, 500.0, PERIOD - 1]),
)
_crash = st.just(("crash",))
_restart = st.just(("restart",))
_budget = st.just(("budget",))


def _disk_state(directory: Path) -> dict:
    """The ledger's content as last written (without writing anything)."""
    return json.loads(json.loads((directory / LEDGER_FILE).read_bytes())["state"])


def _disk_clock(directory: Path) -> float:
    return float(_disk_state(directory)["clock"])


def _check_history(operations: list[tuple]) -> None:
    """Replay ``operations``. The epsilon of the successful debits, grouped by the period of
    the latest time the device had seen, stays within every cap; and after every debit the
    file is in that period and holds at least what was used in it (every report's epsilon
    is on disk, in its period, before the report exists)."""
    limits = PROPERTY_LIMITS
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        clock = FakeClock()
        ledger = PrivacyLedger(directory, limits, clock=clock)
        latest = clock.now  # the latest time any ledger object has read
        per_metric: dict[tuple[int, str], float] = {}
        per_period: dict[int, float] = {}
        lifetime = 0.0
        for operation in operations:
            kind = operation[0]
            if kind == "debit":
                _, metric, epsilon = operation
                if epsilon <= limits.max_epsilon_per_report:
                    latest = max(latest, clock.now)
                try:
                    ledger.debit(metric, epsilon)
                except BudgetExhaustedError:
                    continue
                assert epsilon <= limits.max_epsilon_per_report
                latest = max(latest, _disk_clock(directory))
                period = int((latest - START) // limits.period_seconds)
                per_metric[period, metric] = per_metric.get((period, metric), 0.0) + epsilon
                per_period[period] = per_period.get(period, 0.0) + epsilon
                lifetime += epsilon
                assert per_metric[period, metric] <= limits.per_metric_per_period + SLACK
                assert per_period[period] <= limits.total_per_period + SLACK
                assert lifetime <= limits.lifetime + SLACK
                state = _disk_state(directory)
                assert state["period"] == period
                assert state["spent_per_metric"].get(metric, 0.0) >= (
                    per_metric[period, metric] - SLACK
                )
                assert state["spent_this_period"] >= per_period[period] - SLACK
                assert state["spent_lifetime"] >= lifetime - SLACK
            elif kind == "clock":
                clock.now = operation[1]
            elif kind == "budget":
                ledger.status()
            elif kind == "crash":
                ledger = PrivacyLedger(directory, limits, clock=clock)
            else:
                ledger.release()
                ledger = PrivacyLedger(directory, limits, clock=clock)
            latest = max(latest, _disk_clock(directory))

        status = PrivacyLedger(directory, limits, clock=clock).status()
        assert status.spent_lifetime >= lifetime - SLACK
        latest = max(latest, _disk_clock(directory))
        current = int((latest - START) // limits.period_seconds)
        assert status.period == current
        assert status.spent_this_period >= per_period.get(current, 0.0) - SLACK


_PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@_PROPERTY_SETTINGS
@given(st.lists(st.one_of(_debit, _debit, _debit, _clock, _crash, _restart), max_size=40))
@pytest.mark.slow
def test_caps_hold_over_random_histories(operations: list[tuple]) -> None:
    _check_history(operations)


@_PROPERTY_SETTINGS
@given(
    st.lists(
        st.one_of(_debit, _debit, _debit, _clock, _clock, _budget, _budget, _crash, _restart),
        min_size=10,
        max_size=40,
    )
)
@pytest.mark.slow
def test_caps_hold_over_random_histories_that_read_the_budget(operations: list[tuple]) -> None:
    """As above, with the app reading ``budget()`` now and then (which records the time it
    read on disk)."""
    _check_history(operations)


# --- memoized mechanisms: epsilon per distinct value for life, per report per period --------

#: Lifetime epsilon per distinct value, and per report (RAPPOR's epsilon_infinity and
#: epsilon_one play these parts); binary fractions, so the sums below are exact.
MEMO = MemoizedCost(per_value=0.5, per_report=0.125)


def test_memoized_value_costs_its_lifetime_epsilon_once(tmp_path: Path) -> None:
    limits, clock = make_limits(per_metric_per_period=4.0, total_per_period=8.0), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit_memoized("s", SPEC, b"v", MEMO)  # new: 0.5 for life, 0.125 this period
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.125}, 0.125, 0.5)
    ledger.debit_memoized("s", SPEC, b"v", MEMO)  # second this period: tops up to 0.5
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.5}, 0.5, 0.5)
    for _ in range(3):  # later repeats this period: nothing more
        ledger.debit_memoized("s", SPEC, b"v", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.5}, 0.5, 0.5)
    ledger.debit_memoized("s", SPEC, b"w", MEMO)  # another value: its own lifetime charge
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.625}, 0.625, 1.0)

    clock.now += PERIOD  # next period: a known value costs only its report
    restarted = PrivacyLedger(tmp_path, limits, clock=clock)  # remembered across restarts
    restarted.debit_memoized("s", SPEC, b"v", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (1, {"s": 0.125}, 0.125, 1.0)
    status = on_disk(tmp_path, limits, clock)
    assert status.lifetime_per_metric == {"s": 1.0}
    assert status.memoized_values_per_metric == {"s": 2}


def test_second_report_of_a_value_in_a_period_is_charged_even_after_a_restart(
    tmp_path: Path,
) -> None:
    """Which keys a period has seen is on disk: a restarted ledger tops up, never re-charges
    a first report, and stops charging once the key's period charge is complete."""
    limits, clock = make_limits(per_metric_per_period=4.0, total_per_period=8.0), FakeClock()
    PrivacyLedger(tmp_path, limits, clock=clock).debit_memoized("s", SPEC, b"v", MEMO)
    PrivacyLedger(tmp_path, limits, clock=clock).debit_memoized("s", SPEC, b"v", MEMO)
    PrivacyLedger(tmp_path, limits, clock=clock).debit_memoized("s", SPEC, b"v", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.5}, 0.5, 0.5)


def test_memoized_value_identity_is_spec_and_value(tmp_path: Path) -> None:
    """A value is charged once per spec hash, never per metric name and version: the same
    value under another spec (a changed spec, another version) is charged again."""
    limits, clock = make_limits(per_metric_per_period=4.0, total_per_period=8.0), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    for metric, spec, value in [
        ("s", SPEC, b"v"),
        ("s", OTHER_SPEC, b"v"),
        ("t", SPEC, b"w"),
        ("s", SPEC, b"V"),
    ]:
        ledger.debit_memoized(metric, spec, value, MEMO)
    status = on_disk(tmp_path, limits, clock)
    assert status.spent_lifetime == 4 * 0.5
    assert status.memoized_values_per_metric == {"s": 3, "t": 1}
    assert status.lifetime_per_metric == {"s": 1.5, "t": 0.5}
    assert len({ledger.value_key(SPEC, b"v"), ledger.value_key(SPEC, b"vv")}) == 2
    with pytest.raises(ValueError, match="32 bytes"):
        ledger.value_key(SPEC[:-1], b"v")


def test_ledger_keeps_keyed_hashes_of_values_never_the_values(tmp_path: Path) -> None:
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit_memoized("browser.home", SPEC, b"secret-home-page.example", MEMO)
    raw = (tmp_path / LEDGER_FILE).read_bytes()
    assert b"secret-home-page" not in raw
    state = json.loads(json.loads(raw)["state"])
    key = hmac.new(
        bytes.fromhex(state["device_secret"]),
        b"ldp ledger value v2\x00" + SPEC + b"secret-home-page.example",
        hashlib.sha256,
    ).hexdigest()
    assert state["charged_values"] == [key] and state["format"] == 4
    assert state["reported_this_period"] == {key: 1}


def test_new_memoized_value_refused_by_a_cap_spends_nothing(tmp_path: Path) -> None:
    limits, clock = make_limits(lifetime=1.0, per_metric_per_period=4.0), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit_memoized("s", SPEC, b"a", MEMO)
    ledger.debit_memoized("s", SPEC, b"b", MEMO)  # lifetime 1.0: full
    before = spending(on_disk(tmp_path, limits, clock))
    with pytest.raises(BudgetExhaustedError, match="lifetime.*first report of a new value"):
        ledger.debit_memoized("s", SPEC, b"c", MEMO)
    after = spending(on_disk(tmp_path, limits, clock))
    assert after == before
    # A value already charged may still be reported: it costs no lifetime budget.
    ledger.debit_memoized("s", SPEC, b"a", MEMO)
    assert on_disk(tmp_path, limits, clock).spent_lifetime == 1.0
    # And a new value is still refused (not charged by the refusal, not charged since).
    with pytest.raises(BudgetExhaustedError):
        ledger.debit_memoized("s", SPEC, b"c", MEMO)
    assert on_disk(tmp_path, limits, clock).memoized_values_per_metric == {"s": 2}


def test_period_caps_bound_memoized_reports(tmp_path: Path) -> None:
    """Cap 0.625 per metric: v's reports this period cost 0.125 + 0.375 = 0.5 however many
    there are; w's first report fits (0.625), its second (topping up 0.375) does not."""
    limits, clock = make_limits(per_metric_per_period=0.625), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    for _ in range(50):
        ledger.debit_memoized("s", SPEC, b"v", MEMO)
    ledger.debit_memoized("s", SPEC, b"w", MEMO)
    with pytest.raises(BudgetExhaustedError, match="above the cap.*second report of one value"):
        ledger.debit_memoized("s", SPEC, b"w", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {"s": 0.625}, 0.625, 1.0)
    clock.now += PERIOD  # a new period: w's first report of it fits again
    ledger.debit_memoized("s", SPEC, b"w", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (1, {"s": 0.125}, 0.125, 1.0)


def test_first_report_of_a_value_larger_than_the_per_metric_cap_is_refused(tmp_path: Path) -> None:
    limits, clock = make_limits(per_metric_per_period=0.0625), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    with pytest.raises(BudgetExhaustedError, match="above the cap of 0.0625"):
        ledger.debit_memoized("s", SPEC, b"v", MEMO)  # the period pays 0.125
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {}, 0.0, 0.0)
    assert on_disk(tmp_path, limits, clock).memoized_values_per_metric == {}


def test_memoized_and_plain_debits_of_one_metric_do_not_mix(tmp_path: Path) -> None:
    """A metric whose new version changes mechanism: plain debits pay the lifetime total,
    memoized repeats do not, whatever order they come in."""
    limits, clock = make_limits(per_metric_per_period=4.0, total_per_period=8.0), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit_memoized("s", SPEC, b"v", MEMO)
    for _ in range(4):
        ledger.debit_memoized("s", SPEC, b"v", MEMO)  # period up to 0.5 in all
        ledger.debit("s", 0.25)  # period and lifetime 0.25
    ledger.release()
    status = on_disk(tmp_path, limits, clock)
    assert spending(status) == (0, {"s": 1.5}, 1.5, 1.5)
    assert status.lifetime_per_metric == {"s": 1.5}


@pytest.mark.parametrize("old_format", [1, 2, 3])
def test_older_ledger_is_read_and_upgraded(tmp_path: Path, old_format: int) -> None:
    """A ledger written by older code (no mark beside it) is read and written back as
    format 4. Its charged-key hashes were keyed by name and version, as its memo was:
    they are dropped, and a value reported again pays again, under its spec's memo."""
    limits, clock = make_limits(), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    ledger.debit("a", 0.5)
    ledger.debit_memoized("s", SPEC, b"v", MEMO)
    path = tmp_path / LEDGER_FILE

    def to_old_format(state: dict) -> None:
        state.update(format=old_format)
        del state["pins"], state["generation"]
        if old_format < 3:
            for field in ("lifetime_per_metric", "memoized_values_per_metric"):
                del state[field]
            del state["reported_this_period"]
        if old_format == 1:
            del state["charged_values"]

    path.write_bytes(_rewrite_state(path.read_bytes(), to_old_format, True))
    (tmp_path / MARK_FILE).unlink()  # older code kept no mark
    reopened = PrivacyLedger(tmp_path, limits, clock=clock)
    assert reopened.device_secret == ledger.device_secret
    status = reopened.status()
    before = {"a": 0.5, "s": 0.5} if old_format == 3 else {}
    assert status.lifetime_per_metric == before
    reopened.debit_memoized("s", SPEC, b"v", MEMO)
    state = json.loads(json.loads(path.read_bytes())["state"])
    assert state["format"] == 4 and len(state["charged_values"]) == 1
    assert state["spent_lifetime"] == 1.5
    assert state["memoized_values_per_metric"] == {"s": 2 if old_format == 3 else 1}
    assert (tmp_path / MARK_FILE).exists()


def test_nonsense_memoized_costs_are_refused() -> None:
    for per_value, per_report in [(0.0, 1.0), (1.0, -1.0), (math.inf, 1.0), (1.0, math.nan)]:
        with pytest.raises(ValueError, match="positive and finite"):
            MemoizedCost(per_value, per_report)


def test_memoized_report_above_the_per_report_limit_is_refused(tmp_path: Path) -> None:
    limits, clock = make_limits(max_epsilon_per_report=0.1), FakeClock()
    ledger = PrivacyLedger(tmp_path, limits, clock=clock)
    with pytest.raises(BudgetExhaustedError, match="per report"):
        ledger.debit_memoized("s", SPEC, b"v", MEMO)
    assert spending(on_disk(tmp_path, limits, clock)) == (0, {}, 0.0, 0.0)


def debit_until_refused_memoized(ledger: PrivacyLedger, value: bytes, most: int = 1000) -> int:
    for done in range(most):
        try:
            ledger.debit_memoized("s", SPEC, value, MEMO)
        except BudgetExhaustedError:
            return done
    return most
