"""How far the gateway's history has been reconciled, and which history a run reads.

| run                        | reads the history created in                 | then stores   |
|----------------------------|----------------------------------------------|---------------|
| the first (no checkpoint)  | the window: `reconcile_window_s` until now   | now           |
| the next ones              | checkpoint - `reconcile_overlap_s` until now | now           |
|                            | (never further back than the window)         |               |
| `--full` (the daily sweep) | the window                                   | now           |
| `--since T`                | T until now                                  | now, if T is  |
|                            |                                              | no later than |
|                            |                                              | the above     |
| `--dry-run`                | as the run it stands for                     | nothing       |

The overlap covers the gateway's clock skew and listing lag: a charge the gateway lists
late, or stamps early, is read by the next run. The checkpoint lives in the ledger's own
database and is written after every read and repair it vouches for, so a failover that
loses a ledger commit loses the checkpoints written after it too: that history is read
again. Every moment of it is the database's clock (`now`), the one `updated_at` and
`settled_at` are written by, never the pod's: a pod whose clock runs ahead would store a
checkpoint beyond the history read, and the next run would skip what was created between.
`plan` is pure; `now`, `read` and `store` are the table's three statements.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Literal

import asyncpg

Mode = Literal["window", "incremental", "full", "since"]
SOURCE = "gateway"

_READ = "SELECT reconciled_until FROM reconcile_checkpoint WHERE source = $1"
# Never beyond the database's clock: a reading from ahead would skip the history between.
_STORE = """
INSERT INTO reconcile_checkpoint (source, reconciled_until) VALUES ($1, least($2, now()))
ON CONFLICT (source) DO UPDATE SET reconciled_until = least($2, now()), updated_at = now()
"""


@dataclass(frozen=True)
class Plan:
    """The history one run reads (created in [since, until]) and whether a real run of it
    stores `until` as the checkpoint. `defer_from`: a worker's charge made since then is
    read again by the next run (None: nothing is read twice); `settled_from`: how far
    back `succeeded` rows are checked against the gateway; `previous`: the checkpoint
    stored before it."""

    mode: Mode
    since: dt.datetime
    until: dt.datetime
    stores: bool
    defer_from: dt.datetime | None = field(default=None, compare=False)
    settled_from: dt.datetime | None = field(default=None, compare=False)
    previous: dt.datetime | None = field(default=None, compare=False)


def plan(
    started: dt.datetime,
    *,
    checkpoint: dt.datetime | None,
    since: dt.datetime | None,
    full: bool,
    window_s: float,
    overlap_s: float,
) -> Plan:
    """The run's history, from the stored checkpoint and the command line."""
    window = started - dt.timedelta(seconds=window_s)
    overlap = dt.timedelta(seconds=overlap_s)
    usual = window if checkpoint is None else max(checkpoint - overlap, window)
    mode: Mode = "window" if checkpoint is None else "incremental"
    start = usual
    if since is not None:
        mode, start = "since", since
    elif full:
        mode, start = "full", window
    return Plan(
        mode,
        start,
        started,
        stores=start <= usual,
        defer_from=started - overlap if overlap_s > 0 else None,
        settled_from=min(start, window),
        previous=checkpoint,
    )


async def now(conn: asyncpg.Connection) -> dt.datetime:
    """The database's clock: the moment a run starts at, and reads the history until."""
    value: dt.datetime = await conn.fetchval("SELECT now()")
    return value


async def read(conn: asyncpg.Connection) -> dt.datetime | None:
    """The stored checkpoint, or None before the first real run."""
    value: dt.datetime | None = await conn.fetchval(_READ, SOURCE)
    return value


async def store(conn: asyncpg.Connection, until: dt.datetime) -> None:
    """Record that the history created until `until` is reconciled (at most until the
    database's clock now: a reading from a clock ahead of it is no proof)."""
    await conn.execute(_STORE, SOURCE, until)
