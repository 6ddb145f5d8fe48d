"""One sample of one case: N messages drained by K consumer processes, measured.

A sample runs on a fresh database and streams of its own:

1. create the streams (the charges, the dead letters, the outcome events) and the durable
   consumer exactly as `charge-worker provision` would (plus `sample_freq: 100%` for ack
   advisories; checked to show no drift), paused; unless `Plan.events == "outbox"` (the
   worker's outbox), disable the ledger's outbox triggers: the bare pipeline's `UPDATE`
   would fire them too;
2. publish the backlog of N due charges (with `Plan.subscriptions`, first an active
   `subscriptions` row agreeing with each, for the worker's subscription check; with
   `Plan.decline_every`, every k-th customer's card is declined);
3. start the consumer processes (the worker, `charge-worker run`, or the bare pipeline)
   and wait until they are ready;
4. note every process group's CPU time, resume the consumer: the clock starts;
5. poll the consumer until nothing is pending or awaiting an ack: the clock stops; then,
   unless `Plan.events == "none"`, until the outcome events stream holds one event per
   message acked;
6. CPU time again, peak RSS of each consumer process, its metrics, the ledger's statuses;
7. optionally a paced phase: publish at a fraction of the rate just measured, and take
   publish-to-ack latencies from the ack advisories (see `load.py`);
8. the outcome events in the stream and the rows in the outbox, once every message's event
   is in (or after `OUTCOMES_TIMEOUT_S`), for the sample's checks; the ledger's rows by
   status; once the consumers have stopped and their connections are gone, the
   transactions committed in the sample's database (`pg_stat_database.xact_commit`).

The figure for throughput is the steady rate between 10 % and 90 % acked
(`stats.steady_rate`): a resumed consumer serves the pull request that waited while it was
paused only at that request's expiry (up to `fetch_wait_s` late), and the last slots finish
with nothing left to fetch; both would weigh on a drain of a few seconds. CPU and the
whole-drain rate cover resume to last ack. The CPU is read when the last event is in the
stream, so the relay's work for the last charges is counted with the rest (the worker's
relay publishes after the ack, every `outbox_poll_s` when it has less than a full batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import asyncpg
import httpx
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from pydantic import SecretStr
from pydantic_settings import BaseSettings

from benchmarks import load
from benchmarks.processes import OTHER, STEAL, Child, CpuMeter, peak_rss_bytes, rss_bytes
from benchmarks.stack import Stack
from benchmarks.stats import per_item_us, percentile, steady_rate
from charge_worker import streams
from charge_worker.sandbox.demo.workers import (
    SERVER_VARS,
    Samples,
    WorkerProcess,
    metric,
    settings_env,
)
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.settings import (
    ENV_PREFIX,
    DbSettings,
    GatewaySettings,
    HttpSettings,
    LogSettings,
    NatsSettings,
    ReconcileSettings,
    RetrySettings,
    ScoringSettings,
    Settings,
    WorkerSettings,
)

READY_TIMEOUT_S = 60.0
OUTCOMES_TIMEOUT_S = 30.0  # the longest the last outcome events may take after the last ack
PAUSE_S = 600
PROGRESS_EVERY_S = 5.0
G = TypeVar("G", bound=BaseSettings)


def _defaults_only(cls: type[G], **values: Any) -> G:
    """`cls` from its defaults and `values`: the harness's environment and .env stay out."""
    defaults = {
        name: info.get_default(call_default_factory=True) for name, info in cls.model_fields.items()
    }
    return cls(**(defaults | values))


def worker_settings(stack: Stack, database_url: str, **worker: Any) -> Settings:
    """The worker's real (default) settings, pointed at the stack, with streams of its own.

    `worker` overrides fields of the worker or scoring groups (e.g. `scoring_timeout_s`).
    """
    tag = uuid.uuid4().hex[:8].upper()
    scoring = {k: worker.pop(k) for k in list(worker) if k in ScoringSettings.model_fields}
    return Settings(
        nats=_defaults_only(
            NatsSettings,
            url=stack.nats_url,
            stream_replicas=stack.nats_cluster,
            stream=f"BENCH_{tag}",
            subject=f"bench.{tag}.charges.due",
            dlq_stream=f"BENCH_{tag}_DLQ",
            dlq_subject=f"bench.{tag}.charges.dlq",
            outcomes_stream=f"BENCH_{tag}_OUTCOMES",
            outcomes_subject=f"bench.{tag}.charges.outcome",
        ),
        db=_defaults_only(DbSettings, url=database_url),
        worker=_defaults_only(WorkerSettings, **worker),
        retries=_defaults_only(RetrySettings),  # the default schedule: a soft decline waits
        scoring=_defaults_only(ScoringSettings, url=stack.scoring.url, **scoring),
        gateway=_defaults_only(
            GatewaySettings, url=stack.gateway.url, api_key=SecretStr(stack.api_key)
        ),
        reconcile=_defaults_only(ReconcileSettings),
        http=_defaults_only(HttpSettings, http_host="127.0.0.1", metrics_port=0),
        log=_defaults_only(LogSettings, log_format="json"),
    )


