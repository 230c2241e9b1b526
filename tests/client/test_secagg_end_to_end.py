"""Secure aggregation over HTTP: a real aggregator process, real devices in threads.

Every device is a :class:`client.FederatedClient` against one ``ldp-aggregator serve``
on loopback; a round's devices run ``run_round`` at the same time, each in a thread of
its own, since the four steps of secure aggregation interleave (no device can mask its
input before all have shared their keys). A device "drops out" as a phone does: from
its first request for a given step on, its connection fails (``GoesOffline``); it
retries a little, gives up, and sends nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from sklearn.datasets import load_digits

from client import FederatedClient, RetryPolicy, RoundResult
from client.federated import RoundInfo
from shared.federated.task import TaskConfig, TaskState
from simulations.federated import load_dataset
from simulations.server import Server, start_server

FEATURES, CLASSES = 5, 3


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One aggregator for the module; each test creates tasks of its own names."""
    directory = tmp_path_factory.mktemp("secagg-end-to-end")
    with start_server(str(directory / "aggregator.sqlite3"), directory) as server:
        yield server


class GoesOffline(httpx.BaseTransport):
    """The network, until the device's first request for ``step`` (``(method, last path
    segment)``, e.g. ``("GET", "unmask")``): from then on no connection succeeds."""

    def __init__(self, step: tuple[str, str]) -> None:
        self._network = httpx.HTTPTransport()
        self.step, self.offline = step, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if (request.method, request.url.path.rsplit("/", 1)[-1]) == self.step:
            self.offline = True
        if self.offline:
            raise httpx.ConnectError("the device went offline", request=request)
        return self._network.handle_request(request)

    def close(self) -> None:
        self._network.close()


def create(server: Server, name: str, config: dict[str, Any], test: Any = None) -> None:
    body: dict[str, Any] = {"name": name, "config": config}
    if test is not None:
        body["evaluation"] = {"x": test[0].tolist(), "y": test[1].tolist()}
    response = httpx.post(
        f"{server.url}/v1/federated/tasks", json=body, headers=server.headers("admin"), timeout=60
    )
    assert response.status_code == 201, response.text


