"""Federated learning over the service: tasks, rounds, uploads, refusals, restarts.

In process (FastAPI TestClient) on SQLite and PostgreSQL for the API's rules, and with
real server processes for a restart and for two processes sharing PostgreSQL.
"""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.settings import Settings

KEYS = {
    "admin": "fl-test-admin-key-0123456789",
    "analyst": "fl-test-analyst-key-0123456789",
    "device": "fl-test-device-key-0123456789",
}
PROBLEM = "application/problem+json"
#: Seconds a real server may take to create a task: calibrating its noise runs the PLD
#: accountant many times, which takes seconds on a loaded machine.
CALIBRATION_TIMEOUT = 120.0
MODEL = {"kind": "logistic", "num_features": 4, "num_classes": 3}
NUM_PARAMS = (4 + 1) * 3


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


def task_body(name: str = "digits", **config: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "model": MODEL,
        "mode": "central",
        "rounds": 4,
        "population": 100,
        "clients_per_round": 3,
        "target_epsilon": 4.0,
        "clip_norm": 1.0,
        "round_timeout_seconds": 60,
    }
    values.update(config)
    return {"name": name, "config": values}


def vector(values: np.ndarray) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f8").tobytes()).decode()


def upload(round_number: int = 0, values: np.ndarray | None = None, **extra: Any) -> dict[str, Any]:
    values = np.full(NUM_PARAMS, 0.01) if values is None else values
    body = {"update_id": str(uuid.uuid4()), "round": round_number, "update": vector(values)}
    return body | extra


