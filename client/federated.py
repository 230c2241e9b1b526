"""Federated learning on the device: join a task, train locally, upload a private update.

``FederatedClient(endpoint, api_key, task, data=(x, y))`` takes part in a task served by
the aggregator (``/v1/federated/...``). Each round it:

1. fetches the open round: the global parameters, the clip norm, the sampling rate q;
2. takes part with probability q (Poisson sampling, drawn on the device from the OS
   CSPRNG: the server's accounting assumes exactly that), once per draw of the round: a
   round the aggregator restarted (too few uploads by its deadline, the uploads
   discarded) comes back as a new ``attempt``, and the device decides again;
3. trains locally from the global parameters (``shared.federated.task.local_update``:
   local SGD, or DP-SGD in the silo mode) on its own data, which never leaves the device;
4. clips the update and adds its share of the noise for the task's mode
   (``shared.federated.privacy.privatize``: the same function the simulations run); the
   bit saying whether the update needed clipping is sent only where adaptive clipping
   uses it (with the mode's noise on it), and 0 otherwise;
5. uploads the privatized update with a fresh ``update_id``; a failed upload (connection
   error, 429, 502, 503, 504) is retried with the same bytes and id, with exponential
   backoff and jitter, honouring ``Retry-After``; a round that closed meanwhile (409)
   ends the attempt. Any other error answer (a key unknown or revoked, 401; of another
   role, 403; an update refused, 422) raises :class:`FederatedError` at once, with the
   status and the ``detail`` of the server's problem document (RFC 9457); an upload still
   failing after ``max_attempts`` is logged at WARNING with its last reason.

A ``distributed`` task with ``secure_aggregation`` replaces steps 4 and 5: the device
puts its clipped update on the integer lattice with its share of the noise
(``shared.federated.privacy.privatize_on_lattice``: integers, the adaptive-clipping
bit as a last coordinate) and takes part in the round's SecAgg+ through the relay
(:class:`client.secagg.SecAggSession`: keys, encrypted shares, masked input, unmasking).
The server receives only masked vectors and learns their sum; ``RoundResult.uploaded``
says whether the device's masked input was accepted. A device that drops out at any step
is tolerated; one that sees a request it must not answer (a roster or parameters that do
not match its own computation, an unmask request that would reveal both shares of a
neighbour or leave fewer inputs than ``min_clients``) refuses, logs why, and reveals
nothing more.

The model is the built-in one the task names, or any object with the
:class:`shared.federated.models.Model` interface (a flat parameter vector, a loss and its
gradient, a prediction) of the same size.

The device's privacy cap (``max_epsilon``, at ``max_delta``) is enforced on the device,
from what the device is actually served and does, never from what the task advertises
(``target_epsilon`` is the server's word; the served noise multiplier is what the noise
is drawn with). Each round, before anything is computed, the device recomputes the
epsilon of the task as served: ``T`` (the served ``rounds``) releases at the served
parameters, accounted by :func:`client.federated_ledger.device_epsilon` at
``delta = min(max_delta, served delta)``, and refuses (:class:`TaskRefusedError`, which
says what it computed and its cap) when that exceeds the cap. By mode:

``none``
    the raw update is uploaded: no guarantee at all. Always refused under a cap.
``local``
    the device clips to the served ``C`` and adds ``N(0, (z C)^2)`` itself, with the
    served ``z``: one upload is the Gaussian mechanism at ``z / 2`` (sensitivity ``2 C``),
    whatever ``C`` is, and whatever the server does. This the device verifies fully: the
    plan is ``T`` such uploads (no sampling amplification: the server sees who uploads),
    and the device's own ledger (:class:`client.federated_ledger.FederatedLedger`,
    durable with ``state_dir``) charges every upload it really makes, at the multiplier
    of its round, re-attempts of restarted rounds included, before the upload exists;
    once one more would pass the cap it stops (:class:`DeviceBudgetExhaustedError`). A
    server that changes ``z`` or ``C`` from round to round is charged round by round; a
    lower ``z`` is refused as soon as the plan at it passes the cap.
``silo``
    the device is a silo holding many records and protects each record: it runs the
    task's DP-SGD over its records (``shared.federated.dpsgd``: per-record clipping to
    the served ``C``, noise at the served ``z`` from the OS CSPRNG, ``s`` steps at the
    record rate ``q_r``) and uploads the difference of its parameters. This too the
    device verifies fully, as in the local mode: the plan is ``T s`` releases at
    ``(z, q_r)``, and the ledger charges the ``s`` releases of every upload before it is
    trained. A silo refuses to train past its budget: the smaller of ``max_epsilon`` and
    the task's own ``target_epsilon`` (per record, at ``delta``), checked against the
    ledger before each upload (:class:`DeviceBudgetExhaustedError`).
``central`` and ``distributed``
    the device's clipped update leaves with no noise (central) or a share too small to
    protect it alone (distributed); the guarantee rests on noise the server (or the
    peers) add, and on the server releasing nothing but the noisy aggregate, and on it
    counting its rounds honestly. Without secure aggregation the server sees each
    distributed upload with only its own small noise. With it (``secure_aggregation``)
    the server sees only the sum of the round's masked inputs, as long as it follows
    the protocol (it may be curious, and collude with a small share of the devices: the
    SecAgg+ bound of :mod:`shared.federated.secagg`); the device still trusts that the
    other devices add their noise shares (the sum's noise is theirs as much as its
    own), and that the server counts the shares honestly: that a round's inputs come
    from as many real devices as it says (sybils of the server add no noise), and that
    it charges and releases rounds as planned. None of that can be checked from the
    device: against the server itself the device's epsilon is unbounded. A user who
    sets a cap expects it to hold whoever runs the server, so a device with a cap
    refuses these modes unless ``trust_server_noise=True`` (a loud opt-in, as for any
    idealized guarantee); with it, the device checks what it can, the plan: ``T``
    rounds of the Poisson-subsampled Gaussian at the served ``q`` (the rate the device's
    own sampling uses) and the served multiplier (in the distributed mode the one of the
    fewest shares a round may close with, ``z sqrt(min_clients / (q W))``), each round at
    that round's parameters. Rounds whose parameters differ, and restarted rounds
    (discarded unread by an honest server), are composed by the server's accountant,
    which the device then trusts.

``max_epsilon`` requires ``state_dir``: the ledger that enforces the cap must survive the
app's restarts, or a restarted app would spend the cap again. Without ``max_epsilon`` the
device refuses only a round past the planned ones, and keeps the ledger of its local-mode
uploads (in memory unless ``state_dir`` is given) without accounting (:meth:`FederatedClient.
epsilon_spent` computes their epsilon on demand).
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import numpy as np
from pydantic import ConfigDict, PrivateAttr

from client.federated_ledger import FederatedLedger, device_epsilon
from client.secagg import SecAggSession
from client.transport import RETRYABLE_STATUS, RetryPolicy, problem_detail, retry_after_seconds
from shared.caps import within_cap
from shared.federated.messages import RoundOut, UpdateUpload, decode_vector, encode_vector
from shared.federated.models import Model, make_model
from shared.federated.privacy import DPConfig, privatize, privatize_on_lattice
from shared.federated.secagg import MAX_DEVICES, RoundContext
from shared.federated.task import SecureAggregationSpec, local_update
from shared.randomness import RandomSource

__all__ = [
    "DeviceBudgetExhaustedError",
    "FederatedClient",
    "FederatedError",
    "RoundInfo",
    "RoundResult",
    "TaskFinishedError",
    "TaskRefusedError",
]

#: ``run`` logs its progress here, at INFO: each round joined or skipped, each upload,
#: each restarted round, the end of the task.
logger = logging.getLogger("ldp.federated")


class FederatedError(RuntimeError):
    """The task cannot be joined or the server refused the update (not retryable).

    When the error is the aggregator's answer, ``status`` is its HTTP status and
    ``detail`` the ``detail`` of its problem document (RFC 9457), e.g. "the key is
    unknown or revoked"; both are None otherwise.
    """

    def __init__(self, message: str, status: int | None = None, detail: str | None = None):
        super().__init__(message)
        self.status, self.detail = status, detail

    @classmethod
    def from_response(cls, response: httpx.Response) -> Self:
        """The error that an answer of the aggregator is, saying which request it answered."""
        request, detail = response.request, problem_detail(response)
        return cls(
            f"HTTP {response.status_code} to {request.method} {request.url.path}: {detail}",
            response.status_code,
            detail,
        )


class TaskFinishedError(FederatedError):
    """The task has run all of its rounds, or stopped at its privacy budget."""


class TaskRefusedError(FederatedError):
    """The task as served is beyond what this device accepts: its mode, its epsilon, or
    parameters no honest server serves."""


class DeviceBudgetExhaustedError(TaskFinishedError):
    """This device's uploads to the task reached its own epsilon cap: it uploads no more."""


