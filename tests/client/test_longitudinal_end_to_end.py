"""End to end, repeated collection: 2,000 devices report a drifting value daily for 30 days.

500 of the devices are ``TelemetryClient``s, each with its own state directory (its own
ledger and device secret, so its own permanent responses), recording through ``record``
with their clocks injected one simulated day at a time, and uploading over HTTP to a real
``aggregator.cli serve`` process (fixture ``aggregator`` in ``conftest.py``). The other
1,500 take the SDK's mechanism path without its ledger and outbox: the same
``encode(values, memo=KeyedMemo(secret, spec_scope(spec_hash(spec))))`` with a random
32-byte secret per device, the same payloads, posted over HTTP a day at a time. (2,000
SDK devices cost 35 s of the device side's CPU alone, about 17 ms per device for its 30
records, uploads and state; 500 keep the test near 10 s.)
The SDK devices report in the first hour of each day and the others in the second, so
the aggregator's estimate of a day's first hour is the SDK devices' alone.

The aggregator estimates each window on its own (``estimate?start=&end=``): every day's
first hour and every whole day must match that window's truth; and each SDK device's
ledger charges ``epsilon`` per distinct value it reported for life and ``epsilon_report``
for the day.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from scipy import stats

from client import BudgetLimits, RetryPolicy, TelemetryClient
from client.sdk import random_uuid4
from client.specs import SPECS_FILE
from shared.mechanisms import DeviceContext, make_mechanism
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.memo import KeyedMemo, spec_scope
from shared.schemas import MechanismSpec, MetricSpec
from shared.spec_hash import spec_hash

DEVICES = 2_000
#: Devices that are ``TelemetryClient``s (the first ones); the others post through the
#: mechanism (module docstring).
SDK_DEVICES = 500
DAYS = 30
DAY = 86_400
#: Share of the devices whose value changes each day.
DRIFT = 0.10
METRIC = "app.daily_mode"
LABELS = ["reading", "writing", "browsing", "idle"]
EPSILON, EPSILON_REPORT = 2.0, 1.0
MECHANISM = {
    "mechanism": "lgrr",
    "epsilon": EPSILON,
    "epsilon_report": EPSILON_REPORT,
    "domain_size": len(LABELS),
}
#: Total false-failure probability of the accuracy checks (union bound over every window
#: and category).
DELTA = 1e-6


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """Where the devices' state directories go: in memory (``/dev/shm``) where the system
    has it, so that 2,000 ledgers' fsyncs cost microseconds; else ``tmp_path``."""
    memory = Path("/dev/shm")
    if not memory.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=memory, prefix="ldp-client-test-") as directory:
        yield Path(directory)


def drifting_values(rng: np.random.Generator) -> np.ndarray:
    """(DEVICES, DAYS) category indices: day 0 skewed, then each day a random DRIFT share
    of the devices moves to another value, uniform among the other d - 1."""
    d = len(LABELS)
    values = np.empty((DEVICES, DAYS), dtype=np.int64)
    values[:, 0] = rng.choice(d, size=DEVICES, p=[0.55, 0.25, 0.15, 0.05])
    for day in range(1, DAYS):
        values[:, day] = values[:, day - 1]
        movers = rng.choice(DEVICES, size=round(DRIFT * DEVICES), replace=False)
        values[movers, day] = (values[movers, day] + rng.integers(1, d, size=movers.size)) % d
    return values


class DeviceClock:
    """One device's wall clock: ``minute`` seconds into the first hour of simulated day t."""

    def __init__(self, origin: float, minute: float) -> None:
        self.origin, self.minute, self.day = origin, minute, 0

    def __call__(self) -> float:
        return self.origin + self.day * DAY + self.minute


def run_device(
    url: str,
    key: str,
    state: Path,
    specs: list[dict[str, Any]],
    clock: DeviceClock,
    days: list[int],
) -> dict[str, Any]:
    """One device: its app had fetched the metric list before (``specs.json``, so nothing
    is asked of the aggregator while the clock is in the past), then it records its value
    every day, uploads, and says what its ledger charged."""
    state.mkdir()
    (state / SPECS_FILE).write_text(json.dumps(specs), encoding="utf-8")
    with TelemetryClient(
        url,
        key,
        state,
        limits=BudgetLimits(period_seconds=DAY),
        batch_size=64,  # more than DAYS: the reports go at flush, in one batch
        upload_interval=3600.0,
        retry=RetryPolicy(base=0.05, cap=1.0),
        clock=clock,
    ) as client:
        for day, value in enumerate(days):
            clock.day = day
            client.record(METRIC, LABELS[value])
        status = client.budget()
        return {
            "delivered": client.flush(timeout=60.0),
            "lifetime": status.lifetime_per_metric.get(METRIC),
            "values": status.memoized_values_per_metric.get(METRIC),
            "today": status.spent_per_metric.get(METRIC),
        }


