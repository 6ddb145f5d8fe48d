"""Signed gateway events, a receiver in the test's loop, and reading the journal back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from charge_worker.gateway import ContractGateway
from charge_worker.messages import ChargeDue
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import DbSettings, GatewaySettings, Settings, WebhookSettings
from charge_worker.webhooks.inbox import Entry, Inbox
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.processor import Processor, ProcessorTuning
from charge_worker.webhooks.serve import Receiving, run_webhooks
from charge_worker.webhooks.signature import signed_headers
from tests.support.harness import eventually

SECRET = "whsec_" + base64.b64encode(b"charge-worker tests: the current secret").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"charge-worker tests: the previous secret").decode()
WRONG_SECRET = "whsec_" + base64.b64encode(b"charge-worker tests: nobody's secret").decode()
PERIOD = dt.date(2026, 12, 1)
API_KEY = "sk_test_sandbox"
GATEWAY_TIMEOUT_S = 5.0  # the gateway gives up on an answer after 5 s
FAST = ProcessorTuning(
    lease_s=5.0,
    poll_s=0.05,
    backoff_base_s=0.05,
    backoff_max_s=0.2,
    wait_bound_tries=1000,
    wait_bound_s=3600.0,
    give_up_tries=1000,
    stats_interval_s=0.1,
)
OPEN = ("received", "processing", "awaiting_dependency")


def webhook_settings(
    database_url: str, gateway_url: str, *secrets: str, **webhooks: Any
) -> Settings:
    """Settings for a receiver on a free loopback port; `webhooks`: more `WebhookSettings`."""
    return Settings(
        db=DbSettings(url=database_url),
        gateway=GatewaySettings(url=gateway_url, api_key=SecretStr(API_KEY)),
        webhooks=WebhookSettings(
            webhook_host="127.0.0.1",
            webhook_port=0,
            webhook_secrets=tuple(SecretStr(s) for s in secrets or (SECRET,)),
            **webhooks,
        ),
    )


def event(
    charge_id: str,
    kind: str = "charge.succeeded",
    *,
    revision: int = 1,
    order_id: int = 1,
    status: str | None = None,
    event_id: str | None = None,
    legacy: bool = False,
    amount: int = 99000,
    currency: str = "RUB",
    customer: str = "cus_ok",
) -> dict[str, Any]:
    """A gateway event about `charge_id`; the status follows the type unless given.

    A refunded charge keeps `status: "succeeded"` with `refunded: true` and
    `amount_refunded` (docs/contracts/gateway.md); `legacy` makes the shape from before that
    contract change (`status: "refunded"`, neither field)."""
    refunded = kind == "charge.refunded"
    default = "failed" if kind == "charge.failed" else "succeeded"
    if legacy and refunded:
        default = "refunded"
    charge: dict[str, Any] = {
        "id": charge_id,
        "object": "charge",
        "status": status or default,
        "amount": amount,
        "currency": currency,
        "customer": customer,
        "metadata": {"order_id": str(order_id), "billing_period": PERIOD.isoformat()},
        "revision": revision,
    }
    if not legacy:
        charge |= {"refunded": refunded, "amount_refunded": amount if refunded else 0}
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:16]}",
        "type": kind,
        "created": int(time.time()),
        "data": {"object": charge},
    }


def entry(body: dict[str, Any], source: str = "gateway") -> Entry:
    """`body` as the receiver journals it (for tests that drive the processor directly)."""
    charge = body["data"]["object"]
    metadata = charge["metadata"]
    return Entry(
        source,
        body["id"],
        body["id"],
        body["type"],
        charge["id"],
        charge["revision"],
        int(metadata["order_id"]),
        dt.date.fromisoformat(metadata["billing_period"]),
        json.dumps(body),
    )


@dataclass
class Receiver:
    """A running receiver: where it listens, its metrics, its processor."""

    url: str
    registry: CollectorRegistry
    running: Receiving
    client: httpx.AsyncClient

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def post(
        self,
        body: dict[str, Any] | bytes,
        *,
        secret: str = SECRET,
        timestamp: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Deliver `body` signed as the gateway does (or with `headers` as given)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        message_id = body["id"] if isinstance(body, dict) else "msg_raw"
        if headers is None:
            headers = signed_headers(secret, message_id, raw, timestamp=timestamp)
        return await self.client.post(
            "/webhooks/gateway",
            content=raw,
            headers={"content-type": "application/json", **headers},
            timeout=GATEWAY_TIMEOUT_S,
        )


@contextlib.asynccontextmanager
async def running_receiver(
    settings: Settings, tuning: ProcessorTuning = FAST
) -> AsyncIterator[Receiver]:
    stop = asyncio.Event()
    registry = CollectorRegistry()
    started: asyncio.Future[Receiving] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_webhooks(settings, stop, registry=registry, tuning=tuning, on_ready=started.set_result)
    )
    done, _ = await asyncio.wait({task, started}, timeout=30, return_when="FIRST_COMPLETED")
    if task in done:
        task.result()
    running = started.result()
    url = f"http://127.0.0.1:{running.port}"
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            yield Receiver(url, registry, running, client)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def idle_processor(
    database_url: str, gateway_url: str, tuning: ProcessorTuning = FAST
) -> AsyncIterator[tuple[Inbox, Processor]]:
    """A journal and a processor that runs only when the test calls `run_once`, so the
    test decides which events one batch holds."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    assert pool is not None
    gateway = ContractGateway(GatewaySettings(url=gateway_url, api_key=SecretStr(API_KEY)))
    inbox = Inbox(pool)
    metrics = WebhookMetrics(CollectorRegistry(), source="gateway")
    processor = Processor(
        inbox, gateway, metrics, owner="test-processor", retention_s=3 * 86400, tuning=tuning
    )
    try:
        yield inbox, processor
    finally:
        await gateway.aclose()
        await pool.close()


