"""The Stripe adapter's requests and its mapping of every answer (docs/adapters.md), over
httpx.MockTransport: the wire as stripe-python sends and reads it, no server."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
from pydantic import SecretStr

from charge_worker import errors
from charge_worker.gateway import AUTHENTICATION_REQUIRED, CARD_DECLINED, ChargeResult
from charge_worker.gateway.stripe import LOOKUP_LEAD, StripeGateway
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings

KEY = "sk_test_unit_4242"
CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 48291,
        "billing_period": dt.date(2026, 9, 1),
        "subscription_id": "sub_7Q2",
        "customer_id": "cus_42",
        "amount_minor": 99000,
        "currency": "EUR",
        "due_at": dt.datetime(2026, 9, 1, tzinfo=dt.UTC),
    },
    strict=False,
)
META = {"order_id": "48291", "billing_period": "2026-09-01"}
CUSTOMER = {
    "id": "cus_42",
    "object": "customer",
    "invoice_settings": {"default_payment_method": "pm_1"},
}


def intent(status: str = "succeeded", **fields: Any) -> dict[str, Any]:
    return {
        "id": "pi_1",
        "object": "payment_intent",
        "amount": 99000,
        "currency": "eur",
        "customer": "cus_42",
        "status": status,
        "metadata": META,
        "created": 1_788_000_000,
        "latest_charge": {
            "id": "ch_1",
            "object": "charge",
            "amount_refunded": 0,
            "refunded": False,
        },
        **fields,
    }


Handler = Callable[[httpx.Request], httpx.Response]


def stripe_error(status: int, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": body}, headers=headers)


def on_intents(answer: Handler, customer: dict[str, Any] = CUSTOMER) -> Handler:
    """The customer (with its saved card) first, then `answer` for the intent."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/customers/"):
            return httpx.Response(200, json=customer)
        return answer(request)

    return handler


def adapter(handler: Handler, **cfg: Any) -> StripeGateway:
    settings = GatewaySettings(kind="stripe", url="http://127.0.0.1", api_key=SecretStr(KEY), **cfg)
    return StripeGateway(settings, transport=httpx.MockTransport(handler))


def form(request: httpx.Request) -> dict[str, str]:
    return dict(parse_qsl(request.content.decode()))


async def test_an_off_session_payment_intent_with_the_saved_card_and_our_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=intent())

    gw = adapter(on_intents(handler))
    result = await gw.charge(CHARGE, traceparent="00-abc-def-01")
    await gw.aclose()

    assert result == ChargeResult("succeeded", "pi_1")
    [request] = seen
    assert (request.method, request.url.path) == ("POST", "/v1/payment_intents")
    assert request.headers["Idempotency-Key"] == "48291:2026-09-01"
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.headers["traceparent"] == "00-abc-def-01"
    assert form(request) == {
        "amount": "99000",
        "currency": "eur",
        "customer": "cus_42",
        "payment_method": "pm_1",
        "off_session": "true",
        "confirm": "true",
        "metadata[order_id]": "48291",
        "metadata[billing_period]": "2026-09-01",
    }


async def test_a_replay_is_success_and_marked() -> None:
    replay = {"Idempotent-Replayed": "true"}
    gw = adapter(on_intents(lambda _: httpx.Response(200, json=intent(), headers=replay)))
    assert await gw.charge(CHARGE) == ChargeResult("succeeded", "pi_1", replayed=True)


