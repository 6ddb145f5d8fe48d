"""The system under attack: servers, simulators, a proxy in front of each, N worker processes.

The chaos suite kills and pauses its servers, so it always runs its own embedded
nats-server and PostgreSQL (`Servers`, shared by the scenarios of one run) and ignores
`NATS_URL` / `DATABASE_URL`. Each scenario gets a fresh database, fresh stream names (the
outcomes stream too: no run reads another's events), fresh simulators and proxies
(`Cluster`). The workers reach NATS, PostgreSQL and the gateway only through the proxies,
so a nemesis can slow, blackhole or reset their traffic; the harness itself (generator,
checker) talks to the servers directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from asyncio.subprocess import PIPE
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import asyncpg
import httpx
from nats.aio.client import Client

from charge_worker import streams
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import NatsServer, PostgresServer
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.nats_cluster import NatsCluster
from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.chaos.proxy import Proxy
from tests.support.harness import WorkerProcess, settings_env, settings_for

# Fast clocks so that every redelivery, lease expiry and quiet-row sweep happens within
# seconds; every value passes the settings' own cross-field rules.
CHAOS_SETTINGS: dict[str, Any] = {
    "ack_wait_s": 2.0,
    "backoff_s": (2.0, 2.0, 3.0, 3.0, 4.0),
    "max_deliver": 12,
    "lease_s": 7.0,
    "gateway_timeout_s": 1.0,
    "processing_budget_s": 30.0,
    "drain_s": 5.0,
    "concurrency": 16,
    "fetch_wait_s": 0.5,
    "deferred_check_interval_s": 1.0,
    "stats_interval_s": 1.0,
    "gateway_breaker_reset_s": 2.0,
    "scoring_breaker_reset_s": 2.0,
    "reconcile_quiet_s": 3.0,
    "db_pool_max": 20,
    "outbox_retry_max_s": 2.0,
    # a decline ends the period: the generator's declined keys expect `declined`
    "retry_schedule": (),
}
RESTART_AFTER_S = 0.5
FAILPOINT_DEATH = "worker died at a failpoint"  # a SIGKILL no nemesis sent
# the knobs of a scenario that are an outage, not a property of the gateway (key retention
# and idempotency stay as the scenario set them)
HEALTHY_GATEWAY = {
    "lost_answer_rate": 0.0,
    "error_rates": {},
    "latency": GatewayConfig().latency.model_dump(),
    "endpoint_latency": {},
}
HEALTHY_SCORING = {
    "latency": ScoringConfig().latency.model_dump(),
    "error_rate": 0.0,
    "hang_rate": 0.0,
    "malformed_rate": 0.0,
}
Completed = subprocess.CompletedProcess[
    str
]  # how long a dead worker stays down before its "pod" restarts


class Chronicle:
    """Every harness and nemesis action with seconds since the start; printed on failure."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str, str]] = []
        self.outages: list[tuple[str, float]] = []  # what, when it ended (wall clock)
        self.attacks: Counter[str] = Counter()  # nemesis name -> actions taken
        self.figures: dict[str, Any] = {}  # what a nemesis measured (commits lost, ...)
        self.first_fault: float | None = None  # wall clock of the first nemesis action

    def __call__(self, who: str, what: str) -> None:
        self.lines.append((self.now(), who, what))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def render(self) -> str:
        return "\n".join(f"{t:8.2f}s  {who:<12} {what}" for t, who, what in self.lines)


Shape = Literal["single", "cluster", "cluster_sync"]


