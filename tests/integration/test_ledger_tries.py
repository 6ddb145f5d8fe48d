"""The ledger's one claim per period across its tries, against real PostgreSQL: a message is
claimed only for the period's current try; a declined try leaves the period in the state
its class and number say."""

from __future__ import annotations

import datetime as dt

import asyncpg
import pytest

from charge_worker.errors import AlreadySettled, Unverified
from charge_worker.ledger import Attempted, DeferredChecks, Ledger, Settlement
from charge_worker.messages import ChargeDue
from charge_worker.retries.starts import start_due
from tests.integration.test_ledger import charge, ledger, pool, row

__all__ = ["ledger", "pool"]


def try_of(n: int) -> ChargeDue:
    return charge().model_copy(update={"attempt": n})


async def start_next_try(pool: asyncpg.Pool) -> None:
    """The producer's run, once the next try is due (`now` past its `retry_at`)."""
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
    assert (await start_due(pool, limit=10, cap=8, now=later)).started == 1


async def declined_soft(ledger: Ledger) -> None:
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.settle(
        claim,
        Settlement("retry_scheduled", decline_code="insufficient_funds", retry_in_s=3 * 86400.0),
        story=None,
    )


async def test_a_soft_decline_schedules_the_next_try_at_its_wait(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await declined_soft(ledger)
    settled = await row(pool)
    assert (settled["status"], settled["decline_class"], settled["current_try"]) == (
        "retry_scheduled",
        "soft",
        1,
    )
    assert settled["retry_at"] - settled["settled_at"] == dt.timedelta(days=3)


async def test_a_redelivery_of_the_declined_try_changes_nothing(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await declined_soft(ledger)
    before = await row(pool)
    with pytest.raises(AlreadySettled, match="retry_scheduled"):
        await ledger.claim(charge(), "w2", stream_seq=2)
    assert await row(pool) == before


async def test_a_try_of_a_period_with_no_row_is_never_inserted(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    with pytest.raises(Unverified, match="try 2 of a period with no row"):
        await ledger.claim(try_of(2), "w1", stream_seq=1)
    assert await pool.fetchval("SELECT count(*) FROM charge_attempts") == 0


async def test_a_try_nobody_started_is_refused_and_changes_nothing(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await declined_soft(ledger)
    before = await row(pool)
    with pytest.raises(Unverified, match="try 2 was never started"):
        await ledger.claim(try_of(2), "w2", stream_seq=2)
    assert await row(pool) == before


async def test_the_started_try_is_claimed_and_the_earlier_one_is_over(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await declined_soft(ledger)
    await start_next_try(pool)
    with pytest.raises(AlreadySettled, match="the period is at try 2"):
        await ledger.claim(try_of(1), "w2", stream_seq=2)
    claim = await ledger.claim(try_of(2), "w2", stream_seq=3)
    await ledger.settle(claim, Settlement("succeeded", charge_id="ch_2"), story=None)
    settled = await row(pool)
    assert (settled["status"], settled["current_try"], settled["idempotency_key"]) == (
        "succeeded",
        2,
        "48291:2026-09-01:2",
    )


async def test_a_later_try_charged_without_a_verdict_is_checked_after_all(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    """Try 1 went out without a verdict and was declined; its check was resolved since.
    Try 2, charged without a verdict too, gets a check of its own."""
    unscored = Attempted(calls=1, scoring="deferred", deferred_reason="scoring timed out")
    claim = await ledger.claim(charge(), "w1", stream_seq=1)
    await ledger.settle(
        claim,
        Settlement("retry_scheduled", decline_code="insufficient_funds", retry_in_s=60.0),
        story=None,
        attempted=unscored,
    )
    checks = DeferredChecks(pool, retry_s=60)
    [check] = await checks.take(10)
    await checks.resolve(check, "approved")
    await start_next_try(pool)
    claim = await ledger.claim(try_of(2), "w2", stream_seq=2)
    await ledger.settle(
        claim, Settlement("succeeded", charge_id="ch_2"), story=None, attempted=unscored
    )
    assert await checks.pending() == 1
