"""The demo's outcome events (docs/contracts/charge-outcome.md), as downstream sees them.

The workers' relay publishes what the ledger's triggers wrote to the outbox. The demo waits
until none of its charges' events is left unsent, then reads the outcomes stream the way a
downstream team would (docs/outcomes.md): a durable pull consumer on `<subject>.>`, each
delivery acknowledged, deduplicated by `event_id`. `mismatches` holds what it read against
the ledger's own count of changes (`charge_attempts.outcome_seq` and `outcome_type`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import asyncpg
import click
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from charge_worker.sandbox.demo.samples import Published
from charge_worker.settings import NatsSettings

DRAIN_TIMEOUT_S = 30.0
POLL_S = 0.2
DOWNSTREAM_DURABLE = "demo-downstream"  # a downstream team's consumer, not the worker's
FETCH_BATCH = 100
FETCH_TIMEOUT_S = 5.0

_UNSENT = """
SELECT count(*) AS unsent, max(tries) AS tries,
       (array_agg(last_error ORDER BY occurred_at) FILTER (WHERE last_error IS NOT NULL))[1]
           AS last_error
  FROM charge_outcomes
 WHERE billing_period = $1 AND order_id = ANY($2::bigint[]) AND sent_at IS NULL
"""


async def await_drained(
    conn: asyncpg.Connection, published: Published, *, stream: str, timeout_s: float
) -> bool:
    """Wait until every outcome event of the demo's charges is in the stream; False, having
    said what still waits and why, if that takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = await conn.fetchrow(_UNSENT, published.period, list(published.order_ids))
        assert row is not None
        if row["unsent"] == 0:
            click.echo(f"    the outbox is drained: every outcome event is in {stream}")
            return True
        if time.monotonic() > deadline:
            error = f", the first error: {row['last_error']}" if row["last_error"] else ""
            click.secho(
                f"    {row['unsent']} outcome events still not in {stream} after {timeout_s:g} s"
                f" (up to {row['tries']} tries{error}); the workers' logs say why (outbox.*)",
                fg="red",
            )
            return False
        await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class Seen:
    """One outcome event as the consumer applied it."""

    event_id: str
    type: str
    sequence: int
    order_id: int
    amount_minor: int
    currency: str
    attempt: int  # the period's try the change was made in
    decline_code: str | None
    retry_at: str | None  # `charge.retry_scheduled`: when the next try is due


@dataclass(frozen=True)
class Read:
    """What the downstream consumer saw: each event once, in delivery order."""

    events: list[Seen] = field(default_factory=list)
    duplicates: int = 0  # deliveries of an `event_id` seen already, dropped


async def read_as_consumer(js: JetStreamContext, cfg: NatsSettings) -> Read:
    """Every event of the outcomes stream through a durable pull consumer on
    `<outcomes_subject>.>`, acknowledged one by one, deduplicated by `event_id`."""
    sub = await js.pull_subscribe(
        f"{cfg.outcomes_subject}.>",
        durable=DOWNSTREAM_DURABLE,
        stream=cfg.outcomes_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
    )
    seen: dict[str, Seen] = {}
    duplicates = 0
    try:
        while (await sub.consumer_info()).num_pending:
            for msg in await sub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT_S):
                body = json.loads(msg.data)
                if body["event_id"] in seen:
                    duplicates += 1
                else:
                    seen[body["event_id"]] = Seen(
                        body["event_id"],
                        body["type"],
                        body["sequence"],
                        body["order_id"],
                        body["amount_minor"],
                        body["currency"],
                        body["attempt"],
                        body.get("decline_code"),
                        body.get("retry_at"),
                    )
                await msg.ack()
    finally:
        await sub.unsubscribe()
    return Read(list(seen.values()), duplicates)


def mismatches(read: Read, changes: Mapping[int, tuple[int, str | None]]) -> list[str]:
    """Where what the consumer saw differs from the ledger's changes: per order, its count of
    events (`outcome_seq`) and the type of its last (`outcome_type`)."""
    by_order: dict[int, dict[int, str]] = {}
    for event in read.events:
        by_order.setdefault(event.order_id, {})[event.sequence] = event.type
    found = []
    for order_id, (count, last_type) in sorted(changes.items()):
        events = by_order.pop(order_id, {})
        if sorted(events) != list(range(1, count + 1)):
            found.append(f"order {order_id}: events {sorted(events)} seen, {count} made")
        elif count and events[count] != last_type:
            found.append(f"order {order_id}: last event {events[count]}, the ledger {last_type}")
    found.extend(f"order {order_id}: events of no demo charge" for order_id in sorted(by_order))
    return found
