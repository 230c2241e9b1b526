"""Repeated collection on the device: memoized reports through ``TelemetryClient``.

The aggregator is a fake behind ``httpx.MockTransport`` that serves the metric specs and
keeps every batch; the device's clock is injected (``FakeClock``), one ledger period a
day. What is checked:

* the ledger charges the truth (``client/ledger.py``): a memoized metric's ``epsilon``
  once per distinct value for life, ``epsilon_report`` for a value's first report in a
  period, topped up to ``epsilon`` by a second one in the same period (two reports of
  one value can reveal more than twice ``epsilon_report``: exact enumeration below);
  ``budget()`` shows the lifetime epsilon and the distinct values per metric;
* a kill -9 right after the durable charge, before the report exists, never
  under-charges (a child process: this file run as a script);
* memo stability: the same value gives the same permanent response across restarts and
  processes, and another state directory (another device secret) an independent one;
* the device's per-report limit applies to ``epsilon_report``, and its limit on one
  value's lifetime epsilon (finite by default) to ``epsilon``: a spec above either is
  refused before anything is spent.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import BudgetExhaustedError, BudgetLimits, MemoizedCost, SpecError, TelemetryClient
from client.ledger import PrivacyLedger
from client.outbox import Outbox
from client.sdk import memoized_cost, rappor_secret
from shared.mechanisms import DeviceContext, make_mechanism
from shared.mechanisms.dbitflip import DBitFlip
from shared.mechanisms.lgrr import LongitudinalGRR, grr_matrix
from shared.mechanisms.rappor import Rappor
from shared.memo import KeyedMemo, spec_scope
from shared.schemas import MechanismSpec, MetricSpec
from shared.spec_hash import spec_hash

DAY = 86_400.0
#: 2026-01-01T00:30:00Z: the device's clock on day 0 (reports stamped 2026-01-01T00:00Z).
START = 1_767_227_400.0
#: False-failure rate of each statistical check below.
P_FLOOR = 1e-6

MEMOIZED: dict[str, dict[str, Any]] = {
    "mem.lgrr": {"mechanism": "lgrr", "epsilon": 2.0, "epsilon_report": 0.5, "domain_size": 16},
    "mem.lsue": {"mechanism": "lsue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "mem.loue": {"mechanism": "loue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "mem.losue": {"mechanism": "losue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 4},
    "mem.dbitflip": {
        "mechanism": "dbitflip",
        "epsilon": 1.0,
        "domain_size": 8,
        "bits_per_device": 2,
    },
    "mem.onebitmean": {
        "mechanism": "onebitmean",
        "epsilon": 1.0,
        "lower": 0.0,
        "upper": 100.0,
        "flip_probability": 0.125,
    },
}
OTHERS: dict[str, dict[str, Any]] = {
    "plain.grr": {"mechanism": "grr", "epsilon": 3.0, "domain_size": 4},
    "mem.wide": {"mechanism": "lgrr", "epsilon": 6.0, "epsilon_report": 1.0, "domain_size": 4},
    "mem.loud": {"mechanism": "lgrr", "epsilon": 3.5, "epsilon_report": 3.0, "domain_size": 4},
    #: A permanent response kept by most reports (p2 = 0.84) that is often not the value.
    "mem.sticky": {"mechanism": "lgrr", "epsilon": 1.5, "epsilon_report": 1.2, "domain_size": 4},
    #: Cheap per report, 20 per value for life: what a greedy server asks.
    "mem.greedy": {"mechanism": "lgrr", "epsilon": 20.0, "epsilon_report": 0.4, "domain_size": 4},
    #: RAPPOR whose instantaneous response is the identity: a report is its PRR.
    "str.prr": {
        "mechanism": "rappor",
        "num_bits": 16,
        "num_hashes": 1,
        "num_cohorts": 8,
        "f": 0.5,
        "p": 0.0,
        "q": 1.0,
    },
}
LABELS = {"mem.lgrr": [f"secret-label-{i:02d}-7731" for i in range(16)]}
VERSION = 3
#: A value of each memoized metric (a category index, or a number).
VALUE: dict[str, int | float] = {name: 3 for name in MEMOIZED} | {"mem.onebitmean": 42.5}


def spec_of(name: str) -> MechanismSpec:
    return MechanismSpec.model_validate({**MEMOIZED, **OTHERS}[name])


def served_spec(name: str) -> MetricSpec:
    """The metric ``name`` as the fake aggregator serves it."""
    return MetricSpec.model_validate(next(m for m in served_metrics() if m["name"] == name))


def served_metrics() -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "version": VERSION,
            "description": "",
            "mechanism": mechanism,
            "labels": LABELS.get(name),
        }
        for name, mechanism in {**MEMOIZED, **OTHERS}.items()
    ]


class FakeClock:
    """The device's settable wall clock (seconds since the epoch)."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeAggregator:
    """Serves the metrics above and accepts every batch, keeping the reports."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/metrics":
            return httpx.Response(200, json=served_metrics())
        if request.method == "POST" and request.url.path == "/v1/reports":
            batch = json.loads(request.content)["reports"]
            self.reports.extend(batch)
            return httpx.Response(200, json={"accepted": len(batch), "duplicates": 0})
        return httpx.Response(404)

    def client(self, state_dir: Path, clock: FakeClock, **options: Any) -> TelemetryClient:
        options.setdefault("limits", BudgetLimits(period_seconds=DAY))
        return TelemetryClient(
            "http://aggregator.test",
            "device-key",
            state_dir,
            transport=httpx.MockTransport(self.handle),
            clock=clock,
            upload_interval=3600.0,
            batch_size=100_000,  # nothing leaves before flush or close
            **options,
        )


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """Where the devices' state directories go: in memory (``/dev/shm``) where the system
    has it, so that the ledger's fsyncs cost microseconds; else ``tmp_path``."""
    memory = Path("/dev/shm")
    if not memory.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=memory, prefix="ldp-client-test-") as directory:
        yield Path(directory)


