"""Attack: publish a new RAPPOR version that only lowers ``f``, and compare the two memos.

A RAPPOR device's permanent randomized response (PRR) flips each Bloom bit to a fair coin
with probability f, from uniforms derived from its RAPPOR secret. A device that derived
that secret from the metric's name alone (HMAC(device secret, metric)) gave every version
of the metric the same uniforms: a version with f = 0.25 after one with f = 0.5 compared
the same uniforms against a lower threshold, so wherever the two PRRs differ the new one
is the true Bloom bit, and the two versions together reveal far more than either's
epsilon_infinity. The defence (``client.sdk.rappor_secret``): the secret is
HMAC(device secret, label || spec hash), a new one for every spec.

The devices here are real ``TelemetryClient``s, one state directory each, recording one
string under version 1 (f = 0.5) and then, once the server has replaced it, under version
2 (f = 0.25). The specs set p = 0 and q = 1, so the instantaneous response is the PRR
itself and every report shows its device's permanent bits; both specs stay within the
device's default limits per report and per value (epsilon_infinity 2 ln 3 and 2 ln 7).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from scipy import stats

from client import BudgetLimits, TelemetryClient
from client.specs import SPECS_FILE
from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec

DEVICES = 300
VALUE = "home.example"
#: Two reports of one metric in one period: above the default per-metric cap of 4 together.
LIMITS = BudgetLimits(per_metric_per_period=8.0, total_per_period=16.0)
#: False-failure rate of each statistical check.
P_FLOOR = 1e-6


def spec(f: float) -> dict[str, Any]:
    return {
        "mechanism": "rappor",
        "num_bits": 16,
        "num_hashes": 1,
        "num_cohorts": 8,
        "f": f,
        "p": 0.0,
        "q": 1.0,
    }


VERSIONS = {1: spec(0.5), 2: spec(0.25)}


class VersionServer:
    """Serves metric ``home`` at ``version``, and keeps every report it is sent."""

    def __init__(self) -> None:
        self.version = 1
        self.reports: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/metrics":
            served = {
                "name": "home",
                "version": self.version,
                "description": "home page",
                "mechanism": VERSIONS[self.version],
                "labels": [VALUE],
            }
            return httpx.Response(200, json=[served])
        if request.method == "POST" and request.url.path == "/v1/reports":
            batch = json.loads(request.content)["reports"]
            self.reports.extend(batch)
            return httpx.Response(200, json={"accepted": len(batch), "duplicates": 0})
        return httpx.Response(404)


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """In memory (``/dev/shm``) where the system has it, so that fsyncs cost microseconds."""
    memory = Path("/dev/shm")
    if not memory.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=memory, prefix="ldp-rappor-versions-") as directory:
        yield Path(directory)


def report_once(server: VersionServer, state: Path) -> None:
    """A device starts with no cached specs, records ``VALUE`` and delivers the report."""
    (state / SPECS_FILE).unlink(missing_ok=True)  # fetch the version served now
    with TelemetryClient(
        "http://versions.test",
        "device-key",
        state,
        limits=LIMITS,
        transport=httpx.MockTransport(server.handle),
        upload_interval=3600.0,
    ) as client:
        client.record_string("home", VALUE)
        assert client.flush(timeout=10.0)


def correct_bits(reports: list[dict[str, Any]], mechanism: Rappor) -> np.ndarray:
    """(devices, k) booleans: where each report (its PRR) equals its true Bloom bit."""
    decoded = mechanism.from_payloads([report["payload"] for report in reports])
    truth = mechanism.bloom_packed([VALUE] * len(reports), decoded["cohort"])
    bits = np.unpackbits(decoded["bits"], axis=1, bitorder="little")[:, : mechanism.num_bits]
    true = np.unpackbits(truth, axis=1, bitorder="little")[:, : mechanism.num_bits]
    return np.asarray(bits == true)


@pytest.mark.slow
def test_versions_differing_only_in_f_have_independent_permanent_responses(
    state_root: Path,
) -> None:
    """Over 300 devices x 16 bits (4,800 pairs of permanent bits, independent across
    devices and bit positions), whether each version's PRR bit is the true Bloom bit:

    * the 2 x 2 table of (version 1 true, version 2 true) fits the product of the two
      versions' laws, bit true with probability 1 - f/2 each (realized thresholds;
      chi-square with 3 degrees of freedom, P_FLOOR; every cell expected 150 or more);
    * where the two PRRs differ, version 2's bit is the true one in a share that is
      Binomial around what independence gives, 0.7 (two-sided exact test, P_FLOOR).
      With one secret for both versions it is 1: every difference gives the value away.
    """
    server = VersionServer()
    states = [state_root / f"device-{index:03d}" for index in range(DEVICES)]
    for version in VERSIONS:
        server.version = version
        for state in states:
            report_once(server, state)
    assert len(server.reports) == 2 * DEVICES
    by_version = {
        version: [report for report in server.reports if report["version"] == version]
        for version in VERSIONS
    }
    mechanisms: dict[int, Rappor] = {}
    for version, served in VERSIONS.items():
        mechanism = make_mechanism(MechanismSpec.model_validate(served))
        assert isinstance(mechanism, Rappor)
        mechanisms[version] = mechanism
    first, second = (
        correct_bits(by_version[version], mechanism) for version, mechanism in mechanisms.items()
    )
    p1, p2 = (1 - mechanism.realized_probabilities[0] for mechanism in mechanisms.values())

    table = np.array(
        [
            [np.sum(first & second), np.sum(first & ~second)],
            [np.sum(~first & second), np.sum(~first & ~second)],
        ]
    )
    law = np.outer([p1, 1 - p1], [p2, 1 - p2])
    expected = first.size * law
    assert expected.min() >= 150
    assert stats.chisquare(table.ravel(), expected.ravel()).pvalue > P_FLOOR, table

    differ = first != second
    second_true = int(np.sum(second & differ))
    share = law[1, 0] / (law[0, 1] + law[1, 0])
    assert share == pytest.approx(0.7, abs=1e-12)
    test = stats.binomtest(second_true, int(differ.sum()), share)
    assert test.pvalue > P_FLOOR, (second_true, int(differ.sum()))
