"""A hostile device's unclipped bit against adaptive clipping, on a real service.

Attack: in an adaptive-clipping task (Andrew et al. 2021) every upload carries the bit
"my update was not clipped", from which the server sets the next clip norm
``C exp(-eta (b - gamma))``. One device reporting ``unclipped = -1e6`` made ``exp``
overflow: every later upload answered 500, and after the deadline the task's status and
round answered 500 for ever while the round-closing ticker failed every 0.5 s; with -2000
the next clip norm was 1.3e58.

Defence: in the central mode the server clips each bit to [0, 1]; in the distributed
mode it refuses (422) a bit outside ``[-10 s, 1 + 10 s]`` (``s`` a device's share of the
count's noise), which an honest noisy bit leaves with probability below 2^-60; the
adaptive step is clamped to a factor e per round and C to [1e-6, 1e6]; and a round whose
aggregation still fails on non-finite values is restarted rather than failing the task.
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from simulations.server import Server, start_server

MODEL = {"kind": "logistic", "num_features": 4, "num_classes": 3}
NUM_PARAMS = (4 + 1) * 3
COUNT_NOISE = 5.0
#: The round deadline, seconds, of the tasks that wait for one to pass (the service's
#: ticker closes due rounds every 0.5 s); the others never see theirs, however loaded the
#: machine, so that what they assert cannot depend on how fast requests are answered.
SHORT, LONG = 1.0, 3600.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One service for the attacks below: each works on a task of its own name, and what
    one leaves behind (a hostile bit, a restarted round) must not harm the others."""
    directory = tmp_path_factory.mktemp("hostile-uploads")
    with start_server(str(directory / "target.db"), directory) as running:
        yield running


def _create(
    server: Server, client: httpx.Client, name: str, mode: str, least: int, timeout: float
) -> None:
    """An adaptive-clipping task of three clients a round, all of them in every round
    (q = 1: the attack does not depend on q, and the accountant charges an unsampled round
    in a fraction of the time a sampled one takes)."""
    config = {
        "model": MODEL, "mode": mode, "rounds": 10, "population": 3,
        "clients_per_round": 3, "noise_multiplier": 1.0, "min_clients": least,
        "round_timeout_seconds": timeout, "adaptive_clipping": {"count_noise": COUNT_NOISE},
    }  # fmt: skip
    response = client.post(
        f"{server.url}/v1/federated/tasks",
        json={"name": name, "config": config},
        headers=server.headers("admin"),
    )
    assert response.status_code == 201, response.text