@pytest.mark.parametrize(
    ("body", "code", "kind"),
    [
        (
            {"code": "card_declined", "decline_code": "insufficient_funds"},
            "insufficient_funds",
            CARD_DECLINED,
        ),
        ({"code": "card_declined"}, "card_declined", CARD_DECLINED),
        (
            {"code": AUTHENTICATION_REQUIRED, "decline_code": AUTHENTICATION_REQUIRED},
            AUTHENTICATION_REQUIRED,
            AUTHENTICATION_REQUIRED,
        ),
    ],
)
async def test_a_402_is_a_decline_of_its_kind(body: dict[str, Any], code: str, kind: str) -> None:
    failed = intent("requires_payment_method", last_payment_error=body)
    answer = stripe_error(402, type="card_error", message="m", payment_intent=failed, **body)
    gw = adapter(on_intents(lambda _: answer))
    result = await gw.charge(CHARGE)
    assert (result.status, result.charge_id, result.decline_code) == ("declined", "pi_1", code)
    assert result.decline_kind == kind
    assert gw.available


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("requires_action", AUTHENTICATION_REQUIRED),  # localstripe's answer for 3DS cards
        ("canceled", "canceled"),
    ],
)
async def test_a_200_that_charged_nothing_is_a_decline(status: str, code: str) -> None:
    gw = adapter(on_intents(lambda _: httpx.Response(200, json=intent(status))))
    assert await gw.charge(CHARGE) == ChargeResult("declined", "pi_1", decline_code=code)


async def test_processing_is_its_own_open_result() -> None:
    gw = adapter(on_intents(lambda _: httpx.Response(200, json=intent("processing"))))
    assert await gw.charge(CHARGE) == ChargeResult("processing", "pi_1")


async def test_a_state_no_confirmed_charge_ends_in_is_rejected() -> None:
    gw = adapter(on_intents(lambda _: httpx.Response(200, json=intent("requires_capture"))))
    with pytest.raises(errors.GatewayRejected, match="requires_capture"):
        await gw.charge(CHARGE)


LOCK = {"Stripe-Should-Retry": "true"}


@pytest.mark.parametrize(
    ("answer", "expected", "retry_after_s"),
    [
        (
            stripe_error(429, LOCK, type="invalid_request_error", code="lock_timeout"),
            errors.RateLimited,
            1.0,
        ),
        (
            stripe_error(
                429, {"Retry-After": "7"}, type="invalid_request_error", code="rate_limit"
            ),
            errors.RateLimited,
            7.0,
        ),
        (
            stripe_error(409, type="invalid_request_error", code="idempotency_key_in_use"),
            errors.RequestInProgress,
            2.0,
        ),
        (
            stripe_error(400, type="idempotency_error", message="same key, other params"),
            errors.GatewayRejected,
            None,
        ),
        (
            stripe_error(400, type="invalid_request_error", code="parameter_missing"),
            errors.GatewayRejected,
            None,
        ),
        (stripe_error(500, type="api_error"), errors.OutcomeUnknown, None),
        (httpx.Response(502, text="<html>bad gateway</html>"), errors.OutcomeUnknown, None),
        (httpx.Response(404, text="not found"), errors.DependencyUnavailable, None),
        (httpx.Response(405, text="no"), errors.DependencyUnavailable, None),
        (httpx.Response(400, text="a proxy's bare 400"), errors.DependencyUnavailable, None),
        (
            stripe_error(
                401, type="invalid_request_error", message=f"Invalid API Key provided: {KEY}"
            ),
            errors.DependencyUnavailable,
            None,
        ),
        (
            stripe_error(403, type="invalid_request_error", message="restricted"),
            errors.DependencyUnavailable,
            None,
        ),
    ],
)
async def test_every_other_answer_is_the_domain_error_it_stands_for(
    answer: httpx.Response, expected: type[Exception], retry_after_s: float | None
) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return answer

    gw = adapter(on_intents(handler))
    with pytest.raises(expected) as caught:
        await gw.charge(CHARGE)
    assert len(sent) == 1  # the SDK's own retries are off: ours send the same key later
    if retry_after_s is not None:
        assert getattr(caught.value, "retry_after_s", None) == retry_after_s
    assert KEY not in str(caught.value)
    assert KEY[-4:] not in str(caught.value)


