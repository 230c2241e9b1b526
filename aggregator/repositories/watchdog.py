"""Dropping database connections that stopped answering.

A database client waits on a socket. When the network loses the packets (a partition, a
black-holed route, a firewall or NAT that forgot the connection), the wait lasts until
TCP gives up, many minutes later, and a service with one writer thread stops writing for
that long. TCP keepalives and ``tcp_user_timeout`` catch a silent peer only where the
kernel sees the loss; a proxy or load balancer in between still acknowledges every byte.

So the database layer arms a ``Watchdog`` around every round trip (a statement, a
commit, a rollback, a ping) and disarms it when the answer is in. A connection is dropped
when it has waited longer than ``limit`` seconds *and* nothing has arrived on its socket
for as long (on Linux ``TCP_INFO``'s ``tcpi_last_data_recv``; where that is not known,
the wait alone counts): the watchdog shuts the socket down, the waiting driver call
reads end of file and fails at once, the pool discards the connection, and the caller
gets an error it can answer instead of a hang. A large result that keeps arriving is
never cut; only silence is.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Wait", "Watchdog"]

#: Offset of ``tcpi_last_data_recv`` (milliseconds, u32) in Linux's ``struct tcp_info``:
#: seven one-byte fields and a byte of bit fields, then nine u32 fields, then
#: ``last_data_sent`` and ``last_ack_sent``.
_LAST_DATA_RECV_OFFSET = 52
_TCP_INFO_BYTES = 104


@dataclass(eq=False)
class Wait:
    """One armed round trip of a connection; ``dropped`` once the watchdog shut it down."""

    connection: Any
    since: float
    dropped: bool = False


class Watchdog:
    """Shuts down the socket of a DBAPI connection that waited ``limit`` seconds in silence.

    ``arm(connection)`` when a round trip starts, ``disarm(connection)`` when it ended
    (``waiting`` does both, and yields the ``Wait``); a connection is armed once at a
    time. One daemon thread, started by the first ``arm``; ``dropped`` counts the
    connections it shut down.
    """

    def __init__(self, limit: float) -> None:
        if not limit > 0:
            raise ValueError(f"the watchdog's limit must be positive, got {limit!r}")
        self.limit = limit
        self.dropped = 0
        self._armed: dict[int, Wait] = {}  # by the connection's id
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, connection: Any) -> Wait:
        """``connection`` starts waiting for the database now."""
        wait = Wait(connection, time.monotonic())
        with self._changed:
            if self._closed:
                return wait
            idle = not self._armed
            self._armed[id(connection)] = wait
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="db-watchdog", daemon=True)
                self._thread.start()
            elif idle:
                self._changed.notify()
        return wait

    def disarm(self, connection: Any) -> None:
        """``connection`` has its answer (or failed); once this returns, it is never shut down
        for the round trip armed before."""
        with self._changed:
            self._armed.pop(id(connection), None)

    @contextmanager
    def waiting(self, connection: Any) -> Iterator[Wait]:
        """Armed for the body: one round trip of ``connection``."""
        wait = self.arm(connection)
        try:
            yield wait
        finally:
            self.disarm(connection)

    def close(self) -> None:
        """Stop the thread (connections armed now are left alone)."""
        with self._changed:
            self._closed = True
            self._armed.clear()
            self._changed.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                if not self._armed:
                    self._changed.wait()
                    continue
                self._changed.wait(max(0.01, self._check(time.monotonic())))

    def _check(self, now: float) -> float:
        """Shut down the connections due (the lock held); seconds until the next is due."""
        pause = self.limit
        for key, wait in list(self._armed.items()):
            descriptor = _descriptor(wait.connection)
            if descriptor is None:  # closed meanwhile: nothing to wait for
                del self._armed[key]
                continue
            waited = now - wait.since
            silent = min(waited, _silence(descriptor, waited))
            if silent < self.limit:
                pause = min(pause, self.limit - silent)
                continue
            del self._armed[key]
            _shut_down(descriptor)
            wait.dropped = True
            self.dropped += 1
        return pause


def _descriptor(connection: Any) -> int | None:
    """The socket's file descriptor of a DBAPI connection, or None once it is closed."""
    try:
        descriptor = int(connection.fileno())
    except Exception:  # noqa: BLE001 - a closed connection has no socket to watch
        return None
    return descriptor if descriptor >= 0 else None


def _silence(descriptor: int, otherwise: float) -> float:
    """Seconds since data last arrived on a TCP socket (``otherwise`` when unknown)."""
    if not hasattr(socket, "TCP_INFO"):
        return otherwise
    try:
        with socket.fromfd(descriptor, socket.AF_INET, socket.SOCK_STREAM) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:  # a Unix socket, or one closed meanwhile
        return otherwise
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return otherwise
    (milliseconds,) = struct.unpack_from("=I", info, _LAST_DATA_RECV_OFFSET)
    return float(milliseconds) / 1000.0


def _shut_down(descriptor: int) -> None:
    """End both directions of the socket (the descriptor itself stays its owner's to close)."""
    try:
        duplicate = os.dup(descriptor)
    except OSError:
        return
    with socket.socket(fileno=duplicate) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already shut down or never connected
            pass
