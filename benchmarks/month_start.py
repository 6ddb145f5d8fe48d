"""The month-start case: a million due charges on the 1st, and nothing multiplied.

Three parts, each on a fresh database and streams:

1. **produce** `N` due subscriptions (default 100,000): `charge-worker produce
   --processes 2` as a process, rows per second and its peak RSS. The database is in the
   state a month start meets in production: the ledger holds the previous month's charges
   for the same subscriptions, settled and reconciled, and the planner has statistics
   (`VACUUM ANALYZE`, as autovacuum keeps them). A freshly loaded table without
   statistics, or an empty ledger's, plans the producer's statements for a state no
   month start has (docs/benchmarks.md, "Month start");
2. **drain**: two `charge-worker run` processes drain the backlog while `charge-worker
   reconcile` runs on a short schedule with a short quiet time: no message still queued
   may be re-published; then what each store holds per charge. With `rate_limit`, the
   fleet is limited (`CHARGE_WORKER_GATEWAY_RATE_LIMIT`) and so is the gateway simulator
   (`rate_limit_per_s`): the per-second rate at the gateway and the 429s it answered.
   The limited drain speaks Stripe (`GATEWAY_KIND=stripe`, the simulator's Stripe flavour)
   and also runs one `charge-worker webhooks` receiver, the simulator delivering its
   webhooks to it: the Stripe flavour re-fetches an intent before applying its event (the
   contract's webhooks carry the whole charge and look up only after a wait bound, so
   they would ask the gateway next to nothing). The receiver reaches the simulator through
   a counting proxy in the harness (`CountingProxy`), so its own requests are counted per
   second apart from the fleet's total the simulator counts (`receiver_requests`);
3. **steady reconcile**: `history` charges (default 1,000,000) in the gateway's history and
   the ledger, a run that checkpoints, `new` charges more (default 10,000), another run:
   its gateway requests, wall time and peak RSS against the new activity's pages.

The drain is also drawn (`timeline.png`, matplotlib from the `bench` extra): backlog,
settled per second, gateway requests per second against the limit, reconcile runs marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import resource
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil  # type: ignore[import-untyped]  # no stubs installed
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from benchmarks.drain import READY_TIMEOUT_S, Workers, child_env, worker_settings
from benchmarks.processes import OTHER, Child, CpuMeter, python_argv
from benchmarks.stack import GATEWAY_SEED, Simulator, Stack
from benchmarks.stats import percentile
from charge_worker import streams
from charge_worker.ratelimit import RateLimiter
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.gateway.config import SANDBOX_WEBHOOK_SECRET, GatewayConfig
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import Settings, WebhookSettings

PERIOD = "2026-12-01"
FIRST_ORDER = 1
RECONCILE_EVERY_S = 20.0
QUIET_S = 30.0  # the quiet time of the drain's reconcile runs: shorter than the backlog lasts
PAGE = 100  # charges per history page
SAMPLE_S = 1.0
DRAIN_TIMEOUT_S = 3600.0
HISTORY = 1_000_000  # charges in the gateway's history for the steady reconcile
NEW = 10_000  # charges made since its last run
RATE_LIMIT = 200.0  # the fleet's gateway rate in the limited drain
LIMITED_CHARGES = 20_000
PRODUCE_PROCESSES = 2  # `produce --processes`: one per core of the benchmark's machine
PREVIOUS = "2026-11-01"  # the previous month, settled and reconciled, already in the ledger
HISTORY_AGE_S = 3600  # the month's history is older than the overlap a later run reads again
# The limited drain's provider: Stripe's webhooks carry an intent the receiver re-fetches
# (unless a worker's live lease holds its row), so its requests count against the limit
WEBHOOK_FLAVOUR = "stripe"
WEBHOOK_PATH = "/webhooks/gateway"
RETRIEVE = "GET /v1/payment_intents/{id}"  # only the receiver re-fetches an intent by id


@dataclass
class Command:
    """A `charge-worker` command run to its end as a child process."""

    argv: list[str]
    seconds: float
    peak_rss_mb: float
    returncode: int
    stdout: str


async def run_command(settings: Settings, root: Path, *args: str) -> Command:
    """`charge-worker <args>` with these settings; its wall time and the peak RSS of its
    largest process (sampled)."""
    argv = [sys.executable, "-m", "charge_worker", *args]
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=child_env(settings, root),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    watched, peak = psutil.Process(proc.pid), 0

    async def watch() -> None:  # the largest process: `produce --processes` works in children
        nonlocal peak
        while True:
            with contextlib.suppress(psutil.Error):
                for each in [watched, *watched.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        peak = max(peak, each.memory_info().rss)
            await asyncio.sleep(0.05)

    watching = asyncio.create_task(watch())
    out, _ = await proc.communicate()
    watching.cancel()
    returncode = proc.returncode if proc.returncode is not None else -1
    seconds = time.monotonic() - started
    return Command(argv[3:], seconds, peak / 2**20, returncode, out.decode())


@dataclass
class Timeline:
    """The drain, a sample a second."""

    t: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    settled: list[int] = field(default_factory=list)
    reconcile_at: list[float] = field(default_factory=list)
    gateway_per_s: dict[int, int] = field(default_factory=dict)  # unix second -> requests
    receiver_per_s: dict[int, int] = field(default_factory=dict)  # the webhook receiver's
    started_unix: float = 0.0


@dataclass
class MonthStart:
    charges: int
    produce: dict[str, Any] = field(default_factory=dict)
    drain: dict[str, Any] = field(default_factory=dict)
    limited: dict[str, Any] = field(default_factory=dict)
    reconcile: dict[str, Any] = field(default_factory=dict)
    bytes_per_charge: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The figures the issue asks for, as the report prints them."""
        p, d, r = self.produce, self.drain, self.reconcile
        out = [
            f"month start, {self.charges:,} due charges:",
            f"  produce {p['produce_s']:.1f} s, {p['produce_rows_per_s']:,.0f} rows/s, "
            f"peak RSS {p['produce_peak_rss_mb']:.0f} MB",
            f"  drain by 2 workers {d['drain_s']:.1f} s ({d['drain_per_s']:,.0f}/s), "
            f"{d['reconcile_runs']} reconcile runs, re-published while queued "
            f"{d['republished_while_queued']}",
            "  bytes per charge: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in self.bytes_per_charge.items()),
        ]
        if self.limited:
            lim = self.limited
            out.append(
                f"  limited to {RATE_LIMIT:g}/s: gateway per second p50 "
                f"{lim['gateway_per_s_p50']:.0f}, max {lim['gateway_per_s_max']}, "
                f"429s {lim['gateway_429']}, re-published while queued "
                f"{lim['republished_while_queued']}"
            )
            if rec := lim.get("receiver"):
                verdict = "within it" if rec["fleet_within_limit"] else "OVER it"
                out.append(
                    f"  webhook receiver ({rec['flavour']}: re-fetches an intent no worker "
                    f"holds): {rec['requests']} gateway requests during the drain, per "
                    f"second max {rec['per_s_max']}, 429s {rec['429']}, events applied "
                    f"{rec['events'].get('applied', 0):,.0f} of "
                    f"{rec['deliveries'].get('journaled', 0):,.0f} journaled; fleet (workers, "
                    f"reconcile, receiver) per second max {lim['gateway_per_s_max']} against "
                    f"{rec['limit']:g}/s + a burst of {rec['fleet_burst']}: {verdict}"
                )
        out.append(
            f"  steady reconcile, {r['history']:,} in history and {r['new']:,} new: "
            f"{r['second_run_gateway_requests']} gateway requests for {r['new_activity_pages']} "
            f"pages of new activity, {r['second_run_s']:.1f} s, peak RSS "
            f"{r['second_run_peak_rss_mb']:.0f} MB"
        )
        return out


