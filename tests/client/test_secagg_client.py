"""The device's secure aggregation steps (``client.secagg``) against a scripted relay.

``Relay`` answers the four steps behind ``httpx.MockTransport`` as an honest aggregator
would, for one device under test (index 1) and four honest devices simulated in
process with ``SecAggClient`` (one of which, index 4, shares its keys and then drops
out before its masked input). It can be told to answer a step ``425`` a few times first,
to serve scripted answers (or connection errors) before the real ones, and to alter the
roster or the unmask request it serves. Time is a fake clock that ``sleep`` advances,
so that waits are checked exactly and cost nothing.

At the end of a complete round the relay rebuilds the sum from what the devices sent
(``reconstruct_sum``): the device's wire encoding of keys, shares and masked input is
right exactly when that sum is the sum of the included inputs, to the last bit.
"""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from client import FederatedError
from client.federated import FederatedClient
from client.secagg import STEP_GRACE_SECONDS, SecAggSession
from client.transport import RetryPolicy
from shared.federated.messages import encode_vector
from shared.federated.secagg import (
    PublicKeys,
    Roster,
    RoundContext,
    SecAggClient,
    decode_ring,
    from_ring,
    plan_parameters,
    reconstruct_sum,
    unmask_request,
)
from shared.federated.secagg_messages import SESSION_HEADER
from shared.federated.task import SecureAggregationSpec, TaskConfig

