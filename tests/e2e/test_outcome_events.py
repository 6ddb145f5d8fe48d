"""Outcome events as the rest of the business sees them: the producer, two worker processes
and reconcile run as a user runs them, and a downstream consumer reads `CHARGE_OUTCOMES`
with a durable consumer of its own, deduplicating by `event_id`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.cli import cli
from tests.support.harness import (
    WorkerProcess,
    eventually,
    gateway_charges,
    provisioned,
    settings_env,
    settings_for,
)
from tests.support.producer import DAY, Sub, add_subscriptions, all_final

PERIOD = DAY.isoformat()
API_KEY = "sk_test_sandbox"


async def downstream(nc: Client, cfg: NatsSettings, expected: int) -> list[dict[str, Any]]:
    """What a downstream service applies: its own durable consumer on every outcome
    subject, each event once by `event_id`, acked after it is applied."""
    js = nc.jetstream()
    await js.add_consumer(
        cfg.outcomes_stream,
        ConsumerConfig(
            durable_name="receipts",
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=f"{cfg.outcomes_subject}.>",
        ),
    )
    subscription = await js.pull_subscribe_bind("receipts", cfg.outcomes_stream)
    applied: dict[str, dict[str, Any]] = {}
    seen = 0

    async def drained() -> bool:
        nonlocal seen
        try:
            messages = await subscription.fetch(100, timeout=0.5)
        except TimeoutError:
            messages = []
        for msg in messages:
            seen += 1
            event = json.loads(msg.data)
            assert msg.headers is not None
            assert msg.headers["Nats-Msg-Id"] == f"outcome:{event['event_id']}"
            assert msg.subject == f"{cfg.outcomes_subject}.{event['type'].removeprefix('charge.')}"
            applied.setdefault(event["event_id"], event)
            await msg.ack()
        return len(applied) >= expected

    await eventually(drained, f"{expected} outcome events downstream")
    assert seen == len(applied), "the stream held an event twice"
    return list(applied.values())


async def test_a_billing_day_tells_downstream_each_change_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    env = settings_env(settings)
    await provisioned(nc, settings)
    await add_subscriptions(
        database_url,
        *(Sub(f"sub_{n}", n) for n in (1, 2, 3)),
        Sub("sub_4", 4, customer_id="cus_decline_4"),
        Sub("sub_5", 5, customer_id="cus_block_5"),
    )
    produced = await asyncio.to_thread(cli, "produce", "--date", PERIOD, env=env)
    assert produced.returncode == 0, produced.stderr
    for n in range(2):
        spawn.append(WorkerProcess(settings, tmp_path / f"worker-{n}.log"))
    await eventually(all_final(database_url, 5), "five charges settled")

    # a charge of ours the ledger never heard of (its worker's answer lost with its row):
    # reconcile records it, and downstream hears of it like any other
    async with httpx.AsyncClient(base_url=gateway_sim.url) as client:
        made = await client.post(
            "/v1/charges",
            json={
                "amount": 99000,
                "currency": "RUB",
                "customer": "cus_ok",
                "metadata": {"order_id": "6", "billing_period": PERIOD},
            },
            headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": f"6:{PERIOD}"},
        )
    assert made.status_code == 200, made.text
    await add_subscriptions(
        database_url, Sub("sub_6", 6, next_billing_date=DAY.replace(year=2027, month=1))
    )
    reconciled = await asyncio.to_thread(cli, "reconcile", env=env)
    assert reconciled.returncode == 0, reconciled.stderr

    events = await downstream(nc, nats_settings, expected=6)
    by_order = {e["order_id"]: (e["type"], e["sequence"]) for e in events}
    assert by_order == {
        1: ("charge.succeeded", 1),
        2: ("charge.succeeded", 1),
        3: ("charge.succeeded", 1),
        4: ("charge.retry_scheduled", 1),  # a generic decline is soft: its next try is due
        5: ("charge.blocked", 1),
        6: ("charge.succeeded", 1),
    }
    charges = await gateway_charges(gateway_sim.url)
    assert charges == {f"{n}:{PERIOD}": 1 for n in (1, 2, 3, 6)}
    conn = await asyncpg.connect(database_url)
    try:
        recorded = await conn.fetch(
            "SELECT order_id, gateway_charge_id FROM charge_attempts"
            " WHERE gateway_charge_id IS NOT NULL"
        )
    finally:
        await conn.close()
    assert {e["order_id"]: e["gateway_charge_id"] for e in events if e["gateway_charge_id"]} == {
        r["order_id"]: r["gateway_charge_id"] for r in recorded
    }
