"""A hostile federated server against a device that caps its own epsilon.

Attack: the server decides what the device is asked to do. It can serve the mode
``none`` (the device uploads its raw update), advertise ``target_epsilon = 1`` while
serving the noise multiplier ``1e-9`` (an essentially noise-free update), restart round 0
again and again (each attempt another independently noised upload, while the task
reports nothing spent), change the noise multiplier or the clip norm from round to
round, or read the bare clipped-or-not bit that came with each upload.

Defence: ``FederatedClient(max_epsilon=...)`` trusts none of the server's words. It
refuses the ``none`` mode, and the central and distributed modes unless told to trust
server noise; it recomputes the epsilon of the task from the parameters it is served
each round (never the advertised target) and refuses a plan above its cap; in the local
mode it charges every upload it makes to its own ledger, re-attempts included, at the
multiplier it really used, before the upload is sent, and stops at its cap; it sends the
clipped-or-not bit only where adaptive clipping uses it. The server here is a small real
HTTP server on a loopback port speaking the ``/v1/federated`` wire format
(``shared.federated.messages``); the tests count what it received and check with the
accountant that it is within the device's cap.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.federated import (
    DeviceBudgetExhaustedError,
    FederatedClient,
    FederatedError,
    TaskRefusedError,
)
from shared.accounting import gaussian_rounds_epsilon
from shared.federated.messages import decode_vector, encode_vector
from shared.federated.models import ModelSpec, make_model
from shared.federated.task import TaskConfig, calibrate

TASK = "hostile"
DELTA = 1e-5
SMALL = ModelSpec(kind="logistic", num_features=5, num_classes=3)
#: 200 features x 5 classes + 5 biases = 1,005 parameters: enough coordinates to measure
#: the noise's scale in one upload.
WIDE = ModelSpec(kind="logistic", num_features=200, num_classes=5)

Serve = Callable[[int], dict[str, Any]]


def config(mode: str = "local", model: ModelSpec = SMALL, **values: Any) -> TaskConfig:
    base: dict[str, Any] = {
        "model": model.model_dump(),
        "mode": mode,
        "rounds": 3,
        "population": 10,
        "clients_per_round": 10,
        "delta": DELTA,
    }
    if mode != "none" and "noise_multiplier" not in values:
        base["target_epsilon"] = 2.0
    return TaskConfig.model_validate(base | values)


def served(
    task: TaskConfig,
    *,
    round: int = 0,
    attempt: int = 0,
    noise_multiplier: float | None = None,
    clip_norm: float = 1.0,
) -> dict[str, Any]:
    """The JSON of ``GET .../round``; the noise multiplier is the honest calibration's
    unless given."""
    z = calibrate(task) if noise_multiplier is None else noise_multiplier
    params = np.zeros(make_model(task.model).num_params)
    return {
        "task": TASK,
        "round": round,
        "attempt": attempt,
        "state": "running",
        "config": task.model_dump(mode="json"),
        "noise_multiplier": z,
        "clip_norm": clip_norm,
        "sample_rate": task.sample_rate,
        "expected_clients": task.clients_per_round,
        "num_params": params.size,
        "parameters": encode_vector(params),
        "deadline": 0.0,
    }


class HostileServer:
    """``GET /v1/federated/tasks/{TASK}/round`` answers ``serve(n)`` for the n-th request
    (from 0); every upload is recorded and accepted (or answered ``upload_status``)."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.requests = 0
        self.uploads: list[dict[str, Any]] = []
        self.upload_status = 200
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server interface
                if self.path != f"/v1/federated/tasks/{TASK}/round":
                    return self._reply(404, {"detail": "no such path"})
                body = owner.serve(owner.requests)
                owner.requests += 1
                self._reply(200, body)

            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                if self.path != f"/v1/federated/tasks/{TASK}/updates":
                    return self._reply(404, {"detail": "no such path"})
                upload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if owner.upload_status != 200:
                    return self._reply(owner.upload_status, {"detail": "refused"})
                owner.uploads.append(upload)
                self._reply(200, {"accepted": True, "duplicate": False,
                                  "round": upload["round"],
                                  "updates_received": len(owner.uploads)})  # fmt: skip

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        # A short poll interval: shutdown() waits up to one interval (0.5 s by default).
        self.thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def hostile_server() -> Iterator[Callable[[Serve], HostileServer]]:
    servers: list[HostileServer] = []

    def start(serve: Serve) -> HostileServer:
        servers.append(HostileServer(serve))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def device(server: HostileServer, model: ModelSpec = SMALL, **options: Any) -> FederatedClient:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(20, model.num_features))
    y = rng.integers(0, model.num_classes, 20)
    if "max_epsilon" in options:  # a capped device keeps its ledger on disk
        options.setdefault("state_dir", tempfile.mkdtemp(prefix="ldp-federated-"))
    return FederatedClient(server.url, "device-key", TASK, (x, y), rng=rng, **options)


