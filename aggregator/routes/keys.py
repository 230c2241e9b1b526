"""API keys: create (shown once), list, revoke; admin only."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from aggregator import observability as obs
from aggregator.auth import Role, UnknownKeyError
from aggregator.deps import Admin, Keys

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(tags=["keys"])


class KeyRequest(BaseModel):
    role: Role
    label: str = Field(default="", max_length=200)


class KeyCreated(BaseModel):
    key_id: str
    role: Role
    label: str
    key: str = Field(description="The bearer key. Shown once: only its hash is stored.")


class KeyInfo(BaseModel):
    key_id: str
    role: Role
    label: str
    created_at: float
    revoked_at: float | None


@router.post("/v1/keys", response_model=KeyCreated, status_code=201)
async def create_key(request_body: KeyRequest, principal: Admin, keys: Keys) -> Any:
    """Create an API key; the reply is the only time the key is shown."""
    key_id, key = await run_in_threadpool(keys.create, request_body.role, request_body.label)
    obs.log(
        logger,
        logging.INFO,
        "key created",
        key_id=key_id,
        role=request_body.role,
        by=principal.key_id,
    )
    return {"key_id": key_id, "role": request_body.role, "label": request_body.label, "key": key}


@router.get("/v1/keys", response_model=list[KeyInfo])
async def list_keys(principal: Admin, keys: Keys) -> Any:
    """Every key's id, role, label and state (never the key or its hash)."""
    rows = await run_in_threadpool(keys.listing)
    return [{k: row[k] for k in KeyInfo.model_fields} for row in rows]


@router.delete("/v1/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, principal: Admin, keys: Keys) -> Response:
    """Revoke a key (effective in every process within seconds)."""
    if not await run_in_threadpool(keys.revoke, key_id):
        raise UnknownKeyError(f"no active key {key_id!r}")
    obs.log(logger, logging.INFO, "key revoked", key_id=key_id, by=principal.key_id)
    return Response(status_code=204)
