"""Starting a declined period's next try (retries/starts.py), against real PostgreSQL, and
the producer and reconcile publishing it against a real nats-server.

What it must keep: a due try is started once, however many runs start tries at once; the
try before it is archived as it was; the row holds nothing of it; the 30-day cap pushes a
try to when the window allows; `retry_now` refuses every state no try may follow.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.errors import RetryRefused
from charge_worker.messages import idempotency_key, parse
from charge_worker.producer.schedule import produce
from charge_worker.reconcile.run import run_reconcile
from charge_worker.retries.starts import retry_now, start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import (
    CAP_WINDOW_S,
    DbSettings,
    NatsSettings,
    RetrySettings,
    Settings,
)
from tests.support.harness import provisioned, settings_for
from tests.support.producer import stream_messages

PERIOD = dt.date(2026, 12, 1)
DAY_S = 86400.0
CAP = 8
FINAL_WITH_MONEY = ("succeeded", "refunded", "processing")


async def put_try(
    conn: asyncpg.Connection,
    order_id: int,
    status: str = "retry_scheduled",
    *,
    try_no: int = 1,
    retry_in_s: float = -60.0,
    started_ago_s: float = 2 * DAY_S,
    decline_code: str | None = "insufficient_funds",
    decline_class: str | None = "soft",
    disputed: bool = False,
    review_reason: str | None = None,
) -> None:
    """A period's row as a worker leaves its try `try_no`: `retry_scheduled` (due
    `retry_in_s` from now), or any other status, with everything a try writes filled in."""
    money = status in FINAL_WITH_MONEY
    await conn.execute(
        """
        INSERT INTO charge_attempts (
            order_id, billing_period, idempotency_key, subscription_id, customer_id,
            amount_minor, currency, due_at, status, scoring, gateway_charge_id, gateway_calls,
            last_error, decline_code, decline_class, attempt, created_at, updated_at,
            published_at, published_seq, last_stream_seq, settled_at, current_try,
            try_started_at, retry_at, disputed_at, review_reason)
        VALUES ($1, $2, $3, $4, 'cus_ok', 99000, 'RUB', $5, $6, 'approved', $7, 1,
                $8, $9, $10, 1, now() - make_interval(secs => $11),
                now() - make_interval(secs => $11 / 2),
                now() - make_interval(secs => $11), 41, 41,
                CASE WHEN $6 NOT IN ('scheduled', 'pending', 'processing')
                     THEN now() - make_interval(secs => $11 / 2) END,
                $12, CASE WHEN $12 > 1 THEN now() - make_interval(secs => $11) END,
                CASE WHEN $6 = 'retry_scheduled' THEN now() + make_interval(secs => $13) END,
                CASE WHEN $14 THEN now() END, $15)
        """,
        order_id,
        PERIOD,
        idempotency_key(order_id, PERIOD, try_no),
        f"sub_{order_id}",
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        status,
        f"ch_{order_id}_{try_no}",
        None if money else "declined: insufficient_funds",
        None if money else decline_code,
        None if money else decline_class,
        started_ago_s,
        try_no,
        retry_in_s,
        disputed,
        review_reason,
    )


async def put_earlier(
    conn: asyncpg.Connection, order_id: int, try_no: int, started_ago_s: float
) -> None:
    """An archived try of the period, declined, started `started_ago_s` ago."""
    await conn.execute(
        """
        INSERT INTO charge_tries (order_id, billing_period, try_no, idempotency_key,
                                  gateway_charge_id, decline_code, decline_class, started_at,
                                  ended_at)
        VALUES ($1, $2, $3, $4, $5, 'insufficient_funds', 'soft',
                now() - make_interval(secs => $6), now() - make_interval(secs => $6))
        """,
        order_id,
        PERIOD,
        try_no,
        idempotency_key(order_id, PERIOD, try_no),
        f"ch_{order_id}_{try_no}",
        started_ago_s,
    )


async def row(conn: asyncpg.Connection, order_id: int) -> dict[str, Any]:
    found = await conn.fetchrow(
        "SELECT * FROM charge_attempts WHERE order_id = $1 AND billing_period = $2",
        order_id,
        PERIOD,
    )
    assert found is not None
    return dict(found)


async def tries(conn: asyncpg.Connection, order_id: int) -> list[dict[str, Any]]:
    found = await conn.fetch(
        "SELECT * FROM charge_tries WHERE order_id = $1 ORDER BY try_no", order_id
    )
    return [dict(r) for r in found]


async def event_types(conn: asyncpg.Connection, order_id: int) -> list[str]:
    found = await conn.fetch(
        "SELECT type FROM charge_outcomes WHERE order_id = $1 ORDER BY sequence", order_id
    )
    return [r["type"] for r in found]


async def test_a_due_try_is_started_the_one_before_archived_and_no_event_written(
    conn: asyncpg.Connection,
) -> None:
    await put_try(conn, 1)
    before = await row(conn, 1)
    events_before = await event_types(conn, 1)

    starts = await start_due(conn, limit=10, cap=CAP)

    after = await row(conn, 1)
    assert (starts.started, starts.postponed) == (1, 0)
    assert after["status"] == "scheduled"
    assert after["current_try"] == 2
    assert after["idempotency_key"] == "1:2026-12-01:2"
    assert after["try_started_at"] is not None
    assert after["try_started_at"] > before["created_at"]
    for cleared in (
        "retry_at",
        "gateway_charge_id",
        "decline_code",
        "decline_class",
        "last_error",
        "settled_at",
        "scoring",
        "published_at",
        "published_seq",
        "last_stream_seq",
        "lease_owner",
        "lease_until",
    ):
        assert after[cleared] is None, cleared
    assert after["gateway_calls"] == 0
    # what the period keeps: its money, its trace, its fence and its event count
    for kept in ("amount_minor", "currency", "customer_id", "attempt", "outcome_seq", "due_at"):
        assert after[kept] == before[kept], kept
    [archived] = await tries(conn, 1)
    assert archived == {
        "order_id": 1,
        "billing_period": PERIOD,
        "try_no": 1,
        "idempotency_key": "1:2026-12-01",
        "gateway_charge_id": "ch_1_1",
        "decline_code": "insufficient_funds",
        "decline_class": "soft",
        "last_error": "declined: insufficient_funds",
        "started_at": before["created_at"],
        "ended_at": before["settled_at"],
    }
    # `scheduled` is no outcome: the period's next event is what try 2 comes to
    assert await event_types(conn, 1) == events_before == ["charge.retry_scheduled"]


async def test_a_later_try_is_archived_with_its_own_key_and_start(
    conn: asyncpg.Connection,
) -> None:
    await put_try(conn, 2, try_no=2, started_ago_s=4 * DAY_S)
    await put_earlier(conn, 2, 1, started_ago_s=5 * DAY_S)
    before = await row(conn, 2)

    assert (await start_due(conn, limit=10, cap=CAP)).started == 1

    after = await row(conn, 2)
    assert (after["current_try"], after["idempotency_key"]) == (3, "2:2026-12-01:3")
    earlier = await tries(conn, 2)
    assert [(t["try_no"], t["idempotency_key"]) for t in earlier] == [
        (1, "2:2026-12-01"),
        (2, "2:2026-12-01:2"),
    ]
    assert earlier[1]["started_at"] == before["try_started_at"]


async def test_rows_not_due_and_other_states_are_left_alone(conn: asyncpg.Connection) -> None:
    await put_try(conn, 3, retry_in_s=3600.0)
    await put_try(conn, 4, "action_required", decline_code="authentication_required")
    await put_try(conn, 5, "declined")
    await put_try(conn, 6, "scheduled")
    before = {n: await row(conn, n) for n in (3, 4, 5, 6)}

    starts = await start_due(conn, limit=10, cap=CAP)

    assert (starts.started, starts.postponed) == (0, 0)
    assert {n: await row(conn, n) for n in (3, 4, 5, 6)} == before
    assert await conn.fetchval("SELECT count(*) FROM charge_tries") == 0


async def test_two_runs_at_once_start_each_due_try_once(database_url: str) -> None:
    setup = await asyncpg.connect(database_url)
    try:
        for n in range(1, 41):
            await put_try(setup, n)
    finally:
        await setup.close()
    pool = await asyncpg.create_pool(database_url, min_size=2, max_size=2)
    assert pool is not None

    async def run() -> int:
        """One producer's step: batches of 3 until a batch comes back short."""
        total = 0
        while True:
            starts = await start_due(pool, limit=3, cap=CAP)
            total += starts.started
            if starts.rows < 3:
                return total

    try:
        counts = await asyncio.gather(run(), run())
        rows = await pool.fetch("SELECT status, current_try FROM charge_attempts")
        archived = await pool.fetchval("SELECT count(*) FROM charge_tries")
    finally:
        await pool.close()
    assert sum(counts) == 40
    assert {(r["status"], r["current_try"]) for r in rows} == {("scheduled", 2)}
    assert archived == 40