CONTEXT = RoundContext("tiny", 3, 1)
SPEC = SecureAggregationSpec(step_timeout_seconds=10.0)
LENGTH, BITS, DEVICES, OURS, LEAVER = 6, 32, 5, 1, 4
BASE = "/v1/federated/tasks/tiny/rounds/3/secagg"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class FakeClock:
    """Monotonic seconds that move only when someone sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Relay:
    """An honest relay for one round attempt of ``DEVICES`` devices, scripted at will."""

    def __init__(
        self,
        *,
        length: int = LENGTH,
        bits: int = BITS,
        context: RoundContext = CONTEXT,
        pending: dict[str, int] | None = None,
        roster_edit: Callable[[dict[str, Any]], None] | None = None,
        unmask_edit: Callable[[dict[str, Any]], None] | None = None,
        rng_seed: int = 0,
    ) -> None:
        self.length, self.bits, self.context = length, bits, context
        self.pending = {"keys": 2, "shares": 1, "unmask": 1} if pending is None else pending
        self.roster_edit, self.unmask_edit = roster_edit, unmask_edit
        #: (method, step) -> answers or exceptions served before the real answer.
        self.script: dict[tuple[str, str], list[httpx.Response | type[httpx.TransportError]]]
        self.script = {}
        rng = np.random.default_rng(rng_seed)
        self.others = {i: SecAggClient(context) for i in range(DEVICES) if i != OURS}
        bound = 1 << (bits - 5)  # five inputs sum to less than 2^(b-2): no wrap-around
        self.inputs = {i: rng.integers(-bound, bound, length) for i in self.others}
        #: Every request: (method, step, JSON body or None, session header).
        self.requests: list[tuple[str, str, Any, str | None]] = []
        self.ours: dict[str, Any] = {}
        self.roster: Roster | None = None
        self.http = httpx.Client(
            base_url="http://aggregator.test", transport=httpx.MockTransport(self.handle)
        )

    # --- plumbing -----------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        step = request.url.path.rsplit("/", 1)[1]
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, step, body, request.headers.get(SESSION_HEADER)))
        queue = self.script.get((request.method, step))
        if queue:
            answer = queue.pop(0)
            if isinstance(answer, httpx.Response):
                return answer
            raise answer("scripted failure", request=request)
        if request.method == "GET" and self.pending.get(step, 0) > 0:
            self.pending[step] -= 1
            return httpx.Response(425, headers={"Retry-After": "1"}, json={"detail": "wait"})
        handler: Callable[[Any], Any] = getattr(self, f"{request.method.lower()}_{step}")
        return httpx.Response(200, json=handler(body))

    def posts(self, step: str) -> list[Any]:
        return [body for method, s, body, _ in self.requests if (method, s) == ("POST", step)]

    def session(self, **options: Any) -> tuple[SecAggSession, FakeClock]:
        clock = FakeClock()
        settings: dict[str, Any] = {
            "min_inputs": 3,
            "max_devices": DEVICES,
            "modulus_bits": lambda n: 20,
            "error": lambda response: FederatedError.from_response(response),
            "retry": RetryPolicy(base=0.5, cap=2.0),
            "max_attempts": 4,
            "clock": clock,
            "sleep": clock.sleep,
        } | options
        session = SecAggSession(
            self.http, "", {"Authorization": "Bearer k"}, self.context, SPEC, **settings
        )
        return session, clock

    # --- the steps ----------------------------------------------------------------------

    def post_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        self.ours = {"keys": body}
        return {"participant": OURS, "duplicate": False}

    def get_keys(self, _: Any) -> dict[str, Any]:
        keys = {i: client.advertise() for i, client in self.others.items()}
        ours = self.ours["keys"]
        keys[OURS] = PublicKeys(
            base64.b64decode(ours["encryption_key"]), base64.b64decode(ours["masking_key"])
        )
        parameters = plan_parameters(DEVICES, self.length, self.bits, SPEC)
        ordered = tuple(keys[i] for i in range(DEVICES))
        self.roster = Roster(self.context, parameters, ordered)
        out = {
            "task": self.context.task, "round": self.context.round,
            "attempt": self.context.attempt,
            "participants": [
                {"index": i, "encryption_key": b64(k.encryption_key),
                 "masking_key": b64(k.masking_key)}
                for i, k in enumerate(ordered)
            ],
            "neighbours": parameters.neighbours, "threshold": parameters.threshold,
            "modulus_bits": parameters.modulus_bits, "vector_length": parameters.vector_length,
        }  # fmt: skip
        if self.roster_edit is not None:
            self.roster_edit(out)
        self.sent = {i: client.share_keys(self.roster, i) for i, client in self.others.items()}
        return out

    def post_shares(self, body: dict[str, Any]) -> dict[str, Any]:
        for share in body["shares"]:
            self.sent.setdefault(OURS, {})[share["recipient"]] = base64.b64decode(
                share["ciphertext"]
            )
        return {"step": "shares", "duplicate": False}

    def inbox(self, index: int) -> dict[int, bytes]:
        return {
            sender: ciphertexts[index]
            for sender, ciphertexts in self.sent.items()
            if index in ciphertexts
        }

    def get_shares(self, _: Any) -> dict[str, Any]:
        return {
            "shares": [
                {"sender": sender, "ciphertext": b64(ciphertext)}
                for sender, ciphertext in sorted(self.inbox(OURS).items())
            ]
        }

    def post_masked(self, body: dict[str, Any]) -> dict[str, Any]:
        self.ours["masked"] = body["masked"]
        return {"step": "masked", "duplicate": False}

    @property
    def masked_devices(self) -> set[int]:
        return {i for i in range(DEVICES) if i != LEAVER}

    def get_unmask(self, _: Any) -> dict[str, Any]:
        assert self.roster is not None
        survivors, dropped = unmask_request(self.roster, set(self.sent), self.masked_devices, OURS)
        out = {"survivors": survivors, "dropped": dropped, "masked_inputs": 4}
        if self.unmask_edit is not None:
            self.unmask_edit(out)
        return out

    def post_unmask(self, body: dict[str, Any]) -> dict[str, Any]:
        self.ours["unmask"] = body
        return {"step": "unmask", "duplicate": False}

    def total(self) -> np.ndarray:
        """The round's sum, rebuilt by the server's math from what every device sent."""
        assert self.roster is not None
        shared, masked = set(self.sent), self.masked_devices
        ring = self.roster.parameters.dtype.type((1 << self.bits) - 1)
        total = decode_ring(base64.b64decode(self.ours["masked"]), self.bits, self.length)
        seeds: dict[int, dict[int, bytes]] = {}
        secret_keys: dict[int, dict[int, bytes]] = {}
        for kind, store in (("mask_seed_shares", seeds), ("secret_key_shares", secret_keys)):
            for item in self.ours["unmask"][kind]:
                store.setdefault(item["owner"], {})[OURS] = base64.b64decode(item["share"])
        for index in masked - {OURS}:
            client = self.others[index]
            total = (total + client.mask(self.inbox(index), self.inputs[index])) & ring
            survivors, dropped = unmask_request(self.roster, shared, masked, index)
            seed_shares, key_shares = client.unmask(survivors, dropped)
            for owner, share in seed_shares.items():
                seeds.setdefault(owner, {})[index] = share
            for owner, share in key_shares.items():
                secret_keys.setdefault(owner, {})[index] = share
        return from_ring(
            reconstruct_sum(self.roster, shared, masked, total, seeds, secret_keys), self.bits
        )


VALUES = np.array([5, -7, 1 << 20, -(1 << 20), 0, 3], dtype=np.int64)


def test_a_complete_round_puts_the_devices_input_in_the_sum() -> None:
    """Every step, with 425s on the way: the relay's sum is exactly the included inputs'
    (the device's and three others'; the fifth dropped before its masked input), so the
    device's keys, shares, masked input and revealed shares went out encoded right."""
    relay = Relay()
    session, clock = relay.session()
    outcome = session.run(VALUES)
    assert outcome.included and outcome.completed and outcome.reached == "unmask"
    expected = VALUES + sum(relay.inputs[i] for i in (0, 2, 3))
    np.testing.assert_array_equal(relay.total(), expected)
    revealed = relay.ours["unmask"]
    assert [item["owner"] for item in revealed["secret_key_shares"]] == [LEAVER]
    assert {item["owner"] for item in revealed["mask_seed_shares"]} == {0, 2, 3}
    assert clock.sleeps == [1.0] * 4  # each 425 waited out its Retry-After, no more
    sessions = {header for *_, header in relay.requests}
    assert sessions == {str(session.session_id)} and session.session_id.version == 4
    assert relay.posts("keys")[0]["attempt"] == CONTEXT.attempt


