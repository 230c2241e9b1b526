"""Bearer API keys with roles, stored hashed, and per-key rate limits.

Roles: ``device`` posts reports, ``analyst`` reads estimates, ``admin`` defines metrics
and manages keys (and may do what the others do). A key is ``ldp_`` + 32 random bytes
(URL-safe base64); the server stores only ``sha256(key)`` and compares hashes with
``hmac.compare_digest``. Keys are unguessable (256 bits), so a fast hash suffices: no
salt or slow hash is needed to resist guessing, unlike passwords.

Keys come from the admin API, from ``LDP_ADMIN_KEYS`` / ``LDP_ANALYST_KEYS`` /
``LDP_DEVICE_KEYS`` (comma-separated, hashed at start), or, when a database has no key
at all, from the first start, which creates one admin key and prints it once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from aggregator.storage import Storage

Role = Literal["device", "analyst", "admin"]
ROLES: tuple[Role, ...] = ("device", "analyst", "admin")
#: Environment variables that carry keys for each role.
KEY_VARIABLES: dict[Role, str] = {
    "admin": "LDP_ADMIN_KEYS",
    "analyst": "LDP_ANALYST_KEYS",
    "device": "LDP_DEVICE_KEYS",
}
KEY_PREFIX = "ldp_"
#: Shortest key accepted from the environment.
MIN_KEY_LENGTH = 16


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who made a request: the key's id and role (never the key)."""

    key_id: str
    role: Role

    def may(self, role: Role) -> bool:
        return self.role == role or self.role == "admin"


class KeyRing:
    """The valid keys' hashes, cached in memory and reloaded every ``ttl`` seconds.

    A presented key is hashed, its hash's first 16 hex digits find the candidate
    entries, and the full hashes are compared with ``hmac.compare_digest`` (constant
    time). Revocation and new keys reach every aggregator process within ``ttl``.
    """

    def __init__(self, storage: Storage, ttl: float = 2.0) -> None:
        self._storage = storage
        self._ttl = ttl
        self._lock = threading.Lock()
        self._by_prefix: dict[str, list[tuple[str, Principal]]] = {}
        self._loaded_at = -float("inf")

    def reload(self) -> None:
        by_prefix: dict[str, list[tuple[str, Principal]]] = {}
        for row in self._storage.keys():
            if row["revoked_at"] is None:
                entry = (row["key_hash"], Principal(row["key_id"], row["role"]))
                by_prefix.setdefault(row["key_hash"][:16], []).append(entry)
        with self._lock:
            self._by_prefix = by_prefix
            self._loaded_at = time.monotonic()

    def authenticate(self, key: str) -> Principal | None:
        if time.monotonic() - self._loaded_at > self._ttl:
            self.reload()
        digest = hash_key(key)
        with self._lock:
            entries = self._by_prefix.get(digest[:16], [])
        for stored, principal in entries:
            if hmac.compare_digest(stored, digest):
                return principal
        return None

    def create(self, role: Role, label: str) -> tuple[str, str]:
        """A new key for ``role``: ``(key_id, key)``. The key is shown once, stored hashed."""
        key = new_key()
        key_id = secrets.token_hex(8)
        self._storage.add_key(key_id, hash_key(key), role, label)
        self.reload()
        return key_id, key

    def import_key(self, key: str, role: Role, label: str) -> bool:
        """Store an operator-supplied key (from the environment); False if already stored."""
        if len(key) < MIN_KEY_LENGTH:
            raise ValueError(f"{role} keys must have at least {MIN_KEY_LENGTH} characters")
        added = self._storage.add_key(secrets.token_hex(8), hash_key(key), role, label)
        self.reload()
        return added

    def revoke(self, key_id: str) -> bool:
        revoked = self._storage.revoke_key(key_id)
        self.reload()
        return revoked


class RateLimiter:
    """A token bucket per key: ``rate`` requests per second, bursts up to ``burst``.

    In memory, per process: with W worker processes a key gets up to W times the rate.
    ``acquire`` returns 0 when the request may go ahead, else the seconds to wait.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def acquire(self, key_id: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / self.rate


def bootstrap_keys(keys: KeyRing, storage: Storage, environ: Mapping[str, str]) -> str | None:
    """Import keys from ``LDP_*_KEYS``; when none is stored at all, create an admin key.

    Returns the created admin key, to be printed once, or None. Run once per start,
    before the worker processes, so that two workers never both create one.
    """
    for role in ROLES:
        listed = environ.get(KEY_VARIABLES[role], "").split(",")
        for key in filter(None, (k.strip() for k in listed)):
            keys.import_key(key, role, f"from {KEY_VARIABLES[role]}")
    if storage.count_keys() == 0:
        return keys.create("admin", "created at first start")[1]
    return None