async def test_a_row_another_run_holds_is_skipped_not_waited_for(
    conn: asyncpg.Connection, database_url: str
) -> None:
    await put_try(conn, 7)
    await put_try(conn, 8)
    other = await asyncpg.connect(database_url)
    try:
        async with other.transaction():
            await other.execute("SELECT 1 FROM charge_attempts WHERE order_id = 7 FOR UPDATE")
            while_held = await start_due(conn, limit=10, cap=CAP)
            held = await row(conn, 7)
        after = await start_due(conn, limit=10, cap=CAP)
    finally:
        await other.close()
    assert while_held.started == 1
    assert held["status"] == "retry_scheduled"
    assert after.started == 1
    assert (await row(conn, 7))["current_try"] == 2


async def test_the_cap_postpones_a_try_to_when_the_window_allows(
    conn: asyncpg.Connection,
) -> None:
    # tries 1 (40 days ago: outside the window), 2 (20 days ago), 3 (now's row, 10 days ago)
    await put_try(conn, 9, try_no=3, started_ago_s=10 * DAY_S)
    await put_earlier(conn, 9, 1, started_ago_s=40 * DAY_S)
    await put_earlier(conn, 9, 2, started_ago_s=20 * DAY_S)
    oldest_counted = await conn.fetchval(
        "SELECT started_at FROM charge_tries WHERE order_id = 9 AND try_no = 2"
    )

    capped = await start_due(conn, limit=10, cap=2)

    after = await row(conn, 9)
    assert (capped.started, capped.postponed) == (0, 1)
    assert (after["status"], after["current_try"]) == ("retry_scheduled", 3)
    assert after["retry_at"] == oldest_counted + dt.timedelta(seconds=CAP_WINDOW_S)
    assert len(await tries(conn, 9)) == 2
    assert await event_types(conn, 9) == ["charge.retry_scheduled"]  # no event for a push

    # when the window allows, it starts (try 2 has left the window; 3 is the only one in it)
    allowed = await start_due(conn, limit=10, cap=2, now=after["retry_at"])
    assert (allowed.started, allowed.postponed) == (1, 0)
    assert (await row(conn, 9))["current_try"] == 4

    # one try fewer counted: the same row would have started at once with a cap of 3
    await put_try(conn, 10, try_no=3, started_ago_s=10 * DAY_S)
    await put_earlier(conn, 10, 2, started_ago_s=20 * DAY_S)
    assert (await start_due(conn, limit=10, cap=3)).started == 1


