"""`charge-worker reconcile resolve ORDER_ID PERIOD --note TEXT`: a person has reviewed what
reconcile left for a person, so its alert clears.

Reconcile reports a key's discrepancy (its `succeeded` row's charge the gateway lacks) and
its unmatched charges (captured, not proven the key's own) on every run of its window, and
ChargeWorkerReconcileDiscrepancies / ChargeWorkerReconcileUnmatchedCharges fire while the
latest run counts one. `resolve` records who reviewed it, when, the note, and exactly what
was reviewed: the key's findings as they stand now (`reconcile_reviews`, one row per
charge), with a `reviewed` event in the charge's story. Later runs count those charges as
`reviewed`, not as discrepancies or unmatched charges; a charge found for the key later is
a new finding. A review changes what is reported, never the money: nothing is refunded or
recorded because of one.

The key's findings now: the charges of its `discrepancy` events (one per charge, written by
a real run) that reconcile still reports: a discrepancy while its row is still `succeeded`
with that charge, unshown, and settled inside the window; an unmatched charge told inside the
window. None: refused in one line (exit 1). All reviewed already: said, and exit 0 (the
first review stays).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import asyncpg
import click

from charge_worker import database, events, privileges
from charge_worker.database import translated
from charge_worker.display import printable
from charge_worker.messages import idempotency_key
from charge_worker.reconcile.candidates import Key
from charge_worker.reconcile.report import Finding
from charge_worker.settings import Settings

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

Kind = Literal["discrepancy", "unmatched"]
Db: TypeAlias = "asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"
KIND = "reviewed"  # the event in the charge's story

# what reconcile still reports for the key ($3: the window, in seconds)
_CURRENT = """
SELECT 'discrepancy' AS finding, e.detail->>'ledger_charge_id' AS charge_id
  FROM charge_events e
  JOIN charge_attempts a USING (order_id, billing_period)
 WHERE e.order_id = $1 AND e.billing_period = $2 AND e.kind = 'discrepancy'
   AND a.status = 'succeeded' AND a.gateway_charge_id = e.detail->>'ledger_charge_id'
   AND a.gateway_seen_charge_id IS DISTINCT FROM a.gateway_charge_id
   AND coalesce(a.settled_at, a.updated_at) >= now() - make_interval(secs => $3)
UNION
SELECT 'unmatched', detail->>'charge_id'
  FROM charge_events
 WHERE order_id = $1 AND billing_period = $2 AND kind = 'discrepancy'
   AND detail ? 'charge_id' AND at >= now() - make_interval(secs => $3)
"""
_REVIEWS = """
SELECT finding, charge_id, reviewed_by, reviewed_at, note FROM reconcile_reviews
 WHERE order_id = $1 AND billing_period = $2 AND finding = $3 AND charge_id = ANY($4::text[])
"""
_ALL_REVIEWS = """
SELECT finding, charge_id, reviewed_by, reviewed_at, note FROM reconcile_reviews
 WHERE order_id = $1 AND billing_period = $2
