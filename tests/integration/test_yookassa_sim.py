"""The gateway simulator's YooKassa flavour over real HTTP: each answer of the YooKassa API v3
subset charge-worker speaks (payments, their list, refunds, notifications), and the faults
every flavour shares."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.gateway.config import ENDPOINTS
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.serve import ServedApp
from tests.support.harness import eventually

AUTH = httpx.BasicAuth("100500", "test_sandbox")  # the sandbox's shop id and secret key
PERIOD = "2026-09-01"


@pytest.fixture(scope="module")
def served() -> Iterator[ServedApp]:
    with ServedApp(build_gateway_app(GatewayConfig(flavour="yookassa", seed=7))) as served:
        yield served


@pytest.fixture
def gateway(served: ServedApp) -> ServedApp:
    """The module's simulator, reset: no payments, keys, deliveries; the knobs it began with."""
    httpx.post(f"{served.url}/_sim/reset", trust_env=False).raise_for_status()
    return served


@pytest.fixture
async def client(gateway: ServedApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, auth=AUTH, timeout=10) as client:
        yield client


def payment_body(
    order_id: str = "48291",
    *,
    value: Any = "990.00",
    currency: str = "RUB",
    method: str = "pm_42",
    attempt: int = 1,
) -> dict[str, Any]:
    metadata = {"order_id": order_id, "billing_period": PERIOD}
    if attempt > 1:
        metadata["attempt"] = str(attempt)
    return {
        "amount": {"value": value, "currency": currency},
        "capture": True,
        "payment_method_id": method,
        "description": f"Renewal {order_id} {PERIOD}",
        "metadata": metadata,
    }


def key_of(body: dict[str, Any]) -> str:
    metadata = body["metadata"]
    key = f"{metadata['order_id']}:{metadata['billing_period']}"
    return key + (f":{metadata['attempt']}" if "attempt" in metadata else "")


async def pay(
    client: httpx.AsyncClient,
    body: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    client_timeout_s: float | None = None,
) -> httpx.Response:
    body = body or payment_body()
    headers = {"Idempotence-Key": key or key_of(body)}
    timeout = client_timeout_s if client_timeout_s is not None else 10.0
    return await client.post("/v3/payments", json=body, headers=headers, timeout=timeout)


async def refund(
    client: httpx.AsyncClient, payment_id: str, value: str = "990.00", *, key: str | None = None
) -> httpx.Response:
    body = {
        "payment_id": payment_id,
        "amount": {"value": value, "currency": "RUB"},
        "description": "duplicate",
    }
    headers = {"Idempotence-Key": key or f"refund:{payment_id}"}
    return await client.post("/v3/refunds", json=body, headers=headers)


async def configure(client: httpx.AsyncClient, **knobs: Any) -> dict[str, Any]:
    response = await client.post("/_sim/config", json=knobs)
    assert response.status_code == 200, response.text
    config: dict[str, Any] = response.json()
    return config


async def sim_charges(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await client.get("/_sim/charges")).json()["data"]
    return data


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    answer: dict[str, Any] = (await client.get("/_sim/stats")).json()
    return answer


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The YooKassa error body, checked for its shape, status and code."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()
    assert error["type"] == "error"
    assert error["code"] == code
    assert isinstance(error["description"], str)
    assert error["description"]
    assert len(error["id"]) == 36  # a UUID
    assert set(error) <= {"type", "id", "code", "description", "parameter"}
    return error


def instant(text: str) -> datetime:
    return datetime.fromisoformat(text)


# --- POST /v3/payments: "Create a payment" (an autopayment with a saved method) ------------


