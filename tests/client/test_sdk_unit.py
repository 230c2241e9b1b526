"""``TelemetryClient`` on its own: what ``record`` accepts, what it queues, what it spends.

The aggregator is a fake behind ``httpx.MockTransport`` (``GET /v1/metrics``,
``POST /v1/reports``) that keeps every request the device sends, so that both the
state directory and the traffic can be searched for raw values.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import (
    BudgetExhaustedError,
    BudgetLimits,
    LedgerCorruptError,
    SpecError,
    StateDirectoryInUseError,
    TelemetryClient,
)
from client.ledger import LEDGER_FILE, PrivacyLedger
from client.outbox import OUTBOX_FILE, Outbox
from client.sdk import random_uuid4
from client.specs import SPECS_FILE
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec

#: RAPPOR's common h = 2, f = 0.5 costs 4 ln 3 = 4.39 per value for life: above the
#: default limit of 4 per value, raised here on purpose.
LIMITS = BudgetLimits(
    per_metric_per_period=50.0, total_per_period=500.0, max_value_lifetime_epsilon=5.0
)
SLACK = 1e-9

GRR_LABELS = ["zebra-crossing-7461", "quokka-smile-2290", "narwhal-tusk-5813", "axolotl-3307"]
OUE_LABELS = ["marmot-burrow-1184", "ocelot-spots-6650", "tapir-snout-4419"]
RANGE = {"lower": 0.0, "upper": 10_000.0}
MECHANISMS: dict[str, dict[str, Any]] = {
    "cat.grr": {"mechanism": "grr", "epsilon": 0.5, "domain_size": 4},
    "cat.oue": {"mechanism": "oue", "epsilon": 0.5, "domain_size": 3},
    "cat.sue": {"mechanism": "sue", "epsilon": 0.5, "domain_size": 3},
    "cat.olh": {"mechanism": "olh", "epsilon": 1.5, "domain_size": 5},
    "cat.hr": {"mechanism": "hr", "epsilon": 0.5, "domain_size": 8},
    "cat.auto": {"mechanism": "auto", "epsilon": 0.5, "domain_size": 4},
    "num.laplace": {"mechanism": "laplace", "epsilon": 0.5, **RANGE},
    "num.duchi": {"mechanism": "duchi", "epsilon": 0.5, **RANGE},
    "num.piecewise": {"mechanism": "piecewise", "epsilon": 0.5, **RANGE},
    "str.rappor": {
        "mechanism": "rappor",
        "num_bits": 32,
        "num_hashes": 2,
        "num_cohorts": 8,
        "f": 0.5,
        "p": 0.25,
        "q": 0.75,
    },
    "str.rappor_unbounded": {  # f = 0: the permanent response is the Bloom filter itself
        "mechanism": "rappor",
        "num_bits": 8,
        "num_hashes": 1,
        "num_cohorts": 2,
        "f": 0.0,
        "p": 0.25,
        "q": 0.75,
    },
}
LABELS = {"cat.grr": GRR_LABELS, "cat.oue": OUE_LABELS}
VERSIONS = {"cat.oue": 3}


def served_metrics() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "version": VERSIONS.get(name, 1),
            "description": "",
            "mechanism": mechanism,
            "labels": LABELS.get(name),
        }
        for name, mechanism in MECHANISMS.items()
    ]


class FakeAggregator:
    """Serves the metrics above, accepts every batch, keeps every request body it got."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []  # every byte the device sent
        self.batches: list[list[dict[str, Any]]] = []
        #: The HTTP ``Date`` header of every answer (None: no header).
        self.date: str | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(bytes(request.url.raw_path) + b"\n" + request.content)
        headers = {} if self.date is None else {"Date": self.date}
        if request.method == "GET" and request.url.path == "/v1/metrics":
            return httpx.Response(200, json=served_metrics(), headers=headers)
        if request.method == "POST" and request.url.path == "/v1/reports":
            reports = json.loads(request.content)["reports"]
            self.batches.append(reports)
            return httpx.Response(
                200, json={"accepted": len(reports), "duplicates": 0}, headers=headers
            )
        return httpx.Response(404, headers=headers)

    def client(self, state_dir: Path, **options: Any) -> TelemetryClient:
        options.setdefault("upload_interval", 3600.0)
        options.setdefault("limits", LIMITS)
        return TelemetryClient(
            "http://aggregator.test",
            "device-key",
            state_dir,
            transport=httpx.MockTransport(self.handle),
            **options,
        )


