"""Due subscriptions -> `charges.due` and `scheduled` rows in `charge_attempts` (a daily CronJob).

First, the declined periods whose next try is due are started (`start_tries`: their rows
become `scheduled` for that try, and are published with what earlier runs left unpublished).
Then one transaction per batch of due subscriptions, so that a crash anywhere, and any
re-run, lose nothing and charge nothing twice:

1. lock the batch's due subscriptions (`FOR UPDATE SKIP LOCKED`, so a concurrent run takes
   others) and work out their due periods (the subscription's anchor and interval:
   `charge_worker.periods`). A subscription that breaks docs/contracts/charge-due.md, or whose
   key is recorded with another amount, currency or customer, is reported and left where
   it is.
2. publish the charges not recorded yet (`publish.py`), each with `Nats-Msg-Id:
   charge:<order_id>:<billing_period>`, and await their acks;
3. record one `scheduled` row per charge (`ON CONFLICT DO NOTHING`), published with its
   stream sequence where it was acked, and move `next_billing_date` past the day; commit.

A few statements per batch of thousands, whatever its size. With tracing on, each charge
opens its trace (`tracing`): the row keeps its `traceparent`, and every copy of its message
carries it.

A message may precede its row, and outlive it: a run that dies between steps 2 and 3 leaves
messages whose rows rolled back and subscriptions not moved on. The worker records a
message's row when it claims it (as it does for any producer's), and the next run finds the
key recorded, counts it, and moves the subscription on; if it comes first, it publishes
again and JetStream drops the copy inside its duplicate window (after it, the worker's
claim absorbs it). A charge whose publish failed is recorded unpublished, and the next run
publishes it first (`Publisher.publish_leftovers`). Scheduling needs only PostgreSQL: with
NATS down the run records everything unpublished, then fails.

Driver errors become `DependencyUnavailable` (database.translated), keeping `__cause__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import gc
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import click
import structlog
from nats.js.api import PubAck
from pydantic import ValidationError

from charge_worker import database, logs, privileges, streams, tracing
from charge_worker.database import translated
from charge_worker.errors import ChargeWorkerError, DependencyUnavailable
from charge_worker.jobs import note_run
from charge_worker.messages import SCHEMA, ChargeDue
from charge_worker.periods import due_periods
from charge_worker.producer.publish import (
    BATCH,
    DEFAULT_SUBJECT,
    WHOLE,
    Outgoing,
    Publisher,
    Share,
    mark_published,
    opened,
)
from charge_worker.producer.summary import Problem, Progress, Summary, Ticker
from charge_worker.retries.starts import start_due
from charge_worker.settings import Settings

log = structlog.get_logger(__name__)

# Keyset on subscription_id: a row refused in this run is not taken again by the next batch.
# With each subscription, the ledger's row for its first due period (next_billing_date),
# if any: at a month start the batch's only keys, so nothing is looked up again.
_DUE = """
SELECT s.subscription_id, s.order_id, s.customer_id, s.amount_minor, s.currency,
       s.next_billing_date, coalesce(s.billing_anchor, s.next_billing_date) AS anchor,
       s.billing_interval, s.billing_interval_count, c.status, c.fingerprint
  FROM subscriptions AS s
  LEFT JOIN charge_attempts AS c
         ON c.order_id = s.order_id AND c.billing_period = s.next_billing_date
 WHERE s.active AND s.next_billing_date <= $1 AND s.subscription_id > $2
   AND ($4::text IS NULL OR s.subscription_id <= $4)
 ORDER BY s.subscription_id
 LIMIT $3
   FOR UPDATE OF s SKIP LOCKED
"""

_EXISTING = """
SELECT order_id, billing_period, status, fingerprint FROM charge_attempts
 WHERE (order_id, billing_period) IN (SELECT * FROM unnest($1::bigint[], $2::date[]))
