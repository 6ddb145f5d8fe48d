"""`charge-worker explain ORDER_ID PERIOD`: one charge's whole story, in time order.

The ledger row says where the charge stands, and its current try; `charge_tries` the
period's earlier tries (each declined); `charge_events` says how it got there
(scheduled, published, every delivery with its claim, scoring, lookup, gateway answer and
action, every gateway call, reconcile's repairs and findings, a person's review of them);
`--gateway` adds what the gateway holds.
Much of it came from message bodies and the gateway: each line is printed escaped
(`display.printable`), so that no escape sequence in it reaches the terminal.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
from typing import Any

import click

from charge_worker import events
from charge_worker.database import create_pool, translated
from charge_worker.display import printable
from charge_worker.gateway import AUTHENTICATION_REQUIRED, build_gateway, decline_kind
from charge_worker.messages import idempotency_key
from charge_worker.settings import Settings

_ROW = """
SELECT a.*, d.status AS check_status, d.reason AS check_reason
  FROM charge_attempts a
  LEFT JOIN deferred_scoring_checks d USING (order_id, billing_period)
 WHERE a.order_id = $1 AND a.billing_period = $2
"""
_HIDDEN = {"order_id", "billing_period", "fingerprint", "check_status", "check_reason"}
# the outbox keeps a sent event only for CHARGE_WORKER_OUTBOX_RETENTION_S: the period's
# count (`charge_attempts.outcome_seq`) tells how many there were
_OUTCOMES = """
SELECT sequence, type, occurred_at, sent_at, stream_seq, tries, last_error, next_try_at
  FROM charge_outcomes
 WHERE order_id = $1 AND billing_period = $2
 ORDER BY sequence
"""
# the period's earlier tries; the row holds the current one
_TRIES = """
SELECT try_no AS try, idempotency_key AS key, 'declined' AS status, gateway_charge_id,
       decline_code, decline_class, last_error, started_at, ended_at
  FROM charge_tries
 WHERE order_id = $1 AND billing_period = $2
 ORDER BY try_no
