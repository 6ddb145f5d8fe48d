"""The two sweeps that start from the gateway's charges: double charges and discrepancies.

A key's history page can be stale (a worker charged since) or cut by the window (charged
before it), so every decision here is made on the key's own, current lookup
(`GET /v1/charges?order_id=…&billing_period=…`), never on the page alone.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg

from charge_worker.errors import PermanentError
from charge_worker.gateway import GatewayCharge
from charge_worker.messages import idempotency_key
from charge_worker.reconcile.history import History, patiently
from charge_worker.reconcile.report import Finding
from charge_worker.reconcile.sweeps import CHARGED, Key, Sweeper

_ROW = """
SELECT status, gateway_charge_id, attempt, (lease_until IS NULL OR lease_until < now()) AS free
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

_SETTLED_SINCE = """
SELECT order_id, billing_period, gateway_charge_id FROM charge_attempts
 WHERE status = 'succeeded' AND coalesce(settled_at, updated_at) >= $1
 ORDER BY order_id, billing_period
"""

# One `discrepancy` event per ledger charge, not one per run every 15 minutes.
_REPORTED = """
SELECT EXISTS (SELECT 1 FROM charge_events
                WHERE order_id = $1 AND billing_period = $2 AND kind = 'discrepancy'
                  AND detail->>'ledger_charge_id' = $3)
"""


def _key(order_id: str, billing_period: str) -> Key:
    try:
        return int(order_id), dt.date.fromisoformat(billing_period)
    except ValueError as error:
        raise PermanentError("its metadata is no order_id and billing_period") from error


async def double_charges(run: Sweeper, history: History) -> None:
    """Sweep 1: for every key with more than one `succeeded` charge, keep the one the
    ledger records (or else the earliest, recorded in an open, unleased row now) and
    refund all the others (`Idempotency-Key: refund:<charge id>`; "already" is done)."""
    for (order_id, period), ids in history.succeeded.items():
        if len(ids) > 1:
            with run.each("double_charges", f"{order_id}:{period}"):
                await _double(run, _key(order_id, period))


async def _double(run: Sweeper, key: Key) -> None:
    found = await patiently(run.gateway.lookup, *key)
    succeeded = [c for c in found if c.status == "succeeded"]
    if len(succeeded) < 2:  # refunded since the page was read
        return
    row = await run.conn.fetchrow(_ROW, *key)
    recorded = row["gateway_charge_id"] if row else None
    keep = next((c for c in succeeded if c.id == recorded), succeeded[0])
    extras = [c.id for c in succeeded if c.id != keep.id]
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


async def discrepancies(run: Sweeper, history: History, *, since: dt.datetime) -> None:
    """Sweep 4: report `succeeded` rows settled since `since` whose charge the gateway
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
    if any(c.id == charge_id and c.status in CHARGED for c in found):
        return  # charged before the window, or after the page was read
    gateway = [f"{c.id} {c.status}" for c in found] or "nothing for this key"
    run.report.counts.discrepancies += 1
    detail = {"ledger_charge_id": charge_id, "gateway": gateway}
    run.report.add("discrepancies", Finding(*key, "ledger charged, gateway not", detail))
    if not run.dry_run and not await run.conn.fetchval(_REPORTED, *key, charge_id):
        await run.event(key, "discrepancy", what="ledger succeeded, gateway lacks it", **detail)
