"""The producer's batch statements keep sane plans on a ledger as a month start finds it.

In production the ledger holds the months before, published and settled, and the planner's
statistics say so: hardly any row is unpublished. A statement whose plan trusts that
estimate while the new month's rows arrive can do work that grows with the product of the
batch and the table. PostgreSQL plans a prepared statement's first five executions for
their values, then may keep one generic plan; each statement here runs past that point, and
every execution must cost at most a few passes over what the tables hold (the rows each
plan node produced, times its loops, from `EXPLAIN ANALYZE`), whichever plan it got.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from asyncpg import Connection
from benchmarks.month_start import PERIOD, prepare

from charge_worker.producer.publish import _MARKED
from charge_worker.producer.schedule import _ADVANCE, _EXISTING, schedule
from charge_worker.producer.summary import Summary
from tests.support.producer import connected

HISTORY = 20_000  # due subscriptions, and their previous month settled and published
ARRIVING = 5_000  # this month's rows, scheduled and not published yet
WINDOW = 1_000  # keys per statement, as the producer sends them
EXECUTIONS = 8  # past PostgreSQL's five custom plans
DAY = dt.date.fromisoformat(PERIOD)  # the day the benchmark's subscriptions fall due


def _rows_processed(node: dict[str, Any]) -> int:
    own = int(node["Actual Rows"]) * int(node["Actual Loops"])
    return own + sum(_rows_processed(child) for child in node.get("Plans", []))


async def _month_start_ledger(database_url: str) -> None:
    """The benchmark's month start (last month settled and published, statistics taken),
    and this month's first rows scheduled, not published yet."""
    await prepare(database_url, HISTORY)
    async with connected(database_url) as conn:
        await conn.execute(
            """INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,
                   subscription_id, customer_id, amount_minor, currency, status)
               SELECT n, $2::date, n || ':' || $2::date, 'sub_' || n, 'cus_' || n, 990, 'RUB',
                      'scheduled'
                 FROM generate_series(1, $1::int) AS n""",
            ARRIVING,
            DAY,
        )


_KEYS = (list(range(1, WINDOW + 1)), [DAY] * WINDOW)
_SUBSCRIPTIONS = [f"sub_{n}" for n in range(1, WINDOW + 1)]
_STATEMENTS = {
    "mark published": (_MARKED, (*_KEYS, list(range(1, WINDOW + 1)), [None] * WINDOW)),
    "look up existing": (_EXISTING, _KEYS),
    "advance subscriptions": (
        _ADVANCE,
        (
            _SUBSCRIPTIONS,
            [DAY] * WINDOW,
            [dt.date(DAY.year + 1, 1, 1)] * WINDOW,
            min(_SUBSCRIPTIONS),  # the batch's first and last, in the database's order
            max(_SUBSCRIPTIONS),
        ),
    ),
}


@pytest.mark.parametrize("name", _STATEMENTS)
async def test_a_window_costs_a_few_passes_over_the_tables_whatever_plan_is_cached(
    database_url: str, name: str
) -> None:
    statement, args = _STATEMENTS[name]
    await _month_start_ledger(database_url)
    async with connected(database_url) as conn:
        explain = await conn.prepare(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}")
        processed = []
        for _ in range(EXECUTIONS):
            transaction = conn.transaction()
            await transaction.start()
            (plan,) = json.loads(await explain.fetchval(*args))
            await transaction.rollback()
            processed.append(_rows_processed(plan["Plan"]))

    assert max(processed) <= 4 * (HISTORY + ARRIVING + WINDOW), processed


async def _rows_read_in_sequence(conn: Connection, table: str) -> int:
    """What sequential scans of `table` have read, this session's own reads included."""
    await conn.fetchval("SELECT pg_stat_force_next_flush()")  # flushed before it answers
    await conn.fetchval("SELECT pg_stat_clear_snapshot()")
    return int(
        await conn.fetchval(
            "SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = $1", table
        )
    )


async def test_each_batch_reads_its_own_subscriptions_not_the_table(database_url: str) -> None:
    """Each batch moves its subscriptions on by joining its keys to `subscriptions`. For a
    batch of thousands, a hash join over the whole table looked cheaper to the planner than
    a lookup per key (up to some 700,000 subscriptions at the default costs): every batch
    read the table, and a run over N subscriptions read N * N / batch rows."""
    await prepare(database_url, HISTORY)
    async with connected(database_url) as conn:
        before = await _rows_read_in_sequence(conn, "subscriptions")
        summary = Summary(DAY)
        await schedule(conn, DAY, summary, batch_size=WINDOW)
        read = await _rows_read_in_sequence(conn, "subscriptions") - before

    assert summary.scheduled == HISTORY
    assert read <= HISTORY, f"{read} rows read for {HISTORY} subscriptions"