def test_each_attempt_has_its_own_session_and_keys() -> None:
    relay = Relay()
    first, _ = relay.session()
    second, _ = relay.session()
    assert first.session_id != second.session_id
    first.run(VALUES)
    second.run(VALUES)
    keys = relay.posts("keys")
    assert keys[0]["masking_key"] != keys[1]["masking_key"]


def test_a_409_while_waiting_for_the_roster_ends_the_attempt_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The keys step closed without the device: it leaves, not included, at INFO, and
    sends nothing more."""
    relay = Relay()
    relay.script[("GET", "keys")] = [httpx.Response(409, json={"detail": "not in the round"})]
    session, _ = relay.session()
    with caplog.at_level(logging.INFO, logger="ldp.federated.secagg"):
        outcome = session.run(VALUES)
    assert not outcome.included and outcome.reached == "keys"
    assert outcome.stopped is not None and "409" in outcome.stopped
    assert [(m, s) for m, s, *_ in relay.requests] == [("POST", "keys"), ("GET", "keys")]
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_a_409_after_the_masked_input_leaves_it_included() -> None:
    relay = Relay()
    relay.script[("GET", "unmask")] = [httpx.Response(409, json={"detail": "restarted"})]
    outcome = relay.session()[0].run(VALUES)
    assert outcome.included and outcome.reached == "masked" and not outcome.completed
    assert relay.posts("unmask") == []


def test_failed_posts_are_repeated_with_the_same_body() -> None:
    """A connection error, a 503 and a 429 (Retry-After 3) before each accepted POST:
    the same body every time, after the backoff (at most base 2^i) or the Retry-After."""
    relay = Relay(pending={})
    for step in ("keys", "shares", "masked", "unmask"):
        relay.script[("POST", step)] = [
            httpx.ConnectError,
            httpx.Response(503, json={"detail": "busy"}),
            httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "slow down"}),
        ]
    session, clock = relay.session()
    outcome = session.run(VALUES)
    assert outcome.completed
    for step in ("keys", "shares", "masked", "unmask"):
        bodies = relay.posts(step)
        assert len(bodies) == 4 and all(body == bodies[0] for body in bodies)
    assert len(clock.sleeps) == 12
    for first, second, third in zip(*[iter(clock.sleeps)] * 3, strict=True):
        assert 0 <= first <= 0.5 and 0 <= second <= 1.0 and third == 3.0
    np.testing.assert_array_equal(relay.total(), VALUES + sum(relay.inputs[i] for i in (0, 2, 3)))


def test_a_post_too_early_is_repeated_after_its_retry_after() -> None:
    relay = Relay(pending={})
    early = httpx.Response(425, headers={"Retry-After": "2"}, json={"detail": "too early"})
    relay.script[("POST", "masked")] = [early]
    session, clock = relay.session()
    assert session.run(VALUES).completed
    assert clock.sleeps == [2.0] and len(relay.posts("masked")) == 2


def test_failing_gets_are_repeated_too() -> None:
    relay = Relay(pending={})
    relay.script[("GET", "shares")] = [httpx.ReadTimeout, httpx.Response(502, text="bad gateway")]
    assert relay.session()[0].run(VALUES).completed
    assert [s for m, s, *_ in relay.requests if m == "GET"].count("shares") == 3


def test_a_device_gives_up_after_max_attempts() -> None:
    relay = Relay(pending={})
    relay.script[("POST", "masked")] = [httpx.ConnectError] * 10
    outcome = relay.session(max_attempts=3)[0].run(VALUES)
    assert not outcome.included and outcome.reached == "shares"
    assert outcome.stopped is not None and "failed 3 times" in outcome.stopped
    assert len(relay.posts("masked")) == 3


def test_a_step_that_never_closes_is_left_at_its_timeout() -> None:
    """425 forever: the device waits the step's timeout plus the grace, then leaves."""
    relay = Relay(pending={"shares": 10**6})
    session, clock = relay.session()
    start = clock.now
    outcome = session.run(VALUES)
    assert outcome.reached == "shares" and not outcome.included
    waited = clock.now - start
    assert SPEC.step_timeout_seconds + STEP_GRACE_SECONDS <= waited
    assert waited <= SPEC.step_timeout_seconds + STEP_GRACE_SECONDS + 1.0
    assert relay.posts("masked") == []


