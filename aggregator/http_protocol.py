"""uvicorn's HTTP protocol with deadlines for receiving a request.

uvicorn closes a connection that stays idle between requests (``timeout_keep_alive``),
but not one that sends its request slowly: a client that trickles a header line, or a
body, one byte at a time keeps its connection (and a file descriptor, and a request in
progress) for ever, and a few thousand such clients starve the server. This protocol
(httptools' parser, as uvicorn's default) adds two deadlines:

* the request line and headers must be complete within ``header_timeout`` seconds of
  the connection's opening, or of the previous response on a kept-alive connection;
* the body must be complete within ``body_timeout`` seconds of the headers (also when
  the application has answered without reading it: its bytes are still received and
  thrown away).

Past a deadline the connection is closed (an application reading the body sees the
client disconnect) and ``ldp_connections_timed_out_total{part}`` counts it. The
deadlines come from the ``LDP_HEADER_TIMEOUT`` and ``LDP_BODY_TIMEOUT`` settings
(``aggregator/settings.py``), which ``ldp-aggregator serve`` hands to every worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aggregator import observability as obs
from aggregator.settings import Settings

logger = logging.getLogger("ldp.aggregator")

__all__ = ["DeadlineHttpProtocol"]


@functools.cache
def _deadlines() -> tuple[float, float]:
    settings = Settings.from_environment()
    return settings.header_timeout, settings.body_timeout


class DeadlineHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that closes connections whose request arrives too slowly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout, self.body_timeout = _deadlines()
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, part: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, part)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, part: str) -> None:
        self._deadline = None
        if self.transport is not None and not self.transport.is_closing():
            obs.CONNECTIONS_TIMED_OUT.labels(part).inc()
            obs.log(logger, logging.INFO, "closed a connection: request too slow", part=part)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._arm(self.body_timeout, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete:
            # Answered before its body was in (a refusal): the next request is due.
            self._arm(self.header_timeout, "headers")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Waiting for the next request (uvicorn's keep-alive timer runs too): its headers
        # are due within header_timeout. A body still arriving keeps its own deadline.
        if self.timeout_keep_alive_task is not None and self._deadline is None:
            self._arm(self.header_timeout, "headers")
