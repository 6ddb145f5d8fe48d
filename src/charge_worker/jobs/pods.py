"""`worker_pods`: each worker pod's own state, as it last wrote it, for `status` to read.

A circuit breaker lives in one worker process's memory. Every `charge-worker run` process
writes its row (`record`, from the side task in worker/presence.py): its breakers' states
and since when, its messages in flight, whether it saw the consumer paused; `seen_at` is
the database's now() of the write, so ages never depend on a pod's clock. A process
writes every `TICK_S`, so a row not written for `SEEN_WITHIN_S` (four ticks) belongs to a
pod gone (stopped, replaced) or stuck (its loop or its database connection): `recent`
shows the others and counts those. `maintain` deletes the rows not seen for `RETENTION`
(`prune`): pods come and go, and each process is a row of its own.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from charge_worker.breaker import State
from charge_worker.database import translated

Db: TypeAlias = "asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy[asyncpg.Record]"

TICK_S = 30.0
SEEN_WITHIN_S = 4 * TICK_S  # 2 minutes: a pod that missed four writes in a row is not shown
RETENTION = dt.timedelta(days=1)

# started_at stays the first write's: a later write only says the process is still there
_RECORD = """
INSERT INTO worker_pods (worker, started_at, breakers, in_flight, paused)
VALUES ($1, $2, $3::jsonb, $4, $5)
ON CONFLICT (worker) DO UPDATE
   SET seen_at = now(), breakers = excluded.breakers, in_flight = excluded.in_flight,
       paused = excluded.paused
"""

# every row (a day of pods at most), its age on the database's clock
_READ = """
SELECT worker, started_at, seen_at, breakers, in_flight, paused,
       extract(epoch FROM now() - seen_at)::float8 AS seen_s_ago
  FROM worker_pods ORDER BY worker
"""

# the rows not seen since $1: deleted, or with $2 only counted
_PRUNE = """
WITH doomed AS (
    SELECT worker FROM worker_pods WHERE seen_at < $1
), deleted AS (
    DELETE FROM worker_pods WHERE NOT $2 AND worker IN (SELECT worker FROM doomed)
)
SELECT count(*) FROM doomed
"""


@dataclass(frozen=True)
class BreakerState:
    """One breaker of a pod: its state, and since when (the pod's clock; its start until
    the breaker first changed)."""

    state: State
    since: dt.datetime


@dataclass(frozen=True)
class Pod:
    """One worker process as it last wrote itself."""

    worker: str
    started_at: dt.datetime
    seen_at: dt.datetime
    seen_s_ago: float
    breakers: dict[str, BreakerState]
    in_flight: int
    paused: bool


@dataclass(frozen=True)
class Pods:
    """The pods seen within `seen_within_s`, and how many rows were not (gone or stuck)."""

    seen: tuple[Pod, ...]
    not_seen: int
    seen_within_s: float


async def record(
    db: Db,
    worker: str,
    *,
    started_at: dt.datetime,
    breakers: Mapping[str, BreakerState],
    in_flight: int,
    paused: bool,
) -> None:
    """Write this process's row (one statement); `seen_at` is the database's now."""
    states = {
        name: {"state": b.state, "since": b.since.isoformat()} for name, b in breakers.items()
    }
    async with translated("worker pods"):
        await db.execute(_RECORD, worker, started_at, json.dumps(states), in_flight, paused)


async def recent(db: Db, *, seen_within_s: float = SEEN_WITHIN_S) -> Pods:
    """The pods seen within `seen_within_s`, by name, and the count of the others."""
    async with translated("worker pods"):
        rows = await db.fetch(_READ)
    pods = [_pod(row) for row in rows]
    seen = tuple(pod for pod in pods if pod.seen_s_ago <= seen_within_s)
    return Pods(seen=seen, not_seen=len(pods) - len(seen), seen_within_s=seen_within_s)


async def prune(db: Db, *, before: dt.datetime, dry_run: bool = False) -> int:
    """Delete the rows not seen since `before`; how many (with `dry_run`, would be)."""
    async with translated("worker pods"):
        count: int = await db.fetchval(_PRUNE, before, dry_run)
    return count


def _pod(row: asyncpg.Record) -> Pod:
    breakers = {
        name: BreakerState(state=b["state"], since=dt.datetime.fromisoformat(b["since"]))
        for name, b in json.loads(row["breakers"]).items()
    }
    return Pod(
        worker=row["worker"],
        started_at=row["started_at"],
        seen_at=row["seen_at"],
        seen_s_ago=max(row["seen_s_ago"], 0.0),
        breakers=breakers,
        in_flight=row["in_flight"],
        paused=row["paused"],
    )
