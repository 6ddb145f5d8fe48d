"""The gateway's side of reconcile: its charge history, one page at a time.

`pages` yields each page as it arrives and keeps nothing of it but what it needs to
check that the paging moves on (the page before's ids and oldest `created`), so a run
holds one page whatever the window. Also `patiently`, the one place reconcile waits
when the gateway asks it to (429, 409).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import ParamSpec, TypeVar

from charge_worker.errors import (
    ChargeWorkerError,
    DependencyUnavailable,
    RateLimited,
    RequestInProgress,
)
from charge_worker.gateway import Gateway, GatewayCharge, HistoryPage

PAGE_SIZE = 100
PROGRESS_PAGES = 100  # a progress line on stderr every so many pages
PATIENCE = 3  # tries of a call the gateway asked us to repeat later
MAX_PAUSE_S = 10.0
P = ParamSpec("P")
T = TypeVar("T")


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


async def pages(
    gateway: Gateway,
    *,
    since: dt.datetime,
    until: dt.datetime,
    progress: Callable[[str], None] = lambda _line: None,
) -> AsyncGenerator[list[GatewayCharge], None]:
    """Every charge created in [since, until], 100 at a time, page by page, in the
    gateway's `history_order` (the contract's oldest first, Stripe's newest first).

    The next page is asked for as soon as this one's cursor is known, so the gateway's
    latency overlaps the caller's work on this one (two pages held at most).

    Any failure ends the run (`DependencyUnavailable`): a history with a hole would make
    the checkpoint a lie. So does a gateway whose paging is broken (it ignores
    `starting_after`, sends the charges of the page before again, or goes back the way it
    came), which would be paged forever.
    """
    created_gte, created_lt = int(since.timestamp()), int(until.timestamp()) + 1

    async def fetch(number: int, after: str | None) -> HistoryPage:
        try:
            return await patiently(
                gateway.history,
                created_gte=created_gte,
                created_lt=created_lt,
                starting_after=after,
                limit=PAGE_SIZE,
            )
        except DependencyUnavailable:
            raise
        except ChargeWorkerError as error:
            where = f"gateway history page {number}"
            raise DependencyUnavailable(f"{where}: {type(error).__name__}: {error}") from error

    newest_first = gateway.history_order == "newest_first"
    after: str | None = None
    previous: set[str] = set()
    edge: int | None = None  # the page before's furthest `created` in the paging's direction
    read, number = 0, 1
    asked = asyncio.create_task(fetch(number, after))
    try:
        while True:
            page = await asked
            where = f"gateway history page {number}"
            _check_progress(where, page.charges, after, previous, edge, newest_first=newest_first)
            read += len(page.charges)
            last = not page.has_more or not page.charges
            if number % PROGRESS_PAGES == 0 or (last and number > 1):
                progress(f"reconcile: gateway history page {number}, {read} charges")
            if not last:
                after, number = page.next_after, number + 1
                asked = asyncio.create_task(fetch(number, after))
            yield page.charges
            if last:
                return
            previous = {c.id for c in page.charges}
            moments = [c.created for c in page.charges]
            edge = max(moments) if newest_first else min(moments)
    finally:
        asked.cancel()  # the caller stopped early: the page asked for is not wanted


def _check_progress(
    where: str,
    charges: list[GatewayCharge],
    after: str | None,
    previous: set[str],
    edge: int | None,
    *,
    newest_first: bool,
) -> None:
    """A page must move on past the cursor, bring none of the page before's charges, and
    not lie wholly on the far side of it: older than all of it when the history is oldest
    first, newer when newest first (a little disorder among charges made at nearly the same
    time is the gateway's clocks, not a lost cursor)."""
    if after is not None and charges and charges[-1].id == after:
        raise DependencyUnavailable(
            f"{where}: the gateway ignored starting_after={after} (the cursor did not move);"
            " paging stopped"
        )
    again = next((c.id for c in charges if c.id in previous), None)
    if again is not None:
        raise DependencyUnavailable(
            f"{where}: the gateway sent {again} again after starting_after={after}"
            " (it ignores the cursor?); paging stopped"
        )
    if not charges or edge is None:
        return
    if newest_first and min(c.created for c in charges) > edge:
        raise DependencyUnavailable(
            f"{where}: every charge is newer than the page before's after"
            f" starting_after={after} (the history is newest first); paging stopped"
        )
    if not newest_first and max(c.created for c in charges) < edge:
        raise DependencyUnavailable(
            f"{where}: every charge is older than the page before's after"
            f" starting_after={after} (the history is oldest first); paging stopped"
        )
