"""What the project's HTTP client (`http.build_client`: httpx's API on aiohttp's transport)
tells apart against real sockets: a request never sent (no connection was made: retried as
"not charged") from one whose answer was lost once it was sent (the outcome unknown, looked
up before any retry). Both adapters classify on it (`guard.never_sent`), the Stripe SDK's
errors through their `__cause__`. A connect that times out is taken for an unknown outcome
(the safe side: looked up before anything is sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import httpx
import pytest
import stripe
from pydantic import SecretStr

from charge_worker import errors
from charge_worker.gateway import ContractGateway
from charge_worker.gateway.guard import never_sent
from charge_worker.gateway.stripe_http import OwnedHTTPClient
from charge_worker.gateway.stripe_mapping import domain_error
from charge_worker.http import build_client
from charge_worker.messages import ChargeDue
from charge_worker.settings import GatewaySettings

CHARGE = ChargeDue.model_validate(
    {
        "schema": "charge.due/v1",
        "order_id": 7,
        "billing_period": dt.date(2026, 12, 1),
        "subscription_id": "sub_7",
        "customer_id": "cus_7",
        "amount_minor": 99000,
        "currency": "EUR",
        "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    },
    strict=False,
)


@dataclass
class Listener:
    """A TCP server that reads each request whole, then drops the connection or stays
    silent until the test ends."""

    then: Literal["drop", "silence"]
    received: list[bytes] = field(default_factory=list)
    got_one: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        self.received.append(head + await reader.readexactly(length))
        self.got_one.set()
        if self.then == "silence":
            await self.release.wait()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def listening(then: Literal["drop", "silence"]) -> AsyncIterator[tuple[str, Listener]]:
    listener = Listener(then)
    server = await asyncio.start_server(listener.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", listener
    finally:
        listener.release.set()
        server.close()
        await server.wait_closed()


def closed_port() -> int:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return int(closed.getsockname()[1])


def client(url: str, timeout_s: float = 5.0) -> httpx.AsyncClient:
    return build_client(url, timeout_s=timeout_s, max_connections=1)


async def test_a_refused_connection_is_never_sent() -> None:
    async with client(f"http://127.0.0.1:{closed_port()}") as http:
        with pytest.raises(httpx.TransportError) as caught:
            await http.post("/v1/charges", json={"amount": 1})
    assert never_sent(caught.value)


async def test_a_connection_dropped_after_the_request_was_sent_is_not_never_sent() -> None:
    async with listening("drop") as (url, listener), client(url) as http:
        with pytest.raises(httpx.TransportError) as caught:
            await http.post("/v1/charges", json={"amount": 1})
    assert listener.received[0].endswith(b'{"amount":1}')
    assert not never_sent(caught.value)


async def test_an_answer_that_never_comes_is_a_read_timeout_not_never_sent() -> None:
    async with listening("silence") as (url, listener), client(url, timeout_s=0.2) as http:
        with pytest.raises(httpx.ReadTimeout) as caught:
            await http.post("/v1/charges", json={"amount": 1})
    assert listener.got_one.is_set()
    assert not never_sent(caught.value)


def contract(url: str, timeout_s: float = 5.0) -> ContractGateway:
    settings = GatewaySettings(url=url, api_key=SecretStr("sk_test_x"), gateway_timeout_s=timeout_s)
    return ContractGateway(settings)


async def test_the_contract_adapter_charging_into_a_drop_knows_nothing() -> None:
    async with listening("drop") as (url, listener):
        gateway = contract(url)
        with pytest.raises(errors.OutcomeUnknown):
            await gateway.charge(CHARGE)
        await gateway.aclose()
    assert b"idempotency-key: 7:2026-12-01" in listener.received[0].lower()


async def test_the_contract_adapter_charging_into_silence_knows_nothing_at_the_deadline() -> None:
    async with listening("silence") as (url, listener):
        gateway = contract(url, timeout_s=0.2)
        with pytest.raises(errors.OutcomeUnknown) as caught:
            await gateway.charge(CHARGE)
        await gateway.aclose()
    assert listener.got_one.is_set()
    assert isinstance(caught.value.__cause__, TimeoutError | httpx.ReadTimeout)


async def test_the_contract_adapter_charging_a_refusing_port_charged_nothing() -> None:
    gateway = contract(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(errors.DependencyUnavailable, match="gateway unreachable"):
        await gateway.charge(CHARGE)
    await gateway.aclose()


async def stripe_error(url: str) -> stripe.StripeError:
    """The SDK's error for one request over the adapter's own HTTP client."""
    http = OwnedHTTPClient(client(url))
    with pytest.raises(stripe.APIConnectionError) as caught:
        await http.request_async("POST", f"{url}/v1/payment_intents", {}, b"amount=1")
    await http.close_async()
    return caught.value


async def test_the_stripe_sdk_over_our_client_keeps_never_sent_apart() -> None:
    refused = await stripe_error(f"http://127.0.0.1:{closed_port()}")
    async with listening("drop") as (url, listener):
        dropped = await stripe_error(url)
    assert listener.got_one.is_set()
    assert isinstance(domain_error(refused), errors.DependencyUnavailable)
    assert isinstance(domain_error(dropped), errors.OutcomeUnknown)