async def test_a_payment_succeeds(client: httpx.AsyncClient) -> None:
    """The payment object of YooKassa's "Create a payment": succeeded, paid, captured,
    money as decimal strings, timestamps ISO 8601 UTC with milliseconds."""
    before = time.time()
    response = await pay(client)

    assert response.status_code == 200
    payment = response.json()
    assert payment == {
        "id": payment["id"],
        "status": "succeeded",
        "paid": True,
        "amount": {"value": "990.00", "currency": "RUB"},
        "income_amount": {"value": "955.35", "currency": "RUB"},
        "description": "Renewal 48291 2026-09-01",
        "recipient": {"account_id": "100500", "gateway_id": "100700"},
        "payment_method": {
            "type": "bank_card",
            "id": "pm_42",
            "saved": True,
            "title": "Bank card *4444",
        },
        "captured_at": payment["captured_at"],
        "created_at": payment["created_at"],
        "test": True,
        "refunded_amount": {"value": "0.00", "currency": "RUB"},
        "refundable": True,
        "metadata": {"order_id": "48291", "billing_period": PERIOD},
    }
    assert len(payment["id"]) == 36
    for stamp in (payment["created_at"], payment["captured_at"]):
        assert len(stamp) == len("2026-12-01T03:00:00.456Z")
        assert stamp.endswith("Z")
        assert instant(stamp).timestamp() >= int(before)
    [recorded] = await sim_charges(client)
    assert {name: recorded[name] for name in ("id", "status", "amount", "customer")} == {
        "id": payment["id"],
        "status": "succeeded",
        "amount": 99000,
        "customer": "pm_42",
    }
    assert (recorded["idempotency_key"], recorded["metadata"]) == (
        "48291:2026-09-01",
        payment["metadata"],
    )


@pytest.mark.parametrize(
    ("value", "currency", "minor"),
    [("990.00", "RUB", 99000), ("1990", "JPY", 1990), ("12.345", "KWD", 12345)],
)
async def test_amounts_have_the_currencys_exponent_and_are_kept_in_minor_units(
    client: httpx.AsyncClient, value: str, currency: str, minor: int
) -> None:
    """YooKassa's amount: `value` with exactly the ISO 4217 exponent's digits."""
    response = await pay(client, payment_body(value=value, currency=currency))

    assert response.json()["amount"] == {"value": value, "currency": currency}
    assert [c["amount"] for c in await sim_charges(client)] == [minor]


def _with(**fields: Any) -> dict[str, Any]:
    return payment_body() | fields


def _without(name: str) -> dict[str, Any]:
    body = payment_body()
    del body[name]
    return body


async def test_a_payment_without_metadata_is_another_integrations_and_is_made(
    client: httpx.AsyncClient,
) -> None:
    """`metadata` is optional in "Create a payment": a shop's other integrations may send
    none, and YooKassa makes their payments all the same."""
    response = await client.post(
        "/v3/payments", json=_without("metadata"), headers={"Idempotence-Key": "theirs:1"}
    )
    assert response.status_code == 200, response.text
    assert (response.json()["status"], response.json()["metadata"]) == ("succeeded", {})


@pytest.mark.parametrize(
    ("body", "parameter"),
    [
        (_without("amount"), "amount"),
        (payment_body(value="990"), "amount.value"),
        (payment_body(value="990.0"), "amount.value"),
        (payment_body(value=990.0), "amount.value"),
        (payment_body(value="990.00", currency="JPY"), "amount.value"),
        (payment_body(value="1.50", currency="KWD"), "amount.value"),
        (payment_body(value="0.00"), "amount.value"),
        (payment_body(value="-1.00"), "amount.value"),
        (payment_body(currency="XXX"), "amount.currency"),
        (_with(amount={"value": "990.00"}), "amount"),
        (_with(capture=False), "capture"),
        (_without("capture"), "capture"),
        (_without("payment_method_id"), "payment_method_id"),
        (_with(payment_method_id=""), "payment_method_id"),
        (_with(payment_method_id=42), "payment_method_id"),
        (_with(metadata={"order_id": 48291, "billing_period": PERIOD}), "metadata.order_id"),
        (_with(metadata="48291"), "metadata"),
        (_with(description="x" * 129), "description"),
        (_with(confirmation={"type": "redirect"}), "confirmation"),
        ([1, 2], None),
    ],
)
async def test_an_invalid_payment_is_400_naming_the_parameter_and_not_kept(
    client: httpx.AsyncClient, body: Any, parameter: str | None
) -> None:
    """ "Create a payment" refuses a bad parameter with `400 invalid_request` and its name;
    nothing is charged and the key is not kept."""
    response = await client.post("/v3/payments", json=body, headers={"Idempotence-Key": "k:1"})

    assert error_of(response, 400, "invalid_request").get("parameter") == parameter
    assert await sim_charges(client) == []
    assert (await pay(client, key="k:1")).status_code == 200


async def test_a_body_that_is_not_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v3/payments", content=b"amount=1", headers={"Idempotence-Key": "k:1"}
    )
    error_of(response, 400, "invalid_request")


