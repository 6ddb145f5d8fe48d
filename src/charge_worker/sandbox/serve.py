"""Serve an ASGI app (a simulator) with uvicorn: in a background thread, or in the running loop.

`ServedApp` is for tests and the demo: a context manager that starts the app on a free loopback
port and stops it on exit. `serve_forever` is for `charge-worker sandbox …`: it serves in the
current event loop until cancelled, SIGINT or SIGTERM, then returns after a graceful shutdown.
Both keep uvicorn quiet (warnings only, no access log) and leave logging configuration alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Generator
from types import TracebackType
from typing import Self

import uvicorn
from starlette.types import ASGIApp

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = 5


def _config(app: ASGIApp, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        log_level="warning",
        access_log=False,
        ws="none",
        loop="asyncio",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


class ServedApp:
    """An ASGI app served by uvicorn in a background thread on `host` and a free port.

    ```python
    with ServedApp(build_gateway_app()) as gateway:
        httpx.get(f"{gateway.url}/_sim/stats")
    ```
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.host = host
        self._server = uvicorn.Server(_config(app, host, port))
        self._thread = threading.Thread(target=self._server.run, name="served-app", daemon=True)
        self._start_timeout_s = start_timeout_s
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The port the server is bound to."""
        if self._port is None:
            raise RuntimeError("the server is not running")
        return self._port

    @property
    def url(self) -> str:
        """The server's base URL, e.g. `http://127.0.0.1:43121`."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start serving and wait until the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during startup (port taken? see its log)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"uvicorn did not start within {self._start_timeout_s} s")
            time.sleep(0.01)
        self._port = self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Stop gracefully (finishing in-flight requests), then join the server's thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(STOP_TIMEOUT_S)
        self._port = None

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


class _Server(uvicorn.Server):
    """uvicorn's server, but a signal only stops it: it is not raised again afterwards."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def serve_forever(app: ASGIApp, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve `app` on `host:port` in the running loop until cancelled, SIGINT or SIGTERM.

    A signal stops the server gracefully and this returns; cancellation stops it gracefully
    too, then propagates.
    """
    server = _Server(_config(app, host, port))
    serving = asyncio.ensure_future(server.serve())
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        await serving
        raise
