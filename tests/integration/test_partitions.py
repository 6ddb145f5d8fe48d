"""charge_events by month: partitions made ahead, old ones dropped, writes never homeless."""

from __future__ import annotations

import datetime as dt

import asyncpg

from charge_worker import partitions

NOW = dt.datetime(2031, 5, 17, 9, 30, tzinfo=dt.UTC)  # past the migration's twelve months


async def test_the_migration_leaves_every_month_of_the_next_year_covered(
    conn: asyncpg.Connection,
) -> None:
    present = await partitions.existing(conn)
    now = dt.datetime.now(dt.UTC)
    assert partitions.missing_months(present, now, 11) == []
    await conn.execute(  # a year from now still has a home
        "INSERT INTO charge_events (order_id, billing_period, kind, actor, at)"
        " VALUES (1, '2026-12-01', 'scheduled', 'tests', now() + interval '330 days')"
    )


async def test_months_ahead_are_made_and_months_past_the_retention_dropped(
    conn: asyncpg.Connection,
) -> None:
    for month in partitions.missing_months(await partitions.existing(conn), NOW, 2):
        await partitions.create(conn, month)
    present = await partitions.existing(conn)
    assert partitions.missing_months(present, NOW, 2) == []
    names = {p.name for p in present}
    assert {"charge_events_2031_05", "charge_events_2031_07", "charge_events_before"} <= names

    cutoff = partitions.month_start(NOW, -13)
    for partition in partitions.expired(present, cutoff):
        await partitions.drop(conn, partition)
    left = {p.name for p in await partitions.existing(conn)}
    assert "charge_events_before" not in left  # everything in it is years older
    assert "charge_events_2031_05" in left
    assert all(p.until > cutoff for p in await partitions.existing(conn))


def test_month_start_counts_months_across_years() -> None:
    assert partitions.month_start(NOW, 8) == dt.datetime(2032, 1, 1, tzinfo=dt.UTC)
    assert partitions.month_start(NOW, -5) == dt.datetime(2030, 12, 1, tzinfo=dt.UTC)
