"""The bare pipeline: the worker's I/O per message with none of its safety — the ceiling.

Per message, exactly the round trips a charge needs: pull fetch (to free capacity, like the
worker), claim `INSERT`, score `POST`, charge `POST`, mark `UPDATE` (`succeeded`, or on the
gateway's `402` `declined` with its decline code: no retries), ack, and the charge's outcome
event published to JetStream (`<outcomes_subject>.succeeded` or `.declined`, with a `Nats-
Msg-Id`), batched as the worker's relay batches: up to `outbox_batch` events published at
once, every ack awaited, again at once while batches come full, else after `outbox_poll_s`.
No validation model, no lease fence, no breaker, no heartbeats, no deadline, no gateway-call
bookkeeping, no event rows, no outbox (the events wait in a list in memory, and one whose
publish fails is lost), no metrics, no log line. The HTTP clients are the worker's own
(`charge_worker.http.build_client`: httpx over the httpx-aiohttp transport), the pool is
asyncpg with the worker's size and reset, and the event loop is the worker's
(`charge_worker.event_loop`), so the two differ only in what the worker adds.

Run as a child process by the harness (its CPU is measured like the worker's):
`python -m benchmarks.bare_pipeline CONFIG_JSON`. It touches
`ready_file` once bound to the consumer and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import signal
import sys
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import BaseModel

from charge_worker import event_loop
from charge_worker.database import keep_session
from charge_worker.declines import GENERIC_DECLINE, decline_class
from charge_worker.http import build_client

DRAIN_S = 10.0
OWNER = "bare-pipeline"

CLAIM = """
INSERT INTO charge_attempts (
    order_id, billing_period, idempotency_key, subscription_id, customer_id,
    amount_minor, currency, due_at, status, lease_owner, lease_until, attempt)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, now() + interval '30 seconds', 1)
ON CONFLICT DO NOTHING
"""

MARK = """
UPDATE charge_attempts
   SET status = $3, gateway_charge_id = $4, decline_code = $5, lease_owner = NULL,
       lease_until = NULL, settled_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2
"""
DECLINED = 402  # the contract's card decline (docs/contracts/gateway.md)


class BareConfig(BaseModel):
    """Where everything is, and the worker settings the bare loop mirrors."""

    nats_url: str
    stream: str
    durable: str
    database_url: str
    gateway_url: str
    scoring_url: str
    api_key: str
    concurrency: int
    db_pool_max: int
    http_timeout_s: float
    fetch_wait_s: float
    ready_file: str
    outcomes_subject: str
    outcome_events: bool  # False: none built or published (`benchmarks.overhead --no-outbox`)
    outbox_batch: int
    outbox_poll_s: float
    outbox_publish_timeout_s: float


class BarePipeline:
    def __init__(
        self,
        config: BareConfig,
        pool: asyncpg.Pool,
        scoring: httpx.AsyncClient,
        gateway: httpx.AsyncClient,
        js: JetStreamContext | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.scoring = scoring
        self.gateway = gateway
        self.js = js  # `run` connects its own
        self.unsent: list[tuple[str, str, bytes]] = []  # (event id, kind, body) of charges marked
        self.done = 0
        self.failed = 0
        self.published = 0

    async def handle(self, msg: Msg) -> None:
        try:
            charge = json.loads(msg.data)
            period, key = await claim(self.pool, charge)
            await self._score(charge)
            charge_id, decline_code = await self._charge(charge, key)
            await mark(self.pool, charge["order_id"], period, charge_id, decline_code)
            if self.config.outcome_events:
                self.unsent.append(_outcome(charge, charge_id, decline_code))
            await msg.ack()
            self.done += 1
        except (  # the harness sees a failure as a message never acked
            OSError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            httpx.HTTPError,
            nats.errors.Error,
            KeyError,
            ValueError,
            AssertionError,
            TimeoutError,
        ) as error:
            self.failed += 1
            print(f"bare pipeline: {error!r}", file=sys.stderr, flush=True)

    # One method per round trip, each the bare form of a step of the worker's pipeline (the
    # ledger's two: `claim` and `mark`, below).
    async def _score(self, charge: dict[str, Any]) -> None:
        score = {
            "order_id": charge["order_id"],
            "customer_id": charge["customer_id"],
            "amount_minor": charge["amount_minor"],
            "currency": charge["currency"],
        }
        verdict = (await self.scoring.post("/v1/score", json=score)).json()["decision"]
        assert verdict == "approve", verdict

    async def _charge(self, charge: dict[str, Any], key: str) -> tuple[str | None, str | None]:
        """The charge's id (None: declined) and its decline code (None: charged)."""
        body = {
            "amount": charge["amount_minor"],
            "currency": charge["currency"],
            "customer": charge["customer_id"],
            "metadata": {
                "order_id": str(charge["order_id"]),
                "billing_period": charge["billing_period"],
            },
        }
        answer = await self.gateway.post("/v1/charges", json=body, headers={"Idempotency-Key": key})
        if answer.status_code == DECLINED:
            error = answer.json()["error"]
            return None, str(error.get("decline_code") or GENERIC_DECLINE)
        answer.raise_for_status()
        return str(answer.json()["id"]), None

    # The relay's part, bare: publish what was marked, in batches.
    async def publish_outcomes(self) -> int:
        """Publish up to `outbox_batch` events at once, awaiting every ack; how many."""
        assert self.js is not None
        batch, self.unsent = (
            self.unsent[: self.config.outbox_batch],
            self.unsent[self.config.outbox_batch :],
        )
        results = await asyncio.gather(
            *(self._publish(*event) for event in batch), return_exceptions=True
        )
        for result in results:
            if isinstance(result, Exception):
                self.failed += 1
                print(f"bare pipeline, outcome: {result!r}", file=sys.stderr, flush=True)
            elif isinstance(result, BaseException):
                raise result
        self.published += sum(1 for result in results if result is None)
        return len(batch)

    async def _publish(self, event_id: str, kind: str, body: bytes) -> None:
        assert self.js is not None
        await self.js.publish(
            f"{self.config.outcomes_subject}.{kind}",
            body,
            timeout=self.config.outbox_publish_timeout_s,
            headers={"Nats-Msg-Id": f"outcome:{event_id}"},
        )

    async def relay(self, stop: asyncio.Event) -> None:
        """`publish_outcomes` until `stop`: at once while batches come full, else every poll."""
        while not stop.is_set():
            if await self.publish_outcomes() < self.config.outbox_batch:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.outbox_poll_s)

    async def run(self, stop: asyncio.Event) -> None:
        servers = [url.strip() for url in self.config.nats_url.split(",")]
        nc = await nats.connect(servers=servers, name=OWNER)
        self.js = nc.jetstream()
        sub = await self.js.pull_subscribe_bind(
            durable=self.config.durable, stream=self.config.stream
        )
        relay = asyncio.create_task(self.relay(stop))
        await asyncio.to_thread(Path(self.config.ready_file).touch)
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                free = self.config.concurrency - len(in_flight)
                if free <= 0:
                    await asyncio.wait(in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await sub.fetch(free, timeout=self.config.fetch_wait_s)
                except TimeoutError:
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self.handle(msg))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
        finally:
            if in_flight:
                await asyncio.wait(in_flight, timeout=DRAIN_S)
            await relay
            while await self.publish_outcomes():
                pass
            await nc.close()


