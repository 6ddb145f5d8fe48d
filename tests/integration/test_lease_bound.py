"""The request that can move money always starts under a lease that outlives it.

Since no write precedes a gateway call, the lease is the only thing that keeps a second
worker from taking a charge over while the first one's request may still land: the request
must start while the lease outlives its deadline and the margin (`LEASE_MARGIN_S`). These
tests give the worker the unkind shapes the review found (issue 34, item 1): reads before
the charge request that eat the lease (a Stripe customer with no invoice default: three
requests), and a fleet rate-limit token that is slow to come. The gateway is an
httpx.MockTransport whose charge handler reads, from the real PostgreSQL ledger, how much
lease is left as the request arrives.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
from pydantic import SecretStr

from charge_worker.gateway import Gateway
from charge_worker.gateway.contract import ContractGateway
from charge_worker.gateway.stripe import StripeGateway
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import (
    LEASE_MARGIN_S,
    LEASE_RENEWAL_S,
    GatewaySettings,
)
from charge_worker.worker.decisions import Outcome
from tests.support.pipelines import process_once

TIMEOUT_S = 1.0  # each gateway request's deadline
LEASE_S = TIMEOUT_S + LEASE_MARGIN_S + LEASE_RENEWAL_S  # the least the settings allow
READ_S = 0.8  # a slow read, inside its own deadline: two of them eat more than the slack
CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 7001,
        "billing_period": dt.date(2026, 12, 1),
        "subscription_id": "sub_7001",
        "customer_id": "cus_7001",
        "amount_minor": 99000,
        "currency": "EUR",
        "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    },
    strict=False,
)
_LEASE_LEFT = """
SELECT extract(epoch FROM lease_until - clock_timestamp())
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class LeaseAtCharge:
    """The lease left on the charge's row as each charge request arrives."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.seen: list[float] = []

    async def read(self) -> None:
        left = await self.pool.fetchval(_LEASE_LEFT, CHARGE.order_id, CHARGE.billing_period)
        self.seen.append(float(left))


async def run_once(pool: asyncpg.Pool, gateway: Gateway) -> Outcome:
    done = await process_once(pool, gateway, CHARGE.to_json(), lease_s=LEASE_S)
    return done.result.outcome


def stripe(handler: Handler, **cfg: Any) -> StripeGateway:
    settings = GatewaySettings(
        kind="stripe",
        url="http://127.0.0.1",
        api_key=SecretStr("sk_test_lease"),
        gateway_timeout_s=TIMEOUT_S,
        **cfg,
    )
    return StripeGateway(settings, transport=httpx.MockTransport(handler))


async def test_a_slow_three_request_stripe_charge_starts_its_intent_under_a_full_lease(
    pool: asyncpg.Pool,
) -> None:
    """A customer with no invoice default: the customer, its cards, then the intent. The
    two reads take most of a lease renewed before them; the intent must still start with
    its deadline and the margin left."""
    lease = LeaseAtCharge(pool)

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/v1/customers/"):
            await asyncio.sleep(READ_S)
            return httpx.Response(200, json={"id": CHARGE.customer_id, "object": "customer"})
        if path == "/v1/payment_methods":
            await asyncio.sleep(READ_S)
            card = {"id": "pm_7001", "object": "payment_method"}
            return httpx.Response(200, json={"object": "list", "data": [card], "has_more": False})
        assert path == "/v1/payment_intents", path
        await lease.read()
        return httpx.Response(200, json=intent())

    assert await run_once(pool, stripe(handler)) is Outcome.CHARGED
    assert len(lease.seen) == 1
    assert lease.seen[0] >= TIMEOUT_S + LEASE_MARGIN_S, lease.seen


async def test_a_slow_rate_limit_token_is_waited_for_before_the_lease_is_checked(
    pool: asyncpg.Pool,
) -> None:
    """The fleet's bucket is empty (another pod took the token): the charge request waits
    for a refill outside its deadline. It must not start on what the wait left of the lease."""
    lease = LeaseAtCharge(pool)
    rate = 1 / (2 * READ_S)  # one token every 1.6 s
    other_pod = RateLimiter(pool, rate_per_s=rate)
    await other_pod.spend()  # the only token there is

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/charges", request.url.path
        await lease.read()
        body = {"id": "ch_7001", "status": "succeeded", "amount": 99000, "currency": "EUR"}
        return httpx.Response(200, json=body)

    settings = GatewaySettings(
        url="http://127.0.0.1", api_key=SecretStr("key"), gateway_timeout_s=TIMEOUT_S
    )
    gateway = ContractGateway(
        settings,
        limiter=RateLimiter(pool, rate_per_s=rate),
        transport=httpx.MockTransport(handler),
    )
    assert await run_once(pool, gateway) is Outcome.CHARGED
    assert len(lease.seen) == 1
    assert lease.seen[0] >= TIMEOUT_S + LEASE_MARGIN_S, lease.seen


async def test_a_renewal_too_slow_to_leave_the_request_its_lease_sends_nothing(
    pool: asyncpg.Pool,
) -> None:
    """The lease is renewed right before the intent, but the renewal waits on a row lock
    (a slow database) for longer than the slack the settings leave: the renewed lease
    would not outlive the request, so the intent is never sent."""
    intents = 0
    locked = asyncio.Event()

    async def hold_the_row(seconds: float) -> None:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "SELECT 1 FROM charge_attempts WHERE order_id = $1 FOR UPDATE", CHARGE.order_id
            )
            locked.set()
            await asyncio.sleep(seconds)

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal intents
        path = request.url.path
        if path.startswith("/v1/customers/"):
            holder.append(asyncio.create_task(hold_the_row(2 * READ_S + 2 * LEASE_RENEWAL_S)))
            await locked.wait()
            await asyncio.sleep(READ_S)
            return httpx.Response(200, json={"id": CHARGE.customer_id, "object": "customer"})
        if path == "/v1/payment_methods":
            await asyncio.sleep(READ_S)
            card = {"id": "pm_7001", "object": "payment_method"}
            return httpx.Response(200, json={"object": "list", "data": [card], "has_more": False})
        intents += 1
        return httpx.Response(200, json=intent())

    holder: list[asyncio.Task[None]] = []
    assert await run_once(pool, stripe(handler)) is Outcome.LEASE_HELD
    await asyncio.gather(*holder)
    assert intents == 0


def intent() -> dict[str, Any]:
    return {
        "id": "pi_7001",
        "object": "payment_intent",
        "amount": CHARGE.amount_minor,
        "currency": "eur",
        "customer": CHARGE.customer_id,
        "status": "succeeded",
        "metadata": {"order_id": "7001", "billing_period": "2026-12-01"},
        "created": 1_796_000_000,
        "latest_charge": {"id": "ch_1", "object": "charge", "amount_refunded": 0},
    }
