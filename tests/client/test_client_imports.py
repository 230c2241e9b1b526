"""The client package stays light: no server-side library is imported, at import or in use.

Each check runs in a fresh interpreter, so that what the test process itself has
imported (the aggregator's tests import FastAPI, SQLAlchemy, SciPy) cannot hide or fake
an import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SERVER_SIDE = ("fastapi", "sqlalchemy", "scipy", "uvicorn", "starlette")
ROOT = Path(__file__).resolve().parents[2]

_REPORT = f"""
import json, sys
heavy = sorted({{name.split(".")[0] for name in sys.modules}} & set({SERVER_SIDE!r}))
print(json.dumps(heavy))
"""

_IMPORT_ONLY = "import client\nfrom client import TelemetryClient, BudgetLimits\n" + _REPORT

_IN_USE = (
    """
import json, tempfile
import httpx
from client import TelemetryClient

METRICS = [
    {"name": m, "version": 1, "mechanism": {"mechanism": m, "epsilon": 1.0, "domain_size": 4}}
    for m in ("grr", "oue", "sue", "olh", "hr", "auto")
]
METRICS += [
    {"name": m, "version": 1, "mechanism": {"mechanism": m, "epsilon": 1.0, "lower": 0, "upper": 1}}
    for m in ("laplace", "duchi", "piecewise")
]
METRICS.append({"name": "rappor", "version": 1, "mechanism": {
    "mechanism": "rappor", "num_bits": 16, "num_hashes": 1, "num_cohorts": 4,
    "f": 0.5, "p": 0.25, "q": 0.75}})

def handle(request):
    if request.url.path == "/v1/metrics":
        return httpx.Response(200, json=METRICS)
    count = len(json.loads(request.content)["reports"])
    return httpx.Response(200, json={"accepted": count, "duplicates": 0})

with tempfile.TemporaryDirectory() as state:
    client = TelemetryClient("http://aggregator.test", "key", state,
                             transport=httpx.MockTransport(handle), upload_interval=3600)
    for item in METRICS:
        name = item["name"]
        if name == "rappor":
            client.record_string(name, "example.com")
        elif "domain_size" in item["mechanism"]:
            client.record(name, 3)
        else:
            client.record(name, 0.5)
    client.budget()
    assert client.queued == len(METRICS)
    assert client.close(timeout=10) is True
"""
    + _REPORT
)


def _server_side_modules(code: str) -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_the_client_imports_no_server_side_library() -> None:
    assert _server_side_modules(_IMPORT_ONLY) == []


@pytest.mark.slow
def test_recording_with_every_mechanism_imports_no_server_side_library() -> None:
    assert _server_side_modules(_IN_USE) == []


@pytest.mark.slow
def test_the_check_sees_a_server_side_import() -> None:
    """The probe itself works: it does report a library that was imported."""
    assert _server_side_modules("import client, starlette\n" + _REPORT) == ["starlette"]


_FEDERATED_IN_USE = (
    """
import base64, json
import httpx, numpy as np
from client import FederatedClient
from shared.federated.task import TaskConfig

CONFIG = TaskConfig.model_validate({
    "model": {"kind": "mlp", "num_features": 3, "num_classes": 2, "hidden": 4},
    "mode": "local", "rounds": 5, "population": 10, "clients_per_round": 10,
    "noise_multiplier": 1.0,
})
PARAMS = np.zeros(3 * 4 + 4 + 4 * 2 + 2)
uploads = []

def handle(request):
    if request.url.path.endswith("/round"):
        return httpx.Response(200, json={
            "task": "t", "round": 0, "state": "running", "config": CONFIG.model_dump(mode="json"),
            "noise_multiplier": 1.0, "clip_norm": 1.0, "sample_rate": 1.0,
            "expected_clients": 10.0, "num_params": PARAMS.size,
            "parameters": base64.b64encode(PARAMS.tobytes()).decode(), "deadline": 0.0})
    uploads.append(json.loads(request.content))
    return httpx.Response(200, json={"accepted": True, "duplicate": False, "round": 0,
                                     "updates_received": 1})

http = httpx.Client(transport=httpx.MockTransport(handle))
x, y = np.random.default_rng(0).normal(size=(8, 3)), np.arange(8) % 2
with FederatedClient("http://aggregator.test", "key", "t", (x, y), http=http) as device:
    result = device.run_round()
assert result.uploaded and len(uploads) == 1
"""
    + _REPORT
)


@pytest.mark.slow
def test_federated_training_imports_no_server_side_library() -> None:
    """Training, clipping, noising and uploading a federated update stays light too."""
    assert _server_side_modules(_FEDERATED_IN_USE) == []
