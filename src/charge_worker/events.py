"""The append-only story of each charge (`charge_events`), read back by `explain`.

Kinds, and who writes them:

| kind           | actor      | detail                                                        |
|----------------|------------|---------------------------------------------------------------|
| `scheduled`    | producer   | subscription, amount, currency: told by the ledger row (below)|
| `published`    | producer   | msg id (the current try's): told by the ledger row (below)    |
| `gateway_call` | worker     | attempt, call number: one written before each call by earlier |
|                |            | versions (`explain` still tells them); `delivery` says it now |
| `delivery`     | worker     | stream seq, delivery, attempt, taken over from, scoring,       |
|                |            | lookup, gateway answer, outcome, action, delay, error         |
|                |            | (with the delivery's ledger write itself, which also counts   |
|                |            | the call and keeps the verdict)                               |
| `republished`  | reconcile  | why, stream seq                                               |
| `resolved`     | reconcile  | what a lookup found for an unknown outcome; or a charge the   |
|                |            | gateway made for a row the ledger had as declined, failed or  |
|                |            | blocked, now recorded (`was`: that status, its last error)    |
| `refund`       | reconcile  | charge id, refund id, reason                                  |
| `discrepancy`  | reconcile  | what disagrees: a ledger charge the gateway lacks, or a       |
|                |            | captured charge not proven the key's own (`charge_id`, never  |
|                |            | refunded); once per charge                                    |
| `reviewed`     | a person   | `reconcile resolve`: the note, the charge ids reviewed        |
|                |            | (discrepancies, unmatched charges): no longer counted         |
| `webhook`      | webhooks   | event id, type, charge id, revision, outcome, looked up       |

Writing an event never decides anything: a failure to write one is logged and ignored. The
exception is `delivery`, written by the delivery's ledger write itself: it stands or falls
with it.

The producer's two steps are not rows here: the ledger row already says them (`created_at`
for a row scheduled, `published_at` once its message is stored), and at month start two
more event rows per charge would be a large share of the database's work. `story` tells
them from the row, in the words earlier versions wrote (their rows, where they exist, are
told as written).
A row is `scheduled` by the producer when it was published or is still `scheduled`; a row a
worker created from a message published by someone else has neither.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from charge_worker import json_text
from charge_worker.messages import msg_id

_INSERT = """
INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
VALUES ($1, $2, $3, $4, $5::jsonb)
"""

_STORY = """
SELECT at, kind, actor, detail FROM charge_events
 WHERE order_id = $1 AND billing_period = $2 ORDER BY id
"""

_LEDGER = """
SELECT created_at, published_at, status, subscription_id, amount_minor, currency, traceparent,
       current_try
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""
PRODUCER = "producer"


@dataclass(frozen=True)
class Event:
    at: dt.datetime
    kind: str
    actor: str
    detail: dict[str, Any]


def to_json(detail: Mapping[str, Any]) -> str:
    """An event's detail as stored: `None` values are left out."""
    return json_text.dumps({k: v for k, v in detail.items() if v is not None})


async def record(
    conn: asyncpg.Pool | asyncpg.Connection,
    order_id: int,
    billing_period: dt.date,
    kind: str,
    actor: str,
    **detail: Any,
) -> None:
    """Append one event; `None` values are left out of the detail."""
    await conn.execute(_INSERT, order_id, billing_period, kind, actor, to_json(detail))


async def story(
    conn: asyncpg.Pool | asyncpg.Connection, order_id: int, billing_period: dt.date
) -> list[Event]:
    """Every event of one charge, oldest first (rows written at the same moment in the
    order they were written): the rows of `charge_events`, and the producer's steps told
    by the ledger row."""
    rows = await conn.fetch(_STORY, order_id, billing_period)
    told = [Event(r["at"], r["kind"], r["actor"], json.loads(r["detail"])) for r in rows]
    ledger = await conn.fetchrow(_LEDGER, order_id, billing_period)
    produced = _produced(ledger, order_id, billing_period, {e.kind for e in told})
    return sorted(produced + told, key=lambda event: event.at)


def _produced(
    row: asyncpg.Record | None, order_id: int, billing_period: dt.date, told: set[str]
) -> list[Event]:
    """The producer's `scheduled` and `published`, from the ledger row's columns; none of a
    kind an event row of an earlier version tells already."""
    if row is None or (row["published_at"] is None and row["status"] != "scheduled"):
        return []
    trace = {"trace_id": row["traceparent"].split("-")[1]} if row["traceparent"] else {}
    found = []
    if "scheduled" not in told:
        detail = {name: row[name] for name in ("subscription_id", "amount_minor", "currency")}
        found.append(Event(row["created_at"], "scheduled", PRODUCER, detail | trace))
    if row["published_at"] is not None and "published" not in told:
        # the row's publish is its current try's (a try started afresh is published afresh)
        detail = {"msg_id": msg_id(order_id, billing_period, row["current_try"])} | trace
        found.append(Event(row["published_at"], "published", PRODUCER, detail))
    return found
