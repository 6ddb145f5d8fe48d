"""`+WPI` for messages in progress, on one timer (`worker.heartbeat.Heartbeats`).

The message is a stand-in that records its `in_progress()` calls: what is under test is
when they are made, not NATS (tests/integration/test_worker.py has the real ones)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from charge_worker.worker.heartbeat import Heartbeats
from charge_worker.worker.metrics import Metrics

INTERVAL = 0.02


class Message:
    def __init__(self, beats_wanted: int = 0, *, hang: bool = False) -> None:
        self.calls = 0
        self.hang = hang
        self.wanted = beats_wanted
        self.enough = asyncio.Event()

    async def in_progress(self) -> None:
        self.calls += 1
        if self.calls >= self.wanted:
            self.enough.set()
        if self.hang:
            await asyncio.Event().wait()


def heartbeats(budget_s: float = 60) -> tuple[Heartbeats, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return Heartbeats(INTERVAL, budget_s, metrics), metrics


def msg(message: Message) -> Msg:
    return cast(Msg, cast(Any, message))


async def test_a_message_in_progress_beats_until_stopped_and_the_timer_then_stops() -> None:
    beats, metrics = heartbeats()
    message = Message(beats_wanted=3)
    beat = beats.start(msg(message))
    await message.enough.wait()
    beats.stop(beat)
    assert metrics.heartbeats._value.get() >= 2  # the third may still be on its way
    await asyncio.sleep(2 * beats.tick_s)  # the timer, due first, looks and finds nothing
    assert beats.timer is None
    assert not beats.beating


async def test_a_message_done_before_its_first_beat_sends_none() -> None:
    beats, _ = heartbeats()
    quick = Message()
    beats.stop(beats.start(msg(quick)))
    slow = Message(beats_wanted=1)
    beat = beats.start(msg(slow))  # keeps the timer going past where quick's beat was due
    await slow.enough.wait()
    beats.stop(beat)
    assert quick.calls == 0


async def test_one_in_progress_ack_at_a_time_per_message() -> None:
    beats, _ = heartbeats()
    stuck = Message(hang=True)
    other = Message(beats_wanted=4)
    first, second = beats.start(msg(stuck)), beats.start(msg(other))
    await other.enough.wait()  # four intervals: stuck's first +WPI never returned
    beats.stop(first)
    beats.stop(second)
    assert stuck.calls == 1
    assert first.sending is not None
    assert first.sending.cancelling()  # stopped with it


async def test_no_beat_once_the_budget_is_spent() -> None:
    spent, _ = heartbeats(budget_s=INTERVAL)  # a first beat is due by the budget's end
    clock, _ = heartbeats()  # the same rhythm, no budget to speak of
    over, other = Message(), Message(beats_wanted=3)
    first, second = spent.start(msg(over)), clock.start(msg(other))
    await other.enough.wait()  # started together; three of its beats came and went
    spent.stop(first)
    clock.stop(second)
    assert over.calls <= 1
