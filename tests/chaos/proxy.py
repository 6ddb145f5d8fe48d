"""A TCP proxy with switchable faults, for the reliability tests (our own small toxiproxy).

The proxy runs its own event loop in a daemon thread, so it keeps forwarding while the test's
loop is blocked (in a subprocess call, say). Every fault takes effect at once, for new and
existing connections alike, and may be switched from any thread:

| call             | new connections             | existing connections                    |
|------------------|-----------------------------|-----------------------------------------|
| `pass_through()` | forwarded                   | forwarded (held chunks go out now)      |
| `latency(s)`     | each chunk `s` late         | each chunk `s` late, in order           |
| `blackhole()`    | accepted, nothing forwarded | stall; bytes sent meanwhile are dropped |
| `reset()`        | RST right after accept      | RST on both sockets                     |
| `refuse()`       | refused (listener closed)   | untouched; add `reset_all()` for those  |
| `reset_all()`    | (mode unchanged)            | RST on both sockets, once               |
| `retarget(port)` | forwarded to the new port   | RST on both sockets, once               |

```python
with Proxy("127.0.0.1", nats_port) as proxy:
    nc = await nats.connect(f"nats://{proxy.address}")
    proxy.reset_all()
```
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 64  # per direction: beyond this a delayed direction pushes back on its sender
CALL_TIMEOUT_S = 5.0
LINGER_0 = struct.pack("ii", 1, 0)  # close() then sends RST instead of FIN


class Mode(enum.Enum):
    """What the proxy does to traffic now; set by the methods of the same names."""

    PASS_THROUGH = "pass_through"
    LATENCY = "latency"
    BLACKHOLE = "blackhole"
    RESET = "reset"
    REFUSE = "refuse"


_EOF = object()  # a direction's sender closed its half: forward the FIN
_RST = object()  # a direction's sender reset: reset the other side too


def _linger_0(sock: Any) -> None:
    """Make closing `sock` (a socket or asyncio's wrapper of one) send RST instead of FIN."""
    with contextlib.suppress(OSError):  # already closed
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_0)


