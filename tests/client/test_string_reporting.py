"""End to end, open-domain strings: devices ``record_string`` into a real aggregator.

100 ``TelemetryClient``s, each with its own state directory (its own ledger and device
secret), record strings for three metrics through ``record_string`` and upload over HTTP
to a real ``aggregator.cli serve`` process (fixture ``aggregator`` in ``conftest.py``):

* ``search.term``, a ``cms`` metric whose labels are the candidates it is estimated at
  (``GET /v1/metrics/{name}/estimate``);
* ``crash.process`` (``pem``) and ``typed.word`` (``sfp``), discovery metrics whose most
  frequent strings the aggregator finds without candidates
  (``GET /v1/metrics/{name}/heavy-hitters?k=3``).

Each device records the same ten values to each metric: "fig" four times, "né" and "oak"
three times each (shares 0.4, 0.3, 0.3, in every device and so in every pem group). A
transport that forwards to the aggregator keeps each device's uploads, so the test sees
what went over the wire: each pem device reported in one group, the same after a restart
of the client. Each device's ledger charged ``epsilon`` per report (one-shot mechanisms).

Tolerances, total false-failure probability below 1e-6:

* cms: given the one public hash, the estimate of a candidate s is
  (Z(s)/n - kappa) / (1 - kappa) with Z(s) a sum of n independent reports' contributions,
  report i's having mean pi_i (the share of sketch rows where its string's column is s's)
  and variance s0 + s1 pi_i - pi_i^2 (``shared.mechanisms.sketch``). Its exact mean and
  standard deviation are computed here from the hash, and the estimate must lie within
  z sd, z the normal quantile of a two-sided 5e-8 per candidate (5 candidates; n = 1,000
  bounded terms, the normal approximation): 2.5e-7.
* pem: the three strings are found if every estimate of a level is on the right side of
  0.1: theirs (>= 0.3) above, every other prefix's (frequency 0) below. With group sizes
  binomial over the 100 devices (Bin(100, 1/3) devices of ten reports each) and the OLH
  variance (q (1 - q) / (p - q)^2 + f (1 - p - q) / (p - q)) / n_j at epsilon 6, the union
  bound over the three groups, the three strings and 256 x 6 candidate prefixes per level
  gives a failure probability below 1e-8.
* sfp: each of its three sketches (whole strings, fragment positions 0 and 1) gets at
  least 250 of the 1,000 reports but with probability 1.3e-8. Then every true fragment
  (share >= 0.3) is over 12 sd above the fragment threshold (4.76 sigma_0 = 0.085), and
  in the whole-string sketch the three strings' estimates (sd <= 0.031) and every other
  candidate's (frequency 0, sd <= 0.018) fall on their sides of 0.12 but with probability
  below 1e-8 (a few dozen candidates at most).
* The heavy hitters' frequencies are then checked within ``HEAVY_Z`` = 5.6 of their stated
  std (the plug-in std at the estimate; two-sided 2.1e-8 each, six of them).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from scipy import stats

from client import BudgetLimits, RetryPolicy, SpecError, TelemetryClient
from client.sdk import tls_context
from shared.mechanisms import make_mechanism
from shared.mechanisms.sketch import SketchMechanism
from shared.schemas import MechanismSpec

DEVICES = 100
#: What each device records to each metric (in this order).
VALUES = ["fig"] * 4 + ["né"] * 3 + ["oak"] * 3
CMS, PEM, SFP = "search.term", "crash.process", "typed.word"
SPECS: dict[str, dict[str, Any]] = {
    CMS: {"mechanism": "cms", "epsilon": 4.0, "sketch_width": 256, "sketch_depth": 16},
    PEM: {"mechanism": "pem", "epsilon": 6.0, "max_length": 3},
    SFP: {
        "mechanism": "sfp",
        "epsilon": 6.0,
        "max_length": 3,
        "sketch_width": 256,
        "sketch_depth": 16,
    },
}
#: The cms metric's labels: the candidates it is estimated at by default.
CANDIDATES = ["fig", "né", "oak", "elm", "yew"]
LIMITS = BudgetLimits(per_metric_per_period=1e3, total_per_period=1e4, max_epsilon_per_report=6.0)
#: Per-candidate two-sided false-failure probability of the cms check.
CANDIDATE_ALPHA = 5e-8
#: The normal quantile heavy hitters' frequencies are checked at (two-sided 2.1e-8).
HEAVY_Z = 5.6


class RecordingTransport(httpx.HTTPTransport):
    """Forwards every request to the aggregator and keeps the reports it uploads."""

    def __init__(self) -> None:
        super().__init__(verify=tls_context())  # built once per process, not per device
        self.reports: list[dict[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/reports":
            self.reports.extend(json.loads(request.content)["reports"])
        return super().handle_request(request)


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """Where the devices' state directories go: in memory (``/dev/shm``) where the system
    has it, so that the ledgers' fsyncs cost microseconds; else ``tmp_path``."""
    memory = Path("/dev/shm")
    if not memory.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=memory, prefix="ldp-strings-test-") as directory:
        yield Path(directory)


def open_client(aggregator: Any, state: Path, transport: httpx.BaseTransport) -> TelemetryClient:
    return TelemetryClient(
        aggregator.url,
        aggregator.keys["device"],
        state,
        limits=LIMITS,
        batch_size=64,
        upload_interval=3600.0,  # batches go when 64 reports wait, and at flush
        retry=RetryPolicy(base=0.05, cap=1.0),
        transport=transport,
    )


