"""The worker under faults: unknown outcomes, 409/429, a gateway outage, server restarts.

Every test ends by counting money at the gateway simulator: each key charged once.
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


@pytest.mark.parametrize("mode", ["5xx", "timeout"])
async def test_lost_answer_after_the_charge_resolves_to_one_charge(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    mode: str,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    await set_sim(
        gateway_sim.url, lost_answer_rate=1.0, lost_answer_mode=mode, lost_answer_delay_s=5.0
    )
    js = await provisioned(nc, settings)
    for n in (1, 2, 3):
        await publish(js, settings.nats.subject, due(n))
    async with running_worker(settings) as worker:
        await eventually(lambda: all_settled(database_url, 3), "all resolved by lookup")
        assert worker.metric("charge_worker_gateway_calls_total", result="outcome_unknown") >= 3
    assert await gateway_charges(gateway_sim.url) == each_once(3)


async def test_request_in_progress_is_retried_not_failed(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """An earlier call with this key is still running at the gateway: 409, then retry."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    body = {
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_ok",
        "metadata": {"order_id": "1", "billing_period": "2026-12-01"},
    }
    headers = {"Authorization": "Bearer sk_test_sandbox", "Idempotency-Key": "1:2026-12-01"}
    await set_sim(gateway_sim.url, latency={"fixed_s": 4.0})
    async with httpx.AsyncClient(base_url=gateway_sim.url, timeout=30) as client:
        earlier = asyncio.create_task(client.post("/v1/charges", json=body, headers=headers))
        await eventually(lambda: _in_flight(gateway_sim.url), "the earlier call in flight")
        await set_sim(gateway_sim.url, latency={"fixed_s": 0.0})
        js = await provisioned(nc, settings)
        await publish(js, settings.nats.subject, due(1))
        async with running_worker(settings) as worker:
            await eventually(
                lambda: (
                    worker.metric("charge_worker_gateway_calls_total", result="in_progress") >= 1
                ),
                "a 409 seen",
            )
            await eventually(lambda: all_settled(database_url, 1), "the charge settled")
        assert (await earlier).status_code == 200
    assert await gateway_charges(gateway_sim.url) == each_once(1)


async def _in_flight(gateway_url: str) -> bool:
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{gateway_url}/_sim/stats")).json()
    return bool(stats.get("in_flight"))


async def test_rate_limited_is_retried_after_retry_after(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    await set_sim(gateway_sim.url, error_rates={"429": 0.5}, retry_after_s=1, seed=3)
    js = await provisioned(nc, settings)
    for n in range(1, 7):
        await publish(js, settings.nats.subject, due(n))
    async with running_worker(settings) as worker:
        await eventually(lambda: all_settled(database_url, 6), "all charged")
        assert worker.metric("charge_worker_gateway_calls_total", result="rate_limited") >= 1
        assert worker.metric("charge_worker_dead_letters_total", reason="max_deliveries") == 0
    assert await gateway_charges(gateway_sim.url) == each_once(6)


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


async def test_a_404_from_the_gateway_keeps_the_charge_pending_and_retried(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """`GATEWAY_URL` with a wrong path: the gateway (or a proxy) answers 404. Nothing was
    charged and nothing is known about the charge: it stays pending and is retried, never
    failed or dead-lettered; once the URL is fixed it is charged once (after a lookup)."""
    wrong = settings_for(
        nats_settings, database_url, f"{gateway_sim.url}/wrong-path", scoring_sim.url, **FAST
    )
    js = await provisioned(nc, wrong)
    await publish(js, wrong.nats.subject, due(1))
    async with running_worker(wrong) as worker:
        await eventually(
            lambda: worker.metric("charge_worker_gateway_calls_total", result="unavailable") >= 1,
            "the gateway's 404",
        )
        await eventually(lambda: _pending_and_free(database_url), "the row left pending")
        assert worker.metric("charge_worker_dead_letters_total", reason="rejected") == 0
    assert (await js.stream_info(wrong.nats.dlq_stream)).state.messages == 0
    assert await gateway_charges(gateway_sim.url) == {}

    right = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    async with running_worker(right):
        await eventually(lambda: all_settled(database_url, 1), "charged once the URL is right")
    assert await gateway_charges(gateway_sim.url) == each_once(1)
    assert (await js.stream_info(right.nats.dlq_stream)).state.messages == 0


async def _pending_and_free(database_url: str) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT status, lease_owner FROM charge_attempts")
    finally:
        await conn.close()
    return row is not None and (row["status"], row["lease_owner"]) == ("pending", None)


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
