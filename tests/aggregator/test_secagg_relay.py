"""The aggregator's secure aggregation relay, through its HTTP API, in process.

Devices are simulated with :class:`shared.federated.secagg.SecAggClient` speaking to the
``/v1/federated/tasks/{name}/rounds/{round}/secagg/...`` endpoints (FastAPI
``TestClient``), each with a random integer vector as its lattice input (a ``distributed``
task's device sends its clipped, rounded and noised update there; the relay cannot tell
the difference). The relay must hand ``TaskState.close_secure_round`` exactly the sum of
the inputs of the devices whose masked inputs it unmasked: checked by applying the same
call to the task's state as stored before the round, with the sum computed here, and
comparing the models bit for bit (the step is deterministic given the sum; nothing is
approximated, so no tolerance).

Deadlines are driven by a settable clock: a step past its deadline closes (or restarts
the round) at the next request or ``Federated.tick``.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from aggregator import observability as obs
from aggregator.app import create_app
from aggregator.auth import bootstrap_keys
from aggregator.repositories.database import Database
from aggregator.repositories.schema import SCHEMA_VERSION, SECAGG_TABLES, schema_info
from aggregator.settings import Settings
from shared.federated.secagg import (
    PublicKeys,
    Roster,
    RoundContext,
    SecAggClient,
    SecAggParameters,
    encode_ring,
)
from shared.federated.secagg_messages import SESSION_HEADER
from shared.federated.task import TaskState

KEYS = {
    "admin": "sa-test-admin-key-0123456789",
    "analyst": "sa-test-analyst-key-0123456789",
    "device": "sa-test-device-key-0123456789",
}
MODEL = {"kind": "logistic", "num_features": 4, "num_classes": 3}
STEP_TIMEOUT = 30.0
#: Lattice inputs are drawn from [-INPUT, INPUT]: far inside any ring a task plans.
INPUT = 50


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


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

    def create(
        self, devices: int, min_clients: int = 2, expect: int = 201, **spec: Any
    ) -> httpx.Response:
        """Create the secure task ``sec``; its answer must have the ``expect`` status."""
        config = {
            "model": MODEL,
            "mode": "distributed",
            "rounds": 10,
            "population": 1000,
            "clients_per_round": devices,
            "min_clients": min_clients,
            "target_epsilon": 8.0,  # calibrated: every planned round fits the budget
            "accounting": "rdp",
            "clip_norm": 1.0,
            "secure_aggregation": {"step_timeout_seconds": STEP_TIMEOUT, **spec},
        }
        body = {"name": "sec", "config": config}
        response = self.client.post("/v1/federated/tasks", json=body, headers=auth("admin"))
        assert response.status_code == expect, response.text
        return response

    def status(self) -> dict[str, Any]:
        response = self.client.get("/v1/federated/tasks/sec", headers=auth("analyst"))
        assert response.status_code == 200, response.text
        return dict(response.json())

    def secagg(self, round_number: int = 0, role: str = "analyst") -> dict[str, Any]:
        response = self.client.get(
            f"/v1/federated/tasks/sec/rounds/{round_number}/secagg", headers=auth(role)
        )
        assert response.status_code == 200, response.text
        return dict(response.json())

    def state(self) -> TaskState:
        row = self.app.state.federated.repository.task("sec")
        assert row is not None
        return TaskState.from_json(json.loads(row.state))

    def pass_deadline(self) -> None:
        """Move past the open step's deadline and let the service notice."""
        self.clock.now = self.secagg(self.status()["round"])["deadline"] + 1.0
        self.app.state.federated.tick()

    def secure_rows(self) -> int:
        database = self.app.state.federated.secagg.repository.database
        with database.read() as conn:
            return sum(
                int(conn.execute(select(func.count()).select_from(table)).scalar_one())
                for table in SECAGG_TABLES
            )


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
    with running(str(tmp_path / "secagg.sqlite3")) as service:
        yield service


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Device:
    """One simulated device in one attempt of a round."""

    api: Api
    round: int
    attempt: int
    session: uuid.UUID = field(default_factory=uuid.uuid4)
    index: int = -1

    def __post_init__(self) -> None:
        self.client = SecAggClient(RoundContext("sec", self.round, self.attempt))
        self.keys = self.client.advertise()

    @property
    def base(self) -> str:
        return f"/v1/federated/tasks/sec/rounds/{self.round}/secagg"

    def headers(self) -> dict[str, str]:
        return auth("device") | {SESSION_HEADER: str(self.session)}

    def post(self, step: str, body: dict[str, Any]) -> httpx.Response:
        return self.api.client.post(f"{self.base}/{step}", json=body, headers=self.headers())

    def get(self, step: str) -> httpx.Response:
        return self.api.client.get(f"{self.base}/{step}", headers=self.headers())

    def keys_body(self, keys: PublicKeys | None = None) -> dict[str, Any]:
        keys = keys or self.keys
        return {
            "attempt": self.attempt,
            "encryption_key": b64(keys.encryption_key),
            "masking_key": b64(keys.masking_key),
        }

    def advertise(self) -> httpx.Response:
        response = self.post("keys", self.keys_body())
        if response.status_code == 200:
            self.index = response.json()["participant"]
        return response

    def roster(self) -> Roster:
        response = self.get("keys")
        assert response.status_code == 200, response.text
        out = response.json()
        parameters = SecAggParameters(
            out["vector_length"], out["modulus_bits"], out["neighbours"], out["threshold"]
        )
        keys = tuple(
            PublicKeys(base64.b64decode(p["encryption_key"]), base64.b64decode(p["masking_key"]))
            for p in out["participants"]
        )
        return Roster(RoundContext("sec", self.round, self.attempt), parameters, keys)

    def shares_body(self, roster: Roster) -> dict[str, Any]:
        shares = self.client.share_keys(roster, self.index)
        return {"shares": [{"recipient": r, "ciphertext": b64(c)} for r, c in shares.items()]}

    def masked_body(self, roster: Roster, values: np.ndarray) -> dict[str, Any]:
        response = self.get("shares")
        assert response.status_code == 200, response.text
        inbox = {s["sender"]: base64.b64decode(s["ciphertext"]) for s in response.json()["shares"]}
        masked = self.client.mask(inbox, values)
        return {"masked": b64(encode_ring(masked, roster.parameters.modulus_bits))}

    def unmask_body(self) -> dict[str, Any]:
        response = self.get("unmask")
        assert response.status_code == 200, response.text
        request = response.json()
        seeds, secret_keys = self.client.unmask(request["survivors"], request["dropped"])
        return {
            "mask_seed_shares": [{"owner": o, "share": b64(s)} for o, s in seeds.items()],
            "secret_key_shares": [{"owner": o, "share": b64(s)} for o, s in secret_keys.items()],
        }


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def joined(api: Api, count: int) -> list[Device]:
    """``count`` devices that advertised keys in the open attempt."""
    status = api.status()
    devices = [Device(api, status["round"], status["attempt"]) for _ in range(count)]
    for device in devices:
        ok(device.advertise())
    return devices


