"""Tries of a period on the wire (docs/contracts/gateway.md, "Retrying a declined renewal"):
each try's key and `metadata.attempt` as both adapters send them, and every try's charges as
their lookups read them; over httpx.MockTransport."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
from pydantic import SecretStr

from charge_worker.gateway import ContractGateway
from charge_worker.gateway.stripe import StripeGateway
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings

PERIOD = dt.date(2026, 9, 1)
META = {"order_id": "48291", "billing_period": "2026-09-01"}
CUSTOMER = {
    "id": "cus_42",
    "object": "customer",
    "invoice_settings": {"default_payment_method": "pm_1"},
}


def due(attempt: int) -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": 48291,
            "billing_period": PERIOD,
            "subscription_id": "sub_7Q2",
            "customer_id": "cus_42",
            "amount_minor": 99000,
            "currency": "EUR",
            "due_at": dt.datetime(2026, 9, 1, tzinfo=dt.UTC),
            "attempt": attempt,
        },
        strict=False,
    )


def contract(seen: list[httpx.Request], answer: dict[str, Any], **cfg: Any) -> ContractGateway:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer)

    settings = GatewaySettings(url="http://127.0.0.1", api_key=SecretStr("sk_test_x"), **cfg)
    return ContractGateway(settings, transport=httpx.MockTransport(handler))


def stripe(seen: list[httpx.Request], answer: dict[str, Any], **cfg: Any) -> StripeGateway:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/customers/"):
            return httpx.Response(200, json=CUSTOMER)
        seen.append(request)
        return httpx.Response(200, json=answer)

    settings = GatewaySettings(
        kind="stripe", url="http://127.0.0.1", api_key=SecretStr("sk_test_x"), **cfg
    )
    return StripeGateway(settings, transport=httpx.MockTransport(handler))


def charge_json(charge_id: str, status: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": charge_id,
        "status": status,
        "amount": 99000,
        "currency": "EUR",
        "customer": "cus_42",
        "metadata": META,
        "created": 1_788_000_000,
        **fields,
    }


def intent_json(intent_id: str, status: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": intent_id,
        "object": "payment_intent",
        "amount": 99000,
        "currency": "eur",
        "customer": "cus_42",
        "status": status,
        "metadata": META,
        "created": 1_788_000_000,
        "latest_charge": {"id": "ch_" + intent_id, "amount_refunded": 0, "refunded": False},
        **fields,
    }


@pytest.mark.parametrize(
    ("attempt", "key", "metadata"),
    [
        (1, "48291:2026-09-01", META),  # as before retries: no `attempt`
        (2, "48291:2026-09-01:2", META | {"attempt": "2"}),
        (5, "48291:2026-09-01:5", META | {"attempt": "5"}),
    ],
)
async def test_the_contract_adapter_sends_each_try_under_its_key_with_its_attempt(
    attempt: int, key: str, metadata: dict[str, str]
) -> None:
    seen: list[httpx.Request] = []
    gw = contract(seen, charge_json("ch_1", "succeeded"))
    await gw.charge(due(attempt))
    await gw.aclose()

    [request] = seen
    assert request.headers["Idempotency-Key"] == key
    assert json.loads(request.content)["metadata"] == metadata


@pytest.mark.parametrize(
    ("attempt", "key", "attempt_field"),
    [(1, "48291:2026-09-01", None), (3, "48291:2026-09-01:3", "3")],
)
async def test_the_stripe_adapter_sends_each_try_under_its_key_with_its_attempt(
    attempt: int, key: str, attempt_field: str | None
) -> None:
    seen: list[httpx.Request] = []
    gw = stripe(seen, intent_json("pi_1", "succeeded"))
    await gw.charge(due(attempt))
    await gw.aclose()

    [request] = seen
    sent = dict(parse_qsl(request.content.decode()))
    assert request.headers["Idempotency-Key"] == key
    assert sent.get("metadata[attempt]") == attempt_field
    assert (sent["metadata[order_id]"], sent["metadata[billing_period]"]) == ("48291", "2026-09-01")


@pytest.mark.parametrize("adapter", [contract, stripe])
async def test_the_key_prefix_is_added_once_to_a_later_trys_key(adapter: Any) -> None:
    seen: list[httpx.Request] = []
    answer = (
        charge_json("ch_1", "succeeded")
        if adapter is contract
        else intent_json("pi_1", "succeeded")
    )
    gw = adapter(seen, answer, idempotency_key_prefix="acme:")
    await gw.charge(due(2))
    await gw.aclose()
    assert seen[0].headers["Idempotency-Key"] == "acme:48291:2026-09-01:2"


async def test_a_contract_lookup_reads_every_trys_charge_with_its_attempt_and_decline() -> None:
    listed = {
        "data": [
            charge_json("ch_1", "failed", decline_code="insufficient_funds"),
            charge_json("ch_2", "failed", metadata=META | {"attempt": "2"}),  # no code said
            charge_json("ch_3", "succeeded", metadata=META | {"attempt": "3"}),
        ],
        "has_more": False,
    }
    gw = contract([], listed)
    found = await gw.lookup(48291, PERIOD)
    await gw.aclose()

    assert [(c.id, c.status, c.attempt, c.decline_code) for c in found] == [
        ("ch_1", "failed", 1, "insufficient_funds"),
        ("ch_2", "failed", 2, None),
        ("ch_3", "succeeded", 3, None),
    ]


async def test_a_stripe_lookup_reads_every_trys_intent_with_its_attempt_and_decline() -> None:
    declined = {"type": "card_error", "code": "card_declined", "decline_code": "do_not_honor"}
    expired = {"type": "card_error", "code": "expired_card"}
    listed = {
        "object": "list",
        "data": [  # newest first, as Stripe lists
            intent_json("pi_3", "succeeded", metadata=META | {"attempt": "3"}),
            intent_json(
                "pi_2",
                "requires_payment_method",
                metadata=META | {"attempt": "2"},
                last_payment_error=expired,
            ),
            intent_json("pi_1", "requires_payment_method", last_payment_error=declined),
        ],
        "has_more": False,
    }
    gw = stripe([], listed)
    found = await gw.lookup(48291, PERIOD, customer_id="cus_42")
    await gw.aclose()

    assert [(c.id, c.status, c.attempt, c.decline_code) for c in found] == [
        ("pi_1", "failed", 1, "do_not_honor"),
        ("pi_2", "failed", 2, "expired_card"),
        ("pi_3", "succeeded", 3, None),
    ]