@pytest.fixture
def fake() -> FakeAggregator:
    return FakeAggregator()


@pytest.fixture
def open_client(fake: FakeAggregator, state_root: Path) -> Iterator[Callable[..., TelemetryClient]]:
    """``open_client(state_dir, clock, **options)``; every client is closed after the test
    (before ``state_root`` goes)."""
    opened: list[TelemetryClient] = []

    def make(state_dir: Path, clock: FakeClock, **options: Any) -> TelemetryClient:
        opened.append(fake.client(state_dir, clock, **options))
        return opened[-1]

    yield make
    for client in opened:
        client.close(timeout=1.0)


# --- what the ledger charges ------------------------------------------------------------


@pytest.mark.parametrize("metric", list(MEMOIZED))
def test_a_year_of_daily_reports_of_one_value_costs_epsilon_for_life(
    open_client: Callable[..., TelemetryClient], fake: FakeAggregator, state_root: Path, metric: str
) -> None:
    """365 daily reports of one unchanging value: ``epsilon`` for life, ``epsilon_report``
    each day. The caps are set to exactly these figures, so any over-charge is refused;
    ``budget()`` shows them every day."""
    spec = spec_of(metric)
    assert spec.epsilon_report is not None
    limits = BudgetLimits(
        per_metric_per_period=spec.epsilon_report,
        total_per_period=spec.epsilon_report,
        lifetime=spec.epsilon,
        period_seconds=DAY,
        max_epsilon_per_report=spec.epsilon_report,
    )
    clock = FakeClock()
    client = open_client(state_root, clock, limits=limits)
    for day in range(365):
        client.record(metric, VALUE[metric])
        status = client.budget()
        assert status.period == day
        assert status.spent_per_metric == {metric: spec.epsilon_report}
        assert status.spent_lifetime == spec.epsilon
        assert status.lifetime_per_metric == {metric: spec.epsilon}
        assert status.memoized_values_per_metric == {metric: 1}
        clock.now += DAY
    # A new value would cost another epsilon for life: over the cap, refused.
    other = 1 if spec.is_categorical else 97.5
    with pytest.raises(BudgetExhaustedError, match="lifetime.*first report of a new value"):
        client.record(metric, other)
    assert client.flush(timeout=10.0)
    hours = [report["time"] for report in fake.reports]
    assert len(hours) == 365 and len(set(hours)) == 365  # one report a day, each its day's
    assert hours[0] == "2026-01-01T00:00:00Z" and hours[-1] == "2026-12-31T00:00:00Z"


