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
import httpx
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
    status_of,
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
            {
                "id": made.charge_id,
                "object": "payment_intent",
                "status": "processing",
                # an intent's event carries its metadata (one without ours is ignored)
                "metadata": {"order_id": "2", "billing_period": PERIOD.isoformat()},
            },
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


async def journal_row(db: asyncpg.Connection, event_id: str) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT status, attempts, last_error FROM webhook_inbox WHERE event_id = $1", event_id
    )
    assert row is not None
    return row


async def test_an_event_waiting_for_a_live_worker_lease_does_not_refetch_the_intent(
    database_url: str, stripe_sim: Provider
) -> None:
    """Issue 34 item 4: the decision comes first; while a worker's live lease holds the row,
    every try waits without asking the provider (month start: uncounted traffic)."""
    db = await asyncpg.connect(database_url)
    gateway = stripe_sim.gateway()
    try:
        made = await gateway.charge(due(3))  # no webhook URL yet: none sent
        assert made.charge_id is not None
        await add_row(db, 3, "pending", lease_s=600.0)
        before = (await stripe_sim.stats())["requests"]
        body = stripe_event(
            "payment_intent.succeeded",
            {
                "id": made.charge_id,
                "object": "payment_intent",
                "status": "succeeded",
                "metadata": {"order_id": "3", "billing_period": PERIOD.isoformat()},
            },
        )
        event_id = json.loads(body)["id"]
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            answer = await receiver.post(
                body, headers={"Stripe-Signature": stripe_signature(SECRET, body)}
            )
            assert answer.status_code == 200, answer.text

            async def waited_three_times() -> bool:
                row = await journal_row(db, event_id)
                return row["attempts"] >= 3 and row["status"] == "awaiting_dependency"

            await eventually(waited_three_times, "three tries under the worker's lease")
        row = await journal_row(db, event_id)
        assert "lease" in row["last_error"]
        assert (await stripe_sim.stats())["requests"] == before
        assert (await ledger(db, 3))["status"] == "pending"
    finally:
        await gateway.aclose()
        await db.close()


async def test_the_refetch_spends_a_token_of_the_fleets_rate_limit(
    database_url: str, stripe_sim: Provider
) -> None:
    """Issue 34 item 4: the webhook pods' gateway requests count against the fleet's bucket."""
    db = await asyncpg.connect(database_url)
    gateway = stripe_sim.gateway()
    try:
        made = await gateway.charge(due(4))
        assert made.charge_id is not None
        await add_row(db, 4, "pending")
        settings = stripe_settings(database_url, stripe_sim)
        limited = settings.gateway.model_copy(update={"gateway_rate_limit": 1000.0})
        settings = settings.model_copy(update={"gateway": limited})
        body = stripe_event(
            "payment_intent.succeeded",
            {
                "id": made.charge_id,
                "object": "payment_intent",
                "metadata": {"order_id": "4", "billing_period": PERIOD.isoformat()},
            },
        )
        event_id = json.loads(body)["id"]
        async with running_receiver(settings) as receiver:
            answer = await receiver.post(
                body, headers={"Stripe-Signature": stripe_signature(SECRET, body)}
            )
            assert answer.status_code == 200, answer.text
            await eventually(lambda: settled(db, event_id), "the event processed")
        assert (await ledger(db, 4))["status"] == "succeeded"
        bucket = await db.fetchval("SELECT count(*) FROM rate_buckets WHERE name = 'gateway'")
        assert bucket == 1, "the re-fetch took no token from the fleet's bucket"
    finally:
        await gateway.aclose()
        await db.close()


async def foreign_intent(sim: Provider) -> str:
    """A PaymentIntent another integration made on the account: no metadata of ours."""
    async with httpx.AsyncClient(trust_env=False) as client:
        made = await client.post(
            f"{sim.url}/v1/payment_intents",
            data={
                "amount": "1500",
                "currency": "eur",
                "customer": "cus_checkout",
                "payment_method": "pm_card_checkout",
                "confirm": "true",
                "off_session": "true",
            },
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    made.raise_for_status()
    return str(made.json()["id"])


async def test_events_of_intents_without_our_metadata_are_ignored_not_retried(
    database_url: str, stripe_sim: Provider
) -> None:
    """Issue 34 item 5: Checkout's and other integrations' intents are answered 200 and
    journaled `ignored` at once; a charge or dispute naming no intent is 200 `ignored`, not
    400; a re-fetch that finds no metadata of ours is `ignored` too, final (the provider,
    not the event, says the intent is another integration's)."""
    db = await asyncpg.connect(database_url)
    try:
        foreign = await foreign_intent(stripe_sim)
        intent = stripe_event(
            "payment_intent.succeeded",
            {"id": foreign, "object": "payment_intent", "status": "succeeded", "metadata": {}},
        )
        no_intent = stripe_event(
            "charge.refunded", {"id": "ch_legacy", "object": "charge", "payment_intent": None}
        )
        dispute = stripe_event(
            "charge.dispute.created", {"id": "dp_1", "object": "dispute", "payment_intent": foreign}
        )
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            answers = [
                await receiver.post(
                    body, headers={"Stripe-Signature": stripe_signature(SECRET, body)}
                )
                for body in (intent, no_intent, dispute)
            ]
            assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
            assert answers[1].json()["ignored"] is True
            assert await status_of(db, json.loads(intent)["id"]) == "ignored"
            dispute_id = json.loads(dispute)["id"]
            await eventually(lambda: settled(db, dispute_id), "the dispute processed")
        rows = {r["event_id"]: r for r in await journal(db)}
        assert set(rows) == {json.loads(intent)["id"], dispute_id}
        assert rows[dispute_id]["status"] == "ignored"
        assert rows[dispute_id]["attempts"] == 1
    finally:
        await db.close()


async def test_a_refetched_intent_is_stamped_by_the_databases_clock(
    database_url: str, stripe_sim: Provider
) -> None:
    """Issue 34 item 7: the revision of a re-fetch is the database's clock, not a pod's
    (one that runs ahead would make every other pod's fetches stale). Pod and database
    share a clock here, so this pins where the revision comes from, not a skew."""
    db = await asyncpg.connect(database_url)
    gateway = stripe_sim.gateway()
    clock = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
    try:
        made = await gateway.charge(due(5))
        assert made.charge_id is not None
        await add_row(db, 5, "pending")
        body = stripe_event(
            "payment_intent.succeeded",
            {
                "id": made.charge_id,
                "object": "payment_intent",
                "metadata": {"order_id": "5", "billing_period": PERIOD.isoformat()},
            },
        )
        before = await db.fetchval(clock)
        async with running_receiver(stripe_settings(database_url, stripe_sim)) as receiver:
            answer = await receiver.post(
                body, headers={"Stripe-Signature": stripe_signature(SECRET, body)}
            )
            assert answer.status_code == 200, answer.text
            await eventually(lambda: settled(db, json.loads(body)["id"]), "the event processed")
        after = await db.fetchval(clock)
        row = await ledger(db, 5)
        assert row["status"] == "succeeded"
        assert before <= row["gateway_revision"] <= after
    finally:
        await gateway.aclose()
        await db.close()