@dataclass
class Round:
    """The devices of a round run through the steps, and the inputs of those in the sum."""

    devices: list[Device]
    roster: Roster
    inputs: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def total(self) -> np.ndarray:
        return np.stack([self.inputs[i] for i in sorted(self.inputs)]).sum(axis=0)


def run_round(
    api: Api,
    count: int,
    seed: int,
    drop_shares: frozenset[int] = frozenset(),
    drop_masked: frozenset[int] = frozenset(),
    drop_unmask: frozenset[int] = frozenset(),
    finish: bool = True,
) -> Round:
    """One round of ``count`` devices, each dropping out before the step whose set names
    its index; a step with dropouts closes at its deadline (with ``finish`` False the
    last step's deadline passes unnoticed: nothing closes it yet)."""
    devices = joined(api, count)
    roster = devices[0].roster()
    rng = np.random.default_rng(seed)
    length = roster.parameters.vector_length
    played = Round(devices, roster)
    steps = [
        (drop_shares, lambda d: d.post("shares", d.shares_body(roster))),
        (drop_masked, lambda d: d.post("masked", masked(d))),
        (drop_unmask, lambda d: d.post("unmask", d.unmask_body())),
    ]
    gone: set[int] = set()

    def masked(device: Device) -> dict[str, Any]:
        values = rng.integers(-INPUT, INPUT + 1, size=length, dtype=np.int64)
        played.inputs[device.index] = values
        return device.masked_body(roster, values)

    for number, (dropped, send) in enumerate(steps):
        gone |= dropped
        for device in devices:
            if device.index not in gone:
                ok(send(device))
        if dropped and (finish or number < len(steps) - 1):
            api.pass_deadline()
        elif dropped:
            api.clock.now = api.secagg()["deadline"] + 1.0
    return played