def accountant_epsilon(releases: dict[float, int]) -> float:
    """The project accountant's epsilon at DELTA of uploads (no sampling) with discrete
    Gaussian noise: its zCDP bound, as the device charges it."""
    return gaussian_rounds_epsilon(releases, 1.0, DELTA, mechanism="discrete_gaussian")


def upload_releases(server: HostileServer, multipliers: dict[tuple[int, int], float]) -> dict:
    """The uploads received as {z / 2: count}, by the multiplier served for their draw."""
    releases: dict[float, int] = {}
    for upload in server.uploads:
        key = multipliers[(upload["round"], upload["attempt"])] / 2.0
        releases[key] = releases.get(key, 0) + 1
    return releases


# --- (a) the none mode -------------------------------------------------------------------


def test_the_none_mode_is_refused_under_a_cap(hostile_server: Any) -> None:
    server = hostile_server(lambda n: served(config("none")))
    with device(server, max_epsilon=8.0, trust_server_noise=True) as capped:
        with pytest.raises(TaskRefusedError, match="mode 'none'.*at most 8"):
            capped.run_round()
    assert server.uploads == []
    with device(server) as uncapped:  # the control: without a cap the raw update goes
        assert uncapped.run_round().uploaded
    assert len(server.uploads) == 1


# --- (b) the advertised epsilon is not what the noise gives -----------------------------


@pytest.mark.parametrize("mode", ["local", "central", "distributed"])
def test_an_advertised_epsilon_with_no_noise_is_refused(hostile_server: Any, mode: str) -> None:
    """The task says epsilon 1 and serves z = 1e-9: the device computes the epsilon of
    what it is served (astronomical) and refuses before anything is sent."""
    task = config(mode, target_epsilon=1.0)
    server = hostile_server(lambda n: served(task, noise_multiplier=1e-9))
    with device(server, max_epsilon=1.0, trust_server_noise=True) as capped:
        with pytest.raises(TaskRefusedError, match="advertises epsilon 1.*costs epsilon") as error:
            capped.run_round()
    assert "at most 1" in str(error.value)
    assert server.uploads == []


@pytest.mark.parametrize("mode", ["local", "central", "distributed"])
def test_the_honest_calibration_of_the_cap_is_accepted(hostile_server: Any, mode: str) -> None:
    """The control: the noise the task's own calibration gives for epsilon 1 is taken."""
    task = config(mode, target_epsilon=1.0)
    server = hostile_server(lambda n: served(task))
    with device(server, max_epsilon=1.0, trust_server_noise=True) as capped:
        assert capped.run_round().uploaded
        assert capped.planned_epsilon(capped.fetch_round()) <= 1.0
    assert len(server.uploads) == 1


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_server_noise_is_refused_unless_trusted(hostile_server: Any, mode: str) -> None:
    """The device cannot see the server's (or the peers') noise: under a cap, the central
    and distributed modes need the explicit trust_server_noise, however high the cap."""
    server = hostile_server(lambda n: served(config(mode, target_epsilon=0.5)))
    with device(server, max_epsilon=20.0) as capped:
        with pytest.raises(TaskRefusedError, match=f"mode '{mode}'.*cannot verify"):
            capped.run_round()
    assert server.uploads == []


def test_a_round_past_the_planned_rounds_or_invalid_parameters_are_refused(
    hostile_server: Any,
) -> None:
    task = config("local")
    rounds = [served(task, round=3), served(task, clip_norm=-1.0)]
    server = hostile_server(lambda n: rounds[n])
    with device(server, max_epsilon=20.0) as capped:
        with pytest.raises(TaskRefusedError, match="round 3 of task 'hostile', planned for 3"):
            capped.run_round()
        with pytest.raises(FederatedError, match="invalid privacy parameters.*clip_norm"):
            capped.run_round()
    assert server.uploads == []


# --- (c) restarts ------------------------------------------------------------------------


def restarts(task: TaskConfig, multipliers: list[float]) -> tuple[Serve, dict]:
    """Round 0 again and again, attempt n at ``multipliers[n % len]``; and the map from
    (round, attempt) to the multiplier served."""
    served_at: dict[tuple[int, int], float] = {}

    def serve(n: int) -> dict[str, Any]:
        z = multipliers[n % len(multipliers)]
        served_at[(0, n)] = z
        return served(task, attempt=n, noise_multiplier=z)

    return serve, served_at


def test_restarts_are_charged_and_stop_at_the_cap(hostile_server: Any) -> None:
    """The noise is the honest calibration of 3 uploads at epsilon 2; the server restarts
    round 0 without end. The device uploads 3 times (every attempt charged), then stops:
    the accountant's epsilon of what the server received is within the cap, and one more
    upload would have passed it."""
    task = config("local", target_epsilon=2.0, rounds=3)
    z = calibrate(task)
    serve, served_at = restarts(task, [z])
    server = hostile_server(serve)
    with device(server, max_epsilon=2.0) as capped:
        results = capped.run(max_rounds=50, poll_interval=0.0)
        assert [(r.round, r.attempt, r.uploaded) for r in results] == [
            (0, 0, True), (0, 1, True), (0, 2, True),
        ]  # fmt: skip
        with pytest.raises(DeviceBudgetExhaustedError, match="past its cap of 2, after 3 uploads"):
            capped.run_round()
        assert capped.epsilon_spent() == pytest.approx(accountant_epsilon({z / 2: 3}))
    releases = upload_releases(server, served_at)
    assert releases == {z / 2: 3}
    assert accountant_epsilon(releases) <= 2.0
    assert accountant_epsilon({z / 2: 4}) > 2.0


