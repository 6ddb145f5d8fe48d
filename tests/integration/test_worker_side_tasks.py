"""The tasks beside the pull loop are supervised: one that dies fails `/healthz`, naming it.

`charge-worker run` runs the re-scoring loop, the consumer-stats loop, the outcome relay, the
job-runs exporter, its presence in `worker_pods` and the HTTP server beside the pull loop.
Each test kills one of them in a real worker (real NATS, PostgreSQL and simulators over HTTP)
by cancelling its task, found by the coroutine it runs, and expects an error-level log line
and a failing `/healthz` that names the dead task (a cancelled uvicorn loop leaves its
sockets answering, so even the HTTP task's death is told there; a server that stopped
answering fails the probe by itself).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from nats.aio.client import Client
from structlog.testing import capture_logs

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import eventually, provisioned, running_worker, settings_for

# the coroutine each side task runs, and the name /healthz and the log give it
SIDE_TASKS = {
    "rescore_deferred": "rescoring",
    "report_consumer_stats": "consumer_stats",
    "Relay.run": "outcome_relay",
    "export_job_runs": "job_runs",
    "Presence.run": "pods",
    "Server.serve": "http",  # uvicorn's loop; the sockets it opened answer on without it
}


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)


def side_task(coroutine: str) -> asyncio.Task[object]:
    """The one task of this loop running `coroutine` (a function's qualified name)."""
    [task] = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").endswith(coroutine) and not t.done()
    ]
    return task


def died(logs: list[dict[str, object]], name: str) -> bool:
    return any(
        entry["event"] == "worker.side_task_died"
        and entry["log_level"] == "error"
        and entry.get("task") == name
        for entry in logs
    )


@pytest.mark.parametrize("coroutine", sorted(SIDE_TASKS))
async def test_a_dead_side_task_fails_healthz_naming_it_and_is_logged_as_an_error(
    nc: Client, settings: Settings, coroutine: str
) -> None:
    name = SIDE_TASKS[coroutine]
    await provisioned(nc, settings)
    with capture_logs() as logs:
        async with (
            running_worker(settings) as worker,
            httpx.AsyncClient(base_url=worker.http_url) as client,
        ):
            assert (await client.get("/healthz")).status_code == 200
            task = side_task(coroutine)
            task.cancel()
            await eventually(task.done, f"the {name} task ended")
            healthz = await client.get("/healthz")
            assert healthz.status_code == 503
            assert name in healthz.text
            assert died(logs, name)
            assert (await client.get("/readyz")).status_code == 200  # still consuming
