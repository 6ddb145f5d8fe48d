"""The outbox against real PostgreSQL: every change of a period's state the contract names
commits its event row with it, on every path; nothing else makes one.

The paths are driven through the statements the product runs (the ledger's writes,
reconcile's record and adoption, a webhook's apply, a late verdict); `docs/contracts/
charge-outcome.md` is the table they are checked against.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Literal

import asyncpg
import jsonschema
import pytest

from charge_worker.errors import LeaseHeld
from charge_worker.ledger import Attempted, DeferredCheck, DeferredChecks, Ledger, Settlement
from charge_worker.outcomes.outbox import Event
from tests.integration.test_ledger import PERIOD, charge
from tests.support.contracts import schema

ORDER = 48291


@pytest.fixture
def ledger(pool: asyncpg.Pool) -> Ledger:
    return Ledger(pool, lease_s=60)


async def events(pool: asyncpg.Pool, order_id: int = ORDER) -> list[dict[str, Any]]:
    """The key's events as the relay will publish them, each checked against the schema."""
    rows = await pool.fetch(
        "SELECT order_id, billing_period, sequence, type, subscription_id, customer_id,"
        " amount_minor, currency, gateway_charge_id, decline_code, decline_class, review,"
        " traceparent, occurred_at, attempt, retry_at, sent_at FROM charge_outcomes"
        " WHERE order_id = $1 AND billing_period = $2 ORDER BY sequence",
        order_id,
        PERIOD,
    )
    bodies = []
    for row in rows:
        assert row["sent_at"] is None
        body = json.loads(Event(*list(row.values())[:-1]).body())
        jsonschema.validate(body, schema("charge-outcome.v1.json"))
        assert (body["sequence"], body["type"]) == (row["sequence"], row["type"])
        assert body["event_id"] == f"{order_id}:{PERIOD.isoformat()}:{row['sequence']}"
        bodies.append(body)
    return bodies


async def settled(ledger: Ledger, settlement: Settlement, order_id: int = ORDER) -> None:
    claim = await ledger.claim(charge(order_id), "w1", stream_seq=1)
    await ledger.settle(claim, settlement, story={"result": settlement.status})


async def test_a_success_writes_one_event_with_the_charge(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await settled(ledger, Settlement("succeeded", charge_id="ch_1"))
    [event] = await events(pool)
    assert event["type"] == "charge.succeeded"
    assert event["sequence"] == 1
    assert event["gateway_charge_id"] == "ch_1"
    assert (event["amount_minor"], event["currency"], event["customer_id"]) == (
        99000,
        "RUB",
        "cus_42",
    )
    assert (event["subscription_id"], event["attempt"]) == ("sub_7Q2", 1)
    assert event["billing_period"] == "2026-09-01"
    assert dt.datetime.fromisoformat(event["occurred_at"]).tzinfo == dt.UTC
    assert "review" not in event


@pytest.mark.parametrize(
    ("settlement", "expected"),
    [
        (Settlement("blocked"), "charge.blocked"),
        (Settlement("failed", error="rejected: amount too large"), "charge.failed"),
    ],
)
async def test_each_final_state_writes_its_type(
    ledger: Ledger, pool: asyncpg.Pool, settlement: Settlement, expected: str
) -> None:
    await settled(ledger, settlement)
    [event] = await events(pool)
    assert event["type"] == expected
    assert (event["gateway_charge_id"], event["decline_code"], event["decline_class"]) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("code", "decline_class"),
    [("insufficient_funds", "soft"), ("stolen_card", "hard"), ("expired_card", "customer_action")],
)
async def test_a_decline_carries_its_code_and_class(
    ledger: Ledger, pool: asyncpg.Pool, code: str, decline_class: str
) -> None:
    await settled(ledger, Settlement("declined", decline_code=code))
    [event] = await events(pool)
    assert (event["decline_code"], event["decline_class"]) == (code, decline_class)


