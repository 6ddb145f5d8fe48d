"""Reconcile's paging through the gateway's history, over httpx.MockTransport."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import httpx
import pytest
from pydantic import SecretStr

from charge_worker.errors import DependencyUnavailable
from charge_worker.gateway import GatewayClient
from charge_worker.reconcile.history import PAGE_SIZE, fetch_history
from charge_worker.settings import GatewaySettings

SINCE = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
UNTIL = SINCE + dt.timedelta(days=2)


def charge(n: int) -> dict[str, object]:
    return {
        "id": f"ch_{n:04d}",
        "status": "succeeded",
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_ok",
        "metadata": {"order_id": str(n), "billing_period": "2026-12-01"},
        "created": int(SINCE.timestamp()) + n,
    }


CHARGES = [charge(n) for n in range(250)]


def gateway(pages: Callable[[str | None], tuple[list[dict[str, object]], bool]]) -> GatewayClient:
    """A gateway whose history answers `pages(starting_after)`; it counts its requests."""

    def handler(request: httpx.Request) -> httpx.Response:
        data, has_more = pages(request.url.params.get("starting_after"))
        return httpx.Response(200, json={"data": data, "has_more": has_more})

    settings = GatewaySettings(url="http://gateway.test", api_key=SecretStr("sk_test_x"))
    return GatewayClient(settings, transport=httpx.MockTransport(handler))


def honest(after: str | None) -> tuple[list[dict[str, object]], bool]:
    start = 0 if after is None else next(i for i, c in enumerate(CHARGES) if c["id"] == after) + 1
    return CHARGES[start : start + PAGE_SIZE], start + PAGE_SIZE < len(CHARGES)


async def test_an_honest_gateway_is_paged_through_once() -> None:
    history = await fetch_history(gateway(honest), since=SINCE, until=UNTIL)
    assert (history.pages, len(history.charges)) == (3, 250)


async def test_a_gateway_that_ignores_starting_after_stops_the_run() -> None:
    """It would answer the first page forever (27,000 pages in 15 s)."""
    asked: list[str | None] = []

    def first_page_forever(after: str | None) -> tuple[list[dict[str, object]], bool]:
        asked.append(after)
        return CHARGES[:PAGE_SIZE], True

    with pytest.raises(DependencyUnavailable, match="starting_after") as caught:
        await fetch_history(gateway(first_page_forever), since=SINCE, until=UNTIL)
    assert len(asked) == 2
    assert "ch_0099" in str(caught.value)


async def test_a_page_that_repeats_charges_already_read_stops_the_run() -> None:
    """The cursor moves, but the gateway sends charges it sent before: paging is broken."""

    def overlapping(after: str | None) -> tuple[list[dict[str, object]], bool]:
        if after is None:
            return CHARGES[:PAGE_SIZE], True
        start = next(i for i, c in enumerate(CHARGES) if c["id"] == after) + 1
        return CHARGES[start - 1 : start + PAGE_SIZE - 1], True

    with pytest.raises(DependencyUnavailable, match="again"):
        await fetch_history(gateway(overlapping), since=SINCE, until=UNTIL)
