"""The circuit breaker's states, on a clock the test moves (`charge_worker.breaker`)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from charge_worker.breaker import Breaker, BreakerOpen, State


class Down(Exception):
    """A failure that counts."""


class Verdict(Exception):
    """An answer that does not count: the dependency works."""


class Replayed(Down):
    """An old failure told again: neither a failure nor a success."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, changes: list[State] | None = None) -> Breaker:
    b = Breaker(
        "gateway",
        fail_max=3,
        reset_s=30,
        counts=lambda e: isinstance(e, Down),
        neutral=lambda e: isinstance(e, Replayed),
        clock=clock,
    )
    if changes is not None:
        b.listeners.append(changes.append)
    return b


def call(b: Breaker, error: BaseException | None = None) -> None:
    """One call through the breaker, ending in `error` (raised as it was) or a success."""
    with b:
        if error is not None:
            raise error


def fail(b: Breaker, times: int = 1) -> None:
    for _ in range(times):
        with pytest.raises(Down):  # the tripping call's own error too: never replaced
            call(b, Down())


def test_counted_failures_in_a_row_open_it_and_it_refuses_until_the_reset() -> None:
    clock, changes = Clock(), list[State]()
    b = breaker(clock, changes)
    fail(b, 2)
    assert b.state == "closed"
    fail(b)
    assert (b.state, changes) == ("open", ["open"])
    clock.now += 29.5
    assert b.open_for_s() == pytest.approx(0.5)
    with pytest.raises(BreakerOpen, match="gateway breaker open"):
        call(b)
    clock.now += 0.5
    assert b.open_for_s() == 0.0


@pytest.mark.parametrize("between", [None, Verdict()])
def test_a_success_or_an_answer_ends_the_run_of_failures(between: Exception | None) -> None:
    b = breaker(Clock())
    fail(b, 2)
    with pytest.raises(Verdict) if between else contextlib.nullcontext():
        call(b, between)
    fail(b, 2)
    assert (b.state, b.failures) == ("closed", 2)


def test_after_the_reset_one_call_decides_closed_or_open_again() -> None:
    clock, changes = Clock(), list[State]()
    b = breaker(clock, changes)
    fail(b, 3)
    clock.now += 30
    fail(b)  # the half-open trial fails: open for another reset_s, from now
    assert (b.state, b.open_for_s()) == ("open", 30.0)
    clock.now += 30
    call(b)
    assert (b.state, b.failures) == ("closed", 0)
    assert changes == ["open", "half-open", "open", "half-open", "closed"]


def test_a_cancelled_call_proves_nothing() -> None:
    b = breaker(Clock())
    fail(b, 2)
    with pytest.raises(asyncio.CancelledError):
        call(b, asyncio.CancelledError())
    assert b.failures == 2


def test_a_neutral_answer_neither_counts_nor_ends_the_run() -> None:
    b = breaker(Clock())
    fail(b, 2)
    for _ in range(5):
        with pytest.raises(Replayed):
            call(b, Replayed())
    assert (b.state, b.failures) == ("closed", 2)
    fail(b)
    assert b.state == "open"


def test_a_call_begun_before_it_opened_does_not_keep_it_open_longer() -> None:
    clock = Clock()
    b = breaker(clock)
    b.__enter__()  # a call in flight while three others fail
    fail(b, 3)
    opened, clock.now = b.opened_at, clock.now + 10
    b.__exit__(Down, Down(), None)  # it fails too
    assert (b.state, b.opened_at) == ("open", opened)
