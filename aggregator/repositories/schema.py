"""The aggregator's tables (schema version ``SCHEMA_VERSION``) and the upgrades to it.

* ``schema_info``: the schema version, and the change token of the metric versions
  (``METRICS_CHANGE``);
* ``metric_versions``: one row per (metric, version), the definition as JSON;
* ``api_keys``: SHA-256 hashes of bearer keys with their role (never the keys);
* ``report_ids``: every accepted ``report_id`` (16 bytes), the primary key that makes
  ingest idempotent;
* ``partial_stats``: append-only sufficient statistics, one row per (metric, version,
  time bucket, cell) per ingested batch, until compaction merges a group's rows into one
  (``cell``: the combination of the report's public dimension values,
  ``shared.dimensions``; 0 for a metric without dimensions);
* ``federated_tasks``: one row per federated learning task: its state (model, clip norm,
  rounds and their privacy cost) as JSON, its status, its open round's number, attempt
  and deadline (``round`` and ``attempt`` repeat the state's, so that a round's close
  can be committed by compare-and-swap on them);
* ``federated_updates``: every upload of each task, keyed by (task, ``update_id``) so a
  retry is a duplicate even after its round closed; the vectors of a closed round are
  erased, their ids kept;
* the secure aggregation of a round attempt (``aggregator/repositories/secagg.py``), all
  keyed by (task, round, attempt) and deleted when the round closes or restarts:
  ``secagg_participants`` (one row per device that advertised keys: its index, the
  SHA-256 of its session, its two public keys, and the SHA-256 of what it sent at each
  later step, so that a retry is known as one), ``secagg_shares`` (the encrypted shares,
  by recipient and sender), ``secagg_masked`` (the masked inputs), ``secagg_reveals``
  (the revealed shares, by holder, owner and kind) and ``secagg_steps`` (each closed
  step: the members it froze, and for the first the round's public parameters);
* report integrity (``shared.integrity``): ``report_profiles`` (append-only profiles of
  the reports, one row per (metric, version, bucket, cell) per batch of a profiled
  mechanism, compacted like ``partial_stats``), ``refused_reports`` (how many reports a
  mechanism's refusal rule refused, per metric version, bucket and rule) and
  ``key_usage`` (each device key's reports per metric and hour, for its quota).

``UPGRADES[v]`` takes a database from version ``v`` to ``v + 1`` inside the transaction
that starts the aggregator.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    update,
)
from sqlalchemy.engine import Connection

__all__ = [
    "INTEGRITY_TABLES",
    "METRICS_CHANGE",
    "SCHEMA_VERSION",
    "SECAGG_TABLES",
    "UPGRADES",
    "api_keys",
    "federated_tasks",
    "federated_updates",
    "key_usage",
    "metadata",
    "metric_versions",
    "partial_stats",
    "refused_reports",
    "report_ids",
    "report_profiles",
    "schema_info",
    "secagg_masked",
    "secagg_participants",
    "secagg_reveals",
    "secagg_shares",
    "secagg_steps",
]

SCHEMA_VERSION = 5
#: The ``schema_info`` row whose value changes (to a new random token) with every change
#: to ``metric_versions`` (``MetricsRepository.metrics_stamp``).
METRICS_CHANGE = "metrics_change"

metadata = MetaData()

schema_info = Table(
    "schema_info",
    metadata,
    Column("key", String(32), primary_key=True),
    Column("value", String(64), nullable=False),
)

metric_versions = Table(
    "metric_versions",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("definition", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("role", String(16), nullable=False),
    Column("label", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
)

report_ids = Table(
    "report_ids",
    metadata,
    Column("report_id", LargeBinary(16), primary_key=True),
    Column("received_hour", Integer, nullable=False),
    sqlite_with_rowid=False,
)

partial_stats = Table(
    "partial_stats",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("metric", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("bucket", BigInteger, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("stats", LargeBinary, nullable=False),
    Column("cell", Integer, nullable=False, server_default="0"),
    Index("partial_stats_group", "metric", "version", "bucket", "cell"),
)

federated_tasks = Table(
    "federated_tasks",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("status", String(24), nullable=False),
    Column("round", Integer, nullable=False),
    Column("attempt", Integer, nullable=False, server_default="0"),
    Column("state", Text, nullable=False),
    Column("evaluation", Text, nullable=True),
    Column("deadline", Float, nullable=False),
    Column("created_at", Float, nullable=False),
)

federated_updates = Table(
    "federated_updates",
    metadata,
    Column("task", String(64), primary_key=True),
    Column("update_id", LargeBinary(16), primary_key=True),
    Column("round", Integer, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    Column("unclipped", Float, nullable=False),
    Column("num_examples", Integer, nullable=False),
    Index("federated_updates_round", "task", "round"),
)


def _attempt_columns() -> list[Column[Any]]:
    """The columns naming one round attempt of a task, first in every secure aggregation key."""
    return [
        Column("task", String(64), primary_key=True),
        Column("round", Integer, primary_key=True),
        Column("attempt", Integer, primary_key=True),
    ]


secagg_participants = Table(
    "secagg_participants",
    metadata,
    *_attempt_columns(),
    Column("participant", Integer, primary_key=True),
    Column("session_hash", LargeBinary(32), nullable=False),
    Column("encryption_key", LargeBinary(32), nullable=False),
    Column("masking_key", LargeBinary(32), nullable=False),
    Column("shares_digest", LargeBinary(32), nullable=True),
    Column("masked_digest", LargeBinary(32), nullable=True),
    Column("unmask_digest", LargeBinary(32), nullable=True),
    Index("secagg_participants_session", "task", "round", "attempt", "session_hash", unique=True),
)

secagg_shares = Table(
    "secagg_shares",
    metadata,
    *_attempt_columns(),
    Column("recipient", Integer, primary_key=True),
    Column("sender", Integer, primary_key=True),
    Column("ciphertext", LargeBinary, nullable=False),
)

secagg_masked = Table(
    "secagg_masked",
    metadata,
    *_attempt_columns(),
    Column("participant", Integer, primary_key=True),
    Column("vector", LargeBinary, nullable=False),
)

secagg_reveals = Table(
    "secagg_reveals",
    metadata,
    *_attempt_columns(),
    Column("holder", Integer, primary_key=True),
    Column("owner", Integer, primary_key=True),
    Column("kind", String(8), primary_key=True),
    Column("share", LargeBinary, nullable=False),
)

secagg_steps = Table(
    "secagg_steps",
    metadata,
    *_attempt_columns(),
    Column("step", String(8), primary_key=True),
    Column("members", Text, nullable=False),
    Column("parameters", Text, nullable=True),
    Column("closed_at", Float, nullable=False),
)

#: The tables of secure aggregation, which schema version 4 added.
SECAGG_TABLES = (secagg_participants, secagg_shares, secagg_masked, secagg_reveals, secagg_steps)

report_profiles = Table(
    "report_profiles",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("metric", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("bucket", BigInteger, nullable=False),
    Column("cell", Integer, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("stats", LargeBinary, nullable=False),
    Index("report_profiles_group", "metric", "version", "bucket", "cell"),
)

refused_reports = Table(
    "refused_reports",
    metadata,
    Column("metric", String(64), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("bucket", BigInteger, primary_key=True),
    Column("rule", String(64), primary_key=True),
    Column("reports", BigInteger, nullable=False),
)

key_usage = Table(
    "key_usage",
    metadata,
    Column("key_id", String(64), primary_key=True),
    Column("metric", String(64), primary_key=True),
    Column("hour", BigInteger, primary_key=True),
    Column("reports", BigInteger, nullable=False),
)

#: The tables of report integrity, which schema version 5 added: the profiles of the
#: reports (``shared.integrity``), the reports refused by a mechanism's rules, and each
#: device key's reports per metric and hour (its quota).
INTEGRITY_TABLES = (report_profiles, refused_reports, key_usage)


def _add_task_attempts(conn: Connection) -> None:
    """Version 1 to 2: the ``attempt`` column of ``federated_tasks``, from each task's state."""
    conn.exec_driver_sql(
        "ALTER TABLE federated_tasks ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0"
    )
    rows = conn.execute(select(federated_tasks.c.name, federated_tasks.c.state)).all()
    for name, state in rows:
        attempt = int(json.loads(state).get("attempt", 0))
        if attempt:
            conn.execute(
                update(federated_tasks)
                .where(federated_tasks.c.name == name)
                .values(attempt=attempt)
            )


