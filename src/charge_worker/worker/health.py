"""What the worker reports about itself: `/healthz`, `/readyz`, and the consumer's gauges.

`/healthz` answers "is the pull loop alive, and everything beside it?": it fails when the
loop has not turned for `WEDGED_AFTER_S` (a hung process a restart would cure), or when a
side task (`SideTasks`: the re-scoring loop, the consumer-stats loop, the HTTP server's
loop) ended before the stop, naming it. `/readyz` answers "should this pod get work?":
connected to NATS, PostgreSQL answering with every privilege `run` needs granted
(`privileges.RUN`, or `RUN_VERIFYING`; a missing one is named), the consumer bound and not draining.
A side task copies JetStream's view of the consumer into gauges, so alerts can see lag and
ack-pending from every pod (`max` over pods in the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client

from charge_worker import privileges
from charge_worker.event_loop import raise_if_cancelled
from charge_worker.http import WEDGED_AFTER_S
from charge_worker.settings import NatsSettings
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)


class SideTasks:
    """The tasks that run beside the pull loop, watched.

    One that ends before `stop` is set (an error, a cancel, or a loop that returned) is
    logged at error level and named by `dead()`, which fails `/healthz`: nothing else
    awaits these tasks until the worker stops, so without a watch a dead one goes unseen.
    """

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._dead: dict[str, str] = {}

    @property
    def tasks(self) -> Mapping[str, asyncio.Task[None]]:
        """Every task started, by name."""
        return self._tasks

    def start(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as the side task `name`."""
        task = asyncio.create_task(work, name=name)
        self._tasks[name] = task
        task.add_done_callback(functools.partial(self._ended, name))

    def dead(self) -> str | None:
        """Which side tasks died, and of what; None while all live."""
        if not self._dead:
            return None
        return "; ".join(f"side task {name} died: {why}" for name, why in self._dead.items())

    async def finish(self) -> None:
        """Wait for every task to end (the stop event and the server's exit end them)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if self._stop.is_set() and error is None:
            return  # the way every side task ends
        why = "cancelled" if task.cancelled() else "returned before the stop"
        if error is not None:
            why = f"{type(error).__name__}: {error}"
        self._dead[name] = why
        log.error("worker.side_task_died", task=name, error=why, exc_info=error)


class Health:
    """`/healthz` and `/readyz` of one worker."""

    def __init__(
        self,
        *,
        last_tick: Callable[[], float],
        consuming: Callable[[], bool],
        nc: Client,
        pool: asyncpg.Pool,
        side_tasks: SideTasks | None = None,
        needs: privileges.Needs = privileges.RUN,
    ) -> None:
        self.last_tick = last_tick
        self.consuming = consuming
        self.nc = nc
        self.pool = pool
        self.side_tasks = side_tasks
        self.needs = needs

    def wedged(self, now: float | None = None) -> str | None:
        """Why this process needs a restart (a side task died, or the pull loop stopped
        turning), or None."""
        if self.side_tasks and (dead := self.side_tasks.dead()):
            return dead
        if (now or time.monotonic()) - self.last_tick() < WEDGED_AFTER_S:
            return None
        return f"pull loop wedged for over {WEDGED_AFTER_S:g}s"

    async def not_ready(self) -> str | None:
        """Why this pod should get no work now, or None when it should."""
        if not self.consuming():
            return "consumer not bound or draining"
        if not self.nc.is_connected:
            return "not connected to NATS"
        return await privileges.not_granted(self.pool, self.needs)


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
            metrics.paused.set(1 if info.paused else 0)
            dlq = await js.stream_info(cfg.dlq_stream)
            metrics.dlq_messages.set(dlq.state.messages)
        raise_if_cancelled()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