# retry_now: `charge-worker retry`


@pytest.mark.parametrize(
    ("status", "decline_class"),
    [("retry_scheduled", "soft"), ("action_required", "customer_action"), ("declined", "soft")],
)
async def test_retry_now_starts_the_next_try_at_once(
    conn: asyncpg.Connection, status: str, decline_class: str
) -> None:
    await put_try(conn, 11, status, retry_in_s=5 * DAY_S, decline_class=decline_class)
    events_before = await event_types(conn, 11)

    started = await retry_now(conn, 11, PERIOD, CAP)

    after = await row(conn, 11)
    assert (started.try_no, started.was) == (2, status)
    assert started.charge.key == "11:2026-12-01:2"
    assert started.charge.msg_id == "charge:11:2026-12-01:2"
    assert started.charge.attempt == 2
    assert (after["status"], after["current_try"], after["retry_at"]) == ("scheduled", 2, None)
    assert after["idempotency_key"] == "11:2026-12-01:2"
    [archived] = await tries(conn, 11)
    assert (archived["try_no"], archived["decline_class"]) == (1, decline_class)
    # a period waiting or final hears that a try is coming; one already waiting, nothing new
    added = (await event_types(conn, 11))[len(events_before) :]
    assert added == ([] if status == "retry_scheduled" else ["charge.retry_scheduled"])


