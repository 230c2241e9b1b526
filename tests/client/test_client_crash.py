"""Crash safety: a device process killed with SIGKILL while it records and uploads.

A child process (this file run as a script: ``python test_client_crash.py child ...``)
embeds ``TelemetryClient`` with its own state directory and small ``BudgetLimits``,
records values in cycles (record a few, then flush) and appends one line per report to
a log file *after* ``record`` returned. The test kills it at seeded random moments, in a
record phase or an upload phase, restarts it on the same state directory, and at the
end runs it once more to spend the rest of the budget and flush. Then:

* every logged report was counted by the aggregator, and none twice: for each metric
  ``logged <= n``, and ``n_total <= logged_total + kills`` (a report whose ``record``
  was cut short by the kill may or may not exist: at most one per kill, since the child
  records from one thread);
* the ledger never exceeded a cap, after any kill and at the end, and the epsilon of the
  reports the aggregator counted is within what the ledger debited (every report was
  paid for before it existed); the caps bound: the final run was refused by them.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import BudgetExhaustedError, BudgetLimits, RetryPolicy, TelemetryClient
from client.ledger import PrivacyLedger

#: Many cheap reports (most of the traffic) and a few dear ones.
TAP, MODE = "crash.tap", "crash.mode"
TAP_EPSILON, MODE_EPSILON = 0.01, 0.5
DEFINITIONS = {
    TAP: {
        "description": "crash test: cheap reports",
        "mechanism": {"mechanism": "grr", "epsilon": TAP_EPSILON, "domain_size": 4},
        "labels": ["a", "b", "c", "d"],
    },
    MODE: {
        "description": "crash test: dear reports",
        "mechanism": {"mechanism": "grr", "epsilon": MODE_EPSILON, "domain_size": 3},
        "labels": ["x", "y", "z"],
    },
}
#: Small enough to bind: MODE is refused after 6 reports in a period (its own cap), TAP
#: when the period's total reaches 5 (at most 200 TAP reports beside 6 MODE ones).
LIMITS = BudgetLimits(
    per_metric_per_period=3.0,
    total_per_period=5.0,
    lifetime=50.0,
    period_seconds=86_400.0,
    max_epsilon_per_report=1.0,
)
#: Slack for sums of epsilons in floating point (the ledger's own is 1e-12).
SLACK = 1e-9
KILLED_RUNS = 6
CYCLES = 8  # per killed run: each cycle records PER_CYCLE values, then flushes
PER_CYCLE = 8
SEED = 5_2026


# --- the child process ----------------------------------------------------------------------


def child_main(endpoint: str, api_key: str, state_dir: str, log_path: str, final: bool) -> int:
    """Record in cycles (``record c`` / ``upload c`` markers on stdout); the final run spends
    the budget until both metrics are refused, flushes and prints the budget as JSON."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    client = TelemetryClient(
        endpoint,
        api_key,
        state_dir,
        limits=LIMITS,
        batch_size=8,  # background uploads run while records are made
        upload_interval=0.1,
        retry=RetryPolicy(base=0.02, cap=0.2),
    )
    refused: set[str] = set()

    def record(step: int) -> None:
        metric = MODE if step % PER_CYCLE == 3 else TAP
        try:
            client.record(metric, step % (3 if metric == MODE else 4))
        except BudgetExhaustedError:
            refused.add(metric)
            os.write(log, f"refused {metric}\n".encode())
            return
        os.write(log, f"{metric}\n".encode())  # only once record() has returned

    if not final:
        for cycle in range(CYCLES):
            print(f"record {cycle}", flush=True)
            for k in range(PER_CYCLE):
                record(k)
            print(f"upload {cycle}", flush=True)
            client.flush(timeout=30.0)
        print("done", flush=True)
        return 0
    step = 0
    while refused != {TAP, MODE} and step < 10_000:
        record(step)
        step += 1
    delivered = client.flush(timeout=60.0)
    status = client.budget()
    queued = client.queued
    client.close()
    summary = {
        "delivered": delivered,
        "queued": queued,
        "refused": sorted(refused),
        "spent_per_metric": status.spent_per_metric,
        "spent_this_period": status.spent_this_period,
        "spent_lifetime": status.spent_lifetime,
        "reserved": status.reserved,
    }
    print(json.dumps(summary), flush=True)
    return 0


# --- the test -------------------------------------------------------------------------------


def assert_within_caps(spent: dict[str, float], this_period: float, lifetime: float) -> None:
    for metric, value in spent.items():
        assert value <= LIMITS.per_metric_per_period + SLACK, (metric, value)
    assert this_period <= LIMITS.total_per_period + SLACK
    assert lifetime <= LIMITS.lifetime + SLACK