@pytest.mark.parametrize("key", [None, "", "k" * 65])
async def test_the_idempotence_key_is_required_and_at_most_64_characters(
    client: httpx.AsyncClient, key: str | None
) -> None:
    """YooKassa's idempotence: the `Idempotence-Key` header, at most 64 characters."""
    headers = {} if key is None else {"Idempotence-Key": key}
    response = await client.post("/v3/payments", json=payment_body(), headers=headers)

    assert error_of(response, 400, "invalid_request")["parameter"] == "Idempotence-Key"
    assert await sim_charges(client) == []
    assert (await pay(client, key="k" * 64)).status_code == 200


# --- declines: "cancellation_details" of a canceled payment --------------------------------


@pytest.mark.parametrize(
    ("method", "party", "reason"),
    [
        ("cus_decline_1", "payment_network", "general_decline"),
        ("cus_auth_1", "payment_network", "3d_secure_failed"),
        ("cus_code_insufficient_funds_1", "payment_network", "insufficient_funds"),
        ("cus_code_card_expired_1", "payment_network", "card_expired"),
        ("cus_code_fraud_suspected_1", "yoo_kassa", "fraud_suspected"),
        ("cus_soft_1", "payment_network", "insufficient_funds"),
    ],
)
async def test_a_decline_is_a_canceled_payment_with_its_cancellation_details(
    client: httpx.AsyncClient, method: str, party: str, reason: str
) -> None:
    """A declined autopayment: `200`, `status: canceled`, `cancellation_details {party,
    reason}`; recorded `failed` with the reason, and replayed as any answer."""
    body = payment_body(method=method)
    response = await pay(client, body)
    again = await pay(client, body)

    assert response.status_code == 200
    payment = response.json()
    assert (payment["status"], payment["paid"], payment["refundable"]) == ("canceled", False, False)
    assert payment["cancellation_details"] == {"party": party, "reason": reason}
    assert "captured_at" not in payment
    assert "income_amount" not in payment
    assert (again.status_code, again.json()) == (200, payment)
    [recorded] = await sim_charges(client)
    assert (recorded["status"], recorded["decline_code"], recorded["customer"]) == (
        "failed",
        reason,
        method,
    )


async def test_a_soft_decline_succeeds_on_the_try_metadata_attempt_names(
    client: httpx.AsyncClient,
) -> None:
    """`cus_soft<k>…` and the `succeeds_on_try` knob read the try from `metadata.attempt`."""
    await configure(client, succeeds_on_try={"pm_knob": 3})
    answers = {
        (method, attempt): (
            await pay(client, payment_body(method, method=method, attempt=attempt))
        ).json()["status"]
        for method in ("cus_soft2_1", "pm_knob")
        for attempt in (1, 2, 3)
    }

    assert answers == {
        ("cus_soft2_1", 1): "canceled",
        ("cus_soft2_1", 2): "succeeded",
        ("cus_soft2_1", 3): "succeeded",
        ("pm_knob", 1): "canceled",
        ("pm_knob", 2): "canceled",
        ("pm_knob", 3): "succeeded",
    }


# --- idempotence ----------------------------------------------------------------------------


async def test_same_key_and_body_replay_the_first_answer_without_a_header(
    client: httpx.AsyncClient,
) -> None:
    """YooKassa's idempotence: the same key and body answer the first status and body."""
    first = await pay(client)
    again = await pay(client)

    assert (again.status_code, again.json()) == (200, first.json())
    assert not {name for name in again.headers if "replay" in name.lower()}
    assert len(await sim_charges(client)) == 1


async def test_same_key_other_body_is_idempotence_key_duplicated(
    client: httpx.AsyncClient,
) -> None:
    await pay(client)
    response = await pay(client, payment_body(value="1.00"), key="48291:2026-09-01")

    error = error_of(response, 400, "invalid_request")
    assert error["parameter"] == "Idempotence-Key"
    assert error["description"].startswith("Idempotence key duplicated")
    assert len(await sim_charges(client)) == 1