class Servers:
    """The engines of a chaos run; nemeses restart, pause, partition and fail them over.

    `single`: one nats-server and one PostgreSQL. `cluster`: a 3-node JetStream cluster
    (R3 streams, `sync_interval: always`) and a PostgreSQL primary with an asynchronous
    streaming standby; `cluster_sync`: the same with a synchronous standby.
    """

    def __init__(self, shape: Shape = "single") -> None:
        self.shape = shape
        self.nats: NatsServer | NatsCluster = NatsServer() if shape == "single" else NatsCluster()
        sync = ("synchronous_standby_names=standby",) if shape == "cluster_sync" else ()
        self.pg = PostgresServer(settings=sync)
        self.standby: PostgresServer | None = None

    @property
    def clustered(self) -> bool:
        return isinstance(self.nats, NatsCluster)

    @property
    def nats_ports(self) -> list[int]:
        """The client port of each nats-server."""
        if isinstance(self.nats, NatsCluster):
            return [node.port for node in self.nats.nodes.values()]
        return [self.nats.port]

    @property
    def nats_url(self) -> str:
        return self.nats.url

    def start(self) -> Servers:
        self.nats.start()
        self.pg.start()
        if self.shape != "single":
            self.standby = PostgresServer.standby_of(self.pg).start()
        return self

    def failover(self) -> PostgresServer:
        """The primary's machine dies (SIGKILL, every process); the standby is promoted.
        Returns the new primary (also `self.pg` from now on)."""
        assert self.standby is not None, "failover needs a standby"
        self.pg.terminate(signal.SIGKILL)
        self.standby.promote()
        self.pg, self.standby = self.standby, None
        return self.pg

    def heal(self) -> None:
        """Every server running, unpaused and routed, whatever a nemesis left behind."""
        if isinstance(self.nats, NatsCluster):
            self.nats.heal()
            for node in self.nats.nodes.values():
                if not node.running:
                    node.start()
            self.nats.wait_ready()
        elif self.nats.proc is None or self.nats.proc.poll() is not None:
            self.nats.start()
        else:
            self.nats.resume()
        if self.pg.proc is None or self.pg.proc.poll() is not None:
            self.pg.start()
        else:
            self.pg.resume()
            self.pg.release_replication()

    def stop(self) -> None:
        self.nats.stop()
        if self.standby is not None:
            self.standby.stop()
        self.pg.stop()


class ServerPool:
    """The engines of a run by shape, started when first needed and shared by scenarios; a
    scenario whose faults change its engines for good (a failover) gets fresh ones."""

    def __init__(self) -> None:
        self.shared: dict[Shape, Servers] = {}

    @contextlib.contextmanager
    def lend(self, shape: Shape, *, fresh: bool) -> Iterator[Servers]:
        if fresh:
            servers = Servers(shape).start()
            try:
                yield servers
            finally:
                servers.stop()
            return
        if shape not in self.shared:
            self.shared[shape] = Servers(shape).start()
        yield self.shared[shape]

    def stop(self) -> None:
        for servers in self.shared.values():
            servers.stop()
        self.shared.clear()


