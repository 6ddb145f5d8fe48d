"""`charge-worker maintain [--dry-run] [--json]`: keep the stores inside their retention.

Run daily as the schema owner (it makes and drops tables): `charge_events` gets a monthly
partition for each of the next `MONTHS_AHEAD` months, and loses the partitions wholly
older than `CHARGE_WORKER_EVENTS_RETENTION_MONTHS`. The ledger itself is kept (see
docs/deploying.md, "What each store keeps"); the streams and the webhook journal have
retentions of their own.
"""

from __future__ import annotations

import datetime as dt
import json

import click

from charge_worker import database, partitions
from charge_worker.settings import Settings

MONTHS_AHEAD = 12


async def maintain_command(settings: Settings, *, dry_run: bool, as_json: bool) -> int:
    """Make the partitions ahead, drop the expired ones; print what was (or would be) done."""
    now = dt.datetime.now(dt.UTC)
    cutoff = partitions.month_start(now, -settings.db.events_retention_months)
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
    finally:
        await database.close_quietly(conn)
    made = [f"charge_events_{month:%Y_%m}" for month in months]
    dropped = [p.name for p in old]
    if as_json:
        kept_since = cutoff.isoformat()
        document = {"dry_run": dry_run, "created": made, "dropped": dropped}
        click.echo(json.dumps(document | {"events_kept_since": kept_since}))
        return 0
    verb = ("would create", "would drop") if dry_run else ("created", "dropped")
    click.echo(f"charge_events: {verb[0]} {len(made)} partition(s) {' '.join(made)}".rstrip())
    click.echo(f"charge_events: {verb[1]} {len(dropped)} partition(s) {' '.join(dropped)}".rstrip())
    click.echo(f"charge_events: events kept since {cutoff:%Y-%m-%d}")
    return 0