def expected_after(before: TaskState, total: np.ndarray, participants: int) -> TaskState:
    """The task's state after a secure round whose unmasked sum is ``total``."""
    state = TaskState.from_json(before.to_json())
    state.close_secure_round(total, participants)
    return state


# --- a full round --------------------------------------------------------------------------


def test_a_full_round_closes_with_the_exact_sum(api: Api) -> None:
    api.create(devices=5)
    before = api.state()
    status = api.secagg(0)
    assert (status["step"], status["advertised"]) == ("keys", 0)
    played = run_round(api, 5, seed=1)
    after = api.status()
    assert (after["round"], after["participants"]) == (1, [5])
    expected = expected_after(before, played.total, 5)
    np.testing.assert_array_equal(api.state().server.params, expected.server.params)
    assert api.state().accountant_rounds == expected.accountant_rounds
    assert api.secure_rows() == 0  # every secure row of the round deleted
    # The next round runs the same way, with fresh keys.
    assert api.secagg(1, role="device")["step"] == "keys"
    before = api.state()
    played = run_round(api, 5, seed=2)
    expected = expected_after(before, played.total, 5)
    np.testing.assert_array_equal(api.state().server.params, expected.server.params)


@pytest.mark.parametrize(
    ("shares", "masked", "unmask"),
    [
        (frozenset({3}), frozenset(), frozenset()),  # 10% before sending shares
        (frozenset(), frozenset({7}), frozenset()),  # 10% before the masked input
        (frozenset(), frozenset(), frozenset({0})),  # 10% before unmasking
        (frozenset({1}), frozenset({4}), frozenset({8})),  # 30%, one at each step
    ],
)
def test_dropouts_at_each_step_still_close_the_round(
    sqlite_api: Api, shares: frozenset[int], masked: frozenset[int], unmask: frozenset[int]
) -> None:
    """Ten devices, planned for 30% dropouts: the sum is that of the devices whose masked
    input arrived (a device gone before the unmask step is still in it)."""
    sqlite_api.create(devices=10)
    before = sqlite_api.state()
    played = run_round(sqlite_api, 10, seed=3, drop_shares=shares, drop_masked=masked,
                       drop_unmask=unmask)  # fmt: skip
    included = set(range(10)) - shares - masked
    assert set(played.inputs) == included
    assert sqlite_api.status()["participants"] == [len(included)]
    expected = expected_after(before, played.total, len(included))
    np.testing.assert_array_equal(sqlite_api.state().server.params, expected.server.params)
    assert sqlite_api.secure_rows() == 0


# --- restarts ------------------------------------------------------------------------------


def test_too_few_unmask_answers_restart_the_round_and_release_nothing(sqlite_api: Api) -> None:
    """Five devices on the complete graph (k = 4, t = 3): with two answers no self-mask
    seed has t shares, so nothing is unmasked; the round restarts with no rows left."""
    sqlite_api.create(devices=5)
    before = sqlite_api.state()
    restarts = obs.SECAGG_ROUNDS.labels("restarted", "unmask")._value.get()
    run_round(sqlite_api, 5, seed=4, drop_unmask=frozenset({0, 1, 2}))
    status = sqlite_api.status()
    assert (status["round"], status["attempt"], status["participants"]) == (0, 1, [])
    assert status["epsilon_spent"] == 0.0
    np.testing.assert_array_equal(sqlite_api.state().server.params, before.server.params)
    assert obs.SECAGG_ROUNDS.labels("restarted", "unmask")._value.get() == restarts + 1
    assert sqlite_api.secure_rows() == 0
    # The new attempt runs and closes.
    played = run_round(sqlite_api, 5, seed=5)
    expected = expected_after(before, played.total, 5)
    np.testing.assert_array_equal(sqlite_api.state().server.params, expected.server.params)


def test_too_few_keys_by_the_deadline_restart_and_old_sessions_are_stale(api: Api) -> None:
    api.create(devices=5, min_clients=3)
    early = joined(api, 2)
    waiting = early[0].get("keys")
    assert waiting.status_code == 425 and int(waiting.headers["Retry-After"]) >= 1
    api.pass_deadline()
    status = api.secagg(0)
    assert (status["attempt"], status["step"], status["advertised"]) == (1, "keys", 0)
    assert api.secure_rows() == 0
    late = early[1].advertise()  # keys for attempt 0
    assert late.status_code == 409 and late.json()["errors"][0]["field"] == "attempt"
    gone = early[0].get("keys")
    assert gone.status_code == 409 and "restarted" in gone.json()["detail"]
    assert len(joined(api, 5)) == 5
    assert api.secagg(0)["step"] == "shares"