"""


async def explain_command(
    settings: Settings,
    order_id: int,
    billing_period: dt.date,
    *,
    as_json: bool,
    ask_gateway: bool,
) -> int:
    """Print the story; exit 1 when nothing at all is known about this charge."""
    pool = await create_pool(settings.db)
    try:
        async with translated("cannot read the ledger"):
            row = await pool.fetchrow(_ROW, order_id, billing_period)
            story = await events.story(pool, order_id, billing_period)
            kept = [dict(r) for r in await pool.fetch(_OUTCOMES, order_id, billing_period)]
            earlier = [dict(r) for r in await pool.fetch(_TRIES, order_id, billing_period)]
    finally:
        await pool.close()
    at_gateway: list[dict[str, Any]] = []
    if ask_gateway:
        gateway = build_gateway(settings.gateway)
        customer = row["customer_id"] if row is not None else None
        try:
            if customer is None and gateway.kind == "stripe":
                # Stripe lists charges per customer, and only the ledger row names it
                click.echo("the gateway was not asked: no ledger row names the customer", err=True)
            else:
                found = await gateway.lookup(
                    order_id, billing_period, customer_id=customer, since=_since(row)
                )
                at_gateway = [asdict(c) for c in found]
        finally:
            await gateway.aclose()
    key = idempotency_key(order_id, billing_period)
    if row is None and not story:
        click.echo(f"no charge {key} in the ledger or its story", err=True)
        return 1
    state = {k: v for k, v in dict(row or {}).items() if k not in _HIDDEN and v is not None}
    count = state.get("outcome_seq", len(kept))
    outcomes = {"count": count, "pruned": count - len(kept), "events": kept}
    tries = earlier + ([_current_try(row)] if row is not None else [])
    if as_json:
        document = {
            "key": key,
            "state": state,
            "tries": tries,
            "deferred_check": row and row["check_status"],
            "events": [asdict(e) for e in story],
            "outcomes": outcomes,
            "gateway": at_gateway if ask_gateway else None,
        }
        click.echo(json.dumps(document, default=str, indent=2))
        return 0
    if row is not None and row["check_status"]:
        state["deferred scoring check"] = f"{row['check_status']} ({row['check_reason']})"
    for line in [*_headline(key, state), *_try_lines(tries), "story:"]:
        _say(line)
    for event in story:
        when = _at(event.at)
        actor = printable(event.actor)
        _say(f"  {when}  {actor:<28.28}  {event.kind:<12}  {describe(event)}")
    for line in _outcome_lines(count, kept):
        _say(line)
    for line in _gateway_lines(at_gateway) if ask_gateway else []:
        _say(line)
    return 0


def _say(line: str) -> None:
    click.echo(printable(line))


def _headline(key: str, state: dict[str, Any]) -> list[str]:
    if not state:
        return [f"charge {key}: no ledger row (only events)"]
    money = f"{state['amount_minor']} {state['currency']}"
    charge = f" {state['gateway_charge_id']}" if "gateway_charge_id" in state else ""
    lines = [
        f"charge {key}: {state['status']}{charge}  {money}  customer {state['customer_id']}"
        f"  subscription {state['subscription_id']}",
        f"  claims {state['attempt']}, gateway calls "
        f"{state['gateway_calls']}, scoring {state.get('scoring', '-')}",
    ]
    if state["status"] == "retry_scheduled":
        lines.append(
            f"  retry scheduled: try {state['current_try'] + 1} is due at"
            f" {_at(state['retry_at'])} (the `produce` run after it starts it)"
        )
    elif state["status"] == "action_required":
        lines.append(
            "  action required: the customer must act; once they have,"
            " `charge-worker retry` starts the next try"
        )
    if state["status"] == "processing":
        lines.append(
            "  processing: the provider accepted it and the bank settles it later; nothing is"
            " sent again, its webhook or reconcile records the result"
        )
    if decline_kind(state.get("decline_code")) == AUTHENTICATION_REQUIRED:
        lines.append(
            f"  declined: {state['decline_code']}: the bank wants the customer present;"
            " ask them to pay or authenticate (e-mail them)"
        )
    elif "decline_code" in state:
        lines.append(f"  declined: {state['decline_code']}")
    if "lease_owner" in state:
        lines.append(f"  leased by {state['lease_owner']} until {state['lease_until']}")
    if "gateway_revision" in state:  # set by the webhook inbox
        lines.append(f"  gateway revision {state['gateway_revision']} (webhooks applied)")
    if "disputed_at" in state:
        lines.append(f"  disputed at {state['disputed_at'].isoformat()}")
    for name in ("last_error", "review_reason", "deferred scoring check"):
        if name in state:
            lines.append(f"  {name.replace('_', ' ')}: {state[name]}")
    return lines


def _current_try(row: Any) -> dict[str, Any]:
    """The row's current try, in the shape of an earlier one (`_TRIES`): not ended while it
    is open or waits for its next try to start."""
    return {
        "try": row["current_try"],
        "key": row["idempotency_key"],
        "status": row["status"],
        "gateway_charge_id": row["gateway_charge_id"],
        "decline_code": row["decline_code"],
        "decline_class": row["decline_class"],
        "last_error": row["last_error"],
        "started_at": row["try_started_at"] or row["created_at"],
        "ended_at": row["settled_at"],
    }


def _try_lines(tries: list[dict[str, Any]]) -> list[str]:
    """Every try of the period, oldest first: its number, key, status, decline, times."""
    if not tries:
        return []
    lines = [f"tries: {len(tries)}"]
    for t in tries:
        line = f"  try {t['try']}  {t['key']:<24}  {t['status']:<15}"
        if t["decline_code"] or t["decline_class"]:
            line += f"  {t['decline_code'] or 'generic_decline'} ({t['decline_class'] or '-'})"
        if t["gateway_charge_id"]:
            line += f"  {t['gateway_charge_id']}"
        line += f"  started {_at(t['started_at'])}"
        if t["ended_at"] is not None:
            line += f"  ended {_at(t['ended_at'])}"
        lines.append(line)
    return lines


def _gateway_lines(at_gateway: list[dict[str, Any]]) -> list[str]:
    lines = ["at the gateway:" if at_gateway else "at the gateway: no charge for this key"]
    for charge in at_gateway:
        created = dt.datetime.fromtimestamp(charge["created"], dt.UTC).isoformat()
        money = f"{charge['amount']} {charge['currency']}"
        # a refunded charge stays `succeeded` at the gateway (docs/contracts/gateway.md)
        refunded = charge.get("amount_refunded", 0)
        refund = f", refunded {refunded}" if refunded else ""
        lines.append(f"  {charge['id']}  {charge['status']:<9}  {money}{refund}  created {created}")
    return lines


def _at(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat(timespec="milliseconds")


def _outcome_lines(count: int, kept: list[dict[str, Any]]) -> list[str]:
    """The period's outcome events (docs/contracts/charge-outcome.md), and where each is."""
    if count == 0:
        return ["outcome events: none (no change of state an event is written for)"]
    lines = [f"outcome events: {count}"]
    if pruned := count - len(kept):
        lines[0] += (
            f"; {pruned} not shown: sent, then pruned after the outbox's retention"
            " (CHARGE_WORKER_OUTBOX_RETENTION_S)"
        )
    for event in kept:
        head = f"  #{event['sequence']}  {event['type']:<23}  occurred {_at(event['occurred_at'])}"
        if event["sent_at"] is not None:
            where = f"in the stream {_at(event['sent_at'])}, stream seq {event['stream_seq']}"
        else:
            tries = event["tries"]
            where = f"not in the stream yet: {tries} {'try' if tries == 1 else 'tries'}"
            where += f", next at {_at(event['next_try_at'])}"
            if event["last_error"]:
                where += f", last error: {event['last_error']}"
        lines.append(f"{head}  {where}")
    return lines


