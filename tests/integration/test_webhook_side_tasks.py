"""The webhook receiver's two tasks are supervised: one that dies stops the receiver, loudly.

`charge-worker webhooks` runs the HTTP server and the journal's processor side by side; a
receiver whose processor died would answer 2xx for events nobody applies. Each test kills
one task of a real receiver (real PostgreSQL, the gateway simulator over HTTP) by
cancelling it, found by the coroutine it runs, and expects an error-level log line naming
it and the receiver to stop with an error (the process exits non-zero and is restarted).
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from charge_worker.sandbox.serve import ServedApp
from charge_worker.webhooks.serve import Receiving, run_webhooks
from tests.support.webhooks import FAST, webhook_settings

WAIT_S = 30


def task_running(coroutine: str) -> asyncio.Task[object]:
    """The one task of this loop running `coroutine` (a function's qualified name)."""
    [task] = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").endswith(coroutine) and not t.done()
    ]
    return task


@pytest.mark.parametrize(
    ("coroutine", "name"), [("Processor.run", "processor"), ("Server.serve", "http")]
)
async def test_a_dead_receiver_task_is_logged_as_an_error_and_stops_the_receiver(
    database_url: str, gateway_sim: ServedApp, coroutine: str, name: str
) -> None:
    stop = asyncio.Event()
    started: asyncio.Future[Receiving] = asyncio.get_running_loop().create_future()
    with capture_logs() as logs:
        receiver = asyncio.create_task(
            run_webhooks(
                webhook_settings(database_url, gateway_sim.url),
                stop,
                registry=CollectorRegistry(),
                tuning=FAST,
                on_ready=started.set_result,
            )
        )
        try:
            await asyncio.wait_for(asyncio.shield(started), WAIT_S)
            task_running(coroutine).cancel()
            with pytest.raises(RuntimeError, match=f"webhook {name} task died"):
                await asyncio.wait_for(receiver, WAIT_S)
        finally:
            stop.set()
            await asyncio.wait({receiver}, timeout=WAIT_S)
    assert any(
        entry["event"] == "webhooks.task_died"
        and entry["log_level"] == "error"
        and entry.get("task") == name
        for entry in logs
    ), logs