async def add_row(
    db: asyncpg.Connection,
    order_id: int,
    status: str = "pending",
    *,
    charge_id: str | None = None,
    lease_s: float | None = None,
) -> None:
    """A ledger row as a worker leaves it; `lease_s`: a live lease held by worker-1."""
    leased = lease_s is not None
    await db.execute(
        """
        INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
            customer_id, amount_minor, currency, status, gateway_charge_id, gateway_calls,
            attempt, lease_owner, lease_until)
        VALUES ($1, $2, $1::bigint || ':' || $2::date, 'sub_' || $1::bigint, 'cus_ok', 99000,
                'RUB', $3, $4, 1, 1,
                CASE WHEN $5 THEN 'worker-1' END,
                CASE WHEN $5 THEN now() + make_interval(secs => $6) END)
        """,
        order_id,
        PERIOD,
        status,
        charge_id,
        leased,
        lease_s or 0.0,
    )


async def ledger(db: asyncpg.Connection | asyncpg.Pool, order_id: int) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT status, gateway_charge_id, gateway_revision, disputed_at, review_reason,"
        " lease_owner FROM charge_attempts WHERE order_id = $1 AND billing_period = $2",
        order_id,
        PERIOD,
    )
    assert row is not None
    return row


async def journal(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT event_id, status, revision, attempts, last_error, outcome FROM webhook_inbox"
        " ORDER BY id"
    )


async def status_of(db: asyncpg.Connection, event_id: str) -> str | None:
    value = await db.fetchval("SELECT status FROM webhook_inbox WHERE event_id = $1", event_id)
    return None if value is None else str(value)


async def counted(receiver: Receiver, name: str, **labels: str) -> None:
    """`name` reaches 1: the processor counts an event just after its journal write."""
    await eventually(lambda: receiver.metric(name, **labels) == 1, f"{name} {labels} counted")


async def settled(db: asyncpg.Connection, *event_ids: str) -> bool:
    """Every one of these events has a final journal status."""
    rows = await db.fetch(
        "SELECT status FROM webhook_inbox WHERE event_id = ANY($1::text[])", list(event_ids)
    )
    return len(rows) == len(event_ids) and all(r["status"] not in OPEN for r in rows)


async def webhook_story(db: asyncpg.Connection, order_id: int) -> list[dict[str, Any]]:
    rows = await db.fetch(
        "SELECT detail FROM charge_events WHERE order_id = $1 AND kind = 'webhook' ORDER BY id",
        order_id,
    )
    return [json.loads(r["detail"]) for r in rows]


# --- the incident: the same event again and again changes the ledger once ----------------


def due(order_id: int, customer: str = "cus_ok") -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD,
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer,
            "amount_minor": 99000,
            "currency": "RUB",
            "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        }
    )


class WebhooksProcess:
    """`python -m charge_worker webhooks` on its own port, logging to a file."""

    def __init__(self, database_url: str, gateway_url: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CHARGE_WORKER_")}
        env = clean | {
            "DATABASE_URL": database_url,
            "GATEWAY_URL": gateway_url,
            "GATEWAY_API_KEY": API_KEY,
            "CHARGE_WORKER_WEBHOOK_SECRETS": f"{SECRET}",
            "CHARGE_WORKER_WEBHOOK_HOST": "127.0.0.1",
            "CHARGE_WORKER_WEBHOOK_PORT": str(self.port),
            "CHARGE_WORKER_LOG_FORMAT": "json",
        }
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "charge_worker", "webhooks"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    async def ready(self) -> None:
        async def answers() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{self.url}/readyz")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(answers, "the receiver ready")

    async def exited(self) -> int:
        await eventually(lambda: self.proc.poll() is not None, "the receiver exited")
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