# --- idempotence and refusals ------------------------------------------------------------


def test_retries_are_duplicates_and_other_content_conflicts(sqlite_api: Api) -> None:
    sqlite_api.create(devices=3)
    devices = joined(sqlite_api, 3)
    first = devices[0]
    again = ok(first.post("keys", first.keys_body()))
    assert again == {"participant": first.index, "duplicate": True}
    other = SecAggClient(RoundContext("sec", 0, 0)).advertise()
    assert first.post("keys", first.keys_body(other)).status_code == 409
    late = Device(sqlite_api, 0, 0).advertise()  # the round is full: the step closed
    assert late.status_code == 409
    roster = first.roster()
    body = first.shares_body(roster)
    assert ok(first.post("shares", body)) == {"step": "shares", "duplicate": False}
    assert ok(first.post("shares", body)) == {"step": "shares", "duplicate": True}
    changed = base64.b64decode(body["shares"][0]["ciphertext"])
    changed = bytes([changed[0] ^ 1]) + changed[1:]
    other_shares = {
        "shares": [dict(body["shares"][0], ciphertext=b64(changed))] + body["shares"][1:]
    }
    conflict = first.post("shares", other_shares)
    assert conflict.status_code == 409 and conflict.json()["title"] == "Conflicting message"
    for device in devices[1:]:
        ok(device.post("shares", device.shares_body(roster)))
    length = roster.parameters.vector_length
    masked = first.masked_body(roster, np.zeros(length, dtype=np.int64))
    assert ok(first.post("masked", masked))["duplicate"] is False
    assert ok(first.post("masked", masked))["duplicate"] is True
    raw = base64.b64decode(masked["masked"])
    other_input = bytes(roster.parameters.dtype.itemsize) + raw[roster.parameters.dtype.itemsize :]
    assert other_input != raw  # (a masked word is 0 with probability 2^-b)
    assert first.post("masked", {"masked": b64(other_input)}).status_code == 409


def test_steps_not_yet_closed_answer_425(sqlite_api: Api) -> None:
    sqlite_api.create(devices=3)
    devices = joined(sqlite_api, 3)
    roster = devices[0].roster()
    ok(devices[0].post("shares", devices[0].shares_body(roster)))
    for step in ("shares", "unmask"):
        early = devices[0].get(step)
        assert early.status_code == 425 and early.headers["Retry-After"] == "1"
        assert early.headers["content-type"] == "application/problem+json"
    status = sqlite_api.secagg(0, role="device")
    assert (status["step"], status["advertised"], status["shared"]) == ("shares", 3, 1)


def test_bad_messages_are_refused_naming_the_field(sqlite_api: Api) -> None:
    sqlite_api.create(devices=4, neighbours=2)
    devices = joined(sqlite_api, 4)
    plain = sqlite_api.client.post(
        "/v1/federated/tasks/sec/updates",
        json={"update_id": str(uuid.uuid4()), "round": 0, "update": b64(bytes(8 * 15))},
        headers=auth("device"),
    )
    assert plain.status_code == 409 and "/secagg/" in plain.json()["detail"]
    close = sqlite_api.client.post("/v1/federated/tasks/sec/close", headers=auth("admin"))
    assert close.status_code == 409 and "four steps" in close.json()["detail"]
    me = devices[0]
    roster = me.roster()
    neighbours = roster.neighbours(me.index)
    assert len(neighbours) == 2
    stranger = next(i for i in range(4) if i != me.index and i not in neighbours)
    body = me.shares_body(roster)
    wrong = {"shares": [dict(body["shares"][0], recipient=stranger), body["shares"][1]]}
    refused = me.post("shares", wrong)
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "shares[0].recipient"
    assert str(stranger) in refused.json()["errors"][0]["message"]
    short = me.post("shares", {"shares": body["shares"][:1]})
    assert short.status_code == 422 and short.json()["errors"][0]["field"] == "shares"
    assert sqlite_api.secagg(0)["shared"] == 0  # nothing stored
    for device in devices:
        ok(device.post("shares", device.shares_body(roster)))
    length, bits = roster.parameters.vector_length, roster.parameters.modulus_bits
    masked = me.masked_body(roster, np.zeros(length, dtype=np.int64))
    raw = base64.b64decode(masked["masked"])
    word = roster.parameters.dtype.itemsize
    bad = [b64(raw[:-word]), b64(raw + raw[:word]), "!" * len(masked["masked"])]
    assert bits % 32, f"a {bits}-bit ring fills its words: no value past 2^b to send"
    bad.append(b64((1 << bits).to_bytes(word, "little") + raw[word:]))  # 2^b: outside
    for text in bad:
        refused = me.post("masked", {"masked": text})
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "masked"
    assert sqlite_api.secagg(0)["masked"] == 0
    bad_session = sqlite_api.client.get(
        f"{me.base}/shares", headers=auth("device") | {SESSION_HEADER: "not-a-uuid"}
    )
    assert bad_session.status_code == 422


