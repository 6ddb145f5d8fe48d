"""The keys reconcile looks at again on its next runs (`reconcile_followups`).

The history a run has read is behind the next run's checkpoint, so a key its pages left
unsettled waits here instead, and each run decides it again on a fresh lookup:

| reason      | the key, when it was decided                                      |
|-------------|-------------------------------------------------------------------|
| `failed`    | could not be handled (reported; the run went on)                  |
| `open`      | a charge its `scheduled`/`pending` row does not record yet         |
| `unmatched` | captured charges left for a person: reported on every run         |

A key leaves the queue when a run finds nothing more to do about it, or after the window
(`reconcile_window_s`), as a charge left the old 48 h history. Only a real run writes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal

import asyncpg

from charge_worker.reconcile.candidates import Key

Reason = Literal["failed", "open", "unmatched"]
BATCH = 1000  # keys read at a time

# Looked at least recently first, and only before this run ($4): a run stopped by its
# deadline leaves the keys it did not reach first in line for the next.
_READ = """
SELECT order_id, billing_period, updated_at FROM reconcile_followups
 WHERE (updated_at, order_id, billing_period) > ($1, $2, $3) AND updated_at < $4
   AND found_at >= $5
 ORDER BY updated_at, order_id, billing_period LIMIT $6
"""
_KEEP = """
INSERT INTO reconcile_followups (order_id, billing_period, reason)
SELECT * FROM unnest($1::bigint[], $2::date[], $3::text[])
ON CONFLICT (order_id, billing_period) DO UPDATE SET reason = excluded.reason, updated_at = now()
"""
_DROP = """
DELETE FROM reconcile_followups
 WHERE (order_id, billing_period) IN (SELECT * FROM unnest($1::bigint[], $2::date[]))
"""
_EXPIRE = "DELETE FROM reconcile_followups WHERE found_at < $1"


async def batches(
    conn: asyncpg.Connection, *, since: dt.datetime, before: dt.datetime
) -> AsyncIterator[list[Key]]:
    """Every key queued since `since` and last looked at before `before`, `BATCH` at a
    time, the least recently looked at first."""
    after: tuple[dt.datetime, int, dt.date] = (
        dt.datetime.min.replace(tzinfo=dt.UTC),
        0,
        dt.date.min,
    )
    while rows := await conn.fetch(_READ, *after, before, since, BATCH):
        yield [(r["order_id"], r["billing_period"]) for r in rows]
        last = rows[-1]
        after = (last["updated_at"], last["order_id"], last["billing_period"])


async def keep(conn: asyncpg.Connection, reasons: Mapping[Key, Reason]) -> None:
    """Queue these keys (or say why they stay queued)."""
    if reasons:
        keys = sorted(reasons)
        await conn.execute(
            _KEEP, [k[0] for k in keys], [k[1] for k in keys], [reasons[k] for k in keys]
        )


async def drop(conn: asyncpg.Connection, keys: Sequence[Key]) -> None:
    """These keys need nothing more."""
    if keys:
        await conn.execute(_DROP, [k[0] for k in keys], [k[1] for k in keys])


async def expire(conn: asyncpg.Connection, before: dt.datetime) -> None:
    """Forget keys queued before `before` (the window's start)."""
    await conn.execute(_EXPIRE, before)
