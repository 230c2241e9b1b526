"""Group commit: one writer thread stores every batch waiting at that moment in one transaction.

Request threads ``submit`` a batch and block until the transaction that holds it has
committed (or failed), so a reply still follows its own commit. While one transaction
runs, new batches queue up; the next transaction takes all of them (up to
``max_items`` report ids), so under load each commit, fsync and dirtied B-tree page is
shared by many batches, and the database work runs on its own thread beside the request
threads that parse and validate the next batches.

A failed group is retried one batch at a time, so a batch that cannot be stored fails
alone and the others are stored.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


@dataclass(eq=False)
class Submission:
    """One batch: its distinct report ids and the fold of its new reports
    (``ReportsRepository.ingest``). The group's ``commit`` sets ``accepted``."""

    ids: Sequence[bytes]
    fold: Callable[[list[bool]], list[Any]]
    accepted: int = field(default=0, init=False)
    error: BaseException | None = field(default=None, init=False)
    done: threading.Event = field(default_factory=threading.Event, init=False)


S = TypeVar("S", bound=Submission)


class GroupCommitter(Generic[S]):
    """Runs ``commit(group)`` on a writer thread for groups of queued submissions.

    ``commit`` stores a list of submissions in one transaction and sets each one's
    ``accepted``; it raises to roll the whole group back.
    """

    def __init__(self, commit: Callable[[list[S]], None], max_items: int = 50_000) -> None:
        self._commit = commit
        self._max_items = max_items
        self._queue: queue.SimpleQueue[S | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, submission: S) -> int:
        """Store one batch; returns how many of its ids were new. Raises what its commit raised."""
        with self._lock:
            if self._closed:
                raise RuntimeError("storage is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
                self._thread.start()
            self._queue.put(submission)
        submission.done.wait()
        if submission.error is not None:
            raise submission.error
        return submission.accepted

    def close(self) -> None:
        """Finish the queued submissions, then stop the writer thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            group, items = [first], len(first.ids)
            while items < self._max_items:
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None:
                    stopping = True
                    break
                group.append(following)
                items += len(following.ids)
            self._store(group)

    def _store(self, group: list[S]) -> None:
        try:
            self._commit(group)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting request threads
            if len(group) == 1:
                group[0].error = error
            else:
                for submission in group:
                    self._store([submission])
                return
        for submission in group:
            submission.done.set()