def child_env(settings: Settings, root: Path) -> dict[str, str]:
    """What `WorkerProcess` gives a worker, for children the harness starts itself."""
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(ENV_PREFIX) and key not in SERVER_VARS
    }
    env = inherited | settings_env(settings)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env


class Consumers(Protocol):
    """The processes draining the consumer in one sample."""

    @property
    def pids(self) -> list[int]: ...

    def start(self) -> None: ...

    async def wait_ready(self, http: httpx.AsyncClient) -> None: ...

    async def scrape(self, http: httpx.AsyncClient) -> list[Samples]: ...

    async def stop(self) -> list[int | None]:
        """Stop gracefully (SIGTERM, bounded wait); the exit codes."""
        ...

    def kill(self) -> None:
        """Kill whatever still runs (cleanup after a failure or Ctrl-C)."""
        ...


class _Worker(WorkerProcess):
    """The demo's worker process, with the pid the CPU meter needs."""

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid


class Workers:
    """`count` processes of `charge-worker run` with the same settings."""

    def __init__(self, settings: Settings, log_dir: Path, count: int = 1) -> None:
        self.settings = settings
        self.procs = [_Worker(f"worker-{n}", settings, log_dir) for n in range(1, count + 1)]

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        for proc in self.procs:
            await proc.wait_ready(http)

    async def scrape(self, http: httpx.AsyncClient) -> list[Samples]:
        return [await proc.scrape(http) for proc in self.procs]

    async def stop(self) -> list[int | None]:
        codes = await asyncio.gather(
            *(proc.stop(self.settings.worker.drain_s + 10) for proc in self.procs)
        )
        return list(codes)

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()


class ChildConsumer:
    """One harness-started child (the bare pipeline) as `Consumers`."""

    def __init__(self, child: Child, ready: Callable[[httpx.AsyncClient], Awaitable[bool]]):
        self.child = child
        self._ready = ready

    @property
    def pids(self) -> list[int]:
        return [self.child.pid]

    def start(self) -> None:
        self.child.start()

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not await self._ready(http):
            if self.child.returncode is not None:
                raise RuntimeError(f"{self.child.name} exited:\n{self.child.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.child.name} was not ready within {READY_TIMEOUT_S} s")
            await asyncio.sleep(0.1)

    async def scrape(self, http: httpx.AsyncClient) -> list[Samples]:
        return []

    async def stop(self) -> list[int | None]:
        return [await asyncio.to_thread(self.child.stop)]

    def kill(self) -> None:
        self.child.stop(timeout_s=5)


# Where a sample's outcome events come from: the worker's outbox (its ledger's triggers and
# its relay), the bare pipeline's direct publishes, or nowhere (the worker on a ledger whose
# outbox triggers are disabled: its relay finds nothing to publish). Without the outbox the
# sample's ledger has its outbox triggers disabled.
Events = Literal["outbox", "direct", "none"]


@dataclass(frozen=True)
class Plan:
    """What one sample does."""

    messages: int
    gateway: LatencyModel
    scoring: LatencyModel
    timeout_s: float
    watch_acks: bool = False  # collect ack advisories during the drain (service times)
    paced_fraction: float = 0.0  # > 0: a paced latency phase at this fraction of the rate
    paced_s: float = 5.0
    rss_every: int = 0  # > 0: note each consumer's RSS as every multiple of this is acked
    # a matching active `subscriptions` row for every order published (backlog and paced
    # phase), written before its message: the worker with verify_subscription=match
    subscriptions: bool = False
    events: Events = "outbox"
    # > 0: every this-many-th customer's card is declined (soft; `load.customer_id`)
    decline_every: int = 0


