"""Subscriptions, scheduled rows and stream contents, for the producer's tests."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import asyncpg
from nats.js import JetStreamContext

DAY = dt.date(2026, 12, 1)
# where a period rests: final, or its try ended and the next waits for its time or the customer
FINAL = (
    "succeeded",
    "declined",
    "blocked",
    "failed",
    "refunded",
    "retry_scheduled",
    "action_required",
)


@dataclass(frozen=True)
class Sub:
    """One row of `subscriptions`, due on DAY unless told otherwise."""

    subscription_id: str
    order_id: int
    next_billing_date: dt.date = DAY
    amount_minor: int = 99000
    currency: str = "RUB"
    customer_id: str = "cus_ok"
    active: bool = True


@contextlib.asynccontextmanager
async def connected(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def add_subscriptions(database_url: str, *subs: Sub) -> None:
    async with connected(database_url) as conn:
        await conn.executemany(
            "INSERT INTO subscriptions (subscription_id, order_id, next_billing_date,"
            " amount_minor, currency, customer_id, active) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            [dataclasses.astuple(sub) for sub in subs],
        )


async def add_attempt(
    database_url: str,
    sub: Sub,
    status: str,
    *,
    period: dt.date = DAY,
    amount_minor: int | None = None,
    published: bool = False,
) -> None:
    """A `charge_attempts` row written by hand (due_at NULL), as a worker or an old run left it."""
    async with connected(database_url) as conn:
        await conn.execute(
            "INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,"
            " subscription_id, customer_id, amount_minor, currency, status, gateway_charge_id,"
            " published_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, CASE WHEN $10 THEN now() END)",
            sub.order_id,
            period,
            f"{sub.order_id}:{period.isoformat()}",
            sub.subscription_id,
            sub.customer_id,
            amount_minor or sub.amount_minor,
            sub.currency,
            status,
            f"ch_{sub.order_id}" if status in ("succeeded", "refunded") else None,
            published,
        )


async def attempts(database_url: str) -> dict[str, tuple[str, bool]]:
    """Ledger rows by key: (status, published)."""
    async with connected(database_url) as conn:
        rows = await conn.fetch(
            "SELECT idempotency_key, status, published_at IS NOT NULL AS published"
            " FROM charge_attempts"
        )
    return {row["idempotency_key"]: (row["status"], row["published"]) for row in rows}


async def next_dates(database_url: str) -> dict[str, dt.date]:
    async with connected(database_url) as conn:
        rows = await conn.fetch("SELECT subscription_id, next_billing_date FROM subscriptions")
    return {row["subscription_id"]: row["next_billing_date"] for row in rows}


async def stream_messages(js: JetStreamContext, stream: str) -> dict[str, bytes]:
    """Every message in the stream by Nats-Msg-Id; a second message for an id fails the test."""
    info = await js.stream_info(stream)
    found: dict[str, bytes] = {}
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):  # 0 when empty
        msg = await js.get_msg(stream, seq)
        msg_id = (msg.headers or {})["Nats-Msg-Id"]
        assert msg_id not in found, f"a second message for {msg_id}"
        found[msg_id] = msg.data or b""
    return found


def all_final(database_url: str, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        rows = await attempts(database_url)
        return len(rows) == count and all(status in FINAL for status, _ in rows.values())

    return check


def keys_of(*pairs: tuple[int, str]) -> set[str]:
    return {f"{order_id}:{period}" for order_id, period in pairs}
