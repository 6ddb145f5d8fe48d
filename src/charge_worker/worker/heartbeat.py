"""`+WPI` while a message is processed, so JetStream does not redeliver work in progress."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import nats.errors

from charge_worker.worker.metrics import Metrics

TICKS_PER_INTERVAL = 4


class InProgress(Protocol):
    """A message that can say it is still being worked on (nats-py's `Msg` can)."""

    async def in_progress(self) -> None: ...


class Heartbeats:
    """`+WPI` for each message between `start(msg)` and `stop(beat)`, every 3/4 to 1
    `interval_s`, until `budget_s` after its start; one `+WPI` of a message in flight at a
    time.

    One timer for all the messages, ticking every quarter interval while there are any,
    rather than one per message: most charges finish before their first beat, and a timer
    armed and cancelled per message cost more than the rest of the bookkeeping."""

    def __init__(self, interval_s: float, budget_s: float, metrics: Metrics) -> None:
        self.interval_s, self.budget_s, self.metrics = interval_s, budget_s, metrics
        self.tick_s = interval_s / TICKS_PER_INTERVAL
        self.beating: set[Beat] = set()
        self.timer: asyncio.TimerHandle | None = None

    def start(self, msg: InProgress) -> Beat:
        beat = Beat(msg, time.monotonic())
        self.beating.add(beat)
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
        return beat

    def stop(self, beat: Beat) -> None:
        self.beating.discard(beat)
        if beat.sending is not None:
            beat.sending.cancel()

    def _tick(self) -> None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        for beat in self.beating:
            # due within this tick: no gap between two beats is longer than the interval
            due = now - beat.last >= self.interval_s - self.tick_s
            if due and now - beat.started < self.budget_s:
                if beat.sending is None or beat.sending.done():
                    beat.sending = loop.create_task(self._send(beat.msg))
                beat.last = now
        self.timer = loop.call_later(self.tick_s, self._tick) if self.beating else None

    async def _send(self, msg: InProgress) -> None:
        with contextlib.suppress(nats.errors.Error):
            await msg.in_progress()
            self.metrics.heartbeats.inc()


class Beat:
    """One message's heartbeat."""

    __slots__ = ("last", "msg", "sending", "started")

    def __init__(self, msg: InProgress, started: float) -> None:
        self.msg = msg
        self.started = self.last = started
        self.sending: asyncio.Task[None] | None = None
