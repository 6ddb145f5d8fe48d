"""One candidate key decided: its forgotten row, its double charges, its unrecorded charge,
and the charges left for a person.

A history page only says which keys to look at (`candidates.py`): it can be stale (a
worker charged since) or cut by the window (charged before it), so every decision here is
made on the key's own, current lookup (`GET /v1/charges?order_id=…&billing_period=…`),
one per key and run, never on the page. What may be refunded or recorded without a
person is decided in `proof.py`. In order, as the sweeps ran before:

| the key's row                  | decision                                              |
|--------------------------------|-------------------------------------------------------|
| none (a failover forgot it)    | the charge its subscription proves is recorded        |
| any, > 1 charge captured       | the kept one recorded if the row is open; the proven  |
|                                | doubles refunded                                      |
| declined, failed, blocked,     | the matching charge (of any try) is recorded: a       |
| retry_scheduled,               | period that holds money is never tried again          |
| action_required                |                                                       |
| any                            | charges not proven the key's (another amount,         |
|                                | currency or customer): reported for a person, never   |
|                                | recorded; an open row stays open for the due charge   |
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg

from charge_worker.gateway import GatewayCharge
from charge_worker.messages import idempotency_key
from charge_worker.periods import on_schedule
from charge_worker.reconcile import discrepancies, proof
from charge_worker.reconcile.candidates import OPEN, Key
from charge_worker.reconcile.followups import Reason
from charge_worker.reconcile.report import Finding, Sweep
from charge_worker.reconcile.sweeper import Db, Sweeper

_ROW = """
SELECT status, gateway_charge_id, gateway_seen_charge_id, attempt, fingerprint, last_error,
       (lease_until IS NULL OR lease_until < now()) AS free
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

# Guarded by the status and fence read before: a replay that revived the row, or a retry
# started meanwhile, wins. A period that holds money is tried no more (`retry_at` goes).
_RECORD = """
UPDATE charge_attempts
   SET status = 'succeeded', gateway_charge_id = $5, gateway_seen_charge_id = $5,
       last_error = NULL, retry_at = NULL, settled_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status = $3 AND attempt = $4
"""

_SUBSCRIPTION = """
SELECT subscription_id, customer_id, amount_minor, currency,
       amount_minor::text || ' ' || currency || ' ' || customer_id AS fingerprint,
       coalesce(billing_anchor, next_billing_date) AS anchor, billing_interval,
       billing_interval_count
  FROM subscriptions WHERE order_id = $1
"""

# A worker that claimed the key meanwhile wins (ON CONFLICT): it looks the key up anyway.
_ADOPT = """
INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
                             customer_id, amount_minor, currency, due_at, status,
                             gateway_charge_id, gateway_seen_charge_id, settled_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'succeeded', $9, $9, now())
ON CONFLICT DO NOTHING
RETURNING 1
"""


def _ledger_row(row: asyncpg.Record | None) -> proof.LedgerRow | None:
    if row is None:
        return None
    return proof.LedgerRow(row["status"], row["fingerprint"], row["gateway_charge_id"])


def _sweep(row: asyncpg.Record | None) -> Sweep:
    """The sweep a key's failure is reported under, from its row before the lookup."""
    if row is None:
        return "forgotten_charges"
    return "unrecorded_charges" if row["status"] in proof.SAID_NO else "double_charges"


async def decide(run: Sweeper, key: Key) -> Reason | None:
    """Decide one candidate key on its own lookup; return why the next runs must look at
    it again (`followups.py`), or None when nothing is left to do about it."""
    name = idempotency_key(*key)
    async with run.pool.acquire() as conn:
        found: list[GatewayCharge] | None = None
        with run.each(_sweep(await conn.fetchrow(_ROW, *key)), name):
            found = await run.lookup(key, conn=conn)
        if found is None:
            return "failed"
        for_a_person = await _decide(run, conn, key, found)
        row = await conn.fetchrow(_ROW, *key)
    if name in run.failed:
        return "failed"
    if row is not None and row["status"] in OPEN and key not in run.settled:
        return "open"
    return "unmatched" if for_a_person else None