def _round(server: Server, client: httpx.Client, name: str) -> dict[str, Any]:
    response = client.get(
        f"{server.url}/v1/federated/tasks/{name}/round", headers=server.headers("device")
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _status(server: Server, client: httpx.Client, name: str) -> dict[str, Any]:
    response = client.get(
        f"{server.url}/v1/federated/tasks/{name}", headers=server.headers("analyst")
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _upload(
    server: Server, client: httpx.Client, name: str, unclipped: Any
) -> tuple[httpx.Response, tuple[int, int]]:
    """One upload to the open round, and the (round, attempt) it named. After a 409
    stale-round (the deadline passed between reading the round and uploading: a new
    attempt is open) it is sent again to the new attempt, as a device does. Never a 500."""
    vector = base64.b64encode(np.full(NUM_PARAMS, 0.01, dtype="<f8").tobytes()).decode()
    while True:
        info = _round(server, client, name)
        body = (
            f'{{"update_id": "{uuid.uuid4()}", "round": {info["round"]}, '
            f'"attempt": {info["attempt"]}, "update": "{vector}", "unclipped": {unclipped}}}'
        )  # raw JSON text, so that NaN, Infinity and 1e400 reach the service as written
        response = client.post(
            f"{server.url}/v1/federated/tasks/{name}/updates",
            content=body,
            headers=server.headers("device") | {"Content-Type": "application/json"},
        )
        assert response.status_code < 500, (unclipped, response.text, server.log_tail())
        if response.status_code != 409 or "stale-round" not in response.text:
            return response, (int(info["round"]), int(info["attempt"]))


def _send(server: Server, client: httpx.Client, name: str, unclipped: Any) -> httpx.Response:
    return _upload(server, client, name, unclipped)[0]


def _accepted(server: Server, client: httpx.Client, name: str, unclipped: Any) -> tuple[int, int]:
    """Upload a bit the service takes; the (round, attempt) that took it."""
    response, taken = _upload(server, client, name, unclipped)
    assert response.status_code == 200, (unclipped, response.text)
    return taken


def _after_deadline(server: Server, client: httpx.Client, name: str) -> dict[str, Any]:
    """Wait until the service has closed or restarted the open round at its deadline (the
    ticker, every 0.5 s, or a request after the deadline); the status then."""
    before = _status(server, client, name)
    time.sleep(max(0.0, before["deadline"] - time.time()))
    give_up = time.monotonic() + 60.0
    while True:
        _round(server, client, name)
        status = _status(server, client, name)
        if (status["round"], status["attempt"]) != (before["round"], before["attempt"]):
            return status
        assert time.monotonic() < give_up, ("the round never moved on", status)
        time.sleep(0.05)


def _assert_bounded(status: dict[str, Any]) -> None:
    """C starts at 1 and moves by at most a factor e a round, within [1e-6, 1e6]."""
    norms = [record["clip_norm"] for record in status["history"]] + [status["clip_norm"]]
    for before, after in zip(norms, norms[1:], strict=False):
        assert math.isfinite(after) and 1e-6 <= after <= 1e6
        assert math.exp(-1.0) * (1 - 1e-9) <= after / before <= math.exp(1.0) * (1 + 1e-9)


UNPARSABLE: list[Any] = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e7", '"huge"']


@pytest.mark.slow
def test_hostile_bits_in_the_central_mode_are_clipped(server: Server) -> None:
    with httpx.Client(timeout=30) as client:
        _create(server, client, "central", "central", 1, LONG)
        for value in UNPARSABLE:
            assert _send(server, client, "central", value).status_code == 422
        for value in (-1e6, -2000.0, 1e6):  # accepted, and clipped to [0, 1]
            assert _send(server, client, "central", value).status_code == 200
        status = _status(server, client, "central")  # the third upload closed the round
        assert status["round"] == 1 and status["participants"] == [3]
        _assert_bounded(status)
        for value in (1.0, 0.0, 0.5):  # honest uploads are still taken
            assert _send(server, client, "central", value).status_code == 200
        status = _status(server, client, "central")
        assert status["round"] == 2 and status["participants"] == [3, 3]
        _assert_bounded(status)
        # A round closed at its deadline by the ticker, with one hostile bit in it.
        _create(server, client, "central-due", "central", 1, SHORT)
        _accepted(server, client, "central-due", -1e6)  # min_clients 1: the round will close
        status = _after_deadline(server, client, "central-due")
        assert status["round"] == 1 and status["participants"] == [1]
        assert status["state"] == "running"
        _assert_bounded(status)
        assert _send(server, client, "central-due", 1.0).status_code == 200
        assert "OverflowError" not in server.log_tail(200)


@pytest.mark.slow
def test_hostile_bits_in_the_distributed_mode_are_refused(server: Server) -> None:
    with httpx.Client(timeout=30) as client:
        _create(server, client, "spread", "distributed", 3, LONG)  # fewer: too little noise
        margin = 10 * COUNT_NOISE / math.sqrt(3)  # 10 s, s = sigma_b / sqrt(q W)
        for value in [*UNPARSABLE, -1e6, -2000.0, 1e6, 1 + 1.01 * margin, -1.01 * margin]:
            refused = _send(server, client, "spread", value)
            assert refused.status_code == 422, (value, refused.text)
            assert "unclipped" in refused.text
        assert _status(server, client, "spread")["updates_received"] == 0
        for value in (1 + 0.99 * margin, -0.99 * margin, 0.3):  # extreme but possible
            assert _send(server, client, "spread", value).status_code == 200
        status = _status(server, client, "spread")  # the third upload closed the round
        assert status["round"] == 1 and status["participants"] == [3]
        _assert_bounded(status)
        for value in (1.0, 0.0, 0.5):  # honest uploads are still taken
            assert _send(server, client, "spread", value).status_code == 200
        status = _status(server, client, "spread")
        assert status["round"] == 2 and status["participants"] == [3, 3]
        _assert_bounded(status)
        # One share at the deadline, fewer than min_clients: the round is drawn again.
        _create(server, client, "spread-due", "distributed", 3, SHORT)
        round_, attempt = _accepted(server, client, "spread-due", 1.0)
        status = _after_deadline(server, client, "spread-due")
        assert status["round"] == round_ == 0 and status["attempt"] > attempt
        assert status["state"] == "running" and status["participants"] == []
        assert _send(server, client, "spread-due", 1.0).status_code == 200


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_too_little_count_noise_is_a_422_not_a_500(server: Server, mode: str) -> None:
    """Calibrated noise the default count noise (clients_per_round / 20) cannot pair with.
    Everyone takes part in every round (q = 1), which calibrates in a fraction of the time
    a sampled task takes; its noise is still far above what a count noise of 0.15 allows."""
    config = {
        "model": MODEL, "mode": mode, "rounds": 4, "population": 3,
        "clients_per_round": 3, "target_epsilon": 4.0, "adaptive_clipping": {},
    }  # fmt: skip
    response = httpx.post(
        f"{server.url}/v1/federated/tasks",
        json={"name": "thin", "config": config},
        headers=server.headers("admin"),
        timeout=60,
    )
    assert response.status_code == 422, response.text
    assert "count_noise" in response.text and "target_epsilon" in response.text
