"""`job_runs`: one row per real run of a money-moving job, and what the gauges read of them.

A job records its run at its end (`note_run`), on a connection of its own, after its output:
recording is a report, never part of the run's work, so a failure to record is one warning
line (`jobs.run_not_recorded`) and changes neither the command's output nor its exit status.
A reconcile run that finished carries its figures (`figures.RECONCILE_COUNTS`) in its
summary; one that ended early on an error names the error instead. `maintain` prunes the
rows past `RETENTION`, keeping every row the gauges read (`_KEPT`), however old.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from charge_worker import database
from charge_worker.database import translated
from charge_worker.errors import ChargeWorkerError
from charge_worker.jobs.figures import RECONCILE_COUNTS
from charge_worker.settings import DbSettings

log = structlog.get_logger(__name__)

Job = Literal["produce", "reconcile", "maintain"]
JOBS: tuple[Job, ...] = ("produce", "reconcile", "maintain")
RETENTION = dt.timedelta(days=90)

_RECORD = """
INSERT INTO job_runs (job, started_at, ok, summary) VALUES ($1, $2, $3, $4::jsonb)
"""

# For each job, its latest success and its latest failure, and for reconcile its latest run
# that finished (its summary holds the figures, whether it handled every key or not): each
# one row off `job_runs_latest_idx`, whatever the table holds.
_KEPT = """
SELECT r.* FROM unnest($1::text[]) AS j(job),
       LATERAL ((SELECT * FROM job_runs WHERE job = j.job AND ok
                  ORDER BY finished_at DESC LIMIT 1)
                UNION ALL
                (SELECT * FROM job_runs WHERE job = j.job AND NOT ok
                  ORDER BY finished_at DESC LIMIT 1)
                UNION ALL
                (SELECT * FROM job_runs WHERE job = j.job AND NOT ok AND summary ? $2
                  ORDER BY finished_at DESC LIMIT 1)) AS r
"""

# the runs past their retention but those `_KEPT` names: deleted, or with $4 only counted
_PRUNE = f"""
WITH doomed AS (
    SELECT id FROM job_runs
     WHERE finished_at < $3 AND id NOT IN (SELECT id FROM ({_KEPT}) AS kept)
), deleted AS (
    DELETE FROM job_runs WHERE NOT $4 AND id IN (SELECT id FROM doomed)
)
SELECT count(*) FROM doomed
"""  # noqa: S608 (module constants)

# what marks a reconcile run that finished: a count every such run carries
_FINISHED = "errors"
assert _FINISHED in RECONCILE_COUNTS


@dataclass(frozen=True)
class Run:
    """One recorded run."""

    job: Job
    started_at: dt.datetime
    finished_at: dt.datetime
    ok: bool
    summary: dict[str, Any]


@dataclass(frozen=True)
class Latest:
    """What the gauges show: each job's latest success and failure (absent: none recorded),
    and reconcile's latest run that finished, with its figures."""

    succeeded: dict[Job, dt.datetime]
    failed: dict[Job, dt.datetime]
    reconciled: Run | None


async def record(
    conn: asyncpg.Connection,
    job: Job,
    *,
    started_at: dt.datetime,
    ok: bool,
    summary: Mapping[str, object],
) -> None:
    """Add one run; `finished_at` is the database's now."""
    text = json.dumps(summary, default=str, ensure_ascii=False)
    async with translated("job runs"):
        await conn.execute(_RECORD, job, started_at, ok, text)


async def note_run(
    db: DbSettings,
    job: Job,
    *,
    started_at: dt.datetime,
    ok: bool,
    summary: Mapping[str, object],
    quiet: bool = False,
) -> None:
    """Record a run at its end, on a connection of its own; a failure is logged as one
    warning and swallowed: the run's outcome stands as it is. `quiet`: a run that ended
    early, whose error line has said why; failing to record it (most likely for the same
    cause) says nothing more, so that the error stays one line."""
    try:
        conn = await database.connect(db, application_name=f"charge-worker {job}")
        try:
            await record(conn, job, started_at=started_at, ok=ok, summary=summary)
        finally:
            await database.close_quietly(conn)
    except ChargeWorkerError as error:
        if quiet:
            return
        log.warning("jobs.run_not_recorded", job=job, ok=ok, error=" ".join(str(error).split()))


async def latest(conn: asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]) -> Latest:
    """The rows the gauges read, in one statement."""
    async with translated("job runs"):
        rows = await conn.fetch(_KEPT, list(JOBS), _FINISHED)
    succeeded: dict[Job, dt.datetime] = {}
    failed: dict[Job, dt.datetime] = {}
    reconciled: Run | None = None
    for row in rows:
        run = Run(
            row["job"], row["started_at"], row["finished_at"], row["ok"], json.loads(row["summary"])
        )
        (succeeded if run.ok else failed)[run.job] = run.finished_at
        finished = run.job == "reconcile" and _FINISHED in run.summary
        if finished and (reconciled is None or reconciled.finished_at < run.finished_at):
            reconciled = run
    return Latest(succeeded, failed, reconciled)


async def prune(conn: asyncpg.Connection, *, before: dt.datetime, dry_run: bool = False) -> int:
    """Delete the runs that finished before `before`, but the ones the gauges read; how many
    (with `dry_run`, would be)."""
    async with translated("job runs"):
        count: int = await conn.fetchval(_PRUNE, list(JOBS), _FINISHED, before, dry_run)
    return count
