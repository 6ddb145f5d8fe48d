"""The kill switch with workers running: `pause` stops charging at the next fetch, a worker
(re)starting keeps it paused and Ready with `charge_worker_paused` at 1, and `resume`
charges every message that waited, each exactly once. (The commands themselves, idempotence
and `provision --apply`: tests/e2e/test_pause_cli.py.)
"""

from __future__ import annotations

import datetime as dt
import time

import httpx
from nats.aio.client import Client

from charge_worker.admin.pause import AT_KEY, BY_KEY, REASON_KEY, pause, resume
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    PERIOD,
    RunningWorker,
    consumer_idle,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    settings_for,
    statuses,
)

NOW = dt.datetime(2026, 12, 1, 3, 0, tzinfo=dt.UTC)


async def a_whole_fetch(worker: RunningWorker) -> None:
    """Wait until a fetch the worker started after this call has returned: whatever was in
    the stream by now, that pull could have had it."""
    called = time.monotonic()
    await eventually(lambda: worker.consumer.last_tick > called, "the pull loop turned")
    turned = worker.consumer.last_tick  # the fetch of this turn follows
    await eventually(lambda: worker.consumer.last_tick > turned, "that turn's fetch returned")


async def ready(worker: RunningWorker) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{worker.http_url}/readyz")).status_code


async def test_pause_stops_charging_a_restart_keeps_it_and_resume_loses_nothing(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        fetch_wait_s=0.2,
        stats_interval_s=0.1,
    )
    cfg = settings.nats
    js = await provisioned(nc, settings)
    async with running_worker(settings) as worker:
        await publish(js, cfg.subject, due(1))
        await eventually(lambda: consumer_idle(nc, cfg), "the first charge settled")
        assert await statuses(database_url) == {1: "succeeded"}

        state, changed = await pause(js, cfg, reason="gateway incident", by="ann", now=NOW)
        assert changed
        assert state.paused
        for order_id in range(2, 7):
            await publish(js, cfg.subject, due(order_id))
        await a_whole_fetch(worker)
        await eventually(lambda: worker.metric("charge_worker_paused") == 1, "the paused gauge")
        assert await ready(worker) == 200

    # a pod (re)starting: it provisions (nothing is missing) and binds to the paused consumer
    async with running_worker(settings) as worker:
        await a_whole_fetch(worker)
        await eventually(lambda: worker.metric("charge_worker_paused") == 1, "the paused gauge")
        assert await ready(worker) == 200  # Ready, and /metrics served: paused is no outage
        info = await js.consumer_info(cfg.stream, cfg.durable)
        assert info.paused
        assert info.delivered is not None
        assert info.delivered.stream_seq == 1  # none delivered since the first
        assert (info.num_pending, info.num_ack_pending) == (5, 0)
        metadata = info.config.metadata or {}
        assert (metadata[REASON_KEY], metadata[BY_KEY], metadata[AT_KEY]) == (
            "gateway incident",
            "ann",
            "2026-12-01T03:00:00Z",
        )
        assert await statuses(database_url) == {1: "succeeded"}  # the ledger saw none either

        state, changed = await resume(js, cfg)
        assert changed
        assert (state.paused, state.reason, state.paused_by) == (False, None, None)
        await eventually(lambda: consumer_idle(nc, cfg), "every waiting charge settled")
        await eventually(lambda: worker.metric("charge_worker_paused") == 0, "the gauge back")

    assert await statuses(database_url) == dict.fromkeys(range(1, 7), "succeeded")
    keys = {f"{order_id}:{PERIOD.isoformat()}": 1 for order_id in range(1, 7)}
    assert await gateway_charges(gateway_sim.url) == keys  # each once, none lost