async def _subscriptions(url: str, first: int, count: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            """INSERT INTO subscriptions (subscription_id, order_id, customer_id, amount_minor,
                                          currency, next_billing_date)
               SELECT 'sub_' || n, n, 'cus_bench_' || (n % 1000), 99000, 'RUB', $3::date
                 FROM generate_series($1::bigint, $2::bigint) AS n""",
            first,
            first + count - 1,
            dt.date.fromisoformat(PERIOD),
        )
    finally:
        await conn.close()


async def _sample(
    conn: asyncpg.Connection, nc: Any, settings: Settings, timeline: Timeline, started: float
) -> bool:
    """One point of the timeline; True when the work is done."""
    info = await nc.jetstream().consumer_info(settings.nats.stream, settings.nats.durable)
    backlog = (info.num_pending or 0) + (info.num_ack_pending or 0)
    settled = await conn.fetchval(  # this month's: the ledger holds the previous one too
        "SELECT count(*) FROM charge_attempts"
        " WHERE billing_period = $1::text::date AND status NOT IN ('scheduled', 'pending')",
        PERIOD,
    )
    timeline.t.append(time.monotonic() - started)
    timeline.backlog.append(backlog)
    timeline.settled.append(int(settled))
    return backlog == 0


async def _drain(
    stack: Stack,
    settings: Settings,
    root: Path,
    log_dir: Path,
    *,
    reconcile_every_s: float,
    receiver: Receiver | None = None,
) -> tuple[Timeline, list[dict[str, Any]], float]:
    """Two workers drain what `produce` published while reconcile runs on a schedule (and
    `receiver`, started before them, takes the gateway's webhooks; stopped with them, its
    figures in `receiver.result`); the timeline, each reconcile run's counts, and the
    drain's seconds."""
    timeline, runs = Timeline(started_unix=time.time()), list[dict[str, Any]]()
    workers = Workers(settings, log_dir, count=2)
    nc = await streams.connect(settings.nats, name="bench-month-start", reconnect=False)
    conn = await asyncpg.connect(settings.db.dsn)
    stop = asyncio.Event()

    async def reconcile_on_schedule() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), reconcile_every_s)
            if stop.is_set():
                return
            timeline.reconcile_at.append(time.monotonic() - started)
            done = await run_command(settings, root, "reconcile", "--json")
            with contextlib.suppress(ValueError):
                runs.append(json.loads(done.stdout).get("counts", {}))

    http = httpx.AsyncClient(timeout=10)
    cron: asyncio.Task[None] | None = None
    try:
        if receiver is not None:
            await receiver.start(http)
        started = time.monotonic()
        timeline.started_unix = time.time()
        workers.start()
        cron = asyncio.create_task(reconcile_on_schedule())
        await workers.wait_ready(http)
        while time.monotonic() - started < DRAIN_TIMEOUT_S:
            if await _sample(conn, nc, settings, timeline, started):
                break
            await asyncio.sleep(SAMPLE_S)
        seconds = time.monotonic() - started
        if receiver is not None:  # before its stop: the figures of the drain
            receiver.result = await receiver.figures(http)
    finally:
        stop.set()
        if cron is not None:
            await cron
        await workers.stop()
        if receiver is not None:
            await receiver.stop()
        await http.aclose()
        await conn.close()
        await nc.close()
    return timeline, runs, seconds


