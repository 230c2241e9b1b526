"""Closing federated rounds by compare-and-swap, at the service (``Federated`` over
``TasksRepository``, no FastAPI), on SQLite and on PostgreSQL.

A round's close (aggregation, noise, the model's step, accounting) is computed outside
any lock or transaction and committed only if the task and its round are still as read.
Checked by holding that computation (``TaskState.close_round``) on events:

* two closers of one round both compute before either commits: exactly one result is
  stored, the other's never (the central mode's noise makes the two results differ), and
  the round is counted once;
* while a round's computation is held, report ingestion, reads of the task and uploads
  all finish (SQLite has one writer: a computation inside the write transaction would
  hold them all), and an upload to the full round is refused as closing;
* a close computed before an upload arrived is discarded and computed again with it.

The tasks use a fixed noise multiplier and RDP accounting, so that nothing calibrates.
Every wait has a timeout: a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aggregator import observability as obs
from aggregator.federated import Federated, StaleRoundError
from aggregator.service import Services
from aggregator.settings import Settings
from aggregator.storage import Repositories
from shared.federated.messages import TaskCreate, UpdateUpload
from shared.federated.task import TaskConfig, TaskState
from shared.federated.vectors import encode_vector
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec, MetricDefinition, ReportBatch

NUM_PARAMS = (4 + 1) * 3
#: Longest any step may take before the test calls it stuck.
PATIENCE = 30.0
GRR = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 1.0, "domain_size": 3})


class Clock:
    """A fixed time: no deadline passes unless a test moves it."""

    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def storage(database_url: str) -> Iterator[Repositories]:
    store = Repositories.open(database_url)
    yield store
    store.close()


@pytest.fixture
def federated(storage: Repositories) -> Federated:
    return Federated(storage.tasks, Clock())


def create(federated: Federated, clients_per_round: int, min_clients: int = 2) -> None:
    config = TaskConfig.model_validate(
        {
            "model": {"kind": "logistic", "num_features": 4, "num_classes": 3},
            "mode": "central",
            "rounds": 3,
            "population": 100,
            "clients_per_round": clients_per_round,
            "min_clients": min_clients,
            "noise_multiplier": 1.0,
            "accounting": "rdp",
            "clip_norm": 1.0,
            "round_timeout_seconds": 60,
        }
    )
    federated.create(TaskCreate(name="t", config=config))


def upload(federated: Federated) -> bool:
    """One upload for round 0; whether it was accepted."""
    body = UpdateUpload(
        update_id=uuid.uuid4(), round=0, update=encode_vector(np.full(NUM_PARAMS, 0.01))
    )
    return federated.upload("t", body).accepted


def hold_close_round(
    monkeypatch: pytest.MonkeyPatch, hold: Callable[[TaskState, np.ndarray], None]
) -> None:
    """Run ``hold(state, updates)`` after each ``TaskState.close_round`` has computed."""
    original = TaskState.close_round

    def held(self: TaskState, updates: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        record = original(self, updates, *args, **kwargs)
        hold(self, updates)
        return record

    monkeypatch.setattr(TaskState, "close_round", held)


def started(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``target`` running on a thread; the list receives its result or its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def stored_state(storage: Repositories) -> dict[str, Any]:
    task = storage.tasks.task("t")
    assert task is not None
    return dict(json.loads(task.state))


def test_two_closers_of_one_round_store_exactly_one_result(
    federated: Federated, storage: Repositories, monkeypatch: pytest.MonkeyPatch
) -> None:
    create(federated, clients_per_round=3)
    for _ in range(2):
        assert upload(federated)
    computed: list[dict[str, Any]] = []
    lock = threading.Lock()
    both_computed = threading.Barrier(2, timeout=PATIENCE)

    def hold(state: TaskState, updates: np.ndarray) -> None:
        with lock:
            computed.append(state.to_json())
        both_computed.wait()  # neither commits before both have computed

    hold_close_round(monkeypatch, hold)
    rounds = obs.FEDERATED_ROUNDS._value.get()
    closers = [started(lambda: federated.close("t")) for _ in range(2)]
    for thread, _ in closers:
        thread.join(PATIENCE)
    outcomes = [outcome for _, outcome in closers]
    assert all(len(o) == 1 and not isinstance(o[0], BaseException) for o in outcomes), outcomes
    assert [o[0].round for o in outcomes] == [1, 1]

    assert len(computed) == 2 and computed[0]["params"] != computed[1]["params"]  # own noise
    stored = stored_state(storage)
    assert stored in computed  # one closer's result, exactly as it computed it ...
    (lost,) = [state for state in computed if state != stored]
    assert stored["params"] != lost["params"]  # ... and never the other's
    assert [record["participants"] for record in stored["history"]] == [2]
    assert obs.FEDERATED_ROUNDS._value.get() == rounds + 1
    assert federated.status("t").participants == [2]


def test_ingest_reads_and_uploads_proceed_while_a_round_is_computed(
    federated: Federated, storage: Repositories, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    settings = Settings(database=database_url, compaction_interval=0)
    service = Services.over(settings, storage).aggregator
    service.define("colour", MetricDefinition(mechanism=GRR, labels=("a", "b", "c")))
    mechanism = make_mechanism(GRR)
    reports = mechanism.encode(np.array([0, 1, 2, 1]), rng=np.random.default_rng(5))
    batch = ReportBatch.model_validate(
        {
            "reports": [
                {"report_id": str(uuid.uuid4()), "metric": "colour", "version": 1, "payload": p}
                for p in mechanism.to_payloads(reports)
            ]
        }
    )
    create(federated, clients_per_round=3)
    for _ in range(2):
        assert upload(federated)
    computing, release = threading.Event(), threading.Event()

    def hold(state: TaskState, updates: np.ndarray) -> None:
        computing.set()
        assert release.wait(PATIENCE)

    hold_close_round(monkeypatch, hold)
    filler, filled = started(lambda: upload(federated))  # the third upload closes the round
    try:
        assert computing.wait(PATIENCE)
        ingest, ingested = started(lambda: service.ingest(batch))
        ingest.join(PATIENCE)
        assert ingested and ingested[0].accepted == 4, ingested
        status = federated.status("t")
        assert (status.round, status.updates_received) == (0, 3)
        with pytest.raises(StaleRoundError, match="holds its 3 uploads and is closing"):
            upload(federated)
        assert filler.is_alive() and not release.is_set()  # all of it while the round computed
    finally:
        release.set()
    filler.join(PATIENCE)
    assert filled == [True]
    assert federated.status("t").participants == [3]
    assert storage.reports.report_count() == 4


def test_a_close_computed_before_an_upload_arrived_is_computed_again(
    federated: Federated, storage: Repositories, monkeypatch: pytest.MonkeyPatch
) -> None:
    create(federated, clients_per_round=4)
    for _ in range(2):
        assert upload(federated)
    participants: list[int] = []
    computing, release = threading.Event(), threading.Event()

    def hold(state: TaskState, updates: np.ndarray) -> None:
        participants.append(updates.shape[0])
        computing.set()
        assert release.wait(PATIENCE)

    hold_close_round(monkeypatch, hold)
    rounds = obs.FEDERATED_ROUNDS._value.get()
    closer, closed = started(lambda: federated.close("t"))
    try:
        assert computing.wait(PATIENCE)
        assert upload(federated)  # the third of four: stored while the close computes
    finally:
        release.set()
    closer.join(PATIENCE)
    assert len(closed) == 1 and not isinstance(closed[0], BaseException), closed
    assert participants == [2, 3]  # the close of two was discarded, not stored
    assert closed[0].participants == [3] and closed[0].round == 1
    assert [record["participants"] for record in stored_state(storage)["history"]] == [3]
    assert obs.FEDERATED_ROUNDS._value.get() == rounds + 1
