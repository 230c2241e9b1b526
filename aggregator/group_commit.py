"""Group commit: one writer thread stores every batch waiting at that moment in one transaction.

Request threads ``submit`` a batch and block until the transaction that holds it has
committed (or failed), so a reply still follows its own commit. While one transaction
runs, new batches queue up; the next transaction takes all of them (up to
``max_items`` report ids), so under load each commit, fsync and dirtied B-tree page is
shared by many batches, and the database work runs on its own thread beside the request
threads that parse and validate the next batches.

A failed group is retried one batch at a time, so a batch that cannot be stored fails
alone and the others are stored; but when the storage is unavailable
(``StorageUnavailableError``: the database unreachable, silent or full), every batch of
the group fails with it at once, without a retry that would wait for the database again.
Nothing is acknowledged that was not committed: ``submit`` returns only after its
group's commit returned.

Bounded waits. With a ``timeout`` (the database's, in seconds), a submitter waits at
most ``WAIT_FACTOR`` times it; past that it gets a ``StorageUnavailableError`` and its
batch, if the writer has not taken it yet, is dropped from the queue. A batch the writer
already took may still be committed after that answer: its client sends it again, and
the report ids count it once. ``trouble()`` says why the writer cannot commit now: a
commit waiting longer than ``STALL_FACTOR`` times the timeout, or a commit that failed
on unavailable storage less than ``FAILURE_WINDOW`` seconds ago with none succeeding
since (a later commit, or the window's end, clears it: a failure is not reported for
ever to a probe that would keep writes away).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from aggregator.repositories.availability import StorageUnavailableError


@dataclass(eq=False)
class Submission:
    """One batch: its distinct report ids and the fold of its new reports
    (``ReportsRepository.ingest``). The group's ``commit`` sets ``accepted``."""

    ids: Sequence[bytes]
    fold: Callable[[list[bool]], list[Any]]
    accepted: int = field(default=0, init=False)
    error: BaseException | None = field(default=None, init=False)
    done: threading.Event = field(default_factory=threading.Event, init=False)
    #: Its submitter stopped waiting: the writer skips it if it has not taken it yet.
    abandoned: bool = field(default=False, init=False)


S = TypeVar("S", bound=Submission)

#: A submitter waits at most this many times the database timeout for its commit.
WAIT_FACTOR = 4
#: A commit running longer than this many times the database timeout is reported stalled.
STALL_FACTOR = 2
#: Seconds a commit failed on unavailable storage is reported, unless one succeeds first.
FAILURE_WINDOW = 30.0


class GroupCommitter(Generic[S]):
    """Runs ``commit(group)`` on a writer thread for groups of queued submissions.

    ``commit`` stores a list of submissions in one transaction and sets each one's
    ``accepted``; it raises to roll the whole group back. ``timeout``: the database's
    (seconds; None: submitters wait as long as the commit takes, and no commit is
    reported stalled).
    """

    def __init__(
        self,
        commit: Callable[[list[S]], None],
        max_items: int = 50_000,
        timeout: float | None = None,
    ) -> None:
        self._commit = commit
        self._max_items = max_items
        self._timeout = timeout
        self._queue: queue.SimpleQueue[S | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._committing_since: float | None = None
        self._failure: tuple[float, StorageUnavailableError] | None = None

    def submit(self, submission: S) -> int:
        """Store one batch; returns how many of its ids were new. Raises what its commit
        raised, or ``StorageUnavailableError`` once it waited ``WAIT_FACTOR`` timeouts."""
        with self._lock:
            if self._closed:
                raise RuntimeError("storage is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
                self._thread.start()
            self._queue.put(submission)
        if self._timeout is None:
            submission.done.wait()
        elif not submission.done.wait(WAIT_FACTOR * self._timeout):
            submission.abandoned = True
            raise StorageUnavailableError(
                f"the database did not commit within {WAIT_FACTOR * self._timeout:g} s",
                self._timeout,
            )
        if submission.error is not None:
            raise submission.error
        return submission.accepted

    def trouble(self) -> str | None:
        """Why the writer cannot commit now, or None when nothing says it cannot."""
        now = time.monotonic()
        since = self._committing_since
        timeout = self._timeout
        if since is not None and timeout is not None and now - since > STALL_FACTOR * timeout:
            return f"a commit has been waiting {now - since:.0f} s for the database"
        failure = self._failure
        if failure is not None and now - failure[0] < FAILURE_WINDOW:
            return (
                f"the last commit failed {now - failure[0]:.0f} s ago ({failure[1].reason}) "
                "and none has succeeded since"
            )
        return None

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
            waited = [submission for submission in group if not submission.abandoned]
            if waited:
                self._store(waited)

    def _store(self, group: list[S]) -> None:
        self._committing_since = time.monotonic()
        try:
            self._commit(group)
        except StorageUnavailableError as error:  # the same for every batch: no retry
            self._failure = (time.monotonic(), error)
            for submission in group:
                submission.error = error.again()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting request threads
            if len(group) == 1:
                group[0].error = error
            else:
                for submission in group:
                    self._store([submission])
                return
        else:
            self._failure = None
        finally:
            self._committing_since = None
        for submission in group:
            submission.done.set()