async def _gateway_stats(gateway: Simulator) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        return await gateway.stats(http)


_HOP_BY_HOP = frozenset(
    {"connection", "content-length", "content-encoding", "host", "keep-alive", "transfer-encoding"}
)


class CountingProxy:
    """A loopback HTTP proxy in front of the gateway simulator for one client (the webhook
    receiver): every request forwarded as is, counted by unix second, endpoint (ids as
    `{id}`) and status. Served in a thread of its own, off the harness's loop."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.per_second: Counter[int] = Counter()
        self.by_endpoint: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.client: httpx.AsyncClient | None = None

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            async with httpx.AsyncClient(base_url=upstream, timeout=60) as client:
                self.client = client
                yield

        methods = ["GET", "POST", "DELETE"]
        route = Route("/{path:path}", self._forward, methods=methods)
        self.served = ServedApp(Starlette(routes=[route], lifespan=lifespan))

    @property
    def url(self) -> str:
        return self.served.url

    def start(self) -> None:
        self.served.start()

    def stop(self) -> None:
        self.served.stop()

    def requests_between(self, first_unix: float, last_unix: float) -> list[int]:
        """Requests in each second of [first, last] (0 where none), in order."""
        seconds = range(int(first_unix), int(last_unix) + 1)
        counted = dict(self.per_second)  # a copy: the proxy's thread may still count
        return [counted.get(second, 0) for second in seconds]

    async def _forward(self, request: Request) -> Response:
        assert self.client is not None
        self.per_second[int(time.time())] += 1
        parts = request.url.path.split("/")  # "", "v1", "payment_intents", "pi_…"
        endpoint = "/".join(parts[:3] + ["{id}"] * len(parts[3:]))
        self.by_endpoint[f"{request.method} {endpoint}"] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        answer = await self.client.request(
            request.method,
            request.url.path,
            params=request.url.query,
            headers=headers,
            content=await request.body(),
        )
        self.by_status[str(answer.status_code)] += 1
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
        return Response(answer.content, status_code=answer.status_code, headers=kept)


class Receiver:
    """One `charge-worker webhooks` process: the gateway's webhooks in, its gateway
    requests out through a `CountingProxy` (the fleet's rate limiter shared with the
    workers, through the same database)."""

    def __init__(self, settings: Settings, root: Path, log_dir: Path, gateway: Simulator):
        self.result: dict[str, dict[str, float]] = {}
        self.port = free_port()
        self.proxy = CountingProxy(gateway.url)
        self.proxy.start()
        webhooks = WebhookSettings(
            webhook_host="127.0.0.1",
            webhook_port=self.port,
            webhook_secrets=(SecretStr(SANDBOX_WEBHOOK_SECRET),),
        )
        own = settings.gateway.model_copy(update={"url": self.proxy.url})
        settings = settings.model_copy(update={"webhooks": webhooks, "gateway": own})
        self.child = Child(
            "webhook receiver",
            python_argv("-m", "charge_worker", "webhooks"),
            log_dir / "webhook-receiver.log",
            env=child_env(settings, root),
            cwd=log_dir,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def webhook_url(self) -> str:
        return f"{self.url}{WEBHOOK_PATH}"

    async def start(self, http: httpx.AsyncClient) -> None:
        self.child.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.child.returncode is not None:
                raise RuntimeError(f"the webhook receiver exited:\n{self.child.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(f"{self.url}/readyz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the webhook receiver was not ready in {READY_TIMEOUT_S} s")
            await asyncio.sleep(0.1)

    async def figures(self, http: httpx.AsyncClient) -> dict[str, dict[str, float]]:
        """Deliveries by result and events by status, from its `/metrics`."""
        text = (await http.get(f"{self.url}/metrics")).text
        out: dict[str, dict[str, float]] = {"deliveries": {}, "events": {}}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "charge_worker_webhook_deliveries_total":
                    out["deliveries"][sample.labels["result"]] = sample.value
                elif sample.name == "charge_worker_webhook_events_total":
                    out["events"][sample.labels["status"]] = sample.value
        return {kind: {k: v for k, v in each.items() if v} for kind, each in out.items()}

    async def stop(self) -> int | None:
        try:
            return await asyncio.to_thread(self.child.stop)
        finally:
            self.proxy.stop()


async def prepare(url: str, charges: int) -> int:
    """Part 1's database in a month start's state; the ledger's size in bytes."""
    await _subscriptions(url, FIRST_ORDER, charges)
    conn = await asyncpg.connect(url)
    try:
        await _previous_month(conn, FIRST_ORDER, charges)
        await conn.execute("VACUUM ANALYZE")
        return int(await conn.fetchval(_LEDGER_BYTES))
    finally:
        await conn.close()