def _add_cells(conn: Connection) -> None:
    """Version 2 to 3: the ``cell`` column of ``partial_stats`` (every stored row is of
    cell 0, the one cell of a metric without dimensions, which every metric then was),
    and the column in the group index that compaction and estimates read by. (A table
    that has the column already, as one made by a later version's ``create_all``, keeps
    it.)"""
    columns = {column["name"] for column in inspect(conn).get_columns("partial_stats")}
    if "cell" not in columns:
        conn.exec_driver_sql("ALTER TABLE partial_stats ADD COLUMN cell INTEGER NOT NULL DEFAULT 0")
    conn.exec_driver_sql("DROP INDEX IF EXISTS partial_stats_group")
    conn.exec_driver_sql(
        "CREATE INDEX partial_stats_group ON partial_stats (metric, version, bucket, cell)"
    )


def _add_secure_aggregation(conn: Connection) -> None:
    """Version 3 to 4: the secure aggregation tables (new tables only; ``create_all`` at
    start has made them already, and making them here again is a no-op)."""
    metadata.create_all(conn, tables=list(SECAGG_TABLES), checkfirst=True)


def _add_integrity(conn: Connection) -> None:
    """Version 4 to 5: the report integrity tables (new tables only)."""
    metadata.create_all(conn, tables=list(INTEGRITY_TABLES), checkfirst=True)


#: ``UPGRADES[v]`` brings a database of schema version ``v`` to ``v + 1``.
UPGRADES: dict[int, Callable[[Connection], None]] = {
    1: _add_task_attempts,
    2: _add_cells,
    3: _add_secure_aggregation,
    4: _add_integrity,
}
