"""The worker's own CPU per charge against the bare pipeline's, both in one process, in
alternating batches over the same dependencies: by default the real ones (the bench's
embedded PostgreSQL and its gateway and scoring simulators, each pipeline on a fresh
database), with `--fake-io` canned answers (httpx over a transport that answers at once, a
pool that returns the rows a fresh charge gets; each yields to the loop once). JetStream is
left out in both modes: the deliveries are handed over and their acks go nowhere (the two
pipelines fetch and ack alike), and each outcome event's publish is answered at once with a
stream sequence.

Outcome events are part of each pipeline's batch: after its deliveries, the worker's relay
(`Relay.relay_once`, again while its batches come full) publishes what the ledger's
triggers wrote to the outbox (with `--fake-io`, the pool's outbox holds one row per charge
of the batch), and the bare pipeline publishes its own list of events, batched alike.
The bare pipeline's database has the outbox triggers disabled (its `UPDATE` would fire
them). `--no-outbox` leaves the events out of both: the worker's database has its outbox
triggers disabled too and neither publishes, to measure what the events cost each pipeline.

A diagnosis, not a target: `make bench` measures the real thing, each consumer in its own
process. On a shared VM whose speed drifts by a third from one minute to the next, the full
bench's ratio drifts with it (docs/benchmarks.md). Here the median of the per-pair ratios
holds to about 0.01 from run to run, so a change to the worker's own code can be measured in
minutes: run this on each tree, alternately,

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.overhead

The in-process ratio is not the bench's: both pipelines share one heap and one loop here.

With real I/O, after the timed batches, it counts the statements each pipeline sends
PostgreSQL per charge (asyncpg's query log on a pool of its own, outside the timed
batches): a batch of charges that succeed on their first try, then one whose cards are all
declined (soft: the worker settles them `retry_scheduled`), each with its outcome events'
relay. The count is exact and does not drift: a change that adds a statement to a charge
shows as +1.00.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from asyncpg.connection import LoggedQuery
from nats.aio.msg import Msg
from nats.js.api import PubAck
from prometheus_client import CollectorRegistry

from benchmarks.bare_pipeline import BareConfig, BarePipeline
from benchmarks.load import PERIOD, due_body
from benchmarks.processes import cpu_seconds
from benchmarks.stack import Stack
from charge_worker import event_loop, logs
from charge_worker.database import create_pool, keep_session
from charge_worker.gateway.contract import ContractGateway
from charge_worker.http import build_client
from charge_worker.ledger import Ledger
from charge_worker.outcomes.outbox import Outbox
from charge_worker.outcomes.relay import OutboxMetrics, Relay
from charge_worker.scoring import ScoringClient
from charge_worker.settings import LogSettings, Settings, load_settings
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Pipeline

CONCURRENCY = 16
OCCURRED_AT = dt.datetime(2026, 12, 1, 0, 0, 1, tzinfo=dt.UTC)
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
    """What each pipeline talks to: its pool, its two clients' transport (None: real);
    what writes the worker's outbox rows of a batch's orders (the triggers, or the fake
    pool); PostgreSQL's postmaster (its CPU is read per batch), if it is the harness's."""

    worker_pool: Any
    bare_pool: Any
    transport: httpx.AsyncBaseTransport | None
    write_outcomes: Callable[[range], None] = lambda _orders: None
    postgres_pid: int | None = None
    # real I/O: pools whose statements are counted, on each pipeline's database
    count_statements: Callable[[], contextlib.AbstractAsyncContextManager[Counted]] | None = None


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
    """A fresh claim, every fenced write accepted, and the outbox's rows."""

    def __init__(self, outbox: list[dict[str, object]]) -> None:
        self.outbox = outbox

    async def fetch(self, _sql: str, limit: int) -> list[dict[str, object]]:
        await asyncio.sleep(0)
        taken = self.outbox[:limit]
        del self.outbox[:limit]
        return taken

    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def fetchrow(self, _sql: str, *_args: object) -> dict[str, object]:
        await asyncio.sleep(0)
        return {
            "attempt": 1,
            "gateway_calls": 0,
            "scoring": None,
            "since": OCCURRED_AT,
            "taken_from": None,
            "nak_delivery": None,
        }

    async def fetchval(self, _sql: str, *_args: object) -> int:
        await asyncio.sleep(0)
        return 1

    async def execute(self, _sql: str, *_args: object) -> str:
        await asyncio.sleep(0)
        return "UPDATE 1"


