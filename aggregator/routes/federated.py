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
``aggregator/errors.py``). The endpoints are plain functions: FastAPI runs them in its
worker threads, where calibration, aggregation and storage may block.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter

from aggregator import observability as obs
from aggregator.deps import Admin, Analyst, Device, FederatedService, TaskName
from shared.federated.messages import RoundOut, TaskCreate, TaskStatus, UpdateAccepted, UpdateUpload

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(prefix="/v1/federated/tasks", tags=["federated"])


@router.post("", status_code=201)
def create_task(body: TaskCreate, principal: Admin, federated: FederatedService) -> TaskStatus:
    """Create a task. With ``target_epsilon`` the noise multiplier is calibrated so that
    the planned rounds spend exactly that budget (at ``delta``)."""
    status = federated.create(body)
    obs.log(logger, logging.INFO, "federated task created", task=body.name, by=principal.key_id)
    return status


@router.get("")
def list_tasks(principal: Analyst, federated: FederatedService) -> list[TaskStatus]:
    """Every task's status."""
    return federated.tasks()


@router.get("/{name}")
def task_status(name: TaskName, principal: Analyst, federated: FederatedService) -> TaskStatus:
    """Round, epsilon spent so far (per user; in the silo mode per record of a silo that
    took part in every round), participants per round, evaluation of the model."""
    return federated.status(name)


@router.get("/{name}/round")
def open_round(name: TaskName, principal: Device, federated: FederatedService) -> RoundOut:
    """The open round: the global model, the clip norm, the sampling rate, the deadline."""
    return federated.round(name)


@router.post("/{name}/updates")
def upload_update(
    name: TaskName, body: UpdateUpload, principal: Device, federated: FederatedService
) -> UpdateAccepted:
    """One device's privatized update for the open round; a retry (same ``update_id``) is
    counted once. Refused with nothing stored: another round, wrong length, NaN or
    infinity, an L2 norm no honest update reaches."""
    return federated.upload(name, body)


@router.post("/{name}/close")
def close_round(name: TaskName, principal: Admin, federated: FederatedService) -> TaskStatus:
    """Close the open round now, if it has at least ``min_clients`` updates."""
    return federated.close(name)
