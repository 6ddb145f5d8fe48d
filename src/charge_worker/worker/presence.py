"""This worker process's own state in `worker_pods` (jobs/pods.py), for `charge-worker status`.

The breakers live in this process's memory and nowhere else. A side task of `run` writes
one row for the process, one upsert at a time: at its start, every `pods.TICK_S`, and at
once after one of its breakers changed state, so `status` shows a breaker that opened
within a round trip rather than a tick. A breaker's listener only notes the time and sets
an event (a breaker changes at most a few times per `reset_s`); nothing is written on a
charge's path. A write that fails logs one warning (`pods.write_failed`), like the job
exporter's read, and the next turn writes again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Sequence

import asyncpg
import structlog

from charge_worker.breaker import Breaker, State
from charge_worker.errors import ChargeWorkerError
from charge_worker.event_loop import raise_if_cancelled
from charge_worker.jobs import pods
from charge_worker.jobs.pods import BreakerState

log = structlog.get_logger(__name__)

WRITE_TIMEOUT_S = 10.0  # a write that waits longer (a pool busy charging) is a failed one


class Presence:
    """What this process writes of itself; `run` writes it until the stop."""

    def __init__(
        self,
        worker: str,
        breakers: Sequence[Breaker],
        *,
        in_flight: Callable[[], int],
        paused: Callable[[], bool],
    ) -> None:
        self.worker = worker
        self.started_at = dt.datetime.now(dt.UTC)
        self.in_flight = in_flight
        self.paused = paused
        self.breakers = {breaker.name: breaker for breaker in breakers}
        self.since = dict.fromkeys(self.breakers, self.started_at)
        self.changed = asyncio.Event()
        for breaker in breakers:
            breaker.listeners.append(self._noter(breaker.name))

    def _noter(self, name: str) -> Callable[[State], None]:
        def note(_state: State) -> None:
            self.since[name] = dt.datetime.now(dt.UTC)
            self.changed.set()

        return note

    def states(self) -> dict[str, BreakerState]:
        """Each breaker's state now, and since when."""
        return {
            name: BreakerState(breaker.state, self.since[name])
            for name, breaker in self.breakers.items()
        }

    async def write(self, pool: asyncpg.Pool) -> bool:
        """One upsert of this process's row; False, logged, when it fails."""
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await pods.record(
                    pool,
                    self.worker,
                    started_at=self.started_at,
                    breakers=self.states(),
                    in_flight=self.in_flight(),
                    paused=self.paused(),
                )
        except (ChargeWorkerError, TimeoutError) as error:
            log.warning("pods.write_failed", error=" ".join(str(error).split()) or repr(error))
            return False
        return True

    async def run(
        self, pool: asyncpg.Pool, stop: asyncio.Event, *, interval_s: float = pods.TICK_S
    ) -> None:
        """Write at once, then every `interval_s` and after each breaker change, until `stop`."""
        while not stop.is_set():
            self.changed.clear()  # a change from now on is in this write or wakes the next
            await self.write(pool)
            raise_if_cancelled()
            await _first_of(stop, self.changed, timeout_s=interval_s)


async def _first_of(*events: asyncio.Event, timeout_s: float) -> None:
    """Return once any of `events` is set, or after `timeout_s`."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
