"""A running worker's relay: its charges' events reach the stream, and a stream that
refuses them (missing, a NATS user without the right) stops no charge."""

from __future__ import annotations

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
    settings_for,
)
from tests.support.outcomes import outcomes, unsent


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    return settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, outbox_retry_max_s=1.0
    )


async def drained(pool: asyncpg.Pool) -> bool:
    return await unsent(pool) == 0


async def settled(pool: asyncpg.Pool, count: int) -> bool:
    final = await pool.fetchval(
        "SELECT count(*) FROM charge_attempts WHERE status IN ('succeeded', 'retry_scheduled')"
    )
    return int(final) == count


async def test_events_wait_while_the_stream_refuses_them_and_charging_goes_on(
    nc: Client, settings: Settings, pool: asyncpg.Pool
) -> None:
    js = await provisioned(nc, settings)
    async with running_worker(settings) as worker:
        await js.delete_stream(settings.nats.outcomes_stream)  # provisioned by the worker
        for order_id in (1, 2, 3):
            await publish(js, settings.nats.subject, due(order_id))
        await publish(js, settings.nats.subject, due(4, customer="cus_decline_4"))
        await eventually(lambda: settled(pool, 4), "four charges settled")
        assert await unsent(pool) == 4

        await eventually(
            lambda: worker.metric("charge_worker_outbox_publishes_total", result="failed") >= 4,
            "the relay tried and failed",
        )
        assert await outcomes(js, settings.nats) == []

        await provisioned(nc, settings)  # the stream is back
        await eventually(lambda: drained(pool), "the outbox drained")
        await eventually(
            lambda: worker.metric("charge_worker_outbox_oldest_unsent_seconds") == 0,
            "the age of the oldest unsent event back to 0",
        )
    stored = await outcomes(js, settings.nats)
    assert sorted((m.body["order_id"], m.body["type"]) for m in stored) == [
        (1, "charge.succeeded"),
        (2, "charge.succeeded"),
        (3, "charge.succeeded"),
        (4, "charge.retry_scheduled"),  # a generic decline is soft: the next try is due
    ]
    assert worker.metric("charge_worker_outbox_publishes_total", result="published") == 4
