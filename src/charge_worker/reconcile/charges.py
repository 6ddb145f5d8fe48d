"""The sweeps that start from the gateway's charges: doubles, unrecorded charges, and
discrepancies (the two kinds a person decides).

A key's history page can be stale (a worker charged since) or cut by the window (charged
before it), so every decision here is made on the key's own, current lookup
(`GET /v1/charges?order_id=…&billing_period=…`), never on the page alone. What may be
refunded or recorded without a person is decided in `proof.py`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg

from charge_worker.errors import PermanentError
from charge_worker.gateway import GatewayCharge
from charge_worker.messages import idempotency_key
from charge_worker.periods import on_schedule
from charge_worker.reconcile import proof
from charge_worker.reconcile.history import History, patiently
from charge_worker.reconcile.report import Finding
from charge_worker.reconcile.sweeps import Key, Sweeper

_ROW = """
SELECT status, gateway_charge_id, attempt, fingerprint, last_error,
       (lease_until IS NULL OR lease_until < now()) AS free
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

_SETTLED_SINCE = """
SELECT order_id, billing_period, gateway_charge_id FROM charge_attempts
 WHERE status = 'succeeded' AND coalesce(settled_at, updated_at) >= $1
 ORDER BY order_id, billing_period
"""

_SAID_NO = """
SELECT order_id, billing_period FROM charge_attempts
 WHERE (order_id, billing_period) IN (SELECT * FROM unnest($1::bigint[], $2::date[]))
   AND status IN ('declined', 'failed', 'blocked')
 ORDER BY order_id, billing_period
"""

# Guarded by the status and fence read before: a replay that revived the row wins.
_RECORD = """
UPDATE charge_attempts
   SET status = 'succeeded', gateway_charge_id = $5, last_error = NULL, settled_at = now(),
       updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status = $3 AND attempt = $4
"""

_MISSING = """
SELECT k.order_id, k.billing_period
  FROM unnest($1::bigint[], $2::date[]) AS k(order_id, billing_period)
 WHERE NOT EXISTS (SELECT 1 FROM charge_attempts AS a
                    WHERE a.order_id = k.order_id AND a.billing_period = k.billing_period)
 ORDER BY 1, 2
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
                             gateway_charge_id, settled_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'succeeded', $9, now())
ON CONFLICT DO NOTHING
RETURNING 1
"""

# One `discrepancy` event per charge, not one per run every 15 minutes.
_REPORTED = """
SELECT EXISTS (SELECT 1 FROM charge_events
                WHERE order_id = $1 AND billing_period = $2 AND kind = 'discrepancy'
                  AND detail->>$3 = $4)
"""
MAX_ORDER_ID = 2**63 - 1  # bigint


def _key(order_id: str, billing_period: str) -> Key:
    try:
        return int(order_id), dt.date.fromisoformat(billing_period)
    except ValueError as error:
        raise PermanentError("its metadata is no order_id and billing_period") from error


def _ours(order_id: str, billing_period: str) -> Key | None:
    """The key a charge's metadata names, or None when it could name no ledger row."""
    try:
        key = _key(order_id, billing_period)
    except PermanentError:
        return None
    return key if 0 < key[0] <= MAX_ORDER_ID else None


def _ledger_row(row: asyncpg.Record | None) -> proof.LedgerRow | None:
    if row is None:
        return None
    return proof.LedgerRow(row["status"], row["fingerprint"], row["gateway_charge_id"])


async def forgotten_charges(run: Sweeper, history: History) -> None:
    """Sweep 1: captured charges for keys with no ledger row at all: a database failover
    forgot the producer's row and the worker's claim, and the message was acked. Recorded
    `succeeded` from the key's subscription when the charge matches it (amount, currency,
    customer) and the period is on its schedule, so neither the producer's next run nor a
    re-published message charges the key again; any other charge is for a person."""
    keys = [key for key in (_ours(*pair) for pair in history.captured) if key is not None]
    rows = await run.conn.fetch(_MISSING, [k[0] for k in keys], [k[1] for k in keys])
    for done, row in enumerate(rows, 1):
        run.tick("forgotten charges", done, len(rows))
        key = (row["order_id"], row["billing_period"])
        with run.each("forgotten_charges", idempotency_key(*key)):
            await _forgotten(run, key)


