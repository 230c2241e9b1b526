"""Reports the device paid for are never lost silently: a damaged or missing outbox is
refused with a clear error (never opened as a new, empty one), a full outbox drops its
oldest reports with a durable count and a log line, and batches fit the server's body
limit by bytes (a 413 makes the uploader send the same reports in smaller bodies)."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import OutboxCorruptError
from client.outbox import OUTBOX_FILE, OUTBOX_MARKER, Outbox
from client.transport import Uploader


def report(number: int, padding: int = 0) -> dict[str, Any]:
    return {
        "report_id": str(uuid.UUID(int=number + 1)),
        "metric": "app.theme",
        "version": 1,
        "payload": {"value": number % 4, "pad": "x" * padding},
    }


def filled(directory: Path, count: int = 2_000, padding: int = 200) -> Path:
    """An outbox of ``count`` reports, closed (its WAL checkpointed into the file)."""
    outbox = Outbox(directory)
    outbox.add([report(n, padding) for n in range(count)])
    outbox.close()
    return directory / OUTBOX_FILE


def test_an_emptied_outbox_file_is_refused_not_opened_empty(tmp_path: Path) -> None:
    path = filled(tmp_path)
    path.write_bytes(b"")
    with pytest.raises(OutboxCorruptError, match="missing or empty.*Restore it from a backup"):
        Outbox(tmp_path)
    assert path.stat().st_size == 0  # left as found


def test_a_truncated_outbox_file_is_refused(tmp_path: Path) -> None:
    path = filled(tmp_path)
    data = path.read_bytes()
    assert len(data) > 100_000
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(OutboxCorruptError, match=str(path)):
        Outbox(tmp_path)


def test_a_garbage_header_is_a_clear_error_not_a_raw_sqlite_one(tmp_path: Path) -> None:
    path = filled(tmp_path)
    data = bytearray(path.read_bytes())
    data[:100] = b"\xa5" * 100
    path.write_bytes(bytes(data))
    with pytest.raises(OutboxCorruptError, match="SQLite says"):
        Outbox(tmp_path)


def test_a_missing_outbox_where_one_existed_is_refused(tmp_path: Path) -> None:
    path = filled(tmp_path)
    assert (tmp_path / OUTBOX_MARKER).exists()
    path.unlink()
    with pytest.raises(OutboxCorruptError, match="missing or empty"):
        Outbox(tmp_path)
    assert not path.exists()  # nothing was created in its place


def test_a_database_without_the_outbox_tables_is_refused(tmp_path: Path) -> None:
    path = filled(tmp_path)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("DROP TABLE outbox")
    with pytest.raises(OutboxCorruptError, match="no outbox tables"):
        Outbox(tmp_path)


def test_a_new_directory_and_an_outbox_from_before_the_marker_open(tmp_path: Path) -> None:
    fresh = Outbox(tmp_path / "new")
    assert len(fresh) == 0 and (tmp_path / "new" / OUTBOX_MARKER).exists()
    fresh.close()
    older = tmp_path / "older"
    filled(older, count=10)
    (older / OUTBOX_MARKER).unlink()  # an outbox made before markers existed
    reopened = Outbox(older)
    assert len(reopened) == 10 and (older / OUTBOX_MARKER).exists()
    reopened.close()


def test_drops_for_room_are_logged_and_counted_across_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(tmp_path, max_reports=5)
    with caplog.at_level(logging.WARNING, logger="ldp.client"):
        outbox.add([report(n) for n in range(8)])
    assert outbox.dropped == 3
    assert any("dropped the oldest 3 unsent" in r.getMessage() for r in caplog.records)
    outbox.close()
    again = Outbox(tmp_path, max_reports=5)
    assert again.dropped == 3 and len(again) == 5
    again.close()


def test_take_fits_a_body_of_max_bytes_and_always_takes_one(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    reports = [report(n, padding=1_000) for n in range(40)]
    outbox.add(reports)
    for cap in (1, 2_000, 5_000, 20_000, 10**9):
        batch = outbox.take(512, cap)
        assert batch is not None
        body = json.loads(batch.body)
        assert body["reports"] == reports[: batch.count]
        assert batch.count == 1 or len(batch.body) <= cap
        if batch.count < 40:  # the next report would not have fitted
            with_one_more = len(batch.body) + 1 + len(json.dumps(reports[batch.count]))
            assert with_one_more > cap or batch.count == 512
    assert outbox.take(512, 1).count == 1  # a report alone larger than the cap still goes
    outbox.close()


def test_a_413_sends_the_same_reports_again_in_smaller_bodies(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    reports = [report(n, padding=1_000) for n in range(64)]
    outbox.add(reports)
    delivered: list[str] = []
    server_limit = 10_000

    def post(body: bytes) -> httpx.Response:
        if len(body) > server_limit:
            return httpx.Response(413, json={"title": "Request body too large"})
        delivered.extend(r["report_id"] for r in json.loads(body)["reports"])
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    uploader = Uploader(outbox, post, batch_size=512, interval=60.0)
    try:
        assert uploader.flush(timeout=30.0)
    finally:
        uploader.stop(timeout=1.0)
    assert sorted(delivered) == sorted(r["report_id"] for r in reports)
    assert uploader.stats.reports_refused == 0 and uploader.max_batch_bytes <= server_limit
    outbox.close()


def test_a_413_for_one_report_alone_drops_it_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(tmp_path)
    outbox.add([report(0, padding=50_000), report(1)])

    def post(body: bytes) -> httpx.Response:
        if len(body) > 10_000:
            return httpx.Response(413, json={"title": "Request body too large"})
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    uploader = Uploader(outbox, post, batch_size=512, interval=60.0)
    with caplog.at_level(logging.ERROR, logger="ldp.client"):
        try:
            assert uploader.flush(timeout=30.0)
        finally:
            uploader.stop(timeout=1.0)
    assert uploader.stats.reports_refused == 1 and uploader.stats.reports_acknowledged == 1
    assert any("HTTP 413" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    outbox.close()
