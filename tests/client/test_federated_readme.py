"""The README's federated learning example, verbatim, and the progress ``run`` reports.

The example runs against a real ``aggregator.cli serve`` process (fixture ``service``,
one for the module: each test has a task of its own) with the task created by the
README's own ``curl`` body, so the test breaks when either drifts from the code.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import FederatedClient, RoundResult
from simulations.server import Server, start_server

#: The repository root (for the README).
ROOT = Path(__file__).resolve().parents[2]

#: The federated example of README.md, verbatim: ``test_readme_federated_example`` runs
#: exactly this.
FEDERATED_EXAMPLE = """\
import logging
import os

from sklearn.datasets import load_digits

from client import FederatedClient

logging.basicConfig(level=logging.INFO)  # run() logs every round on "ldp.federated"

# This device's examples: its share of scikit-learn's bundled digits (no download), every
# 100th image from the 7th; 8x8 pixels scaled to [0, 1]. They never leave the device.
images, labels = load_digits(return_X_y=True)
x, y = images[7::100] / 16.0, labels[7::100]

with FederatedClient(
    os.environ.get("LDP_ENDPOINT", "http://127.0.0.1:8000"),
    os.environ["LDP_DEVICE_KEY"],  # a device key from the aggregator's admin
    "digits",
    (x, y),
    max_epsilon=4.0,
    trust_server_noise=True,
    state_dir=os.path.expanduser("~/.local/state/my-app/federated"),  # the device's ledger
) as device:
    # Takes part (with probability q) in every round until the task ends.
    results = device.run(on_round=print)  # print each round's RoundResult as it is decided
print(sum(result.uploaded for result in results), "updates uploaded")
"""

#: What the test changes in the README's task so that one device finishes it in seconds:
#: three rounds, a population of one (q = 1: the device is in every round, and a round
#: closes as soon as its one upload arrives). Mode, model, privacy target and training
#: stay the README's.
SOLO = {"rounds": 3, "population": 1, "clients_per_round": 1}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("federated-readme")
    with start_server(str(directory / "aggregator.sqlite3"), directory) as server:
        yield server


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def readme_task() -> dict[str, Any]:
    """The body of the README's ``curl -X POST .../v1/federated/tasks -d '...'``."""
    found = re.search(r"/v1/federated/tasks \\\n.*?-d '(\{.*?\})'", readme(), flags=re.DOTALL)
    assert found, "README.md shows no curl that creates a federated task"
    return dict(json.loads(found.group(1)))


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Undo what ``logging.basicConfig`` in the example may do to the root logger."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_readme_shows_the_federated_example() -> None:
    """README.md's federated example is the code ``test_readme_federated_example`` runs."""
    blocks = re.findall(r"```python\n(.*?)```", readme(), flags=re.DOTALL)
    assert FEDERATED_EXAMPLE in [b for b in blocks if "FederatedClient(" in b], (
        "README.md's federated example differs from FEDERATED_EXAMPLE"
    )


@pytest.mark.slow
def test_readme_federated_example(
    service: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    root_logging: None,
) -> None:
    """The README's task (its curl body, run by one device: ``SOLO``) and the README's
    device code, verbatim: the device uploads in each of the three rounds, the task
    completes, and the example prints and logs each round as it goes."""
    body = readme_task()
    assert body["name"] == "digits"
    body["config"] |= SOLO
    created = httpx.post(
        f"{service.url}/v1/federated/tasks", json=body, headers=service.headers("admin")
    )
    assert created.status_code == 201, created.text
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LDP_ENDPOINT", service.url)
    monkeypatch.setenv("LDP_DEVICE_KEY", service.keys["device"])
    caplog.set_level(logging.INFO, logger="ldp.federated")

    exec(compile(FEDERATED_EXAMPLE, "README federated example", "exec"), {})  # noqa: S102

    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        *(str(RoundResult(r, participated=True, uploaded=True, attempt=0)) for r in range(3)),
        "3 updates uploaded",
    ]
    logged = [r.getMessage() for r in caplog.records if r.name == "ldp.federated"]
    assert [m for m in logged if "joined, update uploaded" in m] == [
        f"task 'digits': round {r} (attempt 0; 3 planned): joined, update uploaded"
        for r in range(3)
    ]
    assert logged[-1].startswith("task 'digits' finished after 3 decisions")
    status = httpx.get(
        f"{service.url}/v1/federated/tasks/digits", headers=service.headers("analyst")
    ).json()
    assert status["state"] == "completed" and status["participants"] == [1, 1, 1]
    assert (tmp_path / ".local" / "state" / "my-app" / "federated").is_dir()


@pytest.mark.slow
def test_run_reports_restarted_rounds(service: Server, caplog: pytest.LogCaptureFixture) -> None:
    """A round nobody takes part in (q = 10^-6) is restarted at each deadline (0.5 s):
    ``run`` hands every decision to ``on_round`` as it is made (the same ones it
    returns), and logs each skip and each restart, where it used to wait in silence.
    False-failure rate: the device takes part in one of its 3 draws with probability
    at most 3 * 10^-6."""
    config = {
        "model": {"kind": "logistic", "num_features": 4, "num_classes": 2},
        "mode": "none", "rounds": 5, "population": 10**6, "clients_per_round": 1,
        "round_timeout_seconds": 0.5,
    }  # fmt: skip
    created = httpx.post(
        f"{service.url}/v1/federated/tasks",
        json={"name": "sparse", "config": config},
        headers=service.headers("admin"),
    )
    assert created.status_code == 201, created.text
    caplog.set_level(logging.INFO, logger="ldp.federated")
    seen: list[RoundResult] = []
    data = (np.zeros((6, 4)), np.arange(6) % 2)
    with FederatedClient(service.url, service.keys["device"], "sparse", data) as device:
        results = device.run(max_rounds=3, poll_interval=0.05, on_round=seen.append)

    assert seen == results
    assert [(r.round, r.attempt, r.participated) for r in results] == [
        (0, 0, False), (0, 1, False), (0, 2, False),
    ]  # fmt: skip
    logged = [r.getMessage() for r in caplog.records if r.name == "ldp.federated"]
    assert logged == [
        "task 'sparse': round 0 (attempt 0; 5 planned): skipped (not sampled; probability "
        "1e-06 to take part)",
        "task 'sparse': round 0 restarted by the aggregator (too few uploads by its "
        "deadline); deciding again, attempt 1",
        "task 'sparse': round 0 (attempt 1; 5 planned): skipped (not sampled; probability "
        "1e-06 to take part)",
        "task 'sparse': round 0 restarted by the aggregator (too few uploads by its "
        "deadline); deciding again, attempt 2",
        "task 'sparse': round 0 (attempt 2; 5 planned): skipped (not sampled; probability "
        "1e-06 to take part)",
    ]
