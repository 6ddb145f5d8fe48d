"""Stripe's webhooks (`GATEWAY_KIND=stripe`): `Stripe-Signature` checked, events journaled by
their id, and applied from the PaymentIntent as the adapter re-fetches it, so the order they
come in never matters. Real PostgreSQL and the Stripe-flavoured simulator over HTTP."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from pydantic import SecretStr

from charge_worker.settings import GatewaySettings, Settings
from charge_worker.webhooks.signature import stripe_signature
from tests.support.harness import eventually
from tests.support.providers import API_KEY, Provider, provider
from tests.support.webhooks import (
    PERIOD,
    SECRET,
    WRONG_SECRET,
    add_row,
    due,
    journal,
    ledger,
    running_receiver,
    settled,
    webhook_settings,
)


@pytest.fixture
def stripe_sim() -> Iterator[Provider]:
    with provider("stripe", webhook_secret=SECRET, processing_settle_s=0.5) as served:
        yield served


def stripe_settings(database_url: str, sim: Provider) -> Settings:
    settings = webhook_settings(database_url, sim.url)
    gateway = GatewaySettings(kind="stripe", url=sim.url, api_key=SecretStr(API_KEY))
    return settings.model_copy(update={"gateway": gateway})


def stripe_event(kind: str, obj: dict[str, Any]) -> bytes:
    body = {
        "id": f"evt_{uuid.uuid4().hex[:16]}",
        "object": "event",
        "type": kind,
        "created": int(time.time()),
        "data": {"object": obj},
    }
    return json.dumps(body).encode()


async def set_customer(db: asyncpg.Connection, order_id: int, customer: str) -> None:
    await db.execute(
        "UPDATE charge_attempts SET customer_id = $2 WHERE order_id = $1 AND billing_period = $3",
        order_id,
        customer,
        PERIOD,
    )


async def test_a_processing_charge_settles_and_its_refund_lands_from_the_refetched_intent(
    database_url: str, stripe_sim: Provider
) -> None:
    db = await asyncpg.connect(database_url)
    gateway = stripe_sim.gateway()
    try:
        await add_row(db, 1, "pending")
        await set_customer(db, 1, "cus_processing_1")
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            await stripe_sim.configure(webhook_url=f"{receiver.url}/webhooks/gateway")
            made = await gateway.charge(due(1, customer="cus_processing_1"))
            assert made.status == "processing"

            async def row_is(status: str) -> bool:
                return (await ledger(db, 1))["status"] == status

            await eventually(lambda: row_is("succeeded"), "the bank debit settled by webhook")
            assert made.charge_id is not None
            await gateway.refund(made.charge_id)
            await eventually(lambda: row_is("refunded"), "the refund applied by webhook")

            rows = await journal(db)
            assert {r["status"] for r in rows} <= {"applied", "stale"}
            assert len({r["event_id"] for r in rows}) == len(rows) >= 3
            assert receiver.metric(
                "charge_worker_webhook_deliveries_total", source="gateway", result="journaled"
            ) == len(rows)
        row = await ledger(db, 1)
        assert row["gateway_charge_id"] == made.charge_id
    finally:
        await gateway.aclose()
        await db.close()


async def test_an_event_delivered_late_applies_the_intent_as_it_is_now(
    database_url: str, stripe_sim: Provider
) -> None:
    """Order never matters: a stale `payment_intent.processing` arriving after the charge
    succeeded records `succeeded`, the state the re-fetch finds."""
    db = await asyncpg.connect(database_url)
    gateway = stripe_sim.gateway()
    try:
        await add_row(db, 2, "pending")
        made = await gateway.charge(due(2))  # succeeded; no webhook URL yet: none sent
        assert made.charge_id is not None
        old = stripe_event(
            "payment_intent.processing",
            {"id": made.charge_id, "object": "payment_intent", "status": "processing"},
        )
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            answer = await receiver.post(
                old, headers={"Stripe-Signature": stripe_signature(SECRET, old)}
            )
            assert answer.status_code == 200, answer.text
            event_id = json.loads(old)["id"]
            await eventually(lambda: settled(db, event_id), "the late event processed")
        row = await ledger(db, 2)
        assert (row["status"], row["gateway_charge_id"]) == ("succeeded", made.charge_id)
    finally:
        await gateway.aclose()
        await db.close()


async def test_a_wrong_signature_is_refused_and_other_event_types_are_not_journaled(
    database_url: str, stripe_sim: Provider
) -> None:
    db = await asyncpg.connect(database_url)
    try:
        body = stripe_event("payment_intent.succeeded", {"id": "pi_x", "object": "payment_intent"})
        other = stripe_event("customer.created", {"id": "cus_new", "object": "customer"})
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            forged = await receiver.post(
                body, headers={"Stripe-Signature": stripe_signature(WRONG_SECRET, body)}
            )
            standard = await receiver.post(body)  # Standard Webhooks headers: not Stripe's
            ignored = await receiver.post(
                other, headers={"Stripe-Signature": stripe_signature(SECRET, other)}
            )
            stale_at = int(time.time()) - 600
            old = await receiver.post(
                body,
                headers={"Stripe-Signature": stripe_signature(SECRET, body, timestamp=stale_at)},
            )
        assert (forged.status_code, standard.status_code) == (401, 400)
        assert (ignored.status_code, ignored.json()["ignored"]) == (200, True)
        assert old.status_code == 401
        assert await journal(db) == []
    finally:
        await db.close()
