"""Load for the cases: due-charge messages, a backlog, a paced stream, and when they are acked.

* `customer_id`: whose card an order charges. With `decline_every = k`, every k-th
  customer's card is declined (`cus_decline…`: the gateway simulator answers a
  `generic_decline`, a soft decline, on every try); the throughput case declines 1 in 10.
* `add_subscriptions`: the active `subscriptions` rows that agree with those messages, for
  the worker with `CHARGE_WORKER_VERIFY_SUBSCRIPTION=match`.
* `publish_backlog`: core NATS publishes with a flush every batch (the stream captures the
  subject), then the stream's message count is checked: fast enough for 100,000 messages.
* `wait_acked`: polls the durable consumer; a message is done when it is neither pending
  nor awaiting its ack (`num_pending`, `num_ack_pending`). This is how every case measures
  its end, for the bare pipeline and the worker alike.
* `AckTimes`: publish-to-ack latency. The consumer is created with `sample_freq: 100%`, so
  nats-server emits an `io.nats.jetstream.metric.v1.consumer_ack` advisory for every ack,
  stamped with the server's clock when the ack arrived. The harness notes the wall clock
  just before each publish (same machine, same clock), so latency = ack stamp - publish time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Self

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from charge_worker.messages import SCHEMA

PERIOD = dt.date(2026, 12, 1)
AMOUNT_MINOR = 99000
CURRENCY = "RUB"
CUSTOMERS = 1000
DECLINE_PREFIX = "cus_decline_"  # the simulator declines cus_decline… (generic_decline: soft)
PUBLISH_BATCH = 1000
POLL_S = 0.05


def customer_id(order_id: int, decline_every: int = 0) -> str:
    """The order's customer: one of `CUSTOMERS`; with `decline_every = k`, every k-th of
    them has a card the gateway simulator declines."""
    n = order_id % CUSTOMERS
    if decline_every and n % decline_every == 0:
        return f"{DECLINE_PREFIX}{n}"
    return f"cus_bench_{n}"


def declining(order_ids: range, decline_every: int) -> int:
    """How many of `order_ids` charge a customer whose card is declined."""
    return sum(1 for n in order_ids if customer_id(n, decline_every).startswith(DECLINE_PREFIX))


def due_body(order_id: int, decline_every: int = 0) -> bytes:
    """A valid `charge.due/v1` body, its customer approvable, and chargeable unless it is one
    of the declining (`customer_id`)."""
    return json.dumps(
        {
            "schema": SCHEMA,
            "order_id": order_id,
            "billing_period": PERIOD.isoformat(),
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer_id(order_id, decline_every),
            "amount_minor": AMOUNT_MINOR,
            "currency": CURRENCY,
            "due_at": "2026-12-01T00:00:00Z",
        },
        separators=(",", ":"),
    ).encode()


async def add_subscriptions(database_url: str, order_ids: range, decline_every: int = 0) -> None:
    """An active subscription for each order that agrees with its `due_body`: the same
    subscription, customer, amount and currency, billed monthly from PERIOD (so PERIOD is on
    its schedule). Analyzed afterwards, as a table loaded in bulk should be."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            """INSERT INTO subscriptions (subscription_id, order_id, customer_id, amount_minor,
                                          currency, next_billing_date)
               SELECT 'sub_' || n, n, customer, $3::bigint, $4::text, $5::date
                 FROM unnest($1::bigint[], $2::text[]) AS t(n, customer)""",
            list(order_ids),
            [customer_id(n, decline_every) for n in order_ids],
            AMOUNT_MINOR,
            CURRENCY,
            PERIOD,
        )
        await conn.execute("ANALYZE subscriptions")
    finally:
        await conn.close()


def msg_id(order_id: int) -> str:
    """The `Nats-Msg-Id` the producer would give it."""
    return f"charge:{order_id}:{PERIOD.isoformat()}"


async def publish_backlog(
    nc: Client,
    js: JetStreamContext,
    subject: str,
    stream: str,
    order_ids: range,
    *,
    decline_every: int = 0,
) -> None:
    """Publish every order's due charge; raise if the stream did not store them all."""
    before = (await js.stream_info(stream)).state.messages
    for start in range(0, len(order_ids), PUBLISH_BATCH):
        for order_id in order_ids[start : start + PUBLISH_BATCH]:
            body = due_body(order_id, decline_every)
            await nc.publish(subject, body, headers={"Nats-Msg-Id": msg_id(order_id)})
        await nc.flush(timeout=30)
    deadline = time.monotonic() + 30.0
    while True:
        stored = (await js.stream_info(stream)).state.messages - before
        if stored >= len(order_ids):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stream stored {stored} of {len(order_ids)} messages")
        await asyncio.sleep(POLL_S)


