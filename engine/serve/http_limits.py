"""A time limit on a request's head (request line and headers), which uvicorn does not have.

uvicorn's own timer (`timeout_keep_alive`) starts only after an answer, and any byte received
cancels it: a client that connects and sends nothing, or trickles its headers a byte at a time,
holds a connection slot for ever. With enough of them every other client gets 503 from
`--limit-concurrency`. This protocol gives each request's head `header_timeout_s` seconds, counted
from the connection's opening or, on a kept-alive connection, from the first byte after the last
answer; the body has its own limit (`--body-timeout`, the app's)."""
from __future__ import annotations

import asyncio
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `header_timeout_s` seconds for each request's head."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._start_head_timer()          # the first byte of the next request's head
            super().data_received(data)
            if not self._between_requests():
                self._stop_head_timer()           # the head arrived: the app's limits take over

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.logger.warning("closed a connection whose request headers did not arrive within "
                                    "%g s (--header-timeout)", header_timeout_s)
                self.transport.close()

    return HeaderTimeoutProtocol
