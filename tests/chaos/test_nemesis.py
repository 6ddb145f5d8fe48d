"""Nemeses that strike the same server never overlap: each finds it as a whole."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
from types import SimpleNamespace

from tests.chaos import nemesis
from tests.chaos.cluster import Chronicle


class _Postgres:
    """The server's shape as the nemeses use it: no process while it is being restarted."""

    def __init__(self) -> None:
        self.proc: object | None = object()
        self.calls: list[str] = []
        self.stopped = threading.Event()
        self.may_start = threading.Event()

    def restart(self, sig: signal.Signals) -> None:
        self.proc = None
        self.calls.append("stopped")
        self.stopped.set()
        self.may_start.wait(10)
        self.proc = object()
        self.calls.append("started")

    def pause(self) -> None:
        assert self.proc is not None, "paused a server that is not running"
        self.calls.append("paused")

    def resume(self) -> None:
        self.calls.append("resumed")


async def test_a_pause_of_postgres_waits_for_its_restart_to_finish() -> None:
    """Found in a full chaos run: a pause struck between the crash's stop and start, its
    nemesis died on the missing process, and the scenario failed as not attacked enough."""
    pg = _Postgres()
    cluster = SimpleNamespace(
        servers=SimpleNamespace(pg=pg), chronicle=Chronicle(), postgres_faults=asyncio.Lock()
    )
    crash = asyncio.create_task(nemesis.crash_postgres(cluster, random.Random(1)))  # type: ignore[arg-type]
    await asyncio.to_thread(pg.stopped.wait, 10)
    pause = asyncio.create_task(nemesis.pause_postgres(cluster, random.Random(1)))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the pause takes its first step while the server is down
    pg.may_start.set()
    await asyncio.gather(crash, pause)

    assert pg.calls == ["stopped", "started", "paused", "resumed"]