async def test_a_key_still_executing_answers_202_processing(client: httpx.AsyncClient) -> None:
    """YooKassa's `202 {"type": "processing", "retry_after": <ms>}` for a key in progress."""
    await configure(client, endpoint_latency={"POST /v3/payments": {"fixed_s": 0.5}})

    first, second = await asyncio.gather(pay(client), pay(client))

    by_status = {r.status_code: r for r in (first, second)}
    assert sorted(by_status) == [200, 202]
    assert by_status[202].json() == {
        "type": "processing",
        "description": "Request accepted",
        "retry_after": 1000,
    }
    later = await pay(client)
    assert later.json() == by_status[200].json()
    assert len(await sim_charges(client)) == 1


async def test_an_expired_key_pays_anew(client: httpx.AsyncClient) -> None:
    await configure(client, key_retention_s=0.2)
    first = (await pay(client)).json()

    async def paid_anew() -> bool:
        return bool((await pay(client)).json()["id"] != first["id"])

    await eventually(paid_anew, "the key expired")
    assert len({c["id"] for c in await sim_charges(client)}) >= 2


async def test_without_idempotency_every_request_pays(client: httpx.AsyncClient) -> None:
    await configure(client, idempotency_enabled=False)

    first, second = (await pay(client)).json(), (await pay(client)).json()

    assert first["id"] != second["id"]
    assert [c["idempotency_key"] for c in await sim_charges(client)] == ["48291:2026-09-01"] * 2


# --- pending: "payment.status pending", settled later ----------------------------------------


class Receiver:
    """A notification endpoint: keeps each body and its headers; answers `statuses` in turn,
    then 200."""

    def __init__(self, *statuses: int) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses = list(statuses)
        self.app = Starlette(routes=[Route("/hooks", self.receive, methods=["POST"])])

    async def receive(self, request: Request) -> Response:
        self.bodies.append(json.loads(await request.body()))
        self.headers.append(dict(request.headers))
        return Response(status_code=self.statuses.pop(0) if self.statuses else 200)

    def events(self) -> list[str]:
        return [body["event"] for body in self.bodies]


async def test_a_pending_payment_succeeds_later_and_notifies_then(
    client: httpx.AsyncClient,
) -> None:
    """`status: pending` (the bank is working) settles `processing_settle_s` later to
    succeeded; `payment.succeeded` is sent then, none for the pending state."""
    receiver = Receiver()
    with ServedApp(receiver.app) as hooks:
        await configure(client, webhook_url=f"{hooks.url}/hooks", processing_settle_s=0.3)
        pending = (await pay(client, payment_body(method="cus_processing_1"))).json()
        assert (pending["status"], pending["paid"]) == ("pending", False)
        assert "captured_at" not in pending
        assert [c["status"] for c in await sim_charges(client)] == ["processing"]

        await eventually(lambda: receiver.events() == ["payment.succeeded"], "settled")

    settled = (await client.get(f"/v3/payments/{pending['id']}")).json()
    assert (settled["status"], settled["paid"]) == ("succeeded", True)
    assert instant(settled["captured_at"]) >= instant(settled["created_at"])
    assert receiver.bodies[0]["object"] == settled
    assert (await pay(client, payment_body(method="cus_processing_1"))).json() == pending
    assert [c["status"] for c in await sim_charges(client)] == ["succeeded"]


# --- faults every flavour shares ---------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer sk_test_sandbox", "Basic " + base64.b64encode(b"100500:wrong").decode(), "x"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v3/payments"),
        ("GET", "/v3/payments"),
        ("GET", "/v3/payments/abc"),
        ("POST", "/v3/refunds"),
    ],
)
async def test_without_the_shops_credentials_every_request_is_401(
    gateway: ServedApp, authorization: str | None, method: str, path: str
) -> None:
    """YooKassa's HTTP Basic auth (shop id, secret key): `401 invalid_credentials`."""
    headers = {"Idempotence-Key": "48291:2026-09-01"}
    if authorization is not None:
        headers["Authorization"] = authorization
    async with httpx.AsyncClient(base_url=gateway.url) as anonymous:
        response = await anonymous.request(method, path, json=payment_body(), headers=headers)
        error_of(response, 401, "invalid_credentials")
        assert (await anonymous.get("/_sim/charges")).json() == {"data": []}


async def test_too_many_requests_carries_retry_after(client: httpx.AsyncClient) -> None:
    await configure(client, error_rates={"429": 1.0}, retry_after_s=3)

    response = await pay(client)

    error_of(response, 429, "too_many_requests")
    assert response.headers["Retry-After"] == "3"
    assert await sim_charges(client) == []


