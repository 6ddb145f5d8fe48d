"""Due subscriptions -> `scheduled` rows in `charge_attempts` -> `charges.due` (a daily CronJob).

A transactional outbox in two steps, so that a crash anywhere, and any re-run, lose nothing
and publish nothing twice that matters:

1. **schedule** (here), one transaction per batch: lock due subscriptions (`FOR UPDATE
   SKIP LOCKED`, so a concurrent run takes others), record one `scheduled` row per due
   period (`ON CONFLICT DO NOTHING`) and move `next_billing_date` one period at a time past
   the day (periods follow the subscription's anchor and interval: `next_billing_period`).
   A subscription that breaks contracts/charge-due.md, or whose key is recorded with
   another amount, currency or customer, is reported and left where it is.
2. **publish** (`publish.py`): every `scheduled` row not published yet, this run's or
   an earlier one's, with `Nats-Msg-Id: charge:<order_id>:<billing_period>`. JetStream
   drops a re-publish inside its duplicate window; after it, the worker's claim on
   `charge_attempts` absorbs it.

Driver errors become `DependencyUnavailable` (database.translated), keeping `__cause__`.
"""

from __future__ import annotations

import contextlib
import datetime as dt

import asyncpg
import click
import structlog
from pydantic import ValidationError

from charge_worker import database, streams
from charge_worker.database import translated
from charge_worker.messages import SCHEMA, ChargeDue
from charge_worker.producer.publish import ACTOR, BATCH, publish_scheduled
from charge_worker.producer.summary import Problem, Progress, Summary, Ticker
from charge_worker.settings import Settings

log = structlog.get_logger(__name__)

# Keyset on subscription_id: a row refused in this run is not taken again by the next batch.
_DUE = """
SELECT subscription_id, order_id, customer_id, amount_minor, currency, next_billing_date
  FROM subscriptions
 WHERE active AND next_billing_date <= $1 AND subscription_id > $2
 ORDER BY subscription_id
 LIMIT $3
   FOR UPDATE SKIP LOCKED
"""

# The `scheduled` event goes with the row, in the same round trip.
_SCHEDULE = """
WITH inserted AS (
    INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
                                 customer_id, amount_minor, currency, due_at, status)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'scheduled')
    ON CONFLICT DO NOTHING
    RETURNING order_id, billing_period
), story AS (
    INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
    SELECT order_id, billing_period, 'scheduled', $9,
           jsonb_build_object('subscription_id', $4::text, 'amount_minor', $6::bigint,
                              'currency', $7::text)
      FROM inserted
)
SELECT order_id FROM inserted
"""

_EXISTING = """
SELECT status, fingerprint FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

# The next period comes from the anchor, never from the last period plus a month, which
# drifts (the 31st becomes the 28th after February and stays there); migrations/0004.
_ADVANCE = """
UPDATE subscriptions
   SET billing_anchor = coalesce(billing_anchor, next_billing_date),
       next_billing_date = next_billing_period(coalesce(billing_anchor, next_billing_date),
                                               next_billing_date, billing_interval,
                                               billing_interval_count),
       updated_at = now()
 WHERE subscription_id = $1 AND next_billing_date = $2