@dataclass
class Drained:
    """The measurements of one sample."""

    messages: int
    acked: int
    seconds: float  # from resuming the consumer to the last ack seen
    progress: list[tuple[float, int]]  # (seconds since resume, acked) at every poll
    cpu_s: dict[str, float]
    peak_rss: list[int]
    rss: list[int]
    statuses: dict[str, int] = field(default_factory=dict)
    worker_metrics: dict[str, float] = field(default_factory=dict)
    service_s: list[float] = field(default_factory=list)
    latency: dict[str, Any] = field(default_factory=dict)
    sims: dict[str, Any] = field(default_factory=dict)
    exit_codes: list[int | None] = field(default_factory=list)
    rss_by_acked: list[tuple[int, list[int]]] = field(default_factory=list)
    events: Events = "outbox"
    metered_s: float = 0.0  # from resuming to the CPU's second reading (last event in)
    outcomes: int = 0  # events in the sample's outcome events stream, at its end
    outbox_rows: int = 0  # rows in `charge_outcomes` (sent or not), at its end
    declining: int = 0  # messages (backlog and paced) whose customer's card is declined
    # transactions committed in the sample's database over the whole sample (setup, drain,
    # paced phase, the consumers' start and stop), from `pg_stat_database`
    transactions: int = 0
    started_at: float = 0.0  # the harness's monotonic clock when the consumer was resumed

    @property
    def midpoint(self) -> float:
        """The middle of the drain, on the harness's monotonic clock."""
        return self.started_at + self.seconds / 2

    @property
    def whole_rate(self) -> float:
        """Acked / seconds over the whole drain, ramp-up and tail included."""
        return self.acked / self.seconds if self.seconds > 0 else 0.0

    @property
    def rate(self) -> float:
        """The steady rate: between 10 % and 90 % of the messages acked (`stats.steady_rate`)."""
        if self.acked < self.messages:
            return self.whole_rate
        return steady_rate(self.progress, self.messages)

    @property
    def other_cores(self) -> float:
        """Cores busy with processes outside the benchmark, on average during the drain."""
        span = max(self.seconds, self.metered_s)
        return self.cpu_s.get(OTHER, 0.0) / span if span > 0 else 0.0

    @property
    def steal_cores(self) -> float:
        span = max(self.seconds, self.metered_s)
        return self.cpu_s.get(STEAL, 0.0) / span if span > 0 else 0.0

    def cpu_us_per_charge(self, group: str = "consumer") -> float:
        """CPU µs of a process group per acked message, over the whole drain."""
        return per_item_us(self.cpu_s.get(group, 0.0), self.acked)

    @property
    def published(self) -> int:
        """Messages published: the backlog and the paced phase's."""
        return self.messages + int(self.latency.get("published", 0))

    @property
    def transactions_per_charge(self) -> float:
        """Transactions committed in the sample's database per message published."""
        return self.transactions / self.published if self.transactions else math.nan

    def as_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rate"] = self.rate
        data["whole_rate"] = self.whole_rate
        data["other_cores"] = self.other_cores
        return data


def _worker_figures(scraped: list[Samples]) -> dict[str, float]:
    """Sums over the worker processes of what explains a run."""
    figures: dict[str, float] = {}
    names = {
        "processing_sum_s": ("charge_worker_processing_seconds_sum", {}),
        "processing_count": ("charge_worker_processing_seconds_count", {}),
        "charged": ("charge_worker_charges_total", {"result": "charged"}),
        "redeliveries": ("charge_worker_redeliveries_total", {}),
        "heartbeats": ("charge_worker_heartbeats_total", {}),
        "scoring_approve": ("charge_worker_scoring_total", {"result": "approve"}),
        "scoring_failed": ("charge_worker_scoring_total", {"result": "failed_defer"}),
        "deferred_rescored": ("charge_worker_deferred_checks_resolved_total", {}),
        "dead_letters": ("charge_worker_dead_letters_total", {}),
    }
    for key, (name, labels) in names.items():
        figures[key] = sum(metric(samples, name, **labels) for samples in scraped)
    return figures