class RoundInfo(RoundOut):
    """The open round of a task, as the aggregator serves it (``RoundOut``), with its
    parameters decoded and checked (``vector``)."""

    model_config = ConfigDict(frozen=True)

    _vector: np.ndarray = PrivateAttr()

    @property
    def vector(self) -> np.ndarray:
        """The global model's parameters (float64, ``num_params`` of them)."""
        return self._vector

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundInfo:
        """The round a server served; FederatedError if it is malformed or its privacy
        parameters are invalid (a clip norm, multiplier or sampling rate out of range)."""
        try:
            info = cls.model_validate(data)
            vector = decode_vector(info.parameters)
        except ValueError as error:  # pydantic's ValidationError is a ValueError
            raise FederatedError(f"the server's round is malformed: {error}") from None
        if vector.size != info.num_params:
            raise FederatedError("the served parameters do not match num_params")
        info._vector = vector
        try:
            info.dp()
        except ValueError as error:
            raise FederatedError(f"the server serves invalid privacy parameters: {error}") from None
        return info

    def dp(self) -> DPConfig:
        """The privacy mode's parameters, for ``privatize``."""
        return DPConfig(
            self.config.mode,
            self.clip_norm,
            self.noise_multiplier,
            self.expected_clients,
            self.sample_rate,
            self.config.adaptive(),
            self.config.record_sampling(),
        )


