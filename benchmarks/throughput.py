"""Cases 1 and 2: the bare pipeline (the ceiling) and the worker, zero-latency simulators.

Both drain the same number of messages with the same concurrency, pool size and HTTP client
stack; their samples alternate (bare, worker, bare, worker, ...) so drift of the machine
falls on both alike. In every sample of these cases 1 in 10 customers' cards is declined
(`DECLINE_EVERY`: a `generic_decline`, soft): the worker settles those `retry_scheduled`
(its default retry schedule) and emits `charge.retry_scheduled`; the bare pipeline, which
has no retries, marks them `declined` and publishes `charge.declined`. After each worker
sample a paced phase publishes at half the rate just measured and takes publish-to-ack
latencies (`drain.py`, `load.py`).

Case 2b, `verified_sample`: the worker with the subscription check on
(`CHARGE_WORKER_VERIFY_SUBSCRIPTION=match`), after each worker sample. The bench publishes
due charges straight to the stream, with no ledger row (no producer ran), so every claim
takes the check's path: the claim's INSERT carries the EXISTS on `subscriptions`. The
sample's database gets an active subscription agreeing with each message first (its customer
too, declining or not), so every one is verified and sent to the gateway (a refused one
would be dead-lettered, and the sample's checks would say so). No paced phase: it measures
throughput and CPU only, against the same bare samples as case 2.

Case 2c, `no_outbox_sample`: the worker on a ledger whose outbox triggers are disabled, right
after each worker sample: no event row is written, and the worker's relay finds nothing to
publish. Case 2 minus case 2c, pair by pair, is what the outbox of outcome events costs per
charge (its rows, its triggers, its relay's statements and publishes). No paced phase.
"""

from __future__ import annotations

import httpx

from benchmarks.bare_pipeline import BareConfig
from benchmarks.bench import ROOT, Bench
from benchmarks.drain import ChildConsumer, Drained, Events, Plan, Workers, child_env
from benchmarks.processes import Child, python_argv
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.settings import Settings

ZERO = LatencyModel.fixed(0.0)
PACED_FRACTION = 0.5
DECLINE_EVERY = 10  # 1 in 10 customers' cards declined: 10 % soft declines


def bare_consumer(bench: Bench, settings: Settings, name: str) -> ChildConsumer:
    """The bare pipeline as a child process, mirroring `settings`."""
    ready_file = bench.log_dir / f"{name}.ready"
    ready_file.unlink(missing_ok=True)
    config = BareConfig(
        nats_url=bench.stack.nats_url,
        stream=settings.nats.stream,
        durable=settings.nats.durable,
        database_url=settings.db.dsn,
        gateway_url=bench.stack.gateway.url,
        scoring_url=bench.stack.scoring.url,
        api_key=bench.stack.api_key,
        concurrency=settings.worker.concurrency,
        db_pool_max=settings.db.db_pool_max,
        http_timeout_s=settings.gateway.gateway_timeout_s,
        fetch_wait_s=settings.worker.fetch_wait_s,
        ready_file=str(ready_file),
        outcomes_subject=settings.nats.outcomes_subject,
        outcome_events=True,
        outbox_batch=settings.worker.outbox_batch,
        outbox_poll_s=settings.worker.outbox_poll_s,
        outbox_publish_timeout_s=settings.worker.outbox_publish_timeout_s,
    )
    argv = python_argv("-m", "benchmarks.bare_pipeline", config.model_dump_json())
    child = Child(name, argv, bench.log_dir / f"{name}.log", env=child_env(settings, ROOT))

    async def ready(_http: httpx.AsyncClient) -> bool:
        return ready_file.exists()

    return ChildConsumer(child, ready)


def zero_latency_plan(
    bench: Bench,
    messages: int,
    *,
    paced: bool = False,
    subscriptions: bool = False,
    events: Events = "outbox",
) -> Plan:
    return Plan(
        messages=messages,
        gateway=ZERO,
        scoring=ZERO,
        timeout_s=max(120.0, messages / 20),
        paced_fraction=PACED_FRACTION if paced else 0.0,
        paced_s=bench.sizes.paced_s,
        subscriptions=subscriptions,
        events=events,
        decline_every=DECLINE_EVERY,
    )


async def bare_sample(bench: Bench, k: int) -> Drained:
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    plan = zero_latency_plan(bench, bench.sizes.throughput_messages, events="direct")
    consumer = bare_consumer(bench, settings, f"bare-{k}")
    label = f"bare pipeline {k}/{bench.sizes.repeats + 1}"  # one after the last round too
    return await bench.sample(label, plan, settings, consumer)


async def worker_sample(bench: Bench, k: int) -> Drained:
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    plan = zero_latency_plan(bench, bench.sizes.throughput_messages, paced=True)
    log_dir = bench.log_dir / f"worker-{k}"
    log_dir.mkdir(exist_ok=True)
    workers = Workers(settings, log_dir)
    return await bench.sample(f"worker {k}/{bench.sizes.repeats}", plan, settings, workers)


async def verified_sample(bench: Bench, k: int) -> Drained:
    """The worker with the subscription check on, every message's subscription in place."""
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url, verify_subscription="match")
    plan = zero_latency_plan(bench, bench.sizes.throughput_messages, subscriptions=True)
    log_dir = bench.log_dir / f"worker-verified-{k}"
    log_dir.mkdir(exist_ok=True)
    workers = Workers(settings, log_dir)
    label = f"worker, subscription check on {k}/{bench.sizes.repeats}"
    return await bench.sample(label, plan, settings, workers)


async def no_outbox_sample(bench: Bench, k: int) -> Drained:
    """The worker with no outcome events: its ledger's outbox triggers disabled."""
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    plan = zero_latency_plan(bench, bench.sizes.throughput_messages, events="none")
    log_dir = bench.log_dir / f"worker-no-outbox-{k}"
    log_dir.mkdir(exist_ok=True)
    workers = Workers(settings, log_dir)
    label = f"worker, no outbox {k}/{bench.sizes.repeats}"
    return await bench.sample(label, plan, settings, workers)
