"""The two sweeps that start from open ledger rows: unknown outcomes and lost messages.

| sweep              | looks at                                     | repairs by                   |
|--------------------|----------------------------------------------|------------------------------|
| unknown outcomes   | quiet, unleased `pending` rows that called,  | recording what lookup finds  |
|                    | and `processing` rows (the bank settles them)| (still processing: later)    |
| lost messages      | quiet, unleased `scheduled`/`pending` rows   | recording what lookup finds, |
|                    | whose message no longer waits in the stream  | else re-publishing           |

A lookup lists every try's charges of the period; what it says is read as the worker
reads it (`found`): money of any try settles the period `succeeded`, and only the current
try's failed charge is its decline, which leaves the period in the state the retry schedule
says (`retry_scheduled` with its `retry_at`, `action_required`, or `declined`). An earlier
try's decline is that try's, recorded already: it never settles the current one.

Only a charge that matches the row (amount, currency, customer: `proof.split`) is
recorded; one someone else made with our metadata is a person's, and the row stays open,
so the sweep re-publishes it and the due charge is made.

(The gateway's charges are decided in `charges.py`, the rows it does not show in
`discrepancies.py`; what all share is the `Sweeper`.) Rows are read `BATCH` at a time
(keyset, oldest quiet first) and worked on several at once. Nothing here ever charges. The
SQL lives in these modules, not in `ledger.py`: it is not the worker's hot path.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
from pydantic import ValidationError

from charge_worker.errors import PoisonMessage
from charge_worker.gateway import GatewayCharge, period_answer
from charge_worker.messages import SCHEMA, ChargeDue, idempotency_key
from charge_worker.reconcile import proof
from charge_worker.reconcile.candidates import Key
from charge_worker.reconcile.report import Finding
from charge_worker.reconcile.sweeper import BATCH, Sweeper, stamp
from charge_worker.retries.schedule import DECLINE_STATES, after_decline

FIRST = (dt.datetime.min.replace(tzinfo=dt.UTC), 0, dt.date.min)  # before every keyset

# A `processing` row is looked at again after growing gaps: a quarter of its try's age, at
# least the quiet time and at most a day (a card payment settles in seconds, a bank debit in
# days: no sweep asks about it every 15 minutes for a week).
_UNKNOWN = """
SELECT order_id, billing_period, attempt, updated_at, status, customer_id, fingerprint,
       gateway_charge_id, current_try, coalesce(try_started_at, created_at) AS since
  FROM charge_attempts
 WHERE ((status = 'pending' AND gateway_calls > 0) OR status = 'processing')
   AND (lease_until IS NULL OR lease_until < now())
   AND updated_at < now() - CASE WHEN status = 'pending' THEN make_interval(secs => $1)
       ELSE greatest(make_interval(secs => $1),
                     least((now() - coalesce(try_started_at, created_at)) / 4, '1 day'))
       END
   AND (updated_at, order_id, billing_period) > ($2, $3, $4)
 ORDER BY updated_at, order_id, billing_period LIMIT $5
"""

# Quiet, unleased open rows whose newest message no longer waits in the stream: at or below
# the consumer's ack floor ($2), older than the stream's first message ($3), deleted ($4),
# or never published. A month-start queue is not a loss, however long it takes.
_NEWEST = "greatest(published_seq, last_stream_seq)"
_OPEN_AND_QUIET = """
 WHERE status IN ('scheduled', 'pending') AND (lease_until IS NULL OR lease_until < now())
   AND updated_at < now() - make_interval(secs => $1)
"""
_WAITING = f"""
coalesce({_NEWEST} > $2 AND {_NEWEST} >= $3 AND NOT {_NEWEST} = ANY($4::bigint[]), false)
"""
_QUIET = f"""
SELECT order_id, billing_period, subscription_id, customer_id, amount_minor, currency,
       due_at, status, attempt, updated_at, traceparent, fingerprint, gateway_charge_id,
       current_try, least(created_at, due_at) AS since
  FROM charge_attempts {_OPEN_AND_QUIET} AND NOT {_WAITING}
   AND (updated_at, order_id, billing_period) > ($5, $6, $7)
 ORDER BY updated_at, order_id, billing_period LIMIT $8
"""
_STILL_WAITING = f"SELECT count(*) FROM charge_attempts {_OPEN_AND_QUIET} AND {_WAITING}"

# A processing row the bank has not settled: looked at again once it is quiet again.
_STILL_PROCESSING = """
UPDATE charge_attempts SET updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status = 'processing' AND attempt = $3
"""

# Only the quiet clock moves, and where the new message is; a row a worker has taken since
# (another attempt) is its own.
_TOUCH = """
UPDATE charge_attempts SET updated_at = now(), published_seq = greatest(published_seq, $5)
 WHERE order_id = $1 AND billing_period = $2 AND status = $3 AND attempt = $4
