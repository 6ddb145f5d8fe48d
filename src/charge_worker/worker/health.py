"""What the worker reports about itself: `/healthz`, `/readyz`, and the consumer's gauges.

`/healthz` answers "is the pull loop alive?": it fails only when the loop has not turned
for `WEDGED_AFTER_S` (a hung process a restart would cure). `/readyz` answers "should this
pod get work?": connected to NATS, PostgreSQL answering with every privilege `run` needs
granted (`privileges.RUN`; a missing one is named), the consumer bound and not draining.
A side task copies JetStream's view of the consumer into gauges, so alerts can see lag and
ack-pending from every pod (`max` over pods in the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from charge_worker import privileges
from charge_worker.http import WEDGED_AFTER_S
from charge_worker.settings import NatsSettings
from charge_worker.worker.metrics import Metrics


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

    def wedged(self, now: float | None = None) -> str | None:
        """Why this process needs a restart (the pull loop stopped turning), or None."""
        if (now or time.monotonic()) - self.last_tick() < WEDGED_AFTER_S:
            return None
        return f"pull loop wedged for over {WEDGED_AFTER_S:g}s"

    async def not_ready(self) -> str | None:
        """Why this pod should get no work now, or None when it should."""
        if not self.consuming():
            return "consumer not bound or draining"
        if not self.nc.is_connected:
            return "not connected to NATS"
        return await privileges.not_granted(self.pool, privileges.RUN)


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
