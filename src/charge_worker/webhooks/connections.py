"""The receiver's HTTP server, hardened against slow clients.

uvicorn (over h11) closes an idle keep-alive connection after `timeout_keep_alive`, and
`limit_concurrency` answers `503` beyond a number of connections, but it sets no deadline
on a request's line and headers: a client that connects and sends nothing, or trickles a
byte a second, holds its connection, and a slot of that limit, for ever. So a connection
is closed when its request head is not complete within `webhook_header_timeout_s` of the
connection, or of the first byte after a response (as nginx's `client_header_timeout`).
That first byte may also be the rest of a body answered before it was read (a 401, a
413), which uvicorn reads and drops as long as it keeps coming: it gets the same deadline.
The deadline of a body being read is the receiver's (`receiver.read_limited`: `408`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from charge_worker import http
from charge_worker.settings import WebhookSettings


class _Deadlines(H11Protocol):
    """h11's protocol, closing a connection whose request head is late."""

    header_timeout_s: float = 5.0
    _deadline: asyncio.TimerHandle | None = None

    def on_slow(self) -> None:
        """Called before a connection is closed for being late."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle  # a new one once a request's head is parsed
        if self._deadline is None and (cycle is None or cycle.response_complete):
            self._arm()  # the first byte after a response
        super().data_received(data)
        if self.cycle is not cycle:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.on_slow()
            self.transport.close()


def server(app: Starlette, cfg: WebhookSettings, *, on_slow: Callable[[], None]) -> http.Server:
    """A uvicorn server for `app` with the receiver's deadlines and connection limit;
    `on_slow()` is called for each connection closed for being late."""

    class Deadlines(_Deadlines):
        header_timeout_s = cfg.webhook_header_timeout_s

        def on_slow(self) -> None:
            on_slow()

    config = uvicorn.Config(
        app,
        http=Deadlines,
        limit_concurrency=cfg.webhook_max_connections,
        timeout_keep_alive=cfg.webhook_keep_alive_s,
        # the peer stays the TCP peer (uvicorn would take X-Forwarded-For from a loopback
        # peer): `sources.py` decides whom to believe, by CHARGE_WORKER_WEBHOOK_TRUSTED_PROXIES
        proxy_headers=False,
        log_level="warning",
        access_log=False,
        lifespan="off",
        log_config=None,  # uvicorn keeps the root's JSON handler (logs.configure)
    )
    return http.Server(config)