def test_each_distinct_value_costs_epsilon_once(
    open_client: Callable[..., TelemetryClient], state_root: Path
) -> None:
    """A value that changes 3 times over 40 days, once back to an earlier value: three
    distinct values, 3 epsilon for life; every day costs its period epsilon_report."""
    metric, spec = "mem.lgrr", spec_of("mem.lgrr")
    labels = LABELS[metric]
    history = [labels[0]] * 10 + [labels[5]] * 10 + [labels[0]] * 10 + [labels[9]] * 10
    clock = FakeClock()
    client = open_client(state_root, clock, limits=BudgetLimits(lifetime=6.0, period_seconds=DAY))
    for day, value in enumerate(history):
        client.record(metric, value)
        status = client.budget()
        assert status.spent_per_metric == {metric: spec.epsilon_report}, day
        clock.now += DAY
    assert status.spent_lifetime == 3 * spec.epsilon
    assert status.lifetime_per_metric == {metric: 3 * spec.epsilon}
    assert status.memoized_values_per_metric == {metric: 3}
    with pytest.raises(BudgetExhaustedError, match="lifetime"):  # a fourth: 8 > 6
        client.record(metric, labels[1])
    client.record(metric, labels[5])  # a known one is still fine: no lifetime cost
    assert client.budget().memoized_values_per_metric == {metric: 3}


def test_second_report_of_a_value_in_a_day_tops_the_day_up_to_epsilon(
    open_client: Callable[..., TelemetryClient], state_root: Path
) -> None:
    metric, spec = "mem.lgrr", spec_of("mem.lgrr")
    clock = FakeClock()
    client = open_client(state_root, clock)
    client.record(metric, 7)
    assert client.budget().spent_per_metric == {metric: spec.epsilon_report}
    for _ in range(5):  # the second tops up; the others cost nothing more
        client.record(metric, 7)
        assert client.budget().spent_per_metric == {metric: spec.epsilon}
    assert client.budget().spent_lifetime == spec.epsilon


def test_two_reports_of_one_value_can_reveal_more_than_twice_epsilon_report() -> None:
    """Why a second report in a period tops up to epsilon: the exact joint law of two and
    three reports of one value (one permanent response, fresh instantaneous ones) for the
    lgrr metric above (d = 16, epsilon 2, epsilon_report 0.5). Two reports reveal 1.15,
    more than 2 x 0.5 (so charging epsilon_report per report would under-count), and any
    number reveal at most epsilon (post-processing of the permanent response).
    Floating point: the margins (0.15 and 0.85) are far above its error (1e-12)."""
    mechanism = make_mechanism(spec_of("mem.lgrr"))
    assert isinstance(mechanism, LongitudinalGRR)
    permanent = mechanism.permanent_matrix()
    instant = grr_matrix(*mechanism.instantaneous_probabilities, mechanism.domain_size)
    np.testing.assert_allclose(permanent @ instant, mechanism.transition_matrix(), atol=1e-12)

    def loss(law: np.ndarray) -> float:
        """Largest log-likelihood ratio between two values over every output (axis 0:
        the value)."""
        return float(np.log(law.max(axis=0) / law.min(axis=0)).max())

    one = loss(mechanism.transition_matrix())
    two = loss(np.einsum("vs,sa,sb->vab", permanent, instant, instant))
    three = loss(np.einsum("vs,sa,sb,sc->vabc", permanent, instant, instant, instant))
    assert one == pytest.approx(mechanism.epsilon_report, abs=1e-9)
    assert two == pytest.approx(1.1516, abs=1e-4) and two > 2 * mechanism.epsilon_report
    assert two < three <= mechanism.epsilon_lifetime + 1e-12
    # The ledger's charges: one report epsilon_report, two or more max(epsilon, ...).
    cost = memoized_cost(mechanism)
    assert cost.period_charge(0) == mechanism.epsilon_report
    assert cost.period_charge(0) + cost.period_charge(1) == mechanism.epsilon_lifetime
    assert cost.period_charge(2) == 0.0


