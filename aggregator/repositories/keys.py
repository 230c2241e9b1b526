"""API keys: ``api_keys``, one row per key: its SHA-256 hash, role, label and revocation.

The key itself is never stored (``aggregator/auth.py`` hashes it). A hash is stored
once; a revoked key stays on record, so that its id keeps naming it.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, insert, select, update

from aggregator.repositories.database import Repository
from aggregator.repositories.schema import api_keys

__all__ = ["KeysRepository"]


class KeysRepository(Repository):
    """The stored API keys (hashes, never keys)."""

    def add_key(self, key_id: str, key_hash: str, role: str, label: str) -> bool:
        """Store a key's hash; False (and nothing changes) when that hash is already stored."""
        with self.database.write() as conn:
            exists = conn.execute(
                select(api_keys.c.key_id).where(api_keys.c.key_hash == key_hash)
            ).first()
            if exists is not None:
                return False
            conn.execute(
                insert(api_keys).values(
                    key_id=key_id,
                    key_hash=key_hash,
                    role=role,
                    label=label,
                    created_at=time.time(),
                    revoked_at=None,
                )
            )
            return True

    def keys(self) -> list[dict[str, Any]]:
        """Every key's row (``key_id``, ``key_hash``, ``role``, ``label``, ``created_at``,
        ``revoked_at``), oldest first."""
        with self.database.read() as conn:
            rows = conn.execute(select(api_keys).order_by(api_keys.c.created_at)).mappings().all()
        return [dict(row) for row in rows]

    def revoke_key(self, key_id: str, label: str | None = None) -> bool:
        """Revoke an active key (and relabel it, when ``label`` is given); False if none."""
        changes: dict[str, Any] = {"revoked_at": time.time()}
        if label is not None:
            changes["label"] = label
        with self.database.write() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id)
                .where(api_keys.c.revoked_at.is_(None))
                .values(**changes)
            )
            return result.rowcount == 1

    def restore_key(self, key_id: str, label: str) -> bool:
        """Make a revoked key active again, relabelled; False if no revoked key has that id."""
        with self.database.write() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id)
                .where(api_keys.c.revoked_at.is_not(None))
                .values(revoked_at=None, label=label)
            )
            return result.rowcount == 1

    def count_keys(self) -> int:
        """How many keys are stored, revoked ones included."""
        with self.database.read() as conn:
            return int(conn.execute(select(func.count()).select_from(api_keys)).scalar_one())