async def produce(settings: Settings, root: Path) -> Command:
    """`produce` run to its end, one process per core."""
    argv = ("produce", "--date", PERIOD, "--json", "--processes", str(PRODUCE_PROCESSES))
    produced = await run_command(settings, root, *argv)
    if produced.returncode != 0:
        raise RuntimeError(f"produce exited {produced.returncode}: {produced.stdout[-500:]}")
    return produced


async def _previous_month(conn: asyncpg.Connection, first: int, count: int) -> None:
    """Last month's charges of the same subscriptions: charged, published, reconciled."""
    await conn.execute(
        """INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,
               subscription_id, customer_id, amount_minor, currency, status, gateway_charge_id,
               gateway_seen_charge_id, attempt, gateway_calls, created_at, updated_at,
               published_at, settled_at)
           SELECT n, $3::text::date, n || ':' || $3::text, 'sub_' || n, 'cus_bench_' || (n % 1000),
                  99000, 'RUB', 'succeeded', 'ch_prev_' || n, 'ch_prev_' || n, 1, 1,
                  $3::text::date, $3::text::date, $3::text::date, $3::text::date
             FROM generate_series($1::bigint, $2::bigint) AS n""",
        first,
        first + count - 1,
        PREVIOUS,
    )


_LEDGER_BYTES = "SELECT pg_total_relation_size('charge_attempts')"