def test_memoized_cost_covers_every_memoized_mechanism_and_rappor() -> None:
    for name in MEMOIZED:
        spec = spec_of(name)
        assert spec.epsilon_report is not None
        expected = MemoizedCost(spec.epsilon, spec.epsilon_report)
        assert memoized_cost(make_mechanism(spec)) == expected, name
    rappor = make_mechanism(
        MechanismSpec(
            mechanism="rappor", num_bits=16, num_hashes=1, num_cohorts=4, f=0.5, p=0.25, q=0.75
        )
    )
    assert isinstance(rappor, Rappor)
    assert memoized_cost(rappor) == MemoizedCost(rappor.epsilon_infinity, rappor.epsilon_one)
    with pytest.raises(SpecError, match="not a memoized mechanism"):
        memoized_cost(make_mechanism(spec_of("plain.grr")))


def test_the_per_report_limit_applies_to_epsilon_report(
    open_client: Callable[..., TelemetryClient], state_root: Path
) -> None:
    """A device that allows 2 per report (and 6 per value for life) takes an lgrr metric of
    epsilon 6 for life and 1 per report, and refuses a one-shot metric at 3 and an lgrr
    metric at 3 per report."""
    limits = BudgetLimits(
        max_epsilon_per_report=2.0, max_value_lifetime_epsilon=6.0, period_seconds=DAY
    )
    client = open_client(state_root, FakeClock(), limits=limits)
    client.record("mem.wide", 2)
    status = client.budget()
    assert status.spent_per_metric == {"mem.wide": 1.0} and status.spent_lifetime == 6.0
    for metric in ("plain.grr", "mem.loud"):
        with pytest.raises(SpecError, match="asks for epsilon 3 per report.*limit of 2"):
            client.record(metric, 1)
    assert client.queued == 1


def test_default_limits_refuse_a_greedy_lifetime_epsilon(
    open_client: Callable[..., TelemetryClient], state_root: Path
) -> None:
    """Default ``BudgetLimits``: lgrr at 0.4 per report but 20 per value for life is refused
    before anything is spent or queued (the device's limit is 4 per value), and so is an
    lgrr metric at 6 for life; an app that raises the limit to 6 takes the latter, and the
    lifetime total (finite by default) refuses a spec above it the same way."""
    assert BudgetLimits().max_value_lifetime_epsilon == 4.0
    assert math.isfinite(BudgetLimits().lifetime)
    client = open_client(state_root / "default", FakeClock())
    for metric, epsilon in (("mem.greedy", 20), ("mem.wide", 6)):
        with pytest.raises(SpecError, match=f"epsilon {epsilon} for life per value.*limit of 4"):
            client.record(metric, 1)
    assert client.queued == 0 and client.budget().spent_lifetime == 0.0

    raised = BudgetLimits(max_value_lifetime_epsilon=6.0, period_seconds=DAY)
    client = open_client(state_root / "raised", FakeClock(), limits=raised)
    client.record("mem.wide", 1)
    assert client.budget().spent_lifetime == 6.0

    small = BudgetLimits(lifetime=5.0, max_value_lifetime_epsilon=6.0, period_seconds=DAY)
    client = open_client(state_root / "small", FakeClock(), limits=small)
    with pytest.raises(SpecError, match="epsilon 6 at once.*lifetime total of 5"):
        client.record("mem.wide", 1)
    assert client.queued == 0 and client.budget().spent_lifetime == 0.0


