"""The worker's own CPU per charge against the bare pipeline's, both in one process, in
alternating batches over the same dependencies: by default the real ones (the bench's
embedded PostgreSQL and its gateway and scoring simulators, each pipeline on a fresh
database), with `--fake-io` canned answers (httpx over a transport that answers at once, a
pool that returns the rows a fresh charge gets; each yields to the loop once). JetStream is
left out in both modes: the deliveries are handed over and their acks go nowhere (the two
pipelines fetch and ack alike).

A diagnosis, not a target: `make bench` measures the real thing, each consumer in its own
process. On a shared VM whose speed drifts by a third from one minute to the next, the full
bench's ratio drifts with it (docs/benchmarks.md). Here the median of the per-pair ratios
holds to about 0.01 from run to run, so a change to the worker's own code can be measured in
minutes: run this on each tree, alternately,

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.overhead

The in-process ratio is not the bench's: both pipelines share one heap and one loop here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from benchmarks.bare_pipeline import BareConfig, BarePipeline
from benchmarks.load import due_body
from benchmarks.stack import Stack
from charge_worker import event_loop, logs
from charge_worker.database import create_pool, keep_session
from charge_worker.gateway.contract import ContractGateway
from charge_worker.http import build_client
from charge_worker.ledger import Ledger
from charge_worker.scoring import ScoringClient
from charge_worker.settings import LogSettings, load_settings
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Pipeline

CONCURRENCY = 16
WARM_UP_ROUNDS = 3
FAKE_ENV = {
    "NATS_URL": "nats://127.0.0.1:1",
    "DATABASE_URL": "postgresql://fake@127.0.0.1:1/fake",
    "GATEWAY_URL": "http://127.0.0.1",
    "GATEWAY_API_KEY": "sk_test_overhead",
    "SCORING_URL": "http://scoring",
}


@dataclass
class Dependencies:
    """What each pipeline talks to: its pool, its two clients' transport (None: real)."""

    worker_pool: Any
    bare_pool: Any
    transport: httpx.AsyncBaseTransport | None


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


@contextlib.asynccontextmanager
async def faked() -> AsyncIterator[Dependencies]:
    os.environ.update(FAKE_ENV)
    yield Dependencies(Pool(), Pool(), Answers())


@contextlib.asynccontextmanager
async def real(stack: Stack) -> AsyncIterator[Dependencies]:
    await stack.prepare()
    worker_db, bare_db = await stack.new_database(), await stack.new_database()
    os.environ.update(
        NATS_URL=stack.nats_url,
        DATABASE_URL=worker_db,
        GATEWAY_URL=stack.gateway.url,
        GATEWAY_API_KEY=stack.api_key,
        SCORING_URL=stack.scoring.url,
    )
    worker_pool = await create_pool(load_settings().db)
    bare_pool = await asyncpg.create_pool(bare_db, max_size=10, reset=keep_session)
    try:
        yield Dependencies(worker_pool, bare_pool, None)
    finally:
        await worker_pool.close()
        await bare_pool.close()
        await stack.cleanup_databases()  # servers of your own (NATS_URL, DATABASE_URL)


async def measure(deps: Dependencies, rounds: int, batch: int) -> None:
    settings = load_settings()
    nowhere = Nowhere()
    # the bench's adapter; its `transport` is the one seam for canned answers
    gateway = ContractGateway(settings.gateway, transport=deps.transport)
    gateway_url, scoring_url = settings.gateway.url or "", settings.scoring.url or ""
    api_key = settings.gateway.api_key.get_secret_value() if settings.gateway.api_key else ""
    scoring = ScoringClient(settings.scoring, transport=deps.transport)
    metrics = Metrics(CollectorRegistry())
    failpoints = Failpoints("")
    pipeline = Pipeline(
        Ledger(deps.worker_pool, lease_s=settings.worker.lease_s),
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
        deps.bare_pool,
        build_client(scoring_url, timeout_s=5, max_connections=100, transport=deps.transport),
        build_client(
            gateway_url,
            timeout_s=5,
            max_connections=100,
            headers={"Authorization": f"Bearer {api_key}"},
            transport=deps.transport,
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
        f"medians; {'fake' if deps.transport else 'real'} I/O; "
        f"{os.path.dirname(sys.modules['charge_worker'].__file__ or '')})"
    )
    await gateway.aclose()
    await scoring.aclose()
    await bare.scoring.aclose()
    await bare.gateway.aclose()


async def run(args: argparse.Namespace, stack: Stack | None) -> None:
    dependencies = faked() if stack is None else real(stack)
    async with dependencies as deps:
        await measure(deps, args.rounds, args.batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="alternating pairs of batches")
    parser.add_argument("--batch", type=int, default=160, help="charges per batch")
    parser.add_argument("--fake-io", action="store_true", help="canned answers, no servers")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = None if args.fake_io else stack.enter_context(Stack(work_dir))
        devnull = stack.enter_context(open(os.devnull, "w"))
        sys.stderr = devnull  # the canonical lines are written, to nowhere
        stack.callback(setattr, sys, "stderr", sys.__stderr__)
        logs.configure(LogSettings(log_format="json"))
        gc.freeze()  # as `charge-worker run` does
        event_loop.run(run(args, servers))


if __name__ == "__main__":
    main()