def status(server: Server, name: str) -> dict[str, Any]:
    response = httpx.get(
        f"{server.url}/v1/federated/tasks/{name}", headers=server.headers("analyst"), timeout=60
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def run_concurrently(devices: Sequence[FederatedClient], info: RoundInfo) -> list[RoundResult]:
    """Every device's ``run_round(info)`` at once, each in its own thread."""
    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        return list(pool.map(lambda device: device.run_round(info), devices))


def next_draw(server: Server, name: str, info: RoundInfo, timeout: float = 60.0) -> dict[str, Any]:
    """The task's status once the round of ``info`` closed or was restarted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = status(server, name)
        if (now["round"], now["attempt"]) != (info.round, info.attempt):
            return now
        time.sleep(0.1)
    raise AssertionError(f"round {info.round} of {name} neither closed nor restarted in time")


def blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian classes around well-separated centres (fixed by seed 0)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(0, 2.5, size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, n)
    return centres[y] + rng.normal(0, 1, size=(n, FEATURES)), y


def small_task(devices: int, min_clients: int, **secure: Any) -> dict[str, Any]:
    """A secure distributed task of ``devices`` devices, all in every round (q = 1)."""
    return {
        "model": {"kind": "logistic", "num_features": FEATURES, "num_classes": CLASSES},
        "mode": "distributed", "rounds": 2, "population": devices,
        "clients_per_round": devices, "min_clients": min_clients, "noise_multiplier": 1.0,
        "clip_norm": 1.0, "round_timeout_seconds": 60,
        "secure_aggregation": {"step_timeout_seconds": 3.0} | secure,
    }  # fmt: skip


def fleet(
    server: Server, name: str, count: int, offline: dict[int, tuple[str, str]]
) -> tuple[list[FederatedClient], list[httpx.Client]]:
    """``count`` devices of task ``name`` (device ``i`` goes offline at ``offline[i]``)
    and their HTTP clients, which the caller closes."""
    devices, clients = [], []
    for i in range(count):
        http = httpx.Client(transport=GoesOffline(offline.get(i, ("", ""))), timeout=30)
        clients.append(http)
        devices.append(
            FederatedClient(
                server.url,
                server.keys["device"],
                name,
                blobs(20, 100 + i),
                rng=np.random.default_rng(i),
                http=http,
                retry=RetryPolicy(base=0.01, cap=0.05),
                max_attempts=2,
            )  # fmt: skip
        )
    return devices, clients


@pytest.mark.slow
def test_devices_dropping_out_at_each_step_leave_the_masked_inputs_in_the_sum(
    service: Server,
) -> None:
    """16 devices: two go offline before sharing their keys, two before their masked
    input, two before the unmask request. The round closes with the twelve masked inputs
    (the last two dropped after theirs was in: their self masks are removed with their
    neighbours' shares), and the task's epsilon is the one of a round of twelve noise
    shares: what ``TaskState.close_secure_round`` charges for 12, not for 16."""
    offline = {0: ("POST", "shares"), 1: ("POST", "shares"), 2: ("GET", "shares"),
               3: ("GET", "shares"), 4: ("GET", "unmask"), 5: ("GET", "unmask")}  # fmt: skip
    config = small_task(16, min_clients=8, max_dropout=0.4)
    create(service, "dropouts", config)
    devices, clients = fleet(service, "dropouts", 16, offline)
    info = devices[0].fetch_round()
    results = run_concurrently(devices, info)
    for http in clients:
        http.close()
    assert [r.uploaded for r in results] == [False] * 4 + [True] * 12
    final = next_draw(service, "dropouts", info)
    assert (final["round"], final["attempt"]) == (1, 0)
    assert final["participants"] == [12]

    def charged(participants: int) -> float:
        state = TaskState.start(TaskConfig.model_validate(config))
        zeros = np.zeros(state.dp.secure_vector_length(state.num_params), dtype=np.int64)
        return state.close_secure_round(zeros, participants).epsilon

    assert final["epsilon_spent"] == pytest.approx(charged(12), rel=1e-9)
    assert charged(12) != pytest.approx(charged(16), rel=1e-3)


@pytest.mark.slow
def test_a_round_with_too_few_unmask_answers_is_restarted_without_a_model_step(
    service: Server,
) -> None:
    """8 devices (a complete graph: k = 7, t = 4): five go offline after their masked
    input, so three answer the unmask request, fewer than the four shares that rebuild a
    secret. Nothing can be unmasked: the round is restarted (attempt 1), no round is
    charged, and the model is the one served before."""
    config = small_task(8, min_clients=4)
    create(service, "unmask-short", config)
    devices, clients = fleet(service, "unmask-short", 8, {i: ("GET", "unmask") for i in range(5)})
    info = devices[0].fetch_round()
    results = run_concurrently(devices, info)
    assert all(r.uploaded for r in results)
    final = next_draw(service, "unmask-short", info)
    assert (final["round"], final["attempt"]) == (0, 1)
    assert final["history"] == [] and final["epsilon_spent"] == 0
    again = devices[7].fetch_round()
    for http in clients:
        http.close()
    assert (again.round, again.attempt) == (0, 1)
    np.testing.assert_array_equal(again.vector, info.vector)


#: The digits comparison: 100 devices, all in every round (q = 1), 5 rounds, epsilon 16.
DIGITS_DEVICES, DIGITS_ROUNDS, DIGITS_EPSILON = 100, 5, 16.0


def digits_accuracy(server: Server, mode: str, secure: dict[str, Any] | None) -> float:
    """Train digits over HTTP in ``mode``; the final accuracy the server reports on all
    1,797 images (the public evaluation set here: the comparison is of two models, so the
    more images the less the test's own sampling adds to their difference)."""
    data = load_dataset("digits", DIGITS_DEVICES, "iid", 0)
    images, labels = load_digits(return_X_y=True)
    name = f"digits-{mode}"
    config: dict[str, Any] = {
        "model": {"kind": "logistic", "num_features": 64, "num_classes": 10},
        "mode": mode, "rounds": DIGITS_ROUNDS, "population": DIGITS_DEVICES,
        "clients_per_round": DIGITS_DEVICES, "min_clients": 90,
        "target_epsilon": DIGITS_EPSILON, "clip_norm": 1.0, "server_momentum": 0.9,
        "local_training": {"epochs": 5, "batch_size": 8, "learning_rate": 0.5},
        "round_timeout_seconds": 120, "seed": 0,
    }  # fmt: skip
    if secure is not None:
        config["secure_aggregation"] = secure
    create(server, name, config, (images / 16.0, labels))
    seeds = np.random.SeedSequence(0).spawn(DIGITS_DEVICES)
    limits = httpx.Limits(max_connections=DIGITS_DEVICES, max_keepalive_connections=DIGITS_DEVICES)
    final: dict[str, Any] = {}
    with httpx.Client(timeout=60, limits=limits) as http:  # shared by the devices' threads
        devices = [
            FederatedClient(
                server.url,
                server.keys["device"],
                name,
                shard,
                rng=np.random.default_rng(seed),
                http=http,
            )  # fmt: skip
            for shard, seed in zip(data.clients, seeds, strict=True)
        ]
        for _ in range(DIGITS_ROUNDS):
            info = devices[0].fetch_round()
            assert all(result.uploaded for result in run_concurrently(devices, info))
            final = next_draw(server, name, info)
            assert final["attempt"] == 0
    assert final["state"] == "completed"
    assert final["participants"] == [DIGITS_DEVICES] * DIGITS_ROUNDS
    assert 0 < final["epsilon_spent"] <= DIGITS_EPSILON + 1e-9
    return float(final["evaluation"]["accuracy"])


@pytest.mark.slow
def test_secure_distributed_training_on_digits_is_as_accurate_as_central(
    service: Server,
) -> None:
    """Digits, 100 devices, 5 rounds at epsilon 16: the distributed mode with secure
    aggregation reaches the central mode's accuracy within 0.02, from the same data,
    seeds, initial model and local training. The two runs differ only in the noise: the
    devices' discrete shares, summed under masks, against the server's one draw (5%
    larger in the distributed mode, whose rounds may close with 90 of the 100 shares).

    Tolerance: the same two tasks in-process (``simulations.federated.run_task``, 16
    seeds) differ in final accuracy on the 1,797 images by a standard deviation of
    0.0045 (0.011 at most): 0.02 is 4.4 standard deviations. Both train well: 0.90 on
    average, so ``central > 0.85`` fails only for a broken run."""
    central = digits_accuracy(service, "central", None)
    secure = digits_accuracy(
        service, "distributed", {"max_dropout": 0.1, "step_timeout_seconds": 30.0}
    )
    assert central > 0.85
    assert abs(secure - central) <= 0.02
