"""`CHARGE_WORKER_VERIFY_SUBSCRIPTION=match`: a message moves money only when a subscription
says it is due (issue 34, item 3).

Anyone who can publish to `charges.due` could otherwise charge any customer any amount: the
worker charged every well-formed message. With verification on, a message whose key has no
ledger row yet is claimed only when an active subscription of its order has its customer,
amount and currency, and its period is on the subscription's schedule; else the claim
raises `Unverified` (dead-lettered `unverified`). A row the producer scheduled needs no more
proof than its fingerprint (written from the subscription when it was due), so a price
change after scheduling does not dead-letter the period already due.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from charge_worker.errors import Unverified
from charge_worker.ledger import Ledger
from charge_worker.messages import ChargeDue
from tests.support.grants import PASSWORD, with_user
from tests.support.producer import Sub, add_subscriptions

PERIOD = dt.date(2026, 10, 31)
SUB = Sub("sub_v1", 8101, next_billing_date=PERIOD, customer_id="cus_v1")


def due(**fields: Any) -> ChargeDue:
    body = {
        "schema": "charge.due/v1",
        "order_id": SUB.order_id,
        "billing_period": PERIOD,
        "subscription_id": SUB.subscription_id,
        "customer_id": SUB.customer_id,
        "amount_minor": SUB.amount_minor,
        "currency": SUB.currency,
        "due_at": dt.datetime(2026, 10, 31, tzinfo=dt.UTC),
    }
    return ChargeDue.model_validate(body | fields, strict=False)


@pytest.fixture
async def verifying(pool: asyncpg.Pool, database_url: str) -> Ledger:
    await add_subscriptions(database_url, SUB)
    return Ledger(pool, lease_s=60, verify_subscription=True)


async def test_a_message_its_subscription_agrees_with_is_claimed(verifying: Ledger) -> None:
    claim = await verifying.claim(due(), "worker-1", stream_seq=1)
    assert claim.attempt == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"amount_minor": 1_000_000},
        {"currency": "USD"},
        {"customer_id": "cus_attacker"},
        {"subscription_id": "sub_other"},
        {"order_id": 8102},  # no subscription at all
        {"billing_period": dt.date(2026, 10, 30)},  # off the schedule's day
        # anchored on the 31st: November's period is the 30th, never the 29th
        {"billing_period": dt.date(2026, 11, 29)},
    ],
    ids=["amount", "currency", "customer", "subscription", "no subscription", "day", "month"],
)
async def test_a_message_no_subscription_agrees_with_is_unverified_and_writes_nothing(
    verifying: Ledger, pool: asyncpg.Pool, fields: dict[str, Any]
) -> None:
    with pytest.raises(Unverified, match="no active subscription"):
        await verifying.claim(due(**fields), "worker-1", stream_seq=1)
    assert await pool.fetchval("SELECT count(*) FROM charge_attempts") == 0


async def test_later_periods_on_the_anchor_are_verified(verifying: Ledger) -> None:
    """The 31st's schedule: the 30th in November, the 28th in February, the 31st again."""
    for period in (dt.date(2026, 11, 30), dt.date(2027, 2, 28), dt.date(2027, 3, 31)):
        await verifying.claim(due(billing_period=period), "worker-1", stream_seq=1)


async def test_a_month_end_period_of_a_subscription_no_producer_anchored_is_verified(
    pool: asyncpg.Pool, database_url: str
) -> None:
    """No billing_anchor, and a next billing date its own producer clamped to February's
    end: January's 31st (a late message) is still one of its periods."""
    await add_subscriptions(
        database_url, dataclasses.replace(SUB, next_billing_date=dt.date(2027, 2, 28))
    )
    ledger = Ledger(pool, lease_s=60, verify_subscription=True)
    await ledger.claim(due(billing_period=dt.date(2027, 1, 31)), "worker-1", stream_seq=1)
    with pytest.raises(Unverified):  # a day that is no month's end is still off it
        await ledger.claim(due(billing_period=dt.date(2027, 1, 30)), "worker-1", stream_seq=2)


async def test_an_inactive_subscription_charges_nothing(
    pool: asyncpg.Pool, database_url: str
) -> None:
    await add_subscriptions(database_url, dataclasses.replace(SUB, active=False))
    ledger = Ledger(pool, lease_s=60, verify_subscription=True)
    with pytest.raises(Unverified):
        await ledger.claim(due(), "worker-1", stream_seq=1)


async def test_a_row_the_producer_scheduled_is_claimed_after_a_price_change(
    verifying: Ledger, pool: asyncpg.Pool
) -> None:
    await pool.execute(
        "INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,"
        " subscription_id, customer_id, amount_minor, currency, due_at, status)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'scheduled')",
        SUB.order_id,
        PERIOD,
        due().key,
        SUB.subscription_id,
        SUB.customer_id,
        SUB.amount_minor,
        SUB.currency,
        due().due_at,
    )
    await pool.execute("UPDATE subscriptions SET amount_minor = 129000")
    claim = await verifying.claim(due(), "worker-1", stream_seq=1)
    assert claim.attempt == 1


async def test_off_any_well_formed_message_is_claimed_without_a_grant_on_subscriptions(
    pool: asyncpg.Pool, database_url: str
) -> None:
    """The default, for a worker role with no grant on `subscriptions`: more claims than it
    takes PostgreSQL to switch the prepared statement to a generic plan, which checks the
    privileges of every table the statement names."""
    role = f"claims_{uuid.uuid4().hex[:8]}"
    await pool.execute(
        f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}';"
        f" GRANT SELECT, INSERT, UPDATE ON charge_attempts TO {role}"
    )
    database = urlsplit(database_url).path.lstrip("/")
    narrow = await asyncpg.create_pool(
        with_user(database_url, role, database), min_size=1, max_size=1
    )
    assert narrow is not None
    try:
        ledger = Ledger(narrow, lease_s=60)
        for order_id in range(8110, 8120):
            await ledger.claim(due(order_id=order_id, customer_id="cus_anyone"), "w", 1)
    finally:
        await narrow.close()
        await pool.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
