"""Shared HTTP plumbing for the dependency clients: one client per dependency, a breaker.

httpx's API over aiohttp's transport: httpx's default transport spends several times more
client CPU per local request (see the benchmark issue). pybreaker has no native asyncio, so
a call is `with breaker.calling(): await ...` under a hard total deadline
(`asyncio.timeout`), because `httpx.Timeout` bounds each phase, not the whole call.
"""

from __future__ import annotations

import datetime as dt

import httpx
import pybreaker
from httpx_aiohttp import AiohttpTransport

from charge_worker.errors import DependencyUnavailable, OutcomeUnknown


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


def build_breaker(name: str, *, fail_max: int, reset_s: float) -> pybreaker.CircuitBreaker:
    """A breaker that counts only failures of the dependency itself.

    A decline, a 409 or a 4xx is the dependency working; an unknown outcome or an
    unreachable dependency is not. The original error is raised even on the call that
    trips the breaker, so its classification survives.
    """
    return pybreaker.CircuitBreaker(
        fail_max=fail_max,
        reset_timeout=reset_s,
        exclude=[lambda error: not isinstance(error, OutcomeUnknown | DependencyUnavailable)],
        name=name,
        throw_new_error_on_trip=False,
    )


def open_for_s(breaker: pybreaker.CircuitBreaker) -> float:
    """Seconds until an open breaker half-opens (0 when it is not open)."""
    opened_at = breaker._state_storage.opened_at  # pybreaker exposes no getter
    if breaker.current_state != pybreaker.STATE_OPEN or opened_at is None:
        return 0.0
    left = opened_at + dt.timedelta(seconds=breaker.reset_timeout) - dt.datetime.now(dt.UTC)
    return max(left.total_seconds(), 0.0)
