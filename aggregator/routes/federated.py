"""HTTP routes of federated learning, ``/v1/federated/...``: thin, over ``Federated``.

| method and path | who | what |
|---|---|---|
| ``POST /v1/federated/tasks`` | admin | create a task (noise calibrated for a target epsilon) |
| ``GET /v1/federated/tasks`` | analyst | every task's status |
| ``GET /v1/federated/tasks/{name}`` | analyst | round, epsilon spent, participants, evaluation |
| ``GET /v1/federated/tasks/{name}/round`` | device | the open round and the global model |
| ``POST /v1/federated/tasks/{name}/updates`` | device | one privatized update for a round |
| ``POST /v1/federated/tasks/{name}/close`` | admin | close the open round now |
| ``POST .../{name}/rounds/{round}/secagg/keys`` | device | step 1: advertise keys |
| ``GET .../{name}/rounds/{round}/secagg/keys`` | device | the frozen roster |
| ``POST .../{name}/rounds/{round}/secagg/shares`` | device | step 2: encrypted shares |
| ``GET .../{name}/rounds/{round}/secagg/shares`` | device | the shares addressed to it |
| ``POST .../{name}/rounds/{round}/secagg/masked`` | device | step 3: the masked input |
| ``GET .../{name}/rounds/{round}/secagg/unmask`` | device | what to reveal |
| ``POST .../{name}/rounds/{round}/secagg/unmask`` | device | step 4: revealed shares |
| ``GET .../{name}/rounds/{round}/secagg`` | analyst, device | where the secure round stands |

The ``secagg`` endpoints (a task with ``secure_aggregation``; ``aggregator/secagg.py``)
name the device by its ``Secagg-Session`` header, except the status.

A refusal is a ``FederatedError``, answered by its problem document (RFC 9457,
``aggregator/errors.py``). The endpoints are plain functions: FastAPI runs them in its
worker threads, where calibration, aggregation and storage may block.
"""

from __future__ import annotations

import logging
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Header, Path

from aggregator import observability as obs
from aggregator.deps import Admin, Analyst, Device, FederatedService, Observer, TaskName
from shared.federated.messages import RoundOut, TaskCreate, TaskStatus, UpdateAccepted, UpdateUpload
from shared.federated.secagg_messages import (
    SESSION_HEADER,
    KeysAccepted,
    KeysUpload,
    MaskedUpload,
    RosterOut,
    SecAggStatus,
    SharesInbox,
    SharesUpload,
    StepAccepted,
    UnmaskRequestOut,
    UnmaskUpload,
)

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(prefix="/v1/federated/tasks", tags=["federated"])

#: A round's number in a path.
RoundNumber = Annotated[int, Path(alias="round", ge=0, description="Round number.")]
#: The device's session in a secure round: the UUID it advertised its keys with.
Session = Annotated[
    UUID, Header(alias=SESSION_HEADER, description="the device's session in the round")
]
SECAGG = "/{name}/rounds/{round}/secagg"


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


@router.post(f"{SECAGG}/keys")
def secagg_keys(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    body: KeysUpload,
    principal: Device,
    federated: FederatedService,
) -> KeysAccepted:
    """Step 1: the device's two public keys for the open attempt; its index in the round.
    409 when the attempt is not the open one or the keys step has closed."""
    return federated.secagg.advertise(name, round_number, session, body)


@router.get(f"{SECAGG}/keys")
def secagg_roster(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    principal: Device,
    federated: FederatedService,
) -> RosterOut:
    """Every device's keys and the round's parameters, once the keys step closed (425
    before, with ``Retry-After``)."""
    return federated.secagg.roster(name, round_number, session)


@router.post(f"{SECAGG}/shares")
def secagg_shares(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    body: SharesUpload,
    principal: Device,
    federated: FederatedService,
) -> StepAccepted:
    """Step 2: one encrypted share for each of the device's neighbours (422 naming the
    recipient otherwise)."""
    return federated.secagg.share(name, round_number, session, body)


@router.get(f"{SECAGG}/shares")
def secagg_inbox(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    principal: Device,
    federated: FederatedService,
) -> SharesInbox:
    """The shares addressed to the device, once the shares step closed (409 if it closed
    without the device)."""
    return federated.secagg.inbox(name, round_number, session)


@router.post(f"{SECAGG}/masked")
def secagg_masked(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    body: MaskedUpload,
    principal: Device,
    federated: FederatedService,
) -> StepAccepted:
    """Step 3: the device's masked input (exactly ``vector_length`` ring elements)."""
    return federated.secagg.mask(name, round_number, session, body)


@router.get(f"{SECAGG}/unmask")
def secagg_unmask_request(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    principal: Device,
    federated: FederatedService,
) -> UnmaskRequestOut:
    """Which neighbours' shares the device is to reveal, once the masked step closed."""
    return federated.secagg.unmask_request(name, round_number, session)


@router.post(f"{SECAGG}/unmask")
def secagg_unmask(
    name: TaskName,
    round_number: RoundNumber,
    session: Session,
    body: UnmaskUpload,
    principal: Device,
    federated: FederatedService,
) -> StepAccepted:
    """Step 4: the shares the unmask request asked for; the last expected one closes the
    round."""
    return federated.secagg.unmask(name, round_number, session, body)


@router.get(SECAGG)
def secagg_status(
    name: TaskName, round_number: RoundNumber, principal: Observer, federated: FederatedService
) -> SecAggStatus:
    """Where the open round's secure aggregation stands: the step collecting now, its
    deadline, and the messages of each step."""
    return federated.secagg.status(name, round_number)
