"""Deadlines on one timer (`charge_worker.deadline`): what `asyncio.timeout` would do."""

from __future__ import annotations

import asyncio

import pytest

from charge_worker.deadline import Deadlines

FAST = 0.005  # the timer's period in these tests


async def test_a_call_past_its_deadline_is_cancelled_and_raises_timeout() -> None:
    deadlines = Deadlines(FAST)
    never = asyncio.Event()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.01s") as raised:
        async with deadlines.within(0.01):
            await never.wait()
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    assert not deadlines.running
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_call_in_time_returns_and_the_timer_stops_once_nothing_runs() -> None:
    deadlines = Deadlines(FAST)
    async with deadlines.within(60):
        await asyncio.sleep(0)
    assert not deadlines.running
    assert deadlines.timer is not None  # still armed: it looks once more, then stops
    await asyncio.sleep(2 * FAST)  # the loop runs the timer, due first, before this wakes
    assert deadlines.timer is None


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    deadlines = Deadlines(FAST)
    entered = asyncio.Event()

    async def call() -> None:
        async with deadlines.within(60):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not deadlines.running


async def test_a_cancellation_from_elsewhere_after_the_deadline_fired_is_not_swallowed() -> None:
    """Both cancelled the task: the other cancellation wins, as with asyncio.timeout."""
    deadlines = Deadlines(FAST)

    async def call() -> None:
        async with deadlines.within(0.01):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # the deadline's
                asyncio.current_task().cancel()  # type: ignore[union-attr]  # and another
                raise

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(call())


async def test_the_inner_of_two_deadlines_fires_and_the_outer_goes_on() -> None:
    deadlines = Deadlines(FAST)
    async with deadlines.within(60):
        with pytest.raises(TimeoutError):
            async with deadlines.within(0.01):
                await asyncio.Event().wait()
        await asyncio.sleep(0)  # still inside the outer one, not cancelled
    assert not deadlines.running


async def test_many_calls_share_the_timer_and_only_the_late_ones_fire() -> None:
    deadlines = Deadlines(FAST)
    release = asyncio.Event()

    async def call(seconds: float) -> str:
        try:
            async with deadlines.within(seconds):
                await release.wait()
        except TimeoutError:
            return "late"
        return "in time"

    tasks = [asyncio.create_task(call(s)) for s in (0.01, 0.01, 60, 60)]
    assert await asyncio.gather(*tasks[:2]) == ["late", "late"]  # the timer's checks end them
    assert not any(task.done() for task in tasks[2:])
    release.set()
    assert await asyncio.gather(*tasks[2:]) == ["in time", "in time"]


def test_a_timer_left_on_a_closed_loop_does_not_disarm_the_next_loop() -> None:
    deadlines = Deadlines(3600)  # the first loop's timer must not fire before that loop closes
    abandoned_calls: list[asyncio.Task[None]] = []

    async def abandoned() -> None:  # its loop closes while the call is under way
        async def call() -> None:
            async with deadlines.within(60):
                await asyncio.Event().wait()

        abandoned_calls.append(asyncio.create_task(call()))
        await asyncio.sleep(0)

    async def late() -> None:
        async with deadlines.within(0.01):
            await asyncio.Event().wait()

    asyncio.run(abandoned())
    assert deadlines.timer is not None
    deadlines.resolution_s = FAST
    with pytest.raises(TimeoutError, match="no answer within"):  # not wait_for's
        asyncio.run(asyncio.wait_for(late(), 30))  # 30 s: a hang guard, not a measurement