@pytest.mark.parametrize(
    ("status", "extra", "says"),
    [
        ("succeeded", {}, "holds money (succeeded)"),
        ("refunded", {}, "holds money (refunded)"),
        ("processing", {}, "holds money (processing)"),
        ("succeeded", {"disputed": True}, "holds money (succeeded, disputed)"),
        (
            "declined",
            {"decline_code": "stolen_card", "decline_class": "hard"},
            "is final by a hard decline (stolen_card)",
        ),
        ("scheduled", {}, "has a try in flight (try 1 is scheduled)"),
        ("pending", {}, "has a try in flight (try 1 is pending)"),
        ("blocked", {"review_reason": "velocity"}, "is blocked by scoring (velocity)"),
        ("failed", {}, "is failed, nothing charged: replay its dead letter (`charge-worker dlq"),
    ],
)
async def test_retry_now_refuses_what_no_try_may_follow(
    conn: asyncpg.Connection, status: str, extra: dict[str, Any], says: str
) -> None:
    await put_try(conn, 12, status, **extra)
    before = await row(conn, 12)

    with pytest.raises(RetryRefused) as refused:
        await retry_now(conn, 12, PERIOD, CAP)

    message = str(refused.value)
    assert message.startswith(f"12:2026-12-01 {says}"), message
    assert "\n" not in message
    assert await row(conn, 12) == before
    assert await tries(conn, 12) == []


async def test_retry_now_refuses_a_period_it_does_not_know(conn: asyncpg.Connection) -> None:
    with pytest.raises(RetryRefused, match=r"^no charge 13:2026-12-01 in the ledger"):
        await retry_now(conn, 13, PERIOD, CAP)


async def test_retry_now_refuses_past_the_cap_saying_when_the_next_try_is_allowed(
    conn: asyncpg.Connection,
) -> None:
    await put_try(conn, 14, "action_required", try_no=2, started_ago_s=DAY_S)
    await put_earlier(conn, 14, 1, started_ago_s=3 * DAY_S)
    first = await conn.fetchval("SELECT started_at FROM charge_tries WHERE order_id = 14")
    before = await row(conn, 14)

    with pytest.raises(RetryRefused) as refused:
        await retry_now(conn, 14, PERIOD, 2)

    allowed = (first + dt.timedelta(seconds=CAP_WINDOW_S)).astimezone(dt.UTC)
    assert str(refused.value) == (
        "14:2026-12-01 has started 2 tries in the last 30 days, the cap"
        " (CHARGE_WORKER_RETRY_CAP_30D=2): the next try is allowed from "
        + allowed.isoformat(timespec="seconds")
    )
    assert await row(conn, 14) == before


# the started try's message: the producer's run, and reconcile's re-publish


async def test_the_producer_starts_due_tries_and_publishes_them_as_their_try(
    nc: Client, nats_settings: NatsSettings, database_url: str, conn: asyncpg.Connection
) -> None:
    await put_try(conn, 15, try_no=2)
    await put_try(conn, 16, retry_in_s=DAY_S)  # not due
    await put_try(conn, 17, try_no=2, started_ago_s=DAY_S)  # capped at 2
    await put_earlier(conn, 17, 1, started_ago_s=DAY_S)
    retries = RetrySettings(retry_schedule=(DAY_S,), retry_cap_30d=2)
    settings = Settings(nats=nats_settings, db=DbSettings(url=database_url), retries=retries)

    summary = await produce(settings, PERIOD)

    assert (summary.tries_started, summary.tries_postponed, summary.published) == (1, 1, 1)
    assert summary.exit_code == 0
    messages = await stream_messages(nc.jetstream(), nats_settings.stream)
    assert list(messages) == ["charge:15:2026-12-01:3"]
    body = messages["charge:15:2026-12-01:3"]
    assert json.loads(body)["attempt"] == 3
    assert parse(body).key == "15:2026-12-01:3"
    after = await row(conn, 15)
    assert (after["status"], after["current_try"]) == ("scheduled", 3)
    assert after["published_at"] is not None
    assert after["published_seq"] == 1
    lines = "\n".join(summary.lines())
    assert re.search(r"\n  next tries started +1\n  tries postponed by the cap +1\n", lines)


async def test_reconcile_republishes_a_lost_try_as_that_try(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    await put_try(conn, 18)
    await start_due(conn, limit=10, cap=CAP)
    # its publish was lost: the row is quiet and no message waits for it
    await conn.execute("UPDATE charge_attempts SET updated_at = now() - interval '1 day'")

    await run_reconcile(settings)

    [body] = (await stream_messages(js, nats_settings.stream)).values()
    assert parse(body).attempt == 2
    assert parse(body).key == "18:2026-12-01:2"
