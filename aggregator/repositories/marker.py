"""The marker beside a SQLite database, so that a lost database is refused, not recreated.

SQLite opens a missing or zero-length file as a new, empty database: after a truncation,
a failed restore or a deleted file, the aggregator would start with no statistics and no
report ids (so it would count again every retried report) and answer as if new. So when
the aggregator creates a database (or first opens one of an earlier release) it writes
``<database>-created`` beside it, and every start checks the pair:

================================  ==========  ===========================================
database file                     marker      start
================================  ==========  ===========================================
absent                            absent      a new database is created, with its marker
absent                            present     refused: the database is missing
empty (0 bytes)                   either      refused: the file is empty
without the aggregator's tables   present     refused: the database lost its tables
with the aggregator's tables      absent      opened; the marker is written
================================  ==========  ===========================================

A refusal is one line that names the files and what to do: restore the database from a
backup, or delete the file (with its ``-wal`` and ``-shm`` files) and its marker to start
a new, empty database.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["marker_of", "mark", "refusal", "schema_lost"]

_SUFFIX = "-created"


def marker_of(database: Path) -> Path:
    """The marker file of the SQLite file ``database``."""
    return database.with_name(database.name + _SUFFIX)


def _start_afresh(database: Path) -> str:
    return (
        f"restore it from a backup, or delete {database} (with its -wal and -shm files, if "
        f"any) and {marker_of(database)} to start a new, empty database"
    )


def refusal(database: Path) -> str | None:
    """Why the aggregator must not open ``database`` (before opening it), or None."""
    marker = marker_of(database)
    if not database.exists():
        if not marker.exists():
            return None
        return (
            f"the SQLite file {database} is missing, but {marker} says a database was created "
            f"there: restore it from a backup, or delete {marker} to start a new, empty database"
        )
    if database.is_file() and database.stat().st_size == 0:
        return (
            f"the SQLite file {database} is empty (0 bytes) where a database is expected: "
            + _start_afresh(database)
        )
    return None


def schema_lost(database: Path) -> str:
    """The refusal of a file that opened without the aggregator's tables beside a marker."""
    return (
        f"the SQLite file {database} holds none of the aggregator's tables, but "
        f"{marker_of(database)} says a database was created there: " + _start_afresh(database)
    )


def mark(database: Path) -> None:
    """Write the marker of ``database`` (which now holds the aggregator's tables), durably."""
    marker = marker_of(database)
    if marker.exists():
        return
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = (
        f"An ldp-aggregator database has been kept in {database.name} since {created}.\n"
        "While this file exists the aggregator refuses to start where that database is\n"
        "missing or empty (restore it from a backup). To start a new, empty database,\n"
        "delete the database, its -wal and -shm files, and this file.\n"
    )
    partial = marker.with_name(marker.name + ".tmp")
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, marker)