class Acquired:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    async def __aenter__(self) -> Connection:
        return self.connection

    async def __aexit__(self, *_exc: object) -> None:
        return None


class Pool(Connection):
    def __init__(self) -> None:
        super().__init__([])

    def acquire(self) -> Acquired:
        return Acquired(Connection(self.outbox))

    def write_outcomes(self, order_ids: range) -> None:
        """What the ledger's triggers would have written for these orders, charged."""
        self.outbox += [outbox_row(order_id) for order_id in order_ids]


def outbox_row(order_id: int) -> dict[str, object]:
    """An outbox row as the relay reads it (`outbox._TAKE`'s columns, in order): the
    `charge.succeeded` of `order_id`."""
    return {
        "order_id": order_id,
        "billing_period": PERIOD,
        "sequence": 1,
        "type": "charge.succeeded",
        "subscription_id": f"sub_{order_id}",
        "customer_id": "cus_bench_1",
        "amount_minor": 99000,
        "currency": "RUB",
        "gateway_charge_id": f"ch_{order_id}",
        "decline_code": None,
        "decline_class": None,
        "review": False,
        "traceparent": None,
        "occurred_at": OCCURRED_AT,
        "attempt": 1,
        "retry_at": None,
    }


class Nowhere:
    """Where the acks go."""

    async def publish(self, *_args: object, **_kwargs: object) -> None:
        return None


class Stream:
    """Where the outcome events go: a JetStream that stores each publish at once."""

    def __init__(self) -> None:
        self.stored = 0

    async def publish(self, *_args: object, **_kwargs: object) -> PubAck:
        await asyncio.sleep(0)
        self.stored += 1
        return PubAck(stream="OUTCOMES", seq=self.stored)


def message(seq: int, nc: Nowhere, decline_every: int = 0) -> Msg:
    return Msg(
        nc,  # type: ignore[arg-type]
        subject="charges.due",
        reply=f"$JS.ACK.CHARGES.charges-worker.1.{seq}.{seq}.1796286606794460000.0",
        data=due_body(seq, decline_every),
        headers={"Nats-Msg-Id": f"charge:{seq}:2026-12-01"},
    )


@contextlib.asynccontextmanager
async def faked(events: bool) -> AsyncIterator[Dependencies]:
    os.environ.update(FAKE_ENV)
    worker_pool = Pool()
    write = worker_pool.write_outcomes if events else (lambda _orders: None)
    yield Dependencies(worker_pool, Pool(), Answers(), write)


@contextlib.asynccontextmanager
async def real(stack: Stack, events: bool) -> AsyncIterator[Dependencies]:
    await stack.prepare()
    worker_db, bare_db = await stack.new_database(), await stack.new_database()
    for url in (worker_db, bare_db) if not events else (bare_db,):  # no outbox triggers
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("ALTER TABLE charge_attempts DISABLE TRIGGER USER")
        finally:
            await conn.close()
    os.environ.update(
        NATS_URL=stack.nats_url,
        DATABASE_URL=worker_db,
        GATEWAY_URL=stack.gateway.url,
        GATEWAY_API_KEY=stack.api_key,
        SCORING_URL=stack.scoring.url,
    )
    worker_pool = await create_pool(load_settings().db)
    bare_pool = await asyncpg.create_pool(bare_db, max_size=10, reset=keep_session)
    postgres = stack.postgres.proc.pid if stack.postgres and stack.postgres.proc else None

    @contextlib.asynccontextmanager
    async def counted() -> AsyncIterator[Counted]:
        statements = Statements()
        worker = await statements.pool("worker", worker_db)
        bare = await statements.pool("bare", bare_db)
        try:
            yield Counted(statements, worker, bare)
        finally:
            await worker.close()
            await bare.close()

    try:
        yield Dependencies(
            worker_pool, bare_pool, None, postgres_pid=postgres, count_statements=counted
        )
    finally:
        await worker_pool.close()
        await bare_pool.close()
        await stack.cleanup_databases()  # servers of your own (NATS_URL, DATABASE_URL)


