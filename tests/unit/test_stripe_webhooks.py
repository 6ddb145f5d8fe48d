"""Stripe's webhook bodies as the receiver journals them, and re-fetched objects as the
processor applies them: pure functions, no server."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from charge_worker.errors import MalformedDelivery
from charge_worker.gateway import GatewayCharge
from charge_worker.webhooks.bodies import STRIPE_REVISION, journal_entry
from charge_worker.webhooks.inbox import Job
from charge_worker.webhooks.processor import refetched

META = {"order_id": "7", "billing_period": "2026-12-01"}


def body(kind: str, obj: dict[str, Any]) -> bytes:
    event = {"id": "evt_1", "object": "event", "type": kind, "created": 1, "data": {"object": obj}}
    return json.dumps(event).encode()


@pytest.mark.parametrize(
    ("kind", "obj", "journaled_as"),
    [
        (
            "payment_intent.succeeded",
            {"id": "pi_1", "object": "payment_intent", "metadata": META},
            "charge.succeeded",
        ),
        (
            "payment_intent.payment_failed",
            {"id": "pi_1", "object": "payment_intent", "metadata": META},
            "charge.failed",
        ),
        (
            "payment_intent.processing",
            {"id": "pi_1", "object": "payment_intent", "metadata": META},
            "charge.processing",
        ),
        (
            "charge.refunded",
            {"id": "ch_1", "object": "charge", "payment_intent": "pi_1", "metadata": META},
            "charge.refunded",
        ),
        (
            "charge.dispute.created",
            {"id": "dp_1", "object": "dispute", "payment_intent": "pi_1"},
            "charge.dispute_created",
        ),
    ],
)
def test_a_stripe_event_is_journaled_under_its_payment_intent(
    kind: str, obj: dict[str, Any], journaled_as: str
) -> None:
    entry = journal_entry("gateway", "stripe", body(kind, obj), "")
    assert entry is not None
    assert (entry.event_id, entry.event_type, entry.object_id) == ("evt_1", journaled_as, "pi_1")
    assert entry.revision == STRIPE_REVISION
    if obj.get("metadata"):
        assert (entry.order_id, entry.billing_period) == (7, dt.date(2026, 12, 1))


def test_a_type_the_ledger_does_not_use_is_not_journaled() -> None:
    assert journal_entry("gateway", "stripe", body("customer.created", {"id": "cus_1"}), "") is None


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        json.dumps({"id": "evt_1", "type": "x", "created": "soon", "data": {}}).encode(),
    ],
)
def test_a_body_that_is_no_stripe_event_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedDelivery):
        journal_entry("gateway", "stripe", raw, "")


def test_a_refetched_object_replaces_the_events_state_and_names_the_key() -> None:
    job = Job(1, "gateway", "evt_1", "charge.refunded", "pi_1", 1, None, None, "", 1, 0.0)
    charge = GatewayCharge(
        "pi_1", "succeeded", 990, "EUR", "cus_1", "7", "2026-12-01", 0, 990, refunded=True
    )
    first = refetched(job, charge, revision=1_796_000_000_000_000)
    later = refetched(job, charge, revision=1_796_000_000_000_001)

    assert (first.object_status, first.refunded, first.amount_refunded) == ("succeeded", True, 990)
    assert first.key == (7, dt.date(2026, 12, 1))
    # the moment of the fetch, as the database's clock read it (never the pod's)
    assert (first.revision, later.revision) == (1_796_000_000_000_000, 1_796_000_000_000_001)


def test_an_intent_without_our_metadata_is_journaled_ignored() -> None:
    """Issue 34 item 5: Checkout's, Billing's, other integrations' intents."""
    raw = body("payment_intent.succeeded", {"id": "pi_2", "object": "payment_intent"})
    entry = journal_entry("gateway", "stripe", raw, "")
    assert entry is not None
    assert (entry.object_id, entry.status) == ("pi_2", "ignored")


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "ch_1", "object": "charge"},
        {"id": "dp_1", "object": "dispute", "payment_intent": None},
    ],
)
def test_a_charge_or_dispute_naming_no_intent_is_not_journaled(obj: dict[str, Any]) -> None:
    """Issue 34 item 5: answered 200 `ignored`, not 400 (Stripe retries a 4xx for days)."""
    kind = "charge.refunded" if obj["object"] == "charge" else "charge.dispute.created"
    assert journal_entry("gateway", "stripe", body(kind, obj), "") is None
