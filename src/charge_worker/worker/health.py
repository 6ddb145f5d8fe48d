"""The worker's HTTP surface and what it reports: /metrics, /healthz, /readyz.

`/healthz` answers "is the pull loop alive?": it fails only when the loop has not turned
for `WEDGED_AFTER_S` (a hung process a restart would cure). `/readyz` answers "should this
pod get work?": connected to NATS, PostgreSQL answering, the consumer bound and not
draining. A side task copies JetStream's view of the consumer into gauges, so alerts can
see lag and ack-pending from every pod (`max` over pods in the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import asyncpg
import nats.errors
import nats.js.errors
import uvicorn
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from charge_worker.errors import SettingsError
from charge_worker.settings import NatsSettings
from charge_worker.worker.metrics import Metrics

WEDGED_AFTER_S = 60.0
DB_PROBE_TIMEOUT_S = 2.0


class Health:
    def __init__(
        self,
        *,
        last_tick: Callable[[], float],
        consuming: Callable[[], bool],
        nc: Client,
        pool: asyncpg.Pool,
    ) -> None:
        self.last_tick = last_tick
        self.consuming = consuming
        self.nc = nc
        self.pool = pool

    def alive(self, now: float | None = None) -> bool:
        """False once the pull loop has not turned for WEDGED_AFTER_S."""
        return (now or time.monotonic()) - self.last_tick() < WEDGED_AFTER_S

    async def not_ready_because(self) -> str | None:
        """Why this pod should get no work now, or None when it should."""
        if not self.consuming():
            return "consumer not bound or draining"
        if not self.nc.is_connected:
            return "not connected to NATS"
        try:
            async with asyncio.timeout(DB_PROBE_TIMEOUT_S):
                await self.pool.fetchval("SELECT 1")
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
            return f"PostgreSQL not answering: {type(error).__name__}"
        return None


def http_app(metrics: Metrics, health: Health) -> Starlette:
    async def scrape(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        if health.alive():
            return PlainTextResponse("ok")
        return PlainTextResponse(f"pull loop wedged for over {WEDGED_AFTER_S:g}s", 503)

    async def readyz(_: Request) -> Response:
        why = await health.not_ready_because()
        return PlainTextResponse("ready") if why is None else PlainTextResponse(why, 503)

    return Starlette(
        routes=[Route("/metrics", scrape), Route("/healthz", healthz), Route("/readyz", readyz)]
    )


async def report_consumer_stats(
    nc: Client, cfg: NatsSettings, metrics: Metrics, stop: asyncio.Event, *, interval_s: float
) -> None:
    """Copy the consumer's and the dead-letter stream's state into gauges until `stop`."""
    js = nc.jetstream()
    while not stop.is_set():
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            info = await js.consumer_info(cfg.stream, cfg.durable, timeout=5)
            metrics.consumer["pending"].set(info.num_pending or 0)
            metrics.consumer["ack_pending"].set(info.num_ack_pending or 0)
            metrics.consumer["redelivered"].set(info.num_redelivered or 0)
            metrics.consumer["max_ack_pending"].set(info.config.max_ack_pending or 0)
            dlq = await js.stream_info(cfg.dlq_stream)
            metrics.dlq_messages.set(dlq.state.messages)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the command owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int, *, setting: str) -> socket.socket:
    """Bind now, so a taken port fails at start naming `setting`, and port 0 is known at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise SettingsError(f"{setting}: cannot listen on {host}:{port}: {error}") from error
