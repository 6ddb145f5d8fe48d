"""Hard deadlines for many concurrent calls, on one loop timer.

`asyncio.timeout` arms a timer of the loop for every call and disarms it after, and on
CPython 3.11 each look-up of the running loop costs a system call: work on every call, two
calls per charge, for deadlines of seconds that need no timer of their own. A `Deadlines`
keeps the calls under way instead, and one timer checks them every `resolution_s` while
there are any: a call is cancelled up to `resolution_s` after its deadline, and `within()`
then raises `TimeoutError`, as `asyncio.timeout` does (a cancellation from elsewhere stays a
`CancelledError`). Why our own: docs/decisions/0005. It remembers the loop it last ran on
and asks for the running one only when that loop has no task running: a client's calls
are made from one thread.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

RESOLUTION_S = 0.05


class Deadlines:
    """Deadlines of the calls of one event loop (one per client: its calls' deadlines)."""

    def __init__(self, resolution_s: float = RESOLUTION_S) -> None:
        self.resolution_s = resolution_s
        self.running: set[Within] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the timer's

    def within(self, seconds: float) -> Within:
        """`async with deadlines.within(s):` the body is cancelled once `s` have passed, and
        `TimeoutError` raised out of it."""
        return Within(self, seconds)

    def _watch(self, call: Within, loop: asyncio.AbstractEventLoop) -> None:
        self.running.add(call)
        if self.timer is None or self.loop is not loop:  # not armed, or on a closed loop
            self.loop, self.timer = loop, loop.call_later(self.resolution_s, self._check, loop)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        now = loop.time()
        for call in [call for call in self.running if call.when <= now]:
            self.running.discard(call)
            call.expire()
        if self.running:
            self.timer = loop.call_later(self.resolution_s, self._check, loop)


class Within:
    """One call under a deadline (`Deadlines.within`)."""

    __slots__ = ("cancelling", "deadlines", "expired", "seconds", "task", "when")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self.deadlines, self.seconds, self.expired = deadlines, seconds, False

    async def __aenter__(self) -> None:
        loop = self.deadlines.loop
        if loop is None or (task := asyncio.current_task(loop)) is None:
            # the first call, or one on another loop (the last one closed: tests run one each)
            loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)
            if task is None:
                raise RuntimeError("a deadline applies to a task")
        self.task, self.cancelling = task, task.cancelling()
        self.when = loop.time() + self.seconds
        self.deadlines._watch(self, loop)

    def expire(self) -> None:
        self.expired = True
        self.task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.deadlines.running.discard(self)
        # ours, unless someone else cancelled the task too (then theirs goes on)
        if (
            self.expired
            and self.task.uncancel() <= self.cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError(f"no answer within {self.seconds:g}s") from error
