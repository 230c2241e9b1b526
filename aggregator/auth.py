"""Bearer API keys with roles, stored hashed, and per-key rate limits.

Roles: ``device`` posts reports, ``analyst`` reads estimates, ``admin`` defines metrics
and manages keys (and may do what the others do). A key is ``ldp_`` + 32 random bytes
(URL-safe base64); the server stores only ``sha256(key)`` and compares hashes with
``hmac.compare_digest``. Keys are unguessable (256 bits), so a fast hash suffices: no
salt or slow hash is needed to resist guessing, unlike passwords.

Keys come from the admin API or ``ldp-aggregator create-key``, from ``LDP_ADMIN_KEYS``
/ ``LDP_ANALYST_KEYS`` / ``LDP_DEVICE_KEYS`` (comma-separated, hashed at start), or, when
a database has no key at all, from the first start, which creates one admin key and
prints it once.

Keys from the environment follow it. Each is stored with the label ``from
LDP_<ROLE>_KEYS`` (labels the API and the CLI refuse), and at every start
(``sync_environment_keys``):

* a listed key not stored yet is added;
* a stored environment key no longer listed in its role's variable (or the variable
  unset) is revoked, and relabelled ``from LDP_<ROLE>_KEYS; revoked at start: no
  longer listed``;
* a key revoked that way and listed again is active again, under its first label and
  key id: an accidental start without the variables is undone by a start with them;
* a key revoked through the API stays revoked even if listed (a revocation is final:
  list a new key), and a key keeps the role it was first stored with; the start logs a
  warning for each such key, naming the variable and the key id, never the key.

Keys created by the API or the CLI are never touched by a start.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aggregator import observability as obs
from aggregator.repositories.keys import KeysRepository

logger = logging.getLogger("ldp.aggregator")

Role = Literal["device", "analyst", "admin"]
ROLES: tuple[Role, ...] = ("device", "analyst", "admin")
#: Environment variables that carry keys for each role.
KEY_VARIABLES: dict[Role, str] = {
    "admin": "LDP_ADMIN_KEYS",
    "analyst": "LDP_ANALYST_KEYS",
    "device": "LDP_DEVICE_KEYS",
}
#: How messages name a key of each role, article included.
KEY_OF_ROLE: dict[Role, str] = {
    "admin": "an admin key",
    "analyst": "an analyst key",
    "device": "a device key",
}
#: The label of a key stored from each role's variable.
ENVIRONMENT_LABELS: dict[Role, str] = {
    role: f"from {variable}" for role, variable in KEY_VARIABLES.items()
}
#: Appended to that label when a start revokes the key because it is no longer listed.
UNLISTED = "; revoked at start: no longer listed"
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


class InvalidKeyRequestError(ValueError):
    """A key that cannot be created as asked (a label reserved for environment keys)."""


class UnknownKeyError(LookupError):
    """No active key has that id."""


class KeyRing:
    """The valid keys' hashes, cached in memory and reloaded every ``ttl`` seconds.

    A presented key is hashed, its hash's first 16 hex digits find the candidate
    entries, and the full hashes are compared with ``hmac.compare_digest`` (constant
    time). Revocation and new keys reach every aggregator process within ``ttl``.
    """

    def __init__(self, storage: KeysRepository, ttl: float = 2.0) -> None:
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
        """A new key for ``role``: ``(key_id, key)``. The key is shown once, stored hashed.

        Raises ``InvalidKeyRequestError`` for a label reserved for keys from the environment.
        """
        if environment_role(label) is not None:
            raise InvalidKeyRequestError(
                f"the label {label!r} is reserved for keys from the environment"
            )
        key = new_key()
        key_id = secrets.token_hex(8)
        self._storage.add_key(key_id, hash_key(key), role, label)
        self.reload()
        return key_id, key

    def import_key(self, key: str, role: Role, label: str) -> str | None:
        """Store an operator-supplied key (checked by ``listed_keys``); its new key id, or
        None if that key is already stored."""
        key_id = secrets.token_hex(8)
        added = self._storage.add_key(key_id, hash_key(key), role, label)
        self.reload()
        return key_id if added else None

    def revoke(self, key_id: str) -> bool:
        """Revoke an active key; False when there is none with that id."""
        revoked = self._storage.revoke_key(key_id)
        self.reload()
        return revoked

    def listing(self) -> list[dict[str, Any]]:
        """Every stored key's row, oldest first (with its hash: callers choose what to show)."""
        return self._storage.keys()


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


