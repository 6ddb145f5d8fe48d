"""Reconcile's paging through the gateway's history (oldest first, or Stripe's newest
first), over httpx.MockTransport."""

from __future__ import annotations

import datetime as dt
import gc
import tracemalloc
from collections.abc import Callable

import httpx
import pytest
from pydantic import SecretStr

from charge_worker.errors import DependencyUnavailable
from charge_worker.gateway import ContractGateway, GatewayCharge
from charge_worker.gateway.stripe import StripeGateway
from charge_worker.reconcile.history import PAGE_SIZE, PROGRESS_PAGES, pages
from charge_worker.settings import GatewaySettings

SINCE = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
UNTIL = SINCE + dt.timedelta(days=2)


def charge(n: int) -> dict[str, object]:
    return {
        "id": f"ch_{n:06d}",
        "status": "succeeded",
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_ok",
        "metadata": {"order_id": str(n), "billing_period": "2026-12-01"},
        "created": int(SINCE.timestamp()) + n // 10,
    }


CHARGES = [charge(n) for n in range(250)]
Pages = Callable[[str | None], tuple[list[dict[str, object]], bool]]


def gateway(answer: Pages) -> ContractGateway:
    """A gateway whose history answers `answer(starting_after)`."""

    def handler(request: httpx.Request) -> httpx.Response:
        data, has_more = answer(request.url.params.get("starting_after"))
        return httpx.Response(200, json={"data": data, "has_more": has_more})

    settings = GatewaySettings(url="http://127.0.0.1", api_key=SecretStr("sk_test_x"))
    return ContractGateway(settings, transport=httpx.MockTransport(handler))


def honest(charges: list[dict[str, object]]) -> Pages:
    def answer(after: str | None) -> tuple[list[dict[str, object]], bool]:
        start = 0 if after is None else int(after.removeprefix("ch_")) + 1
        return charges[start : start + PAGE_SIZE], start + PAGE_SIZE < len(charges)

    return answer


async def read_all(client: ContractGateway, lines: list[str] | None = None) -> list[list[str]]:
    progress = (lines if lines is not None else []).append
    return [
        [c.id for c in page]
        async for page in pages(client, since=SINCE, until=UNTIL, progress=progress)
    ]


async def test_an_honest_gateway_is_paged_through_once() -> None:
    lines: list[str] = []
    read = await read_all(gateway(honest(CHARGES)), lines)
    assert [len(page) for page in read] == [100, 100, 50]
    assert [c for page in read for c in page] == [c["id"] for c in CHARGES]
    assert lines == ["reconcile: gateway history page 3, 250 charges"]  # the last of several


async def test_progress_every_hundred_pages_on_a_long_history() -> None:
    lines: list[str] = []
    many = [charge(n) for n in range(PAGE_SIZE * PROGRESS_PAGES + 1)]
    await read_all(gateway(honest(many)), lines)
    assert lines == [
        f"reconcile: gateway history page {PROGRESS_PAGES}, {PAGE_SIZE * PROGRESS_PAGES} charges",
        f"reconcile: gateway history page {PROGRESS_PAGES + 1}, {len(many)} charges",
    ]


async def test_one_page_at_a_time_is_held_however_long_the_history() -> None:
    """The issue: a whole window in memory (~1.1 KB per charge, 1.13 GB at 1M). Paging
    10,000 charges holds one page, so it takes about what paging 1,000 does (holding
    9,000 more charges would take ~5 MB more)."""

    async def peak(count: int) -> int:
        client = gateway(honest([charge(n) for n in range(count)]))
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            async for page in pages(client, since=SINCE, until=UNTIL):
                assert all(isinstance(c, GatewayCharge) for c in page)
                # httpx keeps each response in reference cycles until the collector runs,
                # whose timing differs by interpreter: collect, so the peak counts pages held.
                # The young generations only: a page's cycles are that young, and a full
                # collection walks the test process's whole heap at every page (over 80 % of
                # this test's time: 83 s in make test's parallel run).
                gc.collect(1)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # the least of two runs each: tracemalloc counts every thread's allocations, and a
    # test runner's own threads (pytest-xdist's channel) allocate while a run is measured
    small = min([await peak(1_000), await peak(1_000)])
    large = min([await peak(10_000), await peak(10_000)])
    assert large - small < 2_000_000, (small, large)