async def test_only_unknown_outcomes_and_refusals_open_the_breaker() -> None:
    rejected = stripe_error(400, type="idempotency_error", message="m")
    declined = stripe_error(402, type="card_error", code="card_declined")
    for answer in (rejected, declined, stripe_error(429, type="invalid_request_error")):
        gw = adapter(on_intents(lambda _, a=answer: a), gateway_breaker_failures=2)
        for _ in range(3):
            with contextlib.suppress(errors.ChargeWorkerError):
                await gw.charge(CHARGE)
        assert gw.available
    broken = adapter(
        on_intents(lambda _: stripe_error(503, type="api_error")), gateway_breaker_failures=2
    )
    for _ in range(2):
        with pytest.raises(errors.OutcomeUnknown):
            await broken.charge(CHARGE)
    assert not broken.available


async def test_a_replayed_5xx_is_unknown_but_no_new_failure_for_the_breaker() -> None:
    """Issue 34, item 8: Stripe replaying its first answer (a 5xx) to a retried key."""
    answers = iter(["fresh", "replayed", "replayed", "replayed", "fresh"])

    def handler(request: httpx.Request) -> httpx.Response:
        replayed = next(answers) == "replayed"
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return stripe_error(500, headers, type="api_error")

    gw = adapter(on_intents(handler), gateway_breaker_failures=2, gateway_breaker_reset_s=60)
    for _ in range(4):
        with pytest.raises(errors.OutcomeUnknown):
            await gw.charge(CHARGE)
        assert gw.available
    with pytest.raises(errors.OutcomeUnknown):
        await gw.charge(CHARGE)  # the second fresh failure in a row
    assert not gw.available


async def test_connection_refused_is_unavailable_a_reset_unknown() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request)

    with pytest.raises(errors.DependencyUnavailable):
        await adapter(refuse).charge(CHARGE)
    with pytest.raises(errors.OutcomeUnknown):
        await adapter(on_intents(reset)).charge(CHARGE)


async def test_a_customer_without_a_saved_card_is_declined_without_an_intent() -> None:
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/payment_methods":
            assert dict(request.url.params) == {"customer": "cus_42", "type": "card", "limit": "1"}
            return httpx.Response(200, json={"object": "list", "data": [], "has_more": False})
        bare = {"id": "cus_42", "object": "customer", "invoice_settings": {}}
        return httpx.Response(200, json=bare)

    result = await adapter(handler).charge(CHARGE)
    assert result == ChargeResult("declined", None, decline_code="no_payment_method")
    assert sent == ["GET /v1/customers/cus_42", "GET /v1/payment_methods"]


async def test_an_unknown_customer_is_rejected() -> None:
    missing = stripe_error(404, type="invalid_request_error", code="resource_missing")
    with pytest.raises(errors.GatewayRejected, match="no customer cus_42"):
        await adapter(lambda _: missing).charge(CHARGE)


@pytest.mark.parametrize("key", ["pk_test_public", "whsec_x", "sk-live-abc"])
def test_a_key_that_is_no_secret_key_fails_at_start_naming_the_setting(key: str) -> None:
    settings = GatewaySettings(kind="stripe", api_key=SecretStr(key))
    with pytest.raises(errors.SettingsError, match="GATEWAY_API_KEY") as caught:
        StripeGateway(settings)
    assert key not in str(caught.value)


