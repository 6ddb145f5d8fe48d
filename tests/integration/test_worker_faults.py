"""The worker under faults: a lost answer, a gateway outage, server restarts.

Every test ends by counting money at the gateway simulator: each key charged once. What the
worker makes of each answer of the gateway (a 502, a 409, a 429, a 404, a connection
reset) is unit tested on in-memory ports (tests/unit/test_pipeline.py); here are the faults
only real servers and sockets show.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from nats.aio.client import Client
from pydantic import SecretStr

from charge_worker import streams
from charge_worker.errors import DependencyUnavailable
from charge_worker.gateway import ContractGateway
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import NatsServer, PostgresServer, free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import GatewaySettings, NatsSettings
from tests.support.harness import (
    PERIOD,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
)

# Short timeouts so a lease (gateway timeout + 5 s) and the retries after it stay short.
FAST = {"gateway_timeout_s": 1.0, "lease_s": 7.0, "gateway_breaker_reset_s": 1.0}


async def all_settled(database_url: str, count: int) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT status FROM charge_attempts")
    finally:
        await conn.close()
    return len(rows) == count and all(r["status"] == "succeeded" for r in rows)


def each_once(count: int) -> dict[str, int]:
    return {f"{n}:2026-12-01": 1 for n in range(1, count + 1)}


async def test_an_answer_lost_to_the_client_timeout_resolves_to_one_charge(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    await set_sim(
        gateway_sim.url, lost_answer_rate=1.0, lost_answer_mode="timeout", lost_answer_delay_s=5.0
    )
    js = await provisioned(nc, settings)
    for n in (1, 2, 3):
        await publish(js, settings.nats.subject, due(n))
    async with running_worker(settings) as worker:
        await eventually(lambda: all_settled(database_url, 3), "all resolved by lookup")
        assert worker.metric("charge_worker_gateway_calls_total", result="outcome_unknown") >= 3
    assert await gateway_charges(gateway_sim.url) == each_once(3)


async def test_gateway_down_longer_than_every_backoff_loses_nothing(
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
        **FAST,
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        max_deliver=3,
        heartbeat_s=0.3,
        gateway_breaker_failures=3,
        concurrency=2,
    )
    await set_sim(gateway_sim.url, error_rates={"503": 1.0})
    js = await provisioned(nc, settings)
    for n in range(1, 9):
        await publish(js, settings.nats.subject, due(n))
    async with running_worker(settings) as worker:
        await eventually(
            lambda: worker.metric("charge_worker_breaker_open", dependency="gateway") == 1,
            "the gateway breaker open",
        )
        # down for several times every backoff step and the lease together
        await asyncio.sleep(8)
        assert worker.metric("charge_worker_dead_letters_total", reason="max_deliveries") == 0
        await set_sim(gateway_sim.url, error_rates={})
        await eventually(lambda: all_settled(database_url, 8), "all charged after the outage")
        assert worker.metric("charge_worker_dead_letters_total", reason="max_deliveries") == 0
    assert await gateway_charges(gateway_sim.url) == each_once(8)


@pytest.fixture
def own_nats() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


async def test_nats_restart_mid_run(
    own_nats: NatsServer,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    cfg = nats_settings.model_copy(update={"url": own_nats.url})
    settings = settings_for(cfg, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    await set_sim(gateway_sim.url, latency={"fixed_s": 0.05})
    nc = await streams.connect(settings.nats, name="test")
    js = await provisioned(nc, settings)
    for n in range(1, 41):
        await publish(js, settings.nats.subject, due(n))
    async with running_worker(settings) as worker:
        await eventually(
            lambda: (
                worker.metric("charge_worker_messages_total", outcome="charged", action="ack") >= 5
            ),
            "some charged",
        )
        await asyncio.to_thread(own_nats.restart)
        await eventually(lambda: all_settled(database_url, 40), "all charged", within_s=120)
        assert not worker.task.done()  # the same worker, never restarted
    await nc.close()
    assert await gateway_charges(gateway_sim.url) == each_once(40)


async def test_postgres_restart_mid_run(
    nc: Client, nats_settings: NatsSettings, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> None:
    with PostgresServer() as pg:
        await migrate(pg.url)
        settings = settings_for(nats_settings, pg.url, gateway_sim.url, scoring_sim.url, **FAST)
        await set_sim(gateway_sim.url, latency={"fixed_s": 0.05})
        js = await provisioned(nc, settings)
        for n in range(1, 41):
            await publish(js, settings.nats.subject, due(n))
        async with running_worker(settings) as worker:
            await eventually(
                lambda: (
                    worker.metric("charge_worker_messages_total", outcome="charged", action="ack")
                    >= 5
                ),
                "some charged",
            )
            await asyncio.to_thread(pg.restart)
            await eventually(lambda: all_settled(pg.url, 40), "all charged", within_s=120)
            assert not worker.task.done()
    assert await gateway_charges(gateway_sim.url) == each_once(40)


async def test_a_refused_connection_is_known_unsent_not_an_unknown_outcome() -> None:
    cfg = GatewaySettings(url=f"http://127.0.0.1:{free_port()}", api_key=SecretStr("k"))
    gateway = ContractGateway(cfg)
    try:
        with pytest.raises(DependencyUnavailable, match="unreachable"):
            await gateway.lookup(1, PERIOD)
    finally:
        await gateway.aclose()


async def test_readiness_flips_with_nats(
    own_nats: NatsServer,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    cfg = nats_settings.model_copy(update={"url": own_nats.url})
    settings = settings_for(cfg, database_url, gateway_sim.url, scoring_sim.url)
    async with (
        running_worker(settings) as worker,
        httpx.AsyncClient(base_url=worker.http_url) as client,
    ):
        assert (await client.get("/readyz")).status_code == 200
        await asyncio.to_thread(own_nats.terminate)

        async def says(status: int, words: str) -> bool:
            answer = await client.get("/readyz")
            return answer.status_code == status and words in answer.text

        await eventually(lambda: says(503, "not connected to NATS"), "not ready without NATS")
        await asyncio.to_thread(own_nats.start)
        await eventually(lambda: says(200, "ready"), "ready again")
