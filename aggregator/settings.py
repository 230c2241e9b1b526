"""The aggregator's settings: one frozen object, from the command line or the environment.

Every field can be set by an ``LDP_<FIELD>`` environment variable (``LDP_DATABASE``,
``LDP_MIN_REPORTS``, ...); command-line flags override the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


def default_database() -> str:
    """``$LDP_DATA_DIR/aggregator.sqlite3``, by default under ``~/.local/share/ldp-telemetry``."""
    base = os.environ.get("LDP_DATA_DIR") or Path.home() / ".local" / "share" / "ldp-telemetry"
    return str(Path(base) / "aggregator.sqlite3")


@dataclass(frozen=True)
class Settings:
    #: SQLite file path (or ``sqlite:///path``), or ``postgresql+psycopg://user@host/db``.
    database: str = field(default_factory=default_database)
    #: Most reports in one ``POST /v1/reports`` batch.
    max_batch_reports: int = 10_000
    #: Largest request body, in bytes (413 beyond it).
    max_body_bytes: int = 8 * 1024 * 1024
    #: Fewest reports in an estimate's window before anything is released (409 below it).
    min_reports: int = 100
    #: Width of the time buckets statistics are kept in, in seconds (one hour).
    bucket_seconds: int = 3600
    #: Report ids are kept this long; reports stamped earlier are refused (so a retry
    #: can never be counted twice).
    dedupe_retention_hours: int = 24 * 30
    #: Seconds between background compactions of the partial statistics (0: never).
    compaction_interval: float = 60.0
    #: Requests per second each API key may make, and the burst it may save up.
    rate_limit_per_second: float = 200.0
    rate_limit_burst: int = 400

    def __post_init__(self) -> None:
        positive = (
            "max_batch_reports",
            "max_body_bytes",
            "bucket_seconds",
            "dedupe_retention_hours",
            "rate_limit_per_second",
            "rate_limit_burst",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.min_reports < 1:
            raise ValueError(f"min_reports must be at least 1, got {self.min_reports}")
        if self.compaction_interval < 0:
            raise ValueError("compaction_interval must be >= 0 (0 turns compaction off)")
        if 3600 % self.bucket_seconds and self.bucket_seconds % 3600:
            raise ValueError("bucket_seconds must divide an hour or be a whole number of hours")

    @classmethod
    def from_environment(
        cls, environ: dict[str, str] | None = None, **overrides: object
    ) -> Settings:
        """Defaults, then ``LDP_*`` variables, then ``overrides`` that are not None."""
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for item in fields(cls):
            raw = environ.get(f"LDP_{item.name.upper()}")
            if raw is None:
                continue
            kind = {"int": int, "float": float, "str": str}[str(item.type)]
            try:
                values[item.name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"LDP_{item.name.upper()}={raw!r} is not a valid {kind.__name__}"
                ) from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values) if values else cls()
