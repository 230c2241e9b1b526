"""Federated learning on the device: join a task, train locally, upload a private update.

``FederatedClient(endpoint, api_key, task, data=(x, y))`` takes part in a task served by
the aggregator (``/v1/federated/...``). Each round it:

1. fetches the open round: the global parameters, the clip norm, the sampling rate q;
2. takes part with probability q (Poisson sampling, drawn on the device from the OS
   CSPRNG: the server's accounting assumes exactly that), once per draw of the round: a
   round the aggregator restarted (too few uploads by its deadline, the uploads
   discarded) comes back as a new ``attempt``, and the device decides again;
3. trains locally from the global parameters (``shared.federated.fedavg.client_update``)
   on its own data, which never leaves the device;
4. clips the update and adds its share of the noise for the task's mode
   (``shared.federated.privacy.privatize``: the same function the simulations run);
5. uploads the privatized update with a fresh ``update_id``; a failed upload (connection
   error, 429, 502, 503, 504) is retried with the same bytes and id, with exponential
   backoff and jitter, honouring ``Retry-After``; a round that closed meanwhile (409)
   ends the attempt.

A device can refuse a task whose privacy budget is larger than it accepts
(``max_epsilon``). The model is the built-in one the task names, or any object with
the :class:`shared.federated.models.Model` interface (a flat parameter vector, a loss
and its gradient, a prediction) of the same size.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from client.transport import RETRYABLE_STATUS, RetryPolicy, retry_after_seconds
from shared.federated.fedavg import client_update
from shared.federated.messages import RoundOut, UpdateUpload, decode_vector, encode_vector
from shared.federated.models import Model, make_model
from shared.federated.privacy import DPConfig, privatize
from shared.federated.task import TaskConfig
from shared.randomness import RandomSource

__all__ = ["FederatedClient", "FederatedError", "RoundInfo", "RoundResult", "TaskFinishedError"]


class FederatedError(RuntimeError):
    """The task cannot be joined or the server refused the update (not retryable)."""


class TaskFinishedError(FederatedError):
    """The task has run all of its rounds, or stopped at its privacy budget."""


@dataclass(frozen=True)
class RoundInfo:
    """The open round of a task, as the aggregator serves it."""

    task: str
    round: int
    attempt: int
    config: TaskConfig
    noise_multiplier: float
    clip_norm: float
    sample_rate: float
    expected_clients: float
    parameters: np.ndarray
    deadline: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundInfo:
        message = RoundOut.model_validate(data)
        parameters = decode_vector(message.parameters)
        if parameters.size != message.num_params:
            raise FederatedError("the served parameters do not match num_params")
        return cls(
            task=message.task,
            round=message.round,
            attempt=message.attempt,
            config=message.config,
            noise_multiplier=message.noise_multiplier,
            clip_norm=message.clip_norm,
            sample_rate=message.sample_rate,
            expected_clients=message.expected_clients,
            parameters=parameters,
            deadline=message.deadline,
        )

    def dp(self) -> DPConfig:
        """The privacy mode's parameters, for ``privatize``."""
        return DPConfig(
            self.config.mode,
            self.clip_norm,
            self.noise_multiplier,
            self.expected_clients,
            self.sample_rate,
            self.config.adaptive(),
        )


@dataclass(frozen=True)
class RoundResult:
    """What the device did in one round."""

    round: int
    participated: bool
    uploaded: bool
    attempt: int = 0


