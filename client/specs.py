"""Metric specs as the device sees them: fetched from the aggregator, checked, cached on disk.

``GET /v1/metrics`` is public; the device validates every spec itself (the same
``MetricSpec`` model as the server) and refuses what it cannot verify or what
exceeds its own limits. The last good list is kept in ``specs.json`` (written to a
temporary file, fsynced, renamed), so a device that starts offline still knows its
metrics, and refreshed every ``refresh_seconds``.

Each spec is installed with its identity, ``shared.spec_hash.spec_hash`` (SHA-256 of its
canonical JSON), computed once per fetch: what the device's memo, RAPPOR secret and
ledger keys are bound to, and what the ledger pins per name and version on first use
(``client.ledger.PrivacyLedger.pin``), refusing a different spec later with
``SpecChangedError``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.schemas import MetricSpec
from shared.spec_hash import spec_hash

SPECS_FILE = "specs.json"
#: Seconds between attempts to fetch the specs after a failure.
RETRY_SECONDS = 60.0


class SpecError(Exception):
    """A metric cannot be recorded: unknown, unverifiable, or beyond the device's limits."""


class SpecChangedError(SpecError):
    """The aggregator serves a metric version with a spec other than the one this device
    used under that name and version; nothing was spent or queued. A spec changes only
    with a new version."""


class SpecCache:
    """The current metric specs, from the aggregator or, offline, from the last good copy."""

    def __init__(
        self,
        state_dir: Path | str,
        fetch: Callable[[], list[dict[str, Any]]],
        refresh_seconds: float = 3600.0,
    ) -> None:
        self._path = Path(state_dir) / SPECS_FILE
        self._fetch = fetch
        self.refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        #: One fetch at a time: a refresh forced by ``record`` and the uploader's periodic
        #: one would otherwise write the cache file's temporary copy together.
        self._refreshing = threading.Lock()
        self._specs: dict[str, tuple[MetricSpec, bytes]] = {}
        self._problems: dict[str, str] = {}
        self._fetched_at = -float("inf")
        self._retry_at = -float("inf")
        #: Why the last fetch failed, or None.
        self.last_error: str | None = None
        self._load_cached()

    def get(self, name: str) -> MetricSpec:
        """The spec of ``name``, fetching the list first if ``name`` is not known yet."""
        return self.get_hashed(name)[0]

    def get_hashed(self, name: str) -> tuple[MetricSpec, bytes]:
        """The spec of ``name`` and its ``spec_hash`` (as ``get``)."""
        with self._lock:
            found = self._specs.get(name)
        if found is None:
            self.refresh(force=True)
            with self._lock:
                found = self._specs.get(name)
                problem = self._problems.get(name)
            if found is None:
                if problem is None and self.last_error is not None and not self._specs:
                    problem = (
                        f"cannot record {name!r}: the metric specs could not be fetched "
                        f"({self.last_error}) and none are cached yet"
                    )
                raise SpecError(problem or f"the aggregator defines no metric {name!r}")
        return found

    def refresh(self, force: bool = False) -> bool:
        """Fetch the specs if due (or ``force``); False when offline (the cache stays)."""
        with self._refreshing:
            return self._refresh(force)

    def _refresh(self, force: bool) -> bool:
        now = time.monotonic()
        if not force and now - self._fetched_at < self.refresh_seconds:
            return True
        if not force and now < self._retry_at:
            return False
        try:
            items = self._fetch()
        except Exception as error:  # noqa: BLE001 - offline or failing: keep the last good specs
            # Try again in a minute (or at the next unknown metric), not at every wake-up.
            self._retry_at = now + min(RETRY_SECONDS, self.refresh_seconds)
            self.last_error = f"{type(error).__name__}: {error}"
            return False
        self._install(items)
        self._fetched_at = time.monotonic()
        self.last_error = None
        self._save(items)
        return True

    def _install(self, items: list[dict[str, Any]]) -> None:
        specs: dict[str, tuple[MetricSpec, bytes]] = {}
        problems: dict[str, str] = {}
        for item in items if isinstance(items, list) else []:
            name = item.get("name") if isinstance(item, dict) else None
            try:
                spec = MetricSpec.model_validate(item)
            except ValidationError as error:
                if isinstance(name, str):
                    problems[name] = f"metric {name!r} has a spec this SDK cannot verify: {error}"
                continue
            specs[spec.name] = (spec, spec_hash(spec))
        with self._lock:
            self._specs, self._problems = specs, problems

    def _load_cached(self) -> None:
        try:
            items = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        self._install(items)

    def _save(self, items: list[dict[str, Any]]) -> None:
        temporary = self._path.with_suffix(".tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(items, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self._path)