async def _sizes(settings: Settings, charges: int, ledger_before: int) -> dict[str, float]:
    """Bytes per charge in each store: the ledger (grown by, past `ledger_before`), the
    story, the charges stream."""
    conn = await asyncpg.connect(settings.db.dsn)
    try:
        ledger = await conn.fetchval(_LEDGER_BYTES) - ledger_before
        story = await conn.fetchval(
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('charge_events')"
        )
    finally:
        await conn.close()
    nc = await streams.connect(settings.nats, name="bench-sizes", reconnect=False)
    try:
        stream = (await nc.jetstream().stream_info(settings.nats.stream)).state.bytes
    finally:
        await nc.close()
    return {
        "charge_attempts": ledger / charges,
        "charge_events": int(story or 0) / charges,
        "CHARGES stream": stream / charges,
    }


async def _configure_gateway(gateway: Simulator, **config: Any) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        (await http.post(f"{gateway.url}/_sim/reset")).raise_for_status()
        patch = {"latency": {"fixed_s": 0.0}, "key_retention_s": 86400.0} | config
        (await http.post(f"{gateway.url}/_sim/config", json=patch)).raise_for_status()


def stripe_simulator(log_dir: Path) -> Simulator:
    """A second gateway simulator, in the Stripe flavour (chosen at its start), for the
    limited drain and its webhook receiver; started by the caller."""
    config = GatewayConfig(flavour=WEBHOOK_FLAVOUR, seed=GATEWAY_SEED)
    sim = Simulator("gateway", config.model_dump_json(), log_dir)
    sim.child.log_path = log_dir / f"gateway-{WEBHOOK_FLAVOUR}-sim.log"
    return sim


def _receiver_figures(
    receiver: Receiver, stats: dict[str, Any], timeline: Timeline, seconds: float, limit: float
) -> dict[str, Any]:
    """What the receiver asked of the gateway during the drain (its proxy's counts), and
    whether the whole fleet stayed within the limit (the simulator's per-second counts:
    workers, reconcile and receiver; at most the rate plus the limiter's burst, no 429)."""
    proxy, start = receiver.proxy, timeline.started_unix
    per_s = proxy.requests_between(start, start + seconds)
    timeline.receiver_per_s = {int(start) + i: n for i, n in enumerate(per_s) if n}
    burst = RateLimiter(None, rate_per_s=limit).capacity
    fleet = _rates(stats, start)
    return {
        "flavour": WEBHOOK_FLAVOUR,
        "limit": limit,
        "requests": sum(per_s),
        "per_s_max": max(per_s, default=0),
        "per_s_p50": percentile([float(n) for n in per_s], 50) if per_s else 0.0,
        "429": proxy.by_status.get("429", 0),
        # from its start to its stop (a moment after the drain's end), by endpoint; and the
        # simulator's own count of intents fetched by id, which only the receiver does:
        # the two agree when the proxy counted right
        "until_stopped": dict(proxy.by_endpoint),
        "retrieves_at_gateway": stats.get("by_endpoint", {}).get(RETRIEVE, 0),
        "deliveries": receiver.result.get("deliveries", {}),
        "events": receiver.result.get("events", {}),
        "fleet_burst": burst,
        "fleet_within_limit": stats.get("rate_limited", 0) == 0
        and max(fleet, default=0) <= limit + burst,
    }