def environment_role(label: str) -> Role | None:
    """The role whose variable a key with this label came from, or None (not from it)."""
    for role, environment in ENVIRONMENT_LABELS.items():
        if label in (environment, environment + UNLISTED):
            return role
    return None


@dataclass
class KeyChanges:
    """What a start did to the keys from the environment (key ids), and what it refused."""

    added: list[str] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def listed_keys(environ: Mapping[str, str]) -> dict[str, tuple[str, Role]]:
    """The keys ``LDP_*_KEYS`` list, by hash: ``{hash: (key, role)}``.

    Raises ValueError, before anything is stored, for a key shorter than
    ``MIN_KEY_LENGTH`` or one listed for two roles.
    """
    listed: dict[str, tuple[str, Role]] = {}
    for role in ROLES:
        variable = KEY_VARIABLES[role]
        for key in filter(None, (k.strip() for k in environ.get(variable, "").split(","))):
            if len(key) < MIN_KEY_LENGTH:
                raise ValueError(f"{variable}: keys must have at least {MIN_KEY_LENGTH} characters")
            digest = hash_key(key)
            other = listed.get(digest, (key, role))[1]
            if other != role:
                raise ValueError(
                    f"a key is listed in both {KEY_VARIABLES[other]} and {variable}; "
                    "a key has one role"
                )
            listed[digest] = (key, role)
    return listed


def sync_environment_keys(
    keys: KeyRing, storage: KeysRepository, environ: Mapping[str, str]
) -> KeyChanges:
    """Make the stored environment keys follow ``LDP_*_KEYS`` (the rules are in the module
    docstring); raises ValueError, changing nothing, for a badly formed list."""
    listed = listed_keys(environ)
    changes = KeyChanges()
    stored = {row["key_hash"]: row for row in storage.keys()}
    for digest, row in stored.items():
        role = environment_role(row["label"])
        if role is None:
            continue
        still_listed = listed.get(digest, ("", None))[1] == row["role"]
        if row["revoked_at"] is None and not still_listed:
            storage.revoke_key(row["key_id"], ENVIRONMENT_LABELS[role] + UNLISTED)
            changes.revoked.append(row["key_id"])
        elif row["label"].endswith(UNLISTED) and still_listed:
            storage.restore_key(row["key_id"], ENVIRONMENT_LABELS[role])
            changes.restored.append(row["key_id"])
    for digest, (key, role) in listed.items():
        found = stored.get(digest)
        variable = KEY_VARIABLES[role]
        if found is None:
            key_id = keys.import_key(key, role, ENVIRONMENT_LABELS[role])
            if key_id is not None:  # else another process stored it meanwhile
                changes.added.append(key_id)
        elif found["role"] != role:
            changes.refused.append(
                f"a key listed in {variable} is stored as {KEY_OF_ROLE[found['role']]} (id "
                f"{found['key_id']}); a key keeps its role: list a new key"
            )
        elif found["revoked_at"] is not None and not found["label"].endswith(UNLISTED):
            changes.refused.append(
                f"a key listed in {variable} (id {found['key_id']}) was revoked; a revocation "
                "is final: list a new key"
            )
    keys.reload()
    return changes


def bootstrap_keys(
    keys: KeyRing, storage: KeysRepository, environ: Mapping[str, str]
) -> str | None:
    """Make the keys follow ``LDP_*_KEYS``; when none is stored at all, create an admin key.

    Returns the created admin key, to be printed once, or None. Run once per start,
    before the worker processes, so that two workers never both create one.
    """
    changes = sync_environment_keys(keys, storage, environ)
    if changes.revoked:
        obs.log(logger, logging.WARNING, "environment keys revoked", key_ids=changes.revoked)
    if changes.restored:
        obs.log(logger, logging.WARNING, "environment keys restored", key_ids=changes.restored)
    for refusal in changes.refused:
        obs.log(logger, logging.WARNING, "environment key not active", reason=refusal)
    if storage.count_keys() == 0:
        return keys.create("admin", "created at first start")[1]
    return None
