"""Classification of every row of the gateway contract, over httpx.MockTransport."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
from pydantic import SecretStr

from charge_worker import errors
from charge_worker.gateway import ChargeResult, ContractGateway
from charge_worker.gateway.contract import LOOKUP_MAX_PAGES
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings

CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 48291,
        "billing_period": dt.date(2026, 9, 1),
        "subscription_id": "sub_7Q2",
        "customer_id": "cus_42",
        "amount_minor": 99000,
        "currency": "RUB",
        "due_at": dt.datetime(2026, 9, 1, tzinfo=dt.UTC),
    },
    strict=False,
)
OK = {
    "id": "ch_1",
    "status": "succeeded",
    "amount": 99000,
    "currency": "RUB",
    "customer": "cus_42",
    "metadata": {},
    "created": 1,
}


Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def client(handler: Handler, **cfg: object) -> ContractGateway:
    settings = GatewaySettings(
        url="http://127.0.0.1",
        api_key=SecretStr("sk_test_x"),
        **cfg,  # type: ignore[arg-type]
    )
    return ContractGateway(settings, transport=httpx.MockTransport(handler))


def answer(status: int, body: object = None, **headers: str) -> Callable[..., httpx.Response]:
    return lambda request: httpx.Response(status, json=body, headers=headers)


def err(type_: str, code: str) -> dict[str, object]:
    return {"error": {"type": type_, "code": code, "message": "m"}}


async def test_sends_key_auth_traceparent_and_integer_amount() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=OK)

    gw = client(handler)
    result = await gw.charge(CHARGE, traceparent="00-abc-def-01")
    assert result == ChargeResult("succeeded", "ch_1")
    request = seen[0]
    assert request.headers["Idempotency-Key"] == "48291:2026-09-01"
    assert request.headers["Authorization"] == "Bearer sk_test_x"
    assert request.headers["traceparent"] == "00-abc-def-01"
    body = json.loads(request.content)
    assert body["amount"] == 99000
    assert body["metadata"] == {"order_id": "48291", "billing_period": "2026-09-01"}
    await gw.aclose()


async def test_replay_is_success_and_marked() -> None:
    gw = client(answer(200, OK, **{"Idempotent-Replayed": "true"}))
    assert await gw.charge(CHARGE) == ChargeResult("succeeded", "ch_1", replayed=True)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"code": "card_declined", "decline_code": "insufficient_funds"}, "insufficient_funds"),
        ({"code": "card_declined", "decline_code": "stolen_card"}, "stolen_card"),
        ({"code": "card_declined"}, None),  # the contract: absent is a generic decline
        ({"code": "card_declined", "decline_code": ""}, None),
        ({"code": "authentication_required"}, "authentication_required"),  # the older form
        ({}, None),
    ],
)
async def test_decline_is_a_result_with_the_contracts_decline_code(
    error: dict[str, str], code: str | None
) -> None:
    body = {"error": {"type": "card_error", "message": "m", "charge": "ch_9", **error}}
    gw = client(answer(402, body))
    assert await gw.charge(CHARGE) == ChargeResult("declined", None, decline_code=code)


@pytest.mark.parametrize(
    ("status", "body", "headers", "expected"),
    [
        (409, err("idempotency_error", "request_in_progress"), {}, errors.RequestInProgress),
        (429, err("rate_limit_error", "rate_limited"), {"Retry-After": "7"}, errors.RateLimited),
        (400, err("idempotency_error", "key_reused"), {}, errors.GatewayRejected),
        (400, err("invalid_request_error", "parameter_invalid"), {}, errors.GatewayRejected),
        (422, err("invalid_request_error", "parameter_invalid"), {}, errors.GatewayRejected),
        (401, err("authentication_error", "bad_key"), {}, errors.DependencyUnavailable),
        (500, None, {}, errors.OutcomeUnknown),
        (502, None, {}, errors.OutcomeUnknown),
        (503, None, {}, errors.OutcomeUnknown),
        (200, {"status": "weird"}, {}, errors.OutcomeUnknown),
    ],
)
async def test_error_rows(
    status: int, body: object, headers: dict[str, str], expected: type[Exception]
) -> None:
    gw = client(answer(status, body, **headers))
    with pytest.raises(expected):
        await gw.charge(CHARGE)


NOT_ACCEPTED = [
    (404, err("invalid_request_error", "resource_missing")),
    (404, None),
    (405, None),
    (408, None),
    (413, err("invalid_request_error", "too_large")),
    (418, None),
    (400, None),  # a proxy's bare 400: not the gateway's verdict
    (422, {"message": "unprocessable"}),
    (400, err("api_error", "bad_request")),
    (422, {"error": "not an object"}),
]


@pytest.mark.parametrize(("status", "body"), NOT_ACCEPTED)
async def test_any_other_4xx_is_not_accepted_never_a_final_rejection(
    status: int, body: object
) -> None:
    """docs/contracts/gateway.md: only 400/422 with the contract's error body (invalid request,
    idempotency) are final; any other 4xx, or those without it, mean "not accepted,
    nothing charged, try later" and count toward the breaker."""
    gw = client(answer(status, body), gateway_breaker_failures=2, gateway_breaker_reset_s=60)
    for _ in range(2):
        with pytest.raises(errors.DependencyUnavailable, match=f"gateway answered {status}"):
            await gw.charge(CHARGE)
    assert not gw.available
    with pytest.raises(errors.DependencyUnavailable, match="breaker open"):
        await gw.lookup(48291, dt.date(2026, 9, 1))