def _rates(stats: dict[str, Any], since_unix: float) -> list[int]:
    per_second = {int(k): v for k, v in stats.get("per_second", {}).items()}
    return [n for second, n in sorted(per_second.items()) if second >= int(since_unix)]


async def produce_and_drain(
    stack: Stack,
    root: Path,
    log_dir: Path,
    charges: int,
    *,
    rate_limit: float = 0.0,
    webhooks: Simulator | None = None,
) -> dict[str, Any]:
    """Parts 1 and 2 on one fresh database; with `rate_limit`, the fleet and the gateway
    are limited to it. With `webhooks` (a Stripe-flavour simulator), the drain charges
    there and a webhook receiver takes its webhooks (`result["receiver"]`)."""
    url = await stack.new_database()
    settings = worker_settings(stack, url)
    sim = webhooks or stack.gateway
    reconcile = settings.reconcile.model_copy(update={"reconcile_quiet_s": QUIET_S})
    limited: dict[str, Any] = {"gateway_rate_limit": rate_limit}
    if webhooks is not None:
        limited |= {"kind": WEBHOOK_FLAVOUR, "url": webhooks.url}
    gateway = settings.gateway.model_copy(update=limited)
    settings = settings.model_copy(update={"reconcile": reconcile, "gateway": gateway})
    receiver = Receiver(settings, root, log_dir, webhooks) if webhooks is not None else None
    hook = {"webhook_url": receiver.webhook_url} if receiver is not None else {}
    await _configure_gateway(sim, rate_limit_per_s=rate_limit or None, **hook)
    before = await prepare(url, charges)
    produced = await produce(settings, root)
    timeline, runs, seconds = await _drain(
        stack, settings, root, log_dir, reconcile_every_s=RECONCILE_EVERY_S, receiver=receiver
    )
    stats = await _gateway_stats(sim)
    timeline.gateway_per_s = {int(k): v for k, v in stats.get("per_second", {}).items()}
    rates = _rates(stats, timeline.started_unix)
    result = {
        "produce_s": produced.seconds,
        "produce_rows_per_s": charges / produced.seconds,
        "produce_peak_rss_mb": produced.peak_rss_mb,
        "drain_s": seconds,
        "drain_per_s": charges / seconds,
        "reconcile_runs": len(runs),
        "republished_while_queued": sum(run.get("republished", 0) for run in runs),
        "still_waiting_max": max((run.get("still_waiting", 0) for run in runs), default=0),
        "gateway_per_s_p50": percentile([float(r) for r in rates], 50) if rates else 0.0,
        "gateway_per_s_max": max(rates, default=0),
        "gateway_429": stats.get("rate_limited", 0),
        "bytes_per_charge": await _sizes(settings, charges, before),
    }
    if receiver is not None:
        result["receiver"] = _receiver_figures(receiver, stats, timeline, seconds, rate_limit)
        await _configure_gateway(sim)  # no more deliveries to a receiver that has stopped
    result["timeline"] = asdict(timeline)
    await stack.drop_database(url)
    return result


