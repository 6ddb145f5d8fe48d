"""The YooKassa adapter's requests and its mapping of every answer (docs/adapters.md), over
httpx.MockTransport: the wire as YooKassa's API v3 reference describes it, no server."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from charge_worker import errors
from charge_worker.gateway import AUTHENTICATION_REQUIRED, ChargeResult
from charge_worker.gateway.yookassa import YooKassaGateway
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings

CREDENTIALS = "100500:test_unit_secret"
METHOD = "2d8e2a5c-000f-5000-8000-1a2b3c4d5e6f"
META = {"order_id": "48291", "billing_period": "2026-09-01"}


def due(**fields: Any) -> ChargeDue:
    values = {
        "schema": "charge.due/v1",
        "order_id": 48291,
        "billing_period": dt.date(2026, 9, 1),
        "subscription_id": "sub_7Q2",
        "customer_id": METHOD,
        "amount_minor": 99000,
        "currency": "RUB",
        "due_at": dt.datetime(2026, 9, 1, tzinfo=dt.UTC),
    }
    return ChargeDue.model_validate(values | fields, strict=False)


def payment(status: str = "succeeded", **fields: Any) -> dict[str, Any]:
    return {
        "id": "2f9a1e3c-000f-5000-8000-1a2b3c4d5e6f",
        "status": status,
        "paid": status == "succeeded",
        "amount": {"value": "990.00", "currency": "RUB"},
        "payment_method": {"type": "bank_card", "id": METHOD, "saved": True},
        "created_at": "2026-09-01T00:00:01.250Z",
        "refunded_amount": {"value": "0.00", "currency": "RUB"},
        "metadata": META,
        **fields,
    }


def error(status: int, code: str, **fields: Any) -> httpx.Response:
    body = {"type": "error", "id": "e1", "code": code, "description": "…"} | fields
    return httpx.Response(status, json=body)


Handler = Callable[[httpx.Request], httpx.Response]


def adapter(handler: Handler, **overrides: Any) -> tuple[YooKassaGateway, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return handler(request)

    values: dict[str, Any] = {"kind": "yookassa", "api_key": SecretStr(CREDENTIALS)}
    cfg = GatewaySettings(**(values | overrides))
    return YooKassaGateway(cfg, transport=httpx.MockTransport(record)), sent


async def test_a_charge_is_one_autopayment_with_the_saved_method_and_the_trys_key() -> None:
    gateway, sent = adapter(lambda _: httpx.Response(200, json=payment()))
    result = await gateway.charge(due(attempt=2), traceparent="00-abc-def-01")

    [request] = sent
    body = json.loads(request.content)
    assert (request.method, request.url.path) == ("POST", "/v3/payments")
    assert request.url.host == "api.yookassa.ru"
    assert (
        request.headers["Authorization"]
        == "Basic " + base64.b64encode(b"100500:test_unit_secret").decode()
    )
    assert request.headers["Idempotence-Key"] == "48291:2026-09-01:2"
    assert request.headers["traceparent"] == "00-abc-def-01"
    assert body["amount"] == {"value": "990.00", "currency": "RUB"}  # a string, never a float
    assert (body["capture"], body["payment_method_id"]) == (True, METHOD)
    assert body["metadata"] == META | {"attempt": "2"}
    assert result == ChargeResult("succeeded", payment()["id"], replayed=None)


async def test_try_1_is_sent_without_an_attempt_under_the_periods_key() -> None:
    gateway, sent = adapter(lambda _: httpx.Response(200, json=payment()))
    await gateway.charge(due())
    assert sent[0].headers["Idempotence-Key"] == "48291:2026-09-01"
    assert json.loads(sent[0].content)["metadata"] == META


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (payment("pending"), ("processing", None, None)),
        (payment("waiting_for_capture"), ("processing", None, None)),
        (
            payment(
                "canceled",
                cancellation_details={"party": "payment_network", "reason": "card_expired"},
            ),
            ("declined", "card_expired", "card_declined"),
        ),
        (
            payment(
                "canceled",
                cancellation_details={"party": "payment_network", "reason": "3d_secure_failed"},
            ),
            ("declined", "3d_secure_failed", AUTHENTICATION_REQUIRED),
        ),
        (payment("canceled"), ("declined", None, "card_declined")),  # no reason: generic
    ],
)
async def test_an_answered_payment_is_a_result(
    answer: dict[str, Any], expected: tuple[str, str | None, str | None]
) -> None:
    gateway, _ = adapter(lambda _: httpx.Response(200, json=answer))
    result = await gateway.charge(due())
    assert (result.status, result.decline_code, result.decline_kind) == expected
    assert result.charge_id == answer["id"]  # a pending payment's id is recorded


@pytest.mark.parametrize(
    ("response", "raised"),
    [
        (
            httpx.Response(202, json={"type": "processing", "retry_after": 1800}),
            errors.RequestInProgress,
        ),
        (error(400, "invalid_request", parameter="Idempotence-Key"), errors.GatewayRejected),
        (error(400, "invalid_request", parameter="amount.value"), errors.GatewayRejected),
        (error(401, "invalid_credentials"), errors.DependencyUnavailable),
        (error(403, "forbidden"), errors.DependencyUnavailable),
        (httpx.Response(404, text="nginx"), errors.DependencyUnavailable),  # a wrong URL
        (httpx.Response(400, text="bad gateway config"), errors.DependencyUnavailable),
        (error(429, "too_many_requests"), errors.RateLimited),
        (error(500, "internal_server_error"), errors.OutcomeUnknown),
        (httpx.Response(200, text="<html>"), errors.OutcomeUnknown),
        (
            httpx.Response(200, json=payment(amount={"value": "990.0", "currency": "RUB"})),
            errors.OutcomeUnknown,
        ),
        (httpx.Response(200, json=payment("refunded")), errors.OutcomeUnknown),  # no such status
        (  # an amount is a string: a JSON number is no amount of YooKassa's
            httpx.Response(200, json=payment(amount={"value": 990, "currency": "RUB"})),
            errors.OutcomeUnknown,
        ),
    ],
)
async def test_every_other_answer_is_its_domain_error(
    response: httpx.Response, raised: type[Exception]
) -> None:
    gateway, _ = adapter(lambda _: response)
    with pytest.raises(raised) as caught:
        await gateway.charge(due())
    assert "test_unit_secret" not in str(caught.value)


async def test_a_202_waits_as_long_as_yookassa_asks() -> None:
    answer = httpx.Response(202, json={"type": "processing", "retry_after": 1800})
    gateway, _ = adapter(lambda _: answer)
    with pytest.raises(errors.RequestInProgress) as caught:
        await gateway.charge(due())
    assert caught.value.retry_after_s == 1.8


async def test_wrong_credentials_name_the_setting() -> None:
    gateway, _ = adapter(lambda _: error(401, "invalid_credentials"))
    with pytest.raises(errors.DependencyUnavailable, match="GATEWAY_API_KEY"):
        await gateway.charge(due())


@pytest.mark.parametrize(
    ("charge", "why"),
    [
        (due(customer_id="cus 42; drop"), "payment_method_id"),
        (due(currency="XAU"), "XAU"),  # no minor unit in ISO 4217
        (due(currency="ABC"), "ABC"),
    ],
)
async def test_a_charge_yookassa_could_not_take_as_asked_sends_nothing(
    charge: ChargeDue, why: str
) -> None:
    gateway, sent = adapter(lambda _: httpx.Response(200, json=payment()))
    with pytest.raises(errors.GatewayRejected, match=why):
        await gateway.charge(charge)
    assert sent == []


async def test_the_longest_key_a_charge_can_have_fits_with_the_longest_prefix() -> None:
    gateway, sent = adapter(
        lambda _: httpx.Response(200, json=payment()), idempotency_key_prefix="p" * 21
    )
    await gateway.charge(due(order_id=2**63 - 1, attempt=1000))
    assert len(sent[0].headers["Idempotence-Key"]) <= 64


def test_a_prefix_that_leaves_a_refunds_key_over_64_characters_fails_at_start() -> None:
    """`<prefix>refund:<payment id>` (a UUID, 36) must fit YooKassa's 64 characters, or no
    double charge could ever be refunded."""
    adapter(lambda _: httpx.Response(200), idempotency_key_prefix="p" * 21)
    with pytest.raises(errors.SettingsError, match="CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX"):
        adapter(lambda _: httpx.Response(200), idempotency_key_prefix="p" * 22)


@pytest.mark.parametrize("credentials", ["test_secret", "shop:test_secret", "100500:"])
def test_credentials_not_shop_and_key_fail_at_start_naming_the_setting(credentials: str) -> None:
    with pytest.raises(errors.SettingsError, match="GATEWAY_API_KEY"):
        adapter(lambda _: httpx.Response(200), api_key=SecretStr(credentials))


async def test_a_lookup_pages_by_cursor_and_keeps_the_periods_payments_oldest_first() -> None:
    other = payment(id="p-other", metadata={"order_id": "7", "billing_period": "2026-09-01"})
    try2 = payment(id="p-try2", metadata=META | {"attempt": "2"})
    try1 = payment("canceled", id="p-try1", cancellation_details={"reason": "insufficient_funds"})
    pages = {
        None: {"type": "list", "items": [try2, other], "next_cursor": "c2"},
        "c2": {"type": "list", "items": [try1]},
    }
    gateway, sent = adapter(
        lambda request: httpx.Response(200, json=pages[request.url.params.get("cursor")])
    )
    found = await gateway.lookup(48291, dt.date(2026, 9, 1))

    assert [(c.id, c.attempt, c.status, c.decline_code) for c in found] == [
        ("p-try1", 1, "failed", "insufficient_funds"),
        ("p-try2", 2, "succeeded", None),
    ]
    assert sent[0].url.params["created_at.gte"] == "2026-08-01T00:00:00.000Z"  # 31 days before


async def test_a_payment_reads_as_a_charge_in_minor_units_with_its_method_as_customer() -> None:
    refunded = payment(refunded_amount={"value": "990.00", "currency": "RUB"})
    gateway, _ = adapter(lambda _: httpx.Response(200, json=refunded))
    found = await gateway.retrieve(refunded["id"])
    assert found is not None
    assert (found.amount, found.currency, found.customer) == (99000, "RUB", METHOD)
    assert (found.charged, found.captured, found.refunded) == (True, False, True)
    assert found.fingerprint == due().fingerprint
    assert found.created == int(dt.datetime(2026, 9, 1, 0, 0, 1, tzinfo=dt.UTC).timestamp())


async def test_retrieve_of_a_payment_yookassa_does_not_hold_is_none() -> None:
    gateway, _ = adapter(lambda _: error(404, "not_found"))
    assert await gateway.retrieve("missing") is None


async def test_a_refund_sends_the_rest_under_its_key_and_a_refunded_payment_is_already() -> None:
    partly = payment(refunded_amount={"value": "90.00", "currency": "RUB"})

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=partly)
        return httpx.Response(200, json={"id": "r-1", "status": "succeeded"})

    gateway, sent = adapter(answer)
    assert await gateway.refund(partly["id"]) == "r-1"
    body = json.loads(sent[1].content)
    assert body["amount"] == {"value": "900.00", "currency": "RUB"}
    assert sent[1].headers["Idempotence-Key"] == f"refund:{partly['id']}"

    done = payment(refunded_amount={"value": "990.00", "currency": "RUB"})
    gateway, sent = adapter(lambda _: httpx.Response(200, json=done))
    assert await gateway.refund(done["id"]) == "already"
    assert [r.method for r in sent] == ["GET"]


async def test_history_asks_for_the_window_and_hands_back_yookassas_cursor() -> None:
    listed = {"type": "list", "items": [payment()], "next_cursor": "opaque=="}
    gateway, sent = adapter(lambda _: httpx.Response(200, json=listed))
    page = await gateway.history(
        created_gte=1_788_000_000, created_lt=1_788_003_600, starting_after="c1", limit=3
    )
    params = sent[0].url.params
    assert (params["created_at.gte"], params["created_at.lt"]) == (
        "2026-08-29T10:40:00.000Z",
        "2026-08-29T11:40:00.000Z",
    )
    assert (params["cursor"], params["limit"]) == ("c1", "3")
    assert (page.has_more, page.next_after) == (True, "opaque==")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"id": "r-1", "status": "pending"}, "r-1"),  # under way: its key answers it again
        ({"id": "r-1", "status": "canceled"}, errors.GatewayRejected),
        ({"status": "succeeded"}, errors.OutcomeUnknown),
        ({"id": "r-1", "status": "refunding?"}, errors.OutcomeUnknown),
    ],
)
async def test_a_refunds_answer_is_read_not_assumed(
    answer: dict[str, Any], expected: str | type[Exception]
) -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=payment() if request.method == "GET" else answer)

    gateway, _ = adapter(reply)
    if isinstance(expected, str):
        assert await gateway.refund(payment()["id"]) == expected
    else:
        with pytest.raises(expected):
            await gateway.refund(payment()["id"])


async def test_a_lookup_reads_only_the_payments_of_its_key() -> None:
    """Another integration's payment on the shop may be shaped any way: a lookup reads a
    payment in full only once its metadata names the key."""
    theirs = {"id": "p-theirs", "status": "succeeded", "amount": {"value": 5}, "metadata": {}}
    listed = {"type": "list", "items": [payment(), theirs]}
    gateway, _ = adapter(lambda _: httpx.Response(200, json=listed))
    found = await gateway.lookup(48291, dt.date(2026, 9, 1), since=dt.datetime.now(dt.UTC))
    assert [c.id for c in found] == [payment()["id"]]
    with pytest.raises(errors.OutcomeUnknown):  # history must read them all
        await gateway.history(created_gte=0, created_lt=1)