@dataclass
class Cluster:
    """One scenario's system: its database, streams, simulators, proxies and workers."""

    servers: Servers
    root: Path
    settings: Settings
    gateway: ServedApp
    scoring: ServedApp
    proxies: dict[str, Proxy]
    chronicle: Chronicle
    workers: list[WorkerProcess] = field(default_factory=list)
    # one fault of PostgreSQL's at a time: a pause cannot strike a server being restarted
    postgres_faults: asyncio.Lock = field(default_factory=asyncio.Lock)
    _restarts: int = 0

    @property
    def database_url(self) -> str:
        """The scenario's database, directly (not through the proxy)."""
        return _direct(self.settings.db.dsn, self.servers.pg.port, self.proxies["postgres"])

    @property
    def direct_nats(self) -> NatsSettings:
        return self.settings.nats.model_copy(update={"url": self.servers.nats_url})

    def nats_proxies(self) -> list[Proxy]:
        """The proxies in front of the nats-servers (one, or one per cluster node)."""
        return [proxy for name, proxy in self.proxies.items() if name.startswith("nats")]

    def env(self) -> dict[str, str]:
        """The environment of a `charge-worker` command run against this cluster."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CHARGE_WORKER_")}
        return {**clean, **settings_env(self.settings)}

    def spawn(self, count: int) -> None:
        for _ in range(count):
            self._start_worker(len(self.workers))

    def _start_worker(self, index: int) -> None:
        log = self.root / f"worker-{index}.log"
        worker = WorkerProcess(self.settings, log)
        if index < len(self.workers):
            self.workers[index] = worker
        else:
            self.workers.append(worker)
        self.chronicle("cluster", f"worker {index} started (pid {worker.proc.pid})")

    def kill(self, index: int) -> None:
        worker = self.workers[index]
        if worker.alive:
            worker.kill()
            self.chronicle("nemesis", f"kill -9 worker {index} (pid {worker.proc.pid})")

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart every worker that died (a nemesis, a failpoint), like a Deployment does."""
        down_since: dict[int, float] = {}
        while not stop.is_set():
            now = time.monotonic()
            for index, worker in enumerate(self.workers):
                if worker.alive:
                    continue
                if index not in down_since:
                    down_since[index] = now
                    self.chronicle("cluster", f"worker {index} exited {worker.proc.returncode}")
                    if worker.proc.returncode == -signal.SIGKILL and not worker.killed:
                        self.chronicle.attacks[FAILPOINT_DEATH] += 1
                elif now - down_since[index] >= RESTART_AFTER_S:
                    del down_since[index]
                    self._restarts += 1
                    self._start_worker(index)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    @property
    def restarts(self) -> int:
        return self._restarts

    async def command(self, *args: str, timeout_s: float = 120.0) -> Completed:
        """`charge-worker <args>` against this cluster (through the proxies, like a pod).

        Killed when cancelled or after `timeout_s` (a CronJob's deadline): exit -9."""
        command = [sys.executable, "-m", "charge_worker", *args]
        process = await asyncio.create_subprocess_exec(
            *command, env=self.env(), stdout=PIPE, stderr=PIPE, stdin=subprocess.DEVNULL
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            return Completed(command, -signal.SIGKILL, "", f"killed after {timeout_s}s")
        finally:
            if process.returncode is None:  # cancelled
                process.kill()
                await process.wait()
        return Completed(command, process.returncode or 0, out.decode(), err.decode())

    def heal(self) -> None:
        """Every fault over: proxies pass, servers up, simulators healthy again."""
        for proxy in self.proxies.values():
            proxy.pass_through()
        self.servers.heal()
        for app, healthy in ((self.gateway, HEALTHY_GATEWAY), (self.scoring, HEALTHY_SCORING)):
            httpx.post(f"{app.url}/_sim/config", json=healthy, timeout=10).raise_for_status()

    def deploy_fix(self) -> None:
        """Failpoints off, as a release would turn a bug off: SIGTERM every worker (it
        drains), and the supervisor starts them again with the new settings."""
        if not self.settings.worker.failpoints:
            return
        worker = self.settings.worker.model_copy(update={"failpoints": ""})
        self.settings = self.settings.model_copy(update={"worker": worker})
        for index, process in enumerate(self.workers):
            if process.alive:
                process.proc.terminate()
                self.chronicle("cluster", f"worker {index} SIGTERM: failpoints off")

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.kill()


def _direct(url: str, port: int, proxy: Proxy) -> str:
    return url.replace(f":{proxy.port}/", f":{port}/")


@contextlib.asynccontextmanager
async def cluster(
    servers: Servers,
    root: Path,
    chronicle: Chronicle,
    *,
    gateway: GatewayConfig,
    scoring: ScoringConfig,
    overrides: dict[str, Any],
) -> AsyncIterator[Cluster]:
    """A fresh database, streams, simulators and proxies on `servers`; workers not started."""
    uid = uuid.uuid4().hex[:10]
    database = f"chaos_{uid}"
    admin = await asyncpg.connect(servers.pg.url)
    try:
        await admin.execute(f"CREATE DATABASE {database}")
    finally:
        await admin.close()
    await migrate(servers.pg.url_for(database))
    with contextlib.ExitStack() as stack:
        gateway_app = stack.enter_context(ServedApp(build_gateway_app(gateway)))
        scoring_app = stack.enter_context(ServedApp(build_scoring_app(scoring)))
        ports = servers.nats_ports
        names = ["nats"] if len(ports) == 1 else [f"nats-{n + 1}" for n in range(len(ports))]
        proxies = {
            **{
                name: stack.enter_context(Proxy("127.0.0.1", port))
                for name, port in zip(names, ports, strict=True)
            },
            "postgres": stack.enter_context(Proxy("127.0.0.1", servers.pg.port)),
            "gateway": stack.enter_context(Proxy("127.0.0.1", gateway_app.port)),
        }
        nats = NatsSettings(
            url=",".join(f"nats://127.0.0.1:{proxies[name].port}" for name in names),
            stream_replicas=len(ports),
            stream=f"CHARGES_{uid}",
            subject=f"charges_{uid}.due",
            dlq_stream=f"CHARGES_DLQ_{uid}",
            dlq_subject=f"charges_{uid}.dlq",
            outcomes_stream=f"CHARGE_OUTCOMES_{uid}",
            outcomes_subject=f"charges_{uid}.outcome",
        )
        settings = settings_for(
            nats,
            f"postgresql://postgres@127.0.0.1:{proxies['postgres'].port}/{database}",
            f"http://127.0.0.1:{proxies['gateway'].port}",
            scoring_app.url,
            **(CHAOS_SETTINGS | overrides),
        )
        built = Cluster(servers, root, settings, gateway_app, scoring_app, proxies, chronicle)
        nc = await connect_direct(built)
        try:
            report = await streams.provision(nc.jetstream(), built.direct_nats)
            assert not report.drift, report.drift
        finally:
            await nc.close()
        try:
            yield built
        finally:
            built.stop_workers()
            built.heal()


async def connect_direct(built: Cluster) -> Client:
    """The harness's own NATS connection, around the proxy."""
    return await streams.connect(built.direct_nats, name="chaos-harness")
