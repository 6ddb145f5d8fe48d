"""The fleet's gateway rate: one token bucket in PostgreSQL, shared by every process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.ratelimit import RateLimiter
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    settings_for,
)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    created = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert created is not None
    yield created
    await created.close()


async def test_off_it_grants_everything_and_touches_nothing(pool: asyncpg.Pool) -> None:
    limiter = RateLimiter(pool, rate_per_s=0)
    assert await limiter.reserve(500) == 500
    await limiter.spend()
    assert await pool.fetchval("SELECT count(*) FROM rate_buckets") == 0


async def test_processes_share_one_rate(pool: asyncpg.Pool) -> None:
    """Two processes taking as fast as they can get no more, together, than the rate over
    the time they took plus the bucket they start with (BURST_S worth: one token here)."""
    rate = 40.0
    fleet = [RateLimiter(pool, rate_per_s=rate) for _ in range(2)]
    started = time.monotonic()
    spent = 0

    async def drain(limiter: RateLimiter) -> None:
        nonlocal spent
        while time.monotonic() - started < 1.5:
            await limiter.spend()
            spent += 1

    await asyncio.gather(*(drain(limiter) for limiter in fleet))
    elapsed = time.monotonic() - started
    assert spent <= rate * elapsed + fleet[0].capacity + 1  # a bucket of BURST_S worth
    assert spent >= rate  # the bucket refills at the rate: most of 1.5 s worth went through


async def test_nothing_is_fetched_while_a_request_waits_for_a_token(pool: asyncpg.Pool) -> None:
    limiter = RateLimiter(pool, rate_per_s=0.2)  # one token every 5 s, a bucket of one
    assert await limiter.reserve(25) == 25
    await limiter.spend()  # the bucket's one token
    waiting = asyncio.create_task(limiter.spend())
    await eventually(lambda: limiter.waiting == 1, "a request waiting for a token")
    assert await limiter.reserve(25) == 0  # the message would only wait: it stays in the stream
    other = RateLimiter(pool, rate_per_s=0.2)
    assert await other._take(1) == 0  # the fleet's bucket is empty for every process
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert await limiter.reserve(25) == 25


async def test_the_worker_takes_its_gateway_calls_from_the_fleets_bucket(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    pool: asyncpg.Pool,
) -> None:
    """`CHARGE_WORKER_GATEWAY_RATE_LIMIT` reaches the worker: its calls come out of the
    shared bucket (a row the limiter alone writes), and the charge is made."""
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, gateway_rate_limit=50.0
    )
    js = await provisioned(nc, settings)
    async with running_worker(settings):
        await publish(js, settings.nats.subject, due(1))
        await eventually(
            lambda: _gateway_charges_equal(gateway_sim.url, {"1:2026-12-01": 1}), "charged"
        )
    assert await pool.fetchval("SELECT count(*) FROM rate_buckets WHERE name = 'gateway'") == 1


async def _gateway_charges_equal(url: str, expected: dict[str, int]) -> bool:
    return await gateway_charges(url) == expected
