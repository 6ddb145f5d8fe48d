"""Webhooks about the charges of a period's tries, against real PostgreSQL, over real HTTP
(docs/decisions/0007-retries.md; `webhooks/rules.py`).

A charge's try is its metadata's `attempt`. Money of any try is the period's; only the
current try's decline is its own, and leaves the period as the retry schedule says; an
earlier try's decline changes nothing; a period waiting for its next try that turns out to
hold money is recorded with it, so the next try never starts.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from charge_worker.gateway import ContractGateway
from charge_worker.messages import idempotency_key
from charge_worker.retries.starts import start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import GatewaySettings
from charge_worker.webhooks.inbox import Inbox
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.processor import Processor
from tests.support.harness import eventually
from tests.support.webhooks import (
    API_KEY,
    FAST,
    PERIOD,
    Receiver,
    entry,
    event,
    running_receiver,
    settled,
    status_of,
    webhook_settings,
)

SCHEDULE = (600.0, 1200.0)
CAP = 8


@pytest.fixture
async def receiver(database_url: str, gateway_sim: ServedApp) -> AsyncIterator[Receiver]:
    async with running_receiver(webhook_settings(database_url, gateway_sim.url)) as running:
        yield running


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


async def put_row(
    db: asyncpg.Connection, order_id: int, status: str, *, try_no: int, charge_id: str | None = None
) -> None:
    """The period's row at try `try_no`, unleased (a worker that died, or one waiting for
    its next try: `retry_scheduled` due a minute ago, `action_required`, `declined`)."""
    await db.execute(
        """
        INSERT INTO charge_attempts (
            order_id, billing_period, idempotency_key, subscription_id, customer_id,
            amount_minor, currency, status, gateway_charge_id, gateway_calls, attempt,
            current_try, try_started_at, retry_at, decline_code, decline_class, settled_at)
        VALUES ($1, $2, $3, 'sub_' || $1::bigint, 'cus_ok', 99000, 'RUB', $4, $5, 1, 1, $6,
                CASE WHEN $6 > 1 THEN now() - interval '1 hour' END,
                CASE WHEN $4 = 'retry_scheduled' THEN now() - interval '1 minute' END,
                CASE WHEN $4 IN ('retry_scheduled', 'action_required', 'declined')
                     THEN 'insufficient_funds' END,
                CASE WHEN $4 IN ('retry_scheduled', 'action_required', 'declined')
                     THEN 'soft' END,
                CASE WHEN $4 NOT IN ('scheduled', 'pending') THEN now() END)
        """,
        order_id,
        PERIOD,
        idempotency_key(order_id, PERIOD, try_no),
        status,
        charge_id,
        try_no,
    )


def try_event(
    charge_id: str, kind: str, try_no: int, *, code: str | None = None, **kw: Any
) -> dict[str, Any]:
    """`event`, made by try `try_no` (its metadata's `attempt`), with a decline's code."""
    body = event(charge_id, kind, **kw)
    charge = body["data"]["object"]
    if try_no > 1:
        charge["metadata"]["attempt"] = str(try_no)
    if code is not None:
        charge["decline_code"] = code
    return body


async def row(db: asyncpg.Connection, order_id: int) -> dict[str, Any]:
    found = await db.fetchrow(
        """
        SELECT status, current_try, gateway_charge_id, decline_code, decline_class,
               extract(epoch FROM retry_at - now()) AS retry_in_s
          FROM charge_attempts WHERE order_id = $1
        """,
        order_id,
    )
    assert found is not None
    return dict(found)


async def delivered(receiver: Receiver, db: asyncpg.Connection, body: dict[str, Any]) -> str:
    """Post `body`, wait until it is processed; its journal status."""
    assert (await receiver.post(body)).status_code == 200
    await eventually(lambda: settled(db, body["id"]), f"{body['type']} processed")
    status = await status_of(db, body["id"])
    assert status is not None
    return status


async def test_an_earlier_trys_decline_never_declines_the_current_try_and_try_2s_charge_applies(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    """Try 2's worker died mid-call; try 1's `charge.failed` arrives (late, or again): it
    was recorded when try 1 ended, and changes nothing. Try 2's `charge.succeeded` records
    the period's charge, and its refund applies to the same row."""
    await put_row(db, 1, "pending", try_no=2)

    first = try_event("ch_try1", "charge.failed", 1, code="insufficient_funds")
    assert await delivered(receiver, db, first) == "applied"
    assert (await row(db, 1))["status"] == "pending"

    second = try_event("ch_try2", "charge.succeeded", 2, revision=1)
    assert await delivered(receiver, db, second) == "applied"
    recorded = await row(db, 1)
    assert (recorded["status"], recorded["gateway_charge_id"]) == ("succeeded", "ch_try2")
    refund = try_event("ch_try2", "charge.refunded", 2, revision=2)
    assert await delivered(receiver, db, refund) == "applied"
    assert (await row(db, 1))["status"] == "refunded"


async def test_an_earlier_trys_decline_does_not_schedule_a_waiting_period_again(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await put_row(db, 1, "retry_scheduled", try_no=2)
    await put_row(db, 2, "declined", try_no=2)
    before = [await row(db, n) for n in (1, 2)]

    for order_id in (1, 2):
        body = try_event(f"ch_{order_id}_1", "charge.failed", 1, order_id=order_id)
        assert await delivered(receiver, db, body) == "applied"

    after = [await row(db, n) for n in (1, 2)]
    assert [(r["status"], r["current_try"]) for r in after] == [
        ("retry_scheduled", 2),
        ("declined", 2),
    ]
    assert after[0]["retry_in_s"] == pytest.approx(before[0]["retry_in_s"], abs=30)


@pytest.mark.parametrize("status", ["retry_scheduled", "action_required"])
@pytest.mark.parametrize("kind", ["charge.succeeded", "charge.dispute_created"])
async def test_money_for_a_period_waiting_for_its_next_try_is_recorded_and_no_try_starts(
    receiver: Receiver, db: asyncpg.Connection, status: str, kind: str
) -> None:
    """Try 1's charge was captured after all (its answer was a lost decline); the period
    waits for try 3. The webhook proves the money the period's (its fingerprint): the row
    records it and leaves its wait, so the producer's step starts no try."""
    await put_row(db, 1, status, try_no=2)

    late = try_event("ch_try1", kind, 1)
    assert await delivered(receiver, db, late) == "applied"

    after = await row(db, 1)
    assert (after["status"], after["gateway_charge_id"], after["retry_in_s"]) == (
        "succeeded",
        "ch_try1",
        None,
    )
    disputed = await db.fetchval("SELECT disputed_at IS NOT NULL FROM charge_attempts")
    assert disputed is (kind == "charge.dispute_created")
    assert (await start_due(db, limit=10, cap=CAP)).started == 0
    assert (await row(db, 1))["current_try"] == 2


async def test_money_for_a_waiting_period_of_another_fingerprint_is_for_a_person(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await put_row(db, 1, "retry_scheduled", try_no=2)

    stranger = try_event("ch_x", "charge.succeeded", 1, customer="cus_agent")
    assert await delivered(receiver, db, stranger) == "needs_review"

    assert (await row(db, 1))["status"] == "retry_scheduled"


@contextlib.asynccontextmanager
async def processor_with_schedule(
    database_url: str, gateway_url: str
) -> AsyncIterator[tuple[Inbox, Processor]]:
    """A journal whose decisions follow `SCHEDULE`, and a processor run by the test."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    assert pool is not None
    gateway = ContractGateway(GatewaySettings(url=gateway_url, api_key=SecretStr(API_KEY)))
    inbox = Inbox(pool, retry_schedule=SCHEDULE)
    metrics = WebhookMetrics(CollectorRegistry(), source="gateway")
    processor = Processor(
        inbox, gateway, metrics, owner="test-processor", retention_s=86400, tuning=FAST
    )
    try:
        yield inbox, processor
    finally:
        await gateway.aclose()
        await pool.close()


@pytest.mark.parametrize(
    ("code", "status", "klass", "retry_in_s"),
    [
        ("insufficient_funds", "retry_scheduled", "soft", SCHEDULE[1]),
        ("authentication_required", "action_required", "customer_action", None),
        ("stolen_card", "declined", "hard", None),
    ],
    ids=["soft", "customer_action", "hard"],
)
async def test_the_current_trys_decline_leaves_the_period_as_the_schedule_says(
    database_url: str,
    gateway_sim: ServedApp,
    db: asyncpg.Connection,
    code: str,
    status: str,
    klass: str,
    retry_in_s: float | None,
) -> None:
    """Try 2's worker died mid-call; the gateway's `charge.failed` of try 2 is its answer,
    written as the worker writes it: the state the class and the try's number leave the
    period in, with the code and class, and when the next try is due."""
    await put_row(db, 1, "pending", try_no=2)
    failed = try_event("ch_try2", "charge.failed", 2, code=code)
    async with processor_with_schedule(database_url, gateway_sim.url) as (inbox, processor):
        assert await inbox.journal(entry(failed))
        assert await processor.run_once() == 1

    assert await status_of(db, failed["id"]) == "applied"
    after = await row(db, 1)
    assert (after["status"], after["decline_code"], after["decline_class"]) == (
        status,
        code,
        klass,
    )
    if retry_in_s is None:
        assert after["retry_in_s"] is None
    else:
        assert retry_in_s - 60 < after["retry_in_s"] <= retry_in_s
    story = await db.fetchval("SELECT detail FROM charge_events WHERE kind = 'webhook'")
    assert json.loads(story)["detail"] == f"pending -> {status}"


async def test_the_receiver_leaves_a_soft_decline_to_the_configured_schedule(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    """`charge-worker webhooks` as deployed: its processor knows CHARGE_WORKER_RETRY_SCHEDULE
    (the default's first step, a day)."""
    await put_row(db, 1, "pending", try_no=1)
    failed = try_event("ch_try1", "charge.failed", 1, code="insufficient_funds")
    assert await delivered(receiver, db, failed) == "applied"
    after = await row(db, 1)
    assert after["status"] == "retry_scheduled"
    assert 86400 - 60 < after["retry_in_s"] <= 86400