RETURNING next_billing_date
"""


async def produce_command(settings: Settings, day: dt.date, *, as_json: bool) -> int:
    """`charge-worker produce`: run both steps, print the summary, return the exit status.

    Exit 0 when every due charge was published or was already settled; 1 if any charge could
    not be published (it stays `scheduled`: a re-run publishes it). Invalid subscriptions and
    conflicts are reported and skipped, but do not fail the run on their own. Progress goes
    to stderr every 1000 rows, so `--json` keeps stdout one JSON object.
    """
    summary = await produce(settings, day, progress=lambda line: click.echo(line, err=True))
    click.echo(summary.as_json() if as_json else "\n".join(summary.lines()))
    return summary.exit_code


async def produce(
    settings: Settings, day: dt.date, *, batch_size: int = BATCH, progress: Progress | None = None
) -> Summary:
    """Schedule what is due on or before `day`, then publish every unpublished `scheduled` row.

    Scheduling needs only PostgreSQL: with NATS down, the run fails after it, and the next
    run publishes what this one scheduled.
    """
    summary = Summary(day)
    async with translated("produce"), contextlib.AsyncExitStack() as stack:
        # one connection: both steps run one statement at a time, never two at once
        conn = await database.connect(settings.db, application_name="charge-worker produce")
        stack.push_async_callback(database.close_quietly, conn)
        await schedule(conn, day, summary, batch_size=batch_size, progress=progress)
        nc = await streams.connect(settings.nats, name="charge-worker-produce", reconnect=False)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        for drift in (await streams.provision(js, settings.nats)).drift:
            log.warning("streams.drift", detail=str(drift))
        await publish_scheduled(
            conn, js, settings.nats, summary, batch_size=batch_size, progress=progress
        )
    return summary


async def schedule(
    conn: asyncpg.Connection,
    day: dt.date,
    summary: Summary,
    *,
    batch_size: int = BATCH,
    progress: Progress | None = None,
) -> None:
    """Step 1: record every charge due on or before `day` as `scheduled`, batch by batch."""
    ticker = Ticker("due subscriptions examined", progress)
    after = ""
    while True:
        async with conn.transaction():
            rows = await conn.fetch(_DUE, day, after, batch_size)
            for row in rows:
                await _schedule_subscription(conn, row, day, summary)
                summary.due += 1
                ticker.tick()
        if len(rows) < batch_size:
            return
        after = rows[-1]["subscription_id"]


async def _schedule_subscription(
    conn: asyncpg.Connection, row: asyncpg.Record, day: dt.date, summary: Summary
) -> None:
    """One charge per due period, oldest first; stop at a refused one without advancing."""
    period: dt.date = row["next_billing_date"]
    while period <= day:
        try:
            charge = _charge(row, period)
        except ValidationError as error:
            summary.invalid.append(Problem(row["subscription_id"], None, _reason(error)))
            return
        if not await _schedule_charge(conn, charge, summary):
            return
        advanced = await conn.fetchval(_ADVANCE, charge.subscription_id, period)
        if advanced is None:  # cannot happen under our row lock; never advance blindly
            return
        period = advanced


async def _schedule_charge(conn: asyncpg.Connection, charge: ChargeDue, summary: Summary) -> bool:
    """Record one due charge; False (a conflict) when its key holds another charge."""
    key = (charge.order_id, charge.billing_period)
    inserted = await conn.fetchval(
        _SCHEDULE,
        *key,
        charge.key,
        charge.subscription_id,
        charge.customer_id,
        charge.amount_minor,
        charge.currency,
        charge.due_at,
        ACTOR,
    )
    if inserted is not None:
        summary.scheduled += 1
        return True
    existing = await conn.fetchrow(_EXISTING, *key)
    fingerprint = f"{charge.amount_minor} {charge.currency} {charge.customer_id}"
    if existing is None or existing["fingerprint"] != fingerprint:
        recorded = "another row's key" if existing is None else f"'{existing['fingerprint']}'"
        reason = f"recorded as {recorded}, the subscription says '{fingerprint}'"
        summary.conflicts.append(Problem(charge.subscription_id, charge.key, reason))
        return False
    if existing["status"] in ("scheduled", "pending"):
        summary.already_scheduled += 1
    else:
        summary.already_settled += 1
    return True


def _charge(row: asyncpg.Record, period: dt.date) -> ChargeDue:
    """The charge.due/v1 message for one period of a subscription; the contract validates."""
    due_at = dt.datetime.combine(period, dt.time(), dt.UTC)
    return ChargeDue.model_validate(
        {"schema": SCHEMA, **dict(row), "billing_period": period, "due_at": due_at}
    )


def _reason(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()
    )
