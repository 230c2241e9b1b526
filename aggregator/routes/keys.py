"""API keys: create (shown once), list, revoke; admin only."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field

from aggregator import observability as obs
from aggregator.auth import Role, UnknownKeyError
from aggregator.deps import Admin, Keys, require_admin

logger = logging.getLogger("ldp.aggregator")
router = APIRouter(prefix="/v1/keys", tags=["keys"], dependencies=[Depends(require_admin)])


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


@router.post("", status_code=201)
def create_key(request_body: KeyRequest, principal: Admin, keys: Keys) -> KeyCreated:
    """Create an API key; the reply is the only time the key is shown."""
    key_id, key = keys.create(request_body.role, request_body.label)
    obs.log(
        logger,
        logging.INFO,
        "key created",
        key_id=key_id,
        role=request_body.role,
        by=principal.key_id,
    )
    return KeyCreated(key_id=key_id, role=request_body.role, label=request_body.label, key=key)


@router.get("")
def list_keys(keys: Keys) -> list[KeyInfo]:
    """Every key's id, role, label and state (never the key or its hash)."""
    return [KeyInfo.model_validate(row) for row in keys.listing()]


@router.delete("/{key_id}", status_code=204)
def revoke_key(key_id: str, principal: Admin, keys: Keys) -> Response:
    """Revoke a key (effective in every process within seconds)."""
    if not keys.revoke(key_id):
        raise UnknownKeyError(f"no active key {key_id!r}")
    obs.log(logger, logging.INFO, "key revoked", key_id=key_id, by=principal.key_id)
    return Response(status_code=204)