def run_device(aggregator: Any, state: Path, metrics: list[str]) -> dict[str, Any]:
    """One device records ``VALUES`` to each metric and uploads; what it sent and spent."""
    transport = RecordingTransport()
    with open_client(aggregator, state, transport) as client:
        for metric in metrics:
            for value in VALUES:
                client.record_string(metric, value)
        delivered = client.flush(timeout=60.0)
        status = client.budget()
    # What is reserved but unused is counted as spent until close, and shown as reserved.
    used = sum(status.spent_per_metric[metric] for metric in metrics) - status.reserved
    return {"delivered": delivered, "used": used, "reports": transport.reports}


def groups_of(reports: list[dict[str, Any]], metric: str) -> set[int]:
    return {report["payload"]["group"] for report in reports if report["metric"] == metric}


def get(aggregator: Any, path: str, **params: Any) -> dict[str, Any]:
    response = httpx.get(
        f"{aggregator.url}{path}", params=params, headers=aggregator.headers("analyst"), timeout=60
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def sketch_moments(
    mechanism: SketchMechanism, counts: dict[str, int], candidate: str
) -> tuple[float, float]:
    """Exact mean and standard deviation of the sketch's estimate of ``candidate`` given its
    public hash, when ``counts[u]`` reports hold string u (module docstring)."""
    strings = list(counts)
    fingerprints = mechanism.hash.fingerprints([s.encode() for s in [candidate, *strings]])
    columns = np.stack(
        [
            mechanism.hash.positions(fingerprints, np.full(len(fingerprints), row))
            for row in range(mechanism.depth)
        ]
    )
    shared_rows = (columns[:, 1:] == columns[:, :1]).mean(axis=0)  # pi of each string
    reports = np.array([counts[s] for s in strings], dtype=np.float64)
    n, kappa = reports.sum(), mechanism.kappa
    s0, s1 = mechanism.report_moments
    mean = ((reports * shared_rows).sum() / n - kappa) / (1 - kappa)
    variance = (reports * (s0 + s1 * shared_rows - shared_rows**2)).sum()
    return float(mean), math.sqrt(variance) / (n * (1 - kappa))


@pytest.mark.slow
def test_strings_are_estimated_and_discovered_end_to_end(aggregator: Any, state_root: Path) -> None:
    for name, spec in SPECS.items():
        labels = CANDIDATES if name == CMS else None
        aggregator.define(name, {"mechanism": spec, "labels": labels})
    metrics = list(SPECS)
    with ThreadPoolExecutor(max_workers=4) as pool:
        devices = list(
            pool.map(
                lambda d: run_device(aggregator, state_root / f"device-{d:03d}", metrics),
                range(DEVICES),
            )
        )
    charge = len(VALUES) * sum(spec["epsilon"] for spec in SPECS.values())
    for device in devices:
        assert device["delivered"]
        assert device["used"] == pytest.approx(charge, rel=1e-12)  # epsilon per report
        assert len(groups_of(device["reports"], PEM)) == 1  # one group for life

    counts = {value: DEVICES * times for value, times in Counter(VALUES).items()}
    n = DEVICES * len(VALUES)

    cms = get(aggregator, f"/v1/metrics/{CMS}/estimate")
    assert (cms["kind"], cms["n"]) == ("string", n)
    mechanism = make_mechanism(MechanismSpec.model_validate(SPECS[CMS]))
    assert isinstance(mechanism, SketchMechanism)
    z = float(stats.norm.isf(CANDIDATE_ALPHA / 2))
    assert [item["string"] for item in cms["candidates"]] == CANDIDATES
    for item in cms["candidates"]:
        mean, sd = sketch_moments(mechanism, counts, item["string"])
        assert abs(item["frequency"] - mean) <= z * sd, (item, mean, sd)

    for name in (PEM, SFP):
        found = get(aggregator, f"/v1/metrics/{name}/heavy-hitters", k=3)
        assert (found["kind"], found["n"], found["k"]) == ("heavy-hitters", n, 3)
        hitters = found["heavy_hitters"]
        assert {item["string"] for item in hitters} == set(counts), hitters
        for item in hitters:
            truth = counts[item["string"]] / n
            assert abs(item["frequency"] - truth) <= HEAVY_Z * item["std"], item

    # A device keeps its pem group across restarts of its client (the group comes from
    # its secret): twelve devices record once more, each with a fresh client object.
    # Were groups drawn afresh, all twelve would agree by chance with probability 3^-12.
    for index, device in enumerate(devices[:12]):
        transport = RecordingTransport()
        with open_client(aggregator, state_root / f"device-{index:03d}", transport) as client:
            client.record_string(PEM, "fig")
            assert client.flush(timeout=60.0)
        assert groups_of(transport.reports, PEM) == groups_of(device["reports"], PEM)


@pytest.mark.slow
def test_bad_strings_are_refused_before_anything_is_spent(aggregator: Any, tmp_path: Path) -> None:
    aggregator.define(PEM, {"mechanism": SPECS[PEM]})
    aggregator.define(CMS, {"mechanism": SPECS[CMS]})
    with open_client(aggregator, tmp_path / "device", RecordingTransport()) as client:
        client.record_string(PEM, "fig")
        before = client.budget().spent_per_metric
        refusals: list[tuple[str, Any, type[Exception], str]] = [
            (PEM, "figs", ValueError, "max_length of 3"),  # 4 UTF-8 bytes
            (PEM, "né!", ValueError, "max_length of 3"),  # 3 characters, 4 bytes
            (PEM, "\ud800", ValueError, "not valid Unicode"),
            (PEM, b"fig", TypeError, "bytes"),
            (CMS, 12, TypeError, "int"),
        ]
        for metric, value, error, message in refusals:
            with pytest.raises(error, match=message):
                client.record_string(metric, value)
        with pytest.raises(SpecError, match="use record_string"):
            client.record(CMS, "fig")
        with pytest.raises(SpecError, match="use record_string"):
            client.record(PEM, 1)
        assert client.budget().spent_per_metric == before
        assert client.queued == 1
