"""The bare pipeline: the worker's I/O per message with none of its safety — the ceiling.

Per message, exactly the round trips a charge needs: pull fetch (to free capacity, like the
worker), claim `INSERT`, score `POST`, charge `POST`, mark `UPDATE`, ack. No validation
model, no lease fence, no breaker, no heartbeats, no deadline, no gateway-call bookkeeping,
no event rows, no metrics, no log line. The HTTP clients are the worker's own
(`charge_worker.http.build_client`: httpx over the httpx-aiohttp transport), the pool is
asyncpg with the worker's size and reset, and the event loop is the worker's
(`charge_worker.event_loop`), so the two differ only in what the worker adds.

Run as a child process by the harness (its CPU is measured like the worker's):
`python -m benchmarks.bare_pipeline CONFIG_JSON`. It touches
`ready_file` once bound to the consumer and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
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
from pydantic import BaseModel

from charge_worker import event_loop
from charge_worker.database import keep_session
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
   SET status = 'succeeded', gateway_charge_id = $3, lease_owner = NULL, lease_until = NULL,
       settled_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2
"""


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


class BarePipeline:
    def __init__(
        self,
        config: BareConfig,
        pool: asyncpg.Pool,
        scoring: httpx.AsyncClient,
        gateway: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.pool = pool
        self.scoring = scoring
        self.gateway = gateway
        self.done = 0
        self.failed = 0

    async def handle(self, msg: Msg) -> None:
        try:
            charge = json.loads(msg.data)
            order_id, period = charge["order_id"], dt.date.fromisoformat(charge["billing_period"])
            key = f"{order_id}:{charge['billing_period']}"
            await self._claim(charge, period, key)
            await self._score(charge)
            charge_id = await self._charge(charge, key)
            await self._mark(order_id, period, charge_id)
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

    # One method per round trip, each the bare form of a step of the worker's pipeline.
    async def _claim(self, charge: dict[str, Any], period: dt.date, key: str) -> None:
        await self.pool.execute(
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

    async def _score(self, charge: dict[str, Any]) -> None:
        score = {
            "order_id": charge["order_id"],
            "customer_id": charge["customer_id"],
            "amount_minor": charge["amount_minor"],
            "currency": charge["currency"],
        }
        verdict = (await self.scoring.post("/v1/score", json=score)).json()["decision"]
        assert verdict == "approve", verdict

    async def _charge(self, charge: dict[str, Any], key: str) -> str:
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
        return str(answer.json()["id"])

    async def _mark(self, order_id: int, period: dt.date, charge_id: str) -> None:
        await self.pool.execute(MARK, order_id, period, charge_id)

    async def run(self, stop: asyncio.Event) -> None:
        servers = [url.strip() for url in self.config.nats_url.split(",")]
        nc = await nats.connect(servers=servers, name=OWNER)
        sub = await nc.jetstream().pull_subscribe_bind(
            durable=self.config.durable, stream=self.config.stream
        )
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
            await nc.close()


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
        print(f"bare pipeline: {bare.done} acked, {bare.failed} failed", file=sys.stderr)


def main(argv: list[str]) -> None:
    event_loop.run(serve(BareConfig.model_validate_json(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
