"""The scoring client's deadline and failures, over httpx.MockTransport: a failure is a
reason, never an exception, except a cancellation, which is the caller's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from charge_worker.scoring import ScoringClient, ScoringFailure, Verdict
from charge_worker.settings import ScoringSettings

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def scoring(handler: Handler, **cfg: object) -> ScoringClient:
    settings = ScoringSettings(url="http://scoring", **cfg)  # type: ignore[arg-type]
    return ScoringClient(settings, transport=httpx.MockTransport(handler))


async def score(client: ScoringClient) -> Verdict | ScoringFailure:
    return await client.score(
        order_id=48291, customer_id="cus_42", amount_minor=99000, currency="RUB"
    )


def silent(asked: asyncio.Event) -> Handler:
    """A scoring service that takes the request and never answers."""

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.set()
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    return handler


async def test_a_verdict() -> None:
    client = scoring(lambda request: httpx.Response(200, json={"decision": "block", "score": 1}))
    assert await score(client) == Verdict("block", 1.0)
    await client.aclose()


async def test_a_call_past_its_deadline_is_a_failure_that_counts_toward_the_breaker() -> None:
    asked = asyncio.Event()
    client = scoring(silent(asked), scoring_timeout_s=0.05, scoring_breaker_failures=1)
    failure = await score(client)
    assert failure == ScoringFailure("scoring timed out after 0.05s")
    assert asked.is_set()
    assert not client.available
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # uncancelled
    await client.aclose()


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    """A shutdown cancelling a call under way: no failure reason, no failure counted."""
    asked = asyncio.Event()
    client = scoring(silent(asked), scoring_breaker_failures=1)
    scored = asyncio.create_task(score(client))
    await asked.wait()
    scored.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scored
    assert client.available
    await client.aclose()


async def test_an_unreachable_service_is_a_failure_saying_so() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = scoring(refuse)
    failure = await score(client)
    assert isinstance(failure, ScoringFailure)
    assert failure.reason.startswith("scoring unreachable: ConnectError")
    await client.aclose()