"""


async def _quiet_rows(
    run: Sweeper, query: str, *where: object
) -> AsyncIterator[list[asyncpg.Record]]:
    """The rows `query` finds, `BATCH` at a time, oldest quiet first (keyset)."""
    after: tuple[object, ...] = FIRST
    while rows := await run.conn.fetch(query, *where, *after, BATCH):
        yield rows
        last = rows[-1]
        after = (last["updated_at"], last["order_id"], last["billing_period"])


async def unknown_outcomes(run: Sweeper) -> None:
    """Record what the gateway did for quiet, unleased `pending` rows whose call
    has no recorded outcome, and for quiet `processing` rows. A charge found (of any try):
    `succeeded`; one still processing: `processing` (again later); the current try's failed
    one: what the retry schedule says; nothing: left pending for `lost_messages` (the worker
    looks up before charging)."""
    done = 0

    async def one(row: asyncpg.Record) -> None:
        nonlocal done
        key = (row["order_id"], row["billing_period"])
        with run.each("unknown_outcomes", idempotency_key(*key)):
            await _resolve(run, key, row)
        done += 1
        run.tick("unknown outcomes", done)

    async for rows in _quiet_rows(run, _UNKNOWN, run.quiet_s):
        await run.together(rows, one)


@dataclass(frozen=True)
class Found:
    """What a lookup says the period's open row comes to: `status` (as the worker would
    settle it), the charge that says so, and for a decline what the schedule makes of it."""

    status: str
    charge: GatewayCharge
    retry_in_s: float | None = None  # `retry_scheduled`: the wait before the next try
    exhausted: bool = False  # `declined` for want of a try left


def found(
    charges: list[GatewayCharge], current_try: int, schedule: Sequence[float]
) -> Found | None:
    """What a lookup's charges that match the row (`proof.split`) say happened, by the
    worker's rule (`gateway.period_answer`); a decline, as the retry schedule decides on it
    (`after_decline`)."""
    answer = period_answer(charges, current_try)
    if answer is None:
        return None
    status, charge = answer
    if status != "declined":
        return Found(status, charge)
    after = after_decline(charge.decline_code, current_try, schedule)
    return Found(after.status, charge, after.retry_in_s, after.exhausted)


async def _ours(run: Sweeper, key: Key, row: asyncpg.Record) -> list[GatewayCharge]:
    """The key's charges that match its open row; the captured ones that do not (made by
    someone else with our metadata) are reported for a person and never recorded, so the
    row stays open and the due charge goes ahead."""
    ledger = proof.LedgerRow(row["status"], row["fingerprint"], row["gateway_charge_id"])
    found = await _recorded(run, key, row)
    if found is None:  # the charges made since the row's `since` (its query says which)
        found = await run.lookup(key, row["customer_id"], since=row["since"])
    lookup = proof.split(found, ledger)
    if lookup.foreign:
        async with run.pool.acquire() as conn:
            await run.for_a_person(conn, key, ledger, lookup.foreign)
    return lookup.ours


async def _recorded(run: Sweeper, key: Key, row: asyncpg.Record) -> list[GatewayCharge] | None:
    """A `processing` row's charge, read by the id the row recorded, where the provider
    reads charges by id: not every charge of the window (a provider that lists by time
    would page through a month start's payments for each row). None, for a lookup
    instead: no such row or provider, or a charge that is not this key's current try's."""
    charge_id = row["gateway_charge_id"]
    if row["status"] != "processing" or not charge_id or not run.gateway.reads_by_id:
        return None
    found = await run.retrieve(charge_id)
    ours = (str(key[0]), key[1].isoformat(), row["current_try"])
    if [(c.order_id, c.billing_period, c.attempt) for c in found] != [ours]:
        return None
    return found


async def _resolve(run: Sweeper, key: Key, row: asyncpg.Record) -> None:
    attempt, was = row["attempt"], row["status"]
    answer = found(await _ours(run, key, row), row["current_try"], run.retry_schedule)
    if answer is None:
        action = "not found: re-publish" if was == "pending" else "not found at the gateway"
        run.report.add("unknown_outcomes", Finding(*key, action, {"status": was}))
        return
    status, charge = answer.status, answer.charge
    detail = {"attempt": attempt, "charge_id": charge.id} | _try(answer, row)
    if status == was == "processing":  # the bank has not settled it: look again later
        if not run.dry_run:
            async with run.pool.acquire() as conn:
                await conn.execute(_STILL_PROCESSING, *key, attempt)
        run.report.add("unknown_outcomes", Finding(*key, "still processing", detail))
        return
    if run.dry_run:
        run.settled.add(key)
        action = f"would record {status}"
    elif await _settle_found(run, key, attempt, answer, lookup=charge.status):
        run.report.counts.unknown_resolved += 1
        action = f"recorded {status}"
    else:
        action = "taken by a worker: left alone"
    run.report.add("unknown_outcomes", Finding(*key, action, detail))


async def lost_messages(run: Sweeper) -> None:
    """Quiet, unleased `scheduled`/`pending` rows whose message no longer waits in
    the stream (`_QUIET`): a broker that lost it, or a ledger that forgot what a worker did
    (a failover). Each is looked up first: a charge (or a decline) the gateway made is
    recorded, not made again (a gateway without idempotency would charge twice); else the
    row is re-published with a fresh `Nats-Msg-Id` and its quiet clock restarts."""
    position = await run.publisher.position()
    where = (run.quiet_s, position.ack_floor, position.first_seq, list(position.deleted))
    run.report.counts.still_waiting = await run.conn.fetchval(_STILL_WAITING, *where)
    done = 0

    async def one(row: asyncpg.Record) -> None:
        nonlocal done
        key = (row["order_id"], row["billing_period"])
        if key not in run.settled and idempotency_key(*key) not in run.failed:
            with run.each("lost_messages", idempotency_key(*key)):
                await _recover(run, key, row)
        done += 1
        run.tick("lost messages", done)

    async for rows in _quiet_rows(run, _QUIET, *where):
        await run.together(rows, one)


async def _recover(run: Sweeper, key: Key, row: asyncpg.Record) -> None:
    answer = found(await _ours(run, key, row), row["current_try"], run.retry_schedule)
    if answer is None:
        await _republish(run, key, row)
        return
    status, charge = answer.status, answer.charge
    detail = {"status": row["status"], "charge_id": charge.id} | _try(answer, row)
    if run.dry_run:
        run.settled.add(key)
        action = f"would record {status} (found at the gateway)"
    elif await _settle_found(
        run,
        key,
        row["attempt"],
        answer,
        lookup=charge.status,
        how="its message was gone; the gateway had it",
    ):
        run.report.counts.adopted += 1
        action = f"recorded {status} (found at the gateway)"
    else:
        action = "taken by a worker: left alone"
    run.report.add("lost_messages", Finding(*key, action, detail))


def _message(row: asyncpg.Record) -> ChargeDue:
    """The contract body rebuilt from a ledger row, for the row's current try (`attempt`);
    `due_at` defaults to the period's start."""
    period: dt.date = row["billing_period"]
    due_at = row["due_at"] or dt.datetime.combine(period, dt.time(), tzinfo=dt.UTC)
    fields = ("order_id", "subscription_id", "customer_id", "amount_minor", "currency")
    try:
        return ChargeDue.model_validate(
            {"schema": SCHEMA, "billing_period": period, "due_at": due_at}
            | {name: row[name] for name in fields}
            | {"attempt": row["current_try"]}
        )
    except ValidationError as error:
        why = error.errors()[0]["msg"]
        raise PoisonMessage(f"the row makes no valid {SCHEMA} message: {why}") from error


async def _republish(run: Sweeper, key: Key, row: asyncpg.Record) -> None:
    body = _message(row).to_json()
    detail: dict[str, Any] = {"status": row["status"], "quiet_since": stamp(row["updated_at"])}
    if run.dry_run:
        run.report.add("lost_messages", Finding(*key, "would re-publish", detail))
        return
    # fresh each run: the producer's `charge:<key>` may still sit in the dedup window
    msg_id = f"reconcile:{key[0]}:{key[1].isoformat()}:{int(time.time())}"
    seq = await run.publisher.republish(body, msg_id, traceparent=row["traceparent"])
    run.report.counts.republished += 1
    detail |= {"stream_seq": seq, "msg_id": msg_id}
    async with run.pool.acquire() as conn, conn.transaction():
        await conn.execute(_TOUCH, *key, row["status"], row["attempt"], seq)
        why = f"{row['status']} and quiet since {detail['quiet_since']}"
        await run.event(conn, key, "republished", why=why, stream_seq=seq, msg_id=msg_id)
    run.report.add("lost_messages", Finding(*key, "re-published", detail))


def _try(answer: Found, row: asyncpg.Record) -> dict[str, Any]:
    """The try a charge found was made by, when it is not try 1; a decline's schedule."""
    detail: dict[str, Any] = {}
    if answer.charge.attempt != 1 or row["current_try"] != 1:
        detail["try"] = answer.charge.attempt
    if answer.retry_in_s is not None:
        detail["retry_in_s"] = answer.retry_in_s
    if answer.exhausted:
        detail["exhausted"] = True
    return detail


async def _settle_found(run: Sweeper, key: Key, attempt: int, answer: Found, **detail: Any) -> bool:
    """Record what a lookup found for an open row (guarded); False if a worker took it."""
    charge, declined = answer.charge, answer.status in DECLINE_STATES
    error = f"declined: charge {charge.id} failed (reconcile)" if declined else None
    async with run.pool.acquire() as conn:
        return await run.settle(
            conn,
            key,
            attempt,
            answer.status,
            charge_id=None if declined else charge.id,
            error=error,
            decline_code=charge.decline_code if declined else None,
            retry_in_s=answer.retry_in_s,
            **detail,
        )