async def _decide(run: Sweeper, conn: Db, key: Key, found: list[GatewayCharge]) -> bool:
    """The sweeps in their order, on one lookup; True if charges are left for a person."""
    name, person = idempotency_key(*key), False
    captured = [c for c in found if c.captured]
    row = await conn.fetchrow(_ROW, *key)
    ledger = _ledger_row(row)
    if row is None:
        recorded_now: proof.LedgerRow | None = None  # stays None when the key fails
        with run.each("forgotten_charges", name):
            person, recorded_now = await _forgotten(run, conn, key, captured)
        row = await conn.fetchrow(_ROW, *key)  # a worker's claim meanwhile is the row too
        ledger = _ledger_row(row) if row is not None else recorded_now
    refunded: list[str] = []
    if len(captured) > 1:
        with run.each("double_charges", name):
            person |= await _double(run, conn, key, captured, row, ledger=ledger, refunded=refunded)
    if row is not None and row["status"] in proof.SAID_NO:
        left = [c for c in captured if c.id not in refunded]
        with run.each("unrecorded_charges", name):
            person |= await _unrecorded(run, conn, key, left)
    elif ledger is not None and row is not None and len(captured) < 2:
        # one charge, not the row's: someone else's with our metadata, never the payment
        with run.each("unmatched_charges", name):
            foreign = proof.split(captured, ledger).foreign
            person |= await run.for_a_person(conn, key, ledger, foreign)
    recorded: str | None = row["gateway_charge_id"] if row is not None else None
    if (
        row is not None
        and recorded is not None
        and row["status"] == "succeeded"
        and row["gateway_seen_charge_id"] != recorded
        and any(c.id == recorded and c.charged for c in found)
    ):
        await discrepancies.shown_once(run, conn, key, recorded)
    return person


async def _forgotten(
    run: Sweeper, conn: Db, key: Key, captured: list[GatewayCharge]
) -> tuple[bool, proof.LedgerRow | None]:
    """Captured charges for a key with no ledger row at all: a database failover forgot
    the producer's row and the worker's claim, and the message was acked. Recorded
    `succeeded` from the key's subscription when the charge matches it (amount, currency,
    customer) and the period is on its schedule, so neither the producer's next run nor a
    re-published message charges the key again; any other charge is for a person.
    Whether charges are left for a person, and the row recorded (in a dry run: that the
    run would record, so that the dry run proves the same doubles)."""
    sub = await conn.fetchrow(_SUBSCRIPTION, key[0])
    schedule = sub and (sub["anchor"], sub["billing_interval"], sub["billing_interval_count"])
    if sub is None or not schedule or not on_schedule(schedule[0], key[1], *schedule[1:]):
        return await run.for_a_person(conn, key, None, captured), None
    matching = [c for c in captured if c.fingerprint == sub["fingerprint"]]
    person = await run.for_a_person(conn, key, None, [c for c in captured if c not in matching])
    if not matching:
        return person, None
    charge = matching[0]  # the earliest; a later matching one is a double, refunded next
    detail = {"charge_id": charge.id, "subscription_id": sub["subscription_id"]}
    recorded = proof.LedgerRow("succeeded", sub["fingerprint"], charge.id)
    if run.dry_run:
        run.settled.add(key)
        run.report.add("forgotten_charges", Finding(*key, "would record succeeded", detail))
        return person, recorded
    due_at = dt.datetime.combine(key[1], dt.time(), dt.UTC)
    fields = (sub["subscription_id"], sub["customer_id"], sub["amount_minor"], sub["currency"])
    async with conn.transaction():
        adopted = await conn.fetchval(
            _ADOPT, *key, idempotency_key(*key), *fields, due_at, charge.id
        )
        if adopted:
            how = "the ledger had no row (lost with a database failover); the gateway charged it"
            await run.event(conn, key, "resolved", status="succeeded", charge_id=charge.id, how=how)
    run.settled.add(key)
    run.report.counts.adopted_rows += bool(adopted)
    action = "recorded succeeded" if adopted else "claimed by a worker meanwhile: left alone"
    run.report.add("forgotten_charges", Finding(*key, action, detail))
    return person, recorded


