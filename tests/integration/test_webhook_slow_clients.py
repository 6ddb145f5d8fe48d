"""Slow clients against the webhook receiver, over raw sockets that trickle bytes.

A client that connects and sends nothing, trickles its headers or its body, or opens
hundreds of such connections must not hold them open: the receiver closes a connection
whose request head is late (`CHARGE_WORKER_WEBHOOK_HEADER_TIMEOUT_S`), answers `408` to a
late body (`CHARGE_WORKER_WEBHOOK_BODY_TIMEOUT_S`), and answers `503` beyond
`CHARGE_WORKER_WEBHOOK_MAX_CONNECTIONS`. Nothing here measures time: each test awaits what
the server does (a close, an answer), bounded only so that a regression fails instead of
hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from charge_worker.sandbox.serve import ServedApp
from charge_worker.webhooks.signature import signed_headers
from tests.support.harness import eventually
from tests.support.webhooks import (
    SECRET,
    Receiver,
    event,
    journal,
    running_receiver,
    webhook_settings,
)

BOUND_S = 30.0  # a server that never closes fails the test after this, rather than hanging
HEAD = b"POST /webhooks/gateway HTTP/1.1\r\nHost: receiver\r\n"


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


@contextlib.asynccontextmanager
async def receiver_with(
    database_url: str, gateway_url: str, **webhooks: Any
) -> AsyncIterator[Receiver]:
    async with running_receiver(webhook_settings(database_url, gateway_url, **webhooks)) as r:
        yield r


class Client:
    """One raw TCP connection to the receiver."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, receiver: Receiver) -> Client:
        host, port = receiver.url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def trickle(self, data: bytes, *, every_s: float = 0.05) -> None:
        """Send `data` a byte at a time, until it is sent or the server hangs up."""
        with contextlib.suppress(ConnectionError):
            for byte in data:
                self.writer.write(bytes([byte]))
                await self.writer.drain()
                await asyncio.sleep(every_s)

    async def until_closed(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        received = b""
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(BOUND_S):
                while chunk := await self.reader.read(65536):
                    received += chunk
        return received

    def close(self) -> None:
        self.writer.close()


async def test_a_connection_that_sends_nothing_is_closed(
    database_url: str, gateway_sim: ServedApp
) -> None:
    async with receiver_with(database_url, gateway_sim.url, webhook_header_timeout_s=0.5) as r:
        client = await Client.connect(r)
        try:
            assert await client.until_closed() == b""
        finally:
            client.close()
        await eventually(
            lambda: r.metric("charge_worker_webhook_slow_connections_total") == 1,
            "the slow connection counted",
        )


async def test_headers_trickled_a_byte_at_a_time_are_cut_off(
    database_url: str, gateway_sim: ServedApp
) -> None:
    async with receiver_with(database_url, gateway_sim.url, webhook_header_timeout_s=0.5) as r:
        client = await Client.connect(r)
        endless = HEAD + b"X-Slow: " + b"a" * 10_000  # would take minutes at this pace
        trickling = asyncio.create_task(client.trickle(endless))
        try:
            assert await client.until_closed() == b""
            await asyncio.wait_for(trickling, BOUND_S)  # it stops: the server hung up
        finally:
            trickling.cancel()
            client.close()


async def test_a_body_trickled_too_slowly_gets_408_and_nothing_is_journaled(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    body = json.dumps(event("ch_1")).encode()
    headers = signed_headers(SECRET, "msg_slow", body)
    head = HEAD + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    async with receiver_with(database_url, gateway_sim.url, webhook_body_timeout_s=0.5) as r:
        client = await Client.connect(r)
        client.writer.write(head)
        trickling = asyncio.create_task(client.trickle(body))
        try:
            answer = await client.until_closed()
        finally:
            trickling.cancel()
            client.close()
        too_slow = r.metric(
            "charge_worker_webhook_deliveries_total", source="gateway", result="too_slow"
        )
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert too_slow == 1
    assert await journal(db) == []


async def test_the_rest_of_a_body_answered_early_is_not_read_for_ever(
    database_url: str, gateway_sim: ServedApp
) -> None:
    # no signature headers: refused before the body is read, which then keeps trickling
    head = HEAD + b"Content-Length: 1000\r\n\r\n"
    async with receiver_with(database_url, gateway_sim.url, webhook_header_timeout_s=0.5) as r:
        client = await Client.connect(r)
        client.writer.write(head)
        trickling = asyncio.create_task(client.trickle(b"x" * 1000))
        try:
            answer = await client.until_closed()
        finally:
            trickling.cancel()
            client.close()
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_four_hundred_slow_connections_are_closed_and_deliveries_still_answered(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    async with receiver_with(database_url, gateway_sim.url, webhook_header_timeout_s=1.0) as r:
        clients = [await Client.connect(r) for _ in range(400)]
        try:
            for client in clients:  # unauthenticated, and never finishing the head
                client.writer.write(HEAD)
            answers = await asyncio.gather(*(client.until_closed() for client in clients))
        finally:
            for client in clients:
                client.close()
        delivered = await r.post(event("ch_1"))
    assert answers == [b""] * 400
    assert delivered.status_code == 200
    assert len(await journal(db)) == 1


async def test_connections_over_the_limit_get_503_until_some_close(
    database_url: str, gateway_sim: ServedApp
) -> None:
    async with receiver_with(
        database_url, gateway_sim.url, webhook_max_connections=5, webhook_header_timeout_s=60.0
    ) as r:
        idle = [await Client.connect(r) for _ in range(5)]
        try:

            async def refused() -> bool:
                return (await r.client.get("/healthz")).status_code == 503

            await eventually(refused, "a request over the limit refused with 503")
        finally:
            for client in idle:
                client.close()

        async def answered() -> bool:
            return (await r.post(event("ch_1"))).status_code == 200

        await eventually(answered, "a delivery answered once the idle connections closed")
