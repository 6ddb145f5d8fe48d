"""The gateway's side of reconcile: its charge history for the window, paged through once.

Also `patiently`, the one place reconcile waits when the gateway asks it to (429, 409).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from charge_worker.errors import (
    ChargeWorkerError,
    DependencyUnavailable,
    RateLimited,
    RequestInProgress,
)
from charge_worker.gateway import GatewayCharge, GatewayClient

PAGE_SIZE = 100
PATIENCE = 3  # tries of a call the gateway asked us to repeat later
MAX_PAUSE_S = 10.0
P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class History:
    """The gateway's charges created inside the window, as paged through once: by id, and
    the ids of those with money still captured by their metadata key (order_id,
    billing_period), oldest first."""

    charges: dict[str, GatewayCharge] = field(default_factory=dict)
    captured: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    pages: int = 0

    def add(self, charges: list[GatewayCharge]) -> None:
        """Take in one page."""
        for charge in charges:
            self.charges[charge.id] = charge
            if charge.captured and charge.order_id and charge.billing_period:
                self.captured[(charge.order_id, charge.billing_period)].append(charge.id)

    def charged(self, charge_id: str, order_id: int, billing_period: dt.date) -> bool:
        """Whether the gateway shows this charge as made (refunded since or not) for this key."""
        charge = self.charges.get(charge_id)
        return (
            charge is not None
            and charge.charged
            and charge.order_id == str(order_id)
            and charge.billing_period == billing_period.isoformat()
        )


async def patiently(call: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Call the gateway, waiting as asked after a 429 or 409, a few times at most."""
    for attempt in range(1, PATIENCE + 1):
        try:
            return await call(*args, **kwargs)
        except (RateLimited, RequestInProgress) as error:
            if attempt == PATIENCE:
                raise
            await asyncio.sleep(min(error.retry_after_s or 1.0, MAX_PAUSE_S))
    raise AssertionError("unreachable")


async def fetch_history(
    gateway: GatewayClient,
    *,
    since: dt.datetime,
    until: dt.datetime,
    progress: Callable[[str], None] = lambda _line: None,
) -> History:
    """Page through every charge created in [since, until], 100 at a time, oldest first.

    Any failure ends the run (`DependencyUnavailable`): a partial history would make
    doubles and discrepancies guesses. So does a gateway whose paging is broken (it ignores
    `starting_after`, or sends a charge it sent before), which would be paged forever.
    """
    history, after = History(), None
    created_gte, created_lt = int(since.timestamp()), int(until.timestamp()) + 1
    while True:
        try:
            page = await patiently(
                gateway.history,
                created_gte=created_gte,
                created_lt=created_lt,
                starting_after=after,
                limit=PAGE_SIZE,
            )
        except DependencyUnavailable:
            raise
        except ChargeWorkerError as error:
            where = f"gateway history page {history.pages + 1}"
            raise DependencyUnavailable(f"{where}: {type(error).__name__}: {error}") from error
        _check_progress(page.charges, history, after)
        history.add(page.charges)
        history.pages += 1
        if page.has_more or history.pages > 1:
            progress(
                f"reconcile: gateway history page {history.pages}, {len(history.charges)} charges"
            )
        if not page.has_more or not page.charges:
            return history
        after = page.charges[-1].id


def _check_progress(charges: list[GatewayCharge], history: History, after: str | None) -> None:
    """A page must move on past the cursor and bring only charges not read before."""
    where = f"gateway history page {history.pages + 1}"
    if after is not None and charges and charges[-1].id == after:
        raise DependencyUnavailable(
            f"{where}: the gateway ignored starting_after={after} (the cursor did not move);"
            " paging stopped"
        )
    again = next((c.id for c in charges if c.id in history.charges), None)
    if again is not None:
        raise DependencyUnavailable(
            f"{where}: the gateway sent {again} again after starting_after={after}"
            " (it ignores the cursor?); paging stopped"
        )
