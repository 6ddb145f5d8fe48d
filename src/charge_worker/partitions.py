"""`charge_events`' monthly partitions: made ahead of time, dropped past the retention.

The story of every charge is append-only and grows by ~1.5 KB per charge; it is kept by
month (migrations/0008), so that a month past the retention is one `DROP TABLE`, not
millions of deletes. Partitions are named `charge_events_YYYY_MM` and cover that month in
UTC; `charge_events_before` holds every event written before partitioning began. Making
and dropping tables needs the schema owner: `charge-worker maintain` runs as it, daily.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

import asyncpg

from charge_worker.database import translated

PARENT = "charge_events"
BEFORE = "charge_events_before"
_MONTHLY = re.compile(r"charge_events_(\d{4})_(\d{2})")
_UPPER = re.compile(r"TO \('([^']+)'\)")

_LIST = """
SELECT c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound
  FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'charge_events'::regclass
 ORDER BY c.relname
"""


@dataclass(frozen=True)
class Partition:
    """One partition and the first moment it does not cover."""

    name: str
    until: dt.datetime


def month_start(moment: dt.datetime, months_after: int = 0) -> dt.datetime:
    """The first instant (UTC) of the month `months_after` the one `moment` is in."""
    index = moment.astimezone(dt.UTC).year * 12 + moment.astimezone(dt.UTC).month - 1
    year, month = divmod(index + months_after, 12)
    return dt.datetime(year, month + 1, 1, tzinfo=dt.UTC)


async def existing(conn: asyncpg.Connection) -> list[Partition]:
    """The partitions there are now."""
    async with translated("partitions"):
        rows = await conn.fetch(_LIST)
    found = []
    for row in rows:
        if match := _MONTHLY.fullmatch(row["name"]):
            start = dt.datetime(int(match[1]), int(match[2]), 1, tzinfo=dt.UTC)
            found.append(Partition(row["name"], month_start(start, 1)))
        elif upper := _UPPER.search(row["bound"] or ""):
            until = dt.datetime.fromisoformat(upper[1]).astimezone(dt.UTC)
            found.append(Partition(row["name"], until))
    return found


def missing_months(
    partitions: list[Partition], now: dt.datetime, months_ahead: int
) -> list[dt.datetime]:
    """The months from this one to `months_ahead` ahead that no partition covers yet."""
    covered_until = max((p.until for p in partitions if p.name == BEFORE), default=None)
    have = {p.name for p in partitions}
    wanted = (month_start(now, n) for n in range(months_ahead + 1))
    return [
        month
        for month in wanted
        if _name(month) not in have and (covered_until is None or month >= covered_until)
    ]


def expired(partitions: list[Partition], cutoff: dt.datetime) -> list[Partition]:
    """The partitions whose every event is older than `cutoff`."""
    return [p for p in partitions if p.until <= cutoff]


async def create(conn: asyncpg.Connection, month: dt.datetime) -> str:
    name = _name(month)
    sql = (
        f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {PARENT}"
        f" FOR VALUES FROM ('{month.isoformat()}') TO ('{month_start(month, 1).isoformat()}')"
    )
    async with translated("partitions"):
        await conn.execute(sql)
    return name


async def drop(conn: asyncpg.Connection, partition: Partition) -> None:
    async with translated("partitions"):
        await conn.execute(f"DROP TABLE IF EXISTS {partition.name}")


def _name(month: dt.datetime) -> str:
    return f"charge_events_{month:%Y_%m}"
