"""`succeeded` ledger rows whose charge the gateway does not show: reported, never repaired
by charging (a person decides).

Each history page marks the rows whose recorded charge it shows
(`charge_attempts.gateway_seen_charge_id`, one statement per page), and so does a lookup
that shows it. What is left are the rows no page or lookup has shown yet: the partial
index `charge_attempts_unseen_idx` holds only those, so this sweep reads them and not the
ledger. Each settled before the run began (a later one may be on the next run's pages)
and inside the window is looked up: a charge made before the window, or recorded after
its page was read, is marked then; one the gateway does not have for the key is reported,
every run, with one `discrepancy` event ever; once a person has reviewed it
(`reconcile resolve`), as `reviewed` instead (its alert clears).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import asyncpg

from charge_worker.gateway import GatewayCharge
from charge_worker.messages import idempotency_key
from charge_worker.reconcile import reviews
from charge_worker.reconcile.candidates import Key
from charge_worker.reconcile.report import Finding
from charge_worker.reconcile.sweeper import BATCH, Db, Sweeper

# $1 <= settled < $2, after the keyset ($3, $4, $5), $6 at a time
UNSEEN = """
SELECT order_id, billing_period, gateway_charge_id,
       coalesce(settled_at, updated_at) AS settled
  FROM charge_attempts
 WHERE status = 'succeeded' AND gateway_seen_charge_id IS DISTINCT FROM gateway_charge_id
   AND coalesce(settled_at, updated_at) >= $1 AND coalesce(settled_at, updated_at) < $2
   AND (coalesce(settled_at, updated_at), order_id, billing_period) > ($3, $4, $5)
 ORDER BY coalesce(settled_at, updated_at), order_id, billing_period
 LIMIT $6
"""

# The rows of a page's keys whose recorded charge the page shows (made, refunded or not).
_SHOWN = """
UPDATE charge_attempts AS a SET gateway_seen_charge_id = k.charge_id
  FROM unnest($1::bigint[], $2::date[], $3::text[]) AS k(order_id, billing_period, charge_id)
 WHERE a.order_id = k.order_id AND a.billing_period = k.billing_period
   AND a.status = 'succeeded' AND a.gateway_charge_id = k.charge_id
"""
_SHOWN_ONE = """
UPDATE charge_attempts SET gateway_seen_charge_id = $3
 WHERE order_id = $1 AND billing_period = $2 AND status = 'succeeded'
   AND gateway_charge_id = $3
"""

_REPORTED = """
SELECT EXISTS (SELECT 1 FROM charge_events
                WHERE order_id = $1 AND billing_period = $2 AND kind = 'discrepancy'
                  AND detail->>'ledger_charge_id' = $3)
"""


async def shown(run: Sweeper, rows: Sequence[tuple[Key, str]]) -> None:
    """Mark the rows a history page shows (a dry run only remembers them)."""
    if run.dry_run:
        run.shown.update(key for key, _ in rows)
    elif rows:
        keys = [key for key, _ in rows]
        await run.conn.execute(
            _SHOWN, [k[0] for k in keys], [k[1] for k in keys], [c for _, c in rows]
        )


async def discrepancies(run: Sweeper, *, settled_from: dt.datetime, until: dt.datetime) -> None:
    """Look up every `succeeded` row settled in [settled_from, until) that no
    history page or lookup has shown; report those the gateway does not have as charged
    for that key."""
    after: tuple[dt.datetime, int, dt.date] = (settled_from, 0, dt.date.min)
    done = 0

    async def one(row: asyncpg.Record) -> None:
        nonlocal done
        key = (row["order_id"], row["billing_period"])
        if key not in run.shown:
            with run.each("discrepancies", idempotency_key(*key)):
                await _confirm(run, key, row["gateway_charge_id"])
        done += 1
        run.tick("discrepancies", done)

    while rows := await run.conn.fetch(UNSEEN, settled_from, until, *after, BATCH):
        await run.together(rows, one)
        last = rows[-1]
        after = (last["settled"], last["order_id"], last["billing_period"])


async def shown_once(run: Sweeper, conn: Db, key: Key, charge_id: str) -> None:
    """Mark the row whose charge a lookup shows (a dry run only remembers it)."""
    if run.dry_run:
        run.shown.add(key)
    else:
        await conn.execute(_SHOWN_ONE, *key, charge_id)


async def _confirm(run: Sweeper, key: Key, charge_id: str) -> None:
    found = await run.lookup(key)
    async with run.pool.acquire() as conn:
        if any(c.id == charge_id and c.charged for c in found):
            # charged before the window, or recorded after its page was read
            await shown_once(run, conn, key, charge_id)
            return
        await _report(run, conn, key, charge_id, found)


async def _report(
    run: Sweeper, conn: Db, key: Key, charge_id: str, found: list[GatewayCharge]
) -> None:
    """A discrepancy, or, once a person has reviewed it (`reconcile resolve`), `reviewed`."""
    gateway = [f"{c.id} {_state(c)}" for c in found] or "nothing for this key"
    detail = {"ledger_charge_id": charge_id, "gateway": gateway}
    if looked := await reviews.reviewed(conn, key, "discrepancy", [charge_id]):
        for finding in reviews.findings(key, "discrepancy", {charge_id: charge_id}, looked):
            run.report.add("reviewed", finding)
        run.report.reviewed += 1
        return
    run.report.counts.discrepancies += 1
    run.report.add("discrepancies", Finding(*key, "ledger charged, gateway not", detail))
    if not run.dry_run and not await conn.fetchval(_REPORTED, *key, charge_id):
        what = "ledger succeeded, gateway lacks it"
        await run.event(conn, key, "discrepancy", what=what, **detail)


def _state(charge: GatewayCharge) -> str:
    return "refunded" if charge.charged and not charge.captured else charge.status
