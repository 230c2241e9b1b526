"""HTTP routes of federated learning, ``/v1/federated/...``: thin, over ``Federated``.

| method and path | who | what |
|---|---|---|
| ``POST /v1/federated/tasks`` | admin | create a task (noise calibrated for a target epsilon) |
| ``GET /v1/federated/tasks`` | analyst | every task's status |
| ``GET /v1/federated/tasks/{name}`` | analyst | round, epsilon spent, participants, evaluation |
| ``GET /v1/federated/tasks/{name}/round`` | device | the open round and the global model |
| ``POST /v1/federated/tasks/{name}/updates`` | device | one privatized update for a round |
| ``POST /v1/federated/tasks/{name}/close`` | admin | close the open round now |

Every refusal is a problem document (RFC 9457); calibration, aggregation and storage
run in worker threads.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request
from fastapi.concurrency import run_in_threadpool

from aggregator import observability as obs
from aggregator.deps import Admin, Analyst, Device
from aggregator.federated import Federated, FederatedError
from aggregator.problems import ProblemError
from aggregator.registry import METRIC_NAME
from shared.federated.messages import RoundOut, TaskCreate, TaskStatus, UpdateAccepted, UpdateUpload

__all__ = ["add_federated_routes"]

logger = logging.getLogger("ldp.aggregator")
TaskName = Annotated[str, Path(pattern=METRIC_NAME.pattern, description="Task name.")]


def _service(request: Request) -> Federated:
    federated: Federated = request.app.state.federated
    return federated


async def _call(function: Any, *args: Any) -> Any:
    try:
        return await run_in_threadpool(function, *args)
    except FederatedError as error:
        raise ProblemError(
            error.status, error.kind, error.title, str(error), error.problems
        ) from None


async def create_task(body: TaskCreate, request: Request, principal: Admin) -> Any:
    """Create a task. With ``target_epsilon`` the noise multiplier is calibrated so that
    the planned rounds spend exactly that budget (at ``delta``)."""
    status = await _call(_service(request).create, body)
    obs.log(logger, logging.INFO, "federated task created", task=body.name, by=principal.key_id)
    return status


async def list_tasks(request: Request, principal: Analyst) -> Any:
    """Every task's status."""
    return await _call(_service(request).tasks)


async def task_status(name: TaskName, request: Request, principal: Analyst) -> Any:
    """Round, epsilon spent so far, participants per round, evaluation of the model."""
    return await _call(_service(request).status, name)


async def open_round(name: TaskName, request: Request, principal: Device) -> Any:
    """The open round: the global model, the clip norm, the sampling rate, the deadline."""
    return await _call(_service(request).round, name)


async def upload_update(
    name: TaskName, body: UpdateUpload, request: Request, principal: Device
) -> Any:
    """One device's privatized update for the open round; a retry (same ``update_id``) is
    counted once. Refused with nothing stored: another round, wrong length, NaN or
    infinity, an L2 norm no honest update reaches."""
    return await _call(_service(request).upload, name, body)


async def close_round(name: TaskName, request: Request, principal: Admin) -> Any:
    """Close the open round now, if it has at least ``min_clients`` updates."""
    return await _call(_service(request).close, name)


def add_federated_routes(app: FastAPI) -> None:
    """Register the ``/v1/federated`` routes on ``app``."""
    prefix = "/v1/federated"
    tags: list[str | Enum] = ["federated"]
    table: list[tuple[str, str, Any, Any, int]] = [
        ("POST", "/tasks", create_task, TaskStatus, 201),
        ("GET", "/tasks", list_tasks, list[TaskStatus], 200),
        ("GET", "/tasks/{name}", task_status, TaskStatus, 200),
        ("GET", "/tasks/{name}/round", open_round, RoundOut, 200),
        ("POST", "/tasks/{name}/updates", upload_update, UpdateAccepted, 200),
        ("POST", "/tasks/{name}/close", close_round, TaskStatus, 200),
    ]
    for method, path, endpoint, model, status in table:
        app.add_api_route(
            prefix + path,
            endpoint,
            methods=[method],
            response_model=model,
            status_code=status,
            tags=tags,
        )
