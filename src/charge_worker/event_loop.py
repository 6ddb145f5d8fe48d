"""The event loop every command runs on, the signals that stop it, and this process's name.

uvloop (a dependency on Linux) runs the same asyncio code with the loop itself in C: in
`make bench` the loop's own bookkeeping was the worker's largest CPU cost after HTTP.
SIGTERM and SIGINT only set a stop event; each command decides what stopping means.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop

    LOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # Windows: asyncio's own loop runs the same code
    LOOP_FACTORY = None


def raise_if_cancelled() -> None:
    """Raise `CancelledError` when this task has been asked to stop. A loop that suppresses
    its clients' errors calls it on every turn: a client may have turned the cancellation
    into an error of its own (asyncio.wait_for on Python 3.11 can lose it), and the loop
    would then go on for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, on uvloop when it is installed."""
    with asyncio.Runner(loop_factory=LOOP_FACTORY) as runner:
        return runner.run(coro)


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT set `stop` and do nothing else."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def process_name() -> str:
    """This process as a lease owner: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
