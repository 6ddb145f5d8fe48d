"""The adapter conformance suite: every `Gateway` adapter against a server speaking its wire
format, with the faults a provider really has injected by the simulator.

A new provider's adapter is done when it passes this module (docs/adapters.md): add its
flavour to `tests.support.providers.FLAVOURS` and a simulator of its wire format (or a
recorded fake) that injects the same faults. Each test states one guarantee of
`charge_worker.gateway.protocol`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from charge_worker import errors
from charge_worker.declines import decline_class
from charge_worker.gateway import AUTHENTICATION_REQUIRED, CARD_DECLINED, Gateway
from charge_worker.messages import ChargeDue
from charge_worker.sandbox.latency import LatencyModel
from tests.support.harness import eventually
from tests.support.providers import FLAVOURS, CountingLimiter, Provider, provider

PERIOD = dt.date(2026, 12, 1)


def due(
    order_id: int, customer: str = "cus_ok", amount: int = 99000, attempt: int = 1
) -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD,
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer,
            "amount_minor": amount,
            "currency": "EUR",
            "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
            "attempt": attempt,
        },
        strict=False,
    )


@pytest.fixture(params=FLAVOURS)
def sim(request: pytest.FixtureRequest) -> Iterator[Provider]:
    with provider(request.param) as served:
        yield served


@pytest.fixture
async def gateway(sim: Provider) -> AsyncIterator[Gateway]:
    adapter = sim.gateway()
    yield adapter
    await adapter.aclose()


async def lookup(gateway: Gateway, charge: ChargeDue) -> list[str]:
    found = await gateway.lookup(
        charge.order_id, charge.billing_period, customer_id=charge.customer_id
    )
    return [c.id for c in found if c.charged]


async def test_a_repeated_charge_is_a_replay_of_the_one_charge(
    sim: Provider, gateway: Gateway
) -> None:
    charge = due(1)
    first = await gateway.charge(charge)
    again = await gateway.charge(charge)

    assert (first.status, again.status, again.charge_id) == ("succeeded",) * 2 + (first.charge_id,)
    # a provider that marks replays marks this one (YooKassa marks none: None)
    assert first.replayed is not True
    assert again.replayed is not False
    assert await sim.made() == {charge.key: 1}
    assert await lookup(gateway, charge) == [first.charge_id]


async def test_an_answer_lost_after_the_charge_is_unknown_and_the_lookup_finds_it(
    sim: Provider, gateway: Gateway
) -> None:
    charge = due(2)
    await sim.configure(lost_answer_rate=1.0, lost_answer_mode="5xx")
    with pytest.raises(errors.OutcomeUnknown):
        await gateway.charge(charge)
    await sim.configure(lost_answer_rate=0.0)

    found = await lookup(gateway, charge)  # read-your-writes: at once
    again = await gateway.charge(charge)

    assert len(found) == 1
    assert (again.charge_id, again.replayed is not False) == (found[0], True)
    assert await sim.made() == {charge.key: 1}


async def test_an_answer_that_never_comes_is_unknown_within_the_deadline(sim: Provider) -> None:
    gateway = sim.gateway(gateway_timeout_s=1.0)
    await sim.configure(lost_answer_rate=1.0, lost_answer_mode="timeout", lost_answer_delay_s=30)
    started = time.monotonic()
    with pytest.raises(errors.OutcomeUnknown):
        await gateway.charge(due(3))
    await gateway.aclose()
    assert time.monotonic() - started < 10  # the total deadline, not the lost answer's 30 s
    assert await sim.made() == {due(3).key: 1}


async def test_a_5xx_before_anything_is_unknown_and_charges_nothing(
    sim: Provider, gateway: Gateway
) -> None:
    charge = due(4)
    await sim.configure(error_rates={503: 1.0})
    # unknown; or unavailable, where a read the charge makes first failed: never final
    with pytest.raises((errors.OutcomeUnknown, errors.DependencyUnavailable)):
        await gateway.charge(charge)
    await sim.configure(error_rates={})

    assert await lookup(gateway, charge) == []
    assert (await gateway.charge(charge)).status == "succeeded"
    assert await sim.made() == {charge.key: 1}


async def test_a_key_still_executing_is_in_progress(sim: Provider, gateway: Gateway) -> None:
    charge = due(5)
    await sim.configure(latency=LatencyModel(fixed_s=1.5).model_dump())
    first = asyncio.create_task(gateway.charge(charge))
    await asyncio.sleep(0.5)
    with pytest.raises(errors.RequestInProgress) as caught:
        await gateway.charge(charge)
    assert (await first).status == "succeeded"
    assert caught.value.retry_after_s is not None
    assert await sim.made() == {charge.key: 1}


async def test_429_carries_its_retry_after(sim: Provider, gateway: Gateway) -> None:
    await sim.configure(error_rates={429: 1.0}, retry_after_s=7)
    with pytest.raises(errors.RateLimited) as caught:
        await gateway.charge(due(6))
    assert caught.value.retry_after_s == 7
    assert gateway.available  # the provider asked us to slow down: it is not down
    assert await sim.made() == {}


async def test_a_key_reused_with_other_parameters_is_rejected(
    sim: Provider, gateway: Gateway
) -> None:
    await gateway.charge(due(7, amount=1000))
    with pytest.raises(errors.GatewayRejected):
        await gateway.charge(due(7, amount=2000))
    assert gateway.available
    assert await sim.made() == {due(7).key: 1}


@pytest.mark.parametrize(
    ("customer", "kind"),
    [("cus_decline_1", CARD_DECLINED), ("cus_auth_1", AUTHENTICATION_REQUIRED)],
)
async def test_a_decline_is_a_result_of_its_own_kind(
    sim: Provider, gateway: Gateway, customer: str, kind: str
) -> None:
    charge = due(8, customer=customer)
    result = await gateway.charge(charge)
    again = await gateway.charge(charge)

    assert (result.status, result.decline_kind) == ("declined", kind)
    assert result.decline_code == sim.declines[customer]  # the provider's own name for it
    assert (again.status, again.decline_kind) == ("declined", kind)
    found = await gateway.lookup(8, PERIOD, customer_id=customer)
    assert [c.status for c in found] == ["failed"]
    assert gateway.available
    assert await sim.made() == {}


async def test_try_2_of_a_declined_period_has_its_own_key_and_attempt_and_can_succeed(
    sim: Provider, gateway: Gateway
) -> None:
    customer = "cus_soft2_20"  # the simulator declines try 1 softly, charges try 2
    first = await gateway.charge(due(20, customer))
    second = await gateway.charge(due(20, customer, attempt=2))
    again = await gateway.charge(due(20, customer, attempt=2))

    assert (first.status, first.decline_code) == ("declined", "insufficient_funds")
    assert (second.status, second.replayed is not True) == ("succeeded", True)
    assert (again.charge_id, again.replayed is not False) == (second.charge_id, True)
    period = [c for c in await sim.charges() if c["metadata"]["order_id"] == "20"]
    assert [(c["idempotency_key"], c["metadata"].get("attempt"), c["status"]) for c in period] == [
        (f"20:{PERIOD}", None, "failed"),  # try 1: the request from before retries
        (f"20:{PERIOD}:2", "2", "succeeded"),
    ]
    assert await sim.made() == {due(20, attempt=2).key: 1}


async def test_a_lookup_of_the_period_lists_every_trys_charge_with_its_attempt(
    sim: Provider, gateway: Gateway
) -> None:
    customer = "cus_soft3_21"
    results = [await gateway.charge(due(21, customer, attempt=n)) for n in (1, 2, 3)]

    found = await gateway.lookup(21, PERIOD, customer_id=customer)

    assert [r.status for r in results] == ["declined", "declined", "succeeded"]
    assert [(c.attempt, c.status, c.decline_code) for c in found] == [
        (1, "failed", "insufficient_funds"),
        (2, "failed", "insufficient_funds"),
        (3, "succeeded", None),
    ]
    assert found[-1].id == results[-1].charge_id
    assert [c.id for c in found if c.captured] == [results[-1].charge_id]


async def test_a_declines_code_and_class_reach_the_result_and_the_lookup(
    sim: Provider, gateway: Gateway
) -> None:
    classes = []
    for order_id, (customer, code) in enumerate(sim.declines.items(), start=22):
        result = await gateway.charge(due(order_id, customer))
        [found] = await gateway.lookup(order_id, PERIOD, customer_id=customer)

        assert (result.status, result.decline_code) == ("declined", code)
        assert (found.status, found.decline_code, found.attempt) == ("failed", code, 1)
        classes.append(decline_class(result.decline_code))
    # each flavour's cases, in its provider's own codes: three soft (one its generic
    # decline), two for the customer (one the bank's authentication), two hard
    assert classes == ["soft"] * 3 + ["customer_action"] * 2 + ["hard"] * 2
    assert await sim.made() == {}


async def test_history_pages_every_charge_once_in_the_adapters_order(
    sim: Provider, gateway: Gateway
) -> None:
    made = [
        (await gateway.charge(due(100 + n, customer=f"cus_h{n % 2}"))).charge_id for n in range(7)
    ]
    now = int(time.time())

    seen: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        page = await gateway.history(
            created_gte=now - 3600, created_lt=now + 3600, starting_after=after, limit=3
        )
        pages += 1
        seen += [c.id for c in page.charges]
        if not page.has_more:
            break
        after = page.next_after

    assert pages == 3
    expected = made if gateway.history_order == "oldest_first" else made[::-1]
    assert seen == expected
    empty = await gateway.history(created_gte=now + 3600, created_lt=now + 7200)
    assert (empty.charges, empty.has_more) == ([], False)


async def test_a_refund_is_made_once_however_often_it_is_asked_for(
    sim: Provider, gateway: Gateway
) -> None:
    charge = due(9)
    made = await gateway.charge(charge)
    assert made.charge_id is not None

    refund = await gateway.refund(made.charge_id)
    again = await gateway.refund(made.charge_id)  # its key replays, or the charge says so

    assert refund not in ("", "already")
    assert again in (refund, "already")
    assert (await sim.stats())["refunds"] == 1
    [found] = await gateway.lookup(9, PERIOD, customer_id=charge.customer_id)
    assert (found.charged, found.captured, found.refunded) == (True, False, True)
    assert found.amount_refunded == found.amount == charge.amount_minor


async def test_every_request_spends_a_token_of_the_fleets_rate(sim: Provider) -> None:
    limiter = CountingLimiter()
    gateway = sim.gateway(limiter=limiter)
    charge = due(10)
    made = await gateway.charge(charge)
    await lookup(gateway, charge)
    await gateway.history(created_gte=0, created_lt=int(time.time()) + 60)
    assert made.charge_id is not None
    await gateway.refund(made.charge_id)
    assert await gateway.probe()
    await gateway.aclose()

    assert limiter.spent == (await sim.stats())["requests"]


async def test_a_charge_shows_amount_currency_customer_and_metadata(
    sim: Provider, gateway: Gateway
) -> None:
    charge = due(11, customer="cus_show", amount=12345)
    made = await gateway.charge(charge)
    [found] = await gateway.lookup(11, PERIOD, customer_id="cus_show")

    assert found.id == made.charge_id
    assert found.fingerprint == "12345 EUR cus_show"  # as the ledger spells it
    assert (found.order_id, found.billing_period) == ("11", PERIOD.isoformat())
    assert abs(found.created - time.time()) < 60


async def test_a_wrong_api_key_is_unavailable_and_opens_the_breaker(sim: Provider) -> None:
    gateway = sim.gateway(api_key=sim.wrong_api_key, gateway_breaker_failures=2)
    for _ in range(2):
        with pytest.raises(errors.DependencyUnavailable, match="GATEWAY_API_KEY"):
            await gateway.charge(due(12))
    assert not gateway.available
    with pytest.raises(errors.DependencyUnavailable, match="breaker open"):
        await gateway.charge(due(12))
    await gateway.aclose()
    assert await sim.made() == {}


async def test_an_unreachable_provider_is_unavailable(sim: Provider) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    gateway = sim.gateway(url=f"http://127.0.0.1:{port}")
    with pytest.raises(errors.DependencyUnavailable):
        await gateway.charge(due(13))
    assert not await gateway.probe()
    await gateway.aclose()


async def test_retrieve_is_the_charge_now_where_webhooks_need_it(
    sim: Provider, gateway: Gateway
) -> None:
    if not gateway.reads_by_id:
        pytest.skip("contracts/gateway.md reads no charge by id: its webhooks carry it whole")
    charge = due(14)
    made = await gateway.charge(charge)
    assert made.charge_id is not None
    await gateway.refund(made.charge_id)

    found = await gateway.retrieve(made.charge_id)

    assert found is not None
    assert (found.id, found.refunded, found.order_id) == (made.charge_id, True, "14")
    assert await gateway.retrieve(made.charge_id[:3] + "missing") is None


async def test_a_refund_asked_for_again_after_its_key_expired_is_already_done(
    sim: Provider, gateway: Gateway
) -> None:
    made = await gateway.charge(due(15))
    assert made.charge_id is not None
    charge_id = made.charge_id
    await sim.configure(key_retention_s=0.001)  # keys claimed from now on
    await gateway.refund(charge_id)

    async def already() -> bool:  # once the key is forgotten the charge itself answers
        return await gateway.refund(charge_id) == "already"

    await eventually(already, "the refund's key expired")
    assert (await sim.stats())["refunds"] == 1


async def test_processing_is_open_never_final_and_settles_later(
    sim: Provider, gateway: Gateway
) -> None:
    if gateway.kind == "contract":
        pytest.skip("contracts/gateway.md has no processing state: a charge succeeds or fails")
    charge = due(16, customer="cus_processing_1")
    result = await gateway.charge(charge)
    assert (result.status, result.decline_kind) == ("processing", None)
    assert result.charge_id is not None
    charge_id = result.charge_id
    [found] = await gateway.lookup(16, PERIOD, customer_id=charge.customer_id)
    assert found.processing
    assert not found.charged

    async def settled() -> bool:
        now = await gateway.retrieve(charge_id)
        return now is not None and now.charged

    await eventually(settled, "the bank debit settled")
    assert await sim.made() == {charge.key: 1}