class Clock:
    """A settable clock for the service's deadlines."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Api:
    client: TestClient
    app: FastAPI
    clock: Clock

    def create(self, body: dict[str, Any]) -> httpx.Response:
        return self.client.post("/v1/federated/tasks", json=body, headers=auth("admin"))

    def status(self, name: str = "digits") -> dict[str, Any]:
        response = self.client.get(f"/v1/federated/tasks/{name}", headers=auth("analyst"))
        assert response.status_code == 200, response.text
        return dict(response.json())

    def round(self, name: str = "digits") -> httpx.Response:
        return self.client.get(f"/v1/federated/tasks/{name}/round", headers=auth("device"))

    def send(self, body: dict[str, Any], name: str = "digits") -> httpx.Response:
        return self.client.post(
            f"/v1/federated/tasks/{name}/updates", json=body, headers=auth("device")
        )

    def tick(self) -> None:
        self.app.state.federated.tick()


@contextmanager
def running(database: str) -> Iterator[Api]:
    app = create_app(Settings(database=database, compaction_interval=0))
    clock = Clock()
    app.state.federated.clock = clock
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Api(client, app, clock)


@pytest.fixture
def api(database_url: str) -> Iterator[Api]:
    with running(database_url) as service:
        yield service


@pytest.fixture
def sqlite_api(tmp_path: Path) -> Iterator[Api]:
    with running(str(tmp_path / "fl.sqlite3")) as service:
        yield service


def test_create_task_and_read_its_status(api: Api) -> None:
    response = api.create(task_body())
    assert response.status_code == 201, response.text
    status = response.json()
    assert status["state"] == "running" and status["round"] == 0 and status["rounds"] == 4
    assert status["epsilon_spent"] == 0.0 and status["budget"] == 4.0
    assert status["noise_multiplier"] > 0  # calibrated for epsilon 4 over 4 rounds
    assert api.status()["config"]["mode"] == "central"
    listed = api.client.get("/v1/federated/tasks", headers=auth("analyst")).json()
    assert [task["name"] for task in listed] == ["digits"]


def test_task_endpoints_need_the_right_key(sqlite_api: Api) -> None:
    client = sqlite_api.client
    assert client.post("/v1/federated/tasks", json=task_body()).status_code == 401
    refused = client.post("/v1/federated/tasks", json=task_body(), headers=auth("device"))
    assert refused.status_code == 403 and refused.headers["content-type"] == PROBLEM
    assert sqlite_api.create(task_body()).status_code == 201
    assert client.get("/v1/federated/tasks/digits/round").status_code == 401
    assert client.get("/v1/federated/tasks/digits", headers=auth("device")).status_code == 403


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mode": "none"}, "adds no noise"),
        ({"clients_per_round": 500}, "exceeds population"),
        ({"model": {"kind": "forest", "num_features": 4, "num_classes": 3}}, "kind"),
        ({"rounds": 0}, "rounds"),
    ],
)
def test_invalid_tasks_are_refused(sqlite_api: Api, config: dict[str, Any], message: str) -> None:
    response = sqlite_api.create(task_body(**config))
    assert response.status_code == 422
    assert response.headers["content-type"] == PROBLEM
    assert message in response.text
    assert sqlite_api.client.get("/v1/federated/tasks", headers=auth("analyst")).json() == []


@pytest.mark.parametrize(
    ("config", "epsilon"),
    [
        ({"noise_multiplier": 0.3, "rounds": 10_000, "clients_per_round": 100}, "61"),
        ({"noise_multiplier": 0.1, "rounds": 100, "clients_per_round": 100}, "5"),
    ],
)
def test_tasks_planning_an_absurd_epsilon_are_refused_cheaply(
    sqlite_api: Api, config: dict[str, Any], epsilon: str
) -> None:
    """Little noise over many unsampled rounds (which took the PLD accountant minutes) is
    a 422 stating the RDP bound on the planned epsilon, before any PLD accounting."""
    response = sqlite_api.create(task_body(target_epsilon=None, **config))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == PROBLEM
    detail = response.json()["detail"]
    assert "RDP bound" in detail and "more than the 100 a task may plan" in detail
    assert f"spend epsilon up to {epsilon}" in detail
    assert sqlite_api.client.get("/v1/federated/tasks", headers=auth("analyst")).json() == []


def test_duplicate_name_and_bad_evaluation_set(sqlite_api: Api) -> None:
    assert sqlite_api.create(task_body()).status_code == 201
    again = sqlite_api.create(task_body())
    assert again.status_code == 409 and "exists" in again.json()["detail"]
    body = task_body("other") | {"evaluation": {"x": [[0.0, 1.0]], "y": [0]}}
    response = sqlite_api.create(body)
    assert response.status_code == 422 and "features" in response.json()["detail"]


def test_round_serves_the_model(api: Api) -> None:
    api.create(task_body())
    response = api.round()
    assert response.status_code == 200
    info = response.json()
    params = np.frombuffer(base64.b64decode(info["parameters"]), dtype="<f8")
    assert params.size == info["num_params"] == NUM_PARAMS
    assert info["round"] == 0 and info["sample_rate"] == pytest.approx(0.03)
    assert api.round("nothing").status_code == 404


def test_uploads_are_idempotent_and_close_the_round_when_enough_arrived(api: Api) -> None:
    api.create(task_body())
    first = upload()
    assert api.send(first).json() == {
        "accepted": True, "duplicate": False, "round": 0, "updates_received": 1
    }  # fmt: skip
    retry = api.send(first).json()
    assert retry["duplicate"] and retry["updates_received"] == 1
    assert api.send(upload()).json()["updates_received"] == 2
    assert api.status()["round"] == 0
    api.send(upload())  # the third of clients_per_round = 3: the round closes
    status = api.status()
    assert status["round"] == 1 and status["participants"] == [3]
    assert 0 < status["epsilon_spent"] < 4.0
    assert status["history"][0]["epsilon"] == status["epsilon_spent"]
    stale = api.send(upload(0))
    assert stale.status_code == 409 and stale.json()["type"].endswith("stale-round")


def test_a_retry_after_its_round_closed_is_still_a_duplicate(api: Api) -> None:
    """The upload that filled round 0 is retried (its answer was lost): the reply says
    duplicate in round 0, not a stale round, and nothing is counted twice."""
    api.create(task_body())
    api.create(task_body("other"))
    uploads = [upload() for _ in range(3)]
    for body in uploads:
        assert api.send(body).status_code == 200
    retry = api.send(uploads[-1])
    assert retry.status_code == 200
    assert retry.json() == {"accepted": False, "duplicate": True, "round": 0, "updates_received": 3}
    assert api.status()["participants"] == [3] and api.status()["updates_received"] == 0
    # Update ids are per task: the same id is new to another task.
    assert api.send(uploads[0], "other").json()["accepted"] is True


def test_refused_uploads_store_nothing(api: Api) -> None:
    api.create(task_body("noisy", mode="local", clients_per_round=100, rounds=2))
    nan = np.full(NUM_PARAMS, 0.01)
    nan[4] = np.nan
    cases = [
        (upload(values=np.zeros(NUM_PARAMS - 1)), 422, "parameters"),
        (upload() | {"update": "not base64!"}, 422, "base64"),
        (upload(values=nan), 422, "value 4"),
        (upload(values=np.full(NUM_PARAMS, 1e6)), 422, "norm"),
        (upload(round_number=3), 409, "round 0 is open"),
        (upload() | {"unclipped": "NaN"}, 422, "unclipped"),
        (upload() | {"num_examples": 0}, 422, "num_examples"),
    ]
    for body, status, message in cases:
        response = api.send(body, "noisy")
        assert response.status_code == status, (body, response.text)
        assert response.headers["content-type"] == PROBLEM
        assert message in response.text
    assert api.status("noisy")["updates_received"] == 0
    assert api.send(upload(), "nothing").status_code == 404


def test_central_mode_reclips_whatever_arrives(api: Api) -> None:
    """Noise multiplier 0 (clipping only): a huge update moves the model by at most
    C * m / (q W) = 1 * 1 / 3."""
    api.create(task_body(target_epsilon=None, noise_multiplier=0.0, min_clients=1))
    before = np.frombuffer(base64.b64decode(api.round().json()["parameters"]), dtype="<f8")
    assert api.send(upload(values=np.full(NUM_PARAMS, 1e9))).status_code == 200
    closed = api.client.post("/v1/federated/tasks/digits/close", headers=auth("admin"))
    assert closed.status_code == 200 and closed.json()["round"] == 1
    after = np.frombuffer(base64.b64decode(api.round().json()["parameters"]), dtype="<f8")
    assert np.linalg.norm(after - before) == pytest.approx(1.0 / 3.0)


def test_deadline_closes_with_dropouts_or_restarts_the_round(api: Api) -> None:
    """A due round short of min_clients is drawn again: its uploads are discarded (not
    counted in the round that closes), an upload for the abandoned attempt, or a retry of
    one taken in it, is refused as stale, and devices are told the new attempt."""
    api.create(task_body(clients_per_round=10, population=100, min_clients=2))
    first = upload()
    assert api.send(first).status_code == 200
    deadline = api.status()["deadline"]
    api.clock.now = deadline + 1
    api.tick()  # one update, fewer than min_clients: the round restarts
    status = api.status()
    assert status["round"] == 0 and status["attempt"] == 1 and status["deadline"] > deadline
    assert status["updates_received"] == 0
    assert api.round().json()["attempt"] == 1
    for stale in (first, upload()):  # the retry of the discarded upload, a late new one
        response = api.send(stale)
        assert response.status_code == 409 and "attempt 1 is open" in response.text
    for _ in range(2):
        assert api.send(upload(attempt=1)).status_code == 200
    api.clock.now = status["deadline"] + 1
    api.tick()  # two updates at the deadline: the round closes without the other eight
    status = api.status()
    assert status["participants"] == [2] and status["round"] == 1 and status["attempt"] == 0
    assert api.round().json()["attempt"] == 0


def test_admin_close_needs_min_clients(sqlite_api: Api) -> None:
    sqlite_api.create(task_body(min_clients=2))
    sqlite_api.send(upload())
    response = sqlite_api.client.post("/v1/federated/tasks/digits/close", headers=auth("admin"))
    assert response.status_code == 409 and "at least 2" in response.json()["detail"]


def test_task_completes_after_its_planned_rounds(sqlite_api: Api) -> None:
    sqlite_api.create(task_body(rounds=2))
    for round_number in range(2):
        for _ in range(3):
            assert sqlite_api.send(upload(round_number)).status_code == 200
    status = sqlite_api.status()
    assert status["state"] == "completed" and status["round"] == 2
    assert status["epsilon_spent"] <= 4.0 + 1e-9
    finished = sqlite_api.round()
    assert finished.status_code == 409 and "planned rounds" in finished.json()["detail"]
    assert sqlite_api.send(upload(2)).status_code == 409


def test_budget_exhausted_before_the_plan_when_rounds_cost_more(sqlite_api: Api) -> None:
    """Distributed mode with a fixed multiplier: rounds closing with one share of the noise
    instead of four cost more than planned; the task stops before overspending."""
    sqlite_api.create(
        task_body(
            mode="distributed", target_epsilon=None, noise_multiplier=2.0, rounds=20,
            clients_per_round=4, population=40, min_clients=1,
        )
    )  # fmt: skip
    for round_number in range(20):
        if sqlite_api.status()["state"] != "running":
            break
        sqlite_api.send(upload(round_number, values=np.full(NUM_PARAMS, 0.001)))
        sqlite_api.client.post("/v1/federated/tasks/digits/close", headers=auth("admin"))
    status = sqlite_api.status()
    assert status["state"] == "budget_exhausted"
    assert status["round"] < 20
    assert status["epsilon_spent"] <= status["budget"] + 1e-9


def test_evaluation_set_is_scored_every_round(sqlite_api: Api) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 4)).tolist()
    y = rng.integers(0, 3, 30).tolist()
    body = task_body(clients_per_round=1) | {"evaluation": {"x": x, "y": y}}
    assert sqlite_api.create(body).status_code == 201
    sqlite_api.send(upload())
    evaluation = sqlite_api.status()["evaluation"]
    assert set(evaluation) == {"accuracy", "loss"}
    assert 0.0 <= evaluation["accuracy"] <= 1.0 and math.isfinite(evaluation["loss"])


def test_adaptive_task_with_too_little_count_noise_is_refused(sqlite_api: Api) -> None:
    """Given or calibrated, a multiplier the default count noise (clients_per_round / 20)
    cannot pair with is a 422 naming the fields (the calibrated case used to answer 500)."""
    given = sqlite_api.create(
        task_body(target_epsilon=None, noise_multiplier=1.0, adaptive_clipping={})
    )
    calibrated = sqlite_api.create(task_body(adaptive_clipping={}))
    for response in (given, calibrated):
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == PROBLEM
        assert "count_noise" in response.text and "clients_per_round / 20" in response.text
    assert "calibrated for target_epsilon" in calibrated.text
    assert sqlite_api.client.get("/v1/federated/tasks", headers=auth("analyst")).json() == []
    fixed = task_body(adaptive_clipping={"count_noise": 5.0})
    assert sqlite_api.create(fixed).status_code == 201


def test_hostile_unclipped_bits_cannot_wreck_adaptive_clipping(api: Api) -> None:
    """Central: a bit of -1e6 is clipped to 0 and the round closes (it used to overflow
    exp and answer 500 for ever). Distributed: a bit no honest device sends is refused."""
    adaptive = {"count_noise": 5.0}
    api.create(task_body(adaptive_clipping=adaptive))
    for bit in (-1e6, 1.0, 1.0):
        assert api.send(upload(unclipped=bit)).status_code == 200
    status = api.status()
    assert status["round"] == 1 and status["history"][0]["clip_norm"] == 1.0
    assert math.exp(-1.0) <= status["clip_norm"] <= math.exp(1.0)
    api.create(task_body("spread", mode="distributed", adaptive_clipping=adaptive))
    share = api.round("spread").json()
    margin = 10 * 5.0 / math.sqrt(share["expected_clients"])
    for bit in (-1e6, -2000.0, 1e6, 1 + margin * 1.01, -margin * 1.01):
        refused = api.send(upload(unclipped=bit), "spread")
        assert refused.status_code == 422 and "unclipped" in refused.text, refused.text
    assert api.send(upload(unclipped=1 + margin * 0.99), "spread").status_code == 200
    assert api.status("spread")["updates_received"] == 1


def test_a_round_whose_aggregate_overflows_is_restarted(sqlite_api: Api) -> None:
    """Two finite uploads of 1e308 sum past the float range: the round is restarted (not
    a 500), counted, and honest uploads then close it."""
    from aggregator import observability as obs

    sqlite_api.create(task_body(mode="none", target_epsilon=None, min_clients=2))
    failed = obs.FEDERATED_FAILED_ROUNDS._value.get()
    for _ in range(2):
        assert sqlite_api.send(upload(values=np.full(NUM_PARAMS, 1e308))).status_code == 200
    closed = sqlite_api.client.post("/v1/federated/tasks/digits/close", headers=auth("admin"))
    assert closed.status_code == 409  # the round was restarted: its uploads are gone
    status = sqlite_api.status()
    assert status["round"] == 0 and status["attempt"] == 1 and status["updates_received"] == 0
    assert obs.FEDERATED_FAILED_ROUNDS._value.get() == failed + 1
    for _ in range(3):
        assert sqlite_api.send(upload(attempt=1)).status_code == 200
    assert sqlite_api.status()["round"] == 1


# --- real processes ------------------------------------------------------------------------


def _http_upload(server: Any, round_number: int, client: httpx.Client) -> int:
    response = client.post(
        f"{server.url}/v1/federated/tasks/shared/updates",
        json=upload(round_number),
        headers=server.headers("device"),
    )
    return response.status_code


@pytest.mark.slow
def test_task_survives_a_restart(tmp_path: Path, start_server: Callable[..., Any]) -> None:
    database = str(tmp_path / "restart.sqlite3")
    server = start_server(database)
    body = task_body("shared", clients_per_round=3)
    created = httpx.post(
        f"{server.url}/v1/federated/tasks",
        json=body,
        headers=server.headers("admin"),
        timeout=CALIBRATION_TIMEOUT,
    )
    assert created.status_code == 201, created.text
    with httpx.Client(timeout=30) as client:
        for _ in range(4):  # one round of three, and one upload into the next
            assert _http_upload(server, 0 if _ < 3 else 1, client) == 200
    before = httpx.get(
        f"{server.url}/v1/federated/tasks/shared", headers=server.headers("analyst")
    ).json()
    server.kill()
    again = start_server(database)
    after = httpx.get(
        f"{again.url}/v1/federated/tasks/shared", headers=again.headers("analyst")
    ).json()
    assert after["round"] == before["round"] == 1
    assert after["updates_received"] == 1
    assert after["epsilon_spent"] == before["epsilon_spent"]
    params = [
        httpx.get(f"{s.url}/v1/federated/tasks/shared/round", headers=s.headers("device")).json()
        for s in (again,)
    ]
    assert params[0]["round"] == 1


@pytest.mark.slow
def test_two_processes_on_postgresql_close_each_round_once(
    postgres_url: str, start_server: Callable[..., Any]
) -> None:
    """Two aggregators share PostgreSQL; 40 uploads arrive through both at once for rounds
    of 8: every upload is counted once and every round closes exactly once."""
    first = start_server(postgres_url)
    second = start_server(postgres_url)
    body = task_body("shared", clients_per_round=8, rounds=5, population=200)
    assert (
        httpx.post(
            f"{first.url}/v1/federated/tasks",
            json=body,
            headers=first.headers("admin"),
            timeout=CALIBRATION_TIMEOUT,
        ).status_code
        == 201
    )

    def send(index: int) -> int:
        server = (first, second)[index % 2]
        with httpx.Client(timeout=30) as client:
            while True:
                current = client.get(
                    f"{server.url}/v1/federated/tasks/shared/round",
                    headers=server.headers("device"),
                ).json()["round"]
                status = _http_upload(server, current, client)
                if status == 200:
                    return current
                assert status == 409  # the round closed (or filled) since it was read: again

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(send, range(40)))
    status = httpx.get(
        f"{second.url}/v1/federated/tasks/shared", headers=second.headers("analyst")
    ).json()
    assert status["state"] == "completed"
    assert status["participants"] == [8, 8, 8, 8, 8]