@pytest.mark.parametrize("status", [401, 403])
async def test_wrong_credentials_open_the_breaker(status: int) -> None:
    gw = client(answer(status, err("authentication_error", "x")), gateway_breaker_failures=2)
    for _ in range(2):
        with pytest.raises(errors.DependencyUnavailable, match="GATEWAY_API_KEY"):
            await gw.charge(CHARGE)
    assert not gw.available


async def test_final_rejections_do_not_open_the_breaker() -> None:
    gw = client(answer(400, err("idempotency_error", "key_reused")), gateway_breaker_failures=2)
    for _ in range(3):
        with pytest.raises(errors.GatewayRejected):
            await gw.charge(CHARGE)
    assert gw.available


async def test_rate_limit_carries_retry_after() -> None:
    gw = client(answer(429, err("rate_limit_error", "x"), **{"Retry-After": "7"}))
    with pytest.raises(errors.RateLimited) as caught:
        await gw.charge(CHARGE)
    assert caught.value.retry_after_s == 7


@pytest.mark.parametrize(
    ("header", "delay"),
    [("inf", 1.0), ("nan", 1.0), ("-inf", 1.0), ("soon", 1.0), ("-5", 0.0), ("1e12", 1e12)],
)
async def test_retry_after_that_is_no_finite_number_is_the_default(
    header: str, delay: float
) -> None:
    """Non-finite or unreadable: the default; how long is too long the decisions clamp."""
    gw = client(answer(429, err("rate_limit_error", "x"), **{"Retry-After": header}))
    with pytest.raises(errors.RateLimited) as caught:
        await gw.charge(CHARGE)
    assert caught.value.retry_after_s == delay


async def test_connection_refused_is_unavailable_other_transport_errors_unknown() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request)

    with pytest.raises(errors.DependencyUnavailable):
        await client(refuse).charge(CHARGE)
    with pytest.raises(errors.OutcomeUnknown):
        await client(reset).charge(CHARGE)


def silent(sent: asyncio.Event) -> Handler:
    """A gateway that takes the request and never answers."""

    async def handler(request: httpx.Request) -> httpx.Response:
        sent.set()
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    return handler


