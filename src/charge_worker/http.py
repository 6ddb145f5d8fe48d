"""Shared HTTP plumbing: the dependency clients (one per dependency, with a breaker) and the
probes every long-running command serves (`/metrics`, `/healthz`, `/readyz`).

httpx's API over aiohttp's transport: httpx's default transport spends several times more
client CPU per local request (see the benchmark issue). A call is `with breaker: await ...`
under a hard total deadline (`charge_worker.deadline`), because `httpx.Timeout` bounds each
phase, not the whole call.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator

import httpx
import uvicorn
from httpx_aiohttp import AiohttpTransport
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from charge_worker.breaker import Breaker
from charge_worker.errors import (
    DependencyUnavailable,
    OutcomeUnknown,
    ReplayedFailure,
    SettingsError,
)

WEDGED_AFTER_S = 60.0  # a loop that has not turned for this long fails /healthz


def build_client(
    base_url: str,
    *,
    timeout_s: float,
    max_connections: int,
    headers: dict[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A pooled client; `transport` lets unit tests pass `httpx.MockTransport`."""
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        transport=transport or AiohttpTransport(limits=limits, trust_env=False),
        trust_env=False,
    )


def build_breaker(name: str, *, fail_max: int, reset_s: float) -> Breaker:
    """A breaker that counts only failures of the dependency itself.

    A decline, a 409, a 429 or the dependency's own rejection of a request is the
    dependency working; an unknown outcome, an unreachable dependency, or a request it did
    not accept at all (wrong credentials, a wrong path, a proxy's bare 4xx: raised as
    `DependencyUnavailable`) is not. A `ReplayedFailure` is neither: an old answer told again.
    """
    return Breaker(
        name,
        fail_max=fail_max,
        reset_s=reset_s,
        counts=lambda error: isinstance(error, OutcomeUnknown | DependencyUnavailable),
        neutral=lambda error: isinstance(error, ReplayedFailure),
    )


def probes_app(
    registry: CollectorRegistry,
    *,
    wedged: Callable[[], str | None],
    not_ready: Callable[[], Awaitable[str | None]],
    routes: list[BaseRoute] | None = None,
) -> Starlette:
    """`/metrics` from `registry`; `/healthz` fails with what `wedged()` says (a hung process
    a restart would cure); `/readyz` with what `not_ready()` says (this pod should get no
    work now). `routes` come first."""

    async def scrape(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        why = wedged()
        return PlainTextResponse("ok") if why is None else PlainTextResponse(why, 503)

    async def readyz(_: Request) -> Response:
        why = await not_ready()
        return PlainTextResponse("ready") if why is None else PlainTextResponse(why, 503)

    return Starlette(
        routes=[
            *(routes or []),
            Route("/metrics", scrape),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
        ]
    )


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the command owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server(app: Starlette) -> Server:
    """A quiet uvicorn server for `app`, to be served on a socket bound by `listen`."""
    # log_config=None: uvicorn's loggers keep the root's JSON handler (logs.configure)
    # instead of the text handlers uvicorn would install on them
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", log_config=None
    )
    return Server(config)


def listen(host: str, port: int, *, setting: str) -> socket.socket:
    """Bind now, so a taken port fails at start naming `setting`, and port 0 is known at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise SettingsError(f"{setting}: cannot listen on {host}:{port}: {error}") from error
