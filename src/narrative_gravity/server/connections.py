"""How uvicorn runs the app: connection timeouts, and a deadline for request headers that uvicorn lacks."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerConfig

__all__ = ["uvicorn_config"]

log = logging.getLogger("narrative_gravity.server")


def uvicorn_config(app: Any, config: ServerConfig, *, log_level: str = "info", **kwargs: Any) -> Any:
    """The ``uvicorn.Config`` that runs ``app`` with ``config``'s connection timeouts.

    - ``read_timeout_s``: a connection must deliver complete request headers within this time (a fresh
      connection, or one that starts a new request on keep-alive); a body that stalls gets ``408``.
    - ``write_timeout_s``: a response piece the client leaves unread this long drops the connection.
    - ``keep_alive_s``: an idle keep-alive connection is closed after this time.

    ``kwargs`` go to ``uvicorn.Config`` (e.g. ``host`` and ``port``).
    """
    options: dict[str, Any] = {
        "log_level": log_level,
        "timeout_keep_alive": config.keep_alive_s,
        "limit_concurrency": max(256, 4 * config.max_queue),
        "server_header": False,
        "timeout_graceful_shutdown": 30,
        "h11_max_incomplete_event_size": 16 * 1024,  # request line and headers
        "http": _timed_h11(config.read_timeout_s),
        **kwargs,
    }
    return uvicorn.Config(app, **options)


def _timed_h11(read_timeout_s: float) -> Any:
    """uvicorn's h11 protocol, plus a deadline for request headers (uvicorn has none: a client that opens a
    connection and sends a few bytes, or nothing, would keep it forever)."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # still waiting for (the rest of) the request headers
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection that sent no complete request headers in %g s", read_timeout_s)
                self.transport.close()

    return TimedH11Protocol
