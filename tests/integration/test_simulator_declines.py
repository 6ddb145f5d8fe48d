"""The gateway simulator's declines over real HTTP, both flavours: each try's code by
customer and try (`sandbox/gateway/cards.py`), the contract's 402 form, every try's charge in
a lookup and in `GET /_sim/charges`."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.support.providers import API_KEY, Provider, provider

PERIOD = "2026-09-01"


@pytest.fixture
def contract() -> Iterator[Provider]:
    with provider("contract") as served:
        yield served


@pytest.fixture
def stripe() -> Iterator[Provider]:
    with provider("stripe") as served:
        yield served


@pytest.fixture
async def client(contract: Provider) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=contract.url, headers=headers, timeout=10) as client:
        yield client


async def charge(
    client: httpx.AsyncClient, order_id: int, customer: str, attempt: int = 1
) -> httpx.Response:
    """Try `attempt` of the period as the contract adapter sends it."""
    metadata = {"order_id": str(order_id), "billing_period": PERIOD}
    key = f"{order_id}:{PERIOD}"
    if attempt > 1:
        metadata["attempt"] = str(attempt)
        key += f":{attempt}"
    body = {"amount": 1000, "currency": "EUR", "customer": customer, "metadata": metadata}
    return await client.post("/v1/charges", json=body, headers={"Idempotency-Key": key})


@pytest.mark.parametrize(
    ("customer", "code"),
    [
        ("cus_decline_1", "generic_decline"),
        ("cus_auth_1", "authentication_required"),
        ("cus_code_insufficient_funds_1", "insufficient_funds"),
        ("cus_code_stolen_card_1", "stolen_card"),
        ("cus_code_expired_card", "expired_card"),
        ("cus_soft_1", "insufficient_funds"),
    ],
)
async def test_a_decline_answers_the_contracts_402_and_keeps_its_code_on_the_charge(
    client: httpx.AsyncClient, customer: str, code: str
) -> None:
    answer = await charge(client, 1, customer)
    again = await charge(client, 1, customer)

    assert answer.status_code == 402
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["decline_code"]) == (
        "card_error",
        "card_declined",
        code,
    )
    assert error["message"]
    assert (again.status_code, again.json(), again.headers["Idempotent-Replayed"]) == (
        402,
        answer.json(),
        "true",
    )
    listed = await client.get("/v1/charges", params={"order_id": "1", "billing_period": PERIOD})
    [found] = listed.json()["data"]
    assert (found["id"], found["status"], found["decline_code"]) == (
        error["charge"],
        "failed",
        code,
    )


async def test_a_charged_one_carries_no_decline_code(client: httpx.AsyncClient) -> None:
    answer = await charge(client, 1, "cus_ok")
    assert answer.status_code == 200
    assert "decline_code" not in answer.json()


async def test_a_cus_soft_k_card_is_declined_softly_until_try_k_then_charged(
    contract: Provider, client: httpx.AsyncClient
) -> None:
    answers = [await charge(client, 5, "cus_soft3_5", attempt) for attempt in (1, 2, 3)]

    assert [a.status_code for a in answers] == [402, 402, 200]
    assert [a.json()["error"]["decline_code"] for a in answers[:2]] == ["insufficient_funds"] * 2
    assert answers[2].json()["metadata"]["attempt"] == "3"
    listed = await client.get("/v1/charges", params={"order_id": "5", "billing_period": PERIOD})
    shown = [
        (c["metadata"].get("attempt", "1"), c["status"], c.get("decline_code"))
        for c in listed.json()["data"]
    ]
    assert shown == [
        ("1", "failed", "insufficient_funds"),
        ("2", "failed", "insufficient_funds"),
        ("3", "succeeded", None),
    ]
    assert await captured_per_period(contract) == {f"5:{PERIOD}": 1}


async def test_the_succeeds_on_try_knob_makes_any_customers_card_succeed_on_that_try(
    contract: Provider, client: httpx.AsyncClient
) -> None:
    await contract.configure(succeeds_on_try={"cus_plain_7": 2})

    first, second = [await charge(client, 7, "cus_plain_7", attempt) for attempt in (1, 2)]
    other = await charge(client, 8, "cus_plain_8")

    assert (first.status_code, first.json()["error"]["decline_code"]) == (
        402,
        "insufficient_funds",
    )
    assert (second.status_code, other.status_code) == (200, 200)


async def test_sim_charges_shows_each_trys_metadata_so_money_is_counted_per_period(
    contract: Provider, client: httpx.AsyncClient
) -> None:
    await contract.configure(idempotency_enabled=False)  # a gateway that charges twice
    await charge(client, 9, "cus_soft2_9", 1)
    await charge(client, 9, "cus_soft2_9", 2)
    await charge(client, 9, "cus_soft2_9", 3)  # a second capture of the period, another key

    charges = await contract.charges()

    assert [(c["idempotency_key"], c["metadata"].get("attempt")) for c in charges] == [
        (f"9:{PERIOD}", None),
        (f"9:{PERIOD}:2", "2"),
        (f"9:{PERIOD}:3", "3"),
    ]
    assert await contract.made() == {f"9:{PERIOD}:2": 1, f"9:{PERIOD}:3": 1}  # per key: no double
    assert await captured_per_period(contract) == {f"9:{PERIOD}": 2}  # per period: a double


async def test_the_stripe_flavour_declines_by_customer_and_metadata_attempt(
    stripe: Provider,
) -> None:
    async def create(order_id: int, customer: str, attempt: int) -> httpx.Response:
        form: dict[str, Any] = {
            "amount": "1000",
            "currency": "eur",
            "customer": customer,
            "payment_method": f"pm_card_{customer.removeprefix('cus_')}",
            "confirm": "true",
            "off_session": "true",
            "metadata[order_id]": str(order_id),
            "metadata[billing_period]": PERIOD,
        }
        key = f"{order_id}:{PERIOD}"
        if attempt > 1:
            form["metadata[attempt]"] = str(attempt)
            key += f":{attempt}"
        headers = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": key}
        async with httpx.AsyncClient(base_url=stripe.url, timeout=10) as http:
            return await http.post("/v1/payment_intents", data=form, headers=headers)

    declined = await create(3, "cus_soft2_3", 1)
    charged = await create(3, "cus_soft2_3", 2)
    expired = await create(4, "cus_code_expired_card_4", 1)

    error = declined.json()["error"]
    assert (declined.status_code, error["code"], error["decline_code"]) == (
        402,
        "card_declined",
        "insufficient_funds",
    )
    last = error["payment_intent"]["last_payment_error"]
    assert (last["code"], last["decline_code"]) == ("card_declined", "insufficient_funds")
    assert (charged.status_code, charged.json()["status"]) == (200, "succeeded")
    assert charged.json()["metadata"]["attempt"] == "2"
    # a reason Stripe names by a code of its own
    assert (expired.json()["error"]["code"], expired.json()["error"]["decline_code"]) == (
        "expired_card",
        "expired_card",
    )
    shown = [(c["metadata"].get("attempt"), c["status"]) for c in await stripe.charges()]
    assert shown == [(None, "failed"), ("2", "succeeded"), (None, "failed")]


async def captured_per_period(sim: Provider) -> Counter[str]:
    """Charges that took money, per period across every try's key (as the chaos checker
    counts them)."""
    return Counter(
        f"{c['metadata']['order_id']}:{c['metadata']['billing_period']}"
        for c in await sim.charges()
        if c["status"] == "succeeded"
    )