async def test_over_the_rate_limit_is_429(client: httpx.AsyncClient) -> None:
    await configure(client, rate_limit_per_s=0.01)  # one request, then one per 100 s

    first, second = await pay(client), await pay(client, payment_body("2"))

    assert first.status_code == 200
    error_of(second, 429, "too_many_requests")
    assert (await stats(client))["rate_limited"] == 1


@pytest.mark.parametrize("status", [500, 503])
async def test_an_injected_5xx_records_nothing(client: httpx.AsyncClient, status: int) -> None:
    await configure(client, error_rates={str(status): 1.0})

    error_of(await pay(client), status, "internal_server_error")

    assert await sim_charges(client) == []
    await configure(client, error_rates={})
    assert (await pay(client)).status_code == 200


async def test_a_lost_answer_as_500_still_paid(client: httpx.AsyncClient) -> None:
    """`500 internal_server_error`: an unknown outcome; the same key and body answer it."""
    await configure(client, lost_answer_rate=1.0, lost_answer_mode="5xx")

    error_of(await pay(client), 500, "internal_server_error")

    [recorded] = await sim_charges(client)
    await configure(client, lost_answer_rate=0.0)
    retry = await pay(client)
    assert (retry.status_code, retry.json()["id"]) == (200, recorded["id"])
    assert (await stats(client))["lost_answers"] == 1


async def test_a_lost_answer_by_timeout_still_paid(client: httpx.AsyncClient) -> None:
    await configure(client, lost_answer_rate=1.0, lost_answer_mode="timeout")

    with pytest.raises(httpx.ReadTimeout):
        await pay(client, client_timeout_s=0.3)

    [recorded] = await sim_charges(client)
    await configure(client, lost_answer_rate=0.0)
    assert (await pay(client)).json()["id"] == recorded["id"]


def test_endpoint_latency_takes_the_yookassa_endpoints_alone() -> None:
    slow, fast = LatencyModel.fixed(5.5), LatencyModel.fixed(0.2)
    config = GatewayConfig(
        flavour="yookassa", latency=fast, endpoint_latency={"GET /v3/payments/{id}": slow}
    )
    sim = build_gateway_app(config).state.sim

    assert sim.latency_of("GET /v3/payments/{id}") == slow
    assert sim.latency_of("POST /v3/payments") == fast
    with pytest.raises(ValidationError, match="endpoint_latency"):
        GatewayConfig(flavour="yookassa", endpoint_latency={"POST /v1/charges": slow})


# --- GET /v3/payments/{id} and GET /v3/payments: "Payment information", "List of payments" ----


async def test_a_payment_is_read_by_id_and_an_unknown_one_is_404(
    client: httpx.AsyncClient,
) -> None:
    made = (await pay(client)).json()

    assert (await client.get(f"/v3/payments/{made['id']}")).json() == made
    unknown = await client.get("/v3/payments/2f9a1e3c-000f-5000-8000-000000000000")
    assert error_of(unknown, 404, "not_found")["parameter"] == "payment_id"


async def test_the_list_pages_newest_first_by_cursor(client: httpx.AsyncClient) -> None:
    """ "List of payments": newest first, `limit`, an opaque `next_cursor` absent on the
    last page."""
    made = [(await pay(client, payment_body(str(n)))).json() for n in range(5)]

    pages, cursor = [], None
    while True:
        params = {"limit": "2"} | ({"cursor": cursor} if cursor else {})
        listed = (await client.get("/v3/payments", params=params)).json()
        pages.append(listed)
        if "next_cursor" not in listed:
            break
        cursor = listed["next_cursor"]

    assert [len(p["items"]) for p in pages] == [2, 2, 1]
    assert [p["type"] for p in pages] == ["list"] * 3
    assert [i["id"] for p in pages for i in p["items"]] == [m["id"] for m in reversed(made)]
    everything = (await client.get("/v3/payments")).json()
    assert everything == {"type": "list", "items": list(reversed(made))}


async def test_the_default_page_is_ten(client: httpx.AsyncClient) -> None:
    for n in range(11):
        await pay(client, payment_body(str(n)))

    first = (await client.get("/v3/payments")).json()
    rest = (await client.get("/v3/payments", params={"cursor": first["next_cursor"]})).json()

    assert (len(first["items"]), len(rest["items"]), "next_cursor" in rest) == (10, 1, False)


