"""The outbox: a durable FIFO of perturbed reports, bounded by count and by bytes."""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from client.outbox import OUTBOX_FILE, Outbox


def report(number: int, padding: int = 0) -> dict[str, Any]:
    """A wire report whose id encodes ``number`` (``padding`` makes it bigger)."""
    return {
        "report_id": str(uuid.UUID(int=number + 1)),
        "metric": "app.theme",
        "version": 1,
        "payload": {"value": number % 4, "pad": "x" * padding},
        "time": "2024-05-01T12:00:00Z",
    }


def size(body: dict[str, Any]) -> int:
    """Bytes a report takes in the outbox: its compact JSON."""
    return len(json.dumps(body, separators=(",", ":")))


def numbers(outbox: Outbox) -> list[int]:
    """The queued reports, oldest first, as the numbers ``report`` was given."""
    return [uuid.UUID(queued.report_id).int - 1 for queued in outbox.peek(1_000_000)]


def test_fifo_order_for_single_and_batched_adds(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    for number in range(3):
        assert outbox.add([report(number)]) == 0
    assert outbox.add([report(number) for number in range(3, 8)]) == 0
    outbox.add([report(8)])
    assert numbers(outbox) == list(range(9))
    assert [uuid.UUID(q.report_id).int - 1 for q in outbox.peek(4)] == [0, 1, 2, 3]
    assert len(outbox) == 9
    assert outbox.queued_bytes == sum(size(report(n)) for n in range(9))
    outbox.close()


def test_stores_exactly_what_it_was_given(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    given = [report(number, padding=number) for number in range(5)]
    outbox.add(given[:1])
    outbox.add(given[1:])
    queued = outbox.peek(10)
    assert [q.body for q in queued] == given
    assert [q.report_id for q in queued] == [body["report_id"] for body in given]
    outbox.close()
    # On disk too: the table holds the compact JSON of each body and nothing else.
    with contextlib.closing(sqlite3.connect(tmp_path / OUTBOX_FILE)) as db:
        rows = db.execute("SELECT report_id, body FROM outbox ORDER BY seq").fetchall()
    assert [(rid, json.loads(body)) for rid, body in rows] == [
        (body["report_id"], body) for body in given
    ]


def test_a_report_that_is_not_json_is_refused_and_nothing_is_queued(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    outbox.add([report(0)])
    bad = report(1)
    bad["payload"] = {"value": math.nan}
    with pytest.raises(ValueError):
        outbox.add([bad])
    with pytest.raises(ValueError):
        outbox.add([report(2), bad])  # a batch is all or nothing
    assert numbers(outbox) == [0]
    assert outbox.queued_bytes == size(report(0))
    outbox.close()


def test_durable_across_close_and_reopen(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    outbox.add([report(n, padding=n) for n in range(6)])
    before = [q.body for q in outbox.peek(100)]
    queued_bytes = outbox.queued_bytes
    outbox.close()

    reopened = Outbox(tmp_path)
    assert [q.body for q in reopened.peek(100)] == before
    assert len(reopened) == 6
    assert reopened.queued_bytes == queued_bytes
    reopened.add([report(6)])  # and it goes on in order
    assert numbers(reopened) == list(range(7))
    reopened.close()


def test_count_bound_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, max_reports=5)
    dropped = [outbox.add([report(n)]) for n in range(8)]
    assert dropped == [0] * 5 + [1] * 3
    assert numbers(outbox) == [3, 4, 5, 6, 7]
    assert outbox.dropped == 3

    assert outbox.add([report(n) for n in range(8, 12)]) == 4
    assert numbers(outbox) == [7, 8, 9, 10, 11]
    assert outbox.dropped == 7
    assert outbox.queued_bytes == sum(size(report(n)) for n in range(7, 12))
    outbox.close()

    reopened = Outbox(tmp_path, max_reports=5)
    assert reopened.dropped == 7  # over the device's life, not per process
    assert numbers(reopened) == [7, 8, 9, 10, 11]
    reopened.close()


def test_byte_bound_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    one = size(report(0, padding=100))
    assert all(size(report(n, padding=100)) == one for n in range(10))
    outbox = Outbox(tmp_path, max_bytes=3 * one + one // 2)
    for n in range(5):
        outbox.add([report(n, padding=100)])
        assert outbox.queued_bytes <= outbox.max_bytes
    assert numbers(outbox) == [2, 3, 4]
    assert outbox.dropped == 2
    assert outbox.queued_bytes == 3 * one

    # A batch of two pushes out the two oldest.
    assert outbox.add([report(n, padding=100) for n in range(5, 7)]) == 2
    assert numbers(outbox) == [4, 5, 6]
    assert outbox.dropped == 4
    outbox.close()
    reopened = Outbox(tmp_path, max_bytes=3 * one + one // 2)
    assert reopened.dropped == 4
    assert reopened.queued_bytes == 3 * one
    reopened.close()


@pytest.mark.parametrize("bounds", [{"max_reports": 0}, {"max_bytes": 0}])
def test_bounds_must_be_positive(tmp_path: Path, bounds: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Outbox(tmp_path, **bounds)


def test_take_gives_the_oldest_reports_as_one_body_and_discard_removes_them(
    tmp_path: Path,
) -> None:
    outbox = Outbox(tmp_path)
    assert outbox.take(10) is None
    given = [report(n, padding=n) for n in range(6)]
    outbox.add(given[:2])
    for body in given[2:]:
        outbox.add([body])
    batch = outbox.take(4)
    assert batch is not None and batch.count == 4 and batch.last - batch.first == 3
    sent = json.loads(batch.body)["reports"]
    assert sorted(sent, key=lambda r: r["report_id"]) == given[:4]
    assert numbers(outbox) == list(range(6))  # taking leaves them queued
    outbox.discard(batch)
    assert numbers(outbox) == [4, 5]
    assert len(outbox) == 2
    assert outbox.queued_bytes == sum(size(given[n]) for n in (4, 5))
    outbox.discard(batch)  # discarding twice removes nothing more
    assert numbers(outbox) == [4, 5] and len(outbox) == 2
    rest = outbox.take(10)
    assert rest is not None and rest.count == 2
    outbox.discard(rest)
    assert outbox.take(10) is None and len(outbox) == 0 and outbox.queued_bytes == 0
    outbox.close()


def test_discard_keeps_counts_true_when_a_taken_batch_was_dropped_for_room(
    tmp_path: Path,
) -> None:
    outbox = Outbox(tmp_path, max_reports=4)
    outbox.add([report(n) for n in range(4)])
    in_flight = outbox.take(3)
    assert in_flight is not None
    outbox.add([report(4)])
    outbox.add([report(5)])  # 0 and 1 are dropped while in flight
    outbox.discard(in_flight)
    assert numbers(outbox) == [3, 4, 5]
    assert len(outbox) == 3
    assert outbox.queued_bytes == sum(size(report(n)) for n in (3, 4, 5))
    outbox.close()
    reopened = Outbox(tmp_path, max_reports=4)
    assert len(reopened) == 3 and numbers(reopened) == [3, 4, 5]
    reopened.close()
