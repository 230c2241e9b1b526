"""The silo mode over the service: silos (``FederatedClient``) run DP-SGD over their
records; the service and every silo report the same epsilon per record; a round past the
target is refused by the service, and an upload past its budget by the silo itself.

In process (FastAPI TestClient over SQLite), silos seeded for reproducibility.
"""

from __future__ import annotations

import base64
import functools
import math
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.settings import Settings
from client.federated import (
    DeviceBudgetExhaustedError,
    FederatedClient,
    TaskFinishedError,
    TaskRefusedError,
)
from shared import accounting
from shared.accounting import gaussian_epsilon

KEYS = {
    "admin": "silo-test-admin-key-0123456789",
    "analyst": "silo-test-analyst-key-0123456789",
    "device": "silo-test-device-key-0123456789",
}
DELTA = 1e-5
RATE, STEPS = 0.1, 4
NUM_PARAMS = (4 + 1) * 3


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Service:
    client: TestClient
    app: FastAPI
    clock: Clock

    def create(self, name: str, **config: Any) -> dict[str, Any]:
        values: dict[str, Any] = {
            "model": {"kind": "logistic", "num_features": 4, "num_classes": 3},
            "mode": "silo",
            "rounds": 3,
            "population": 3,
            "clients_per_round": 3,
            "target_epsilon": 1.5,
            "dpsgd": {"sample_rate": RATE, "steps": STEPS, "learning_rate": 0.5},
            "round_timeout_seconds": 60,
        }
        values.update(config)
        body = {"name": name, "config": {k: v for k, v in values.items() if v is not None}}
        response = self.client.post("/v1/federated/tasks", json=body, headers=auth("admin"))
        assert response.status_code == 201, response.text
        return dict(response.json())

    def status(self, name: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/federated/tasks/{name}", headers=auth("analyst"))
        assert response.status_code == 200, response.text
        return dict(response.json())

    def silos(self, name: str, count: int, **options: Any) -> list[FederatedClient]:
        """``count`` silos; each capped one keeps its ledger in a directory of its own."""
        rng = np.random.default_rng(7)
        capped = "max_epsilon" in options
        return [
            FederatedClient(
                "http://testserver", KEYS["device"], name,
                (rng.normal(size=(40, 4)), rng.integers(0, 3, size=40)),
                rng=np.random.default_rng(100 + i), http=self.client,
                state_dir=tempfile.mkdtemp(prefix="ldp-silo-") if capped else None, **options,
            )
            for i in range(count)
        ]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def calibrate_each_task_once() -> Iterator[None]:
    """The tasks below calibrate the same noise (target 1.5 over 3 rounds of 4 steps at
    0.1), seconds each: the module keeps each result, computed once for real."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            accounting,
            "calibrate_noise_multiplier",
            functools.cache(accounting.calibrate_noise_multiplier),
        )
        yield


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    app = create_app(Settings(database=str(tmp_path / "silo.sqlite3"), compaction_interval=0))
    clock = Clock()
    app.state.federated.clock = clock
    environment = {f"LDP_{role.upper()}_KEYS": key for role, key in KEYS.items()}
    assert bootstrap_keys(app.state.keys, app.state.services.repositories.keys, environment) is None
    with TestClient(app) as client:
        yield Service(client, app, clock)


def rounds_within(z: float, target: float) -> int:
    """The most rounds whose steps keep a silo's epsilon within ``target``."""
    rounds = 0
    while silo_epsilon(z, (rounds + 1) * STEPS) <= target:
        rounds += 1
    return rounds


def silo_epsilon(z: float, steps: int) -> float:
    """A silo's epsilon per record after ``steps`` DP-SGD steps of discrete Gaussian noise,
    as the service and the device account it."""
    return gaussian_epsilon(z, RATE, steps, DELTA, mechanism="discrete_gaussian")


def test_silos_train_and_report_the_epsilon_the_service_reports(service: Service) -> None:
    created = service.create("hospitals")
    assert created["mode"] == "silo" and created["silo_steps"] == 0
    z = created["noise_multiplier"]
    silos = service.silos("hospitals", 3, max_epsilon=1.5)  # the noise is theirs: no trust
    models = []
    for _ in range(3):
        info = silos[0].fetch_round()
        models.append(info.vector)
        assert all(silo.run_round(info).uploaded for silo in silos)  # the third closes it
    assert not np.array_equal(models[0], models[1])  # the averaged DP-SGD updates moved it
    status = service.status("hospitals")
    assert status["state"] == "completed" and status["round"] == 3
    assert status["silo_steps"] == 3 * STEPS
    expected = silo_epsilon(z, 3 * STEPS)
    assert status["epsilon_spent"] == pytest.approx(expected, rel=1e-12)
    assert 1.5 * (1 - 1e-3) <= status["epsilon_spent"] <= 1.5
    for silo in silos:  # each silo's own ledger: every step of every upload it made
        assert silo.epsilon_spent() == pytest.approx(expected, rel=1e-9)
    with pytest.raises(TaskFinishedError):
        silos[0].fetch_round()
    assert [r["participants"] for r in status["history"]] == [3, 3, 3]


def test_the_service_refuses_a_round_past_the_target(service: Service) -> None:
    """Noise fixed at z = 1.5 and a target of 1.5: rounds run while the epsilon after one
    more stays within 1.5; then the task is budget_exhausted and refuses the next round."""
    z, target = 1.5, 1.5
    service.create("capped", noise_multiplier=z, target_epsilon=target, rounds=50,
                   population=1, clients_per_round=1)  # fmt: skip
    allowed = rounds_within(z, target)
    (silo,) = service.silos("capped", 1)
    rounds = 0
    with pytest.raises(TaskFinishedError, match="exceed its privacy budget"):
        while True:
            assert silo.run_round().uploaded
            rounds += 1
    assert rounds == allowed
    status = service.status("capped")
    assert status["state"] == "budget_exhausted" and status["round"] == allowed
    assert status["epsilon_spent"] <= target < silo_epsilon(z, (allowed + 1) * STEPS)
    body = {"update_id": str(uuid.uuid4()), "round": allowed,
            "update": base64.b64encode(np.zeros(NUM_PARAMS).tobytes()).decode()}  # fmt: skip
    refused = service.client.post(
        "/v1/federated/tasks/capped/updates", json=body, headers=auth("device")
    )
    assert refused.status_code == 409


def test_a_silo_refuses_to_train_past_its_budget(service: Service) -> None:
    """An attempt the service restarted (too few uploads by its deadline) cost the silo
    that uploaded to it: its ledger holds one upload more than the service charged, so it
    stops one round before the service would, on the task's own target."""
    z, target = 1.5, 1.5
    service.create("restarts", noise_multiplier=z, target_epsilon=target, rounds=50,
                   population=2, clients_per_round=2, min_clients=2)  # fmt: skip
    allowed = rounds_within(z, target)
    eager, late = service.silos("restarts", 2)
    assert eager.run_round().uploaded  # alone in attempt 0
    service.clock.now += 61
    service.app.state.federated.tick()  # restarted: the upload is discarded unread
    assert service.status("restarts")["attempt"] == 1
    for _ in range(allowed - 1):
        info = late.fetch_round()
        assert eager.run_round(info).uploaded and late.run_round(info).uploaded
    with pytest.raises(DeviceBudgetExhaustedError, match=f"past its cap of {target:g}"):
        eager.run_round()
    assert eager.epsilon_spent() <= target
    status = service.status("restarts")
    assert status["state"] == "running" and status["round"] == allowed - 1


def test_silo_updates_have_no_norm_bound_but_must_be_finite(service: Service) -> None:
    service.create("norms")
    for values, code in ((np.full(NUM_PARAMS, 1e6), 200), (np.full(NUM_PARAMS, math.nan), 422)):
        body = {"update_id": str(uuid.uuid4()), "round": 0,
                "update": base64.b64encode(values.astype("<f8").tobytes()).decode()}  # fmt: skip
        response = service.client.post(
            "/v1/federated/tasks/norms/updates", json=body, headers=auth("device")
        )
        assert response.status_code == code, response.text


def test_a_silo_checks_the_plan_against_its_own_cap(service: Service) -> None:
    service.create("plan")
    (modest,) = service.silos("plan", 1, max_epsilon=1.0)
    with pytest.raises(TaskRefusedError, match="mode 'silo'"):
        modest.fetch_round()
    (willing,) = service.silos("plan", 1, max_epsilon=1.5)
    info = willing.fetch_round()
    assert willing.planned_epsilon(info) == pytest.approx(
        silo_epsilon(info.noise_multiplier, 3 * STEPS), rel=1e-9
    )


def test_a_ledger_from_before_silos_reads_as_unsampled_releases(tmp_path: Path) -> None:
    """A format 1 ledger (one release at rate 1 per upload, as the local mode wrote it)
    keeps counting: its releases at rate 1, its uploads their number, and a silo's charge
    adds its steps at their own rate beside them."""
    import json

    from client.federated_ledger import FederatedLedger, _checksum, device_releases_epsilon

    ledger = FederatedLedger("http://aggregator", "legacy", tmp_path)
    body = {"format": 1, "endpoint": "http://aggregator", "task": "legacy", "delta": DELTA,
            "releases": [[0.8, 3]]}  # fmt: skip
    path = ledger._path  # where the ledger of this endpoint and task lives
    assert path is not None
    path.write_text(json.dumps({"body": body, "checksum": _checksum(body)}))
    assert ledger.releases() == {(0.8, 1.0): 3} and ledger.uploads() == 3
    assert ledger.charge(1.5, DELTA, None, sample_rate=RATE, releases=STEPS).charged
    assert ledger.releases() == {(0.8, 1.0): 3, (1.5, RATE): STEPS} and ledger.uploads() == 4
    expected = device_releases_epsilon({(0.8, 1.0): 3, (1.5, RATE): STEPS}, DELTA)
    assert ledger.epsilon() == expected