async def _forgotten(run: Sweeper, key: Key) -> None:
    captured = [c for c in await patiently(run.gateway.lookup, *key) if c.captured]
    sub = await run.conn.fetchrow(_SUBSCRIPTION, key[0])
    schedule = sub and (sub["anchor"], sub["billing_interval"], sub["billing_interval_count"])
    if sub is None or not schedule or not on_schedule(schedule[0], key[1], *schedule[1:]):
        await _unmatched(run, key, None, captured)
        return
    matching = [c for c in captured if c.fingerprint == sub["fingerprint"]]
    await _unmatched(run, key, None, [c for c in captured if c not in matching])
    if not matching:
        return
    charge = matching[0]  # the earliest; a later matching one is a double, refunded next
    detail = {"charge_id": charge.id, "subscription_id": sub["subscription_id"]}
    if run.dry_run:
        run.settled.add(key)
        run.report.add("forgotten_charges", Finding(*key, "would record succeeded", detail))
        return
    due_at = dt.datetime.combine(key[1], dt.time(), dt.UTC)
    fields = (sub["subscription_id"], sub["customer_id"], sub["amount_minor"], sub["currency"])
    async with run.conn.transaction():
        adopted = await run.conn.fetchval(
            _ADOPT, *key, idempotency_key(*key), *fields, due_at, charge.id
        )
        if adopted:
            how = "the ledger had no row (lost with a database failover); the gateway charged it"
            await run.event(key, "resolved", status="succeeded", charge_id=charge.id, how=how)
    run.settled.add(key)
    run.report.counts.adopted_rows += bool(adopted)
    action = "recorded succeeded" if adopted else "claimed by a worker meanwhile: left alone"
    run.report.add("forgotten_charges", Finding(*key, action, detail))


async def double_charges(run: Sweeper, history: History) -> None:
    """Sweep 2: for every key with more than one charge still captured, keep the one the
    ledger records (or else the earliest matching its row, recorded in an open, unleased
    row now) and refund the other charges that match the row (`Idempotency-Key:
    refund:<charge id>`; "already" is done). Charges not proven the key's are unmatched."""
    for (order_id, period), ids in history.captured.items():
        if len(ids) > 1:
            with run.each("double_charges", f"{order_id}:{period}"):
                await _double(run, _key(order_id, period))


async def _double(run: Sweeper, key: Key) -> None:
    found = await patiently(run.gateway.lookup, *key)
    row = await run.conn.fetchrow(_ROW, *key)
    ledger = _ledger_row(row)
    sorted_out = proof.doubles([c for c in found if c.captured], ledger)
    await _unmatched(run, key, ledger, sorted_out.unmatched)
    keep, extras = sorted_out.keep, [c.id for c in sorted_out.refund]
    if keep is None or not extras:  # refunded since the page was read, or not ours to judge
        return
    run.report.counts.double_charges += len(extras)
    detail: dict[str, Any] = {"kept": keep.id, "ledger": await _keep(run, key, row, keep)}
    if run.dry_run:
        run.report.add("double_charges", Finding(*key, "would refund", detail | {"extra": extras}))
        return
    refunded = []
    for charge_id in extras:  # one refund failing does not hold back the others
        with run.each("double_charges", idempotency_key(*key)):
            refund_id = await patiently(run.gateway.refund, charge_id)
            refunded.append(charge_id)
            run.report.counts.refunds += 1
            await run.event(
                key,
                "refund",
                charge_id=charge_id,
                refund_id=refund_id,
                reason="duplicate",
                kept=keep.id,
            )
    action = "refunded" if len(refunded) == len(extras) else "partly refunded"
    run.report.add("double_charges", Finding(*key, action, detail | {"refunded": refunded}))


async def _keep(run: Sweeper, key: Key, row: asyncpg.Record | None, keep: GatewayCharge) -> str:
    """Make the ledger name the kept charge where that is safe; say what it says."""
    if row is None:
        return "no ledger row"
    if row["gateway_charge_id"] == keep.id:
        return "recorded"
    if row["status"] not in ("scheduled", "pending"):
        return f"{row['status']} with {row['gateway_charge_id'] or 'no charge'}: left alone"
    if not row["free"]:
        # a worker that looks up will find the earliest too; it is kept at the gateway
        return "leased by a live worker: left alone"
    if run.dry_run:
        run.settled.add(key)
        return "would record"
    how = "double charge: the earliest kept"
    recorded = await run.settle(key, row["attempt"], "succeeded", keep.id, None, how=how)
    return "recorded now" if recorded else "taken by a worker: left alone"