@dataclass(frozen=True)
class RoundResult:
    """What the device did in one round."""

    round: int
    participated: bool
    uploaded: bool
    attempt: int = 0


class FederatedClient:
    """One device's participation in one federated task; see the module docstring.

    ``max_epsilon`` caps the device's epsilon for the task at ``delta = min(max_delta,
    the task's delta)``; ``trust_server_noise`` accepts the central and distributed modes
    under that cap (their guarantee rests on noise the device does not add);
    ``state_dir`` makes the ledger of local-mode uploads durable (in memory without it);
    a cap needs it, so that what the device spent survives a restart of the app.
    """

    def __init__(
        self,
        endpoint: str,
        api_key: str,
        task: str,
        data: tuple[np.ndarray, np.ndarray],
        model: Model | None = None,
        rng: np.random.Generator | None = None,
        *,
        max_epsilon: float | None = None,
        max_delta: float = 1e-5,
        trust_server_noise: bool = False,
        state_dir: str | Path | None = None,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        max_attempts: int = 8,
        http: httpx.Client | None = None,
    ) -> None:
        x, y = np.asarray(data[0], dtype=np.float64), np.asarray(data[1])
        if x.ndim != 2 or y.shape != (x.shape[0],) or x.shape[0] == 0:
            raise ValueError("data must be (x, y) with x of shape (n, features), y of shape (n,)")
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError("labels y must be integers")
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0, got {max_epsilon!r}")
        if max_epsilon is not None and state_dir is None:
            raise ValueError(
                "max_epsilon needs state_dir: a cap whose spending is kept only in memory "
                "is forgotten when the app restarts; pass state_dir=<a directory the app "
                "keeps> (the same one at every start)"
            )
        if not 0.0 < max_delta < 1.0:
            raise ValueError(f"max_delta must lie in (0, 1), got {max_delta!r}")
        self.task, self.model, self.rng = task, model, rng
        self.max_epsilon, self.max_delta = max_epsilon, max_delta
        self.trust_server_noise = trust_server_noise
        self.retry, self.max_attempts = retry or RetryPolicy(), max_attempts
        self._x, self._y = x, y.astype(np.int64)
        self._owns_http = http is None
        self._http = http or httpx.Client(base_url=endpoint.rstrip("/"), timeout=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._base = endpoint.rstrip("/") if http is not None else ""
        self._jitter = random.Random()
        self._ledger = FederatedLedger(endpoint, task, state_dir)
        #: The last (round, attempt) this device decided on: it decides once per draw.
        self._last_draw = (-1, 0)

    # --- rounds ----------------------------------------------------------------------

    def fetch_round(self) -> RoundInfo:
        """The task's open round; FederatedError once the task is finished or refused."""
        response = self._request("GET", f"/v1/federated/tasks/{self.task}/round")
        if response.status_code == 409 and _problem_type(response).endswith("task-finished"):
            raise TaskFinishedError.from_response(response)
        if response.status_code != 200:
            raise FederatedError.from_response(response)
        try:
            data = response.json()
        except ValueError:
            raise FederatedError("the server's round is not JSON") from None
        info = RoundInfo.from_json(data)
        self._check_task(info)
        return info

    def run_round(self, round_info: RoundInfo | None = None) -> RoundResult:
        """Take part in the open round (fetched unless given) with probability q.

        In the local and silo modes the upload is charged to the device's ledger before it
        is trained, noised and sent; DeviceBudgetExhaustedError (nothing sent) when it
        would take the device past its cap (``max_epsilon``; in the silo mode also the
        task's ``target_epsilon``). With secure aggregation the device takes the round's
        four steps (:mod:`client.secagg`) and returns when it has answered the unmask
        request or left the attempt (``uploaded``: its masked input was accepted).
        """
        info = round_info or self.fetch_round()
        self._check_task(info)
        self._last_draw = (info.round, info.attempt)
        if not self._sampled(info.sample_rate):
            return RoundResult(info.round, participated=False, uploaded=False, attempt=info.attempt)
        model = self.model or make_model(info.config.model)
        if model.num_params != info.vector.size:
            raise FederatedError(
                f"the model has {model.num_params} parameters; the task's has {info.vector.size}"
            )
        dp = info.dp()
        if dp.noised_on_device:
            self._charge(info)
        update = local_update(
            info.config, model, info.vector, self._x, self._y, info.noise_multiplier,
            info.clip_norm, self.rng,
        )  # fmt: skip
        spec = info.config.secure_aggregation
        if spec is not None:  # masked, summed: the server learns the sum alone
            values = privatize_on_lattice(update, dp, info.clip_norm, self.rng)
            included = self._secure_session(info, spec).run(values).included
            return RoundResult(
                info.round, participated=True, uploaded=included, attempt=info.attempt
            )
        contribution = privatize(update, dp, info.clip_norm, self.rng)
        body = UpdateUpload(
            update_id=uuid.uuid4(),
            round=info.round,
            attempt=info.attempt,
            update=encode_vector(contribution.update),
            # The clipped-or-not bit is data too: it leaves the device only where adaptive
            # clipping uses it (noised by the mode), never as a bare bit.
            unclipped=contribution.unclipped if dp.adaptive is not None else 0.0,
            num_examples=int(self._x.shape[0]),
        ).model_dump(mode="json")
        uploaded = self._upload(body)
        return RoundResult(info.round, participated=True, uploaded=uploaded, attempt=info.attempt)

    def run(
        self,
        max_rounds: int | None = None,
        poll_interval: float = 1.0,
        on_round: Callable[[RoundResult], None] | None = None,
    ) -> list[RoundResult]:
        """Take part in each new round (and each new attempt of one) until the task
        finishes, the device's budget for it is spent, or ``max_rounds`` decisions were
        made; returns the decisions, in order.

        Progress: each decision is logged at INFO on the ``ldp.federated`` logger
        (joined and uploaded; joined but not accepted, the round having closed first; or
        skipped: not sampled, with probability 1 - q), as are a round the aggregator
        restarted (a new ``attempt``: too few uploads by its deadline) and the end of the
        task; between decisions the device polls every ``poll_interval`` seconds until
        the round closes. ``on_round``, when given, is called with each decision's
        :class:`RoundResult` as soon as it is made.
        """
        results: list[RoundResult] = []
        while max_rounds is None or len(results) < max_rounds:
            try:
                info = self.fetch_round()
                if (info.round, info.attempt) <= self._last_draw:
                    time.sleep(poll_interval)
                    continue
                if info.round == self._last_draw[0]:
                    logger.info(
                        "task %r: round %d restarted by the aggregator (too few uploads by "
                        "its deadline); deciding again, attempt %d",
                        self.task, info.round, info.attempt,
                    )  # fmt: skip
                result = self.run_round(info)
            except TaskFinishedError as finished:
                logger.info(
                    "task %r finished after %d decisions: %s", self.task, len(results), finished
                )
                break
            logger.info("task %r: %s", self.task, _describe(result, info))
            results.append(result)
            if on_round is not None:
                on_round(result)
        return results

    def epsilon_spent(self) -> float:
        """The device's epsilon for this task from its ledger of local-mode uploads (every
        upload charged, re-attempts included), at ``min(max_delta, the task's delta)``."""
        return self._ledger.epsilon(self.max_delta)

    def planned_epsilon(self, info: RoundInfo) -> float:
        """Epsilon of the task as served in ``info``: ``T`` releases at its parameters.

        local: ``T`` Gaussian releases at ``z / 2``, no sampling; central: ``T`` rounds of
        the Gaussian at ``z`` Poisson-subsampled at the served ``q``; distributed: the same
        at ``z sqrt(min_clients / (q W))``, the noise of the fewest shares a round may
        close with (``DPConfig.accounting_noise_multiplier``, as the server charges);
        silo: ``T s`` DP-SGD steps at ``z``, each subsampling the records at ``q_r``;
        ``inf`` without noise. At ``delta = min(max_delta, the task's delta)``, by
        :func:`client.federated_ledger.device_epsilon`; the advertised target is not used.
        """
        dp = info.dp()
        if not dp.private:
            return math.inf
        multiplier = dp.accounting_noise_multiplier(info.config.min_clients)
        delta = min(self.max_delta, info.config.delta)
        releases = {multiplier: info.config.rounds * dp.releases_per_round}
        return device_epsilon(releases, dp.accounting_sample_rate, delta)

    # --- plumbing --------------------------------------------------------------------

    def _check_task(self, info: RoundInfo) -> None:
        """Refuse (TaskRefusedError) a round past the planned ones, and under a cap a task
        whose mode the device cannot accept or whose served plan costs more than the cap."""
        config, cap = info.config, self.max_epsilon
        if info.round >= config.rounds:
            raise TaskRefusedError(
                f"the server serves round {info.round} of task {self.task!r}, planned for "
                f"{config.rounds} rounds"
            )
        if cap is None:
            return
        if config.mode == "none":
            raise TaskRefusedError(
                f"task {self.task!r} runs in mode 'none': the raw update would be uploaded "
                f"with no differential privacy; this device accepts epsilon at most {cap:g}"
            )
        if config.mode in ("central", "distributed") and not self.trust_server_noise:
            who = "the server adds" if config.mode == "central" else "the other devices add"
            raise TaskRefusedError(
                f"task {self.task!r} runs in mode {config.mode!r}: its privacy rests on noise "
                f"{who}, which this device cannot verify; this device accepts epsilon at "
                f"most {cap:g} and does not trust server noise (trust_server_noise=False)"
            )
        epsilon = self.planned_epsilon(info)
        if not within_cap(epsilon, cap):
            advertised = (
                ""
                if config.target_epsilon is None
                else f" (it advertises epsilon {config.target_epsilon:g})"
            )
            raise TaskRefusedError(
                f"task {self.task!r} as served{advertised}: mode {config.mode!r}, noise "
                f"multiplier {info.noise_multiplier:g}, clip norm {info.clip_norm:g}, "
                f"sampling rate {info.sample_rate:g}, {config.rounds} rounds, costs epsilon "
                f"{epsilon:.4g} at delta {min(self.max_delta, config.delta):g} by this "
                f"device's accounting; this device accepts epsilon at most {cap:g}"
            )

    def _charge(self, info: RoundInfo) -> None:
        """Charge one upload to the ledger: a local-mode Gaussian release at ``z / 2``, or
        a silo's ``s`` DP-SGD steps at ``(z, q_r)``; refused past :meth:`_cap`."""
        dp = info.dp()
        delta = min(self.max_delta, info.config.delta)
        cap = self._cap(info)
        charge = self._ledger.charge(
            dp.accounting_noise_multiplier(1), delta, cap,
            sample_rate=dp.accounting_sample_rate, releases=dp.releases_per_round,
        )  # fmt: skip
        if not charge.charged:
            assert cap is not None and charge.epsilon is not None
            raise DeviceBudgetExhaustedError(
                f"task {self.task!r}: one more upload (round {info.round}, attempt "
                f"{info.attempt}, noise multiplier {info.noise_multiplier:g}) would bring "
                f"this device's epsilon to {charge.epsilon:.4g} at delta {charge.delta:g}, "
                f"past its cap of {cap:g}, after {self._ledger.uploads()} uploads"
            )

    def _cap(self, info: RoundInfo) -> float | None:
        """The epsilon this device's uploads to the task may reach: ``max_epsilon``, and in
        the silo mode the task's ``target_epsilon`` too (a silo trains no further than the
        budget its task names); None when neither applies."""
        caps = [self.max_epsilon]
        if info.config.mode == "silo":
            caps.append(info.config.target_epsilon)
        given = [cap for cap in caps if cap is not None]
        return min(given) if given else None

    def _sampled(self, rate: float) -> bool:
        if rate >= 1.0:
            return True
        return bool(RandomSource(self.rng).bernoulli(rate, 1)[0])

    def _upload(self, body: dict[str, Any]) -> bool:
        path = f"/v1/federated/tasks/{self.task}/updates"
        reason = "no attempt made"
        for attempt in range(self.max_attempts):
            try:
                response = self._request("POST", path, json=body)
            except httpx.TransportError as error:
                response, reason = None, f"{type(error).__name__}: {error}"
            if response is not None and response.status_code == 200:
                return True
            if response is not None and response.status_code == 409:
                return False  # the round closed (or the task finished) meanwhile
            if response is not None and response.status_code not in RETRYABLE_STATUS:
                raise FederatedError.from_response(response)
            if response is not None:
                reason = f"HTTP {response.status_code}: {problem_detail(response)}"
            if attempt + 1 < self.max_attempts:
                retry_after = None if response is None else retry_after_seconds(response)
                time.sleep(self.retry.delay(attempt, retry_after, self._jitter))
        logger.warning(
            "task %r: the update was not uploaded in %d attempts; the last failed with %s",
            self.task, self.max_attempts, reason,
        )  # fmt: skip
        return False

    def _secure_session(self, info: RoundInfo, spec: SecureAggregationSpec) -> SecAggSession:
        """This device's part in the secure aggregation (``spec``) of ``info``'s round
        attempt: fresh keys and session id, and the device's own checks of the roster
        (its ring holds the sum of the roster's inputs by
        :meth:`DPConfig.secure_modulus_bits`; a round closes with no fewer than
        ``min_clients`` inputs, and takes no more than ``max_clients`` devices, by default
        ``ceil(clients_per_round)``)."""
        dp, num_params = info.dp(), info.num_params
        return SecAggSession(
            self._http,
            self._base,
            self._headers,
            RoundContext(self.task, info.round, info.attempt),
            spec,
            min_inputs=info.config.min_clients,
            max_devices=min(
                MAX_DEVICES, info.config.max_clients or math.ceil(info.config.clients_per_round)
            ),
            modulus_bits=lambda devices: dp.secure_modulus_bits(
                info.clip_norm, num_params, devices
            ),
            error=FederatedError.from_response,
            retry=self.retry,
            max_attempts=self.max_attempts,
            jitter=self._jitter,
        )

    def _request(self, method: str, path: str, **options: Any) -> httpx.Response:
        return self._http.request(method, self._base + path, headers=self._headers, **options)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> FederatedClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _describe(result: RoundResult, info: RoundInfo) -> str:
    """One decision of ``run``, for its log."""
    where = f"round {result.round} (attempt {result.attempt}; {info.config.rounds} planned)"
    if not result.participated:
        return f"{where}: skipped (not sampled; probability {info.sample_rate:g} to take part)"
    if result.uploaded:
        if info.config.secure_aggregation is not None:
            return f"{where}: joined, masked update accepted for the secure sum"
        return f"{where}: joined, update uploaded"
    return (
        f"{where}: joined, but the update was not accepted (the round closed first, or "
        "every upload attempt failed)"
    )


def _problem_type(response: httpx.Response) -> str:
    try:
        return str(response.json().get("type", ""))
    except ValueError:
        return ""
