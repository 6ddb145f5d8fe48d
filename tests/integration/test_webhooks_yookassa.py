"""YooKassa's notifications (`GATEWAY_KIND=yookassa`): unsigned, so taken only from
`CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS` (here loopback, where the simulator sends from), and
applied from the payment as the adapter re-fetches it: whatever a body says, the ledger
records what YooKassa holds. Real PostgreSQL and the YooKassa-flavoured simulator over HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import SecretStr

from charge_worker.gateway import Gateway, build_gateway
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import GatewaySettings, RetrySettings, Settings
from tests.support.harness import eventually
from tests.support.webhooks import (
    PERIOD,
    Receiver,
    add_row,
    due,
    journal,
    ledger,
    running_receiver,
    settled,
    webhook_settings,
)

SHOP_ID, SECRET_KEY = "100500", "test_sandbox"  # the simulator's
CREDENTIALS = f"{SHOP_ID}:{SECRET_KEY}"
LOOPBACK = "127.0.0.1/32"


@pytest.fixture
def sim() -> Iterator[ServedApp]:
    config = GatewayConfig(flavour="yookassa", seed=1, processing_settle_s=0.3)
    with ServedApp(build_gateway_app(config)) as served:
        yield served


@pytest.fixture
async def gateway(sim: ServedApp) -> AsyncIterator[Gateway]:
    """The adapter the test charges with (the receiver builds its own)."""
    adapter = build_gateway(yookassa_gateway(sim))
    yield adapter
    await adapter.aclose()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


def yookassa_gateway(sim: ServedApp) -> GatewaySettings:
    return GatewaySettings(kind="yookassa", url=sim.url, api_key=SecretStr(CREDENTIALS))


def yookassa_settings(database_url: str, sim: ServedApp, **webhooks: Any) -> Settings:
    """A receiver that takes notifications from loopback only, and no secret; a decline
    ends its period (no retry schedule), so the ledger says `declined`."""
    settings = webhook_settings(
        database_url, sim.url, webhook_source_networks=(LOOPBACK,), **webhooks
    )
    unsigned = settings.webhooks.model_copy(update={"webhook_secrets": ()})
    return settings.model_copy(
        update={
            "gateway": yookassa_gateway(sim),
            "webhooks": unsigned,
            "retries": RetrySettings(retry_schedule=()),
        }
    )


def notification(event: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": "notification", "event": event, "object": obj}).encode()


async def deliver(receiver: Receiver, body: bytes, **headers: str) -> httpx.Response:
    """POST `body` unsigned, as YooKassa does."""
    return await receiver.post(body, headers=headers)


async def set_customer(db: asyncpg.Connection, order_id: int, customer: str) -> None:
    """The row's customer: for YooKassa the saved payment method its payments carry."""
    await db.execute(
        "UPDATE charge_attempts SET customer_id = $2 WHERE order_id = $1 AND billing_period = $3",
        order_id,
        customer,
        PERIOD,
    )


async def test_a_pending_payment_settles_by_its_notification_once_however_often_delivered(
    database_url: str, sim: ServedApp, gateway: Gateway, db: asyncpg.Connection
) -> None:
    """The worker recorded `processing` (YooKassa answered `pending`); the simulator's
    `payment.succeeded` settles it from the re-fetched payment (one that comes before the
    row is recorded waits for it); the same notification again is the same journal row."""
    async with (
        running_receiver(yookassa_settings(database_url, sim)) as receiver,
        httpx.AsyncClient(base_url=sim.url, trust_env=False) as simulator,
    ):
        hook = {"webhook_url": f"{receiver.url}/webhooks/gateway"}
        (await simulator.post("/_sim/config", json=hook)).raise_for_status()
        made = await gateway.charge(due(1, customer="cus_processing_1"))
        assert made.status == "processing"
        assert made.charge_id is not None
        await add_row(db, 1, "processing", charge_id=made.charge_id)
        await set_customer(db, 1, "cus_processing_1")
        event_id = f"payment.succeeded:{made.charge_id}"

        async def applied() -> bool:
            return await settled(db, event_id) and (await ledger(db, 1))["status"] == "succeeded"

        await eventually(applied, "the settled payment applied by its notification")
        # YooKassa delivers it again: the same event about the same payment
        payment = await simulator.get(f"/v3/payments/{made.charge_id}", auth=(SHOP_ID, SECRET_KEY))
        answer = await deliver(receiver, notification("payment.succeeded", payment.json()))
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"received": event_id, "duplicate": True}
        duplicates = receiver.metric(
            "charge_worker_webhook_duplicate_events_total", source="gateway"
        )
    assert duplicates == 1
    rows = await journal(db)
    assert [(r["event_id"], r["status"]) for r in rows] == [(event_id, "applied")]
    row = await ledger(db, 1)
    assert (row["status"], row["gateway_charge_id"]) == ("succeeded", made.charge_id)


