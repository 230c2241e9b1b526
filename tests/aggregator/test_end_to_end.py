"""End to end: real ``ldp-aggregator serve`` processes over loopback HTTP.

Covers the command line (demo metrics, a ``--config`` file and its versions, a bad
config, the first-start admin key), simulated devices whose published estimate is
checked against the truth, two worker processes behind one Prometheus endpoint, and
graceful shutdown with a batch in flight.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.mmap_dict import MmapedDict

from aggregator.registry import DEMO_METRICS
from shared.mechanisms import Mechanism, as_categorical, make_mechanism
from shared.schemas import MechanismSpec
from tests.support import ROOT, AggregatorProcess

#: Two-sided normal quantile whose tail is 1e-5: P(|Z| > 4.42) = 9.9e-6.
Z_STRICT = 4.42

StartServer = Callable[..., Any]


def new_reports(
    metric: str, version: int, mechanism: Mechanism, values: np.ndarray, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """Reports of ``values`` perturbed by ``mechanism`` (seeded), each with a fresh id."""
    payloads = mechanism.to_payloads(mechanism.encode(values, rng=rng))
    return [
        {"report_id": str(uuid.uuid4()), "metric": metric, "version": version, "payload": payload}
        for payload in payloads
    ]


def post_reports(server: Any, reports: list[dict[str, Any]]) -> dict[str, int]:
    """POST one batch as a device; the reply must be 200."""
    response = httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60.0,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def estimate(server: Any, metric: str, version: int | None = None) -> httpx.Response:
    params = {} if version is None else {"version": version}
    return httpx.get(
        f"{server.url}/v1/metrics/{metric}/estimate",
        params=params,
        headers=server.headers("analyst"),
        timeout=60.0,
    )


def counted(server: Any, metric: str, version: int | None = None) -> int:
    """Reports counted for a metric version; servers run with ``--min-reports 1``, so a 409
    (below the release threshold) means none."""
    response = estimate(server, metric, version)
    if response.status_code == 409:
        assert "holds 0 reports" in response.json()["detail"]
        return 0
    assert response.status_code == 200, response.text
    return int(response.json()["n"])


def grr(epsilon: float, domain_size: int) -> Mechanism:
    spec = {"mechanism": "grr", "epsilon": epsilon, "domain_size": domain_size}
    return make_mechanism(MechanismSpec.model_validate(spec))


# --- the command line ---------------------------------------------------------------------


@pytest.mark.slow
def test_serve_without_config_defines_the_demo_metrics(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(str(tmp_path / "demo.sqlite3"))
    response = httpx.get(f"{server.url}/v1/metrics")  # public: no key
    assert response.status_code == 200
    metrics = {item["name"]: item for item in response.json()}
    assert set(metrics) == set(DEMO_METRICS)
    for name, definition in DEMO_METRICS.items():
        assert metrics[name]["version"] == 1
        assert MechanismSpec.model_validate(metrics[name]["mechanism"]) == definition.mechanism
        expected = list(definition.labels) if definition.labels is not None else None
        assert metrics[name]["labels"] == expected


CONFIG = """
[metrics."checkout.step"]
description = "Furthest checkout step reached."
labels = ["cart", "address", "payment", "done"]

[metrics."checkout.step".mechanism]
mechanism = "grr"
epsilon = {epsilon}
domain_size = 4

[metrics."checkout.seconds"]
description = "Time to check out, clipped to 0..600 s."