class FederatedClient:
    """One device's participation in one federated task; see the module docstring."""

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
        self.task, self.model, self.rng = task, model, rng
        self.max_epsilon = max_epsilon
        self.retry, self.max_attempts = retry or RetryPolicy(), max_attempts
        self._x, self._y = x, y.astype(np.int64)
        self._owns_http = http is None
        self._http = http or httpx.Client(base_url=endpoint.rstrip("/"), timeout=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._base = endpoint.rstrip("/") if http is not None else ""
        self._jitter = random.Random()
        #: The last (round, attempt) this device decided on: it decides once per draw.
        self._last_draw = (-1, 0)

    # --- rounds ----------------------------------------------------------------------

    def fetch_round(self) -> RoundInfo:
        """The task's open round; FederatedError once the task is finished or refused."""
        response = self._request("GET", f"/v1/federated/tasks/{self.task}/round")
        if response.status_code == 409 and _problem_type(response).endswith("task-finished"):
            raise TaskFinishedError(_problem(response))
        if response.status_code != 200:
            raise FederatedError(_problem(response))
        info = RoundInfo.from_json(response.json())
        self._check_budget(info.config)
        return info

    def run_round(self, round_info: RoundInfo | None = None) -> RoundResult:
        """Take part in the open round (fetched unless given) with probability q."""
        info = round_info or self.fetch_round()
        self._check_budget(info.config)
        self._last_draw = (info.round, info.attempt)
        if not self._sampled(info.sample_rate):
            return RoundResult(info.round, participated=False, uploaded=False, attempt=info.attempt)
        model = self.model or make_model(info.config.model)
        if model.num_params != info.parameters.size:
            raise FederatedError(
                f"the model has {model.num_params} parameters; the task's has "
                f"{info.parameters.size}"
            )
        training = info.config.local_training.training()
        # Local SGD's batch order: from the OS when no generator is given (not secret:
        # the noise below is what protects the data, drawn from the OS CSPRNG).
        generator = self.rng or np.random.default_rng(int.from_bytes(os.urandom(16), "big"))
        update = client_update(model, info.parameters, self._x, self._y, training, generator)
        contribution = privatize(update, info.dp(), info.clip_norm, self.rng)
        body = UpdateUpload(
            update_id=uuid.uuid4(),
            round=info.round,
            attempt=info.attempt,
            update=encode_vector(contribution.update),
            unclipped=contribution.unclipped,
            num_examples=int(self._x.shape[0]),
        ).model_dump(mode="json")
        uploaded = self._upload(body)
        return RoundResult(info.round, participated=True, uploaded=uploaded, attempt=info.attempt)

    def run(self, max_rounds: int | None = None, poll_interval: float = 1.0) -> list[RoundResult]:
        """Take part in each new round (and each new attempt of one) until the task
        finishes, or ``max_rounds`` decisions were made."""
        results: list[RoundResult] = []
        while max_rounds is None or len(results) < max_rounds:
            try:
                info = self.fetch_round()
            except TaskFinishedError:
                break
            if (info.round, info.attempt) <= self._last_draw:
                time.sleep(poll_interval)
                continue
            results.append(self.run_round(info))
        return results

    # --- plumbing --------------------------------------------------------------------

    def _check_budget(self, config: TaskConfig) -> None:
        if self.max_epsilon is None or config.mode == "none":
            return
        budget = config.target_epsilon
        if budget is None or budget > self.max_epsilon:
            raise FederatedError(
                f"task {self.task!r} promises epsilon {budget}; this device accepts at most "
                f"{self.max_epsilon}"
            )

    def _sampled(self, rate: float) -> bool:
        if rate >= 1.0:
            return True
        return bool(RandomSource(self.rng).bernoulli(rate, 1)[0])

    def _upload(self, body: dict[str, Any]) -> bool:
        path = f"/v1/federated/tasks/{self.task}/updates"
        for attempt in range(self.max_attempts):
            try:
                response = self._request("POST", path, json=body)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 200:
                return True
            if response is not None and response.status_code == 409:
                return False  # the round closed (or the task finished) meanwhile
            if response is not None and response.status_code not in RETRYABLE_STATUS:
                raise FederatedError(_problem(response))
            if attempt + 1 < self.max_attempts:
                retry_after = None if response is None else retry_after_seconds(response)
                time.sleep(self.retry.delay(attempt, retry_after, self._jitter))
        return False

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


def _problem_type(response: httpx.Response) -> str:
    try:
        return str(response.json().get("type", ""))
    except ValueError:
        return ""


def _problem(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text[:200]
    return f"{response.status_code}: {detail}"