async def test_a_soft_decline_with_tries_left_announces_the_next_try(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await settled(
        ledger,
        Settlement("retry_scheduled", decline_code="insufficient_funds", retry_in_s=86400.0),
    )
    [event] = await events(pool)
    retry_at = await pool.fetchval("SELECT retry_at FROM charge_attempts")
    assert event["type"] == "charge.retry_scheduled"
    assert (event["decline_code"], event["decline_class"], event["attempt"]) == (
        "insufficient_funds",
        "soft",
        1,
    )
    assert event["retry_at"] == retry_at.astimezone(dt.UTC).isoformat(
        timespec="milliseconds"
    ).replace("+00:00", "Z")
    assert dt.datetime.fromisoformat(event["retry_at"]) - dt.datetime.fromisoformat(
        event["occurred_at"]
    ) == dt.timedelta(days=1)


async def test_a_customer_action_decline_asks_for_the_customer(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await settled(ledger, Settlement("action_required", decline_code="expired_card"))
    [event] = await events(pool)
    assert (event["type"], event["decline_class"], "retry_at" in event) == (
        "charge.action_required",
        "customer_action",
        False,
    )


async def test_a_decline_a_webhook_recorded_without_a_code_is_a_generic_one(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await ledger.claim(charge(), "w1", stream_seq=1)
    await pool.execute(
        "UPDATE charge_attempts SET status = 'declined', lease_owner = NULL, lease_until = NULL"
    )
    [event] = await events(pool)
    assert (event["decline_code"], event["decline_class"]) == ("generic_decline", "soft")


async def test_writes_that_change_no_state_write_no_event(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    claim = await ledger.extend(claim)
    await ledger.retry_later(claim, "gateway 503", keep_lease=False, attempted=Attempted(calls=1))
    await ledger.published(ORDER, PERIOD, 9)
    claim = await ledger.claim(charge(), "w2", stream_seq=2)
    await ledger.settle(claim, Settlement("processing", charge_id="py_1"), story=None)
    assert await events(pool) == []


async def test_a_fenced_out_write_writes_no_event(ledger: Ledger, pool: asyncpg.Pool) -> None:
    first = await ledger.claim(charge(), "w1", stream_seq=1)
    await pool.execute("UPDATE charge_attempts SET lease_until = now() - interval '1 second'")
    await ledger.claim(charge(), "w2", stream_seq=2)
    with pytest.raises(LeaseHeld):
        await ledger.settle(first, Settlement("succeeded", charge_id="ch_1"), story=None)
    assert await events(pool) == []


async def test_out_of_deliveries_before_any_call_fails_with_an_event(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.give_up(claim, "max deliveries")
    [event] = await events(pool)
    assert event["type"] == "charge.failed"


async def test_out_of_deliveries_after_a_call_waits_for_the_lookup_without_an_event(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.give_up(claim, "max deliveries", attempted=Attempted(calls=1))
    assert await events(pool) == []


async def test_a_replayed_failure_that_then_succeeds_numbers_its_events_in_order(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.give_up(claim, "max deliveries")
    claim = await ledger.claim(charge(), "w1", stream_seq=2, revive_failed=True)
    await ledger.settle(claim, Settlement("succeeded", charge_id="ch_1"), story=None)
    assert [(e["sequence"], e["type"]) for e in await events(pool)] == [
        (1, "charge.failed"),
        (2, "charge.succeeded"),
    ]


# reconcile's repairs, as reconcile/charges.py writes them
_RECORD = """
UPDATE charge_attempts
   SET status = 'succeeded', gateway_charge_id = $3, gateway_seen_charge_id = $3,
       last_error = NULL, settled_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2
"""
_ADOPT = """
INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
                             customer_id, amount_minor, currency, due_at, status,
                             gateway_charge_id, gateway_seen_charge_id, settled_at)
VALUES ($1::bigint, $2::date, $1::bigint || ':' || $2::date, 'sub_7Q2', 'cus_42', 99000,
        'RUB', now(), 'succeeded', $3, $3, now())
ON CONFLICT DO NOTHING
RETURNING 1
"""


async def test_reconcile_recording_a_lost_answer_writes_its_event(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.give_up(claim, "max deliveries", attempted=Attempted(calls=1))
    await pool.execute(_RECORD, ORDER, PERIOD, "ch_found")
    [event] = await events(pool)
    assert (event["type"], event["gateway_charge_id"]) == ("charge.succeeded", "ch_found")


async def test_reconcile_adopting_a_forgotten_charge_writes_event_one(pool: asyncpg.Pool) -> None:
    assert await pool.fetchval(_ADOPT, ORDER, PERIOD, "ch_found") == 1
    [event] = await events(pool)
    assert (event["sequence"], event["type"]) == (1, "charge.succeeded")


async def test_an_adoption_that_inserts_nothing_writes_nothing(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    """A BEFORE INSERT trigger would have written it: ON CONFLICT decides after those."""
    await ledger.claim(charge(), "w1", stream_seq=1)
    assert await pool.fetchval(_ADOPT, ORDER, PERIOD, "ch_found") is None
    assert await events(pool) == []


async def test_a_refund_and_a_dispute_follow_the_charge_in_sequence(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await settled(ledger, Settlement("succeeded", charge_id="ch_1"))
    await pool.execute(
        "UPDATE charge_attempts SET disputed_at = now(), review_reason = 'dispute opened'"
        " WHERE order_id = $1",
        ORDER,
    )
    await pool.execute(  # a second notice of the same dispute changes nothing
        "UPDATE charge_attempts SET disputed_at = coalesce(disputed_at, now()) WHERE order_id = $1",
        ORDER,
    )
    await pool.execute("UPDATE charge_attempts SET status = 'refunded' WHERE order_id = $1", ORDER)
    assert [(e["sequence"], e["type"], e["gateway_charge_id"]) for e in await events(pool)] == [
        (1, "charge.succeeded", "ch_1"),
        (2, "charge.disputed", "ch_1"),
        (3, "charge.refunded", "ch_1"),
    ]


@pytest.mark.parametrize(
    ("verdict", "expected"),
    [
        ("blocked", [("charge.succeeded", 1, False), ("charge.blocked", 2, True)]),
        ("approved", [("charge.succeeded", 1, False)]),
    ],
)
async def test_a_late_verdict_writes_an_event_only_when_it_blocks(
    ledger: Ledger,
    pool: asyncpg.Pool,
    verdict: Literal["approved", "blocked"],
    expected: list[tuple[str, int, bool]],
) -> None:
    """A late block marks the charge for review; a late approval changes nothing."""
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.settle(
        claim,
        Settlement("succeeded", charge_id="ch_1"),
        story=None,
        attempted=Attempted(calls=1, scoring="deferred", deferred_reason="scoring slow"),
    )
    checks = DeferredChecks(pool, retry_s=60)
    check = DeferredCheck(ORDER, PERIOD, "cus_42", 99000, "RUB")
    await checks.resolve(check, verdict)
    await checks.resolve(check, verdict)  # resolved once only
    assert [(e["type"], e["sequence"], e.get("review", False)) for e in await events(pool)] == (
        expected
    )


async def test_a_change_rolled_back_leaves_no_event(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await ledger.claim(charge(), "w1", stream_seq=1)
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute(
            "UPDATE charge_attempts SET status = 'blocked', lease_owner = NULL,"
            " lease_until = NULL WHERE order_id = $1",
            ORDER,
        )
        await transaction.rollback()
    assert await events(pool) == []
    assert await pool.fetchval("SELECT outcome_seq FROM charge_attempts") == 0


async def test_the_event_carries_the_charges_trace(ledger: Ledger, pool: asyncpg.Pool) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await pool.execute("UPDATE charge_attempts SET traceparent = $1", traceparent)
    await ledger.settle(claim, Settlement("succeeded", charge_id="ch_1"), story=None)
    stored = await pool.fetchval("SELECT traceparent FROM charge_outcomes")
    assert stored == traceparent


async def test_a_role_with_no_grant_on_the_outbox_still_writes_its_events(
    database_url: str, pool: asyncpg.Pool
) -> None:
    """The roles that change the ledger (the webhook receiver's, reconcile's) need no
    privilege on the outbox: the trigger writes it as the schema's owner."""
    await pool.execute(
        "CREATE ROLE outbox_less LOGIN PASSWORD 'x';"
        " GRANT SELECT, INSERT, UPDATE ON charge_attempts TO outbox_less"
    )
    try:
        conn = await asyncpg.connect(database_url, user="outbox_less", password="x")
        try:
            await conn.execute(_ADOPT.replace("RETURNING 1", ""), ORDER, PERIOD, "ch_1")
        finally:
            await conn.close()
        assert len(await events(pool)) == 1
    finally:
        await pool.execute("REVOKE ALL ON charge_attempts FROM outbox_less; DROP ROLE outbox_less")
