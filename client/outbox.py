"""The outbox: perturbed reports wait here, in SQLite, until the aggregator acknowledges them.

Only perturbed reports are written (the wire JSON of a report in ``POST /v1/reports``:
report id, metric, version, payload, hour, and the public ``dimensions`` of a metric that
declares some; a row queued before dimensions existed has none and is sent as it is);
raw values never are. ``add`` commits before it
returns, so a report survives the app's crash or restart (WAL with
``synchronous=NORMAL``: a committed report survives a process crash; a power cut can
lose the last moments, never the ledger's debit, which is fsynced). Reports leave by
``discard`` after an acknowledgement (or a refusal that can never change), so a retry
sends the very same reports (same ids, same randomness).

What is dropped unsent, and how an app learns it. The outbox is bounded by count and
bytes (default 100,000 reports, 64 MiB: weeks of reports offline for a typical app).
When it is full, the oldest reports are dropped to make room, so ``record`` never blocks
nor fails for want of space: their epsilon was already spent, and the newest reports are
the ones an analyst still wants. Every drop is counted in ``dropped`` (stored in the
outbox database, in the same transaction, so it survives restarts) and logged as a
warning on the ``ldp.client`` logger. Nothing else is ever dropped unsent.

A damaged outbox is refused, never silently replaced. ``outbox.expected`` marks a state
directory that has had an outbox; opening checks the database (``PRAGMA quick_check``,
the schema) and raises ``OutboxCorruptError``, naming the file and what to do, when the
outbox is missing or empty where the marker says one existed, is not a SQLite database,
fails the check, or lacks its tables: a truncated file would otherwise open as a new,
empty outbox and its reports would be lost without a count.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUTBOX_FILE = "outbox.sqlite3"
#: Written once an outbox exists: from then on a missing or empty outbox is an error.
OUTBOX_MARKER = "outbox.expected"

logger = logging.getLogger("ldp.client")

#: The wire JSON of a report: compact, ASCII, no NaN (one encoder, not one per call).
_encode_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_INSERT = "INSERT INTO outbox (seq, report_id, body, size) VALUES (?, ?, ?, ?)"
#: The oldest reports as one request body, assembled by SQLite (the order of the reports
#: inside the body is not specified, nor needed: the same rows, and only they, are sent).
#: The oldest reports, at most ``limit`` of them and at most ``max_bytes`` of body (the
#: first one always: a report alone larger than that is still sent, and refused alone).
_TAKE = (
    "SELECT min(seq), max(seq), count(*), '{\"reports\":[' || group_concat(body, ',') || ']}'"
    " FROM (SELECT seq, body, row_number() OVER (ORDER BY seq) AS k,"
    "  sum(size + 1) OVER (ORDER BY seq) AS running"
    "  FROM (SELECT seq, body, size FROM outbox ORDER BY seq LIMIT ?))"
    " WHERE k = 1 OR running + ? <= ?"
)
#: The bytes of a body besides its reports and their commas: '{"reports":[' and ']}'.
_BODY_FRAME = len('{"reports":[]}') - 1
_NO_BYTE_LIMIT = 2**62

_SCHEMA = (
    # seq is assigned here, increasing within a process (no AUTOINCREMENT table, no index on
    # report_id: one B-tree page per insert keeps record() cheap).
    "CREATE TABLE IF NOT EXISTS outbox ("
    " seq INTEGER PRIMARY KEY,"
    " report_id TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " size INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


class OutboxCorruptError(RuntimeError):
    """The outbox database is damaged or missing where one existed; nothing was changed."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(
            f"the outbox {path} cannot be used: {why}. Its unsent reports may be lost. Restore "
            f"it from a backup; or, to start with an empty outbox (the reports it held are "
            f"not sent, and their epsilon stays spent), delete it with its -wal and -shm "
            f"files and {OUTBOX_MARKER}"
        )
        self.path = path


@dataclass(frozen=True)
class QueuedReport:
    """One queued report: its place in the queue, its id, and its wire JSON text."""

    seq: int
    report_id: str
    text: str

    @property
    def body(self) -> dict[str, Any]:
        """The report as a dict (parsed from ``text``)."""
        parsed: dict[str, Any] = json.loads(self.text)
        return parsed