async def acked(js: JetStreamContext, stream: str, durable: str, total: int) -> int:
    """How many of the `total` messages published to the consumer are acked (or termed)."""
    info = await js.consumer_info(stream, durable)
    return total - (info.num_pending or 0) - (info.num_ack_pending or 0)


async def wait_acked(
    js: JetStreamContext,
    stream: str,
    durable: str,
    total: int,
    *,
    timeout_s: float,
    on_progress: Callable[[int], None] = lambda _done: None,
    poll_s: float = POLL_S,
) -> list[tuple[float, int]]:
    """Poll until all `total` are acked or `timeout_s` passes: every (monotonic time, acked)."""
    deadline = time.monotonic() + timeout_s
    series: list[tuple[float, int]] = []
    while time.monotonic() < deadline:
        done = await acked(js, stream, durable, total)
        series.append((time.monotonic(), done))
        on_progress(done)
        if done >= total:
            break
        await asyncio.sleep(poll_s)
    return series


def parse_timestamp(text: str) -> float:
    """An RFC 3339 UTC timestamp with up to nanoseconds, as Unix seconds."""
    base, _, fraction = text.rstrip("Z").partition(".")
    whole = dt.datetime.fromisoformat(base).replace(tzinfo=dt.UTC).timestamp()
    return whole + (float(f"0.{fraction}") if fraction else 0.0)


class AckTimes:
    """Collects the consumer's ack advisories: stream sequence -> server time of the ack."""

    def __init__(self, nc: Client, stream: str, durable: str) -> None:
        self.nc = nc
        self.subject = f"$JS.EVENT.METRIC.CONSUMER.ACK.{stream}.{durable}"
        self.at: dict[int, float] = {}
        self.service_s: dict[int, float] = {}  # delivery to ack, as the server saw it
        self._sub: Subscription | None = None
        self._arrived = asyncio.Event()

    async def _on_ack(self, msg: Msg) -> None:
        event = json.loads(msg.data)
        seq = int(event["stream_seq"])
        self.at[seq] = parse_timestamp(event["timestamp"])
        self.service_s[seq] = int(event["ack_time"]) / 1e9
        self._arrived.set()

    async def wait_for(self, seqs: Collection[int], *, timeout_s: float) -> bool:
        """Wait until every sequence in `seqs` was acked, at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.at.keys() >= set(seqs):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        return True

    async def __aenter__(self) -> Self:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_ack)
        await self.nc.flush()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


async def publish_paced(
    js: JetStreamContext,
    subject: str,
    order_ids: range,
    rate_per_s: float,
    *,
    decline_every: int = 0,
) -> dict[int, float]:
    """Publish at a steady rate (open loop); stream sequence -> wall time just before publish."""
    sent: dict[int, float] = {}
    start = time.monotonic()
    for index, order_id in enumerate(order_ids):
        delay = start + index / rate_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        at = time.time()
        ack = await js.publish(
            subject,
            due_body(order_id, decline_every),
            headers={"Nats-Msg-Id": msg_id(order_id)},
        )
        sent[ack.seq] = at
    return sent