"""
# a resolve at the same time as this one: its rows stay, these are not written
_INSERT = """
INSERT INTO reconcile_reviews (order_id, billing_period, finding, charge_id, reviewed_by, note)
SELECT $1, $2, f, c, $5, $6 FROM unnest($3::text[], $4::text[]) AS u(f, c)
ON CONFLICT DO NOTHING
RETURNING finding, charge_id, reviewed_by, reviewed_at, note
"""

APPLICATION = "charge-worker reconcile resolve"


@dataclass(frozen=True)
class Review:
    """Who reviewed a charge, when, and what they noted."""

    by: str
    at: dt.datetime
    note: str

    def detail(self) -> dict[str, str]:
        stamp = self.at.astimezone(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return {"reviewed_by": self.by, "reviewed_at": stamp, "note": self.note}


def _review(row: asyncpg.Record) -> Review:
    return Review(row["reviewed_by"], row["reviewed_at"], row["note"])


async def reviewed(conn: Db, key: Key, kind: Kind, charge_ids: Sequence[str]) -> dict[str, Review]:
    """The reviews of these charges of the key, by charge id (none: an empty dict)."""
    if not charge_ids:
        return {}
    rows = await conn.fetch(_REVIEWS, *key, kind, list(charge_ids))
    return {row["charge_id"]: _review(row) for row in rows}


def findings(
    key: Key, kind: Kind, charges: Mapping[str, Any], reviews: Mapping[str, Review]
) -> list[Finding]:
    """The report's `reviewed` findings for the key: one per review, naming its charges
    (`charges`: every charge found, by id, as the report describes it)."""
    by_review: dict[Review, list[str]] = {}
    for charge_id, review in reviews.items():
        by_review.setdefault(review, []).append(charge_id)
    found = []
    for review, ids in by_review.items():
        what = [charges[charge_id] for charge_id in sorted(ids)]
        detail: dict[str, Any] = {"charges": what, **review.detail()}
        found.append(Finding(*key, f"{kind}, reviewed", detail))
    return found


async def resolve_command(
    settings: Settings,
    order_id: int,
    billing_period: dt.date,
    *,
    note: str,
    by: str,
    as_json: bool,
) -> int:
    """Record the review of the key's current findings; print it. Exit 0 when reviewed now
    or already; 1 when the key has nothing to review (one line on stderr, nothing written).
    An unreachable database, or a role lacking a grant, raises (one line, exit 1)."""
    key = (order_id, billing_period)
    name = idempotency_key(*key)
    conn = await database.connect(settings.db, application_name=APPLICATION)
    try:
        async with translated("reconcile resolve"):
            await privileges.require(conn, privileges.RESOLVE)
            async with conn.transaction():
                window_s = settings.reconcile.reconcile_window_s
                found = await conn.fetch(_CURRENT, *key, window_s)
                current = sorted({(r["finding"], r["charge_id"]) for r in found})
                rows = await conn.fetch(_ALL_REVIEWS, *key)
                known = {(r["finding"], r["charge_id"]) for r in rows}
                new = [finding for finding in current if finding not in known]
                written: list[asyncpg.Record] = []
                if new:
                    kinds, charges = zip(*new, strict=True)
                    written = await conn.fetch(_INSERT, *key, list(kinds), list(charges), by, note)
                if written:
                    await events.record(conn, *key, KIND, by, note=note, **_named(written))
                if len(written) < len(new):  # another resolve at once reviewed some
                    rows = await conn.fetch(_ALL_REVIEWS, *key)
    finally:
        await database.close_quietly(conn)
    if not current:
        click.echo(
            printable(
                f"Error: nothing to review for {name}: reconcile reports no discrepancy or"
                f" unmatched charge for it (run `charge-worker reconcile` first, or read"
                f" `charge-worker explain {order_id} {billing_period.isoformat()}`)"
            ),
            err=True,
        )
        return 1
    now = [(r["finding"], r["charge_id"], _review(r)) for r in written]
    done = {(kind, charge) for kind, charge, _ in now}
    reviews = {(r["finding"], r["charge_id"]): _review(r) for r in rows}
    before = [(k, c, reviews[k, c]) for k, c in current if (k, c) not in done]
    _print(name, now, before, as_json=as_json)
    return 0


def _named(rows: Sequence[asyncpg.Record]) -> dict[str, Any]:
    """The event's detail: the charges reviewed, by finding."""
    named: dict[str, Any] = {}
    for row in rows:
        named.setdefault(row["finding"], []).append(row["charge_id"])
    return named


def _print(
    name: str,
    now: Sequence[tuple[str, str, Review]],
    before: Sequence[tuple[str, str, Review]],
    *,
    as_json: bool,
) -> None:
    if as_json:
        document = {
            "key": name,
            "reviewed": [{"finding": k, "charge_id": c, **r.detail()} for k, c, r in now],
            "already_reviewed": [
                {"finding": k, "charge_id": c, **r.detail()} for k, c, r in before
            ],
            "exit_code": 0,
        }
        click.echo(json.dumps(document, ensure_ascii=False))
        return
    for kind, charge, review in now:
        click.echo(printable(f"reviewed {name} {kind} {charge} by {review.by}: {review.note}"))
    for kind, charge, review in before:
        d = review.detail()
        click.echo(
            printable(
                f"already reviewed {name} {kind} {charge} by {d['reviewed_by']} at"
                f" {d['reviewed_at']}: {d['note']}"
            )
        )
    if now:
        click.echo("the next reconcile run counts it as reviewed, not in its alerts")