@dataclass(frozen=True)
class Batch:
    """The oldest ``count`` queued reports, ``seq`` from ``first`` to ``last``, as the body
    of ``POST /v1/reports`` (``{"reports": [...]}``, UTF-8)."""

    first: int
    last: int
    count: int
    body: bytes


class Outbox:
    """A durable FIFO of wire reports, bounded by ``max_reports`` and ``max_bytes``."""

    def __init__(
        self, state_dir: Path | str, max_reports: int = 100_000, max_bytes: int = 64 << 20
    ) -> None:
        if max_reports < 1 or max_bytes < 1:
            raise ValueError("max_reports and max_bytes must be positive")
        self.max_reports, self.max_bytes = max_reports, max_bytes
        path = Path(state_dir) / OUTBOX_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = path.parent / OUTBOX_MARKER
        expected = marker.exists()
        if expected and (not path.exists() or path.stat().st_size == 0):
            raise OutboxCorruptError(
                path, "it is missing or empty, but this state directory had an outbox"
            )
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self._configure(path, expected)
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise OutboxCorruptError(path, f"SQLite says: {error}") from None
        except OutboxCorruptError:
            self._db.close()
            raise
        if not expected:
            _write_marker(marker)
        self._count, self._bytes, last = self._db.execute(
            "SELECT count(*), coalesce(sum(size), 0), coalesce(max(seq), 0) FROM outbox"
        ).fetchone()
        # Sequence numbers never repeat within a process, so a batch being uploaded can
        # never be confused with reports queued after it (even if it was evicted meanwhile).
        self._next_seq = int(last) + 1

    def _configure(self, path: Path, expected: bool) -> None:
        """Set the connection up, check the database, and create the tables if new."""
        # One process owns a state directory (the ledger's file lock says so): an exclusive
        # lock keeps the WAL index in memory, which makes each commit cheaper.
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
        # A report is a few hundred bytes: small pages make each commit's WAL frame small
        # (applies to a new file). A checkpoint syncs the WAL and the database file: every
        # 4000 frames (4 MiB) costs a record about 1.5 us on average less than SQLite's
        # default of 1000, for a pause of about 5 ms where 1000 pauses for 3 (10000: 15-20).
        self._db.execute("PRAGMA page_size=1024")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA wal_autocheckpoint=4000")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Freed pages are not zeroed (some builds default to secure_delete=ON): they held
        # only perturbed reports, already sent, and zeroing them tripled the cost of
        # deleting an acknowledged batch (2.1 ms to 0.7 ms for 512 reports), during which
        # record() waits for the connection.
        self._db.execute("PRAGMA secure_delete=FAST")
        self._db.execute("PRAGMA busy_timeout=30000")
        # The cursor of record()'s single-report insert, kept rather than made per call.
        self._insert = self._db.cursor()
        (verdict,) = self._db.execute("PRAGMA quick_check(1)").fetchone()
        if verdict != "ok":
            raise OutboxCorruptError(path, f"its integrity check failed: {verdict}")
        tables = {
            name
            for (name,) in self._db.execute("SELECT name FROM sqlite_schema WHERE type='table'")
        }
        if expected and not {"outbox", "counters"} <= tables:
            raise OutboxCorruptError(path, "it holds no outbox tables")
        with self._transaction():
            for statement in _SCHEMA:
                self._db.execute(statement)

    def add(self, reports: Sequence[dict[str, Any]]) -> int:
        """Queue wire reports durably; returns how many old reports were dropped for room."""
        texts = [_encode_json(report) for report in reports]
        added = sum(len(text) for text in texts)
        with self._lock:
            first = self._next_seq
            if (
                len(texts) == 1
                and self._count < self.max_reports
                and self._bytes + added <= self.max_bytes
            ):  # one statement is its own transaction: one commit
                self._insert.execute(_INSERT, (first, reports[0]["report_id"], texts[0], added))
                self._next_seq, self._count, self._bytes = (
                    first + 1,
                    self._count + 1,
                    self._bytes + added,
                )
                return 0
            self._next_seq = first + len(texts)
            rows = [
                (first + i, report["report_id"], text, len(text))
                for i, (report, text) in enumerate(zip(reports, texts, strict=True))
            ]
            with self._transaction():
                self._db.executemany(_INSERT, rows)
                self._count += len(rows)
                self._bytes += added
                return self._evict()

    def peek(self, limit: int) -> list[QueuedReport]:
        """The oldest ``limit`` reports, still queued."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, report_id, body FROM outbox ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        return [QueuedReport(seq, report_id, body) for seq, report_id, body in rows]

    def take(self, limit: int, max_bytes: int | None = None) -> Batch | None:
        """The oldest reports (still queued) as one request body, at most ``limit`` of them
        and, with ``max_bytes``, as many as fit a body of that many bytes (at least one),
        or None if the outbox is empty. Every row with a ``seq`` in ``first..last`` is in
        it: rows are only ever deleted from the front, or by ``seq``, and new ones come
        after."""
        cap = _NO_BYTE_LIMIT if max_bytes is None else max_bytes
        with self._lock:
            first, last, count, body = self._db.execute(_TAKE, (limit, _BODY_FRAME, cap)).fetchone()
        if not count:
            return None
        return Batch(first, last, count, body.encode("utf-8"))

    def discard(self, batch: Batch) -> None:
        """Delete an acknowledged (or permanently refused) batch from ``take``; reports of it
        already gone (dropped for room meanwhile) are skipped."""
        with self._lock, self._transaction():
            sizes = self._db.execute(
                "DELETE FROM outbox WHERE seq BETWEEN ? AND ? RETURNING size",
                (batch.first, batch.last),
            ).fetchall()
            self._count -= len(sizes)
            self._bytes -= sum(size for (size,) in sizes)

    def discard_ids(self, batch: Batch, report_ids: set[str]) -> int:
        """Delete the reports of ``batch`` whose id is in ``report_ids`` (refused one by one);
        returns how many were still queued and are now gone."""
        ids = sorted(report_ids)
        marks = ",".join("?" * len(ids))
        with self._lock, self._transaction():
            sizes = self._db.execute(
                f"DELETE FROM outbox WHERE seq BETWEEN ? AND ? AND report_id IN ({marks}) "
                "RETURNING size",
                (batch.first, batch.last, *ids),
            ).fetchall()
            self._count -= len(sizes)
            self._bytes -= sum(size for (size,) in sizes)
        return len(sizes)

    def __len__(self) -> int:
        with self._lock:
            return int(self._count)

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return int(self._bytes)

    @property
    def dropped(self) -> int:
        """Reports dropped, over the device's life, because the outbox was full."""
        return self.counter("dropped") or 0

    def counter(self, name: str) -> int | None:
        """A stored integer (``dropped``, or one the client keeps here), None if unset."""
        with self._lock:
            row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else None

    def set_counter(self, name: str, value: int) -> None:
        """Store an integer under ``name`` (committed before it returns)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _evict(self) -> int:
        """Drop the oldest reports while over a bound (inside the caller's transaction)."""
        dropped = 0
        while self._count > self.max_reports or (self._bytes > self.max_bytes and self._count):
            excess = max(self._count - self.max_reports, 1)
            rows = self._db.execute(
                "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT ?) "
                "RETURNING size",
                (excess,),
            ).fetchall()
            dropped += len(rows)
            self._count -= len(rows)
            self._bytes -= sum(size for (size,) in rows)
        if dropped:
            self._db.execute(
                "INSERT INTO counters (name, value) VALUES ('dropped', ?) "
                "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
                (dropped,),
            )
            logger.warning(
                "the outbox is full (at most %d reports, %d bytes): dropped the oldest %d "
                "unsent; the device's total of reports dropped is in TelemetryClient.dropped",
                self.max_reports,
                self.max_bytes,
                dropped,
            )
        return dropped

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        self._db.execute("ROLLBACK" if kind is not None else "COMMIT")


def _write_marker(marker: Path) -> None:
    """Create ``marker`` durably (file and directory entry fsynced)."""
    with open(marker, "wb") as handle:
        handle.write(b"this state directory has an outbox; a missing one is an error\n")
        handle.flush()
        os.fsync(handle.fileno())
    directory = os.open(marker.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