async def test_a_call_past_its_deadline_is_unknown_and_counts_toward_the_breaker() -> None:
    """The deadline bounds the whole call (httpx's timeout bounds each phase of it)."""
    sent = asyncio.Event()
    gw = client(silent(sent), gateway_timeout_s=0.05, gateway_breaker_failures=1)
    with pytest.raises(errors.OutcomeUnknown, match=r"no answer within 0\.05s") as caught:
        await gw.charge(CHARGE)
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert sent.is_set()
    assert not gw.available
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # uncancelled


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    """A shutdown cancelling a charge under way is neither a timeout nor a gateway failure."""
    sent = asyncio.Event()
    gw = client(silent(sent), gateway_breaker_failures=1)
    charging = asyncio.create_task(gw.charge(CHARGE))
    await sent.wait()
    charging.cancel()
    with pytest.raises(asyncio.CancelledError):
        await charging
    assert gw.available


async def test_breaker_opens_on_unknown_outcomes_only() -> None:
    gw = client(answer(503), gateway_breaker_failures=2, gateway_breaker_reset_s=60)
    declines = client(answer(402, err("card_error", "card_declined")), gateway_breaker_failures=2)
    for _ in range(3):
        await declines.charge(CHARGE)
    assert declines.available
    for _ in range(2):
        with pytest.raises(errors.OutcomeUnknown):
            await gw.charge(CHARGE)
    assert not gw.available
    with pytest.raises(errors.DependencyUnavailable, match="breaker open") as caught:
        await gw.charge(CHARGE)
    assert caught.value.retry_after_s is not None
    assert 0 < caught.value.retry_after_s <= 60


async def test_lookup_and_refund() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            assert request.url.params["order_id"] == "48291"
            assert request.url.params["billing_period"] == "2026-09-01"
            meta = {"order_id": "48291", "billing_period": "2026-09-01"}
            return httpx.Response(200, json={"data": [{**OK, "metadata": meta}], "has_more": False})
        charge_id = json.loads(request.content)["charge"]
        assert request.headers["Idempotency-Key"] == f"refund:{charge_id}"
        if charge_id == "ch_1":
            return httpx.Response(200, json={"id": "re_1", "charge": "ch_1", "status": "succeeded"})
        return httpx.Response(400, json=err("invalid_request_error", "charge_already_refunded"))

    gw = client(handler)
    found = await gw.lookup(48291, dt.date(2026, 9, 1))
    assert [(c.id, c.order_id, c.billing_period) for c in found] == [
        ("ch_1", "48291", "2026-09-01")
    ]
    assert await gw.refund("ch_1") == "re_1"
    assert await gw.refund("ch_2") == "already"


async def test_an_already_refunded_answer_without_a_type_is_done() -> None:
    """The contract's refund answer names only the code: `{"error": {"code": …}}`."""
    gw = client(answer(400, {"error": {"code": "charge_already_refunded"}}))
    assert await gw.refund("ch_1") == "already"
    assert gw.available


async def test_a_charge_shows_its_refund_and_whether_money_is_still_captured() -> None:
    """docs/contracts/gateway.md, "Refunds": a refunded charge keeps `status: "succeeded"`."""
    meta = {"order_id": "48291", "billing_period": "2026-09-01"}
    refunded = {**OK, "id": "ch_r", "metadata": meta, "amount_refunded": 99000, "refunded": True}
    partly = {**OK, "id": "ch_p", "metadata": meta, "amount_refunded": 1000, "refunded": False}
    older = {**OK, "id": "ch_o", "metadata": meta, "status": "refunded"}  # before the contract
    gw = client(answer(200, {"data": [OK, refunded, partly, older], "has_more": False}))

    found = await gw.lookup(48291, dt.date(2026, 9, 1))

    assert [(c.id, c.status, c.amount_refunded, c.refunded) for c in found] == [
        ("ch_1", "succeeded", 0, False),
        ("ch_r", "succeeded", 99000, True),
        ("ch_p", "succeeded", 1000, False),
        ("ch_o", "succeeded", 99000, True),
    ]
    assert [(c.charged, c.captured) for c in found] == [
        (True, True),
        (True, False),
        (True, True),
        (True, False),
    ]