async def _statuses(database_url: str) -> tuple[dict[str, int], int, int]:
    """The ledger's rows by status, the outbox's rows, and the transactions committed in
    the database so far (this connection's own not yet counted)."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT status, count(*) FROM charge_attempts GROUP BY status")
        outbox = await conn.fetchval("SELECT count(*) FROM charge_outcomes")
        transactions = await _committed(conn)
    finally:
        await conn.close()
    return {str(row[0]): int(row[1]) for row in rows}, int(outbox), transactions


async def _committed(conn: asyncpg.Connection) -> int:
    """`pg_stat_database.xact_commit` of the connection's database, once every other
    backend on it has exited: a backend's counts reach the statistics at the latest when
    it exits, and it still shows in `pg_stat_activity` until then."""
    deadline = time.monotonic() + OUTCOMES_TIMEOUT_S
    while await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ):
        if time.monotonic() > deadline:
            return 0  # not measured
        await asyncio.sleep(load.POLL_S)
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(
        await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
    )


async def disable_outbox(database_url: str) -> None:
    """No outbox: the ledger's triggers that write it (migrations/0012) are off."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("ALTER TABLE charge_attempts DISABLE TRIGGER USER")
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'charge_attempts'::regclass "
            "AND NOT tgisinternal AND tgenabled <> 'D'"
        )
    finally:
        await conn.close()
    if left:
        raise RuntimeError(f"{left} triggers on charge_attempts are still enabled")


async def _outcomes(js: JetStreamContext, cfg: NatsSettings) -> int:
    """Outcome events in the sample's stream."""
    return int((await js.stream_info(cfg.outcomes_stream)).state.messages)


async def _wait_outcomes(js: JetStreamContext, cfg: NatsSettings, count: int) -> int:
    """Poll until the outcome events stream holds `count` events, at most
    `OUTCOMES_TIMEOUT_S`; how many it holds."""
    deadline = time.monotonic() + OUTCOMES_TIMEOUT_S
    while True:
        have = await _outcomes(js, cfg)
        if have >= count or time.monotonic() > deadline:
            return have
        await asyncio.sleep(load.POLL_S)


async def provision_paused(js: JetStreamContext, settings: Settings) -> None:
    cfg = settings.nats
    await js.add_stream(streams.charges_stream(cfg))
    await js.add_stream(streams.dlq_stream(cfg))
    await js.add_stream(streams.outcomes_stream(cfg))
    consumer = dataclasses.replace(streams.worker_consumer(cfg), sample_freq="100%")
    await js.add_consumer(cfg.stream, consumer)
    report = await streams.provision(js, cfg)
    if report.drift or report.created:
        raise RuntimeError(f"the benchmark's consumer differs from the worker's: {report}")
    until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=PAUSE_S)
    await js.pause_consumer(cfg.stream, cfg.durable, until.isoformat().replace("+00:00", "Z"))


async def delete_streams(js: JetStreamContext, cfg: NatsSettings) -> None:
    for name in (cfg.stream, cfg.dlq_stream, cfg.outcomes_stream):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(name)


async def _paced_latency(
    nc: Client,
    js: JetStreamContext,
    settings: Settings,
    plan: Plan,
    *,
    rate: float,
) -> dict[str, Any]:
    """Open-loop load at `plan.paced_fraction` of `rate`; publish-to-ack latencies."""
    cfg = settings.nats
    paced_rate = max(rate * plan.paced_fraction, 1.0)
    count = max(int(paced_rate * plan.paced_s), 20)
    ids = range(plan.messages + 1, plan.messages + 1 + count)
    if plan.subscriptions:
        await load.add_subscriptions(settings.db.dsn, ids, plan.decline_every)
    async with load.AckTimes(nc, cfg.stream, cfg.durable) as acks:
        sent = await load.publish_paced(
            js, cfg.subject, ids, paced_rate, decline_every=plan.decline_every
        )
        await acks.wait_for(sent.keys(), timeout_s=plan.timeout_s)
    latencies = sorted(acks.at[seq] - at for seq, at in sent.items() if seq in acks.at)
    if not latencies:
        return {"rate_per_s": paced_rate, "published": len(sent), "acked": 0}
    return {
        "rate_per_s": paced_rate,
        "published": len(sent),
        "acked": len(latencies),
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "max_s": latencies[-1],
        "samples_s": latencies,
    }


ProgressFn = Callable[[str], None]


class _Progress:
    """The drain's poll callback: progress lines, and RSS at every `rss_every` acked."""

    def __init__(self, plan: Plan, pids: list[int], say: ProgressFn) -> None:
        self.plan = plan
        self.pids = pids
        self.say = say
        self.last = time.monotonic()
        self.rss_by_acked: list[tuple[int, list[int]]] = []

    def __call__(self, done: int) -> None:
        every = self.plan.rss_every
        if every and done >= (len(self.rss_by_acked) + 1) * every:
            self.rss_by_acked.append((done, [rss_bytes(pid) for pid in self.pids]))
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            self.say(f"{done:,}/{self.plan.messages:,} acked")