@dataclass
class Worker:
    """The worker's parts a delivery and its outcome event go through, on one pool."""

    settings: Settings
    consumer: Consumer
    relay: Relay
    metrics: Metrics
    gateway: ContractGateway
    scoring: ScoringClient

    @classmethod
    def on(
        cls,
        pool: Any,
        settings: Settings,
        transport: httpx.AsyncBaseTransport | None,
        stream: Stream,
    ) -> Worker:
        # the bench's adapter; its `transport` is the one seam for canned answers
        gateway = ContractGateway(settings.gateway, transport=transport)
        scoring = ScoringClient(settings.scoring, transport=transport)
        metrics = Metrics(CollectorRegistry())
        failpoints = Failpoints("")
        pipeline = Pipeline(
            Ledger(pool, lease_s=settings.worker.lease_s),
            gateway,
            scoring,
            owner="overhead",
            metrics=metrics,
            failpoints=failpoints,
            retry_schedule=settings.retries.retry_schedule,
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
        outbox = Outbox.of_worker(pool, settings.worker)
        relay = Relay(
            outbox,
            stream,  # type: ignore[arg-type]  # publishes only
            settings.nats,
            settings.worker,
            OutboxMetrics(metrics.registry),
        )
        return cls(settings, consumer, relay, metrics, gateway, scoring)

    async def handle(self, msgs: list[Msg]) -> None:
        """The deliveries, `CONCURRENCY` at a time."""
        for i in range(0, len(msgs), CONCURRENCY):
            fetched_at = time.monotonic()
            await asyncio.gather(
                *(self.consumer._handle(m, fetched_at) for m in msgs[i : i + CONCURRENCY])
            )

    async def publish_outcomes(self) -> None:
        """The relay, until it has nothing left."""
        while await self.relay.relay_once() == self.settings.worker.outbox_batch:
            pass

    async def aclose(self) -> None:
        await self.gateway.aclose()
        await self.scoring.aclose()


async def handle_bare(bare: BarePipeline, msgs: list[Msg]) -> None:
    """The deliveries, `CONCURRENCY` at a time, as `Worker.handle`."""
    for i in range(0, len(msgs), CONCURRENCY):
        await asyncio.gather(*(bare.handle(m) for m in msgs[i : i + CONCURRENCY]))


async def publish_bare(bare: BarePipeline) -> None:
    while await bare.publish_outcomes() == bare.config.outbox_batch:
        pass


async def measure(deps: Dependencies, rounds: int, batch: int, *, events: bool) -> None:
    settings = load_settings()
    nowhere = Nowhere()
    stream = Stream()
    worker = Worker.on(deps.worker_pool, settings, deps.transport, stream)
    metrics = worker.metrics
    bare = bare_pipeline(deps, settings, stream, events=events)
    next_seq = 0

    async def publish_outcomes(on_worker: bool) -> None:
        """Each pipeline's relay, until it has nothing left of the batch."""
        if not events:
            return
        await (worker.publish_outcomes() if on_worker else publish_bare(bare))

    async def one_batch(on_worker: bool) -> tuple[float, float]:
        """CPU us per charge of `batch` deliveries, `CONCURRENCY` at a time, and their
        outcome events: this process's, and PostgreSQL's (NaN if not measured)."""
        nonlocal next_seq
        msgs = [message(next_seq + i + 1, nowhere) for i in range(batch)]
        if on_worker:
            deps.write_outcomes(range(next_seq + 1, next_seq + batch + 1))
        next_seq += batch
        postgres = _cpu_s(deps.postgres_pid)
        started = time.process_time()
        await (worker.handle(msgs) if on_worker else handle_bare(bare, msgs))
        await publish_outcomes(on_worker)
        spent = time.process_time() - started
        return spent / batch * 1e6, (_cpu_s(deps.postgres_pid) - postgres) / batch * 1e6

    for _ in range(WARM_UP_ROUNDS):
        await one_batch(True)
        await one_batch(False)
    pairs = [(await one_batch(True), await one_batch(False)) for _ in range(rounds)]
    check(metrics, bare, stream, (rounds + WARM_UP_ROUNDS) * batch, events=events)
    report(pairs, deps, batch, events=events)
    await worker.aclose()
    await bare.scoring.aclose()
    await bare.gateway.aclose()
    if deps.count_statements is not None:
        await count_statements(deps, settings, first=next_seq + 1, batch=batch, events=events)


class Statements:
    """Every statement sent on the pools it made, by the SQL's opening words, while
    `counting` (asyncpg's query log)."""

    def __init__(self) -> None:
        self.counting = False
        self.by_pool: dict[str, Counter[str]] = {}

    async def pool(self, name: str, url: str) -> asyncpg.Pool:
        """A pool like the worker's (`database.create_pool`) whose statements are counted
        under `name`."""
        counts = self.by_pool.setdefault(name, Counter())

        def note(query: LoggedQuery) -> None:
            if self.counting:
                counts[" ".join(query.query.split()[:3])] += 1

        async def init(conn: asyncpg.Connection) -> None:
            conn.add_query_logger(note)

        pool = await asyncpg.create_pool(url, max_size=10, reset=keep_session, init=init)
        assert pool is not None
        return pool

    def take(self, name: str) -> Counter[str]:
        """The counts under `name` so far, which start again from nothing."""
        taken = Counter(self.by_pool[name])
        self.by_pool[name].clear()
        return taken


@dataclass
class Counted:
    """Pools on the worker's and the bare pipeline's databases, their statements counted."""

    statements: Statements
    worker: asyncpg.Pool
    bare: asyncpg.Pool


async def count_statements(
    deps: Dependencies, settings: Settings, *, first: int, batch: int, events: bool
) -> None:
    """Print the statements each pipeline sends per charge: a batch charged on its first
    try, and a batch declined (soft), their outcome events' relay included."""
    assert deps.count_statements is not None
    nowhere = Nowhere()
    lines = []
    async with deps.count_statements() as counted:
        worker = Worker.on(counted.worker, settings, None, Stream())
        bare = bare_pipeline(deps, settings, Stream(), events=events, pool=counted.bare)
        for label, decline_every in (("charged on try 1", 0), ("declined (soft)", 1)):
            for counting in (False, True):  # a warm-up first: each connection's type checks
                msgs = [message(first + i, nowhere, decline_every) for i in range(batch)]
                orders = range(first, first + batch)
                first += batch
                counted.statements.counting = counting
                await worker.handle(msgs)
                await handle_bare(bare, msgs)
                if events:
                    await worker.publish_outcomes()
                    await publish_bare(bare)
                counted.statements.counting = False
            for name in ("worker", "bare"):
                pool = counted.worker if name == "worker" else counted.bare
                rows = await _statuses(pool, orders)
                taken = counted.statements.take(name)
                lines.append(_statement_line(f"{label}, {name}", taken, batch, rows))
        await worker.aclose()
        await bare.scoring.aclose()
        await bare.gateway.aclose()
    print(
        f"Statements sent to PostgreSQL per charge (a batch of {batch} each; outcome events "
        f"{'on' if events else 'off'}), by their opening words:"
    )
    for line in lines:
        print(f"  {line}")


async def _statuses(pool: asyncpg.Pool, orders: range) -> dict[str, int]:
    """The ledger's rows of `orders` by status."""
    rows = await pool.fetch(
        "SELECT status, count(*) FROM charge_attempts WHERE order_id BETWEEN $1 AND $2 "
        "GROUP BY status",
        orders.start,
        orders.stop - 1,
    )
    return {str(row[0]): int(row[1]) for row in rows}


def _statement_line(label: str, counts: Counter[str], batch: int, rows: dict[str, int]) -> str:
    total = sum(counts.values()) / batch
    each = ", ".join(f"{words}… {n / batch:.3f}" for words, n in counts.most_common())
    ledger = ", ".join(f"{status} {n}" for status, n in sorted(rows.items()))
    return f"{label:<30} {total:.3f} ({each}); rows: {ledger}"


def check(
    metrics: Metrics, bare: BarePipeline, stream: Stream, charges: int, *, events: bool
) -> None:
    """Every delivery charged and acked by each pipeline, and its event published."""
    acked = metrics.registry.get_sample_value(
        "charge_worker_messages_total", {"outcome": "charged", "action": "ack"}
    )
    relayed = metrics.registry.get_sample_value(
        "charge_worker_outbox_publishes_total", {"result": "published"}
    )
    published = (relayed, bare.published, stream.stored)
    if acked != charges or bare.failed:
        raise SystemExit(f"not every delivery was charged and acked: {acked}, {bare.failed}")
    if published != ((charges, charges, 2 * charges) if events else (0, 0, 0)):
        raise SystemExit(f"outcome events published (relay, bare, stored): {published}")


def bare_pipeline(
    deps: Dependencies, settings: Settings, stream: Stream, *, events: bool, pool: Any = None
) -> BarePipeline:
    """The bare pipeline on `deps` (or on `pool`), its events published to `stream`."""
    gateway_url, scoring_url = settings.gateway.url or "", settings.scoring.url or ""
    api_key = settings.gateway.api_key.get_secret_value() if settings.gateway.api_key else ""
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
        outcomes_subject=settings.nats.outcomes_subject,
        outcome_events=events,
        outbox_batch=settings.worker.outbox_batch,
        outbox_poll_s=settings.worker.outbox_poll_s,
        outbox_publish_timeout_s=settings.worker.outbox_publish_timeout_s,
    )
    return BarePipeline(
        config,
        deps.bare_pool if pool is None else pool,
        build_client(scoring_url, timeout_s=5, max_connections=100, transport=deps.transport),
        build_client(
            gateway_url,
            timeout_s=5,
            max_connections=100,
            headers={"Authorization": f"Bearer {api_key}"},
            transport=deps.transport,
        ),
        js=stream,  # type: ignore[arg-type]  # publishes only
    )


