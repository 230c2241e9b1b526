"""HTTP routes of federated learning, ``/v1/federated/...``: thin, over ``Federated``.

| method and path | who | what |
|---|---|---|
| ``POST /v1/federated/tasks`` | admin | create a task (noise calibrated for a target epsilon) |
| ``GET /v1/federated/tasks`` | analyst | every task's status |
| ``GET /v1/federated/tasks/{name}`` | analyst | round, epsilon spent, participants, evaluation |
| ``GET /v1/federated/tasks/{name}/round`` | device | the open round and the global model |
| ``POST /v1/federated/tasks/{name}/updates`` | device | one privatized update for a round |
| ``POST /v1/federated/tasks/{name}/close`` | admin | close the open round now |

A refusal is a ``FederatedError``, answered by its problem document (RFC 9457,
``aggregator/errors.py``); calibration, aggregation and storage run in worker threads.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.concurrency import run_in_threadpool

from aggregator import observability as obs
from aggregator.deps import Admin, Analyst, Device, FederatedService
from aggregator.registry import METRIC_NAME
from shared.federated.messages import RoundOut, TaskCreate, TaskStatus, UpdateAccepted, UpdateUpload

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(tags=["federated"])
TaskName = Annotated[str, Path(pattern=METRIC_NAME.pattern, description="Task name.")]


@router.post("/v1/federated/tasks", response_model=TaskStatus, status_code=201)
async def create_task(body: TaskCreate, principal: Admin, federated: FederatedService) -> Any:
    """Create a task. With ``target_epsilon`` the noise multiplier is calibrated so that
    the planned rounds spend exactly that budget (at ``delta``)."""
    status = await run_in_threadpool(federated.create, body)
    obs.log(logger, logging.INFO, "federated task created", task=body.name, by=principal.key_id)
    return status


@router.get("/v1/federated/tasks", response_model=list[TaskStatus])
async def list_tasks(principal: Analyst, federated: FederatedService) -> Any:
    """Every task's status."""
    return await run_in_threadpool(federated.tasks)


@router.get("/v1/federated/tasks/{name}", response_model=TaskStatus)
async def task_status(name: TaskName, principal: Analyst, federated: FederatedService) -> Any:
    """Round, epsilon spent so far (per user; in the silo mode per record of a silo that
    took part in every round), participants per round, evaluation of the model."""
    return await run_in_threadpool(federated.status, name)


@router.get("/v1/federated/tasks/{name}/round", response_model=RoundOut)
async def open_round(name: TaskName, principal: Device, federated: FederatedService) -> Any:
    """The open round: the global model, the clip norm, the sampling rate, the deadline."""
    return await run_in_threadpool(federated.round, name)


@router.post("/v1/federated/tasks/{name}/updates", response_model=UpdateAccepted)
async def upload_update(
    name: TaskName, body: UpdateUpload, principal: Device, federated: FederatedService
) -> Any:
    """One device's privatized update for the open round; a retry (same ``update_id``) is
    counted once. Refused with nothing stored: another round, wrong length, NaN or
    infinity, an L2 norm no honest update reaches."""
    return await run_in_threadpool(federated.upload, name, body)


@router.post("/v1/federated/tasks/{name}/close", response_model=TaskStatus)
async def close_round(name: TaskName, principal: Admin, federated: FederatedService) -> Any:
    """Close the open round now, if it has at least ``min_clients`` updates."""
    return await run_in_threadpool(federated.close, name)
