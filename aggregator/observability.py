"""Prometheus metrics and structured logs.

Metrics (``GET /metrics``): reports accepted, duplicates, rejected by reason, ingest
latency per batch, estimate latency, requests by route and status, bodies refused for
lack of room and the bytes of bodies in progress, secure aggregation's messages (by step and
outcome), closed steps and ended rounds, connections closed because a request
arrived too slowly (``part``: headers or body), and full reloads of
the metric catalog (``ldp_catalog_reloads_total``: one per change of the definitions).
With several worker processes, ``PROMETHEUS_MULTIPROC_DIR`` (set by ``ldp-aggregator
serve --workers N``) makes every process write its samples there and ``/metrics`` sum
them.

Logs are one JSON object per line on stderr: time, level, event and fields. They never
carry a client address, a key, or report contents.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

REPORTS_ACCEPTED = Counter("ldp_reports_accepted", "Reports stored and counted.")
REPORTS_DUPLICATE = Counter("ldp_reports_duplicate", "Reports ignored as already accepted.")
REPORTS_REJECTED = Counter(
    "ldp_reports_rejected",
    "Reports in refused batches (when the batch parsed), by reason.",
    ["reason"],
)
BATCHES_REJECTED = Counter("ldp_batches_rejected", "Batches refused, by reason.", ["reason"])
REPORTS_BY_KEY = Counter(
    "ldp_reports_by_key",
    "Reports offered per device key id (stored or duplicate): one key standing for many "
    "devices shows here.",
    ["key"],
)
QUOTA_REFUSALS = Counter(
    "ldp_quota_refusals",
    "Batches refused with 429 because a device key passed its hourly quota, by key and metric.",
    ["key", "metric"],
)
REPORTS_REFUSED_BY_RULE = Counter(
    "ldp_reports_refused_by_rule",
    "Reports no honest device sends (a mechanism's refusal rule), by metric and rule.",
    ["metric", "rule"],
)
INGEST_SECONDS = Histogram(
    "ldp_ingest_seconds",
    "Time to validate and durably store one batch.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
BODIES_REFUSED = Counter(
    "ldp_bodies_refused",
    "Requests refused with 503 because too many bytes of bodies were in progress.",
)
BODY_BYTES_IN_FLIGHT = Gauge(
    "ldp_body_bytes_in_flight",
    "Bytes of request bodies being received or processed (reserved by declared length).",
    multiprocess_mode="livesum",
)
CONNECTIONS_TIMED_OUT = Counter(
    "ldp_connections_timed_out",
    "Connections closed because a request's headers or body did not arrive in time.",
    ["part"],
)
ESTIMATE_SECONDS = Histogram("ldp_estimate_seconds", "Time to compute one estimate.")
REQUESTS = Counter("ldp_http_requests", "HTTP requests by route and status.", ["route", "status"])
CATALOG_RELOADS = Counter(
    "ldp_catalog_reloads", "Full reads of the metric definitions (after the catalog changed)."
)
FEDERATED_UPDATES = Counter(
    "ldp_federated_updates", "Federated uploads: accepted, duplicate or rejected.", ["outcome"]
)
FEDERATED_ROUNDS = Counter("ldp_federated_rounds", "Federated rounds closed.")
FEDERATED_RESTARTS = Counter(
    "ldp_federated_restarts", "Federated rounds restarted (too few uploads by the deadline)."
)
FEDERATED_FAILED_ROUNDS = Counter(
    "ldp_federated_failed_rounds",
    "Federated rounds restarted because aggregating them failed (non-finite values).",
)

SECAGG_MESSAGES = Counter(
    "ldp_secagg_messages",
    "Secure aggregation messages by step (keys, shares, masked, unmask) and outcome "
    "(added, duplicate, rejected).",
    ["step", "outcome"],
)
SECAGG_STEPS = Counter(
    "ldp_secagg_steps", "Secure aggregation steps closed (keys, shares, masked).", ["step"]
)
SECAGG_ROUNDS = Counter(
    "ldp_secagg_rounds",
    "Secure rounds ended, by outcome (closed, restarted, failed, exhausted) and the step "
    "they ended at.",
    ["outcome", "step"],
)


def exposition() -> tuple[bytes, str]:
    """The metrics in Prometheus text format (summed over processes in multiprocess mode)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    logger.log(level, event, extra={"fields": fields})


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's logging configuration: its own messages as JSON lines too, no access log."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "aggregator.observability.JsonFormatter"}},
        "handlers": {"default": handler},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "ldp": {"handlers": ["default"], "level": level.upper(), "propagate": False},
        },
    }