def start_child(aggregator: Any, state: Path, log: Path, stderr: Any, final: bool) -> Any:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "child",
        aggregator.url,
        aggregator.keys["device"],
        str(state),
        str(log),
        "final" if final else "run",
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=Path(__file__).parents[2]
    )


def counter(exposition: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", exposition, flags=re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_kill_nine_during_record_and_upload(aggregator: Any, tmp_path: Path) -> None:
    """Seeded random SIGKILLs of a recording, uploading device; see the module docstring."""
    for name, definition in DEFINITIONS.items():
        aggregator.define(name, definition)
    state, log = tmp_path / "device", tmp_path / "created.log"
    rng = random.Random(SEED)
    kills = 0
    phases: list[str] = []
    with (tmp_path / "child.stderr").open("w") as stderr:
        for _ in range(KILLED_RUNS):
            phase, cycle = rng.choice(["record", "upload"]), rng.randrange(5)
            delay = rng.uniform(0.0, 0.005)
            child = start_child(aggregator, state, log, stderr, final=False)
            assert child.stdout is not None
            for line in child.stdout:
                if line.strip() == f"{phase} {cycle}":
                    time.sleep(delay)
                    if child.poll() is None:
                        child.send_signal(signal.SIGKILL)
                        kills += 1
                        phases.append(phase)
                    break
            child.wait(timeout=60)
            assert child.returncode in (0, -signal.SIGKILL), (tmp_path / "child.stderr").read_text()
            # The ledger survives every kill, readable and within every cap.
            status = PrivacyLedger(state, LIMITS).status()
            assert_within_caps(
                status.spent_per_metric, status.spent_this_period, status.spent_lifetime
            )

        final = start_child(aggregator, state, log, stderr, final=True)
        out, _ = final.communicate(timeout=120)
    assert final.returncode == 0, (tmp_path / "child.stderr").read_text()
    summary = json.loads(out.strip().splitlines()[-1])

    lines = log.read_text().splitlines()
    logged = {metric: lines.count(metric) for metric in (TAP, MODE)}
    n = {metric: aggregator.count(metric) for metric in (TAP, MODE)}
    exposition = aggregator.prometheus()
    accepted = counter(exposition, "ldp_reports_accepted_total")
    duplicates = counter(exposition, "ldp_reports_duplicate_total")
    context = f"kills={kills} {phases} logged={logged} n={n} duplicates={duplicates}"

    assert kills == KILLED_RUNS, context
    assert summary["delivered"] and summary["queued"] == 0, summary
    # Exactly once: every report that record() returned for is counted, none twice.
    for metric in (TAP, MODE):
        assert logged[metric] <= n[metric], context
    assert sum(n.values()) <= sum(logged.values()) + kills, context
    assert accepted == sum(n.values()), context  # the server never restarted: all it took

    # The caps held throughout and bound at the end: the final run was refused by them.
    assert summary["refused"] == [MODE, TAP], summary
    assert_within_caps(
        summary["spent_per_metric"], summary["spent_this_period"], summary["spent_lifetime"]
    )
    ledger = PrivacyLedger(state, LIMITS).status()  # after close: no reservation left
    assert_within_caps(ledger.spent_per_metric, ledger.spent_this_period, ledger.spent_lifetime)
    for metric, epsilon in ((TAP, TAP_EPSILON), (MODE, MODE_EPSILON)):
        room = min(
            LIMITS.per_metric_per_period - ledger.spent_per_metric[metric],
            LIMITS.total_per_period - ledger.spent_this_period,
            LIMITS.lifetime - ledger.spent_lifetime,
        )
        assert room < epsilon + SLACK, (metric, ledger)  # one more report would exceed a cap
    # Every counted report was paid for: its epsilon is within what the ledger debited
    # (the rest was reserved by a killed process and lost, never spent twice).
    assert n[TAP] * TAP_EPSILON <= ledger.spent_per_metric[TAP] + SLACK, context
    assert n[MODE] * MODE_EPSILON <= ledger.spent_per_metric[MODE] + SLACK, context
    assert n[TAP] * TAP_EPSILON + n[MODE] * MODE_EPSILON <= ledger.spent_lifetime + SLACK


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "child":
        endpoint, api_key, state_dir, log_path, kind = sys.argv[2:]
        sys.exit(child_main(endpoint, api_key, state_dir, log_path, final=kind == "final"))
    pytest.exit("usage: test_client_crash.py child ENDPOINT KEY STATE_DIR LOG run|final")