async def test_a_forged_body_is_applied_as_the_provider_holds_the_payment(
    database_url: str, sim: ServedApp, gateway: Gateway, db: asyncpg.Connection
) -> None:
    """The body says `payment.succeeded`; YooKassa holds the payment canceled: the ledger
    records the decline, under the reason the re-fetched payment gives."""
    made = await gateway.charge(due(2, customer="cus_decline_1"))  # no webhook URL: none sent
    assert made.charge_id is not None
    await add_row(db, 2, "pending")
    await set_customer(db, 2, "cus_decline_1")
    forged = notification(
        "payment.succeeded",
        {
            "id": made.charge_id,
            "status": "succeeded",
            "paid": True,
            "amount": {"value": "990.00", "currency": "RUB"},
            "metadata": {"order_id": "2", "billing_period": PERIOD.isoformat()},
        },
    )
    async with running_receiver(yookassa_settings(database_url, sim)) as receiver:
        answer = await deliver(receiver, forged)
        assert answer.status_code == 200, answer.text
        event_id = f"payment.succeeded:{made.charge_id}"
        await eventually(lambda: settled(db, event_id), "the forged notification processed")
    row = await db.fetchrow(
        "SELECT status, gateway_charge_id, decline_code FROM charge_attempts"
        " WHERE order_id = 2 AND billing_period = $1",
        PERIOD,
    )
    assert row is not None
    assert (row["status"], row["gateway_charge_id"]) == ("declined", made.charge_id)
    assert row["decline_code"] == "general_decline"


async def test_a_delivery_from_outside_the_networks_is_refused_and_journals_nothing(
    database_url: str, sim: ServedApp, db: asyncpg.Connection
) -> None:
    """Behind a trusted proxy (loopback here) the source is the forwarded address: one
    outside YooKassa's networks is 403, however the client spelled its own left-most entry;
    the proxy's own deliveries (nothing forwarded) come from loopback, inside. A body that
    is no notification is 400, an event the ledger does not use 200 and not journaled."""
    body = notification(
        "payment.succeeded",
        {"id": "2f9a1e3c-000f-5000-8000-1a2b3c4d5e6f", "status": "succeeded"},
    )
    waiting = notification("payment.waiting_for_capture", {"id": "2f9a1e3c-0001"})
    settings = yookassa_settings(database_url, sim, webhook_trusted_proxies=(LOOPBACK,))
    async with running_receiver(settings) as receiver:
        outside = await deliver(receiver, body, **{"X-Forwarded-For": "203.0.113.9"})
        forged = await deliver(receiver, body, **{"X-Forwarded-For": "127.0.0.1, 203.0.113.9"})
        malformed = await deliver(receiver, b'{"id": "evt_1", "type": "charge.succeeded"}')
        unused = await deliver(receiver, waiting)
        refused = receiver.metric(
            "charge_worker_webhook_deliveries_total", source="gateway", result="unauthorized"
        )
    assert (outside.status_code, forged.status_code) == (403, 403)
    assert "203.0.113.9" in outside.json()["error"]
    assert refused == 2
    assert malformed.status_code == 400, malformed.text  # from loopback: inside, read
    assert (unused.status_code, unused.json()) == (200, {"received": None, "ignored": True})
    assert await journal(db) == []


async def test_a_body_without_our_metadata_decides_nothing_the_payment_does(
    database_url: str, sim: ServedApp, gateway: Gateway, db: asyncpg.Connection
) -> None:
    """A body stripped of our metadata arrives first for our payment: the payment, as
    re-fetched, is ours and is applied (the real delivery after it is a duplicate). A
    payment that is truly another integration's is ignored once re-fetched, final."""
    ours = await gateway.charge(due(3, customer="cus_ok"))
    assert ours.charge_id is not None
    await add_row(db, 3, "pending")
    await set_customer(db, 3, "cus_ok")
    stripped = notification("payment.succeeded", {"id": ours.charge_id, "status": "succeeded"})
    async with (
        running_receiver(yookassa_settings(database_url, sim)) as receiver,
        httpx.AsyncClient(base_url=sim.url, trust_env=False) as simulator,
    ):
        theirs = await simulator.post(  # another integration's payment, on the same shop
            "/v3/payments",
            auth=(SHOP_ID, SECRET_KEY),
            headers={"Idempotence-Key": "their-order-77"},
            json={
                "amount": {"value": "10.00", "currency": "RUB"},
                "capture": True,
                "payment_method_id": "cus_ok",
                "metadata": {"their_order": "77"},
            },
        )
        assert theirs.status_code == 200, theirs.text
        first = await deliver(receiver, stripped)
        other = await deliver(
            receiver, notification("payment.succeeded", theirs.json() | {"metadata": {}})
        )
        ours_id = f"payment.succeeded:{ours.charge_id}"
        theirs_id = f"payment.succeeded:{theirs.json()['id']}"
        await eventually(lambda: settled(db, ours_id, theirs_id), "both processed")
    assert (first.status_code, other.status_code) == (200, 200)
    statuses = {r["event_id"]: r["status"] for r in await journal(db)}
    assert statuses == {ours_id: "applied", theirs_id: "ignored"}
    row = await ledger(db, 3)
    assert (row["status"], row["gateway_charge_id"]) == ("succeeded", ours.charge_id)