"""

# One statement for the whole batch. The row is the charge's `scheduled` event too, and its
# `published` event when its message was stored before the insert (events.py). A charge is
# due at its period's first moment, UTC (`_midnight`, the contract's default). It answers
# with the positions (from 1) of the keys recorded first elsewhere: NULL, and nothing read
# again, when every row went in (a month start).
_SCHEDULE = """
WITH batch AS (
    SELECT * FROM unnest($1::bigint[], $2::date[], $3::text[], $4::text[], $5::text[],
                         $6::bigint[], $7::text[], $8::text[], $9::bigint[])
           WITH ORDINALITY AS t(order_id, billing_period, idempotency_key, subscription_id,
                                customer_id, amount_minor, currency, traceparent, seq, i)
), inserted AS (
    INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
                                 customer_id, amount_minor, currency, due_at, traceparent,
                                 published_seq, published_at, status)
    SELECT order_id, billing_period, idempotency_key, subscription_id, customer_id,
           amount_minor, currency, billing_period::timestamp AT TIME ZONE 'UTC', traceparent,
           seq, CASE WHEN seq IS NOT NULL THEN statement_timestamp() END, 'scheduled'
      FROM batch
    ON CONFLICT DO NOTHING
    RETURNING order_id, billing_period
)
SELECT array_agg(i) FROM batch AS b
 WHERE (SELECT count(*) FROM inserted) < cardinality($1::bigint[])
   AND NOT EXISTS (SELECT 1 FROM inserted AS n
                    WHERE n.order_id = b.order_id AND n.billing_period = b.billing_period)
"""

# Guarded by the date each row was read with; the anchor is fixed on the first advance.
# The batch's range of ids ($4, $5: its first and last, in the database's order) keeps the
# plan to the batch: planned for thousands of keys, a hash join over the whole table looked
# cheaper than a lookup per key (tests/integration/test_producer_plans.py).
_ADVANCE = """
UPDATE subscriptions AS s
   SET billing_anchor = coalesce(s.billing_anchor, s.next_billing_date),
       next_billing_date = t.next_date, updated_at = now()
  FROM unnest($1::text[], $2::date[], $3::date[]) AS t(subscription_id, read_date, next_date)
 WHERE s.subscription_id = t.subscription_id AND s.next_billing_date = t.read_date
   AND s.subscription_id BETWEEN $4 AND $5
"""

Key = tuple[int, dt.date]
SCHEDULE_BATCH = 5000  # subscriptions per transaction
START_BATCH = 1000  # tries started per statement
LANES = 2  # transactions of one process at once: one waits for its acks while another works


@dataclass
class _Plan:
    """One due subscription's charges in this run, and how many of them are recorded."""

    subscription_id: str
    read_date: dt.date
    charges: list[ChargeDue]
    after_last: dt.date  # the period after the last due one
    first: asyncpg.Record | None = None  # the ledger's row for the first charge, read with it
    accepted: int = 0  # charges recorded (now or before) in order, up to the first conflict

    @property
    def next_date(self) -> dt.date:
        """Where the subscription moves on to: its first charge not recorded."""
        if self.accepted < len(self.charges):
            return self.charges[self.accepted].billing_period
        return self.after_last


async def produce_command(
    settings: Settings,
    day: dt.date,
    *,
    as_json: bool,
    share: Share = WHOLE,
) -> int:
    """`charge-worker produce`: run it, print the summary, return the exit status.

    Exit 0 when every due charge was published or was already settled; 1 if any charge could
    not be published (it stays `scheduled`: a re-run publishes it). Invalid subscriptions and
    conflicts are reported and skipped, but do not fail the run on their own. Progress is
    logged every 1000 rows (`logs.progress`), so `--json` keeps stdout one JSON object.

    The whole run (`share` WHOLE) is recorded in `job_runs` at its end, ok when it exits 0;
    one process of `produce --processes N` is not: the parent records the run.
    """
    gc.freeze()  # what start-up loaded lives as long as the run: no collection walks it
    started = dt.datetime.now(dt.UTC)
    whole = share == WHOLE
    try:
        summary = await produce(
            settings,
            day,
            progress=logs.progress(settings.log, __package__),
            share=share,
        )
    except ChargeWorkerError as error:
        if whole:
            await note_produced(settings, day, started, error)
        raise
    click.echo(summary.as_json() if as_json else "\n".join(summary.lines()))
    if whole:
        await note_produced(settings, day, started, summary)
    return summary.exit_code


