"""Secure aggregation on the device: one round attempt's four steps over HTTP (SecAgg+).

A device of a ``distributed`` task with ``secure_aggregation`` uploads no update: it
puts its update on the integer lattice with its share of the noise
(:func:`shared.federated.privacy.privatize_on_lattice`) and :class:`SecAggSession` takes
that vector through the aggregator's relay (the endpoints of
:mod:`shared.federated.secagg_messages`), with the cryptography of
:class:`shared.federated.secagg.SecAggClient` (Bell et al., CCS 2020, on Bonawitz et al.,
CCS 2017). Every request carries ``Secagg-Session``: a random UUID4 drawn for this
attempt, which names the device in it and which no other device knows.

1. **keys**: ``POST .../keys`` two fresh X25519 public keys; then ``GET .../keys`` until
   the step closes: the roster (every device that advertised) and the round's public
   parameters. The device checks them against what it computes itself and refuses the
   round (:class:`~shared.federated.secagg.SecAggRefusal`) otherwise: the roster is for
   this task, round and attempt, indexed ``0..n-1``, of ``min_inputs`` to
   ``max_devices`` devices; the vector length is its own vector's; the modulus has at
   least the bits its own ``modulus_bits(n)`` gives (so that the sum of ``n`` inputs
   cannot wrap around); ``k`` and ``t`` are those
   :func:`~shared.federated.secagg.plan_parameters` plans for ``n`` devices under the
   task's spec (fewer neighbours or a threshold at most ``k / 2`` would weaken the
   masks, more neighbours would make the device's work a relay's to choose); its own
   keys are at its index (``share_keys``).
2. **shares**: one AES-GCM ciphertext per neighbour, holding its Shamir shares of the
   device's masking key and self-mask seed; then the shares its neighbours sent it.
3. **masked input**: ``y = x + PRG(b_u) + sum_v +-PRG(s_uv) mod 2^b``, masked with
   exactly the neighbours whose shares it received; then the unmask request.
4. **unmasking**: for each neighbour the request names, one share: of the self-mask seed
   of a survivor, or of the masking key of a device that dropped out, never both
   (``SecAggClient.unmask`` refuses anything else); and only when at least
   ``min_inputs`` masked inputs are in the sum, since the noise of fewer shares is less
   than the device's accounting assumed.

Waiting: a ``GET`` answered ``425 Too Early`` is asked again after ``Retry-After``
(else ``poll_interval``); a ``409`` means the device is not in the step (it came late, the
round was restarted, or the step closed without it): it stops quietly, at INFO. A
``POST`` is repeated with the same body (the relay's ``POST`` is idempotent) after a
connection error, 408, 425, 429 or 5xx, with the backoff of
:class:`client.transport.RetryPolicy`, as is a ``GET`` that fails so. Each step (a
``POST`` and the ``GET`` that follows it) is bounded by the task's
``step_timeout_seconds`` plus ``STEP_GRACE_SECONDS``, and by ``max_attempts``
consecutive failures: past either the device gives up, logged at WARNING. So does a
refusal or a malformed message (:class:`~shared.federated.secagg.SecAggError`): the
device sends nothing more in the attempt, in particular no share. Any other error answer
(401, 403, 404, 422) is raised as ``error(response)``.

The outcome (:class:`SecAggOutcome`) says whether the masked input was accepted (the
device's update is then in the sum if the round closes) and where the device stopped.
"""

from __future__ import annotations

import base64
import binascii
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from client.transport import RetryPolicy, problem_detail, retry_after_seconds, upload_retries
from shared.federated.secagg import (
    PublicKeys,
    Roster,
    RoundContext,
    SecAggClient,
    SecAggError,
    SecAggParameters,
    SecAggRefusal,
    encode_ring,
    plan_parameters,
)
from shared.federated.secagg_messages import (
    SESSION_HEADER,
    EncryptedShareIn,
    KeysAccepted,
    KeysUpload,
    MaskedUpload,
    RevealedShare,
    RosterOut,
    SecAggStep,
    SharesInbox,
    SharesUpload,
    UnmaskRequestOut,
    UnmaskUpload,
)
from shared.federated.task import SecureAggregationSpec

__all__ = ["POLL_INTERVAL", "STEP_GRACE_SECONDS", "SecAggOutcome", "SecAggSession"]

logger = logging.getLogger("ldp.federated.secagg")

#: Seconds between two ``GET`` of a step that is still collecting, without ``Retry-After``.
POLL_INTERVAL = 0.2

#: A step may have opened before the device's request, and the relay's clock is not the
#: device's: the device waits this much longer than ``step_timeout_seconds`` for a step.
STEP_GRACE_SECONDS = 5.0