def report(
    pairs: list[tuple[tuple[float, float], tuple[float, float]]],
    deps: Dependencies,
    batch: int,
    *,
    events: bool,
) -> None:
    """Print the medians of the pairs: this process's CPU, then PostgreSQL's."""
    own = [(w, b) for (w, _), (b, _) in pairs]
    bare_us = statistics.median(b for _, b in own)
    ratio = statistics.median(w / b for w, b in own)
    extra = statistics.median(w - b for w, b in own)
    where = os.path.dirname(sys.modules["charge_worker"].__file__ or "")
    print(
        f"worker {ratio * bare_us:,.1f} us/charge, bare {bare_us:,.1f} us/charge: "
        f"ratio {ratio:.3f}, extra {extra:,.1f} us ({len(pairs)} pairs of {batch} charges, "
        f"medians; {'fake' if deps.transport else 'real'} I/O; "
        f"outcome events {'on' if events else 'off'}; {where})"
    )
    if deps.postgres_pid is not None:
        db = [(w, b) for (_, w), (_, b) in pairs]
        print(
            f"PostgreSQL, the same batches: worker {statistics.median(w for w, _ in db):,.0f}"
            f" us/charge, bare {statistics.median(b for _, b in db):,.0f} us/charge, extra "
            f"{statistics.median(w - b for w, b in db):,.0f} us (medians; its processes' "
            "times count in clock ticks of 10 ms: a rough figure)"
        )


def _cpu_s(postgres_pid: int | None) -> float:
    """PostgreSQL's CPU seconds so far (its backends too), NaN if it is not measured."""
    return math.nan if postgres_pid is None else cpu_seconds(postgres_pid, with_children=True)


async def run(args: argparse.Namespace, stack: Stack | None) -> None:
    events = not args.no_outbox
    dependencies = faked(events) if stack is None else real(stack, events)
    async with dependencies as deps:
        await measure(deps, args.rounds, args.batch, events=events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="alternating pairs of batches")
    parser.add_argument("--batch", type=int, default=160, help="charges per batch")
    parser.add_argument("--fake-io", action="store_true", help="canned answers, no servers")
    parser.add_argument(
        "--no-outbox",
        action="store_true",
        help="no outcome events: the worker's outbox triggers off, neither pipeline publishes",
    )
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
