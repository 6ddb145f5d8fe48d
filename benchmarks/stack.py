"""The servers every case runs against: nats-server, PostgreSQL and the two simulators.

nats-server and PostgreSQL are the embedded ones (`charge_worker.sandbox.embedded`) unless
`NATS_URL` / `DATABASE_URL` point at servers of your own (the database user then needs
CREATEDB: each sample gets a fresh database cloned from a migrated template). The gateway
and scoring simulators run as `python -m charge_worker sandbox gateway|scoring` child
processes, so their CPU is neither the harness's nor the worker's and can be measured
apart; each case sets their latency through `POST /_sim/config` after a `/_sim/reset`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from benchmarks.processes import Child, python_argv, wait_until
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import NatsServer, PostgresServer, free_port
from charge_worker.sandbox.gateway.app import GatewayConfig
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.nats_cluster import NatsCluster
from charge_worker.sandbox.scoring import ScoringConfig

SIM_START_TIMEOUT_S = 30.0
GATEWAY_SEED = 8
SCORING_SEED = 9
# The gateway simulator scans every key it keeps on each request (`IdempotencyKeys.claim`),
# so its cost per charge grows with the keys kept: at the default 24 h retention ~0.3 ms of
# its CPU per charge for every 10,000 charges made (3 ms per charge after 100,000). Each
# benchmark message is delivered once (checked per sample), so nothing is replayed, and 2 s
# of keys keep the simulator's cost flat.
KEY_RETENTION_S = 2.0


def with_database(url: str, database: str) -> str:
    """`url` pointing at another database on the same server."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{database}"))


async def admin(url: str, *statements: str) -> None:
    """Run `statements` (CREATE DATABASE and the like) on one connection of their own."""
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


class Simulator:
    """One simulator as a child process on a free loopback port."""

    def __init__(self, kind: Literal["gateway", "scoring"], config_json: str, log_dir: Path):
        self.kind = kind
        self.port = free_port()
        argv = python_argv(
            "-m",
            "charge_worker",
            "sandbox",
            kind,
            "--port",
            str(self.port),
            "--config",
            config_json,
        )
        self.child = Child(f"{kind} simulator", argv, log_dir / f"{kind}-sim.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        if self.child.returncode is not None:
            raise RuntimeError(
                f"the {self.kind} simulator exited during start:\n{self.child.log_tail()}"
            )
        try:
            return httpx.get(f"{self.url}/_sim/config", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    def start(self) -> None:
        self.child.start()
        if not wait_until(self._answers, timeout_s=SIM_START_TIMEOUT_S):
            raise RuntimeError(f"the {self.kind} simulator did not answer within 30 s")

    async def set_latency(self, client: httpx.AsyncClient, latency: LatencyModel) -> None:
        """Forget all state (charges, keys, counters), then set the latency."""
        (await client.post(f"{self.url}/_sim/reset")).raise_for_status()
        patch = {"latency": latency.model_dump(mode="json")}
        (await client.post(f"{self.url}/_sim/config", json=patch)).raise_for_status()

    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        response = await client.get(f"{self.url}/_sim/stats")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data


class Stack:
    """Everything the cases share; a context manager that stops all it started."""

    def __init__(self, work_dir: Path, *, nats_cluster: int = 1) -> None:
        self.work_dir = work_dir
        self.nats_cluster = nats_cluster  # 3: an embedded 3-node JetStream cluster, R3 streams
        self.nats: NatsServer | NatsCluster | None = None
        self.postgres: PostgresServer | None = None
        self.nats_url = os.environ.get("NATS_URL", "")
        self.admin_url = os.environ.get("DATABASE_URL", "")
        self.template = f"bench_template_{os.getpid()}"
        self.gateway = Simulator(
            "gateway",
            GatewayConfig(seed=GATEWAY_SEED, key_retention_s=KEY_RETENTION_S).model_dump_json(),
            work_dir,
        )
        self.scoring = Simulator(
            "scoring", ScoringConfig(seed=SCORING_SEED).model_dump_json(), work_dir
        )
        self.api_key = GatewayConfig().api_key
        self._databases: list[str] = []

    @property
    def external(self) -> dict[str, bool]:
        return {"nats": self.nats is None, "postgres": self.postgres is None}

    def start(self) -> None:
        if not self.nats_url:
            self.nats = (NatsCluster() if self.nats_cluster == 3 else NatsServer()).start()
            self.nats_url = self.nats.url
        if not self.admin_url:
            self.postgres = PostgresServer().start()
            self.admin_url = self.postgres.url
        self.gateway.start()
        self.scoring.start()

    async def prepare(self) -> None:
        """The migrated template database every sample's database is cloned from."""
        await self._admin(
            f"DROP DATABASE IF EXISTS {self.template}", f"CREATE DATABASE {self.template}"
        )
        await migrate(with_database(self.admin_url, self.template))

    async def _admin(self, *statements: str) -> None:
        await admin(self.admin_url, *statements)

    async def new_database(self) -> str:
        """A fresh, migrated, empty ledger; dropped by `drop_database` or on stop."""
        name = f"bench_{uuid.uuid4().hex[:12]}"
        await self._admin(f"CREATE DATABASE {name} TEMPLATE {self.template}")
        self._databases.append(name)
        return with_database(self.admin_url, name)

    async def drop_database(self, url: str) -> None:
        name = urlsplit(url).path.lstrip("/")
        await self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        with contextlib.suppress(ValueError):
            self._databases.remove(name)

    async def cleanup_databases(self) -> None:
        """Drop what a failed or interrupted run left behind (external servers only matter)."""
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            for name in [*self._databases, self.template]:
                await self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            self._databases.clear()

    async def server_versions(self) -> dict[str, str]:
        conn = await asyncpg.connect(self.admin_url)
        try:
            postgres = str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()
        return {"postgresql": postgres}

    def pids(self) -> dict[str, list[int]]:
        """The processes whose CPU each measurement reports, by group."""
        groups: dict[str, list[int]] = {
            "gateway sim": [self.gateway.child.pid],
            "scoring sim": [self.scoring.child.pid],
        }
        if self.postgres is not None and self.postgres.proc is not None:
            groups["postgres"] = [self.postgres.proc.pid]
        if isinstance(self.nats, NatsCluster):
            nodes = self.nats.nodes.values()
            groups["nats-server"] = [node.proc.pid for node in nodes if node.proc is not None]
        elif self.nats is not None and self.nats.proc is not None:
            groups["nats-server"] = [self.nats.proc.pid]
        groups["harness"] = [os.getpid()]
        return groups

    def stop(self) -> None:
        self.gateway.child.stop()
        self.scoring.child.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