@pytest.mark.parametrize("amount_refunded", [None, 0, 1000])
async def test_refunded_true_means_in_full_whatever_amount_refunded_says(
    amount_refunded: int | None,
) -> None:
    """Issue 34, item 12: `refunded: true` without `amount_refunded` (or with less than the
    amount) holds no money, or reconcile refunds it again on every run."""
    meta = {"order_id": "48291", "billing_period": "2026-09-01"}
    charge = {**OK, "id": "ch_r", "metadata": meta, "refunded": True}
    if amount_refunded is not None:
        charge["amount_refunded"] = amount_refunded
    gw = client(answer(200, {"data": [charge], "has_more": False}))

    [found] = await gw.lookup(48291, dt.date(2026, 9, 1))

    assert (found.amount_refunded, found.refunded, found.captured) == (99000, True, False)


async def test_a_lookup_pages_through_every_charge_of_the_key() -> None:
    """Issue 34, item 9: a key with more than a page of charges has its later doubles found."""
    meta = {"order_id": "48291", "billing_period": "2026-09-01"}
    pages = {
        None: ([{**OK, "id": "ch_1", "metadata": meta}], True),
        "ch_1": ([{**OK, "id": "ch_2", "metadata": meta}], True),
        "ch_2": ([{**OK, "id": "ch_3", "metadata": meta}], False),
    }
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        seen.append(params)
        data, has_more = pages[params.get("starting_after")]
        return httpx.Response(200, json={"data": data, "has_more": has_more})

    found = await client(handler).lookup(48291, dt.date(2026, 9, 1))

    assert [c.id for c in found] == ["ch_1", "ch_2", "ch_3"]
    key = {"order_id": "48291", "billing_period": "2026-09-01"}
    assert [{k: p[k] for k in key} for p in seen] == [key, key, key]
    assert [p.get("starting_after") for p in seen] == [None, "ch_1", "ch_2"]


async def test_a_lookup_that_never_ends_stops_as_an_unknown_outcome() -> None:
    count = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal count
        count += 1
        data = [{**OK, "id": f"ch_{count}"}]
        return httpx.Response(200, json={"data": data, "has_more": True})

    with pytest.raises(errors.OutcomeUnknown, match="pages"):
        await client(handler).lookup(48291, dt.date(2026, 9, 1))
    assert count == LOOKUP_MAX_PAGES


async def test_a_lookup_told_more_follows_an_empty_page_knows_nothing() -> None:
    gw = client(answer(200, {"data": [], "has_more": True}))
    with pytest.raises(errors.OutcomeUnknown, match="empty page"):
        await gw.lookup(48291, dt.date(2026, 9, 1))


async def test_a_replayed_5xx_is_unknown_but_no_new_failure_for_the_breaker() -> None:
    """Issue 34, item 8: the gateway replaying its first answer (a 5xx) to a retried key is
    not the gateway failing again: it neither counts toward the breaker nor ends a run."""
    answers = iter(["fresh", "replayed", "replayed", "replayed", "fresh"])

    def handler(request: httpx.Request) -> httpx.Response:
        replayed = next(answers) == "replayed"
        return httpx.Response(503, headers={"Idempotent-Replayed": "true"} if replayed else {})

    gw = client(handler, gateway_breaker_failures=2, gateway_breaker_reset_s=60)
    for _ in range(4):
        with pytest.raises(errors.OutcomeUnknown):
            await gw.charge(CHARGE)
        assert gw.available
    with pytest.raises(errors.OutcomeUnknown):
        await gw.charge(CHARGE)  # the second fresh failure in a row
    assert not gw.available


async def test_an_idempotency_key_prefix_goes_on_the_charge_and_the_refund_key() -> None:
    """Issue 34, item 8: for an account shared with other integrations."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/refunds":
            return httpx.Response(200, json={"id": "re_1", "charge": "ch_1"})
        return httpx.Response(200, json=OK)

    gw = client(handler, idempotency_key_prefix="acme:")
    await gw.charge(CHARGE)
    await gw.refund("ch_1")

    assert [r.headers["Idempotency-Key"] for r in seen] == [
        "acme:48291:2026-09-01",
        "acme:refund:ch_1",
    ]
    assert json.loads(seen[0].content)["metadata"] == {
        "order_id": "48291",
        "billing_period": "2026-09-01",
    }