def test_secure_tasks_that_cannot_run_are_refused_and_plain_tasks_have_no_steps(
    sqlite_api: Api,
) -> None:
    refused = sqlite_api.create(devices=1, expect=422)  # a sum of one input is that input
    assert refused.json()["errors"][0]["field"] == "config.max_clients"
    large = {
        "model": MODEL, "mode": "distributed", "rounds": 2, "population": 10**6,
        "clients_per_round": 10_001, "noise_multiplier": 1.0, "secure_aggregation": {},
    }  # fmt: skip
    too_many = sqlite_api.client.post(  # a roster past the bound: 10,001 devices' keys
        "/v1/federated/tasks", json={"name": "large", "config": large}, headers=auth("admin")
    )
    assert too_many.status_code == 422, too_many.text
    assert too_many.json()["errors"][0]["field"] == "config.max_clients"
    assert "at most 10000 may share one round" in too_many.json()["detail"]
    config = {
        "model": MODEL, "mode": "distributed", "rounds": 2, "population": 100,
        "clients_per_round": 5, "target_epsilon": 8.0, "accounting": "rdp",
    }  # fmt: skip
    created = sqlite_api.client.post(
        "/v1/federated/tasks", json={"name": "plain", "config": config}, headers=auth("admin")
    )
    assert created.status_code == 201, created.text
    steps = sqlite_api.client.get(
        "/v1/federated/tasks/plain/rounds/0/secagg", headers=auth("analyst")
    )
    assert steps.status_code == 409 and steps.json()["title"] == "Other aggregation"


# --- exactly once --------------------------------------------------------------------------


def test_two_closers_of_one_secure_round_commit_exactly_once(
    sqlite_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both closers compute the round's close (held until both have) before either
    commits: exactly one commits, the round is counted once."""
    sqlite_api.create(devices=4)
    run_round(sqlite_api, 4, seed=6, drop_unmask=frozenset({3}), finish=False)
    relay = sqlite_api.app.state.federated.secagg
    assert relay.repository.progress("sec", 0, 0).step == "unmask"  # overdue, not closed
    barrier = threading.Barrier(2, timeout=30)
    original = TaskState.close_secure_round

    def held(self: TaskState, *args: Any, **kwargs: Any) -> Any:
        record = original(self, *args, **kwargs)
        barrier.wait()
        return record

    monkeypatch.setattr(TaskState, "close_secure_round", held)
    closed = obs.SECAGG_ROUNDS.labels("closed", "unmask")._value.get()
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(relay.advance("sec")))
               for _ in range(2)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 2 and all(r is not None and r.round == 1 for r in results)
    assert obs.SECAGG_ROUNDS.labels("closed", "unmask")._value.get() == closed + 1
    assert sqlite_api.status()["participants"] == [4]
    assert len(sqlite_api.state().history) == 1


# --- schema upgrade ------------------------------------------------------------------------


def test_a_version_3_database_is_upgraded(database_url: str) -> None:
    """Version 3 had no secure aggregation tables: the upgrade adds them."""
    database = Database(database_url)
    try:
        with database.write() as conn:
            for table in reversed(SECAGG_TABLES):
                conn.exec_driver_sql(f"DROP TABLE {table.name}")
            conn.execute(
                update(schema_info).where(schema_info.c.key == "schema_version").values(value="3")
            )
    finally:
        database.close()
    upgraded = Database(database_url)
    try:
        with upgraded.read() as conn:
            version = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one()
            counts = [
                conn.execute(select(func.count()).select_from(table)).scalar_one()
                for table in SECAGG_TABLES
            ]
        assert version == str(SCHEMA_VERSION) and counts == [0] * len(SECAGG_TABLES)
    finally:
        upgraded.close()
