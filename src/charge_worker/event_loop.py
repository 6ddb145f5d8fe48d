"""The event loop every command runs on: uvloop's when it is installed, else asyncio's.

uvloop (a dependency on Linux) runs the same asyncio code with the loop itself in C: in
`make bench` the loop's own bookkeeping was the worker's largest CPU cost after HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop

    LOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # Windows: asyncio's own loop runs the same code
    LOOP_FACTORY = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on uvloop when it is installed."""
    with asyncio.Runner(loop_factory=LOOP_FACTORY) as runner:
        return runner.run(coro)
