"""The `Gateway` protocol: what the worker, reconcile, `explain` and the webhook receiver
need of a payment provider, and what every adapter guarantees (docs/adapters.md).

| call       | guarantees                                                                 |
|------------|----------------------------------------------------------------------------|
| `charge`   | at most one charge per `ChargeDue.key` at the provider, however often it   |
|            | is called (the key goes out as the provider's idempotency key); answers    |
|            | `ChargeResult` or raises the domain error the answer stands for            |
| `lookup`   | read-your-writes: every charge the provider holds for the key, including   |
|            | one made by a call whose answer was lost a moment ago                      |
| `history`  | every charge created in a window, a page at a time, in `history_order`     |
| `refund`   | a full refund, once per charge (`refund:<charge id>`); "already" if done   |
| `retrieve` | the charge object now, by the provider's id, where `reads_by_id` (webhooks |
|            | that carry no revision are applied from it; reconcile reads a `processing` |
|            | row's charge by it)                                                        |

A charge may make reads first (Stripe: the saved card); its one request that can move money
is preceded by `before_send`, so the worker checks its lease against that request alone.
Every request spends a token of the fleet's rate (`limiter`) and goes through the
breaker (`breaker`), under a hard total deadline; an unknown outcome or an unreachable
provider counts toward the breaker, a verdict (a decline, a rejection, a 409, a 429)
does not. `probe` is a cheap read that lets an open breaker close.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from charge_worker.breaker import Breaker
from charge_worker.gateway.results import ChargeResult, GatewayCharge, HistoryPage
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewayKind

__all__ = ["Gateway", "GatewayKind", "HistoryOrder", "WebhookScheme"]

HistoryOrder = Literal["oldest_first", "newest_first"]
WebhookScheme = Literal["standard", "stripe", "yookassa"]


class Gateway(Protocol):
    """A payment provider, as charge-worker uses it; see the module's table."""

    kind: GatewayKind
    # the order `history` pages come in (reconcile checks that paging moves that way)
    history_order: HistoryOrder
    # how the provider signs its webhooks, and whether their objects must be re-fetched
    webhook_scheme: WebhookScheme
    # `retrieve` works: the provider reads a charge by its id (the contract has no such read)
    reads_by_id: bool
    limiter: RateLimiter
    breaker: Breaker

    @property
    def charge_deadline_s(self) -> float:
        """The longest the request that can move money may take once `before_send` let it
        go: the worker lets it go only while its lease outlives that (ledger.Claim.outlives)."""

    @property
    def available(self) -> bool:
        """False while the breaker is open: callers should stop taking work."""

    async def charge(
        self,
        charge: ChargeDue,
        *,
        traceparent: str | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> ChargeResult:
        """Charge once per key; raise the domain error the answer stands for.

        `before_send` is awaited once, right before the one request that can move money
        starts (after its rate-limit token, after any read the adapter makes first); what it
        raises propagates and nothing is sent."""

    async def lookup(
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        """Every charge the provider holds for this key (normally 0 or 1), read-your-writes.
        `customer_id` lets providers that list per customer find it (Stripe needs it).
        `since`: no charge the caller asks about was made before it (by the database's
        clock: the ledger row's try began then); a provider that can only list by time
        (YooKassa) lists from there, less its margin for clocks, instead of its own lead."""

    async def history(
        self,
        *,
        created_gte: int,
        created_lt: int,
        starting_after: str | None = None,
        limit: int = 100,
    ) -> HistoryPage:
        """One page of charges created in [created_gte, created_lt) (unix seconds), in
        `history_order`, after the charge `starting_after`."""

    async def refund(self, charge_id: str, *, reason: str = "duplicate") -> str:
        """Refund a charge in full; return the refund id ("already" if it was refunded)."""

    async def retrieve(self, charge_id: str) -> GatewayCharge | None:
        """The charge as the provider holds it now; None when it has no such charge."""

    async def probe(self) -> bool:
        """A cheap read; True when the provider answered."""

    async def aclose(self) -> None:
        """Release the connections."""
