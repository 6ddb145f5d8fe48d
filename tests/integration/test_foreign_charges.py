"""A charge someone else made with our metadata is never taken for the period's payment.

The worker looks a key up before sending again (a lost answer, a lease taken over). What
it finds is found by the `order_id`/`billing_period` metadata alone, and anyone with the
account's key can set that metadata: a support agent's manual charge, another
integration's, a verification charge of 1. Only a charge with the period's fingerprint
(amount, currency, customer) is the period's; any other is reported and the due charge
goes ahead (issue 34, item 2). The gateway is an httpx.MockTransport answering the lookup
with such a charge; the ledger is the real PostgreSQL one.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import SecretStr

from charge_worker.gateway.contract import ContractGateway
from charge_worker.ledger import Attempted, Ledger
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings
from charge_worker.worker.decisions import Outcome
from tests.support.pipelines import process_once

LEASE_S = 60.0
CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 7101,
        "billing_period": dt.date(2026, 12, 1),
        "subscription_id": "sub_7101",
        "customer_id": "cus_7101",
        "amount_minor": 99000,
        "currency": "EUR",
        "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    },
    strict=False,
)
METADATA = {"order_id": "7101", "billing_period": "2026-12-01"}


async def an_answer_was_lost(pool: asyncpg.Pool) -> None:
    """Another worker claimed the charge, called the gateway and lost the answer."""
    ledger = Ledger(pool, lease_s=LEASE_S)
    claim = await ledger.claim(CHARGE, "worker-0", stream_seq=1)
    await ledger.retry_later(claim, "timeout", keep_lease=False, attempted=Attempted(calls=1))


def charge_object(charge_id: str, status: str = "succeeded", **fields: Any) -> dict[str, Any]:
    return {
        "id": charge_id,
        "status": status,
        "amount": CHARGE.amount_minor,
        "currency": CHARGE.currency,
        "customer": CHARGE.customer_id,
        "metadata": METADATA,
        "created": 1_796_000_000,
        **fields,
    }


class Gateway:
    """Answers the lookup with `found`; charges (once) when asked."""

    def __init__(self, *found: dict[str, Any]) -> None:
        self.found = list(found)
        self.charged: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": self.found, "has_more": False})
        self.charged.append(request.headers["Idempotency-Key"])
        return httpx.Response(200, json=charge_object("ch_ours"))

    def adapter(self) -> ContractGateway:
        cfg = GatewaySettings(url="http://127.0.0.1:9", api_key=SecretStr("key"))
        return ContractGateway(cfg, transport=httpx.MockTransport(self.handle))


@pytest.mark.parametrize(
    "foreign",
    [
        {"amount": 100},  # a verification charge
        {"customer": "cus_someone_else"},  # another customer's, with our order's metadata
        {"currency": "USD"},
    ],
    ids=["amount", "customer", "currency"],
)
async def test_a_foreign_charge_found_by_lookup_is_not_recorded_and_the_due_charge_is_made(
    pool: asyncpg.Pool, foreign: dict[str, Any]
) -> None:
    await an_answer_was_lost(pool)
    gateway = Gateway(charge_object("ch_foreign", **foreign))

    done = await process_once(pool, gateway.adapter(), CHARGE.to_json(), lease_s=LEASE_S)

    assert done.result.outcome is Outcome.CHARGED, done.result
    assert done.settlement is not None
    assert done.settlement.charge_id == "ch_ours"
    assert gateway.charged == [CHARGE.key]
    assert done.notes["unmatched"] == ["ch_foreign"]


async def test_a_foreign_decline_found_by_lookup_does_not_decline_the_period(
    pool: asyncpg.Pool,
) -> None:
    await an_answer_was_lost(pool)
    gateway = Gateway(charge_object("ch_foreign", status="failed", amount=100))

    done = await process_once(pool, gateway.adapter(), CHARGE.to_json(), lease_s=LEASE_S)

    assert done.result.outcome is Outcome.CHARGED, done.result
    assert gateway.charged == [CHARGE.key]


async def test_our_own_charge_found_by_lookup_is_recorded_without_charging_again(
    pool: asyncpg.Pool,
) -> None:
    """The control: a charge with the period's fingerprint is the lost answer."""
    await an_answer_was_lost(pool)
    gateway = Gateway(charge_object("ch_lost"), charge_object("ch_foreign", amount=100))

    done = await process_once(pool, gateway.adapter(), CHARGE.to_json(), lease_s=LEASE_S)

    assert done.result.outcome is Outcome.CHARGED, done.result
    assert done.settlement is not None
    assert done.settlement.charge_id == "ch_lost"
    assert gateway.charged == []
    assert done.notes["unmatched"] == ["ch_foreign"]
