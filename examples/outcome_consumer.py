"""A reference consumer of charge-worker's outcome events (docs/outcomes.md).

It reads `CHARGE_OUTCOMES` through a durable pull consumer and applies each change of a
billing period once, and never lets an older event undo a newer one:

- per `(order_id, billing_period)` it keeps the highest `sequence` it has handled; an event
  at or below it is a duplicate (the same `event_id`, `<order_id>:<billing_period>:<sequence>`,
  redelivered or re-published) or stale (an older change arriving late), and is acknowledged
  without being applied;
- a `type` it does not know is skipped (new ones may come), but its sequence still counts;
- it acknowledges a message only after its change is applied and recorded.

The record here is in memory, so that the example runs as it is. A real consumer keeps it in
its own database and moves it in the same transaction as its side effect (docs/outcomes.md
shows the statement); then a crash anywhere leaves either both or neither, and the message,
unacknowledged, comes again.

    pip install nats-py
    python examples/outcome_consumer.py --server nats://127.0.0.1:4222 --durable my-service
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

# docs/contracts/charge-outcome.md, "type"
KNOWN_TYPES = frozenset(
    {
        "charge.succeeded",
        "charge.declined",
        "charge.retry_scheduled",
        "charge.action_required",
        "charge.blocked",
        "charge.failed",
        "charge.refunded",
        "charge.disputed",
    }
)
RETRY_DELAY_S = 5.0  # before a side effect that raised TryLater is tried again


class Verdict(enum.Enum):
    """What became of one message."""

    APPLY = "applied"
    DUPLICATE = "duplicate"  # acknowledged, not applied again
    STALE = "stale"  # acknowledged: a newer change of its period was handled already
    UNKNOWN_TYPE = "skipped"  # acknowledged: a type this consumer does not know
    LATER = "later"  # the side effect could not be done now: redelivered after a delay
    INVALID = "invalid"  # not an event of the contract: terminated, never redelivered


class TryLater(Exception):
    """Raised by the side effect when it cannot be done now: the event comes again later."""


Event = dict[str, Any]
Apply = Callable[[Event], Awaitable[None]]


@dataclass
class Periods:
    """The highest `sequence` handled per `(order_id, billing_period)`: the latest state of
    each period, and the record that makes every `event_id` count once."""

    highest: dict[tuple[int, str], int] = field(default_factory=dict)

    def judge(self, event: Event) -> Verdict:
        handled = self.highest.get((event["order_id"], event["billing_period"]), 0)
        if event["sequence"] == handled:
            return Verdict.DUPLICATE
        if event["sequence"] < handled:
            return Verdict.STALE
        return Verdict.APPLY if event["type"] in KNOWN_TYPES else Verdict.UNKNOWN_TYPE

    def record(self, event: Event) -> None:
        self.highest[(event["order_id"], event["billing_period"])] = event["sequence"]


async def handle(
    msg: Msg, periods: Periods, apply: Apply, *, retry_delay_s: float = RETRY_DELAY_S
) -> Verdict:
    """Judge one message, apply it if it is new, record it, then settle the message."""
    try:
        event = json.loads(msg.data)
        verdict = periods.judge(event)
    except (ValueError, TypeError, KeyError):
        await msg.term()
        return Verdict.INVALID
    if verdict is Verdict.APPLY:
        try:
            await apply(event)
        except TryLater:
            await msg.nak(delay=retry_delay_s)
            return Verdict.LATER
    if verdict in (Verdict.APPLY, Verdict.UNKNOWN_TYPE):
        periods.record(event)
    await msg.ack()
    return verdict


async def consume(
    js: JetStreamContext,
    periods: Periods,
    apply: Apply,
    stop: asyncio.Event,
    *,
    durable: str,
    stream: str = "CHARGE_OUTCOMES",
    subject: str = "charges.outcome.>",
    on_verdict: Callable[[Msg, Verdict], None] = lambda msg, verdict: None,
    retry_delay_s: float = RETRY_DELAY_S,
) -> None:
    """Handle the stream's events through the durable consumer `durable` until `stop`."""
    sub = await js.pull_subscribe(
        subject,
        durable=durable,
        stream=stream,
        # from the first event the stream holds; a nak'd or unacknowledged one comes again
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30
        ),
    )
    while not stop.is_set():
        try:
            msgs = await sub.fetch(50, timeout=1)
        except TimeoutError:  # nats-py raises its own subclass, or the builtin itself
            continue  # nothing new
        for msg in msgs:
            on_verdict(msg, await handle(msg, periods, apply, retry_delay_s=retry_delay_s))


async def print_change(event: Event) -> None:
    """The side effect of this example: say what changed."""
    print(f"order {event['order_id']}, {event['billing_period']}: {event['type']}", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="nats://127.0.0.1:4222")
    parser.add_argument("--durable", required=True, help="your service's consumer name")
    parser.add_argument("--stream", default="CHARGE_OUTCOMES")
    parser.add_argument("--subject", default="charges.outcome.>")
    args = parser.parse_args()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    nc = await nats.connect(args.server)

    def show(msg: Msg, verdict: Verdict) -> None:
        msg_id = (msg.headers or {}).get("Nats-Msg-Id")
        print(f"  {verdict.value}: {msg.subject} {msg_id}", flush=True)

    try:
        await consume(
            nc.jetstream(),
            Periods(),
            print_change,
            stop,
            durable=args.durable,
            stream=args.stream,
            subject=args.subject,
            on_verdict=show,
        )
    finally:
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
