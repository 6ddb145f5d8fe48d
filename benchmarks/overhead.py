"""The worker's own CPU per charge against the bare pipeline's, in one process, with the
I/O faked the same way under both: canned PostgreSQL answers, canned HTTP answers (httpx
over a transport that answers at once), an ack that goes nowhere. Each fake yields to the
loop once, as a real round trip would.

A diagnosis, not a target: `make bench` measures the real thing. On a shared VM whose speed
drifts by a third from one minute to the next, the full bench's ratio drifts with it
(docs/performance.md). Here both run in one process, in alternating batches, and the median
of the per-pair ratios is steady to about 0.01, so a change to the worker's own code can be
measured in minutes: run this on each tree, alternately,

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.overhead --rounds 100

The ratio is larger than the full bench's (no sockets, no aiohttp, no asyncpg protocol under
either: the shared work is smaller); the `extra` in microseconds is the worker's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from typing import Any

import httpx
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from benchmarks.bare_pipeline import BareConfig, BarePipeline
from benchmarks.load import due_body
from charge_worker import event_loop, logs
from charge_worker.gateway import build_gateway
from charge_worker.http import build_client
from charge_worker.ledger import Ledger
from charge_worker.scoring import ScoringClient
from charge_worker.settings import load_settings
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Pipeline

CONCURRENCY = 16
WARM_UP_ROUNDS = 3
FAKE_ENV = {
    "NATS_URL": "nats://127.0.0.1:1",
    "DATABASE_URL": "postgresql://fake@127.0.0.1:1/fake",
    "GATEWAY_URL": "http://gateway",
    "GATEWAY_API_KEY": "sk_test_overhead",
    "SCORING_URL": "http://scoring",
}


class Answers(httpx.AsyncBaseTransport):
    """Scoring approves; the gateway charges."""

    def __init__(self) -> None:
        self.charged = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0)
        if request.url.path == "/v1/score":
            body: dict[str, object] = {"decision": "approve", "score": 0.1}
        else:
            self.charged += 1
            body = {"id": f"ch_{self.charged}", "status": "succeeded", "amount": 99000}
        return httpx.Response(200, json=body)


class Connection:
    """A fresh claim, and every fenced write accepted."""

    async def fetchrow(self, _sql: str, *_args: object) -> dict[str, object]:
        await asyncio.sleep(0)
        return {"attempt": 1, "gateway_calls": 0, "scoring": None, "taken_from": None}

    async def fetchval(self, _sql: str, *_args: object) -> int:
        await asyncio.sleep(0)
        return 1

    async def execute(self, _sql: str, *_args: object) -> str:
        await asyncio.sleep(0)
        return "UPDATE 1"


class Acquired:
    def __init__(self) -> None:
        self.connection = Connection()

    async def __aenter__(self) -> Connection:
        return self.connection

    async def __aexit__(self, *_exc: object) -> None:
        return None


class Pool(Connection):
    def acquire(self) -> Acquired:
        return Acquired()


class Nowhere:
    """Where the acks go."""

    async def publish(self, *_args: object, **_kwargs: object) -> None:
        return None


def message(seq: int, nc: Nowhere) -> Msg:
    return Msg(
        nc,  # type: ignore[arg-type]
        subject="charges.due",
        reply=f"$JS.ACK.CHARGES.charges-worker.1.{seq}.{seq}.1796286606794460000.0",
        data=due_body(seq),
        headers={"Nats-Msg-Id": f"charge:{seq}:2026-12-01"},
    )


async def measure(rounds: int, batch: int) -> None:
    settings = load_settings()
    answers, pool, nowhere = Answers(), Pool(), Nowhere()
    gateway = build_gateway(settings.gateway)
    gateway.client = build_client(  # type: ignore[attr-defined]
        "http://gateway",
        timeout_s=5,
        max_connections=100,
        headers={"Authorization": "Bearer sk"},
        transport=answers,
    )
    scoring = ScoringClient(settings.scoring, transport=answers)
    metrics = Metrics(CollectorRegistry())
    failpoints = Failpoints("")
    pipeline = Pipeline(
        Ledger(pool, lease_s=settings.worker.lease_s),  # type: ignore[arg-type]
        gateway,
        scoring,
        owner="overhead",
        metrics=metrics,
        failpoints=failpoints,
    )
    consumer = Consumer(
        settings,
        js=None,  # type: ignore[arg-type]  # never fetches: deliveries are handed to it
        pipeline=pipeline,
        dead_letters=None,  # type: ignore[arg-type]  # nothing is dead-lettered
        gateway=gateway,
        metrics=metrics,
        failpoints=failpoints,
    )
    config = BareConfig(
        nats_url="",
        stream="",
        durable="",
        database_url="",
        gateway_url="",
        scoring_url="",
        api_key="",
        concurrency=CONCURRENCY,
        db_pool_max=10,
        http_timeout_s=5,
        fetch_wait_s=1,
        ready_file="",
    )
    bare = BarePipeline(
        config,
        pool,  # type: ignore[arg-type]
        build_client("http://scoring", timeout_s=5, max_connections=100, transport=answers),
        build_client(
            "http://gateway",
            timeout_s=5,
            max_connections=100,
            headers={"Authorization": "Bearer sk"},
            transport=answers,
        ),
    )
    next_seq = 0

    async def one_batch(worker: bool) -> float:
        """CPU us per charge of `batch` deliveries, `CONCURRENCY` at a time."""
        nonlocal next_seq
        msgs = [message(next_seq + i + 1, nowhere) for i in range(batch)]
        next_seq += batch
        started = time.process_time()
        for i in range(0, batch, CONCURRENCY):
            chunk = msgs[i : i + CONCURRENCY]
            fetched_at = time.monotonic()
            handled: list[Any] = [
                consumer._handle(m, fetched_at) if worker else bare.handle(m) for m in chunk
            ]
            await asyncio.gather(*handled)
        return (time.process_time() - started) / batch * 1e6

    for _ in range(WARM_UP_ROUNDS):
        await one_batch(True)
        await one_batch(False)
    pairs = [(await one_batch(True), await one_batch(False)) for _ in range(rounds)]
    acked = metrics.registry.get_sample_value(
        "charge_worker_messages_total", {"outcome": "charged", "action": "ack"}
    )
    if acked != (rounds + WARM_UP_ROUNDS) * batch or bare.failed:
        raise SystemExit(f"not every delivery was charged and acked: {acked}, {bare.failed}")
    bare_us = statistics.median(b for _, b in pairs)
    ratio = statistics.median(w / b for w, b in pairs)
    extra = statistics.median(w - b for w, b in pairs)
    print(
        f"worker {ratio * bare_us:,.1f} us/charge, bare {bare_us:,.1f} us/charge: "
        f"ratio {ratio:.3f}, extra {extra:,.1f} us ({rounds} pairs of {batch} charges, "
        f"medians; {os.path.dirname(sys.modules['charge_worker'].__file__ or '')})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="alternating pairs of batches")
    parser.add_argument("--batch", type=int, default=160, help="charges per batch")
    args = parser.parse_args()
    os.environ.update(FAKE_ENV)
    settings = load_settings()
    with open(os.devnull, "w") as devnull:  # the canonical lines are written, to nowhere
        sys.stderr = devnull
        logs.configure(settings.log)
        gc.freeze()  # as `charge-worker run` does
        try:
            event_loop.run(measure(args.rounds, args.batch))
        finally:
            sys.stderr = sys.__stderr__


if __name__ == "__main__":
    main()