def test_an_answer_outside_the_protocol_is_raised() -> None:
    relay = Relay()
    relay.script[("POST", "keys")] = [httpx.Response(401, json={"detail": "key revoked"})]
    with pytest.raises(FederatedError, match="key revoked") as raised:
        relay.session()[0].run(VALUES)
    assert raised.value.status == 401


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda out: out.__setitem__(field, value)


def _grown(out: dict[str, Any]) -> None:
    """A sixth device in the roster (more than the round takes), planned as such."""
    keys = SecAggClient(CONTEXT).advertise()
    out["participants"].append(
        {"index": DEVICES, "encryption_key": b64(keys.encryption_key),
         "masking_key": b64(keys.masking_key)}
    )  # fmt: skip
    planned = plan_parameters(DEVICES + 1, LENGTH, BITS, SPEC)
    out.update(neighbours=planned.neighbours, threshold=planned.threshold)


def _swap_keys(out: dict[str, Any]) -> None:
    first, ours = out["participants"][0], out["participants"][OURS]
    for key in ("encryption_key", "masking_key"):
        first[key], ours[key] = ours[key], first[key]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_set("attempt", 0), "attempt 0"),
        (_set("round", 4), "round 4"),
        (_set("vector_length", LENGTH + 1), "vector length"),
        (_set("modulus_bits", 19), "19 bits"),
        (lambda out: out.update(neighbours=2, threshold=2), "plans k = 4"),
        (_set("threshold", 2), "plans k = 4 and t = 3"),
        (_set("threshold", 4), "plans k = 4 and t = 3"),
        (lambda out: out["participants"].pop(), "has 5 to 5"),
        (_grown, "has 3 to 5"),
        (lambda out: out["participants"].reverse(), "indexed"),
        (_swap_keys, ""),
    ],
    ids=[
        "attempt", "round", "length", "modulus", "neighbours", "threshold-low",
        "threshold-high", "too-few", "too-many", "order", "own-keys",
    ],
)  # fmt: skip
def test_a_roster_the_device_does_not_accept_is_refused_before_any_share(
    edit: Callable[[dict[str, Any]], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The roster is checked against the device's own computation (here: a ring of at
    least 20 bits, 3 to 5 devices, or 5 to 5); a refusal sends no share, logged at
    WARNING."""
    relay = Relay(roster_edit=edit)
    session, _ = relay.session(min_inputs=5 if "5 to 5" in reason else 3)
    with caplog.at_level(logging.WARNING, logger="ldp.federated.secagg"):
        outcome = session.run(VALUES)
    assert not outcome.included and outcome.reached == "keys"
    assert outcome.stopped is not None and outcome.stopped.startswith("refused")
    assert reason in outcome.stopped
    assert relay.posts("shares") == []
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda out: out["dropped"].append(out["survivors"][0]), "refused"),
        (lambda out: out["survivors"].append(99), "refused"),
        (_set("masked_inputs", 2), "fewer than the 3"),
    ],
    ids=["both-shares-of-one", "not-a-neighbour", "too-few-inputs"],
)
def test_an_unmask_request_the_device_refuses_reveals_nothing(
    edit: Callable[[dict[str, Any]], None], reason: str
) -> None:
    """Asked for both shares of one neighbour, for a share it does not hold, or to unmask
    a sum of fewer inputs than a round may close with: no share leaves the device (no
    POST .../unmask at all)."""
    relay = Relay(unmask_edit=edit)
    outcome = relay.session()[0].run(VALUES)
    assert outcome.included and outcome.reached == "masked"
    assert outcome.stopped is not None and reason in outcome.stopped
    assert relay.posts("unmask") == []


def test_a_roster_no_ring_holds_is_refused() -> None:
    def too_many(devices: int) -> int:
        raise ValueError(f"{devices} inputs need more than 64 bits")

    relay = Relay()
    outcome = relay.session(modulus_bits=too_many)[0].run(VALUES)
    assert outcome.stopped is not None and "fits no ring" in outcome.stopped
    assert relay.posts("shares") == []


def test_malformed_answers_end_the_attempt() -> None:
    relay = Relay()
    relay.script[("GET", "shares")] = [httpx.Response(200, json={"shares": "none"})]
    outcome = relay.session()[0].run(VALUES)
    assert not outcome.included and outcome.stopped is not None
    assert "malformed" in outcome.stopped


def test_a_session_runs_once() -> None:
    session, _ = Relay().session()
    session.run(VALUES)
    with pytest.raises(RuntimeError, match="runs once"):
        session.run(VALUES)


def test_values_must_be_integers() -> None:
    session, _ = Relay().session()
    with pytest.raises(ValueError, match="integers"):
        session.run(np.zeros(LENGTH))


# --- the federated client --------------------------------------------------------------


def test_a_federated_client_of_a_secure_task_never_uploads_its_update() -> None:
    """A distributed task with secure aggregation: the device trains, puts its update
    on the lattice (the length and ring its own computation gives), and takes part
    through the relay; nothing goes to ``POST .../updates``, and ``uploaded`` says its
    masked input was accepted. The relay's sum minus the other inputs is the device's
    vector: a clipped update with noise, in lattice steps, far inside the ring."""
    config = TaskConfig.model_validate(
        {
            "model": {"kind": "logistic", "num_features": 3, "num_classes": 2},
            "mode": "distributed", "rounds": 5, "population": 5, "clients_per_round": 5,
            "min_clients": 3, "noise_multiplier": 1.0, "clip_norm": 1.0,
            "secure_aggregation": {"step_timeout_seconds": 10.0},
        }
    )  # fmt: skip
    dp = config.dp_config(1.0)
    params = np.zeros(8)
    length = dp.secure_vector_length(params.size)
    bits = dp.secure_modulus_bits(1.0, params.size, DEVICES)
    relay = Relay(length=length, bits=bits, context=RoundContext("tiny", 0, 0), pending={})
    round_out = {
        "task": "tiny", "round": 0, "attempt": 0, "state": "running",
        "config": config.model_dump(mode="json"), "noise_multiplier": 1.0, "clip_norm": 1.0,
        "sample_rate": 1.0, "expected_clients": 5.0, "num_params": params.size,
        "parameters": encode_vector(params), "deadline": 0.0,
    }  # fmt: skip
    paths: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path.endswith("/round"):
            return httpx.Response(200, json=round_out)
        return relay.handle(request)

    http = httpx.Client(transport=httpx.MockTransport(handle))
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(20, 3)), rng.integers(0, 2, 20)
    with FederatedClient("http://aggregator.test", "k", "tiny", (x, y), http=http) as device:
        result = device.run_round()
    assert result.participated and result.uploaded
    assert not any(path.endswith("/updates") for path in paths)
    assert relay.posts("unmask")
    ours = relay.total() - sum(relay.inputs[i] for i in (0, 2, 3))
    assert ours.shape == (length,) and ours.dtype == np.int64
    assert 0 < np.abs(ours).max() < 2 ** (bits - 2)
    assert uuid.UUID(relay.requests[0][3] or "").version == 4


SERVER_SIDE = ("fastapi", "sqlalchemy", "scipy", "uvicorn", "starlette")


@pytest.mark.slow
def test_a_secure_round_on_the_device_imports_no_server_side_library() -> None:
    """The test above in a fresh interpreter (what this process imported cannot hide an
    import): a device's secure round, keys to unmasking, loads no server-side library."""
    code = (
        "import sys\n"
        "from tests.client.test_secagg_client import "
        "test_a_federated_client_of_a_secure_task_never_uploads_its_update as secure_round\n"
        "secure_round()\n"
        f"print(sorted({{name.split('.')[0] for name in sys.modules}} & set({SERVER_SIDE!r})))\n"
    )
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().splitlines()[-1] == "[]"