async def test_the_list_filters_by_created_at_and_status(client: httpx.AsyncClient) -> None:
    """`created_at.gte|gt|lt|lte` (ISO 8601) and `status`."""
    made = [(await pay(client, payment_body(str(n)))).json() for n in range(4)]
    made.append((await pay(client, payment_body("9", method="cus_decline_1"))).json())
    middle = made[2]["created_at"]

    async def ids(**params: str) -> list[str]:
        listed = (await client.get("/v3/payments", params=params | {"limit": "100"})).json()
        return [item["id"] for item in listed["items"]]

    def expected(keep: Any) -> list[str]:
        return [m["id"] for m in reversed(made) if keep(instant(m["created_at"]))]

    at = instant(middle)
    assert await ids(**{"created_at.gte": middle}) == expected(lambda t: t >= at)
    assert await ids(**{"created_at.gt": middle}) == expected(lambda t: t > at)
    assert await ids(**{"created_at.lt": middle}) == expected(lambda t: t < at)
    assert await ids(**{"created_at.lte": middle}) == expected(lambda t: t <= at)
    assert await ids(**{"created_at.lt": made[0]["created_at"]}) == []
    assert await ids(**{"created_at.gt": made[-1]["created_at"]}) == []
    assert await ids(status="canceled") == [made[-1]["id"]]
    assert await ids(status="succeeded") == [m["id"] for m in reversed(made[:4])]


@pytest.mark.parametrize(
    ("params", "parameter"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"created_at.gte": "yesterday"}, "created_at.gte"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"before:999").decode()}, "cursor"),
        ({"status": "paid"}, "status"),
        ({"customer": "pm_42"}, "customer"),
    ],
)
async def test_a_bad_list_query_is_400(
    client: httpx.AsyncClient, params: dict[str, str], parameter: str
) -> None:
    response = await client.get("/v3/payments", params=params)

    assert error_of(response, 400, "invalid_request")["parameter"] == parameter


# --- POST /v3/refunds: "Create a refund" ------------------------------------------------------


async def test_a_refund_in_full_leaves_the_payment_succeeded_and_not_refundable(
    client: httpx.AsyncClient,
) -> None:
    paid = (await pay(client)).json()

    response = await refund(client, paid["id"])
    again = await refund(client, paid["id"])

    assert response.status_code == 200
    made = response.json()
    assert made == {
        "id": made["id"],
        "payment_id": paid["id"],
        "status": "succeeded",
        "amount": {"value": "990.00", "currency": "RUB"},
        "created_at": made["created_at"],
        "description": "duplicate",
    }
    assert (again.status_code, again.json()) == (200, made)
    shown = (await client.get(f"/v3/payments/{paid['id']}")).json()
    assert (shown["status"], shown["refunded_amount"], shown["refundable"]) == (
        "succeeded",
        {"value": "990.00", "currency": "RUB"},
        False,
    )
    [recorded] = await sim_charges(client)
    assert (recorded["status"], recorded["amount_refunded"], recorded["refunded"]) == (
        "succeeded",
        99000,
        True,
    )
    assert (await stats(client))["refunds"] == 1


async def test_a_refund_takes_at_most_the_refundable_rest(client: httpx.AsyncClient) -> None:
    paid = (await pay(client)).json()

    too_much = await refund(client, paid["id"], "990.01", key="r:1")
    part = await refund(client, paid["id"], "400.00", key="r:2")
    shown = (await client.get(f"/v3/payments/{paid['id']}")).json()
    rest = await refund(client, paid["id"], "590.00", key="r:3")
    once_more = await refund(client, paid["id"], "1.00", key="r:4")

    assert error_of(too_much, 400, "invalid_request")["parameter"] == "amount"
    assert part.status_code == 200
    assert (shown["refunded_amount"]["value"], shown["refundable"]) == ("400.00", True)
    assert rest.status_code == 200
    error_of(once_more, 400, "invalid_request")
    assert (await sim_charges(client))[0]["amount_refunded"] == 99000


async def test_refunding_an_unknown_or_canceled_payment(client: httpx.AsyncClient) -> None:
    canceled = (await pay(client, payment_body(method="cus_decline_1"))).json()

    error_of(await refund(client, "2f9a1e3c-000f-5000-8000-000000000000"), 404, "not_found")
    error_of(await refund(client, canceled["id"]), 400, "invalid_request")


