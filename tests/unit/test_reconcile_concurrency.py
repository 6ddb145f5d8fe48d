"""`together`: reconcile's keys worked on a bounded number at a time (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from charge_worker.errors import DependencyUnavailable
from charge_worker.reconcile.sweeper import together


async def test_at_most_limit_at_once_and_every_item_once() -> None:
    running, most, done = 0, 0, []

    async def work(item: int) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        for _ in range(3):
            await asyncio.sleep(0)
        running -= 1
        done.append(item)

    await together(range(20), work, limit=4)

    assert most == 4
    assert sorted(done) == list(range(20))


async def test_the_first_error_ends_the_others_and_is_raised_as_itself() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def work(item: int) -> None:
        started.append(item)
        if item == 1:
            raise DependencyUnavailable("gateway unreachable")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(item)
            raise

    with pytest.raises(DependencyUnavailable, match="unreachable"):
        await together(range(10), work, limit=3)
    assert started == [0, 1]  # none starts after it, not even in the slot it left
    assert cancelled == [0]