[metrics."checkout.seconds".mechanism]
mechanism = "piecewise"
epsilon = 1.0
lower = 0.0
upper = 600.0
"""


@pytest.mark.slow
def test_config_defines_metrics_and_a_new_epsilon_makes_a_new_version(
    start_server: StartServer, tmp_path: Path
) -> None:
    database = str(tmp_path / "config.sqlite3")
    config = tmp_path / "metrics.toml"
    config.write_text(CONFIG.format(epsilon=1.0))
    rng = np.random.default_rng(41)
    old = grr(1.0, 4)

    server = start_server(database, "--config", str(config), "--min-reports", "1")
    listed = {m["name"]: m for m in httpx.get(f"{server.url}/v1/metrics").json()}
    assert set(listed) == {"checkout.step", "checkout.seconds"}  # no demo metrics
    assert listed["checkout.step"]["version"] == 1
    assert listed["checkout.step"]["labels"] == ["cart", "address", "payment", "done"]
    assert listed["checkout.seconds"]["mechanism"]["upper"] == 600.0
    reply = post_reports(server, new_reports("checkout.step", 1, old, rng.integers(0, 4, 120), rng))
    assert reply == {"accepted": 120, "duplicates": 0}
    server.stop()

    config.write_text(CONFIG.format(epsilon=2.0))
    server = start_server(database, "--config", str(config), "--min-reports", "1")
    listed = {m["name"]: m for m in httpx.get(f"{server.url}/v1/metrics").json()}
    assert listed["checkout.step"]["version"] == 2
    assert listed["checkout.step"]["mechanism"]["epsilon"] == 2.0
    assert listed["checkout.seconds"]["version"] == 1  # unchanged, so not re-versioned
    versions = httpx.get(f"{server.url}/v1/metrics/checkout.step/versions").json()
    assert [(v["version"], v["mechanism"]["epsilon"]) for v in versions] == [(1, 1.0), (2, 2.0)]

    # Devices still on version 1 keep reporting under it; new devices use version 2.
    post_reports(server, new_reports("checkout.step", 1, old, rng.integers(0, 4, 80), rng))
    post_reports(server, new_reports("checkout.step", 2, grr(2.0, 4), rng.integers(0, 4, 150), rng))

    first = estimate(server, "checkout.step", version=1).json()
    assert (first["version"], first["epsilon"], first["n"]) == (1, 1.0, 200)
    latest = estimate(server, "checkout.step").json()
    assert (latest["version"], latest["epsilon"], latest["n"]) == (2, 2.0, 150)
    assert [item["label"] for item in latest["estimates"]] == ["cart", "address", "payment", "done"]
    server.stop()

    # The same file again changes nothing.
    server = start_server(database, "--config", str(config), "--min-reports", "1")
    versions = httpx.get(f"{server.url}/v1/metrics/checkout.step/versions").json()
    assert [v["version"] for v in versions] == [1, 2]
    assert counted(server, "checkout.step", 1) == 200
    assert counted(server, "checkout.step", 2) == 150


BAD_CONFIGS = {
    "negative epsilon": (
        '[metrics."bad.metric"]\n[metrics."bad.metric".mechanism]\n'
        'mechanism = "grr"\nepsilon = -1.0\ndomain_size = 3\n',
        "mechanism.epsilon",
    ),
    "labels do not match the domain": (
        '[metrics."bad.metric"]\nlabels = ["a", "b", "c"]\n[metrics."bad.metric".mechanism]\n'
        'mechanism = "grr"\nepsilon = 1.0\ndomain_size = 4\n',
        "labels",
    ),
    "misspelt field": (
        '[metrics."bad.metric"]\n[metrics."bad.metric".mechanism]\n'
        'mechanism = "grr"\nepsilon = 1.0\ndomian_size = 4\n',
        "domian_size",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
@pytest.mark.slow
def test_a_bad_config_stops_the_start_with_a_clear_error(case: str, tmp_path: Path) -> None:
    text, field_name = BAD_CONFIGS[case]
    config = tmp_path / "metrics.toml"
    config.write_text(text)
    command = [sys.executable, "-m", "aggregator.cli", "serve", "--port", "0"]
    command += ["--database", str(tmp_path / "bad.sqlite3"), "--config", str(config)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "'bad.metric'" in result.stderr
    assert field_name in result.stderr
    assert str(config) in result.stderr


# --- the first-start admin key --------------------------------------------------------------

KEY_PATTERN = re.compile(r"ldp_[A-Za-z0-9_-]{20,}")


@pytest.fixture
def start_bare(tmp_path: Path) -> Iterator[Callable[[str, str], AggregatorProcess]]:
    """``start_bare(database, name)``: ``serve`` with no key in the environment, its output
    in ``name.out`` and its stderr in ``name.err`` (in ``tmp_path``); stopped after."""
    started: list[AggregatorProcess] = []

    def start(database: str, name: str) -> AggregatorProcess:
        server = AggregatorProcess(
            database, tmp_path / f"{name}.out", None, error_path=tmp_path / f"{name}.err"
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.mark.slow
def test_first_start_prints_an_admin_key_once(
    tmp_path: Path, start_bare: Callable[[str, str], AggregatorProcess]
) -> None:
    database = str(tmp_path / "keys.sqlite3")
    first = start_bare(database, "first")
    printed = KEY_PATTERN.findall((tmp_path / "first.err").read_text())
    assert len(printed) == 1, "the first start prints exactly one admin key on stderr"
    assert not KEY_PATTERN.search((tmp_path / "first.out").read_text())
    key = printed[0]

    listed = httpx.get(f"{first.url}/v1/keys", headers={"Authorization": f"Bearer {key}"})
    assert listed.status_code == 200
    assert [(k["role"], k["revoked_at"]) for k in listed.json()] == [("admin", None)]
    wrong = httpx.get(f"{first.url}/v1/keys", headers={"Authorization": f"Bearer {key}x"})
    assert wrong.status_code == 401
    first.stop()

    second = start_bare(database, "second")
    assert not KEY_PATTERN.search((tmp_path / "second.err").read_text())
    assert not KEY_PATTERN.search((tmp_path / "second.out").read_text())
    again = httpx.get(f"{second.url}/v1/keys", headers={"Authorization": f"Bearer {key}"})
    assert again.status_code == 200
    assert len(again.json()) == 1  # no second key was made
    created = httpx.post(
        f"{second.url}/v1/keys",
        json={"role": "device", "label": "phones"},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert created.status_code == 201


# --- simulated devices ----------------------------------------------------------------------


@pytest.mark.slow
def test_simulated_devices_are_estimated_within_their_confidence_intervals(
    start_server: StartServer, tmp_path: Path
) -> None:
    """20,000 devices with values from a known distribution report through OUE (eps = 2).

    OUE's per-category estimates are independent given the values (each bit of a report
    is drawn independently), unbiased and close to normal at n = 20,000 (each is a sum
    of 20,000 independent bits). The truth is the devices' empirical distribution. Checks
    and their false-failure rates: every category within 4.42 std (P(|Z| > 4.42) = 9.9e-6,
    about 1e-4 over d = 10), and at least 6 of the 10 published 95% intervals cover the
    truth (P(Binomial(10, 0.05) >= 5) = 6.4e-5). The server's estimate must also equal the
    one computed locally from the same reports (the fold is exact).
    """
    server = start_server(str(tmp_path / "devices.sqlite3"), "--min-reports", "1")
    spec = {"mechanism": "oue", "epsilon": 2.0, "domain_size": 10}
    labels = [f"item-{i}" for i in range(10)]
    defined = httpx.put(
        f"{server.url}/v1/metrics/sim.choice",
        json={"description": "simulated", "mechanism": spec, "labels": labels},
        headers=server.headers("admin"),
    )
    assert defined.status_code == 201, defined.text
    version = defined.json()["version"]
    mechanism = make_mechanism(MechanismSpec.model_validate(spec))

    n, d = 20_000, 10
    truth_p = np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01])
    rng = np.random.default_rng(20_241_122)
    values = rng.choice(d, size=n, p=truth_p)
    reports = mechanism.encode(values, rng=rng)
    payloads = mechanism.to_payloads(reports)
    with httpx.Client(headers=server.headers("device"), timeout=60.0) as client:
        for start in range(0, n, 1_000):
            batch = [
                {
                    "report_id": str(uuid.uuid4()),
                    "metric": "sim.choice",
                    "version": version,
                    "payload": payload,
                }
                for payload in payloads[start : start + 1_000]
            ]
            reply = client.post(f"{server.url}/v1/reports", json={"reports": batch})
            assert reply.json() == {"accepted": 1_000, "duplicates": 0}

    response = estimate(server, "sim.choice")
    assert response.status_code == 200, response.text
    published = response.json()
    assert (published["n"], published["version"], published["mechanism"]) == (n, version, "oue")
    frequency = np.array([item["frequency"] for item in published["estimates"]])
    std = np.array([item["std"] for item in published["estimates"]])
    low = np.array([item["ci_low"] for item in published["estimates"]])
    high = np.array([item["ci_high"] for item in published["estimates"]])
    assert [item["label"] for item in published["estimates"]] == labels

    categorical = as_categorical(mechanism)
    assert categorical is not None
    local = categorical.estimate(mechanism.aggregate(reports))
    np.testing.assert_allclose(frequency, local.frequencies, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(std, local.std, rtol=1e-12)

    truth = np.bincount(values, minlength=d) / n
    z = (frequency - truth) / std
    assert np.all(np.abs(z) < Z_STRICT), z
    covered = (low <= truth) & (truth <= high)
    assert covered.sum() >= 6, (covered, z)

    projected = np.array([item["frequency"] for item in published["postprocessed"]])
    assert np.all(projected >= 0) and projected.sum() == pytest.approx(1.0)


# --- operations -----------------------------------------------------------------------------


def _accepted_by_process(directory: Path) -> dict[str, float]:
    """``ldp_reports_accepted`` as each process recorded it in the multiprocess directory."""
    found: dict[str, float] = {}
    for path in directory.glob("counter_*.db"):
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            if '"ldp_reports_accepted_total"' in key:
                found[path.stem] = found.get(path.stem, 0.0) + value
    return found


def _scraped_total(server: Any) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r"^ldp_reports_accepted_total (\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


@pytest.mark.slow
def test_two_workers_serve_and_metrics_sum_over_processes(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Batches go out on fresh connections, a few at a time, until both workers have
    accepted some (the kernel hands connections to either worker). Every scrape of
    ``/metrics``, whichever worker answers it, must then report the sum of both."""
    samples = tmp_path / "prometheus"
    samples.mkdir()
    server = start_server(
        str(tmp_path / "workers.sqlite3"),
        "--workers",
        "2",
        env={"PROMETHEUS_MULTIPROC_DIR": str(samples)},
    )
    mechanism = grr(2.0, 3)
    rng = np.random.default_rng(7)
    total = 0
    for _ in range(50):
        batches = [
            new_reports("app.theme", 1, mechanism, rng.integers(0, 3, 50), rng) for _ in range(4)
        ]
        threads = [threading.Thread(target=post_reports, args=(server, b)) for b in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total += 200
        if sum(value > 0 for value in _accepted_by_process(samples).values()) >= 2:
            break
    by_process = _accepted_by_process(samples)
    assert sum(value > 0 for value in by_process.values()) >= 2, by_process
    assert sum(by_process.values()) == total
    for _ in range(6):
        assert _scraped_total(server) == total


@pytest.mark.slow
def test_sigterm_finishes_a_batch_in_flight_or_counts_nothing(
    start_server: StartServer, tmp_path: Path
) -> None:
    """SIGTERM arrives while a batch's body is still on the wire. The client then either
    gets 200 and the batch is counted, or sees the connection fail and nothing of the
    batch is counted, so that its retry (same ids) counts it exactly once."""
    database = str(tmp_path / "shutdown.sqlite3")
    server = start_server(database, "--min-reports", "1")
    rng = np.random.default_rng(11)
    reports = new_reports("app.theme", 1, grr(2.0, 3), rng.integers(0, 3, 5_000), rng)
    body = httpx.Request("POST", "/", json={"reports": reports}).read()
    half_sent, go_on = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def body_chunks() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        half_sent.set()
        go_on.wait(timeout=60)
        yield body[len(body) // 2 :]

    def upload() -> None:
        try:
            response = httpx.post(
                f"{server.url}/v1/reports",
                content=body_chunks(),
                headers={**server.headers("device"), "Content-Type": "application/json"},
                timeout=60.0,
            )
            outcome["response"] = response
        except httpx.TransportError as error:
            outcome["error"] = error
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["crash"] = error

    uploader = threading.Thread(target=upload)
    uploader.start()
    assert half_sent.wait(timeout=60)
    time.sleep(0.3)  # let the server read the headers and the first half
    os.killpg(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "Shutting down" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Shutting down" in server.log(), server.log()
    go_on.set()
    uploader.join(timeout=60)
    assert server.process.wait(timeout=60) is not None

    assert "crash" not in outcome, outcome
    assert len(outcome) == 1, outcome
    server = start_server(database, "--min-reports", "1")
    if "response" in outcome:
        response = outcome["response"]
        assert response.status_code == 200, response.text
        assert response.json() == {"accepted": 5_000, "duplicates": 0}
        assert counted(server, "app.theme") == 5_000
        assert post_reports(server, reports) == {"accepted": 0, "duplicates": 5_000}
    else:
        assert counted(server, "app.theme") == 0
        assert post_reports(server, reports) == {"accepted": 5_000, "duplicates": 0}
    assert counted(server, "app.theme") == 5_000
