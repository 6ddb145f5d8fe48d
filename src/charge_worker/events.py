"""The append-only story of each charge (`charge_events`), read back by `explain`.

Kinds, and who writes them:

| kind           | actor      | detail                                                        |
|----------------|------------|---------------------------------------------------------------|
| `scheduled`    | producer   | subscription, amount, currency                                |
| `published`    | producer   | stream seq, msg id, duplicate                                 |
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
| `webhook`      | webhooks   | event id, type, charge id, revision, outcome, looked up       |

Writing an event never decides anything: a failure to write one is logged and ignored. The
exceptions are the events written by the very statement they describe (`scheduled`,
`published`, and `delivery` with the delivery's ledger write): they stand or fall with it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

_INSERT = """
INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
VALUES ($1, $2, $3, $4, $5::jsonb)
"""

_STORY = """
SELECT at, kind, actor, detail FROM charge_events
 WHERE order_id = $1 AND billing_period = $2 ORDER BY id
"""


@dataclass(frozen=True)
class Event:
    at: dt.datetime
    kind: str
    actor: str
    detail: dict[str, Any]


def to_json(detail: Mapping[str, Any]) -> str:
    """An event's detail as stored: `None` values are left out."""
    return json.dumps({k: v for k, v in detail.items() if v is not None}, default=str)


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
    """Every event of one charge, oldest first."""
    rows = await conn.fetch(_STORY, order_id, billing_period)
    return [Event(r["at"], r["kind"], r["actor"], json.loads(r["detail"])) for r in rows]