async def _double(
    run: Sweeper,
    conn: Db,
    key: Key,
    captured: list[GatewayCharge],
    row: asyncpg.Record | None,
    *,
    ledger: proof.LedgerRow | None,
    refunded: list[str],
) -> bool:
    """More than one charge still captured: keep the one the ledger records (or else the
    earliest matching its row, recorded in an open, unleased row now) and refund the
    other charges that match the row (`Idempotency-Key: refund:<charge id>`; "already" is
    done). Charges not proven the key's are unmatched. `ledger` is the row's proof (a dry
    run's row that would have been recorded, when `row` is None)."""
    sorted_out = proof.doubles(captured, ledger)
    person = await run.for_a_person(conn, key, ledger, sorted_out.unmatched)
    keep, extras = sorted_out.keep, [c.id for c in sorted_out.refund]
    if keep is None or not extras:  # refunded since the page was read, or not ours to judge
        return person
    run.report.counts.double_charges += len(extras)
    detail: dict[str, Any] = {"kept": keep.id, "ledger": await _keep(run, conn, key, row, keep)}
    if run.dry_run:
        run.report.add("double_charges", Finding(*key, "would refund", detail | {"extra": extras}))
        return person
    for charge_id in extras:  # one refund failing does not hold back the others
        with run.each("double_charges", idempotency_key(*key)):
            refund_id = await run.refund(charge_id)
            refunded.append(charge_id)
            run.report.counts.refunds += 1
            await run.event(
                conn,
                key,
                "refund",
                charge_id=charge_id,
                refund_id=refund_id,
                reason="duplicate",
                kept=keep.id,
            )
    action = "refunded" if len(refunded) == len(extras) else "partly refunded"
    run.report.add("double_charges", Finding(*key, action, detail | {"refunded": refunded}))
    return person


async def _keep(
    run: Sweeper, conn: Db, key: Key, row: asyncpg.Record | None, keep: GatewayCharge
) -> str:
    """Make the ledger name the kept charge where that is safe; say what it says."""
    if row is None:
        return "no ledger row"
    if row["gateway_charge_id"] == keep.id:
        return "recorded"
    if row["status"] not in OPEN:
        return f"{row['status']} with {row['gateway_charge_id'] or 'no charge'}: left alone"
    if not row["free"]:
        # a worker that looks up will find the earliest too; it is kept at the gateway
        return "leased by a live worker: left alone"
    if run.dry_run:
        run.settled.add(key)
        return "would record"
    how = "double charge: the earliest kept"
    recorded = await run.settle(
        conn, key, row["attempt"], "succeeded", charge_id=keep.id, error=None, how=how
    )
    return "recorded now" if recorded else "taken by a worker: left alone"


async def _unrecorded(run: Sweeper, conn: Db, key: Key, captured: list[GatewayCharge]) -> bool:
    """A captured charge (of any try) while the row is `declined`, `failed`, `blocked`,
    `retry_scheduled` or `action_required` (the customer paid; the ledger says no, or waits
    to try again: recording it moves the row out of `retry_scheduled`, so no next try
    starts). A charge that matches the row is recorded (`succeeded`,
    with a `resolved` event); others are for a person."""
    row = await conn.fetchrow(_ROW, *key)
    ledger = _ledger_row(row)
    if row is None or ledger is None or ledger.status not in proof.SAID_NO:
        return False  # revived by a replay meanwhile: the worker looks it up
    sorted_out = proof.unrecorded(captured, ledger)
    person = await run.for_a_person(conn, key, ledger, sorted_out.unmatched)
    charge = sorted_out.keep
    if charge is None:
        return person
    run.report.counts.unrecorded_charges += 1
    detail = {"charge_id": charge.id, "was": ledger.status}
    if run.dry_run:
        run.settled.add(key)
        action = "would record succeeded"
    elif await _record(run, conn, key, row, charge):
        run.report.counts.ledger_repaired += 1
        action = "recorded succeeded"
    else:
        action = "changed meanwhile: left alone"
    run.report.add("unrecorded_charges", Finding(*key, action, detail))
    return person


async def _record(
    run: Sweeper, conn: Db, key: Key, row: asyncpg.Record, charge: GatewayCharge
) -> bool:
    """The guarded write, with its `resolved` event; False if the row changed since read."""
    async with conn.transaction():
        result = await conn.execute(_RECORD, *key, row["status"], row["attempt"], charge.id)
        if result != "UPDATE 1":
            return False
        await run.event(
            conn,
            key,
            "resolved",
            status="succeeded",
            charge_id=charge.id,
            was=row["status"],
            last_error=row["last_error"],
            how=f"the gateway charged it; the ledger said {row['status']}",
        )
    run.settled.add(key)
    return True
