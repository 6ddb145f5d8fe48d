"""The ledger against real PostgreSQL: atomic claims, leases, fences, guarded transitions."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import asyncpg
import pytest

from charge_worker.errors import AlreadySettled, LeaseHeld, PayloadConflict
from charge_worker.ledger import Attempted, Ledger, Settlement
from charge_worker.messages import ChargeDue

PERIOD = dt.date(2026, 9, 1)


def charge(order_id: int = 48291, amount: int = 99000, customer: str = "cus_42") -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD,
            "subscription_id": "sub_7Q2",
            "customer_id": customer,
            "amount_minor": amount,
            "currency": "RUB",
            "due_at": dt.datetime(2026, 9, 1, tzinfo=dt.UTC),
        },
        strict=False,
    )


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=12)
    assert pool is not None
    yield pool
    await pool.close()


@pytest.fixture
def ledger(pool: asyncpg.Pool) -> Ledger:
    return Ledger(pool, lease_s=60)


async def row(pool: asyncpg.Pool, order_id: int = 48291) -> asyncpg.Record:
    record = await pool.fetchrow(
        "SELECT * FROM charge_attempts WHERE order_id = $1 AND billing_period = $2",
        order_id,
        PERIOD,
    )
    assert record is not None
    return record


async def expire_leases(pool: asyncpg.Pool) -> None:
    await pool.execute("UPDATE charge_attempts SET lease_until = now() - interval '1 second'")


async def test_first_claim_inserts_a_pending_leased_row(ledger: Ledger, pool: asyncpg.Pool) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=7)
    assert (claim.attempt, claim.gateway_calls, claim.outcome_unknown) == (1, 0, False)
    stored = await row(pool)
    assert stored["status"] == "pending"
    assert stored["lease_owner"] == "w1"
    assert stored["idempotency_key"] == "48291:2026-09-01"
    assert stored["last_stream_seq"] == 7


async def test_a_live_lease_holds_off_a_second_worker(ledger: Ledger) -> None:
    await ledger.claim(charge(), "w1", 1)
    with pytest.raises(LeaseHeld) as held:
        await ledger.claim(charge(), "w2", 2)
    assert held.value.retry_after_s is not None
    assert 0 < held.value.retry_after_s <= 60


async def test_ten_concurrent_claims_one_winner(ledger: Ledger) -> None:
    results = await asyncio.gather(
        *(ledger.claim(charge(), f"w{i}", i) for i in range(10)), return_exceptions=True
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(r, LeaseHeld) for r in results if isinstance(r, BaseException))


async def test_expired_lease_is_taken_over_and_fences_out_the_old_owner(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    old = await ledger.claim(charge(), "w1", 1)
    await expire_leases(pool)
    new = await ledger.claim(charge(), "w2", 2)
    assert new.attempt == old.attempt + 1
    assert new.taken_from == "w1"
    assert old.taken_from is None
    assert not old.outcome_unknown
    assert new.outcome_unknown  # the old owner may have died mid-call: no write says
    with pytest.raises(LeaseHeld):
        await ledger.settle(old, Settlement("succeeded", charge_id="ch_old"), story=None)
    with pytest.raises(LeaseHeld):
        await ledger.retry_later(old, "gateway 503", keep_lease=False)
    await ledger.settle(new, Settlement("succeeded", charge_id="ch_1"), story=None)
    stored = await row(pool)
    assert (stored["status"], stored["gateway_charge_id"], stored["lease_owner"]) == (
        "succeeded",
        "ch_1",
        None,
    )


async def test_a_settle_writes_its_story_only_when_it_holds_the_lease(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    old = await ledger.claim(charge(), "w1", 1)
    await expire_leases(pool)
    new = await ledger.claim(charge(), "w2", 2)
    with pytest.raises(LeaseHeld):
        await ledger.settle(old, Settlement("succeeded", charge_id="ch_old"), story={"by": "w1"})
    await ledger.settle(
        new, Settlement("succeeded", charge_id="ch_1"), story={"by": "w2", "none": None}
    )
    stories = await pool.fetch(
        "SELECT actor, detail FROM charge_events WHERE order_id = $1 AND kind = 'delivery'",
        48291,
    )
    assert [(s["actor"], s["detail"]) for s in stories] == [("w2", '{"by": "w2"}')]


async def test_final_row_makes_a_duplicate_delivery_already_settled(ledger: Ledger) -> None:
    claim = await ledger.claim(charge(), "w1", 1)
    await ledger.settle(claim, Settlement("declined", error="card_declined"), story=None)
    with pytest.raises(AlreadySettled, match="declined"):
        await ledger.claim(charge(), "w2", 2)


@pytest.mark.parametrize(
    "other", [charge(amount=100), charge(customer="cus_other")], ids=["amount", "customer"]
)
async def test_same_key_other_payload_is_a_conflict(ledger: Ledger, other: ChargeDue) -> None:
    await ledger.claim(charge(), "w1", 1)
    with pytest.raises(PayloadConflict, match="99000 RUB cus_42"):
        await ledger.claim(other, "w2", 2)


async def test_scheduled_row_is_claimed_by_a_guarded_update(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await pool.execute(
        "INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,"
        " subscription_id, customer_id, amount_minor, currency, status)"
        " VALUES (48291, $1, '48291:2026-09-01', 'sub_7Q2', 'cus_42', 99000, 'RUB', 'scheduled')",
        PERIOD,
    )
    claim = await ledger.claim(charge(), "w1", 3)
    assert claim.attempt == 1
    assert (await row(pool))["status"] == "pending"


async def test_the_call_its_verdict_and_deferred_check_are_written_with_the_outcome(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    claim = await ledger.claim(charge(), "w1", 1)
    assert claim.outlives(ledger.clock(), 10.0)
    assert not claim.outlives(ledger.clock(), ledger.lease_s)  # no room for the margin
    deferred = Attempted(1, "deferred", "scoring timeout")
    await ledger.settle(
        claim, Settlement("succeeded", charge_id="ch_1"), story={"x": 1}, attempted=deferred
    )
    checks = await pool.fetch("SELECT status, reason FROM deferred_scoring_checks")
    assert [(c["status"], c["reason"]) for c in checks] == [("pending", "scoring timeout")]
    stored = await row(pool)
    assert (stored["gateway_calls"], stored["scoring"]) == (1, "deferred")
    story = await pool.fetch("SELECT kind, actor FROM charge_events")
    assert [(e["kind"], e["actor"]) for e in story] == [("delivery", "w1")]


async def test_a_fenced_out_write_keeps_neither_call_nor_verdict(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    old = await ledger.claim(charge(), "w1", 1)
    await expire_leases(pool)
    await ledger.claim(charge(), "w2", 2)
    with pytest.raises(LeaseHeld):
        await ledger.retry_later(
            old, "lost", keep_lease=True, attempted=Attempted(1, "deferred", "scoring timeout")
        )
    stored = await row(pool)
    assert (stored["gateway_calls"], stored["scoring"]) == (0, None)
    assert await pool.fetchval("SELECT count(*) FROM deferred_scoring_checks") == 0


async def test_retry_later_keeps_or_releases_the_lease(ledger: Ledger, pool: asyncpg.Pool) -> None:
    claim = await ledger.claim(charge(), "w1", 1)
    await ledger.retry_later(claim, "gateway 503", keep_lease=True)
    assert (await row(pool))["lease_owner"] == "w1"
    await ledger.retry_later(claim, "scoring down", keep_lease=False)
    stored = await row(pool)
    assert (stored["lease_owner"], stored["last_error"], stored["status"]) == (
        None,
        "scoring down",
        "pending",
    )
    again = await ledger.claim(charge(), "w2", 2)  # released: taken at once
    assert again.attempt == 2


async def test_give_up_fails_only_rows_never_sent(ledger: Ledger, pool: asyncpg.Pool) -> None:
    never_sent = await ledger.claim(charge(order_id=1), "w1", 1)
    await ledger.give_up(never_sent, "max deliveries")
    assert (await row(pool, 1))["status"] == "failed"
    sent = await ledger.claim(charge(order_id=2), "w1", 2)
    await ledger.give_up(sent, "max deliveries", attempted=Attempted(calls=1))
    assert (await row(pool, 2))["status"] == "pending"  # the outcome may be unknown
    called_before = await ledger.claim(charge(order_id=2), "w2", 3)
    await ledger.give_up(called_before, "max deliveries")
    assert (await row(pool, 2))["status"] == "pending"


async def test_only_a_replay_revives_a_failed_row_that_never_reached_the_gateway(
    ledger: Ledger,
) -> None:
    crashed = await ledger.claim(charge(order_id=1), "w1", 1)
    await ledger.give_up(crashed, "max deliveries")  # failed, gateway never called
    with pytest.raises(AlreadySettled):
        await ledger.claim(charge(order_id=1), "w2", 2)
    revived = await ledger.claim(charge(order_id=1), "w2", 3, revive_failed=True)
    assert revived.attempt == crashed.attempt + 1
    assert not revived.outcome_unknown  # nothing was sent: charge at once


async def test_a_replay_revives_a_failed_row_that_called_the_gateway_to_look_up_first(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    """A row failed by a gateway answer that charged nothing (a 404 from a wrong path, taken
    for a rejection): only a replay brings it back, and its claim says an earlier call has
    no known outcome, so the worker looks the key up before any new call."""
    rejected = await ledger.claim(charge(order_id=2), "w1", 4)
    await ledger.settle(
        rejected,
        Settlement("failed", error="gateway 404"),
        story=None,
        attempted=Attempted(calls=1),
    )
    with pytest.raises(AlreadySettled):
        await ledger.claim(charge(order_id=2), "w2", 5)

    revived = await ledger.claim(charge(order_id=2), "w2", 6, revive_failed=True)

    assert (revived.attempt, revived.gateway_calls) == (rejected.attempt + 1, 1)
    assert revived.outcome_unknown
    assert ((await row(pool, 2))["status"], (await row(pool, 2))["lease_owner"]) == (
        "pending",
        "w2",
    )
    with pytest.raises(PayloadConflict):  # a replay is still the same charge or none
        await ledger.claim(charge(order_id=2, amount=1), "w3", 7, revive_failed=True)