async def unrecorded_charges(run: Sweeper, history: History) -> None:
    """Sweep 3: keys the gateway shows a captured charge for while their ledger row is
    `declined`, `failed` or `blocked` (the customer paid; the ledger says no). A charge that
    matches the row is recorded (`succeeded`, with a `resolved` event); others are for a
    person."""
    keys = [key for key in (_ours(*pair) for pair in history.captured) if key is not None]
    rows = await run.conn.fetch(_SAID_NO, [k[0] for k in keys], [k[1] for k in keys])
    for done, row in enumerate(rows, 1):
        run.tick("unrecorded charges", done, len(rows))
        key = (row["order_id"], row["billing_period"])
        with run.each("unrecorded_charges", idempotency_key(*key)):
            await _unrecorded(run, key)


async def _unrecorded(run: Sweeper, key: Key) -> None:
    found = await patiently(run.gateway.lookup, *key)
    row = await run.conn.fetchrow(_ROW, *key)
    ledger = _ledger_row(row)
    if row is None or ledger is None or ledger.status not in proof.SAID_NO:
        return  # revived by a replay meanwhile: the worker looks it up
    sorted_out = proof.unrecorded([c for c in found if c.captured], ledger)
    await _unmatched(run, key, ledger, sorted_out.unmatched)
    charge = sorted_out.keep
    if charge is None:
        return
    run.report.counts.unrecorded_charges += 1
    detail = {"charge_id": charge.id, "was": ledger.status}
    if run.dry_run:
        run.settled.add(key)
        action = "would record succeeded"
    elif await _record(run, key, row, charge):
        run.report.counts.ledger_repaired += 1
        action = "recorded succeeded"
    else:
        action = "changed meanwhile: left alone"
    run.report.add("unrecorded_charges", Finding(*key, action, detail))


async def _record(run: Sweeper, key: Key, row: asyncpg.Record, charge: GatewayCharge) -> bool:
    """The guarded write, with its `resolved` event; False if the row changed since read."""
    async with run.conn.transaction():
        result = await run.conn.execute(_RECORD, *key, row["status"], row["attempt"], charge.id)
        if result != "UPDATE 1":
            return False
        await run.event(
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


async def _unmatched(
    run: Sweeper, key: Key, ledger: proof.LedgerRow | None, charges: list[GatewayCharge]
) -> None:
    """Report captured charges reconcile may neither refund nor record, for a person (once
    per run, one `discrepancy` event per charge ever)."""
    new = [c for c in charges if c.id not in run.unmatched]
    if not new:
        return
    run.unmatched.update(c.id for c in new)
    run.report.counts.unmatched_charges += len(new)
    said = ledger.describe() if ledger else "no ledger row"
    detail = {"ledger": said, "charges": [f"{c.id} {c.fingerprint}" for c in new]}
    run.report.add("unmatched_charges", Finding(*key, "left for a person", detail))
    if run.dry_run:
        return
    for charge in new:
        if not await run.conn.fetchval(_REPORTED, *key, "charge_id", charge.id):
            what = "captured at the gateway, not proven this key's charge: not refunded"
            await run.event(
                key,
                "discrepancy",
                what=what,
                charge_id=charge.id,
                charge=charge.fingerprint,
                ledger=said,
            )


async def discrepancies(run: Sweeper, history: History, *, since: dt.datetime) -> None:
    """Sweep 6: report `succeeded` rows settled since `since` whose charge the gateway
    does not have as charged for that key. Never repaired by charging: a human decides."""
    rows = await run.conn.fetch(_SETTLED_SINCE, since)
    for done, row in enumerate(rows, 1):
        run.tick("discrepancies", done, len(rows))
        key = (row["order_id"], row["billing_period"])
        if not history.charged(row["gateway_charge_id"], *key):
            with run.each("discrepancies", idempotency_key(*key)):
                await _confirm(run, key, row["gateway_charge_id"])


async def _confirm(run: Sweeper, key: Key, charge_id: str) -> None:
    found = await patiently(run.gateway.lookup, *key)
    if any(c.id == charge_id and c.charged for c in found):
        return  # charged before the window, or after the page was read
    gateway = [f"{c.id} {_state(c)}" for c in found] or "nothing for this key"
    run.report.counts.discrepancies += 1
    detail = {"ledger_charge_id": charge_id, "gateway": gateway}
    run.report.add("discrepancies", Finding(*key, "ledger charged, gateway not", detail))
    if not run.dry_run and not await run.conn.fetchval(
        _REPORTED, *key, "ledger_charge_id", charge_id
    ):
        await run.event(key, "discrepancy", what="ledger succeeded, gateway lacks it", **detail)


def _state(charge: GatewayCharge) -> str:
    return "refunded" if charge.charged and not charge.captured else charge.status
