"""`charge-worker maintain [--dry-run] [--json]`: keep the stores inside their retention.

Run daily as the schema owner (it makes and drops tables): `charge_events` gets a monthly
partition for each of the next `MONTHS_AHEAD` months, and loses the partitions wholly
older than `CHARGE_WORKER_EVENTS_RETENTION_MONTHS`; `job_runs` loses the runs that finished
more than `jobs.runs.RETENTION` ago, but the ones the worker pods' gauges read (each job's
latest success and failure, reconcile's latest finished run); `worker_pods` loses the
rows of pods not seen for `jobs.pods.RETENTION` (pods come and go). The ledger itself is kept
(see docs/deploying.md, "What each store keeps"); the streams and the webhook journal have
retentions of their own. A real run is recorded in `job_runs`; a dry run is not.
"""

from __future__ import annotations

import datetime as dt
import json

import click

from charge_worker import database, partitions
from charge_worker.errors import ChargeWorkerError
from charge_worker.jobs import note_run, pods
from charge_worker.jobs.runs import RETENTION, prune
from charge_worker.settings import Settings

MONTHS_AHEAD = 12


async def maintain_command(settings: Settings, *, dry_run: bool, as_json: bool) -> int:
    """Make the partitions ahead, drop the expired ones, prune the old job runs and the pods
    long gone; print what was (or would be) done."""
    now = dt.datetime.now(dt.UTC)
    cutoff = partitions.month_start(now, -settings.db.events_retention_months)
    runs_before = now - RETENTION
    pods_before = now - pods.RETENTION
    try:
        conn = await database.connect(settings.db, application_name="charge-worker maintain")
        try:
            present = await partitions.existing(conn)
            months = partitions.missing_months(present, now, MONTHS_AHEAD)
            old = partitions.expired(present, cutoff)
            if not dry_run:
                for month in months:
                    await partitions.create(conn, month)
                for partition in old:
                    await partitions.drop(conn, partition)
            pruned = await prune(conn, before=runs_before, dry_run=dry_run)
            gone = await pods.prune(conn, before=pods_before, dry_run=dry_run)
        finally:
            await database.close_quietly(conn)
    except ChargeWorkerError as error:
        if not dry_run:
            ended = {"error": type(error).__name__}
            await note_run(
                settings.db, "maintain", started_at=now, ok=False, summary=ended, quiet=True
            )
        raise
    made = [f"charge_events_{month:%Y_%m}" for month in months]
    dropped = [p.name for p in old]
    _print(
        dry_run,
        as_json,
        made,
        dropped,
        cutoff=cutoff,
        pruned=pruned,
        runs_before=runs_before,
        gone=gone,
        pods_before=pods_before,
    )
    if not dry_run:
        done = {"created": made, "dropped": dropped, "runs_pruned": pruned, "pods_pruned": gone}
        await note_run(settings.db, "maintain", started_at=now, ok=True, summary=done)
    return 0


def _print(
    dry_run: bool,
    as_json: bool,
    made: list[str],
    dropped: list[str],
    *,
    cutoff: dt.datetime,
    pruned: int,
    runs_before: dt.datetime,
    gone: int,
    pods_before: dt.datetime,
) -> None:
    if as_json:
        kept_since = cutoff.isoformat()
        document = {"dry_run": dry_run, "created": made, "dropped": dropped}
        runs = {"runs_pruned": pruned, "runs_kept_since": runs_before.isoformat()}
        seen = {"pods_pruned": gone, "pods_kept_seen_since": pods_before.isoformat()}
        click.echo(json.dumps(document | {"events_kept_since": kept_since} | runs | seen))
        return
    verb = (
        ("would create", "would drop", "would prune")
        if dry_run
        else ("created", "dropped", "pruned")
    )
    click.echo(f"charge_events: {verb[0]} {len(made)} partition(s) {' '.join(made)}".rstrip())
    click.echo(f"charge_events: {verb[1]} {len(dropped)} partition(s) {' '.join(dropped)}".rstrip())
    click.echo(f"charge_events: events kept since {cutoff:%Y-%m-%d}")
    click.echo(f"job_runs: {verb[2]} {pruned} run(s) finished before {runs_before:%Y-%m-%d}")
    since = f"{pods_before:%Y-%m-%d %H:%M} UTC"
    click.echo(f"worker_pods: {verb[2]} {gone} pod(s) not seen since {since}")