def test_restarts_with_changing_noise_are_composed(hostile_server: Any) -> None:
    """Each restart serves another multiplier (each plan alone within the cap); the
    ledger composes the uploads at the multipliers really used and stops at the cap."""
    task = config("local", target_epsilon=3.0, rounds=2)
    z = calibrate(task)
    serve, served_at = restarts(task, [z, 1.5 * z, 4.0 * z])
    server = hostile_server(serve)
    with device(server, max_epsilon=3.0) as capped:
        results = capped.run(max_rounds=50, poll_interval=0.0)
    releases = upload_releases(server, served_at)
    count = len(server.uploads)
    assert len(results) == count < 50 and count >= 2
    assert accountant_epsilon(releases) <= 3.0
    following = served_at[(0, count)] / 2  # the multiplier of the refused attempt
    assert accountant_epsilon(releases | {following: releases.get(following, 0) + 1}) > 3.0


def test_a_durable_ledger_survives_the_client(hostile_server: Any, tmp_path: Path) -> None:
    """With a state directory a new client (an app restart) knows the uploads made, and a
    refused upload (the server answers 400 after the bytes left) was still charged."""
    task = config("local", target_epsilon=2.0, rounds=3)
    serve, served_at = restarts(task, [calibrate(task)])
    server = hostile_server(serve)
    with device(server, max_epsilon=2.0, state_dir=tmp_path) as first:
        assert first.run(max_rounds=2, poll_interval=0.0)[-1].uploaded
    server.upload_status = 400
    with device(server, max_epsilon=2.0, state_dir=tmp_path) as second:
        with pytest.raises(FederatedError, match="400"):
            second.run_round()
    server.upload_status = 200
    with device(server, max_epsilon=2.0, state_dir=tmp_path) as third:
        with pytest.raises(DeviceBudgetExhaustedError, match="after 3 uploads"):
            third.run_round()
        assert third.epsilon_spent() <= 2.0
    assert len(server.uploads) == 2


# --- (d) parameters that change from round to round ------------------------------------


def test_the_device_uses_and_checks_each_rounds_parameters(hostile_server: Any) -> None:
    """Round 0 at (z, C = 1), round 1 at (z, C = 100), round 2 at (z / 10, C = 1). The
    device noises each upload with the round's own ``z C`` and refuses round 2, whose
    plan costs more than the cap.

    The scale check: an upload is ``clipped + N(0, (z C)^2 I_P)`` with ``||clipped|| <= C``
    and P = 1,005, so ``||upload|| / (z C sqrt(P))`` lies within ``1 / (z sqrt(P))`` (about
    0.02 here) of ``chi_P / sqrt(P)``, whose std is about ``1 / sqrt(2 P)`` = 0.022; the
    tolerance 0.2 is 8 of those stds beyond the clipped part: a false failure has
    probability below 1e-14 per upload (and the seed is fixed)."""
    task = config("local", model=WIDE, target_epsilon=4.0, rounds=4)
    z = calibrate(task)
    schedule = [(z, 1.0), (z, 100.0), (z / 10, 1.0)]
    server = hostile_server(
        lambda n: served(task, round=n, noise_multiplier=schedule[n][0], clip_norm=schedule[n][1])
    )
    with device(server, WIDE, max_epsilon=4.0) as capped:
        assert capped.run_round().uploaded and capped.run_round().uploaded
        with pytest.raises(TaskRefusedError, match=f"noise multiplier {z / 10:g}.*at most 4"):
            capped.run_round()
    assert len(server.uploads) == 2
    size = make_model(WIDE).num_params
    for upload, (multiplier, clip) in zip(server.uploads, schedule, strict=False):
        ratio = np.linalg.norm(decode_vector(upload["update"])) / (multiplier * clip * size**0.5)
        assert abs(ratio - 1.0) < 0.2, (ratio, multiplier, clip)


def test_the_clipped_bit_does_not_leave_the_device_in_local_mode(hostile_server: Any) -> None:
    """Whether an update needed clipping is a fact about the data; with C = 1000 a small
    update is unclipped (bit 1). The local mode has no use for the bit and no noise on it,
    so the device sends 0."""
    task = config("local", clip_norm=1000.0)
    server = hostile_server(lambda n: served(task, clip_norm=1000.0))
    with device(server) as plain:
        assert plain.run_round().uploaded
    assert server.uploads[0]["unclipped"] == 0.0