class _Link:
    """One proxied connection: the accepted socket, its streams, and the upstream's streams."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.client: asyncio.StreamWriter | None = None
        self.upstream: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None  # forwarding both ways

    def abort(self, *, rst: bool) -> None:
        if rst:
            _linger_0(self.sock)
            if self.upstream is not None:
                _linger_0(self.upstream.get_extra_info("socket"))
        for writer in self.writers():
            writer.transport.abort()
        if self.client is None:
            self.sock.close()
        if self.task is not None:
            self.task.cancel()

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client, self.upstream) if w is not None]


class Proxy:
    """Forwards TCP connections from a free loopback port to `upstream_host:upstream_port`."""

    def __init__(
        self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1"
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        self._port: int | None = None
        self._mode = Mode.PASS_THROUGH
        self._latency_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._links: set[_Link] = set()
        self._changed: asyncio.Event | None = None  # set and replaced on every mode switch
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("accepted", "bytes_to_upstream", "bytes_to_client", "bytes_dropped", "resets"), 0
        )

    @property
    def port(self) -> int:
        """The port the proxy listens on (kept across `refuse()`)."""
        if self._port is None:
            raise RuntimeError("the proxy is not running")
        return self._port

    @property
    def address(self) -> str:
        """`host:port` to connect to instead of the upstream, e.g. `127.0.0.1:43121`."""
        return f"{self.listen_host}:{self.port}"

    @property
    def mode(self) -> Mode:
        """The fault in effect."""
        return self._mode

    def stats(self) -> dict[str, int]:
        """Counters: `accepted`, `bytes_to_upstream`, `bytes_to_client`, `bytes_dropped`,
        `resets` (connections reset), and `open` (connections now proxied)."""
        with self._stats_lock:
            return {**self._stats, "open": len(self._links)}

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    # -- faults: each returns once it is in effect -------------------------------------------

    def pass_through(self) -> None:
        """Forward normally; re-open the listener after `refuse()`."""
        self._switch(Mode.PASS_THROUGH)

    def latency(self, seconds: float) -> None:
        """Forward every chunk `seconds` after it arrived, each direction in order."""
        if seconds < 0:
            raise ValueError("latency cannot be negative")
        self._switch(Mode.LATENCY, seconds)

    def blackhole(self) -> None:
        """Accept and read, forward nothing: bytes arriving meanwhile are dropped."""
        self._switch(Mode.BLACKHOLE)

    def reset(self) -> None:
        """Reset every connection now, and each new one right after accept, until switched."""
        self._switch(Mode.RESET)

    def refuse(self) -> None:
        """Close the listener so connecting is refused; existing connections carry on."""
        self._switch(Mode.REFUSE)

    def reset_all(self) -> None:
        """Reset every current connection once; the mode stays as it is."""
        self._call(self._reset_links())

    def retarget(self, upstream_port: int) -> None:
        """Forward new connections to another port (a promoted standby, as a virtual IP or a
        pooler would be re-pointed); existing connections are reset."""
        self._call(self._retarget(upstream_port))

    def _switch(self, mode: Mode, latency_s: float = 0.0) -> None:
        if self._loop is None:  # applied by start()
            self._mode, self._latency_s = mode, latency_s
            return
        self._call(self._apply(mode, latency_s))

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the proxy's thread and listen; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError("the proxy is already running")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        try:
            self._call(self._apply(self._mode, self._latency_s))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Close the listener and every connection, then end the thread (bounded)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self._shutdown())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT_S)
            self._loop = self._thread = self._port = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        finally:
            loop.close()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine on the proxy's loop and wait for it, from any other thread."""
        if self._loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("the proxy is not running")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("call the proxy from another thread than its own")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    # -- on the proxy's loop -----------------------------------------------------------------

    async def _apply(self, mode: Mode, latency_s: float) -> None:
        self._mode, self._latency_s = mode, latency_s
        previous, self._changed = self._changed, asyncio.Event()
        if self._listener is None and (mode is not Mode.REFUSE or self._port is None):
            self._listen()
        if mode is Mode.REFUSE:
            await self._stop_listening()
        if mode is Mode.RESET:
            await self._reset_links()
        if previous is not None:
            previous.set()

    def _listen(self) -> None:
        # Our own accept loop, not asyncio.Server: in Python 3.11 a connection accepted just
        # before Server.close() is neither served nor closed, and its client hangs.
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        listener = socket.create_server((self.listen_host, self._port or 0), family=family)
        listener.setblocking(False)
        self._listener, self._port = listener, listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept(listener))

    async def _stop_listening(self) -> None:
        """Close the listener: the kernel now refuses, and resets what it had queued."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting])
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _retarget(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        await self._reset_links()

    async def _reset_links(self) -> None:
        for link in list(self._links):
            link.abort(rst=True)
            self._count("resets")

    async def _shutdown(self) -> None:
        await self._stop_listening()
        tasks = [link.task for link in self._links if link.task is not None]
        for link in list(self._links):
            link.abort(rst=False)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._changed = None

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            self._count("accepted")
            if self._mode is Mode.RESET:
                _linger_0(sock)
                sock.close()
                self._count("resets")
                continue
            link = _Link(sock)
            link.task = loop.create_task(self._serve(link))
            self._links.add(link)

    async def _serve(self, link: _Link) -> None:
        try:
            client_reader, link.client = await asyncio.open_connection(sock=link.sock)
            await self._proxy(link, client_reader, link.client)
        except BaseException:
            link.abort(rst=False)
            raise
        else:  # both directions ended with a FIN: flush what is buffered, then close
            for side in link.writers():
                side.close()
                with contextlib.suppress(OSError):
                    await side.wait_closed()
        finally:
            self._links.discard(link)

    async def _proxy(
        self, link: _Link, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        try:
            upstream_reader, link.upstream = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:  # the upstream is down: the client sees its connection die
            _linger_0(link.sock)
            client.transport.abort()
            return
        async with asyncio.TaskGroup() as group:
            for reader, writer, key in (
                (client_reader, link.upstream, "bytes_to_upstream"),
                (upstream_reader, client, "bytes_to_client"),
            ):
                queue: asyncio.Queue[tuple[float, object]] = asyncio.Queue(QUEUE_CHUNKS)
                group.create_task(self._receive(reader, queue))
                group.create_task(self._send(queue, writer, key, link))

    async def _receive(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, object]]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await reader.read(CHUNK_BYTES)
            except OSError:
                await queue.put((loop.time(), _RST))
                return
            if not data:
                await queue.put((loop.time(), _EOF))
                return
            if self._mode is Mode.BLACKHOLE:
                self._count("bytes_dropped", len(data))
            else:
                await queue.put((loop.time(), data))

    async def _send(
        self,
        queue: asyncio.Queue[tuple[float, object]],
        writer: asyncio.StreamWriter,
        key: str,
        link: _Link,
    ) -> None:
        while True:
            received_at, item = await queue.get()
            if not await self._due(received_at, droppable=isinstance(item, bytes)):
                assert isinstance(item, bytes)
                self._count("bytes_dropped", len(item))
                continue
            if item is _RST:
                link.abort(rst=True)
                return
            if item is _EOF:
                if writer.can_write_eof() and not writer.transport.is_closing():
                    with contextlib.suppress(OSError):  # the peer reset meanwhile
                        writer.write_eof()
                return
            assert isinstance(item, bytes)
            self._count(key, len(item))
            writer.write(item)
            try:
                await writer.drain()
            except OSError:  # the receiver is gone: so is the whole connection
                link.abort(rst=True)
                return

    async def _due(self, received_at: float, *, droppable: bool) -> bool:
        """Wait until what arrived at `received_at` may go out; False: drop it (blackhole).

        A FIN or RST is never dropped: it waits out the blackhole, as a retransmission would.
        Each turn waits for a mode switch or the deadline, so a switch re-decides at once.
        """
        loop = asyncio.get_running_loop()
        while True:
            changed = self._changed
            assert changed is not None
            if self._mode is Mode.BLACKHOLE:
                if droppable:
                    return False
                await changed.wait()
                continue
            delay_s = received_at + self._latency_s - loop.time()
            if self._mode is not Mode.LATENCY or delay_s <= 0:
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), delay_s)