async def steady_reconcile(stack: Stack, root: Path, history: int, new: int) -> dict[str, Any]:
    """Part 3: a checkpointed run, then one after `new` more charges."""
    url = await stack.new_database()
    settings = worker_settings(stack, url)
    await _configure_gateway(stack.gateway)
    await _load(stack, url, FIRST_ORDER, history, age_s=HISTORY_AGE_S)
    first = await run_command(settings, root, "reconcile", "--json")
    before = await _gateway_stats(stack.gateway)
    await _load(stack, url, FIRST_ORDER + history, new)
    second = await run_command(settings, root, "reconcile", "--json")
    after = await _gateway_stats(stack.gateway)
    requests = after["requests"] - before["requests"]
    new_pages = math.ceil(new / PAGE)
    await stack.drop_database(url)
    return {
        "history": history,
        "new": new,
        "first_run_s": first.seconds,
        "first_run_peak_rss_mb": first.peak_rss_mb,
        "second_run_s": second.seconds,
        "second_run_peak_rss_mb": second.peak_rss_mb,
        "second_run_gateway_requests": requests,
        "new_activity_pages": new_pages,
        "requests_per_new_page": requests / new_pages,
        "second_run_counts": _counts(second.stdout),
    }


def _counts(stdout: str) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        counts: dict[str, Any] = json.loads(stdout).get("counts", {})
        return counts
    return {}


async def _load(stack: Stack, url: str, first: int, count: int, *, age_s: int = 0) -> None:
    """`count` charges made `age_s` ago, in the gateway's history and in the ledger."""
    async with httpx.AsyncClient(timeout=600) as http:
        body = {
            "first_order_id": first,
            "count": count,
            "billing_period": PERIOD,
            "amount": 99000,
            "customer_prefix": "cus_bench_",
            "created": int(time.time()) - age_s,
        }
        response = await http.post(f"{stack.gateway.url}/_sim/charges/load", json=body)
        response.raise_for_status()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            """INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,
                   subscription_id, customer_id, amount_minor, currency, status,
                   gateway_charge_id, attempt, gateway_calls, settled_at)
               SELECT n, $3::text::date, n || ':' || $3::text, 'sub_' || n, 'cus_bench_' || n,
                      99000, 'RUB', 'succeeded', 'ch_load_' || n || '_' || $3::text, 1, 1,
                      now() - make_interval(secs => $4)
                 FROM generate_series($1::bigint, $2::bigint) AS n""",
            first,
            first + count - 1,
            PERIOD,
            float(age_s),
        )
    finally:
        await conn.close()