def test_no_raw_value_is_kept_or_sent(
    open_client: Callable[..., TelemetryClient], fake: FakeAggregator, state_root: Path
) -> None:
    """Memoized reports keep keyed hashes of memo keys, never the labels recorded."""
    clock = FakeClock()
    client = open_client(state_root, clock)
    recorded = LABELS["mem.lgrr"][2:5]
    for _ in range(3):
        for label in recorded:
            client.record("mem.lgrr", label)
        clock.now += DAY
    assert client.close(timeout=5.0)
    for path in (p for p in state_root.rglob("*") if p.is_file() and p.name != "specs.json"):
        content = path.read_bytes()
        assert not any(label.encode() in content for label in recorded), path.name
    assert len(fake.reports) == 9
    assert not any(label in json.dumps(fake.reports) for label in recorded)


# --- kill -9 between the charge and the report --------------------------------------------

#: The values the child records, one a day (index = day): 0 new, 0, 1 new, 1, 0, 2 new.
CRASH_HISTORY = [0, 0, 1, 1, 0, 2]


def child_main(state_dir: str, mode: str, argument: int) -> int:
    """``crash K``: record ``CRASH_HISTORY`` day by day, SIGKILLing this process right after
    the ledger's durable charge of record K (before the report exists). ``repeat N``: record
    1 for ``mem.sticky`` and ``mem.dbitflip`` N times on day 0, close, and print the
    reports delivered as JSON."""
    fake, clock = FakeAggregator(), FakeClock()
    if mode == "crash":
        charge = PrivacyLedger.debit_memoized
        charged = [0]

        def charge_then_die(self: PrivacyLedger, *args: Any) -> None:
            charge(self, *args)
            if charged[0] == argument:
                os.kill(os.getpid(), signal.SIGKILL)
            charged[0] += 1

        PrivacyLedger.debit_memoized = charge_then_die  # type: ignore[method-assign, assignment]
        client = fake.client(Path(state_dir), clock)
        for day, value in enumerate(CRASH_HISTORY):
            clock.now = START + day * DAY
            client.record("mem.lgrr", value)
        return 1  # never reached: the kill comes first
    client = fake.client(Path(state_dir), clock)
    for _ in range(argument):
        for metric in ("mem.sticky", "mem.dbitflip"):
            client.record(metric, 1)
    client.close(timeout=10.0)
    print(json.dumps(fake.reports))
    return 0


def run_child(state_dir: Path, mode: str, argument: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "child",
            str(state_dir),
            mode,
            str(argument),
        ],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard only
        cwd=Path(__file__).resolve().parents[2],
    )


def queued_times(state_dir: Path) -> list[str]:
    """The hours of the reports in a closed (or killed) device's outbox, oldest first."""
    outbox = Outbox(state_dir)
    try:
        return [queued.body["time"] for queued in outbox.peek(1_000)]
    finally:
        outbox.close()


