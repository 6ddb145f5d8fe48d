"""A lookup is as narrow as the ledger can make it: YooKassa can only list a shop's payments
by time, so the worker, reconcile and `explain` tell the adapter when the try began (by the
database's clock) and it lists from there, less its margin for clocks, instead of a month
of every payment of the shop. The unkind shape: an answer lost after the payment was made.
Real PostgreSQL and the YooKassa-flavoured simulator over HTTP."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.gateway.results import GatewayCharge
from charge_worker.gateway.yookassa import LOOKUP_MARGIN, YooKassaGateway
from charge_worker.messages import ChargeDue
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from charge_worker.worker.decisions import Outcome
from tests.support.harness import provisioned
from tests.support.pipelines import process_once
from tests.support.providers import Provider, provider

LEASE_S = 30.0
CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 8101,
        "billing_period": dt.date(2026, 12, 1),
        "subscription_id": "sub_8101",
        "customer_id": "2d8e2a5c-000f-5000-8000-1a2b3c4d5e6f",
        "amount_minor": 99000,
        "currency": "RUB",
        "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    },
    strict=False,
)


class Recording(YooKassaGateway):
    """The YooKassa adapter, noting the `since` of every lookup it is asked for."""

    asked: list[dt.datetime | None]

    async def lookup(
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        self.asked.append(since)
        return await super().lookup(order_id, billing_period, customer_id=customer_id, since=since)


@pytest.fixture
def sim() -> Iterator[Provider]:
    with provider("yookassa") as served:
        yield served


def recording(sim: Provider) -> Recording:
    gateway = Recording(sim.settings())
    gateway.asked = []
    return gateway


async def test_a_lost_answer_is_looked_up_from_when_the_try_began(
    sim: Provider, pool: asyncpg.Pool
) -> None:
    await sim.configure(lost_answer_rate=1.0, lost_answer_mode="5xx")
    first = await process_once(pool, recording(sim), CHARGE.to_json(), lease_s=LEASE_S)
    assert first.result.outcome is Outcome.OUTCOME_UNKNOWN
    await sim.configure(lost_answer_rate=0.0)
    await pool.execute(
        "UPDATE charge_attempts SET lease_until = now() - interval '1 second'"
    )  # the pod died

    gateway = recording(sim)
    again = await process_once(pool, gateway, CHARGE.to_json(), lease_s=LEASE_S)

    began = await pool.fetchval("SELECT created_at FROM charge_attempts")
    assert gateway.asked == [began]  # the try's start, not a month before the period
    assert again.result.outcome is Outcome.CHARGED
    assert await sim.made() == {CHARGE.key: 1}


async def test_the_adapter_lists_from_the_tries_start_less_its_margin(sim: Provider) -> None:
    gateway = recording(sim)
    made = await gateway.charge(CHARGE)
    now = dt.datetime.now(dt.UTC)
    try:
        within = await gateway.lookup(8101, CHARGE.billing_period, since=now + LOOKUP_MARGIN / 2)
        after = await gateway.lookup(8101, CHARGE.billing_period, since=now + 2 * LOOKUP_MARGIN)
    finally:
        await gateway.aclose()
    # a database clock running ahead of YooKassa's by less than the margin still finds it
    assert [c.id for c in within] == [made.charge_id]
    assert after == []  # a charge before the try's start is not the try's


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, sim: Provider, scoring_sim: ServedApp
) -> Settings:
    return sim.worker_settings(nats_settings, database_url, scoring_sim.url, reconcile_quiet_s=0.01)


async def test_a_row_made_again_after_a_failover_finds_the_payment_older_than_it(
    nc: Client, settings: Settings, pool: asyncpg.Pool, sim: Provider
) -> None:
    """A failover lost the row and its message; `produce` made the row again, hours after
    the payment (here: a row dated two hours ahead). Reconcile's lost-messages sweep looks
    from the period's due moment, not the row's birth, so it records the payment instead of
    sending the charge out again (a second payment once YooKassa forgot the key)."""
    await provisioned(nc, settings)
    gateway = sim.gateway()
    try:
        made = await gateway.charge(CHARGE)
    finally:
        await gateway.aclose()
    await pool.execute(
        """
        INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,
            subscription_id, customer_id, amount_minor, currency, due_at, status,
            created_at, updated_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'scheduled', now() + interval '2 hours',
                now() - interval '1 minute')
        """,
        CHARGE.order_id,
        CHARGE.billing_period,
        CHARGE.key,
        CHARGE.subscription_id,
        CHARGE.customer_id,
        CHARGE.amount_minor,
        CHARGE.currency,
        CHARGE.due_at,
    )

    report = await run_reconcile(settings)

    row = await pool.fetchrow("SELECT status, gateway_charge_id FROM charge_attempts")
    assert row is not None
    assert (row["status"], row["gateway_charge_id"]) == ("succeeded", made.charge_id)
    assert report.counts.republished == 0
    assert await sim.made() == {CHARGE.key: 1}
