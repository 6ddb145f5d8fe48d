"""Wiring and lifecycle of `charge-worker run`: connections, clients, consumer, HTTP, signals.

SIGTERM and SIGINT only set the stop event; the consumer decides what stopping means
(no more fetches, in-flight work drained within `drain_s`, nothing acked on cancel). The
side tasks (re-scoring, the outcome relay, the job runs' gauges, this pod's row in
`worker_pods`, consumer stats, the HTTP server) are watched (`health.SideTasks`): one
that dies is logged at error level and fails `/healthz`, so the pod is restarted.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry

from charge_worker import event_loop, http, privileges, streams
from charge_worker.database import create_pool
from charge_worker.dlq import DeadLetters
from charge_worker.gateway import build_gateway
from charge_worker.jobs import export_job_runs
from charge_worker.ledger import DeferredChecks, Ledger
from charge_worker.outcomes.outbox import Outbox
from charge_worker.outcomes.relay import OutboxMetrics, Relay
from charge_worker.ratelimit import RateLimiter
from charge_worker.scoring import ScoringClient
from charge_worker.settings import Settings
from charge_worker.worker.advisories import Advisories
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.health import Health, SideTasks, report_consumer_stats
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Pipeline
from charge_worker.worker.presence import Presence
from charge_worker.worker.rescoring import BATCH, rescore_deferred

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Running:
    """A started worker, as `on_ready` sees it (tests use it to reach the HTTP surface and
    the side tasks)."""

    consumer: Consumer
    http_port: int
    side_tasks: Mapping[str, asyncio.Task[None]]


async def run_worker(  # noqa: PLR0915 (the wiring: every part, once, in start order)
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: CollectorRegistry | None = None,
    on_ready: Callable[[Running], None] = lambda _r: None,
) -> None:
    """Run one worker until `stop` is set."""
    failpoints = Failpoints(settings.worker.failpoints)  # a bad spec fails before connecting
    listener = http.listen(
        settings.http.http_host, settings.http.metrics_port, setting="CHARGE_WORKER_METRICS_PORT"
    )
    owner = event_loop.process_name()
    structlog.contextvars.bind_contextvars(worker=owner)  # every task started after
    nc = await streams.connect(settings.nats, name=f"charge-worker {owner}")
    js = nc.jetstream()
    report = await streams.provision(js, settings.nats)
    for drift in report.drift:
        log.warning("streams.drift", detail=str(drift))
    pool = await create_pool(settings.db)
    limiter = RateLimiter(pool, rate_per_s=settings.gateway.gateway_rate_limit)
    gateway = build_gateway(settings.gateway, limiter=limiter)
    scoring = ScoringClient(settings.scoring)
    metrics = Metrics(registry or CollectorRegistry())
    metrics.watch(gateway.breaker)
    metrics.watch(scoring.breaker)
    ledger = Ledger(
        pool,
        lease_s=settings.worker.lease_s,
        verify_subscription=settings.worker.verify_subscription == "match",
    )
    dead_letters = DeadLetters(js, settings.nats)
    pipeline = Pipeline(
        ledger,
        gateway,
        scoring,
        owner=owner,
        metrics=metrics,
        failpoints=failpoints,
        retry_schedule=settings.retries.retry_schedule,
    )
    consumer = Consumer(
        settings,
        js=js,
        pipeline=pipeline,
        dead_letters=dead_letters,
        gateway=gateway,
        metrics=metrics,
        failpoints=failpoints,
    )
    side_tasks = SideTasks(stop)
    health = Health(
        last_tick=lambda: consumer.last_tick,
        consuming=consumer.ready.is_set,
        nc=nc,
        pool=pool,
        side_tasks=side_tasks,
        needs=privileges.RUN_VERIFYING if ledger.verify_subscription else privileges.RUN,
    )
    server = http.server(  # served on `listener`, bound above
        http.probes_app(metrics.registry, wedged=health.wedged, not_ready=health.not_ready)
    )
    interval_s = settings.worker.deferred_check_interval_s
    # a taken batch stays leased long enough to score all of it at the full timeout
    checks = DeferredChecks(pool, retry_s=BATCH * settings.scoring.scoring_timeout_s + interval_s)
    advisories = Advisories(dead_letters, ledger, metrics)
    subscription = await nc.subscribe(advisories.subject(), cb=advisories.on_message)
    side_tasks.start("http", server.serve(sockets=[listener]))
    side_tasks.start(
        "rescoring", rescore_deferred(checks, scoring, metrics, stop, interval_s=interval_s)
    )
    relay = Relay(
        Outbox.of_worker(pool, settings.worker),
        js,
        settings.nats,
        settings.worker,
        OutboxMetrics(metrics.registry),
        before_mark=lambda: failpoints.hit("after_outcome_publish_before_mark"),
    )
    side_tasks.start("outcome_relay", relay.run(stop))
    side_tasks.start("job_runs", export_job_runs(pool, metrics.registry, stop))
    presence = Presence(
        owner,
        (gateway.breaker, scoring.breaker),
        in_flight=lambda: len(consumer.in_flight),
        # as report_consumer_stats last read the consumer
        paused=lambda: metrics.registry.get_sample_value("charge_worker_paused") == 1,
    )
    side_tasks.start("pods", presence.run(pool, stop))
    side_tasks.start(
        "consumer_stats",
        report_consumer_stats(
            nc, settings.nats, metrics, stop, interval_s=settings.worker.stats_interval_s
        ),
    )
    log.info("worker.started", concurrency=settings.worker.concurrency)
    try:
        consuming = asyncio.create_task(consumer.run(stop))
        on_ready(Running(consumer, listener.getsockname()[1], side_tasks.tasks))
        await consuming
    finally:
        server.should_exit = True
        stop.set()
        await side_tasks.finish()
        for opened in getattr(server, "servers", []):  # a dead uvicorn loop leaves them open
            opened.close()
        await subscription.unsubscribe()
        await gateway.aclose()
        await scoring.aclose()
        await pool.close()
        await nc.drain()
        log.info("worker.stopped")


async def run_command(settings: Settings) -> int:
    """`charge-worker run`: until SIGTERM or SIGINT; 0 after a clean stop.

    What is loaded by now (modules, validators, settings) lives as long as the process:
    frozen out of the collector's sight, so a full collection, which a stream of charges
    triggers every few thousand objects, walks only what the charges allocated."""
    gc.freeze()
    stop = asyncio.Event()
    with event_loop.stop_on_signals(stop):
        await run_worker(settings, stop)
    return 0