def describe(event: events.Event) -> str:
    """One line for one event, in words."""
    d = event.detail
    if event.kind == "reviewed":  # `reconcile resolve`: by whom is the event's actor
        found = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in d.items() if k != "note")
        return f"{found} reviewed: {d.get('note')}"
    if event.kind != "delivery":
        return ", ".join(f"{k} {v}" for k, v in d.items())
    parts = [f"delivery {d.get('delivery')} of stream seq {d.get('stream_seq')}"]
    if d.get("taken_from"):
        parts.append(f"took over the expired lease of {d['taken_from']}")
    if "lookup" in d:
        parts.append(f"looked up first: {d['lookup']}")
    if "scoring" in d:
        parts.append(f"scoring {d['scoring']}")
    if "gateway" in d:
        charge = f" {d['charge_id']}" if d.get("charge_id") else ""
        replay = " (replayed)" if d.get("replayed") else ""
        decline = f" ({d['decline']})" if d.get("decline") else ""
        parts.append(f"gateway {d['gateway']}{charge}{decline}{replay}")
    action = str(d.get("action"))
    if d.get("delay_s") is not None:
        action += f" {float(d['delay_s']):g}s"
    if d.get("dlq_reason"):
        action += f" ({d['dlq_reason']})"
    parts.append(f"{d.get('outcome')} -> {action}")
    if d.get("error"):
        parts.append(str(d["error"]))
    return "; ".join(parts)


def _since(row: Any) -> dt.datetime | None:
    """No charge of the period, of any try, is older than its row or its due moment (a row
    made again after a failover is younger than its charges); None without a row."""
    if row is None:
        return None
    moments: list[dt.datetime] = [m for m in (row["created_at"], row["due_at"]) if m is not None]
    return min(moments)
