"""`database.translated()`: which driver errors are an outage and which are a bad value."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import asyncpg
import pytest

from charge_worker.database import create_pool, translated
from charge_worker.errors import DependencyUnavailable, PermanentError
from charge_worker.ledger import Ledger
from charge_worker.messages import ChargeDue
from charge_worker.settings import DbSettings

PLUS_ONE = dt.timezone(dt.timedelta(hours=1))


@pytest.fixture
async def pool(db_settings: DbSettings) -> AsyncIterator[asyncpg.Pool]:
    created = await create_pool(db_settings)
    yield created
    await created.close()


@pytest.mark.parametrize(
    ("sql", "value"),
    [
        ("SELECT $1::text", "cus\x00"),  # refused by the server
        ("SELECT $1::timestamptz", dt.datetime(1, 1, 1, 0, 30, tzinfo=PLUS_ONE)),  # by asyncpg
        ("SELECT $1::jsonb", '{"error": "\\u0000"}'),
        ("SELECT $1::bigint", 2**63),
    ],
    ids=["nul-in-text", "year-0-in-utc", "nul-in-jsonb", "over-bigint"],
)
async def test_a_value_postgresql_cannot_store_is_poison_not_an_outage(
    pool: asyncpg.Pool, sql: str, value: object
) -> None:
    """Found in production: taken for "dependency unavailable", such a message was requeued
    41 times in 8 minutes and never dead-lettered."""
    with pytest.raises(PermanentError) as caught:
        async with translated("ledger"):
            await pool.fetchval(sql, value)
    assert caught.value.outcome == "poison"
    assert isinstance(caught.value.__cause__, asyncpg.DataError)
    assert str(caught.value).startswith("ledger: ")


async def test_the_ledger_refuses_an_unstorable_charge_as_poison(pool: asyncpg.Pool) -> None:
    """A charge the parser let through (built here without validation) cannot be claimed."""
    charge = ChargeDue.model_construct(
        schema_="charge.due/v1",
        order_id=7,
        billing_period=dt.date(2026, 12, 1),
        subscription_id="sub_7",
        customer_id="cus\x00",
        amount_minor=99000,
        currency="RUB",
        due_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    )
    with pytest.raises(PermanentError) as caught:
        await Ledger(pool, lease_s=15.0).claim(charge, "worker-1", stream_seq=1)
    assert caught.value.outcome == "poison"
    assert await pool.fetchval("SELECT count(*) FROM charge_attempts") == 0


async def test_a_connection_that_is_gone_is_still_an_outage(db_settings: DbSettings) -> None:
    conn = await asyncpg.connect(db_settings.dsn)
    await conn.close()
    with pytest.raises(DependencyUnavailable):
        async with translated("ledger"):
            await conn.fetchval("SELECT 1")