async def _measure(
    stack: Stack,
    nc: Client,
    *,
    plan: Plan,
    cfg: NatsSettings,
    consumers: Consumers,
    progress: ProgressFn,
) -> Drained:
    """Steps 4 to 6 of the module docstring, with the consumers ready and the backlog in."""
    js = nc.jetstream()
    meter = CpuMeter(stack.pids() | {"consumer": consumers.pids}, frozenset({"postgres"}))
    polled = _Progress(plan, consumers.pids, progress)
    acks = load.AckTimes(nc, cfg.stream, cfg.durable)
    async with acks if plan.watch_acks else contextlib.nullcontext(acks):
        meter.start()
        started = time.monotonic()
        await js.resume_consumer(cfg.stream, cfg.durable)
        series = await load.wait_acked(
            js,
            cfg.stream,
            cfg.durable,
            plan.messages,
            timeout_s=plan.timeout_s,
            on_progress=polled,
        )
        ended, done = series[-1] if series else (time.monotonic(), 0)
        if plan.events != "none":
            await _wait_outcomes(js, cfg, done)
        cpu = meter.stop()
        metered = time.monotonic()
    return Drained(
        messages=plan.messages,
        acked=done,
        seconds=ended - started,
        progress=[(round(at - started, 4), count) for at, count in series],
        cpu_s=cpu,
        peak_rss=[peak_rss_bytes(pid) for pid in consumers.pids],
        rss=[rss_bytes(pid) for pid in consumers.pids],
        service_s=sorted(acks.service_s.values()),
        rss_by_acked=polled.rss_by_acked,
        events=plan.events,
        metered_s=metered - started,
        started_at=started,
    )


async def _run_consumers(
    stack: Stack,
    http: httpx.AsyncClient,
    nc: Client,
    *,
    plan: Plan,
    settings: Settings,
    consumers: Consumers,
    progress: ProgressFn,
) -> Drained:
    cfg = settings.nats
    consumers.start()
    try:
        await consumers.wait_ready(http)
        result = await _measure(
            stack, nc, plan=plan, cfg=cfg, consumers=consumers, progress=progress
        )
        js = nc.jetstream()
        if result.acked < plan.messages:
            progress(f"TIMED OUT after {plan.timeout_s:g} s: {result.acked}/{plan.messages}")
        elif plan.paced_fraction > 0:
            progress(f"paced phase: {plan.paced_fraction:.0%} of {result.rate:,.0f}/s")
            result.latency = await _paced_latency(nc, js, settings, plan, rate=result.rate)
        if plan.events == "none":
            result.outcomes = await _outcomes(js, cfg)
        else:
            expected = result.acked + int(result.latency.get("acked", 0))
            result.outcomes = await _wait_outcomes(js, cfg, expected)
        result.worker_metrics = _worker_figures(await consumers.scrape(http))
        result.sims = {
            "gateway": await stack.gateway.stats(http),
            "scoring": await stack.scoring.stats(http),
        }
    finally:
        codes = await consumers.stop()
    result.exit_codes = codes
    if any(code != 0 for code in codes):
        progress(f"WARNING: consumer exit codes {codes}")
    return result


async def drain(
    stack: Stack,
    http: httpx.AsyncClient,
    plan: Plan,
    settings: Settings,
    consumers: Consumers,
    *,
    progress: ProgressFn,
) -> Drained:
    """Run one sample; `settings` name the sample's database and streams."""
    cfg = settings.nats
    database_url = settings.db.dsn
    await stack.gateway.set_latency(http, plan.gateway)
    await stack.scoring.set_latency(http, plan.scoring)
    nc = await streams.connect(cfg, name="charge-worker-bench", reconnect=False)
    try:
        js = nc.jetstream()
        await provision_paused(js, settings)
        if plan.events != "outbox":
            await disable_outbox(database_url)
        backlog = range(1, plan.messages + 1)
        if plan.subscriptions:
            progress(f"adding {plan.messages:,} matching subscriptions")
            await load.add_subscriptions(database_url, backlog, plan.decline_every)
        progress(f"publishing {plan.messages:,} messages")
        await load.publish_backlog(
            nc, js, cfg.subject, cfg.stream, backlog, decline_every=plan.decline_every
        )
        result = await _run_consumers(
            stack, http, nc, plan=plan, settings=settings, consumers=consumers, progress=progress
        )
        result.declining = load.declining(range(1, result.published + 1), plan.decline_every)
        result.statuses, result.outbox_rows, result.transactions = await _statuses(database_url)
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await delete_streams(nc.jetstream(), cfg)
        await nc.close()
        await stack.drop_database(database_url)
    return result