def count_tail(count: int, truth: int, n: int, p: float, q: float) -> float:
    """Exact P(|C - E C| >= |count - E C|) for C = Bin(truth, p) + Bin(n - truth, q): the
    law of a category's report count given its true count (independent devices, each
    reporting it with probability p if it holds it, q if not)."""
    law = np.convolve(
        stats.binom.pmf(np.arange(truth + 1), truth, p),
        stats.binom.pmf(np.arange(n - truth + 1), n - truth, q),
    )
    mean = truth * p + (n - truth) * q
    deviation = np.abs(np.arange(n + 1) - mean)
    return float(law[deviation >= abs(count - mean) - 1e-9].sum())


def post_day(aggregator: Any, reports: list[dict[str, Any]], version: int, hour: float) -> None:
    """Post one day's reports of the devices outside the SDK, as a device would."""
    stamp = datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:00:00Z")
    body = {
        "reports": [
            {
                "report_id": random_uuid4(),
                "metric": METRIC,
                "version": version,
                "payload": payload,
                "time": stamp,
            }
            for payload in reports
        ]
    }
    response = httpx.post(
        f"{aggregator.url}/v1/reports",
        json=body,
        headers=aggregator.headers("device"),
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": len(reports), "duplicates": 0}


def window_estimate(aggregator: Any, version: int, start: float, end: float) -> dict[str, Any]:
    """``GET /v1/metrics/{METRIC}/estimate`` over [start, end) (unix seconds)."""
    response = httpx.get(
        f"{aggregator.url}/v1/metrics/{METRIC}/estimate",
        params={
            "version": version,
            "start": datetime.fromtimestamp(start, UTC).isoformat(),
            "end": datetime.fromtimestamp(end, UTC).isoformat(),
        },
        headers=aggregator.headers("analyst"),
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_two_thousand_devices_report_daily_for_thirty_days(
    aggregator: Any, state_root: Path
) -> None:
    """Per-window estimates match each window's truth, and every ledger charged the truth.

    Time: the simulated days are the 30 days before now (the aggregator refuses future
    hours and keeps duplicate ids 30 days), day t the window [origin + t days, origin +
    t + 1 days). An SDK device records on day t a few minutes into the day's first hour,
    so its report carries that hour, and its ledger (created on day 0) is in period t.

    Tolerance: given a window's true counts, a category's report count is exactly
    Bin(n_v, p) + Bin(n - n_v, q) (devices independent, their permanent responses too;
    p and q the mechanism's realized one-report probabilities), whose two-sided tail at
    the observed count is computed exactly (``count_tail``); each of the 30 x 2 x 4
    checks fails with probability at most DELTA / 240, all together at most DELTA = 1e-6.
    """
    stored = aggregator.define(
        METRIC,
        {"description": "what the device did most today", "mechanism": MECHANISM, "labels": LABELS},
    )
    version = stored["version"]
    specs = aggregator.metrics()
    mechanism = make_mechanism(MechanismSpec.model_validate(MECHANISM))
    assert isinstance(mechanism, LongitudinalGRR)
    values = drifting_values(np.random.default_rng(20261124))

    now = time.time()
    origin = math.floor(now / 3600) * 3600 - (DAYS - 1) * DAY - 12 * 3600
    assert now - 30 * DAY < origin and origin + (DAYS - 1) * DAY + 3600 <= now
    key = aggregator.keys["device"]

    def sdk_device(index: int) -> dict[str, Any]:
        clock = DeviceClock(origin, 60.0 + index % 3000)
        state = state_root / f"device-{index:04d}"
        return run_device(aggregator.url, key, state, specs, clock, values[index].tolist())

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(sdk_device, range(SDK_DEVICES)))

    others = values[SDK_DEVICES:]
    served = MetricSpec.model_validate(next(item for item in specs if item["name"] == METRIC))
    memo = KeyedMemo([os.urandom(32) for _ in others], spec_scope(spec_hash(served)))
    for day in range(DAYS):
        payloads = mechanism.to_payloads(
            mechanism.encode(others[:, day], context=DeviceContext(memo=memo))
        )
        post_day(aggregator, payloads, version, origin + day * DAY + 3600)

    # Every SDK ledger: epsilon per distinct value for life, epsilon_report for the day.
    distinct = [len(set(row)) for row in values[:SDK_DEVICES].tolist()]
    for outcome, charged in zip(outcomes, distinct, strict=True):
        assert outcome["delivered"] is True
        assert outcome["values"] == charged
        assert outcome["lifetime"] == charged * EPSILON
        assert outcome["today"] == EPSILON_REPORT

    p, q, d = mechanism.p, mechanism.q, mechanism.domain_size
    checks = DAYS * 2 * d
    for day in range(DAYS):
        start = origin + day * DAY
        for devices, end in ((SDK_DEVICES, start + 3600), (DEVICES, start + DAY)):
            published = window_estimate(aggregator, version, start, end)
            assert published["n"] == devices, (day, devices)
            truth = np.bincount(values[:devices, day], minlength=d)
            for v, item in enumerate(published["estimates"]):
                count = devices * (item["frequency"] * (p - q) + q)
                assert abs(count - round(count)) < 1e-6
                tail = count_tail(round(count), int(truth[v]), devices, p, q)
                assert tail >= DELTA / checks, (day, devices, v, item, truth[v] / devices)