@pytest.fixture
def fake() -> FakeAggregator:
    """The fake aggregator (named apart from the real one of ``conftest.py``)."""
    return FakeAggregator()


@pytest.fixture
def client(fake: FakeAggregator, tmp_path: Path) -> Iterator[TelemetryClient]:
    telemetry = fake.client(tmp_path)
    yield telemetry
    with contextlib.suppress(LedgerCorruptError):
        telemetry.close(timeout=0.5)


def queued_reports(client: TelemetryClient) -> list[dict[str, Any]]:
    """The outbox's committed content, oldest first. (The client holds the outbox's file
    exclusively while open; the crash tests read it from disk after a kill -9.)"""
    return [queued.body for queued in client._outbox.peek(1_000_000)]


def stored_reports(state_dir: Path) -> list[dict[str, Any]]:
    """The outbox's content on disk, read through a new connection (client closed)."""
    outbox = Outbox(state_dir)
    try:
        return [queued.body for queued in outbox.peek(1_000_000)]
    finally:
        outbox.close()


def mechanism_of(name: str) -> Any:
    return make_mechanism(MechanismSpec.model_validate(MECHANISMS[name]))


def record_one_of_everything(client: TelemetryClient) -> list[str]:
    """Record by label, by index, numbers and strings; the metric of each report, in order."""
    client.record("cat.grr", "narwhal-tusk-5813")
    client.record("cat.grr", 0)
    client.record("cat.oue", "ocelot-spots-6650")
    client.record("cat.oue", np.int64(2))  # type: ignore[arg-type]  # numpy scalars work too
    client.record("cat.sue", 1)
    client.record("cat.olh", 4)
    client.record("cat.hr", 7)
    client.record("cat.auto", 3)
    client.record("num.laplace", 7345.12389)
    client.record("num.duchi", 2718)
    client.record("num.piecewise", np.float32(1234.5))  # type: ignore[arg-type]
    client.record("num.piecewise", -50.0)  # clipped, not refused
    client.record_string("str.rappor", "secret-homepage-9931.example")
    return [
        "cat.grr",
        "cat.grr",
        "cat.oue",
        "cat.oue",
        "cat.sue",
        "cat.olh",
        "cat.hr",
        "cat.auto",
        "num.laplace",
        "num.duchi",
        "num.piecewise",
        "num.piecewise",
        "str.rappor",
    ]


