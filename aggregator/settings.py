"""The aggregator's settings: one frozen object, from the command line or the environment.

Every field can be set by an ``LDP_<FIELD>`` environment variable (``LDP_DATABASE``,
``LDP_MIN_REPORTS``, ...); command-line flags override the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from aggregator.repositories.database import DEFAULT_TIMEOUT
from shared.schemas import MAX_BATCH_REPORTS

#: Bytes a body is allowed per report: the largest report of fixed size (OLH at the largest
#: domain and epsilon, a 64-character metric name, the largest version and a time) is 231
#: bytes of compact JSON, 243 with spaces after the separators. Bit-vector reports grow with
#: the domain: a body of the default size holds 10,000 reports of up to 256 bytes, or fewer
#: larger ones (e.g. 14 OUE reports at d = 2^20, 175 KB each).
REPORT_BYTES = 256


def default_database() -> str:
    """``$LDP_DATA_DIR/aggregator.sqlite3``, by default under ``~/.local/share/ldp-telemetry``."""
    base = os.environ.get("LDP_DATA_DIR") or Path.home() / ".local" / "share" / "ldp-telemetry"
    return str(Path(base) / "aggregator.sqlite3")


@dataclass(frozen=True)
class Settings:
    #: SQLite file path (or ``sqlite:///path``), or ``postgresql+psycopg://user@host/db``.
    database: str = field(default_factory=default_database)
    #: Most reports in one ``POST /v1/reports`` batch.
    max_batch_reports: int = MAX_BATCH_REPORTS
    #: Largest ``POST /v1/reports`` body, in bytes (413 beyond it): a full batch at
    #: ``REPORT_BYTES``.
    max_body_bytes: int = MAX_BATCH_REPORTS * REPORT_BYTES
    #: Largest body of every other request, in bytes (413 beyond it): a metric definition
    #: with many labels (100,000 candidate strings take about 3.3 MB), a federated update
    #: (base64 of its float64 parameters: about 790,000 parameters fit).
    max_other_body_bytes: int = 8 * 1024 * 1024
    #: Most bytes of request bodies received or processed at once; a body that would pass
    #: it is refused at once with 503 and ``Retry-After`` (eight bodies of the largest size).
    max_body_bytes_in_flight: int = 8 * MAX_BATCH_REPORTS * REPORT_BYTES
    #: Report batches validated at once by one worker process. Validation holds Python's
    #: global interpreter lock, so a second one in parallel gains nothing and makes every
    #: other request (``/healthz`` too) wait longer for its turn.
    parallel_validations: int = 1
    #: Seconds a connection may take to send a request's headers (counted from the
    #: connection, or from the previous response), and then its body; closed after.
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    #: Most open connections and requests in progress; past it, uvicorn answers 503.
    max_connections: int = 2048
    #: Fewest reports in an estimate's window before anything is released (409 below it).
    min_reports: int = 100
    #: Width of the time buckets statistics are kept in, in seconds (one hour).
    bucket_seconds: int = 3600
    #: Report ids are kept this long; reports stamped earlier are refused (so a retry
    #: can never be counted twice).
    dedupe_retention_hours: int = 24 * 30
    #: Seconds between background compactions of the partial statistics (0: never).
    compaction_interval: float = 60.0
    #: Longest wait for the database, in seconds: to connect, for a free connection, and
    #: for each answer (a connection silent that long is dropped); past it a request gets
    #: 503 with ``Retry-After`` of this many seconds.
    database_timeout: float = DEFAULT_TIMEOUT
    #: Requests per second each API key may make, and the burst it may save up.
    rate_limit_per_second: float = 200.0
    rate_limit_burst: int = 400
    #: Analyst estimates (estimate, series, heavy hitters) computed at once; more wait their
    #: turn, so the memory they take is bounded by this many times one request's.
    max_concurrent_estimates: int = 2
    #: Reports each device key may send per metric per hour (0: no quota); past it a batch
    #: is answered 429 with Retry-After (``aggregator.quotas``).
    reports_per_key_per_hour: int = 0

    def __post_init__(self) -> None:
        positive = (
            "max_batch_reports",
            "max_body_bytes",
            "max_other_body_bytes",
            "max_body_bytes_in_flight",
            "header_timeout",
            "body_timeout",
            "max_connections",
            "parallel_validations",
            "bucket_seconds",
            "dedupe_retention_hours",
            "rate_limit_per_second",
            "rate_limit_burst",
            "max_concurrent_estimates",
            "database_timeout",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_batch_reports > MAX_BATCH_REPORTS:
            raise ValueError(
                f"max_batch_reports must be at most {MAX_BATCH_REPORTS} (the batch schema's "
                f"limit), got {self.max_batch_reports}"
            )
        largest = max(self.max_body_bytes, self.max_other_body_bytes)
        if self.max_body_bytes_in_flight < largest:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                f"the largest body limit ({largest}), or no body of the largest size could "
                "ever be received"
            )
        if self.reports_per_key_per_hour < 0:
            raise ValueError(
                "reports_per_key_per_hour must be >= 0 (0: no quota), got "
                f"{self.reports_per_key_per_hour}"
            )
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