async def claim(pool: asyncpg.Pool, charge: dict[str, Any]) -> tuple[dt.date, str]:
    """The bare claim of a `charge.due/v1` body: its row inserted `pending`, leased. Returns
    the charge's period and its idempotency key."""
    period = dt.date.fromisoformat(charge["billing_period"])
    key = f"{charge['order_id']}:{charge['billing_period']}"
    await pool.execute(
        CLAIM,
        charge["order_id"],
        period,
        key,
        charge["subscription_id"],
        charge["customer_id"],
        charge["amount_minor"],
        charge["currency"],
        dt.datetime.fromisoformat(charge["due_at"]),
        OWNER,
    )
    return period, key


async def mark(
    pool: asyncpg.Pool,
    order_id: int,
    period: dt.date,
    charge_id: str | None,
    decline_code: str | None,
) -> None:
    """The bare settle: `succeeded` with the charge's id, or `declined` with its code."""
    status = "succeeded" if decline_code is None else "declined"
    await pool.execute(MARK, order_id, period, status, charge_id, decline_code)


def _outcome(
    charge: dict[str, Any], charge_id: str | None, decline_code: str | None
) -> tuple[str, str, bytes]:
    """The charge's `charge.succeeded` or `charge.declined` event
    (docs/contracts/charge-outcome.md): its id, kind and body, with the fields the worker's
    outbox writes."""
    event_id = f"{charge['order_id']}:{charge['billing_period']}:1"
    kind = "succeeded" if decline_code is None else "declined"
    body = {
        "schema": "charge.outcome/v1",
        "event_id": event_id,
        "type": f"charge.{kind}",
        "sequence": 1,
        "order_id": charge["order_id"],
        "billing_period": charge["billing_period"],
        "subscription_id": charge["subscription_id"],
        "customer_id": charge["customer_id"],
        "amount_minor": charge["amount_minor"],
        "currency": charge["currency"],
        "attempt": 1,
        "gateway_charge_id": charge_id,
        "decline_code": decline_code,
        "decline_class": None if decline_code is None else decline_class(decline_code),
        "occurred_at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
    }
    return event_id, kind, json.dumps(body).encode()


async def serve(config: BareConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pool = await asyncpg.create_pool(
        config.database_url, min_size=1, max_size=config.db_pool_max, reset=keep_session
    )
    assert pool is not None
    scoring = build_client(config.scoring_url, timeout_s=config.http_timeout_s, max_connections=100)
    gateway = build_client(
        config.gateway_url,
        timeout_s=config.http_timeout_s,
        max_connections=100,
        headers={"Authorization": f"Bearer {config.api_key}"},
    )
    bare = BarePipeline(config, pool, scoring, gateway)
    try:
        await bare.run(stop)
    finally:
        await scoring.aclose()
        await gateway.aclose()
        await pool.close()
        print(
            f"bare pipeline: {bare.done} acked, {bare.published} outcome events published, "
            f"{bare.failed} failed",
            file=sys.stderr,
        )


def main(argv: list[str]) -> None:
    event_loop.run(serve(BareConfig.model_validate_json(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