def _hour(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:00:00Z")


def test_every_queued_report_is_a_wire_report_and_nothing_more(
    client: TelemetryClient, fake: FakeAggregator, tmp_path: Path
) -> None:
    before = datetime.now(UTC)
    metrics = record_one_of_everything(client)
    after = datetime.now(UTC)
    assert client.queued == len(metrics)

    reports = queued_reports(client)
    assert [report["metric"] for report in reports] == metrics
    assert len({report["report_id"] for report in reports}) == len(reports)
    for report in reports:
        assert set(report) == {"report_id", "metric", "version", "payload", "time"}
        identifier = uuid.UUID(report["report_id"])
        assert identifier.version == 4 and str(identifier) == report["report_id"]
        assert report["version"] == VERSIONS.get(report["metric"], 1)
        mechanism = mechanism_of(report["metric"])
        assert set(report["payload"]) == mechanism.payload_fields
        assert len(mechanism.from_payloads([report["payload"]])) == 1  # a valid report
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:00:00Z", report["time"])
        assert report["time"] in {_hour(before), _hour(after)}

    # What goes on the wire is exactly what was queued.
    assert client.flush(timeout=5.0) is True
    assert [r for batch in fake.batches for r in batch] == reports
    assert client.queued == 0


def test_rappor_reports_of_one_device_keep_their_cohort(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    first = fake.client(tmp_path)
    for value in ("a.example", "b.example", "a.example"):
        first.record_string("str.rappor", value)
    first.close(timeout=5.0)
    again = fake.client(tmp_path)
    again.record_string("str.rappor", "c.example")
    again.close(timeout=5.0)
    cohorts = {r["payload"]["cohort"] for batch in fake.batches for r in batch}
    assert len(cohorts) == 1
    assert 0 <= cohorts.pop() < MECHANISMS["str.rappor"]["num_cohorts"]


BAD_VALUES: dict[str, tuple[str, str, Any, type[Exception]]] = {
    "unknown label": ("cat.grr", "record", "zebra-crossing", ValueError),
    "label of another metric": ("cat.grr", "record", OUE_LABELS[0], ValueError),
    "label on a metric without labels": ("cat.olh", "record", "four", ValueError),
    "index too large": ("cat.grr", "record", 4, ValueError),
    "negative index": ("cat.oue", "record", -1, ValueError),
    "numpy index too large": ("cat.hr", "record", np.int64(8), ValueError),
    "bool as a category": ("cat.grr", "record", True, TypeError),
    "float as a category": ("cat.grr", "record", 1.0, TypeError),
    "None as a category": ("cat.grr", "record", None, TypeError),
    "list as a category": ("cat.grr", "record", [1], TypeError),
    "NaN": ("num.laplace", "record", math.nan, ValueError),
    "numpy NaN": ("num.duchi", "record", np.float64("nan"), ValueError),
    "infinity": ("num.piecewise", "record", -math.inf, ValueError),
    "bool as a number": ("num.laplace", "record", False, TypeError),
    "text as a number": ("num.laplace", "record", "12.5", TypeError),
    "None as a number": ("num.laplace", "record", None, TypeError),
    "complex number": ("num.laplace", "record", 1 + 2j, TypeError),
    "record on a rappor metric": ("str.rappor", "record", "a.example", SpecError),
    "record_string on a categorical metric": ("cat.grr", "record_string", GRR_LABELS[0], SpecError),
    "record_string on a numeric metric": ("num.laplace", "record_string", "12.5", SpecError),
    "bytes to record_string": ("str.rappor", "record_string", b"a.example", TypeError),
    "number to record_string": ("str.rappor", "record_string", 12, TypeError),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_bad_values_raise_and_spend_and_queue_nothing(
    client: TelemetryClient, tmp_path: Path, case: str
) -> None:
    metric, method, value, error = BAD_VALUES[case]
    client.record("cat.grr", 1)  # something spent and queued already
    before, queued = client.budget(), client.queued
    with pytest.raises(error):
        getattr(client, method)(metric, value)
    after = client.budget()
    assert after.spent_per_metric == before.spent_per_metric
    assert after.spent_lifetime == before.spent_lifetime
    assert after.reserved == before.reserved
    assert client.queued == queued
    assert len(queued_reports(client)) == queued


def _raw_forms(number: float) -> list[bytes]:
    """Ways a number could be written down: as text and as a binary double or float."""
    return [
        repr(number).encode(),
        f"{number:.3f}".encode(),
        struct.pack("<d", number),
        struct.pack(">d", number),
        struct.pack("<f", number),
    ]


def test_raw_values_are_nowhere_in_the_state_directory_or_the_traffic(
    client: TelemetryClient, fake: FakeAggregator, tmp_path: Path
) -> None:
    labels = ["narwhal-tusk-5813", "ocelot-spots-6650"]
    numbers = [7345.12389, 2718.28183, 1234.56789]
    strings = ["secret-homepage-9931.example", "other-secret-4471.example"]
    client.record("cat.grr", labels[0])
    client.record("cat.oue", labels[1])
    client.record("num.laplace", numbers[0])
    client.record("num.duchi", numbers[1])
    client.record("num.piecewise", numbers[2])
    for text in strings:
        client.record_string("str.rappor", text)
    for _ in range(3):  # a few more, so that every file has had something written
        client.record("num.piecewise", numbers[2])

    def search() -> None:
        files = [path for path in tmp_path.rglob("*") if path.is_file()]
        assert {path.name for path in files} >= {LEDGER_FILE, OUTBOX_FILE, SPECS_FILE}
        anywhere = [s.encode() for s in strings] + [f for n in numbers for f in _raw_forms(n)]
        for path in files:
            content = path.read_bytes()
            for raw in anywhere:
                assert raw not in content, f"{raw!r} in {path.name}"
            if path.name != SPECS_FILE:  # the labels are public, in the specs
                for label in labels:
                    assert label.encode() not in content, f"{label!r} in {path.name}"
        for request in fake.sent:
            for raw in anywhere + [label.encode() for label in labels]:
                assert raw not in request

    search()  # while queued (the outbox's write-ahead log included)
    assert client.close(timeout=5.0) is True
    assert fake.batches
    search()  # and after upload and close


def test_budget_reflects_spending_and_close_releases_reservations(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    client = fake.client(tmp_path)
    assert client.budget().spent_lifetime == 0.0
    for _ in range(5):
        client.record("cat.grr", 2)
    client.record("num.duchi", 10.0)

    status = client.budget()
    used = 5 * 0.5 + 0.5
    assert status.reserved > 0  # reserved ahead, counted as spent
    assert status.spent_per_metric["cat.grr"] >= 2.5 - SLACK
    assert status.spent_this_period - status.reserved == pytest.approx(used, abs=SLACK)
    assert status.spent_lifetime - status.reserved == pytest.approx(used, abs=SLACK)
    assert status.left_this_period == pytest.approx(500.0 - status.spent_this_period)
    assert status.left_for("cat.grr") == pytest.approx(50.0 - status.spent_per_metric["cat.grr"])

    assert client.close(timeout=5.0) is True
    on_disk = PrivacyLedger(tmp_path, LIMITS).status()
    assert on_disk.spent_per_metric["cat.grr"] == pytest.approx(2.5, abs=SLACK)
    assert on_disk.spent_per_metric["num.duchi"] == pytest.approx(0.5, abs=SLACK)
    assert on_disk.spent_lifetime == pytest.approx(used, abs=SLACK)
    assert not (tmp_path / f"{OUTBOX_FILE}-wal").exists()  # the outbox was closed cleanly
    with pytest.raises(RuntimeError):
        client.record("cat.grr", 2)


def test_budget_cap_refuses_record_and_queues_nothing(fake: FakeAggregator, tmp_path: Path) -> None:
    limits = BudgetLimits(per_metric_per_period=1.0, total_per_period=10.0)
    client = fake.client(tmp_path, limits=limits)
    try:
        client.record("cat.grr", 0)
        client.record("cat.grr", 1)
        with pytest.raises(BudgetExhaustedError):
            client.record("cat.grr", 2)
        assert client.queued == 2
        client.record("cat.oue", 0)  # another metric still has budget
        assert client.queued == 3
    finally:
        client.close(timeout=5.0)


def test_corrupt_ledger_stops_all_reports(fake: FakeAggregator, tmp_path: Path) -> None:
    client = fake.client(tmp_path)
    client.record("cat.grr", 1)  # the first report of a metric reserves for itself only
    (tmp_path / LEDGER_FILE).write_bytes(b'{"checksum": "0", "state": "{}"}')
    with pytest.raises(LedgerCorruptError):
        client.record("cat.grr", 1)
    with pytest.raises(LedgerCorruptError):
        client.record("num.duchi", 1.0)
    with pytest.raises(LedgerCorruptError):
        client.budget()
    assert client.queued == 1
    with contextlib.suppress(LedgerCorruptError):
        client.close(timeout=5.0)
    with pytest.raises(LedgerCorruptError):
        fake.client(tmp_path)
    assert len(stored_reports(tmp_path)) == 0  # the earlier report was still delivered
    assert len(fake.batches) == 1


def test_missing_ledger_of_a_used_device_stops_all_reports(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    client = fake.client(tmp_path)
    client.record("cat.grr", 1)
    assert client.close(timeout=5.0) is True
    (tmp_path / LEDGER_FILE).unlink()
    with pytest.raises(LedgerCorruptError, match="missing"):
        fake.client(tmp_path)
    assert not (tmp_path / LEDGER_FILE).exists()


def test_close_releases_the_outbox_even_when_the_ledger_is_corrupt(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    """Fails at present: ``close`` calls ``ledger.release()`` before closing the outbox and
    the HTTP client, without ``try/finally``; a corrupt ledger makes ``release`` raise and
    leaves the SQLite connection (and its write-ahead log) open."""
    client = fake.client(tmp_path)
    client.record("cat.grr", 1)
    (tmp_path / LEDGER_FILE).write_bytes(b"garbage")
    with contextlib.suppress(LedgerCorruptError):
        client.close(timeout=5.0)
    assert not (tmp_path / f"{OUTBOX_FILE}-wal").exists()


def test_report_ids_are_random_version_4_uuids() -> None:
    """Every id parses as a version 4, RFC variant UUID and round-trips as text; the 122
    random bits are uniform: each hex digit outside the fixed ones takes every value
    (over 20,000 ids, a value of a digit is missing with probability 16 * (15/16)^20000)."""
    ids = [random_uuid4() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    for text in ids[:1000]:
        parsed = uuid.UUID(text)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and str(parsed) == text
    digits = np.array([list(text.replace("-", "")) for text in ids])
    for position in set(range(32)) - {12, 16}:  # the version digit and the variant digit
        assert len(set(digits[:, position])) == 16
    assert set(digits[:, 12]) == {"4"} and set(digits[:, 16]) == set("89ab")


# --- memoized RAPPOR charges, server clock, one client per state directory ----------------


def test_rappor_charges_epsilon_infinity_once_per_distinct_value(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    rappor = mechanism_of("str.rappor")
    client = fake.client(tmp_path)
    for value in ["home-a.example", "home-a.example", "home-b.example", "home-a.example"]:
        client.record_string("str.rappor", value)
    assert client.close(timeout=5.0) is True
    on_disk = PrivacyLedger(tmp_path, LIMITS).status()
    # Two distinct values: 2 epsilon_infinity for life (not 4 epsilon_one); the period
    # pays epsilon_one for each value's first report, tops a's up to epsilon_infinity at
    # its second, and nothing for its third.
    assert on_disk.spent_lifetime == pytest.approx(2 * rappor.epsilon_infinity, abs=SLACK)
    assert on_disk.spent_per_metric["str.rappor"] == pytest.approx(
        rappor.epsilon_infinity + rappor.epsilon_one, abs=SLACK
    )
    assert on_disk.memoized_values_per_metric == {"str.rappor": 2}
    assert on_disk.lifetime_per_metric["str.rappor"] == pytest.approx(
        2 * rappor.epsilon_infinity, abs=SLACK
    )
    assert len(fake.batches[0]) == 4


def test_rappor_without_a_lifetime_bound_is_refused(fake: FakeAggregator, client: Any) -> None:
    with pytest.raises(SpecError, match="lifetime epsilon is infinite"):
        client.record_string("str.rappor_unbounded", "home-a.example")
    assert client.queued == 0 and client.budget().spent_lifetime == 0.0


def test_rappor_value_that_is_not_unicode_is_refused_before_any_spending(client: Any) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        client.record_string("str.rappor", "half a pair \ud800")
    assert client.queued == 0 and client.budget().spent_lifetime == 0.0


def test_report_hours_follow_the_aggregator_clock(fake: FakeAggregator, tmp_path: Path) -> None:
    """The device's clock is two hours fast; the aggregator's ``Date`` says the true time.
    Reports carry the aggregator's hour, also after a restart with no answer yet (the
    offset is kept), and with the device's own clock before any answer ever came."""
    true_now = datetime(2025, 3, 14, 15, 9, 26, tzinfo=UTC)
    device = true_now.timestamp() + 2 * 3600.0
    fake.date = "Fri, 14 Mar 2025 15:09:26 GMT"
    client = fake.client(tmp_path, clock=lambda: device)
    client.record("cat.grr", 1)
    assert [r["time"] for r in queued_reports(client)] == ["2025-03-14T15:00:00Z"]
    assert client.close(timeout=5.0) is True

    fake.date = None  # answers without Date: the kept offset still applies
    client = fake.client(tmp_path, clock=lambda: device)
    client.record("cat.grr", 2)
    assert [r["time"] for r in queued_reports(client)] == ["2025-03-14T15:00:00Z"]
    client.close(timeout=5.0)

    fresh = fake.client(tmp_path / "fresh", clock=lambda: device)
    fresh.record("cat.grr", 3)  # never heard a Date: its own clock is all it has
    assert [r["time"] for r in queued_reports(fresh)] == ["2025-03-14T17:00:00Z"]
    fresh.close(timeout=5.0)


def test_a_second_client_on_one_state_directory_fails_at_once(
    fake: FakeAggregator, tmp_path: Path
) -> None:
    first = fake.client(tmp_path)
    try:
        with pytest.raises(StateDirectoryInUseError, match=re.escape(str(tmp_path))):
            fake.client(tmp_path)
        first.record("cat.grr", 1)  # the first one is unharmed
        assert first.queued == 1
    finally:
        first.close(timeout=5.0)
    second = fake.client(tmp_path)  # free again once the first is closed
    assert second.queued == 0  # the first delivered its report
    second.close(timeout=5.0)


_OTHER_PROCESS = """
import sys
from client import StateDirectoryInUseError, TelemetryClient
try:
    TelemetryClient("http://127.0.0.1:9", "key", sys.argv[1])
except StateDirectoryInUseError as error:
    print(error)
    sys.exit(3)
sys.exit(0)
"""


@pytest.mark.slow
def test_a_client_in_another_process_fails_at_once(fake: FakeAggregator, tmp_path: Path) -> None:
    first = fake.client(tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _OTHER_PROCESS, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,  # a hang guard only
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        first.close(timeout=5.0)
    assert done.returncode == 3, done.stderr
    assert "another telemetry client holds the state directory" in done.stdout
    assert str(tmp_path) in done.stdout