@pytest.mark.slow
def test_kill_nine_between_charge_and_report_never_under_charges(
    open_client: Callable[..., TelemetryClient], state_root: Path
) -> None:
    """The child dies right after the durable charge of its third record (day 2, value 1,
    new): the two earlier reports are queued, the third never existed, and yet value 1 is
    charged for life and day 2 its epsilon_report. Restarted, the device reports value 1
    again that day: no second lifetime charge, and the day tops up (its first report
    counted, though it never left). A second child dies after charging day 4's report of
    a known value: epsilon_report for the day, nothing for life."""
    spec = spec_of("mem.lgrr")
    limits = BudgetLimits(period_seconds=DAY)
    first, second = state_root / "first", state_root / "second"
    killed = run_child(first, "crash", 2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert queued_times(first) == ["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"]
    clock = FakeClock(START + 2 * DAY)
    status = PrivacyLedger(first, limits, clock).status()
    assert status.spent_lifetime == 2 * spec.epsilon
    assert status.memoized_values_per_metric == {"mem.lgrr": 2}
    assert status.spent_per_metric == {"mem.lgrr": spec.epsilon_report}

    client = open_client(first, clock)
    client.record("mem.lgrr", 1)
    status = client.budget()
    assert status.spent_lifetime == 2 * spec.epsilon
    assert status.memoized_values_per_metric == {"mem.lgrr": 2}
    assert status.spent_per_metric == {"mem.lgrr": spec.epsilon}

    killed = run_child(second, "crash", 4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(queued_times(second)) == 4
    status = PrivacyLedger(second, limits, FakeClock(START + 4 * DAY)).status()
    assert status.spent_lifetime == 2 * spec.epsilon  # values 0 and 1, nothing for the kill
    assert status.spent_per_metric == {"mem.lgrr": spec.epsilon_report}


# --- memo stability ----------------------------------------------------------------------


def device_memo(state_dir: Path, metric: str, size: int = 1) -> KeyedMemo:
    """The memo of a device's metric, from the secret in its ledger on disk and the hash of
    the spec served."""
    secret = PrivacyLedger(state_dir, BudgetLimits(period_seconds=DAY)).device_secret
    return KeyedMemo(secret, spec_scope(spec_hash(served_spec(metric))), size)


@pytest.mark.slow
def test_same_value_same_permanent_response_across_restarts_and_processes(
    open_client: Callable[..., TelemetryClient], fake: FakeAggregator, state_root: Path
) -> None:
    """dbitflip reports are the permanent response itself: every report of the value is the
    same payload, from the first client, a restarted one and another process, and it is
    the one the ledger's secret gives (``KeyedMemo``). lgrr reports carry a fresh
    instantaneous response: 120 reports from each of the three fit the instantaneous law
    around the permanent response the secret gives (chi-square, P_FLOOR each; every cell
    expected 6 or more). That response is not the device's value (a state directory is
    drawn until it is not), so reports that re-drew it would not fit: against their law
    (one report's, GRR at epsilon_report) the chi-square's noncentrality is 420, its
    threshold at P_FLOOR 31 (false-failure rate below 1e-40)."""
    from scipy import stats  # here, not at the top: the child processes need no scipy

    lgrr = make_mechanism(spec_of("mem.sticky"))
    dbitflip = make_mechanism(spec_of("mem.dbitflip"))
    assert isinstance(lgrr, LongitudinalGRR) and isinstance(dbitflip, DBitFlip)
    metrics, value, runs = ("mem.sticky", "mem.dbitflip"), 1, 120
    for attempt in range(50):
        state = state_root / f"device-{attempt}"
        permanent = int(lgrr.permanent(np.array([value]), device_memo(state, "mem.sticky"))[0])
        if permanent != value:
            break
    assert permanent != value  # P(50 draws all kept) = 0.6^50
    memo = device_memo(state, "mem.dbitflip")
    expected_bits = dbitflip.to_payloads(
        dbitflip.encode(np.array([value]), context=DeviceContext(memo=memo))
    )[0]

    for _ in range(2):  # a client, then a restarted one on the same directory
        client = open_client(state, FakeClock())
        for _ in range(runs):
            for metric in metrics:
                client.record(metric, value)
        assert client.close(timeout=10.0)
    child = run_child(state, "repeat", runs)
    assert child.returncode == 0, child.stderr
    reports = fake.reports + json.loads(child.stdout.strip().splitlines()[-1])
    assert len(reports) == 3 * 2 * runs

    instant = grr_matrix(*lgrr.instantaneous_probabilities, lgrr.domain_size)
    for run in range(3):
        batch = reports[2 * runs * run : 2 * runs * (run + 1)]
        bits = [r["payload"] for r in batch if r["metric"] == "mem.dbitflip"]
        assert bits == [expected_bits] * runs
        values = [r["payload"]["value"] for r in batch if r["metric"] == "mem.sticky"]
        counts = np.bincount(values, minlength=lgrr.domain_size)
        assert stats.chisquare(counts, runs * instant[permanent]).pvalue > P_FLOOR, counts
        stateless = runs * lgrr.transition_matrix()[value]
        assert stats.chisquare(counts, stateless).pvalue < P_FLOOR, counts


def test_rappor_randomness_comes_from_the_spec_hash(
    open_client: Callable[..., TelemetryClient], fake: FakeAggregator, state_root: Path
) -> None:
    """A RAPPOR report's cohort and permanent bits are those of the secret
    ``rappor_secret(device secret, spec hash)`` = HMAC(device secret, label || spec hash)
    (here the instantaneous response is the identity, so a report is its PRR); a wrong
    secret would match three reports' cohorts and 16 bits each by chance with probability
    below 1e-12."""
    values = ["a.example", "b.example", "c.example"]
    limits = BudgetLimits(per_metric_per_period=16.0, period_seconds=DAY)
    client = open_client(state_root, FakeClock(), limits=limits)
    for value in values:
        client.record_string("str.prr", value)
    assert client.close(timeout=5.0)
    spec = served_spec("str.prr")
    mechanism = make_mechanism(spec.mechanism)
    assert isinstance(mechanism, Rappor)
    device = PrivacyLedger(state_root, BudgetLimits(period_seconds=DAY)).device_secret
    secret = rappor_secret(device, spec_hash(spec))
    cohort = mechanism.assign_cohort(secret)
    blooms = mechanism.bloom_packed(values, [cohort] * len(values))
    reports = np.zeros(len(values), dtype=mechanism.report_dtype)
    reports["cohort"] = cohort
    reports["bits"] = mechanism.permanent_response(blooms, secret)
    expected = mechanism.to_payloads(reports)
    assert [report["payload"] for report in fake.reports] == expected


def test_other_device_secrets_give_independent_permanent_responses(state_root: Path) -> None:
    """400 devices (state directories, each with its own secret): the permanent responses
    of two values of each device fit the product of the permanent law's rows (chi-square
    on the 4 x 4 table, every cell expected 7 or more, P_FLOOR): independent from device
    to device and from value to value, as the ledger's epsilon per distinct value needs."""
    from scipy import stats  # here, not at the top: the child processes need no scipy

    mechanism = make_mechanism(spec_of("mem.sticky"))
    assert isinstance(mechanism, LongitudinalGRR)
    devices, d = 400, mechanism.domain_size
    limits = BudgetLimits(period_seconds=DAY)
    secrets = [PrivacyLedger(state_root / f"d{i}", limits).device_secret for i in range(devices)]
    assert len(set(secrets)) == devices
    memo = KeyedMemo(secrets, spec_scope(spec_hash(served_spec("mem.sticky"))))
    first = mechanism.permanent(np.full(devices, 0), memo)
    second = mechanism.permanent(np.full(devices, 2), memo)
    table = np.zeros((d, d))
    np.add.at(table, (first, second), 1)
    law = mechanism.permanent_matrix()
    expected = devices * np.outer(law[0], law[2])
    assert expected.min() >= 5  # chi-square's usual validity rule
    assert stats.chisquare(table.ravel(), expected.ravel()).pvalue > P_FLOOR


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        sys.exit(child_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    pytest.exit("usage: test_memoized_reporting.py child STATE_DIR crash|repeat N")