async def test_a_lookup_lists_the_customers_intents_since_the_period_and_matches_metadata() -> None:
    seen: list[httpx.Request] = []
    other = {"order_id": "48291", "billing_period": "2026-08-01"}
    pages = [
        [intent(id="pi_3"), intent(id="pi_x", metadata=other)],
        [
            intent(
                id="pi_2",
                status="requires_payment_method",
                last_payment_error={"code": "card_declined"},
            )
        ],
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        data = pages[len(seen) - 1]
        return httpx.Response(
            200, json={"object": "list", "data": data, "has_more": len(seen) == 1}
        )

    found = await adapter(handler).lookup(48291, dt.date(2026, 9, 1), customer_id="cus_42")

    assert [(c.id, c.status) for c in found] == [("pi_2", "failed"), ("pi_3", "succeeded")]
    since = dt.datetime.combine(dt.date(2026, 9, 1) - LOOKUP_LEAD, dt.time(), dt.UTC)
    first, second = (dict(r.url.params) for r in seen)
    assert first == {
        "customer": "cus_42",
        "created[gte]": str(int(since.timestamp())),
        "limit": "100",
        "expand[0]": "data.latest_charge",
    }
    assert second == first | {"starting_after": "pi_x"}


async def test_a_lookup_without_the_customer_cannot_be_made() -> None:
    with pytest.raises(errors.OutcomeUnknown, match="needs the customer"):
        await adapter(lambda _: httpx.Response(500)).lookup(1, dt.date(2026, 9, 1))


async def test_history_is_a_window_newest_first_with_the_refunds() -> None:
    refunded = {"id": "ch_1", "amount_refunded": 99000, "refunded": True}

    def handler(request: httpx.Request) -> httpx.Response:
        assert dict(request.url.params) == {
            "created[gte]": "10",
            "created[lt]": "20",
            "limit": "2",
            "starting_after": "pi_9",
            "expand[0]": "data.latest_charge",
        }
        data = [intent(id="pi_8", latest_charge=refunded), intent(id="pi_7", status="processing")]
        return httpx.Response(200, json={"object": "list", "data": data, "has_more": True})

    page = await adapter(handler).history(
        created_gte=10, created_lt=20, starting_after="pi_9", limit=2
    )

    assert page.has_more
    assert [(c.id, c.status, c.captured, c.refunded) for c in page.charges] == [
        ("pi_8", "succeeded", False, True),
        ("pi_7", "processing", False, False),
    ]
    assert page.charges[0].fingerprint == "99000 EUR cus_42"


@pytest.mark.parametrize(
    "latest_charge",
    [{"id": "ch_1", "refunded": True}, {"id": "ch_1", "refunded": True, "amount_refunded": 10}],
)
async def test_a_charge_refunded_true_holds_no_money_whatever_amount_refunded_says(
    latest_charge: dict[str, Any],
) -> None:
    """Issue 34, item 12: `refunded: true` is a refund in full."""
    gw = adapter(lambda _: httpx.Response(200, json=intent(latest_charge=latest_charge)))

    found = await gw.retrieve("pi_1")

    assert found is not None
    assert (found.amount_refunded, found.refunded, found.captured) == (99000, True, False)


async def test_a_refund_names_the_intent_and_its_reason_and_is_keyed_by_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["Idempotency-Key"] == "refund:pi_1"
        assert form(request) == {"payment_intent": "pi_1", "reason": "duplicate"}
        return httpx.Response(200, json={"id": "re_1", "object": "refund"})

    assert await adapter(handler).refund("pi_1") == "re_1"
    already = stripe_error(400, type="invalid_request_error", code="charge_already_refunded")
    assert await adapter(lambda _: already).refund("pi_1") == "already"


async def test_an_idempotency_key_prefix_goes_on_the_intent_and_the_refund_key() -> None:
    """Issue 34, item 8: for an account shared with other integrations."""
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        if request.url.path == "/v1/refunds":
            return httpx.Response(200, json={"id": "re_1", "object": "refund"})
        return httpx.Response(200, json=intent())

    gw = adapter(on_intents(handler), idempotency_key_prefix="acme:")
    await gw.charge(CHARGE)
    await gw.refund("pi_1")

    assert keys == ["acme:48291:2026-09-01", "acme:refund:pi_1"]


async def test_retrieve_expands_the_charge_and_a_missing_intent_is_none() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/pi_gone"):
            return stripe_error(404, type="invalid_request_error", code="resource_missing")
        assert dict(request.url.params) == {"expand[0]": "latest_charge"}
        return httpx.Response(200, json=intent())

    gw = adapter(handler)
    found = await gw.retrieve("pi_1")
    assert found is not None
    assert (found.id, found.order_id, found.billing_period) == ("pi_1", "48291", "2026-09-01")
    assert await gw.retrieve("pi_gone") is None
    assert gw.available