_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True)
class SecAggOutcome:
    """What the device did in one round attempt.

    ``included``: the relay accepted its masked input (its update is in the sum if the
    round closes); ``reached``: the last step whose ``POST`` the relay accepted (None:
    not even its keys); ``stopped``: why it stopped before the end (None: it answered
    the unmask request).
    """

    included: bool
    reached: SecAggStep | None
    stopped: str | None = None

    @property
    def completed(self) -> bool:
        """Whether the device took every step of the attempt."""
        return self.stopped is None


class _Stop(Exception):
    """The device leaves the attempt (a 409, a deadline, retries spent): no refusal."""

    def __init__(self, reason: str, level: int = logging.WARNING) -> None:
        super().__init__(reason)
        self.reason, self.level = reason, level


class SecAggSession:
    """One device's part in one attempt of a securely aggregated round.

    ``http`` sends the requests (to ``base`` + the task's paths, with ``headers``, to
    which the session adds its ``Secagg-Session``); ``context`` names the attempt;
    ``spec`` is the task's secure aggregation; ``min_inputs`` the fewest inputs a round
    may close with (the task's ``min_clients``), ``max_devices`` the most devices its
    roster holds (``max_clients``, by default ``ceil(clients_per_round)``: the relay
    closes the keys step there); ``modulus_bits(n)`` the fewest bits of
    the ring that hold the sum of ``n`` devices' inputs by the device's own computation;
    ``error(response)`` the exception raised for an answer that is not part of the
    protocol. ``clock`` (monotonic seconds), ``sleep`` and ``jitter`` pace the waits.
    """

    def __init__(
        self,
        http: httpx.Client,
        base: str,
        headers: Mapping[str, str],
        context: RoundContext,
        spec: SecureAggregationSpec,
        *,
        min_inputs: int,
        max_devices: int,
        modulus_bits: Callable[[int], int],
        error: Callable[[httpx.Response], Exception],
        retry: RetryPolicy | None = None,
        max_attempts: int = 8,
        poll_interval: float = POLL_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        jitter: random.Random | None = None,
    ) -> None:
        if not 1 <= min_inputs <= max_devices or max_attempts < 1 or not poll_interval > 0:
            raise ValueError(
                "need 1 <= min_inputs <= max_devices, max_attempts >= 1 and poll_interval "
                f"> 0, got {min_inputs!r}, {max_devices!r}, {max_attempts!r}, {poll_interval!r}"
            )
        self.context, self.spec = context, spec
        #: This attempt's session id: the device's name in the round, known to it alone.
        self.session_id = uuid.uuid4()
        self._http, self._error = http, error
        self._path = f"{base}/v1/federated/tasks/{context.task}/rounds/{context.round}/secagg"
        self._headers = {**headers, SESSION_HEADER: str(self.session_id)}
        self._min_inputs, self._max_devices = min_inputs, max_devices
        self._modulus_bits = modulus_bits
        self._retry, self._max_attempts = retry or RetryPolicy(), max_attempts
        self._poll_interval = poll_interval
        self._clock, self._sleep = clock, sleep
        self._jitter = jitter or random.Random()
        self._client = SecAggClient(context)
        self._ran = False
        self._reached: SecAggStep | None = None
        self._included = False
        #: Why the last request failed (for the log once the device gives up).
        self._last_failure = ""

    def run(self, values: np.ndarray) -> SecAggOutcome:
        """Take ``values`` (the device's lattice vector, integers) through the four steps.

        Returns once the device answered the unmask request or left the attempt; raises
        ``error(response)`` for an answer outside the protocol, ValueError for ``values``
        that are not a vector of integers, RuntimeError when the session ran before (its
        keys are for one run: a new attempt takes a new session).
        """
        if self._ran:
            raise RuntimeError("a secure aggregation session runs once; make a new one")
        self._ran = True
        vector = np.asarray(values)
        if vector.ndim != 1 or vector.size == 0 or not np.issubdtype(vector.dtype, np.integer):
            raise ValueError(
                f"values must be a non-empty vector of integers, got {vector.dtype} of "
                f"shape {vector.shape}"
            )
        try:
            roster, index = self._advertise(vector.size)
            inbox = self._share(roster, index)
            self._send_masked(roster, inbox, vector.astype(np.int64))
            self._unmask()
        except _Stop as stop:
            return self._stopped(stop.reason, stop.level)
        except SecAggError as refusal:
            kind = "refused" if isinstance(refusal, SecAggRefusal) else "stopped"
            return self._stopped(f"{kind}: {refusal}", logging.WARNING)
        return SecAggOutcome(self._included, self._reached)

    # --- the four steps --------------------------------------------------------------

    def _advertise(self, length: int) -> tuple[Roster, int]:
        """Step 1: advertise the keys; the checked roster and the device's index in it."""
        deadline = self._deadline()
        keys = self._client.advertise()
        body = KeysUpload(
            attempt=self.context.attempt,
            encryption_key=_b64(keys.encryption_key),
            masking_key=_b64(keys.masking_key),
        )
        accepted = self._parse(KeysAccepted, self._post("keys", body, deadline))
        roster = self._roster(self._parse(RosterOut, self._poll("keys", deadline)), length)
        return roster, accepted.participant

    def _share(self, roster: Roster, index: int) -> dict[int, bytes]:
        """Step 2: send the encrypted shares; the shares the neighbours sent, by sender."""
        deadline = self._deadline()
        ciphertexts = self._client.share_keys(roster, index)
        body = SharesUpload(
            shares=[
                EncryptedShareIn(recipient=recipient, ciphertext=_b64(ciphertext))
                for recipient, ciphertext in sorted(ciphertexts.items())
            ]
        )
        self._post("shares", body, deadline)
        inbox = self._parse(SharesInbox, self._poll("shares", deadline))
        shares: dict[int, bytes] = {}
        for share in inbox.shares:
            if share.sender in shares:
                raise SecAggRefusal(f"the inbox holds two shares from device {share.sender}")
            shares[share.sender] = _unb64(share.ciphertext, f"the share of {share.sender}")
        return shares

    def _send_masked(self, roster: Roster, inbox: Mapping[int, bytes], values: np.ndarray) -> None:
        """Step 3: the masked input, masked with exactly the senders of ``inbox``."""
        deadline = self._deadline()
        masked = self._client.mask(inbox, values)
        body = MaskedUpload(masked=_b64(encode_ring(masked, roster.parameters.modulus_bits)))
        self._post("masked", body, deadline)
        self._included = True

    def _unmask(self) -> None:
        """Step 4: the shares the unmask request asks for, once the request checks out."""
        deadline = self._deadline()
        request = self._parse(UnmaskRequestOut, self._poll("unmask", deadline))
        if request.masked_inputs < self._min_inputs:
            raise SecAggRefusal(
                f"the sum would hold {request.masked_inputs} masked inputs, fewer than the "
                f"{self._min_inputs} the task may close a round with: their noise is less "
                "than this device accepted"
            )
        seeds, secret_keys = self._client.unmask(request.survivors, request.dropped)
        body = UnmaskUpload(
            mask_seed_shares=_revealed(seeds), secret_key_shares=_revealed(secret_keys)
        )
        self._post("unmask", body, self._deadline())

    # --- checks ----------------------------------------------------------------------

    def _roster(self, out: RosterOut, length: int) -> Roster:
        """The roster the relay served, checked against what the device computes itself."""
        context = self.context
        served = (out.task, out.round, out.attempt)
        if served != (context.task, context.round, context.attempt):
            raise SecAggRefusal(
                f"the roster is for task {out.task!r}, round {out.round}, attempt "
                f"{out.attempt}; this device takes part in task {context.task!r}, round "
                f"{context.round}, attempt {context.attempt}"
            )
        n = len(out.participants)
        if [p.index for p in out.participants] != list(range(n)):
            raise SecAggRefusal(f"the roster's {n} participants are not indexed 0..{n - 1}")
        if not self._min_inputs <= n <= self._max_devices:
            raise SecAggRefusal(
                f"the roster has {n} devices; a round of the task has {self._min_inputs} "
                f"to {self._max_devices}"
            )
        if out.vector_length != length:
            raise SecAggRefusal(
                f"the roster's vector length is {out.vector_length}; this device's is {length}"
            )
        try:
            needed = self._modulus_bits(n)
        except ValueError as error:  # no ring of at most 64 bits holds the sum
            raise SecAggRefusal(f"the sum of {n} inputs fits no ring: {error}") from None
        if not needed <= out.modulus_bits <= 64:
            raise SecAggRefusal(
                f"the roster's ring has {out.modulus_bits} bits; the sum of {n} inputs needs "
                f"{needed} to 64 by this device's computation"
            )
        keys = tuple(
            PublicKeys(
                _unb64(p.encryption_key, f"device {p.index}'s encryption key"),
                _unb64(p.masking_key, f"device {p.index}'s masking key"),
            )
            for p in out.participants
        )
        parameters = SecAggParameters(length, out.modulus_bits, out.neighbours, out.threshold)
        roster = Roster(context, parameters, keys)  # SecAggError if malformed (k >= n, ...)
        planned = plan_parameters(n, length, out.modulus_bits, self.spec)
        if (out.neighbours, out.threshold) != (planned.neighbours, planned.threshold):
            raise SecAggRefusal(
                f"the roster has k = {out.neighbours} neighbours and threshold t = "
                f"{out.threshold}; for {n} devices the task's spec plans k = "
                f"{planned.neighbours} and t = {planned.threshold}"
            )
        return roster

    # --- HTTP --------------------------------------------------------------------------

    def _deadline(self) -> float:
        return self._clock() + self.spec.step_timeout_seconds + STEP_GRACE_SECONDS

    def _post(self, step: SecAggStep, body: BaseModel, deadline: float) -> httpx.Response:
        """``POST .../{step}``, repeated with the same body while it fails transiently."""
        content = body.model_dump(mode="json")
        failures = 0
        while True:
            response = self._send("POST", step, content)
            if response is not None and response.is_success:
                self._reached = step
                return response
            if response is not None:
                self._unless_transient(response, "POST", step)
            failures += 1
            self._wait_to_retry(response, failures, deadline, f"POST .../{step}")

    def _poll(self, step: SecAggStep, deadline: float) -> httpx.Response:
        """``GET .../{step}`` until the step has closed (200)."""
        failures = 0
        while True:
            response = self._send("GET", step, None)
            if response is not None and response.status_code == 200:
                return response
            if response is not None and response.status_code == 425:
                failures = 0
                wait = retry_after_seconds(response)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise _Stop(f"step {step!r} did not close within its timeout")
                self._sleep(min(self._poll_interval if wait is None else wait, remaining))
                continue
            if response is not None:
                self._unless_transient(response, "GET", step)
            failures += 1
            self._wait_to_retry(response, failures, deadline, f"GET .../{step}")

    def _send(self, method: str, step: str, content: Any) -> httpx.Response | None:
        """One request; None (and the reason kept) when no answer came."""
        try:
            response = self._http.request(
                method, f"{self._path}/{step}", headers=self._headers, json=content
            )
        except httpx.TransportError as failure:
            self._last_failure = f"{type(failure).__name__}: {failure}"
            return None
        self._last_failure = f"HTTP {response.status_code}: {problem_detail(response)}"
        return response

    def _unless_transient(self, response: httpx.Response, method: str, step: str) -> None:
        """Leave quietly on 409, raise ``error`` on an answer outside the protocol; return
        for one worth repeating (408, 429, 5xx; and 425 to a ``POST``, whose step's
        predecessor has not closed yet where this server answered)."""
        status = response.status_code
        if status == 409:
            raise _Stop(
                f"{method} .../{step}: {problem_detail(response)} (HTTP 409: not in the step)",
                logging.INFO,
            )
        if not (upload_retries(status) or status == 425):
            raise self._error(response)

    def _wait_to_retry(
        self, response: httpx.Response | None, failures: int, deadline: float, what: str
    ) -> None:
        """Back off before repeating ``what`` after its ``failures``-th consecutive failure;
        _Stop once ``max_attempts`` failed or the wait would pass the step's deadline."""
        if failures >= self._max_attempts:
            raise _Stop(f"{what} failed {failures} times; the last: {self._last_failure}")
        retry_after = None if response is None else retry_after_seconds(response)
        wait = self._retry.delay(failures - 1, retry_after, self._jitter)
        if self._clock() + wait > deadline:
            raise _Stop(f"{what} failed ({self._last_failure}) and the step's timeout is near")
        self._sleep(wait)

    def _parse(self, model: type[_Model], response: httpx.Response) -> _Model:
        """The relay's answer as ``model``; SecAggError when it is not one."""
        try:
            return model.model_validate(response.json())
        except (ValueError, ValidationError) as malformed:  # JSON or fields
            raise SecAggError(
                f"the answer to {response.request.method} {response.request.url.path} is "
                f"malformed: {malformed}"
            ) from None

    def _stopped(self, reason: str, level: int) -> SecAggOutcome:
        context = self.context
        logger.log(
            level,
            "task %r, round %d, attempt %d: secure aggregation left after step %s (masked "
            "input %s): %s",
            context.task, context.round, context.attempt, self._reached or "none",
            "in the sum" if self._included else "not sent", reason,
        )  # fmt: skip
        return SecAggOutcome(self._included, self._reached, reason)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    """Standard base64 (SecAggError naming ``what`` when it is not)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SecAggError(f"{what} is not base64") from None


def _revealed(shares: Mapping[int, bytes]) -> list[RevealedShare]:
    return [
        RevealedShare(owner=owner, share=_b64(share)) for owner, share in sorted(shares.items())
    ]
