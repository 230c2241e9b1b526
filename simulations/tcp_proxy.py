"""A loopback TCP proxy that injects network faults on demand, for fault tests and benchmarks.

``TcpProxy(upstream_port)`` listens on a free loopback port and relays each connection
to ``127.0.0.1:upstream_port`` (e.g. PostgreSQL), until told otherwise:

* ``blackhole()``: nothing is relayed any more; every byte that arrives, from either
  side, on any connection, is read and dropped, and connections opened meanwhile are
  accepted but never connected upstream. A connection that lost bytes stays black-holed
  for good, as when a firewall or NAT forgets a connection during a partition (its
  stream is broken); only connections opened after ``recover()`` carry data again, and
  a connection left idle throughout carries on. Each side sees a peer that accepted its
  bytes and went silent, which TCP keepalives do not detect (the proxy's kernel answers
  them).
* ``reset()``: every open connection is reset (RST), and connections opened until
  ``recover()`` are reset at once, as when the database restarts.
* ``lose_replies_after(*patterns)``: on the first connection whose replies from upstream
  contain ``patterns`` in that order, the reply holding the last one and every byte after
  it are dropped: with PostgreSQL's command tags (``b"INSERT 0 "``, ``b"COMMIT\\x00"``)
  that is a commit the server made and whose answer never arrives, an ambiguous commit.
  ``tripped`` is set when it happens.
* ``recover()``: connections opened from now on are relayed.

One thread runs every connection (``selectors``); ``close()`` stops it and closes them.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TcpProxy"]

Mode = Literal["forward", "blackhole", "reset"]
_CHUNK = 65536
_POLL_SECONDS = 0.05


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream connection (None when never connected)."""

    client: socket.socket
    upstream: socket.socket | None
    dead: bool = False  # lost bytes: nothing is relayed on it any more
    mute: bool = False  # its replies are dropped (an ambiguous commit was made)
    matched: int = 0  # how many of the reply patterns were seen, in order
    tail: bytes = b""  # the end of the replies so far, for patterns cut across reads
    sockets: list[socket.socket] = field(default_factory=list)


class TcpProxy:
    """A fault-injecting TCP proxy from ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.tripped = threading.Event()
        self._mode: Mode = "forward"
        self._patterns: tuple[bytes, ...] = ()
        self._lock = threading.Lock()
        self._reset_pending = False
        self._closing = False
        self._links: set[_Link] = set()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> Mode:
        return self._mode

    def blackhole(self) -> None:
        """Stop relaying: drop every byte from now on (see the module's docstring)."""
        with self._lock:
            self._mode = "blackhole"

    def reset(self) -> None:
        """Reset every open connection, and each new one until ``recover()``."""
        with self._lock:
            self._mode = "reset"
            self._reset_pending = True

    def recover(self) -> None:
        """Relay the connections opened from now on."""
        with self._lock:
            self._mode = "forward"

    def lose_replies_after(self, *patterns: bytes) -> None:
        """Drop a connection's replies from the one completing ``patterns`` (in order) on."""
        if not patterns or not all(patterns):
            raise ValueError("lose_replies_after needs one or more non-empty patterns")
        with self._lock:
            self._patterns = patterns
            self.tripped.clear()

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        with self._lock:
            self._closing = True
        self._thread.join()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the relay thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    closing = self._closing
                    reset, self._reset_pending = self._reset_pending, False
                if closing:
                    return
                if reset:
                    for link in list(self._links):
                        self._drop(link, abort=True)
                for key, _ in self._selector.select(_POLL_SECONDS):
                    mode = self._mode  # as it is now, not when the wait began
                    if key.data is None:
                        self._accept(mode)
                    else:
                        link, from_client = key.data
                        if link in self._links:
                            self._pump(link, from_client, key.fileobj, mode)
        finally:
            for link in list(self._links):
                self._drop(link, abort=False)
            self._selector.close()
            self._listener.close()

    def _accept(self, mode: Mode) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if mode == "reset":
            _abort(client)
            return
        upstream = None
        if mode == "forward":
            try:
                upstream = socket.create_connection(self.upstream, timeout=5.0)
            except OSError:
                _abort(client)
                return
        link = _Link(client, upstream, dead=mode == "blackhole")
        for sock, from_client in ((client, True), (upstream, False)):
            if sock is not None:
                sock.setblocking(True)
                sock.settimeout(5.0)
                self._selector.register(sock, selectors.EVENT_READ, (link, from_client))
                link.sockets.append(sock)
        self._links.add(link)

    def _pump(self, link: _Link, from_client: bool, sock: object, mode: Mode) -> None:
        assert isinstance(sock, socket.socket)
        try:
            data = sock.recv(_CHUNK)
        except OSError:
            data = b""
        if not data:
            self._drop(link, abort=False)
            return
        if mode == "blackhole":
            link.dead = True
        if link.dead or link.upstream is None:
            return
        if not from_client:
            self._watch_replies(link, data)
            if link.mute:
                return
        target = link.upstream if from_client else link.client
        try:
            target.sendall(data)
        except OSError:
            self._drop(link, abort=False)

    def _watch_replies(self, link: _Link, data: bytes) -> None:
        """Advance ``link`` through the reply patterns; mute it when the last one shows."""
        with self._lock:
            patterns = self._patterns
        if not patterns or self.tripped.is_set():
            return
        seen = link.tail + data
        while link.matched < len(patterns):
            where = seen.find(patterns[link.matched])
            if where < 0:
                break
            seen = seen[where + len(patterns[link.matched]) :]
            link.matched += 1
        if link.matched == len(patterns):
            link.mute = True
            self.tripped.set()
            return
        longest = max(len(pattern) for pattern in patterns)
        link.tail = seen[-longest:]

    def _drop(self, link: _Link, abort: bool) -> None:
        self._links.discard(link)
        for sock in link.sockets:
            self._selector.unregister(sock)
        if abort:
            _abort(link.client)
        else:
            link.client.close()
        if link.upstream is not None:
            link.upstream.close()


def _abort(sock: socket.socket) -> None:
    """Close with a reset (RST) rather than an orderly end of stream."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
