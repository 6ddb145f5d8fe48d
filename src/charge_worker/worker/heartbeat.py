"""`+WPI` while a message is processed, so JetStream does not redeliver work in progress."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import nats.errors
from nats.aio.msg import Msg

from charge_worker.worker.metrics import Metrics


class Heartbeat:
    """`+WPI` every `interval_s` while inside, up to `budget_s` after entering.

    A timer rather than a task per message: most charges finish before the first beat and
    then cost one cancelled timer. One `+WPI` is in flight at a time.
    """

    def __init__(self, msg: Msg, interval_s: float, budget_s: float, metrics: Metrics) -> None:
        self.msg, self.interval_s, self.budget_s, self.metrics = msg, interval_s, budget_s, metrics
        self.loop = asyncio.get_running_loop()
        self.sending: asyncio.Task[None] | None = None

    def __enter__(self) -> Heartbeat:
        self.deadline = self.loop.time() + self.budget_s
        self.timer = self.loop.call_later(self.interval_s, self._beat)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.timer.cancel()
        if self.sending is not None:
            self.sending.cancel()

    def _beat(self) -> None:
        if self.loop.time() >= self.deadline:
            return
        if self.sending is None or self.sending.done():
            self.sending = self.loop.create_task(self._send())
        self.timer = self.loop.call_later(self.interval_s, self._beat)

    async def _send(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.msg.in_progress()
            self.metrics.heartbeats.inc()
