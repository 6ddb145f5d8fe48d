"""Wiring and lifecycle of `charge-worker run`: connections, clients, consumer, HTTP, signals.

SIGTERM and SIGINT only set the stop event; the consumer decides what stopping means
(no more fetches, in-flight work drained within `drain_s`, nothing acked on cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator

import structlog
import uvicorn
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from charge_worker import streams
from charge_worker.checks import BATCH, rescore_deferred
from charge_worker.consumer import Consumer
from charge_worker.dlq import DeadLetters
from charge_worker.errors import ChargeWorkerError
from charge_worker.failpoints import Failpoints
from charge_worker.gateway import GatewayClient
from charge_worker.ledger import DeferredChecks, Ledger, create_pool
from charge_worker.metrics import Metrics
from charge_worker.pipeline import Pipeline
from charge_worker.scoring import ScoringClient
from charge_worker.settings import Settings

log = structlog.get_logger("charge_worker.app")


def worker_id() -> str:
    """This process's lease owner name: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def http_app(registry: CollectorRegistry, ready: Callable[[], bool]) -> Starlette:
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_: Request) -> Response:
        return PlainTextResponse("ready") if ready() else PlainTextResponse("not ready", 503)

    return Starlette(
        routes=[Route("/metrics", metrics), Route("/healthz", healthz), Route("/readyz", readyz)]
    )


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the worker owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _log_failures(handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
    async def wrapped(msg: Msg) -> None:
        try:
            await handler(msg)
        except (ChargeWorkerError, ValueError, KeyError) as error:
            log.error("dlq.advisory_failed", error=repr(error))

    return wrapped


async def run_worker(
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: CollectorRegistry | None = None,
    on_ready: Callable[[Consumer], None] = lambda _c: None,
) -> None:
    """Run one worker until `stop` is set."""
    owner = worker_id()
    structlog.contextvars.bind_contextvars(worker=owner)
    nc = await streams.connect(settings.nats, name=f"charge-worker {owner}")
    js = nc.jetstream()
    report = await streams.provision(js, settings.nats)
    for drift in report.drift:
        log.warning("streams.drift", detail=str(drift))
    pool = await create_pool(settings.db)
    gateway = GatewayClient(settings.gateway)
    scoring = ScoringClient(settings.scoring)
    metrics = Metrics(registry or CollectorRegistry())
    metrics.watch(gateway.breaker)
    metrics.watch(scoring.breaker)
    ledger = Ledger(pool, lease_s=settings.worker.lease_s)
    dead_letters = DeadLetters(js, settings.nats)
    consumer = Consumer(
        settings,
        js=js,
        pipeline=Pipeline(
            ledger,
            gateway,
            scoring,
            owner=owner,
            metrics=metrics,
            failpoints=Failpoints(settings.worker.failpoints),
        ),
        dead_letters=dead_letters,
        ledger=ledger,
        gateway=gateway,
        metrics=metrics,
    )
    advisories = await nc.subscribe(
        dead_letters.advisory_subject(), cb=_log_failures(dead_letters.on_max_deliveries)
    )
    server = _Server(
        uvicorn.Config(
            http_app(metrics.registry, consumer.ready.is_set),
            host=settings.http.http_host,
            port=settings.http.metrics_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
    )
    http_task = asyncio.create_task(server.serve())
    # a taken batch stays leased long enough to score all of it at the full timeout
    checks = DeferredChecks(
        pool,
        retry_s=BATCH * settings.scoring.scoring_timeout_s
        + settings.worker.deferred_check_interval_s,
    )
    checks_task = asyncio.create_task(
        rescore_deferred(
            checks, scoring, metrics, stop, interval_s=settings.worker.deferred_check_interval_s
        )
    )
    log.info("worker.started", concurrency=settings.worker.concurrency)
    try:
        consuming = asyncio.create_task(consumer.run(stop))
        on_ready(consumer)
        await consuming
    finally:
        server.should_exit = True
        stop.set()
        await checks_task
        await advisories.unsubscribe()
        await http_task
        await gateway.aclose()
        await scoring.aclose()
        await pool.close()
        await nc.drain()
        log.info("worker.stopped")