async def test_a_gateway_that_ignores_starting_after_stops_the_run() -> None:
    """It would answer the first page forever (27,000 pages in 15 s)."""
    asked: list[str | None] = []

    def first_page_forever(after: str | None) -> tuple[list[dict[str, object]], bool]:
        asked.append(after)
        return CHARGES[:PAGE_SIZE], True

    with pytest.raises(DependencyUnavailable, match="starting_after") as caught:
        await read_all(gateway(first_page_forever))
    assert len(asked) == 2
    assert "ch_000099" in str(caught.value)


async def test_a_page_that_repeats_charges_already_read_stops_the_run() -> None:
    """The cursor moves, but the gateway sends charges it sent before: paging is broken."""

    def overlapping(after: str | None) -> tuple[list[dict[str, object]], bool]:
        if after is None:
            return CHARGES[:PAGE_SIZE], True
        start = int(after.removeprefix("ch_")) + 1
        return CHARGES[start - 1 : start + PAGE_SIZE - 1], True

    with pytest.raises(DependencyUnavailable, match="again"):
        await read_all(gateway(overlapping))


async def test_a_page_older_than_the_one_before_stops_the_run() -> None:
    """Oldest first: a page that goes back in time is a cursor the gateway lost."""

    def back_to_the_start(after: str | None) -> tuple[list[dict[str, object]], bool]:
        if after is None:
            return CHARGES[100:200], True
        return CHARGES[:100], True

    with pytest.raises(DependencyUnavailable, match="older"):
        await read_all(gateway(back_to_the_start))


def intent(n: int) -> dict[str, object]:
    """A Stripe PaymentIntent standing for `charge(n)`."""
    return charge(n) | {
        "id": f"pi_{n:06d}",
        "object": "payment_intent",
        "currency": "rub",
        "latest_charge": {"id": f"ch_{n:06d}", "amount_refunded": 0, "refunded": False},
    }


def stripe_gateway(answer: Pages) -> StripeGateway:
    """A Stripe adapter whose PaymentIntent list answers `answer(starting_after)`."""

    def handler(request: httpx.Request) -> httpx.Response:
        data, has_more = answer(request.url.params.get("starting_after"))
        return httpx.Response(200, json={"object": "list", "data": data, "has_more": has_more})

    settings = GatewaySettings(kind="stripe", url="http://127.0.0.1", api_key=SecretStr("sk_x"))
    return StripeGateway(settings, transport=httpx.MockTransport(handler))


NEWEST_FIRST = [intent(n) for n in reversed(range(250))]


def honest_newest_first(after: str | None) -> tuple[list[dict[str, object]], bool]:
    start = 0 if after is None else 250 - int(after.removeprefix("pi_"))
    return NEWEST_FIRST[start : start + PAGE_SIZE], start + PAGE_SIZE < 250


async def test_a_history_newest_first_is_paged_through_once() -> None:
    """Stripe lists newest first: the paging goes back in time, page by page."""
    read = [
        [c.id for c in page]
        async for page in pages(stripe_gateway(honest_newest_first), since=SINCE, until=UNTIL)
    ]
    assert [len(page) for page in read] == [100, 100, 50]
    assert [c for page in read for c in page] == [c["id"] for c in NEWEST_FIRST]


async def test_a_page_newer_than_the_one_before_stops_a_newest_first_run() -> None:
    def forward_again(after: str | None) -> tuple[list[dict[str, object]], bool]:
        if after is None:
            return NEWEST_FIRST[100:200], True
        return NEWEST_FIRST[:100], True

    with pytest.raises(DependencyUnavailable, match="newer"):
        async for _ in pages(stripe_gateway(forward_again), since=SINCE, until=UNTIL):
            pass
