"""What every adapter's request goes through, whatever the provider: a token of the fleet's
rate, the breaker, a hard total deadline.

The request of a charge that can move money (the one that carries the idempotency key) is
sent with `before_send`: awaited once its token is taken, right before the request starts,
so the worker proves there that its lease outlives the request's deadline (`BeforeSend`).
Nothing the adapter did before it (reads, token waits, however slow) can then push the
request past the lease.

A call is `with breaker: await …`, under a deadline (`charge_worker.deadline`; a client's
own timeout bounds each phase, not the whole call). The request passed in translates its
driver's errors into domain errors itself, inside the breaker, so that an `OutcomeUnknown` or
`DependencyUnavailable` counts toward it and a verdict (decline, rejection, 409, 429) does
not (`http.build_breaker`). A `ReplayedFailure` (the provider replaying its first answer to
a key, a 5xx) is neither: the breaker hears nothing of it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import httpx

from charge_worker.breaker import BreakerOpen
from charge_worker.deadline import Deadlines
from charge_worker.errors import DependencyUnavailable, OutcomeUnknown
from charge_worker.http import build_breaker
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewaySettings

T = TypeVar("T")
DEFAULT_RETRY_AFTER_S = 1.0
# awaited right before the request that can move money starts; raises to send nothing
BeforeSend = Callable[[], Awaitable[None]]


class Guarded:
    """The limiter, breaker and deadline an adapter shares with the pull loop (which reads
    `breaker` and `limiter` to stop fetching while the provider is down or the fleet's rate
    is spent)."""

    def __init__(self, cfg: GatewaySettings, *, limiter: RateLimiter | None) -> None:
        self.timeout_s = cfg.gateway_timeout_s
        self.key_prefix = cfg.idempotency_key_prefix  # before every Idempotency-Key sent
        self.breaker = build_breaker(
            "gateway", fail_max=cfg.gateway_breaker_failures, reset_s=cfg.gateway_breaker_reset_s
        )
        # the fleet's request rate: each request spends a token (none while the rate is off)
        self.limiter = limiter or RateLimiter(None, rate_per_s=0)
        self.deadlines = Deadlines()

    @property
    def charge_deadline_s(self) -> float:
        """The longest the request that can move money may take once `before_send` let it
        go: one request's deadline, whatever the adapter read or waited for before it."""
        return self.timeout_s

    @property
    def available(self) -> bool:
        """False while the breaker is open: callers should stop taking work."""
        return self.breaker.open_for_s() == 0.0

    async def guarded(
        self,
        what: str,
        request: Callable[[], Awaitable[T]],
        *,
        success_counts: bool = True,
        before_send: BeforeSend | None = None,
    ) -> T:
        """Spend a token, then run `request` inside the breaker under the deadline.

        `before_send` is awaited after the token and before the request: what it raises
        propagates, nothing sent, the breaker untouched.

        `success_counts=False`: a read that a charge makes first (Stripe's saved card) must
        not close the breaker's count of the charge calls failing after it, or an outage of
        charges alone would never open it; its failures still count."""
        await self.limiter.spend()
        if before_send is not None:
            await before_send()
        try:
            if success_counts or self.breaker.state != "closed":
                with self.breaker:
                    return await self._within_deadline(what, request)
            try:
                return await self._within_deadline(what, request)
            except (OutcomeUnknown, DependencyUnavailable) as failure:
                with self.breaker:  # counted as the breaker counts any failure
                    raise failure from failure.__cause__
        except BreakerOpen as error:
            raise DependencyUnavailable(
                "gateway breaker open", retry_after_s=self.breaker.open_for_s()
            ) from error

    async def _within_deadline(self, what: str, request: Callable[[], Awaitable[T]]) -> T:
        try:
            async with self.deadlines.within(self.timeout_s):
                return await request()
        except TimeoutError as error:
            raise OutcomeUnknown(f"gateway {what}: no answer within {self.timeout_s:g}s") from error


async def answer(
    client: httpx.AsyncClient, method: str, path: str, *, who: str, what: str, **kwargs: Any
) -> httpx.Response:
    """The answer to one request, whatever its status; the driver's errors as the domain's:
    one that cannot have reached `who` (the provider's name) is `DependencyUnavailable`,
    any other (a timeout, a reset after sending) an `OutcomeUnknown` naming `what`."""
    try:
        return await client.request(method, path, **kwargs)
    except httpx.TransportError as error:
        if never_sent(error):
            raise DependencyUnavailable(f"{who} unreachable: {error}") from error
        raise OutcomeUnknown(f"{who} {what}: {error!r}") from error
    except httpx.HTTPError as error:
        raise OutcomeUnknown(f"{who} {what}: {error!r}") from error


def never_sent(error: BaseException) -> bool:
    """True when the request cannot have reached the gateway (no connection was made).

    httpx-aiohttp maps aiohttp's connect failure to `ConnectTimeout`, the same class it uses
    for a connection dropped after sending, so the aiohttp cause is what tells them apart.
    """
    cause = error.__cause__
    return (
        isinstance(error, httpx.ConnectError)
        or isinstance(cause, aiohttp.ClientConnectorError)
        or (isinstance(cause, httpx.TransportError) and cause is not error and never_sent(cause))
    )


def retry_after(header: str | None) -> float:
    """`Retry-After` in seconds, >= 0; unreadable or not finite (`inf`, `nan`): the default.
    How long is too long is for the decisions, which know the backoff."""
    try:
        delay = float(header if header is not None else DEFAULT_RETRY_AFTER_S)
    except ValueError:
        return DEFAULT_RETRY_AFTER_S
    return max(delay, 0.0) if math.isfinite(delay) else DEFAULT_RETRY_AFTER_S