async def note_produced(
    settings: Settings, day: dt.date, started: dt.datetime, ended: Summary | ChargeWorkerError
) -> None:
    """Record a whole run in `job_runs`: ok when it exits 0, with its figures; or the error
    that ended it early, quietly (its one line is printed as the command ends)."""
    if isinstance(ended, ChargeWorkerError):
        failed = {"day": day.isoformat(), "error": type(ended).__name__}
        await note_run(
            settings.db, "produce", started_at=started, ok=False, summary=failed, quiet=True
        )
    else:
        ok, figures = ended.exit_code == 0, ended.figures()
        await note_run(settings.db, "produce", started_at=started, ok=ok, summary=figures)


async def produce(
    settings: Settings,
    day: dt.date,
    *,
    batch_size: int | None = None,
    progress: Progress | None = None,
    lanes: int = LANES,
    share: Share = WHOLE,
) -> Summary:
    """Start the declined periods' next tries that are due (`start_tries`), publish them
    with what earlier runs left unpublished, then schedule and publish what is due on
    or before `day` in `lanes` transactions at once (one publishes while another reads and
    writes); of the subscriptions in `share` only.

    Scheduling needs only PostgreSQL: with NATS down, the run schedules everything, then
    fails, and the next run publishes what this one scheduled.
    """
    summary = Summary(day)
    batch = batch_size or SCHEDULE_BATCH
    async with translated("produce"), contextlib.AsyncExitStack() as stack:
        conn = await _connect(settings, stack)
        await privileges.require(conn, privileges.PRODUCE)
        await start_tries(conn, summary, settings.retries.retry_cap_30d, progress=progress)
        cursor = Cursor(Ticker("due subscriptions examined", progress), share, share.after)
        try:
            nc = await streams.connect(settings.nats, name="charge-worker-produce", reconnect=False)
            stack.push_async_callback(nc.close)
            js = nc.jetstream()
            for drift in (await streams.provision(js, settings.nats)).drift:
                log.warning("streams.drift", detail=str(drift))
        except DependencyUnavailable:
            await schedule(conn, day, summary, batch_size=batch, cursor=cursor)
            raise
        publisher = Publisher(conn, nc, settings.nats, summary, progress)
        await publisher.publish_leftovers(batch_size or BATCH, share)
        conns = [conn] + [await _connect(settings, stack) for _ in range(lanes - 1)]
        await _all(
            schedule(lane, day, summary, batch_size=batch, publisher=publisher, cursor=cursor)
            for lane in conns
        )
    return summary


async def start_tries(
    conn: asyncpg.Connection,
    summary: Summary,
    cap: int,
    *,
    batch_size: int = START_BATCH,
    progress: Progress | None = None,
) -> None:
    """Start the next try of every declined period whose `retry_at` has come, a batch per
    statement (`retries.starts.start_due`), or postpone it where the 30-day cap of `cap`
    would be exceeded. A started try's row is `scheduled` and unpublished: the run's
    publishing of what is left unpublished sends it, with `attempt` its try."""
    ticker = Ticker("next tries started", progress)
    while True:
        starts = await start_due(conn, batch_size, cap)
        summary.tries_started += starts.started
        summary.tries_postponed += starts.postponed
        ticker.tick(starts.started)
        if starts.rows < batch_size:
            return


