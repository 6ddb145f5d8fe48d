"""`charge-worker webhooks`: the gateway-webhook receiver and the journal's processor.

One process serves `POST /webhooks/gateway` (verify, journal, answer: `webhook_receiver`)
and `/healthz`, `/readyz`, `/metrics`, and runs the processor that applies journaled events
to the ledger in revision order (`webhook_processor`). They use separate connection pools,
so a processor stuck on a locked ledger row never takes the receiver's connections: the
answer stays fast whatever the ledger does.

SIGTERM and SIGINT only set the stop event: the server finishes the requests it has, the
processor its current event (a lease makes any unfinished one available again), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
import structlog
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charge_worker import event_loop, http, privileges
from charge_worker.database import create_pool
from charge_worker.gateway import build_gateway
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import Settings
from charge_worker.webhooks import connections
from charge_worker.webhooks.inbox import Inbox
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.processor import Processor, ProcessorTuning
from charge_worker.webhooks.receiver import receiver
from charge_worker.webhooks.signature import SCHEME_OF, verifier_for
from charge_worker.webhooks.sources import SourceCheck

log = structlog.get_logger(__name__)
SOURCE = "gateway"
PROCESSOR_POOL_MAX = 3


@dataclass(frozen=True)
class Receiving:
    """A started receiver, as `on_ready` sees it (tests use it to reach it)."""

    port: int
    processor: Processor


async def serve_command(settings: Settings) -> int:
    """Serve until SIGTERM or SIGINT; 0 after a clean stop."""
    stop = asyncio.Event()
    with event_loop.stop_on_signals(stop):
        await run_webhooks(settings, stop)
    return 0


async def run_webhooks(
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: CollectorRegistry | None = None,
    tuning: ProcessorTuning | None = None,
    on_ready: Callable[[Receiving], None] = lambda _r: None,
) -> None:
    """Receive and process webhooks until `stop` is set."""
    cfg = settings.webhooks
    # the adapter's provider signs its way (Standard Webhooks, Stripe-Signature), or does
    # not sign and is known by its networks (YooKassa)
    scheme = SCHEME_OF[settings.gateway.kind]
    verifier = verifier_for(scheme, cfg)  # a signing scheme without a secret does not start
    sources = SourceCheck.from_settings(cfg) if scheme == "yookassa" else None
    owner = event_loop.process_name()
    metrics = WebhookMetrics(registry or CollectorRegistry(), source=SOURCE)
    async with contextlib.AsyncExitStack() as resources:
        listener = resources.enter_context(
            http.listen(cfg.webhook_host, cfg.webhook_port, setting="CHARGE_WORKER_WEBHOOK_PORT")
        )
        receiver_pool = await create_pool(settings.db)
        resources.push_async_callback(receiver_pool.close)
        small = {"db_pool_min": 1, "db_pool_max": PROCESSOR_POOL_MAX}
        processor_pool = await create_pool(settings.db.model_copy(update=small))
        resources.push_async_callback(processor_pool.close)
        # the processor's re-fetches and lookups spend the fleet's tokens, as the worker's do
        limiter = RateLimiter(processor_pool, rate_per_s=settings.gateway.gateway_rate_limit)
        gateway = build_gateway(settings.gateway, limiter=limiter)
        resources.push_async_callback(gateway.aclose)
        processor = Processor(
            Inbox(processor_pool, retry_schedule=settings.retries.retry_schedule),
            gateway,
            metrics,
            owner=owner,
            retention_s=cfg.webhook_retention_s,
            tuning=tuning,
        )
        endpoint = receiver(
            source=SOURCE,
            verifier=verifier,
            scheme=scheme,
            sources=sources,
            inbox=Inbox(receiver_pool),
            metrics=metrics,
            max_bytes=cfg.webhook_max_bytes,
            body_timeout_s=cfg.webhook_body_timeout_s,
            on_journaled=processor.wake,
        )
        server = connections.server(
            _app(endpoint, metrics.registry, processor, receiver_pool, stop),
            cfg,
            on_slow=metrics.slow_connections.inc,
        )
        port = listener.getsockname()[1]
        log.info("webhooks.started", port=port, owner=owner)
        ready = Receiving(port, processor)
        await _serve(server, listener, processor, stop, lambda: on_ready(ready))
        log.info("webhooks.stopped")


async def _serve(
    server: uvicorn.Server,
    listener: socket.socket,
    processor: Processor,
    stop: asyncio.Event,
    ready: Callable[[], None],
) -> None:
    """Run server and processor until `stop`, or until either ends by itself: then the
    receiver stops, since a receiver that journals what no processor applies, or a
    processor nothing can probe, must be restarted."""
    tasks = {
        asyncio.create_task(server.serve(sockets=[listener]), name="http"),
        asyncio.create_task(processor.run(stop), name="processor"),
    }
    stopping = asyncio.create_task(stop.wait())
    ready()
    try:
        done, _ = await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task in done:
                _raise_if_died(task, stop)
    finally:
        stop.set()
        server.should_exit = True
        stopping.cancel()
        await asyncio.gather(*tasks, stopping, return_exceptions=True)
        for opened in getattr(server, "servers", []):  # a dead uvicorn loop leaves them open
            opened.close()


def _raise_if_died(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    """Log at error level and raise what ended `task`, unless it ended for the stop."""
    error = None if task.cancelled() else task.exception()
    if error is None and stop.is_set():
        return
    why = "cancelled" if task.cancelled() else "returned before the stop"
    if error is not None:
        why = f"{type(error).__name__}: {error}"
    log.error("webhooks.task_died", task=task.get_name(), error=why, exc_info=error)
    if isinstance(error, Exception):
        raise error  # a domain error stays one line on the command's stderr
    raise RuntimeError(f"the webhook {task.get_name()} task died: {why}")


def _app(
    endpoint: Callable[[Request], Awaitable[Response]],
    registry: CollectorRegistry,
    processor: Processor,
    pool: asyncpg.Pool,
    stop: asyncio.Event,
) -> Starlette:
    def wedged() -> str | None:
        if time.monotonic() - processor.last_tick < http.WEDGED_AFTER_S:
            return None
        return f"processor loop wedged for over {http.WEDGED_AFTER_S:g}s"

    async def not_ready() -> str | None:
        if stop.is_set():
            return "stopping"
        return await privileges.not_granted(pool, privileges.WEBHOOKS)

    return http.probes_app(
        registry,
        wedged=wedged,
        not_ready=not_ready,
        routes=[Route(f"/webhooks/{SOURCE}", endpoint, methods=["POST"])],
    )