@pytest.mark.parametrize(
    "body",
    [
        {"amount": {"value": "1.00", "currency": "RUB"}},
        {"payment_id": "p"},
        {"payment_id": "p", "amount": {"value": "1", "currency": "RUB"}},
        {"payment_id": "p", "amount": {"value": "1.00", "currency": "RUB"}, "reason": "x"},
    ],
)
async def test_an_invalid_refund_is_400(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await client.post("/v3/refunds", json=body, headers={"Idempotence-Key": "r"})
    error_of(response, 400, "invalid_request")


# --- notifications: "Incoming notifications" ---------------------------------------------------


async def test_notifications_are_unsigned_and_carry_the_object(
    client: httpx.AsyncClient,
) -> None:
    """`{"type": "notification", "event", "object"}`: `payment.succeeded`, `payment.canceled`
    (the payment), `refund.succeeded` (the refund); no signature header."""
    receiver = Receiver()
    with ServedApp(receiver.app) as hooks:
        await configure(client, webhook_url=f"{hooks.url}/hooks")
        paid = (await pay(client)).json()
        canceled = (await pay(client, payment_body("2", method="cus_decline_1"))).json()
        refunded = (await refund(client, paid["id"])).json()
        await eventually(lambda: len(receiver.bodies) == 3, "three notifications")

    by_event = {body["event"]: body for body in receiver.bodies}
    assert by_event == {
        "payment.succeeded": {"type": "notification", "event": "payment.succeeded", "object": paid},
        "payment.canceled": {
            "type": "notification",
            "event": "payment.canceled",
            "object": canceled,
        },
        "refund.succeeded": {
            "type": "notification",
            "event": "refund.succeeded",
            "object": refunded,
        },
    }
    for headers in receiver.headers:
        assert not {h for h in headers if "signature" in h or h.startswith("webhook-")}


async def test_a_notification_answered_other_than_200_is_sent_again(
    client: httpx.AsyncClient,
) -> None:
    """YooKassa expects `200` and retries any other answer (a `204` too); duplicates are
    sent as the other flavours send them."""
    receiver = Receiver(500, 204)
    with ServedApp(receiver.app) as hooks:
        await configure(
            client,
            webhook_url=f"{hooks.url}/hooks",
            webhook_time_scale=0.0001,
            webhook_duplicate=1.0,
        )
        await pay(client)

        async def done() -> bool:
            return bool((await client.get("/_sim/webhooks")).json()["pending"] == 0)

        await eventually(done, "both copies delivered")

    deliveries = (await client.get("/_sim/webhooks")).json()["deliveries"]
    assert sorted(a for d in deliveries for a in d["attempts"]) == [200, 200, 204, 500]
    assert [d["delivered"] for d in deliveries] == [True, True]
    assert receiver.events() == ["payment.succeeded"] * 4


# --- the simulator's own ------------------------------------------------------------------------


async def test_stats_name_the_yookassa_endpoints(client: httpx.AsyncClient) -> None:
    paid = (await pay(client)).json()
    await client.get("/v3/payments")
    await client.get(f"/v3/payments/{paid['id']}")
    await refund(client, paid["id"])

    counted = await stats(client)

    assert counted["by_endpoint"] == dict.fromkeys(ENDPOINTS["yookassa"], 1)
    assert (counted["requests"], counted["charges"]) == (4, 1)


async def test_config_defaults_to_the_sandbox_credentials_and_reset_forgets(
    client: httpx.AsyncClient,
) -> None:
    """`{"flavour": "yookassa"}` alone (as `charge-worker sandbox gateway --config` reads
    it) takes YooKassa's sandbox credentials; the other flavours keep theirs."""
    assert GatewayConfig.model_validate_json('{"flavour": "yookassa"}').api_key == (
        "100500:test_sandbox"
    )
    assert GatewayConfig(flavour="stripe").api_key == "sk_test_sandbox"
    assert GatewayConfig().api_key == "sk_test_sandbox"
    initial = (await client.get("/_sim/config")).json()
    assert (initial["flavour"], initial["api_key"]) == ("yookassa", "100500:test_sandbox")

    await configure(client, api_key="100501:other")
    error_of(await pay(client), 401, "invalid_credentials")
    await client.post("/_sim/reset")

    assert (await client.get("/_sim/config")).json() == initial
    assert (await pay(client)).status_code == 200