async def _all(lanes: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run the lanes at once; when one fails, the others are cancelled (their open batch
    rolls back) before its error goes on."""
    tasks = [asyncio.create_task(lane) for lane in lanes]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _connect(settings: Settings, stack: contextlib.AsyncExitStack) -> asyncpg.Connection:
    conn = await database.connect(settings.db, application_name="charge-worker produce")
    stack.push_async_callback(database.close_quietly, conn)
    return conn


@dataclass
class Cursor:
    """Where the next batch of due subscriptions starts, shared by the lanes of one run:
    each lane reads its batch (and locks it) under `lock`, then records and commits it
    while the others read theirs. No subscription is read twice in a run, those refused
    included, exactly as with one lane."""

    ticker: Ticker
    share: Share = WHOLE
    after: str = ""
    done: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def schedule(
    conn: asyncpg.Connection,
    day: dt.date,
    summary: Summary,
    *,
    batch_size: int = SCHEDULE_BATCH,
    progress: Progress | None = None,
    publisher: Publisher | None = None,
    cursor: Cursor | None = None,
) -> None:
    """Record every charge due on or before `day` as `scheduled`, a batch of subscriptions
    per transaction, four statements per batch whatever its size; with a `publisher`, each
    batch's new charges are published inside its transaction and recorded published.
    Without one, they are recorded unpublished. With tracing on, each charge recorded opens
    its trace (`create <subject>`), kept in its row. Lanes running at once on connections of
    their own share a `cursor`."""
    cursor = cursor or Cursor(Ticker("due subscriptions examined", progress))
    subject = publisher.cfg.subject if publisher else DEFAULT_SUBJECT
    while not cursor.done:
        async with conn.transaction():
            async with cursor.lock:
                through = cursor.share.through
                rows = await conn.fetch(_DUE, day, cursor.after, batch_size, through)
                cursor.done = len(rows) < batch_size
                cursor.after = rows[-1]["subscription_id"] if rows else cursor.after
                cursor.ticker.tick(len(rows))
            plans = [_plan(row, day, summary) for row in rows]
            await _schedule_batch(conn, plans, summary, subject, publisher)
        summary.due += len(rows)


def _plan(row: asyncpg.Record, day: dt.date, summary: Summary) -> _Plan:
    """The subscription's due periods as contract-checked charges; none, and no advance,
    when it breaks the contract (reported)."""
    read: dt.date = row["next_billing_date"]
    anchor, interval, count = row["anchor"], row["billing_interval"], row["billing_interval_count"]
    periods, after_last = due_periods(anchor, read, interval, count, day)
    try:
        charges = [_charge(row, period) for period in periods]
    except ValidationError as error:
        summary.invalid.append(Problem(row["subscription_id"], None, _reason(error)))
        return _Plan(row["subscription_id"], read, [], read)
    first = row if charges and row["status"] is not None else None
    return _Plan(row["subscription_id"], read, charges, after_last, first)


async def _schedule_batch(
    conn: asyncpg.Connection,
    plans: list[_Plan],
    summary: Summary,
    subject: str,
    publisher: Publisher | None,
) -> None:
    """Publish the batch's new charges, then insert them with what their acks say; count the
    recorded ones; stop each subscription at its first conflict; advance each past what it
    has recorded."""
    later = [c for plan in plans for c in plan.charges[1:]]  # a subscription catching up
    first = {_key(p.charges[0]): p.first for p in plans if p.first is not None}
    existing = first | await _existing(conn, later)
    fresh: list[tuple[_Plan, ChargeDue]] = []
    for plan in plans:
        for charge in plan.charges:
            found = existing.get(_key(charge))
            if found is None:
                fresh.append((plan, charge))
            elif not _recorded(charge, found, summary):
                break
            plan.accepted += 1
    charges = [charge for _, charge in fresh]
    created = [opened(charge, subject) for charge in charges] if tracing.enabled() else []
    traces = [tracing.traceparent_of(span) for span in created] or [None] * len(charges)
    outgoing = [Outgoing(charge, trace) for charge, trace in zip(charges, traces, strict=True)]
    acks: list[PubAck | None] = [None] * len(outgoing)
    if publisher is not None:
        acks = await publisher.send(outgoing)
    # a worker may have recorded a charge meanwhile (from this message, or another's)
    raced = await _insert(conn, outgoing, acks)
    summary.scheduled += len(outgoing) - len(raced)
    again = await _existing(conn, [outgoing[i].charge for i in raced])
    recorded = []
    for i in raced:
        plan, charge = fresh[i]
        if _recorded(charge, again.get(_key(charge)), summary):
            recorded.append(i)
        else:
            plan.accepted = min(plan.accepted, plan.charges.index(charge))
    await mark_published(conn, [outgoing[i] for i in recorded], [acks[i] for i in recorded])
    kept = set(raced)  # a key recorded first elsewhere keeps its trace
    for i, span in enumerate(created):
        if i not in kept:
            span.end()
    moved = [plan for plan in plans if plan.next_date != plan.read_date]
    if moved:
        await conn.execute(
            _ADVANCE,
            [plan.subscription_id for plan in moved],
            [plan.read_date for plan in moved],
            [plan.next_date for plan in moved],
            moved[0].subscription_id,
            moved[-1].subscription_id,
        )


def _key(charge: ChargeDue) -> Key:
    return charge.order_id, charge.billing_period


async def _existing(
    conn: asyncpg.Connection, charges: list[ChargeDue]
) -> dict[Key, asyncpg.Record]:
    if not charges:
        return {}
    rows = await conn.fetch(
        _EXISTING, [c.order_id for c in charges], [c.billing_period for c in charges]
    )
    return {(row["order_id"], row["billing_period"]): row for row in rows}


def _recorded(charge: ChargeDue, found: asyncpg.Record | None, summary: Summary) -> bool:
    """The key is recorded as this very charge (counted); False, reported, when it holds
    another one."""
    fingerprint = charge.fingerprint
    if found is None or found["fingerprint"] != fingerprint:
        recorded = "another row's key" if found is None else f"'{found['fingerprint']}'"
        reason = f"recorded as {recorded}, the subscription says '{fingerprint}'"
        summary.conflicts.append(Problem(charge.subscription_id, charge.key, reason))
        return False
    if found["status"] in ("scheduled", "pending"):
        summary.already_scheduled += 1
    else:
        summary.already_settled += 1
    return True


async def _insert(
    conn: asyncpg.Connection, outgoing: list[Outgoing], acks: list[PubAck | None]
) -> list[int]:
    """Record the charges as `scheduled`, with their traces, and as published where they
    were acked: the positions of those whose key was recorded first elsewhere (none at a
    month start, where no key set is built)."""
    if not outgoing:
        return []
    charges = [o.charge for o in outgoing]
    raced: list[int] | None = await conn.fetchval(
        _SCHEDULE,
        [c.order_id for c in charges],
        [c.billing_period for c in charges],
        [c.key for c in charges],
        [c.subscription_id for c in charges],
        [c.customer_id for c in charges],
        [c.amount_minor for c in charges],
        [c.currency for c in charges],
        [o.traceparent for o in outgoing],
        [ack.seq if ack is not None else None for ack in acks],
    )
    return sorted(i - 1 for i in raced or ())


def _charge(row: asyncpg.Record, period: dt.date) -> ChargeDue:
    """The charge.due/v1 message for one period of a subscription; the contract validates."""
    return ChargeDue.model_validate(
        {
            "schema": SCHEMA,
            "subscription_id": row["subscription_id"],
            "order_id": row["order_id"],
            "customer_id": row["customer_id"],
            "amount_minor": row["amount_minor"],
            "currency": row["currency"],
            "billing_period": period,
            "due_at": _midnight(period),
        }
    )


@functools.lru_cache(maxsize=256)
def _midnight(period: dt.date) -> dt.datetime:
    """When a period's charge is due: its first moment, UTC (a month start's charges share
    a handful of periods)."""
    return dt.datetime.combine(period, dt.time(), dt.UTC)


def _reason(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()
    )
