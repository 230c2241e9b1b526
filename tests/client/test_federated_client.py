"""FederatedClient against a real aggregator process over loopback HTTP."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import FederatedClient, LedgerCorruptError, TaskFinishedError
from client.federated import TaskRefusedError
from client.federated_ledger import device_epsilon
from shared.accounting import gaussian_rounds_epsilon
from shared.federated.models import LogisticRegression, accuracy
from simulations.server import Server, start_server

FEATURES, CLASSES = 5, 3


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One aggregator process for the tests that neither kill nor restart it: each creates
    a task of its own name, so they do not see each other's rounds. (A test that kills the
    aggregator takes the ``aggregator`` fixture: a process of its own.)"""
    directory = tmp_path_factory.mktemp("federated-client")
    with start_server(str(directory / "aggregator.sqlite3"), directory) as server:
        yield server


def blobs(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian classes around well-separated centres (fixed by seed 0)."""
    centres = np.random.default_rng(0).normal(0, 2.5, size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, n)
    return centres[y] + rng.normal(0, 1, size=(n, FEATURES)), y


def create(aggregator: Any, name: str, **config: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "model": {"kind": "logistic", "num_features": FEATURES, "num_classes": CLASSES},
        "mode": "central",
        "rounds": 6,
        "population": 12,
        "clients_per_round": 12,
        "target_epsilon": 8.0,
        "clip_norm": 2.0,
        "local_training": {"epochs": 5, "batch_size": 8, "learning_rate": 0.3},
        "server_momentum": 0.5,
        "round_timeout_seconds": 30,
    } | config
    rng = np.random.default_rng(99)
    x, y = blobs(300, rng)
    body = {"name": name, "config": values, "evaluation": {"x": x.tolist(), "y": y.tolist()}}
    response = httpx.post(
        f"{aggregator.url}/v1/federated/tasks", json=body, headers=aggregator.headers("admin")
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def status(aggregator: Any, name: str) -> dict[str, Any]:
    response = httpx.get(
        f"{aggregator.url}/v1/federated/tasks/{name}", headers=aggregator.headers("analyst")
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_a_small_task_trains_over_http(service: Any) -> None:
    """12 devices, 6 rounds of central DP-FedAvg at epsilon 8: the model the server holds
    classifies a held-out set far better than the untrained model (all-zero weights
    predict class 0 for everything: accuracy about 1/3 on balanced blobs)."""
    create(service, "blobs")
    rng = np.random.default_rng(1)
    devices = [
        FederatedClient(service.url, service.keys["device"], "blobs", blobs(40, rng), rng=None)
        for _ in range(12)
    ]
    for _ in range(6):
        info = devices[0].fetch_round()
        results = [device.run_round(info) for device in devices]
        assert all(r.participated and r.uploaded for r in results)  # q = 1: everyone
    final = status(service, "blobs")
    assert final["state"] == "completed" and final["participants"] == [12] * 6
    assert 0 < final["epsilon_spent"] <= 8.0 + 1e-9
    test_x, test_y = blobs(600, np.random.default_rng(2))
    model = LogisticRegression(FEATURES, CLASSES)
    untrained = accuracy(model, np.zeros(model.num_params), test_x, test_y)
    assert untrained < 0.45
    assert final["evaluation"]["accuracy"] > 0.8
    with pytest.raises(TaskFinishedError, match="planned rounds"):
        devices[0].fetch_round()
    for device in devices:
        device.close()


@pytest.mark.slow
def test_run_follows_rounds_until_the_task_finishes(service: Any) -> None:
    """One device alone with rounds of one: ``run`` takes part in each until completed."""
    create(service, "solo", rounds=3, population=1, clients_per_round=1)
    with FederatedClient(
        service.url, service.keys["device"], "solo", blobs(30, np.random.default_rng(3))
    ) as device:
        results = device.run(poll_interval=0.05)
    assert [r.round for r in results] == [0, 1, 2]
    assert status(service, "solo")["state"] == "completed"


@pytest.mark.slow
def test_a_restarted_round_is_decided_again(service: Any) -> None:
    """q = 10^-6 (no noise: nothing to calibrate): nobody takes part, so the round is
    restarted at each deadline (0.5 s);
    a device decides once per attempt, not once per round (which would stall it)."""
    create(
        service, "sparse", mode="none", target_epsilon=None, population=10**6,
        clients_per_round=1, min_clients=1, round_timeout_seconds=0.5,
    )  # fmt: skip
    with FederatedClient(
        service.url, service.keys["device"], "sparse", blobs(10, np.random.default_rng(3))
    ) as device:
        results = device.run(max_rounds=3, poll_interval=0.05)
    assert [(r.round, r.attempt, r.participated) for r in results] == [
        (0, 0, False), (0, 1, False), (0, 2, False),
    ]  # fmt: skip
    assert status(service, "sparse")["attempt"] >= 2


def test_device_refuses_a_task_beyond_its_epsilon(service: Any, tmp_path: Path) -> None:
    """Central mode: refused under a cap unless the device trusts the server's noise; and
    then refused still, as the plan the server serves costs epsilon 8 > 2."""
    create(service, "greedy", target_epsilon=8.0)
    data = blobs(10, np.random.default_rng(4))
    url, key = service.url, service.keys["device"]
    with FederatedClient(url, key, "greedy", data, max_epsilon=2.0, state_dir=tmp_path) as device:
        with pytest.raises(TaskRefusedError, match="cannot verify.*at most 2"):
            device.run_round()
    with FederatedClient(
        url, key, "greedy", data, max_epsilon=2.0, trust_server_noise=True, state_dir=tmp_path
    ) as device:
        with pytest.raises(TaskRefusedError, match="costs epsilon 8.*at most 2"):
            device.run_round()
    assert status(service, "greedy")["updates_received"] == 0


def test_a_local_task_is_charged_on_the_device_as_on_the_server(
    service: Any, tmp_path: Path
) -> None:
    """Local mode at epsilon 3 over 2 rounds, one device with a cap of 3: both rounds
    are uploaded, and the device's own ledger (durable in ``state_dir``) holds the same
    epsilon as the server's accountant (both PLD at the federated grid)."""
    create(
        service, "local", mode="local", target_epsilon=3.0, rounds=2, population=1,
        clients_per_round=1,
    )  # fmt: skip
    data = blobs(20, np.random.default_rng(6))
    url, key = service.url, service.keys["device"]
    with FederatedClient(url, key, "local", data, max_epsilon=3.0, state_dir=tmp_path) as device:
        assert [r.uploaded for r in device.run(poll_interval=0.05)] == [True, True]
        spent = device.epsilon_spent()
    server = status(service, "local")
    assert server["state"] == "completed"
    assert 0 < spent <= 3.0
    assert spent == pytest.approx(server["epsilon_spent"], rel=1e-9)
    with FederatedClient(url, key, "local", data, max_epsilon=3.0, state_dir=tmp_path) as again:
        assert again.epsilon_spent() == spent


@pytest.mark.slow
def test_an_upload_is_charged_before_it_is_sent(aggregator: Any, tmp_path: Path) -> None:
    """The aggregator dies between the round and the upload: the upload is lost, its
    epsilon is not (a crash loses budget, never spends it twice)."""
    create(
        aggregator, "lost", mode="local", target_epsilon=3.0, rounds=2, population=1,
        clients_per_round=1,
    )  # fmt: skip
    data = blobs(20, np.random.default_rng(8))
    url, key = aggregator.url, aggregator.keys["device"]
    with FederatedClient(
        url, key, "lost", data, max_epsilon=3.0, state_dir=tmp_path, max_attempts=1
    ) as device:
        info = device.fetch_round()
        aggregator.kill()
        assert not device.run_round(info).uploaded
    with FederatedClient(url, key, "lost", data, max_epsilon=3.0, state_dir=tmp_path) as again:
        assert again.epsilon_spent() == pytest.approx(
            device_epsilon({info.noise_multiplier / 2: 1}, 1.0, 1e-5)
        )


def test_a_damaged_ledger_fails_closed(service: Any, tmp_path: Path) -> None:
    """A ledger edited to forget its uploads does not match its checksum: no upload."""
    create(
        service, "damaged", mode="local", target_epsilon=3.0, rounds=3, population=1,
        clients_per_round=1,
    )  # fmt: skip
    data = blobs(20, np.random.default_rng(9))
    url, key = service.url, service.keys["device"]
    with FederatedClient(url, key, "damaged", data, state_dir=tmp_path) as device:
        assert device.run_round().uploaded
    (ledger,) = tmp_path.glob("federated-*.json")
    content = json.loads(ledger.read_text())
    content["body"]["releases"] = []  # the uploads forgotten, the checksum left as it was
    ledger.write_text(json.dumps(content))
    with FederatedClient(url, key, "damaged", data, state_dir=tmp_path) as device:
        with pytest.raises(LedgerCorruptError, match="altered"):
            device.run_round()
    assert status(service, "damaged")["participants"] == [1]
    assert status(service, "damaged")["updates_received"] == 0


def test_device_epsilon_is_the_tighter_bound_and_safe_for_any_multiplier() -> None:
    """The uploads add discrete Gaussian noise: charged by its zCDP bound (never below the
    continuous Gaussian's PLD figure), safe for a hostile multiplier (no PLD grid for
    z = 1e-9 is ever built); no noise is infinite; nothing is 0."""
    releases = {0.8: 3, 1.6: 2}
    discrete = gaussian_rounds_epsilon(releases, 1.0, 1e-5, mechanism="discrete_gaussian")
    pld = gaussian_rounds_epsilon(releases, 1.0, 1e-5, "pld", value_discretization_interval=1e-3)
    assert pld < discrete and device_epsilon(releases, 1.0, 1e-5) == discrete
    assert device_epsilon({1e-9: 1}, 1.0, 1e-5) > 1e15
    assert device_epsilon({0.0: 1}, 1.0, 1e-5) == math.inf
    assert device_epsilon({}, 1.0, 1e-5) == 0.0


def test_a_model_of_ones_own_trains_through_the_same_interface(service: Any) -> None:
    """Any object with the Model interface of the task's size can be passed in."""

    class Wrapped:
        def __init__(self) -> None:
            self.inner = LogisticRegression(FEATURES, CLASSES)
            self.calls = 0

        @property
        def num_params(self) -> int:
            return self.inner.num_params

        def init_params(self, rng: np.random.Generator) -> np.ndarray:
            return self.inner.init_params(rng)

        def loss_and_grad(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> Any:
            self.calls += 1
            return self.inner.loss_and_grad(params, x, y)

        def predict(self, params: np.ndarray, x: np.ndarray) -> np.ndarray:
            return self.inner.predict(params, x)

    create(service, "own", rounds=1, population=1, clients_per_round=1)
    model = Wrapped()
    with FederatedClient(
        service.url,
        service.keys["device"],
        "own",
        blobs(16, np.random.default_rng(5)),
        model=model,
    ) as device:
        assert device.run_round().uploaded
    assert model.calls > 0
    assert status(service, "own")["participants"] == [1]


def test_a_cap_without_a_state_directory_is_refused() -> None:
    """A cap kept in memory would be spent again after every restart of the app."""
    data = blobs(10, np.random.default_rng(4))
    with pytest.raises(ValueError, match="max_epsilon needs state_dir"):
        FederatedClient("http://127.0.0.1:9", "key", "capped", data, max_epsilon=2.0)
