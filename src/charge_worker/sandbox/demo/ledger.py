"""The demo's periods as the ledger holds them: `charge_attempts` (each period and its
current try) and `charge_tries` (its earlier tries, each declined).

Only the demo's own order ids are read, so a shared database's other rows stay out.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from charge_worker.retries.schedule import WAITING

FINAL = frozenset({"succeeded", "declined", "blocked", "failed", "refunded"})
# a declined try's period waits in one of these: for its next try, or for its customer
AT_REST = FINAL | WAITING
CHARGED = frozenset({"succeeded", "refunded"})  # a refunded charge was made all the same


@dataclass(frozen=True)
class LedgerRow:
    """One `charge_attempts` row, as much as the demo shows."""

    order_id: int
    customer_id: str
    amount_minor: int
    currency: str
    status: str
    scoring: str | None
    claims: int
    last_error: str | None
    outcome_seq: int  # how many outcome events the row's changes made
    outcome_type: str | None  # the type of the last
    current_try: int
    decline_code: str | None  # the current try's
    decline_class: str | None
    retry_at: dt.datetime | None


async def ledger_rows(
    conn: asyncpg.Connection, period: dt.date, order_ids: Sequence[int]
) -> list[LedgerRow]:
    """The demo's rows of `charge_attempts`."""
    records = await conn.fetch(
        "SELECT order_id, customer_id, amount_minor, currency, status, scoring,"
        "       attempt AS claims, last_error, outcome_seq, outcome_type, current_try,"
        "       decline_code, decline_class, retry_at"
        "  FROM charge_attempts WHERE billing_period = $1 AND order_id = ANY($2::bigint[])"
        " ORDER BY order_id",
        period,
        list(order_ids),
    )
    return [LedgerRow(**dict(record)) for record in records]


@dataclass(frozen=True)
class EarlierTry:
    """One `charge_tries` row: a try that was declined and followed by another."""

    order_id: int
    try_no: int
    decline_code: str | None
    decline_class: str | None


async def earlier_tries(
    conn: asyncpg.Connection, period: dt.date, order_ids: Sequence[int]
) -> dict[int, list[EarlierTry]]:
    """The demo's earlier tries, per order, in try order."""
    records = await conn.fetch(
        "SELECT order_id, try_no, decline_code, decline_class FROM charge_tries"
        " WHERE billing_period = $1 AND order_id = ANY($2::bigint[])"
        " ORDER BY order_id, try_no",
        period,
        list(order_ids),
    )
    found: dict[int, list[EarlierTry]] = {}
    for record in records:
        found.setdefault(record["order_id"], []).append(EarlierTry(**dict(record)))
    return found
