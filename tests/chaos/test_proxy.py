"""The chaos proxy over real sockets: an echo server behind it, and the real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import nats
import pytest

from tests.chaos.proxy import Mode, Proxy

SILENCE_S = 0.2  # how long "nothing arrives" is watched for; no test waits for it to pass
EVENT_TIMEOUT_S = 10.0  # a guard on awaited events, never reached when all is well


class EchoServer:
    """Echoes every byte back and records how each connection ended: `eof` or `reset`."""

    def __init__(self) -> None:
        self.endings: asyncio.Queue[str] = asyncio.Queue()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ending = "eof"
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionResetError:
            ending = "reset"
        finally:
            writer.close()
        self.endings.put_nowait(ending)


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield server


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", echo.port) as running:
        yield running


@contextlib.asynccontextmanager
async def connected(
    proxy: Proxy,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), EVENT_TIMEOUT_S)


async def read_one(proxy: Proxy) -> bytes:
    """Connect and read a byte: a reset shows as ConnectionResetError, on connect or on read."""
    async with connected(proxy) as (reader, _):
        return await asyncio.wait_for(reader.read(1), EVENT_TIMEOUT_S)


async def silent(reader: asyncio.StreamReader) -> bool:
    """Nothing arrives within `SILENCE_S` (the read is cancelled, nothing consumed)."""
    try:
        await asyncio.wait_for(reader.read(1), SILENCE_S)
    except TimeoutError:
        return True
    return False


async def test_pass_through_echoes_and_forwards_the_fin(proxy: Proxy, echo: EchoServer) -> None:
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"hello") == b"hello"
        writer.write(b"bye")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), EVENT_TIMEOUT_S) == b"bye"
    assert await echo.endings.get() == "eof"
    stats = proxy.stats()
    assert stats["accepted"] == 1
    assert stats["bytes_to_upstream"] == stats["bytes_to_client"] == 8
    assert stats["resets"] == 0


async def test_latency_holds_chunks_in_order_until_switched(proxy: Proxy) -> None:
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"before") == b"before"
        proxy.latency(30)
        assert proxy.mode is Mode.LATENCY
        for chunk in (b"one,", b"two,", b"three"):
            writer.write(chunk)
            await writer.drain()
        assert await silent(reader)
        proxy.pass_through()  # held chunks go out now, in the order they came
        data = await asyncio.wait_for(reader.readexactly(13), EVENT_TIMEOUT_S)
        assert data == b"one,two,three"


async def test_short_latency_delivers_everything_in_order(proxy: Proxy) -> None:
    proxy.latency(0.01)
    chunks = [f"{n};".encode() for n in range(50)]
    async with connected(proxy) as (reader, writer):
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        expected = b"".join(chunks)
        assert await asyncio.wait_for(reader.readexactly(len(expected)), EVENT_TIMEOUT_S) == (
            expected
        )


async def test_blackhole_drops_both_ways_then_heals(proxy: Proxy) -> None:
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"ping") == b"ping"
        proxy.blackhole()
        writer.write(b"lost")
        await writer.drain()
        assert await silent(reader)
        async with connected(proxy) as (new_reader, new_writer):  # accepted, never answered
            new_writer.write(b"void")
            await new_writer.drain()
            assert await silent(new_reader)
        proxy.pass_through()
        assert await roundtrip(reader, writer, b"back") == b"back"  # not b"lost"
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"fresh") == b"fresh"
    assert proxy.stats()["bytes_dropped"] >= len(b"lost")


async def test_reset_sends_rst_to_both_sides_until_switched(proxy: Proxy, echo: EchoServer) -> None:
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"hi") == b"hi"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), EVENT_TIMEOUT_S)
    assert await echo.endings.get() == "reset"
    with pytest.raises(ConnectionResetError):  # a new connection: accepted, then reset
        await read_one(proxy)
    proxy.pass_through()
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"again") == b"again"
    assert proxy.stats()["resets"] == 2


async def test_reset_all_is_one_shot(proxy: Proxy, echo: EchoServer) -> None:
    proxy.latency(0)
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"hi") == b"hi"
        proxy.reset_all()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), EVENT_TIMEOUT_S)
    assert await echo.endings.get() == "reset"
    assert proxy.mode is Mode.LATENCY  # unchanged
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"next") == b"next"
    assert proxy.stats()["resets"] == 1


async def test_refuse_closes_the_listener_and_pass_through_reopens_it(proxy: Proxy) -> None:
    port = proxy.port
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"first") == b"first"  # accepted by the proxy
        proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        assert await roundtrip(reader, writer, b"still") == b"still"  # existing ones carry on
        proxy.pass_through()
    assert proxy.port == port
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"open") == b"open"


async def test_stop_closes_every_connection(echo: EchoServer) -> None:
    proxy = Proxy("127.0.0.1", echo.port)
    proxy.start()
    port = proxy.port
    async with connected(proxy) as (reader, writer):
        assert await roundtrip(reader, writer, b"hi") == b"hi"
        proxy.latency(30)
        writer.write(b"held")
        await writer.drain()
        proxy.stop()
        assert await asyncio.wait_for(reader.read(), EVENT_TIMEOUT_S) == b""
    assert await echo.endings.get() == "eof"
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


def _echo_one_connection(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def test_forwards_without_the_callers_event_loop() -> None:
    """No loop runs in this test: the proxy's own thread does the forwarding."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(EVENT_TIMEOUT_S)
        upstream = threading.Thread(target=_echo_one_connection, args=(listener,), daemon=True)
        upstream.start()
        with Proxy("127.0.0.1", listener.getsockname()[1]) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), EVENT_TIMEOUT_S) as client:
                client.sendall(b"sync")
                assert client.recv(4, socket.MSG_WAITALL) == b"sync"
            upstream.join(EVENT_TIMEOUT_S)
            assert not upstream.is_alive()  # the client's FIN reached the upstream


async def test_nats_client_reconnects_through_the_proxy_after_reset_all(nats_url: str) -> None:
    upstream = urlsplit(nats_url)
    assert upstream.hostname is not None
    assert upstream.port is not None
    reconnected = asyncio.Event()
    errors: list[Exception] = []

    async def on_reconnected() -> None:
        reconnected.set()

    async def on_error(exc: Exception) -> None:
        errors.append(exc)  # the reset shows up here; nats-py would log it otherwise

    responder = await nats.connect(nats_url)
    with Proxy(upstream.hostname, upstream.port) as proxy:
        client = await nats.connect(
            f"nats://{proxy.address}",
            reconnected_cb=on_reconnected,
            error_cb=on_error,
            reconnect_time_wait=0.05,  # type: ignore[arg-type]  # nats-py annotates int, takes float
            max_reconnect_attempts=-1,
        )
        try:

            async def answer(msg: nats.aio.msg.Msg) -> None:
                await msg.respond(b"pong:" + msg.data)

            sub = await responder.subscribe("chaos.proxy.ping", cb=answer)
            await responder.flush()
            reply = await client.request("chaos.proxy.ping", b"1", timeout=EVENT_TIMEOUT_S)
            assert reply.data == b"pong:1"

            proxy.reset_all()
            await asyncio.wait_for(reconnected.wait(), EVENT_TIMEOUT_S)
            reply = await client.request("chaos.proxy.ping", b"2", timeout=EVENT_TIMEOUT_S)
            assert reply.data == b"pong:2"
            await sub.unsubscribe()
        finally:
            await client.close()
            await responder.close()
        stats = proxy.stats()
    assert stats["accepted"] == 2
    assert stats["resets"] == 1
