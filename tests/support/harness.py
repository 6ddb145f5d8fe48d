"""Run a real worker in the test's event loop against real servers and simulators."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from charge_worker import streams
from charge_worker.settings import (
    DbSettings,
    GatewaySettings,
    HttpSettings,
    NatsSettings,
    ReconcileSettings,
    RetrySettings,
    ScoringSettings,
    Settings,
    WorkerSettings,
    env_name,
)
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.run import Running, run_worker

PERIOD = dt.date(2026, 12, 1)
WAIT_S = 60.0


def settings_for(
    nats: NatsSettings,
    database_url: str,
    gateway_url: str,
    scoring_url: str,
    **overrides: Any,
) -> Settings:
    """Fast test settings; `overrides` are field=value of any group."""
    groups: dict[str, dict[str, Any]] = {
        "nats": {"ack_wait_s": 5.0, "backoff_s": (5.0, 10.0), "max_deliver": 4},
        "db": {"url": database_url, "db_pool_max": 20},
        "worker": {"concurrency": 8, "processing_budget_s": 60.0, "lease_s": 15.0, "drain_s": 10.0},
        "scoring": {"url": scoring_url},
        "gateway": {
            "url": gateway_url,
            "api_key": SecretStr("sk_test_sandbox"),
            "gateway_timeout_s": 5.0,
        },
        "http": {"http_host": "127.0.0.1", "metrics_port": 0},
        "reconcile": {},
        "retries": {},
    }
    classes = {
        "nats": NatsSettings,
        "db": DbSettings,
        "worker": WorkerSettings,
        "scoring": ScoringSettings,
        "gateway": GatewaySettings,
        "http": HttpSettings,
        "reconcile": ReconcileSettings,
        "retries": RetrySettings,
    }
    for field, value in overrides.items():
        group = next(g for g, cls in classes.items() if field in cls.model_fields)
        groups[group][field] = value
    base = nats.model_dump()
    built = {
        name: classes[name](**(base if name == "nats" else {}) | values)
        for name, values in groups.items()
    }
    return Settings(**built)


def due(order_id: int, customer: str = "cus_ok", amount: int = 99000, **extra: Any) -> bytes:
    return json.dumps(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD.isoformat(),
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer,
            "amount_minor": amount,
            "currency": "RUB",
            "due_at": "2026-12-01T00:00:00Z",
            **extra,
        }
    ).encode()


async def provisioned(nc: Client, settings: Settings) -> JetStreamContext:
    """Streams and consumer shaped by these settings, before anything is published."""
    js = nc.jetstream()
    report = await streams.provision(js, settings.nats)
    assert not report.drift, report.drift
    return js


async def publish(
    js: JetStreamContext, subject: str, body: bytes, msg_id: str | None = None
) -> int:
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    ack = await js.publish(subject, body, headers=headers)
    return ack.seq


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str, within_s: float = WAIT_S
) -> None:
    """Wait until `check()` (sync or async) is true; fail naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not await _truth(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


async def consumer_idle(nc: Client, cfg: NatsSettings) -> bool:
    """Nothing left for the durable consumer: none pending, none awaiting an ack."""
    info = await nc.jetstream().consumer_info(cfg.stream, cfg.durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def statuses(database_url: str) -> dict[int, str]:
    """Every ledger row's status, by order id."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT order_id, status FROM charge_attempts")
    finally:
        await conn.close()
    return {row["order_id"]: row["status"] for row in rows}


async def dead_letters_at_least(nc: Client, cfg: NatsSettings, count: int = 1) -> bool:
    return (await nc.jetstream().stream_info(cfg.dlq_stream)).state.messages >= count


async def gateway_charges(gateway_url: str) -> Counter[str]:
    """Successful charges per idempotency key, counted at the gateway simulator."""
    async with httpx.AsyncClient() as client:
        data = (await client.get(f"{gateway_url}/_sim/charges")).json()["data"]
    return Counter(c["idempotency_key"] for c in data if c["status"] in ("succeeded", "refunded"))


async def set_sim(url: str, **config: Any) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/_sim/config", json=config)
        response.raise_for_status()


async def _truth(value: bool | Awaitable[bool]) -> bool:
    return await value if inspect.isawaitable(value) else value


@dataclass
class RunningWorker:
    consumer: Consumer
    registry: CollectorRegistry
    stop: asyncio.Event
    task: asyncio.Task[None]
    http_url: str

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def running_worker(settings: Settings) -> AsyncIterator[RunningWorker]:
    stop = asyncio.Event()
    registry = CollectorRegistry()
    started: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_worker(settings, stop, registry=registry, on_ready=started.set_result)
    )
    done, _ = await asyncio.wait({task, started}, timeout=WAIT_S, return_when="FIRST_COMPLETED")
    if task in done:
        task.result()  # raises what stopped it
    running = started.result()
    await asyncio.wait_for(running.consumer.ready.wait(), WAIT_S)
    worker = RunningWorker(
        running.consumer, registry, stop, task, f"http://127.0.0.1:{running.http_port}"
    )
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes `charge-worker run` load exactly these settings."""
    env: dict[str, str] = {}
    for name in Settings.model_fields:
        group = getattr(settings, name)
        for field in type(group).model_fields:
            value = getattr(group, field)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, tuple):
                value = ",".join(
                    v.get_secret_value() if isinstance(v, SecretStr) else str(v) for v in value
                )
            env[env_name(type(group), field)] = str(value)
    return env


class WorkerProcess:
    """`charge-worker run` as a child process with these settings, its output in `log`."""

    def __init__(self, settings: Settings, log: Path, **env: str) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CHARGE_WORKER_")}
        full = {**clean, **settings_env(settings), "CHARGE_WORKER_LOG_FORMAT": "json", **env}
        self.log = log
        self.killed = False  # by kill(), as opposed to dying by itself
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "charge_worker", "run"],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    async def exited(self) -> int:
        await eventually(lambda: self.proc.poll() is not None, "the worker exited", within_s=60)
        return self.proc.returncode

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, like a pod killed mid-charge; waits for the exit."""
        if self.proc.poll() is None:
            self.killed = True
            self.proc.kill()
            self.proc.wait()
