"""The gateway simulator over real HTTP: every answer of docs/contracts/gateway.md."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charge_worker.messages import parse
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.gateway.config import ENDPOINTS
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.serve import ServedApp
from tests.support.harness import due, eventually
from tests.support.providers import provider

API_KEY = "sk_test_sandbox"


@pytest.fixture
def gateway() -> Iterator[ServedApp]:
    with ServedApp(build_gateway_app(GatewayConfig(seed=7))) as served:
        yield served


@pytest.fixture
async def client(gateway: ServedApp) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=10) as client:
        yield client


def charge_body(
    order_id: str = "48291",
    period: str = "2026-09-01",
    *,
    amount: Any = 99000,
    customer: str = "cus_42",
) -> dict[str, Any]:
    return {
        "amount": amount,
        "currency": "RUB",
        "customer": customer,
        "metadata": {"order_id": order_id, "billing_period": period},
    }


def key_of(body: dict[str, Any]) -> str:
    return f"{body['metadata']['order_id']}:{body['metadata']['billing_period']}"


async def charge(
    client: httpx.AsyncClient,
    body: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    client_timeout_s: float | None = None,
) -> httpx.Response:
    body = body or charge_body()
    headers = {"Idempotency-Key": key or key_of(body)}
    if client_timeout_s is None:
        return await client.post("/v1/charges", json=body, headers=headers)
    return await client.post("/v1/charges", json=body, headers=headers, timeout=client_timeout_s)


async def refund(
    client: httpx.AsyncClient, charge_id: str, *, key: str | None = None
) -> httpx.Response:
    body = {"charge": charge_id, "reason": "duplicate"}
    headers = {"Idempotency-Key": key or f"refund:{charge_id}"}
    return await client.post("/v1/refunds", json=body, headers=headers)


async def configure(client: httpx.AsyncClient, **knobs: Any) -> dict[str, Any]:
    response = await client.post("/_sim/config", json=knobs)
    assert response.status_code == 200, response.text
    config: dict[str, Any] = response.json()
    return config


async def sim_charges(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await client.get("/_sim/charges")
    assert response.status_code == 200
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# --- POST /v1/charges ----------------------------------------------------------------------


async def test_a_charge_succeeds(client: httpx.AsyncClient) -> None:
    before = int(time.time())
    response = await charge(client)

    assert response.status_code == 200
    assert "idempotent-replayed" not in response.headers
    body = response.json()
    assert body["id"].startswith("ch_")
    assert body == {
        "id": body["id"],
        "object": "charge",
        "status": "succeeded",
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_42",
        "metadata": {"order_id": "48291", "billing_period": "2026-09-01"},
        "created": body["created"],
        "revision": 1,
        "amount_refunded": 0,
        "refunded": False,
    }
    assert isinstance(body["created"], int)
    assert body["created"] >= before


async def test_same_key_and_params_replay_the_original_answer(client: httpx.AsyncClient) -> None:
    first = await charge(client)
    again = await charge(client)

    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert len(await sim_charges(client)) == 1


async def test_a_cus_decline_customer_is_declined_and_recorded(client: httpx.AsyncClient) -> None:
    body = charge_body(customer="cus_decline_7")
    response = await charge(client, body)

    assert response.status_code == 402
    error = error_of(response)
    assert (error["type"], error["code"]) == ("card_error", "card_declined")
    assert error["message"]
    [recorded] = await sim_charges(client)
    assert recorded["status"] == "failed"
    assert recorded["id"] == error["charge"]
    lookup = await client.get(
        "/v1/charges", params={"order_id": "48291", "billing_period": "2026-09-01"}
    )
    assert [c["status"] for c in lookup.json()["data"]] == ["failed"]

    again = await charge(client, body)
    assert again.status_code == 402
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == response.json()
    assert len(await sim_charges(client)) == 1


async def test_a_key_in_flight_answers_409(client: httpx.AsyncClient) -> None:
    await configure(client, latency={"fixed_s": 1.0})

    first, second = await asyncio.gather(charge(client), charge(client))

    by_status = {r.status_code: r for r in (first, second)}
    assert sorted(by_status) == [200, 409]
    error = error_of(by_status[409])
    assert (error["type"], error["code"]) == ("idempotency_error", "request_in_progress")
    later = await charge(client)
    assert later.status_code == 200
    assert later.headers["Idempotent-Replayed"] == "true"
    assert len(await sim_charges(client)) == 1


async def test_same_key_other_params_is_key_reused(client: httpx.AsyncClient) -> None:
    await charge(client)
    response = await charge(client, charge_body(amount=100), key="48291:2026-09-01")

    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"]) == ("idempotency_error", "key_reused")
    assert len(await sim_charges(client)) == 1


def _without(name: str) -> dict[str, Any]:
    body = charge_body()
    del body[name]
    return body


def _with(**fields: Any) -> dict[str, Any]:
    return charge_body() | fields


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (_without("amount"), 400, "amount"),
        (_without("metadata"), 400, "metadata"),
        (_with(metadata={"order_id": "48291"}), 400, "metadata[billing_period]"),
        (_with(extra="x"), 400, "extra"),
        ([1, 2], 400, None),
        (_with(amount=True), 422, "amount"),
        (_with(amount=99000.0), 422, "amount"),
        (_with(amount="99000"), 422, "amount"),
        (_with(amount=0), 422, "amount"),
        (_with(amount=-5), 422, "amount"),
        (_with(currency="rub"), 422, "currency"),
        (_with(currency="RUBL"), 422, "currency"),
        (_with(customer=""), 422, "customer"),
        (
            _with(metadata={"order_id": 48291, "billing_period": "2026-09-01"}),
            422,
            "metadata[order_id]",
        ),
        (_with(metadata="48291"), 422, "metadata"),
    ],
)
async def test_an_invalid_body_is_rejected_and_not_kept(
    client: httpx.AsyncClient, body: Any, status: int, param: str | None
) -> None:
    response = await client.post("/v1/charges", json=body, headers={"Idempotency-Key": "k:1"})

    assert response.status_code == status
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error.get("param") == param
    assert await sim_charges(client) == []
    # An invalid request does not keep its key: a valid one with it is a fresh charge.
    assert (await charge(client, key="k:1")).status_code == 200


async def test_a_body_that_is_not_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/charges", content=b"amount=1", headers={"Idempotency-Key": "k:1"}
    )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


async def test_a_missing_idempotency_key_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/charges", json=charge_body())

    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", "Idempotency-Key")
    assert await sim_charges(client) == []


async def test_rate_limit_carries_retry_after(client: httpx.AsyncClient) -> None:
    await configure(client, error_rates={"429": 1.0}, retry_after_s=3)

    response = await charge(client)

    assert response.status_code == 429
    assert response.headers["Retry-After"] == "3"
    assert error_of(response)["type"] == "rate_limit_error"
    assert await sim_charges(client) == []


@pytest.mark.parametrize("status", [500, 503])
async def test_an_injected_5xx_records_nothing(client: httpx.AsyncClient, status: int) -> None:
    await configure(client, error_rates={str(status): 1.0})

    response = await charge(client)

    assert response.status_code == status
    assert error_of(response)["type"] == "api_error"
    assert await sim_charges(client) == []
    await configure(client, error_rates={})
    retry = await charge(client)
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    stats = (await client.get("/_sim/stats")).json()
    assert stats["injected_errors"] == 1


async def test_error_rates_are_drawn_per_request(client: httpx.AsyncClient) -> None:
    await configure(client, error_rates={"500": 0.5})

    answers = [(await charge(client, charge_body(str(n)))).status_code for n in range(40)]

    assert set(answers) == {200, 500}
    assert len(await sim_charges(client)) == answers.count(200)


async def test_a_lost_answer_by_timeout_still_charged(client: httpx.AsyncClient) -> None:
    await configure(client, lost_answer_rate=1.0, lost_answer_mode="timeout")

    with pytest.raises(httpx.ReadTimeout):
        await charge(client, client_timeout_s=0.3)

    [recorded] = await sim_charges(client)
    assert recorded["idempotency_key"] == "48291:2026-09-01"
    retry = await charge(client)
    assert retry.status_code == 200
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == recorded["id"]
    assert len(await sim_charges(client)) == 1
    assert (await client.get("/_sim/stats")).json()["lost_answers"] == 1


async def test_a_lost_answer_as_502_still_charged(client: httpx.AsyncClient) -> None:
    await configure(client, lost_answer_rate=1.0, lost_answer_mode="5xx")

    response = await charge(client)

    assert response.status_code == 502
    [recorded] = await sim_charges(client)
    retry = await charge(client)
    assert retry.status_code == 200
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == recorded["id"]


async def test_without_idempotency_every_request_charges(client: httpx.AsyncClient) -> None:
    await configure(client, idempotency_enabled=False)

    first, second = await charge(client), await charge(client)

    assert (first.status_code, second.status_code) == (200, 200)
    assert "idempotent-replayed" not in second.headers
    assert first.json()["id"] != second.json()["id"]
    recorded = await sim_charges(client)
    assert [c["idempotency_key"] for c in recorded] == ["48291:2026-09-01"] * 2
    lookup = await client.get(
        "/v1/charges", params={"order_id": "48291", "billing_period": "2026-09-01"}
    )
    assert [c["id"] for c in lookup.json()["data"]] == [first.json()["id"], second.json()["id"]]


async def test_an_expired_key_charges_again(client: httpx.AsyncClient) -> None:
    await configure(client, key_retention_s=0.2)
    first = await charge(client)
    assert first.status_code == 200

    deadline = time.monotonic() + 10
    while True:
        again = await charge(client)
        assert again.status_code == 200
        if "idempotent-replayed" not in again.headers:
            break
        assert time.monotonic() < deadline, "the key never expired"
        await asyncio.sleep(0.05)

    assert again.json()["id"] != first.json()["id"]
    assert len(await sim_charges(client)) == 2


# --- auth --------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "Bearer sk_wrong", f"Basic {API_KEY}", API_KEY])
@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/charges"), ("GET", "/v1/charges"), ("POST", "/v1/refunds")]
)
async def test_a_missing_or_wrong_api_key_is_401(
    gateway: ServedApp, authorization: str | None, method: str, path: str
) -> None:
    headers = {"Idempotency-Key": "48291:2026-09-01"}
    if authorization is not None:
        headers["Authorization"] = authorization
    async with httpx.AsyncClient(base_url=gateway.url) as anonymous:
        response = await anonymous.request(method, path, json=charge_body(), headers=headers)
        assert response.status_code == 401
        assert error_of(response)["type"] == "invalid_request_error"
        assert (await anonymous.get("/_sim/charges")).json() == {"data": []}


# --- GET /v1/charges ---------------------------------------------------------------------


async def test_lookup_by_order_and_period(client: httpx.AsyncClient) -> None:
    wanted = (await charge(client, charge_body("1", "2026-09-01"))).json()
    await charge(client, charge_body("1", "2026-10-01"))
    await charge(client, charge_body("2", "2026-09-01"))

    found = await client.get(
        "/v1/charges", params={"order_id": "1", "billing_period": "2026-09-01"}
    )
    nothing = await client.get(
        "/v1/charges", params={"order_id": "3", "billing_period": "2026-09-01"}
    )

    assert found.status_code == 200
    assert found.json() == {"object": "list", "data": [wanted], "has_more": False}
    assert nothing.json()["data"] == []
    assert nothing.json()["has_more"] is False


async def test_paging_by_time_oldest_first(client: httpx.AsyncClient) -> None:
    made = [(await charge(client, charge_body(str(n)))).json() for n in range(5)]
    window = {"created_gte": str(made[0]["created"]), "created_lt": str(made[-1]["created"] + 1)}

    pages, after = [], None
    while True:
        params = window | {"limit": "2"} | ({"starting_after": after} if after else {})
        page = (await client.get("/v1/charges", params=params)).json()
        pages.append(page)
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]

    assert [len(p["data"]) for p in pages] == [2, 2, 1]
    assert [c["id"] for p in pages for c in p["data"]] == [c["id"] for c in made]
    before_all = await client.get("/v1/charges", params={"created_lt": str(made[0]["created"])})
    after_all = await client.get(
        "/v1/charges", params={"created_gte": str(made[-1]["created"] + 1)}
    )
    assert before_all.json() == {"object": "list", "data": [], "has_more": False}
    assert after_all.json()["data"] == []
    default_page = (await client.get("/v1/charges")).json()
    assert len(default_page["data"]) == 5


async def test_the_default_page_is_ten(client: httpx.AsyncClient) -> None:
    await configure(client, idempotency_enabled=False)
    for _ in range(11):
        await charge(client)

    page = (await client.get("/v1/charges")).json()
    everything = (
        await client.get(
            "/v1/charges", params={"order_id": "48291", "billing_period": "2026-09-01"}
        )
    ).json()

    assert (len(page["data"]), page["has_more"]) == (10, True)
    assert (len(everything["data"]), everything["has_more"]) == (11, False)


@pytest.mark.parametrize(
    "params",
    [
        {"limit": "0"},
        {"limit": "101"},
        {"limit": "ten"},
        {"created_gte": "yesterday"},
        {"created_lt": "-1"},
        {"order_id": "48291"},
        {"billing_period": "2026-09-01"},
        {"customer": "cus_42"},
        {"starting_after": "ch_unknown"},
    ],
)
async def test_a_bad_query_is_400(client: httpx.AsyncClient, params: dict[str, str]) -> None:
    response = await client.get("/v1/charges", params=params)

    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


# --- POST /v1/refunds --------------------------------------------------------------------


async def test_a_refund_succeeds_and_replays(client: httpx.AsyncClient) -> None:
    charged = (await charge(client)).json()

    response = await refund(client, charged["id"])
    again = await refund(client, charged["id"])

    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("re_")
    assert (body["object"], body["charge"], body["amount"], body["status"]) == (
        "refund",
        charged["id"],
        99000,
        "succeeded",
    )
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == body
    [recorded] = await sim_charges(client)
    assert (recorded["status"], recorded["refunded"], recorded["revision"]) == (
        "succeeded",
        True,
        2,
    )


async def test_a_refunded_charge_stays_succeeded_and_shows_its_refund_everywhere(
    client: httpx.AsyncClient,
) -> None:
    """docs/contracts/gateway.md, "Refunds": as Stripe's, a refunded charge keeps `status:
    "succeeded"`; `amount_refunded` and `refunded` show the refund, in every answer."""
    kept = (await charge(client, charge_body("1"))).json()
    refunded = (await charge(client, charge_body("2"))).json()
    assert (kept["amount_refunded"], kept["refunded"]) == (0, False)

    assert (await refund(client, refunded["id"])).status_code == 200

    shown = {"status": "succeeded", "amount_refunded": 99000, "refunded": True, "revision": 2}
    lookup = await client.get(
        "/v1/charges", params={"order_id": "2", "billing_period": "2026-09-01"}
    )
    [looked_up] = lookup.json()["data"]
    [_, paged] = (await client.get("/v1/charges")).json()["data"]
    [untouched, recorded] = await sim_charges(client)
    for seen in (looked_up, paged, recorded):
        assert {name: seen[name] for name in shown} == shown
    assert (untouched["status"], untouched["amount_refunded"], untouched["refunded"]) == (
        "succeeded",
        0,
        False,
    )
    statuses = {c["status"] for c in await sim_charges(client)}
    assert statuses == {"succeeded"}


class Receiver:
    """A webhook endpoint that keeps every body it is sent."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.app = Starlette(routes=[Route("/hooks", self.receive, methods=["POST"])])

    async def receive(self, request: Request) -> Response:
        self.events.append(json.loads(await request.body()))
        return Response(status_code=200)


async def test_a_refund_webhook_carries_the_charge_still_succeeded_and_refunded(
    client: httpx.AsyncClient,
) -> None:
    receiver = Receiver()
    with ServedApp(receiver.app) as hooks:
        await configure(client, webhook_url=f"{hooks.url}/hooks")
        charged = (await charge(client)).json()
        await refund(client, charged["id"])
        await eventually(lambda: len(receiver.events) == 2, "both webhooks delivered")

    by_type = {event["type"]: event["data"]["object"] for event in receiver.events}
    assert set(by_type) == {"charge.succeeded", "charge.refunded"}
    made, refunded = by_type["charge.succeeded"], by_type["charge.refunded"]
    assert (made["status"], made["amount_refunded"], made["refunded"], made["revision"]) == (
        "succeeded",
        0,
        False,
        1,
    )
    assert (
        refunded["id"],
        refunded["status"],
        refunded["amount_refunded"],
        refunded["refunded"],
        refunded["revision"],
    ) == (charged["id"], "succeeded", 99000, True, 2)


async def test_refunding_a_refunded_charge_with_a_new_key(client: httpx.AsyncClient) -> None:
    charged = (await charge(client)).json()
    await refund(client, charged["id"])

    response = await refund(client, charged["id"], key="refund:another")

    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"]) == ("invalid_request_error", "charge_already_refunded")
    assert (await sim_charges(client))[0]["revision"] == 2


async def test_refunding_an_unknown_charge_is_404(client: httpx.AsyncClient) -> None:
    response = await refund(client, "ch_unknown")

    assert response.status_code == 404
    assert error_of(response)["code"] == "resource_missing"


async def test_refunding_a_declined_charge_is_400(client: httpx.AsyncClient) -> None:
    declined = await charge(client, charge_body(customer="cus_decline"))
    charge_id = error_of(declined)["charge"]

    response = await refund(client, charge_id)

    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"
    assert (await sim_charges(client))[0]["status"] == "failed"


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"charge": "ch_1", "reason": "duplicate"}, {}),
        ({"reason": "duplicate"}, {"Idempotency-Key": "refund:ch_1"}),
        ({"charge": "ch_1", "reason": "bored"}, {"Idempotency-Key": "refund:ch_1"}),
    ],
)
async def test_an_invalid_refund_is_rejected(
    client: httpx.AsyncClient, body: dict[str, str], headers: dict[str, str]
) -> None:
    response = await client.post("/v1/refunds", json=body, headers=headers)

    assert response.status_code in (400, 422)
    assert error_of(response)["type"] == "invalid_request_error"


# --- /_sim -------------------------------------------------------------------------------


async def test_stats_count_requests_by_endpoint_and_status(client: httpx.AsyncClient) -> None:
    await charge(client)
    await charge(client)
    await charge(client, charge_body("2", customer="cus_decline"))
    await client.get("/v1/charges")

    stats = (await client.get("/_sim/stats")).json()

    assert stats["by_endpoint"] == {"POST /v1/charges": 3, "GET /v1/charges": 1}
    assert stats["by_status"] == {"200": 3, "402": 1}
    assert (stats["requests"], stats["charges"]) == (4, 2)


async def test_config_updates_partially_and_reset_forgets(client: httpx.AsyncClient) -> None:
    initial = (await client.get("/_sim/config")).json()
    assert initial["api_key"] == API_KEY
    assert initial["key_retention_s"] == 86400

    updated = await configure(client, error_rates={"503": 0.25}, lost_answer_delay_s=1)
    assert updated == initial | {"error_rates": {"503": 0.25}, "lost_answer_delay_s": 1}
    bad = await client.post("/_sim/config", json={"error_rates": {"404": 0.5}})
    assert bad.status_code == 422
    assert (await client.post("/_sim/config", json={"no_such_knob": 1})).status_code == 422
    assert (await client.get("/_sim/config")).json() == updated

    await configure(client, error_rates={})
    await charge(client)
    reset = await client.post("/_sim/reset")

    assert reset.status_code == 200
    assert (await client.get("/_sim/config")).json() == initial
    assert await sim_charges(client) == []
    assert (await client.get("/_sim/stats")).json()["requests"] == 0
    assert "idempotent-replayed" not in (await charge(client)).headers


def test_the_app_exposes_its_simulator() -> None:
    app = build_gateway_app(GatewayConfig(api_key="sk_other"))
    assert app.state.sim.config.api_key == "sk_other"


def test_an_endpoint_latency_replaces_latency_for_that_endpoint_alone() -> None:
    slow, fast = LatencyModel.fixed(5.5), LatencyModel.fixed(0.2)
    config = GatewayConfig(
        flavour="stripe", latency=fast, endpoint_latency={"POST /v1/payment_intents": slow}
    )
    sim = build_gateway_app(config).state.sim

    assert sim.latency_of("POST /v1/payment_intents") == slow
    assert sim.latency_of("GET /v1/payment_intents") == fast
    with pytest.raises(ValidationError, match="endpoint_latency"):  # not a contract endpoint
        GatewayConfig(endpoint_latency={"POST /v1/payment_intents": slow})


async def test_a_slow_endpoint_holds_its_requests_while_the_others_answer(
    client: httpx.AsyncClient,
) -> None:
    await configure(client, endpoint_latency={"POST /v1/charges": {"fixed_s": 3.0}})

    charging = asyncio.create_task(charge(client))
    await eventually(lambda: in_flight(client), "the charge's key in progress")
    listed = await client.get("/v1/charges")

    assert listed.status_code == 200
    assert await in_flight(client), "the list answered while the charge still waited"
    assert (await charging).status_code == 200


async def in_flight(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/_sim/stats")).json()["in_flight"])


async def test_without_an_invoice_default_a_stripe_charge_is_three_requests() -> None:
    """`invoice_default` false (the chaos scenario `lease_outlived_stripe`): no customer has
    an invoice default payment method, its card is only listed, so the Stripe adapter reads
    the customer, then its cards, then creates the PaymentIntent with the listed card."""
    with provider("stripe", invoice_default=False) as sim:
        gateway = sim.gateway()
        try:
            result = await gateway.charge(parse(due(1, "cus_ok_1")))
        finally:
            await gateway.aclose()
        stats = await sim.stats()

    assert result.status == "succeeded"
    assert stats["by_endpoint"] == {
        "GET /v1/customers/{id}": 1,
        "GET /v1/payment_methods": 1,
        "POST /v1/payment_intents": 1,
    }
    assert set(stats["by_endpoint"]) <= set(ENDPOINTS["stripe"])
