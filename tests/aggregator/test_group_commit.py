"""Group commit: batches share transactions, yet each is stored or refused on its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from aggregator.group_commit import GroupCommitter, Submission


class FakeStore:
    """A commit function over an in-memory id set, recording the groups it was given."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.ids: set[bytes] = set()
        self.rows: list[Any] = []
        self.groups: list[int] = []
        self.gate = gate
        self.entered = threading.Event()

    def commit(self, group: list[Submission]) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        staged_ids, staged_rows = set(self.ids), []
        for submission in group:
            new = [i not in staged_ids for i in submission.ids]
            staged_ids.update(submission.ids)
            submission.accepted = sum(new)
            staged_rows += submission.fold(new)  # may raise: nothing of the group is kept
        self.ids, self.rows = staged_ids, self.rows + staged_rows
        self.groups.append(len(group))


def fold_of(tag: str) -> Callable[[list[bool]], list[Any]]:
    return lambda new: [(tag, sum(new))]


def test_concurrent_overlapping_batches_count_every_id_once() -> None:
    store = FakeStore()
    committer: GroupCommitter[Submission] = GroupCommitter(store.commit)
    accepted: list[int] = []
    lock = threading.Lock()

    def send(worker: int) -> None:
        for batch in range(20):
            ids = [f"{(worker * 37 + batch * 11 + k) % 300}".encode() for k in range(25)]
            count = committer.submit(
                Submission(list(dict.fromkeys(ids)), fold_of(f"{worker}.{batch}"))
            )
            with lock:
                accepted.append(count)

    threads = [threading.Thread(target=send, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    committer.close()
    sent = {
        f"{(w * 37 + b * 11 + k) % 300}".encode()
        for w in range(8)
        for b in range(20)
        for k in range(25)
    }
    assert sum(accepted) == len(store.ids) == len(sent)  # every distinct id counted once
    assert store.ids == sent
    assert sum(count for _, count in store.rows) == len(sent)
    assert sum(store.groups) == 8 * 20


def test_waiting_batches_share_one_transaction() -> None:
    gate = threading.Event()
    store = FakeStore(gate)
    committer: GroupCommitter[Submission] = GroupCommitter(store.commit)
    results: dict[int, int] = {}

    def send(index: int) -> None:
        results[index] = committer.submit(Submission([bytes([index])], fold_of(str(index))))

    first = threading.Thread(target=send, args=(0,))
    first.start()
    assert store.entered.wait(10)  # the writer holds batch 0 in a commit
    others = [threading.Thread(target=send, args=(i,)) for i in range(1, 6)]
    for thread in others:
        thread.start()
    while committer._queue.qsize() < 5:  # all five wait behind the first commit
        threading.Event().wait(0.001)
    gate.set()
    for thread in [first, *others]:
        thread.join()
    committer.close()
    assert results == {i: 1 for i in range(6)}
    assert store.groups == [1, 5]


def test_a_failing_batch_fails_alone_and_the_rest_of_its_group_is_stored() -> None:
    gate = threading.Event()
    store = FakeStore(gate)
    committer: GroupCommitter[Submission] = GroupCommitter(store.commit)
    outcomes: dict[str, object] = {}

    def bad_fold(new: list[bool]) -> list[Any]:
        raise ValueError("cannot fold")

    def send(tag: str, ids: list[bytes], fold: Callable[[list[bool]], list[Any]]) -> None:
        try:
            outcomes[tag] = committer.submit(Submission(ids, fold))
        except ValueError as error:
            outcomes[tag] = error

    blocker = threading.Thread(target=send, args=("first", [b"x"], fold_of("first")))
    blocker.start()
    assert store.entered.wait(10)
    threads = [
        threading.Thread(target=send, args=("good1", [b"a", b"b"], fold_of("good1"))),
        threading.Thread(target=send, args=("bad", [b"c"], bad_fold)),
        threading.Thread(target=send, args=("good2", [b"b", b"d"], fold_of("good2"))),
    ]
    for thread in threads:
        thread.start()
    while committer._queue.qsize() < 3:
        threading.Event().wait(0.001)
    gate.set()
    for thread in [blocker, *threads]:
        thread.join()
    committer.close()
    assert isinstance(outcomes["bad"], ValueError)
    assert b"c" not in store.ids
    assert store.ids == {b"x", b"a", b"b", b"d"}
    assert outcomes["first"] == 1
    assert outcomes["good1"] + outcomes["good2"] == 3  # type: ignore[operator]  # b once


def test_submit_after_close_is_refused() -> None:
    committer = GroupCommitter(FakeStore().commit)
    committer.close()
    with pytest.raises(RuntimeError, match="closed"):
        committer.submit(Submission([b"a"], fold_of("a")))