def draw(timeline: dict[str, Any], limit: float, path: Path) -> bool:
    """The drain as a picture; False when matplotlib is not installed (the bench extra)."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
    except ImportError:
        return False
    t, settled = timeline["t"], timeline["settled"]
    per_s = [max(b - a, 0) / SAMPLE_S for a, b in zip([0, *settled], settled, strict=False)]
    start = int(timeline["started_unix"])
    gateway = sorted((int(k) - start, v) for k, v in timeline["gateway_per_s"].items())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(t, timeline["backlog"], label="backlog (pending + unacked)")
    top.set_ylabel("messages")
    bottom.plot(t, per_s, label="settled per second")
    if gateway:
        bottom.plot(*zip(*gateway, strict=True), label="gateway requests per second")
    receiver = sorted((int(k) - start, v) for k, v in timeline.get("receiver_per_s", {}).items())
    if receiver:
        bottom.plot(*zip(*receiver, strict=True), label="of which the webhook receiver's")
    if limit:
        bottom.axhline(limit, linestyle="--", color="grey", label=f"fleet limit {limit:g}/s")
    for axis in (top, bottom):
        for at in timeline["reconcile_at"]:
            axis.axvline(at, color="orange", alpha=0.4)
        axis.legend(loc="upper right")
    bottom.set_xlabel("seconds since the workers started (orange: a reconcile run)")
    bottom.set_ylabel("per second")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


async def month_start(
    stack: Stack,
    root: Path,
    log_dir: Path,
    *,
    charges: int,
    history: int,
    new: int,
    rate_limit: float,
    limited_charges: int,
    png: Path,
    say: Any = print,
) -> MonthStart:
    """The whole case; `say` gets progress lines."""
    result = MonthStart(charges)
    say(f"month start: produce and drain {charges:,} due charges, reconcile every 20 s")
    result.drain = await produce_and_drain(stack, root, log_dir, charges)
    result.bytes_per_charge = result.drain.pop("bytes_per_charge")
    result.produce = {k: result.drain.pop(k) for k in list(result.drain) if k.startswith("produce")}
    if rate_limit:
        say(
            f"month start: {limited_charges:,} charges with the fleet limited to "
            f"{rate_limit:g}/s, {WEBHOOK_FLAVOUR} flavour, a webhook receiver taking its webhooks"
        )
        stripe = stripe_simulator(log_dir)
        await asyncio.to_thread(stripe.start)
        try:
            result.limited = await produce_and_drain(
                stack, root, log_dir, limited_charges, rate_limit=rate_limit, webhooks=stripe
            )
        finally:
            await asyncio.to_thread(stripe.child.stop)
        result.limited.pop("bytes_per_charge")
    say(f"month start: steady reconcile, {history:,} charges in history, {new:,} new")
    result.reconcile = await steady_reconcile(stack, root, history, new)
    timeline = (result.limited or result.drain)["timeline"]
    drawn = draw(timeline, rate_limit if result.limited else 0.0, png)
    say(f"month start: timeline {'drawn to ' + str(png) if drawn else 'not drawn (no matplotlib)'}")
    return result


def main(argv: list[str]) -> int:
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m benchmarks.month_start", description=__doc__)
    parser.add_argument("--charges", type=int, default=100_000)
    parser.add_argument("--history", type=int, default=HISTORY)
    parser.add_argument("--new", type=int, default=NEW)
    parser.add_argument("--rate-limit", type=float, default=RATE_LIMIT)
    parser.add_argument("--limited-charges", type=int, default=LIMITED_CHARGES)
    parser.add_argument("--nats-cluster", type=int, choices=(1, 3), default=1)
    parser.add_argument(
        "--produce-only", action="store_true", help="part 1 alone: how fast `produce` is"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/month_start"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)

    if args.produce_only:
        return _produce_only(args.charges, root, logs, args.nats_cluster)

    async def go(stack: Stack) -> MonthStart:
        await stack.prepare()
        return await month_start(
            stack,
            root,
            logs,
            charges=args.charges,
            history=args.history,
            new=args.new,
            rate_limit=args.rate_limit,
            limited_charges=args.limited_charges,
            png=args.out / "timeline.png",
        )

    with Stack(logs, nats_cluster=args.nats_cluster) as stack:
        result = asyncio.run(go(stack))
    (args.out / "month_start.json").write_text(json.dumps(result.as_json(), indent=2) + "\n")
    summary = {k: v for k, v in result.as_json().items() if k not in ("drain", "limited")}
    for part in ("drain", "limited"):
        summary[part] = {k: v for k, v in getattr(result, part).items() if k != "timeline"}
    print(json.dumps(summary, indent=2))
    return 0


def _produce_only(charges: int, root: Path, logs: Path, nats_cluster: int) -> int:
    """Part 1 alone, with the CPU per row of `produce` (its processes, reaped) and of the
    servers during the run (`CpuMeter`: other load and stolen time too)."""

    def reaped() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return children.ru_utime + children.ru_stime

    async def go(stack: Stack) -> dict[str, float]:
        await stack.prepare()
        url = await stack.new_database()
        await prepare(url, charges)
        servers = {k: v for k, v in stack.pids().items() if k in ("postgres", "nats-server")}
        meter = CpuMeter(servers, frozenset({"postgres"}))  # its backends are children
        before = reaped()
        meter.start()
        produced = await produce(worker_settings(stack, url), root)
        spent = meter.stop()
        spent["produce"] = reaped() - before
        spent[OTHER] = max(spent[OTHER] - spent["produce"], 0.0)  # the meter saw it as other
        return {
            "produce_s": produced.seconds,
            "produce_rows_per_s": charges / produced.seconds,
            "produce_peak_rss_mb": produced.peak_rss_mb,
            **{f"{name} CPU us per row": 1e6 * cpu / charges for name, cpu in spent.items()},
        }

    with Stack(logs, nats_cluster=nats_cluster) as stack:
        print(json.dumps(asyncio.run(go(stack)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
