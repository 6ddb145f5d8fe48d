"""A circuit breaker for one dependency, on the monotonic clock of its process.

Closed, calls go through, and `fail_max` counted failures in a row open it. Open, calls are
refused (`BreakerOpen`) for `reset_s`; after that the breaker is half-open: calls go
through, and the first outcome closes it or opens it again for another `reset_s`.

A failure counts when `counts(error)` says so: an unknown outcome or an unreachable
dependency does, a verdict (a decline, a 409, a 429) does not and, like a success, ends a
run of failures. A cancelled call (the worker stopping) proves nothing either way and
changes nothing. The error of a call is always raised as it was, the one that trips the
breaker included, so its classification survives.

A call is `with breaker: await ...`. This replaced pybreaker, whose `calling()` is a
generator context manager with a lock, listener loops and datetime arithmetic on every call,
twice per charge, for an event loop that needs none of them, and which had no public way to
tell how long it stays open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal

State = Literal["closed", "open", "half-open"]


class BreakerOpen(Exception):
    """The breaker refused the call: the dependency failed `fail_max` times in a row."""


class Breaker:
    def __init__(
        self,
        name: str,
        *,
        fail_max: int,
        reset_s: float,
        counts: Callable[[BaseException], bool],
        neutral: Callable[[BaseException], bool] = lambda error: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.fail_max = fail_max
        self.reset_s = reset_s
        self.counts = counts
        self.neutral = neutral
        self.clock = clock
        self.state: State = "closed"
        self.failures = 0  # counted failures in a row
        self.opened_at = 0.0
        self.listeners: list[Callable[[State], None]] = []

    def open_for_s(self) -> float:
        """Seconds until an open breaker lets a call through (0 when it would now)."""
        if self.state != "open":
            return 0.0
        return max(self.opened_at + self.reset_s - self.clock(), 0.0)

    def __enter__(self) -> None:
        if self.state == "open":
            if self.open_for_s() > 0:
                raise BreakerOpen(f"{self.name} breaker open")
            self._become("half-open")

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(error, asyncio.CancelledError) or (error and self.neutral(error)):
            return
        if error is None or not self.counts(error):
            self._succeeded()
        else:
            self._failed()

    def _succeeded(self) -> None:
        self.failures = 0
        if self.state == "half-open":
            self._become("closed")

    def _failed(self) -> None:
        if self.state == "open":  # a call made before it opened: already counted enough
            return
        self.failures += 1
        if self.state == "half-open" or self.failures >= self.fail_max:
            self.opened_at = self.clock()
            self._become("open")

    def _become(self, state: State) -> None:
        if state != self.state:
            self.state = state
            for listener in self.listeners:
                listener(state)
