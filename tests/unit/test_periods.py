"""Billing periods from an anchor: the table card billing uses, and no drift, ever."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from charge_worker.periods import MAX_CATCH_UP, due_periods, next_period, on_schedule

D = dt.date


@pytest.mark.parametrize(
    ("anchor", "current", "interval", "count", "expected"),
    [
        (D(2027, 1, 31), D(2027, 1, 31), "month", 1, D(2027, 2, 28)),
        (D(2027, 1, 31), D(2027, 2, 28), "month", 1, D(2027, 3, 31)),  # back to the 31st
        (D(2027, 1, 31), D(2027, 3, 31), "month", 1, D(2027, 4, 30)),
        (D(2028, 1, 30), D(2028, 1, 30), "month", 1, D(2028, 2, 29)),  # a leap year
        (D(2027, 1, 15), D(2027, 12, 15), "month", 1, D(2028, 1, 15)),
        (D(2027, 11, 30), D(2027, 11, 30), "month", 3, D(2028, 2, 29)),
        (D(2027, 11, 30), D(2028, 2, 29), "month", 3, D(2028, 5, 30)),
        (D(2028, 2, 29), D(2028, 2, 29), "year", 1, D(2029, 2, 28)),
        (D(2028, 2, 29), D(2031, 2, 28), "year", 1, D(2032, 2, 29)),
        (D(2027, 3, 1), D(2027, 3, 1), "year", 2, D(2029, 3, 1)),
        (D(2027, 6, 10), D(2027, 1, 10), "month", 1, D(2027, 2, 10)),  # before its anchor
    ],
)
def test_next_period(
    anchor: dt.date, current: dt.date, interval: str, count: int, expected: dt.date
) -> None:
    assert next_period(anchor, current, interval, count) == expected  # type: ignore[arg-type]


@given(
    anchor=st.dates(min_value=D(2000, 1, 1), max_value=D(2100, 1, 1)),
    count=st.integers(min_value=1, max_value=12),
    steps=st.integers(min_value=1, max_value=60),
)
def test_every_period_keeps_the_anchor_day_where_the_month_has_it(
    anchor: dt.date, count: int, steps: int
) -> None:
    period = anchor
    for _ in range(steps):
        following = next_period(anchor, period, "month", count)
        months = (following.year - period.year) * 12 + following.month - period.month
        assert months == count
        assert following.day == anchor.day or (
            following.day < anchor.day
            and (
                (following + dt.timedelta(days=1)).month != following.month  # the month's last day
            )
        )
        period = following


def test_due_periods_from_the_first_through_the_day_and_the_one_after() -> None:
    periods, after = due_periods(D(2027, 1, 31), D(2027, 1, 31), "month", 1, D(2027, 5, 30))
    assert periods == [D(2027, 1, 31), D(2027, 2, 28), D(2027, 3, 31), D(2027, 4, 30)]
    assert after == D(2027, 5, 31)
    none = due_periods(D(2027, 1, 31), D(2027, 6, 30), "month", 1, D(2027, 5, 30))
    assert none == ([], D(2027, 6, 30))


def test_catch_up_is_bounded_per_run() -> None:
    periods, after = due_periods(D(1800, 1, 1), D(1800, 1, 1), "month", 1, D(2027, 1, 1))
    assert len(periods) == MAX_CATCH_UP
    assert after == D(1900, 1, 1)  # the next run goes on from there


def test_on_schedule_knows_the_schedule_s_periods_and_no_others() -> None:
    assert on_schedule(D(2027, 1, 31), D(2027, 2, 28), "month", 1)
    assert on_schedule(D(2027, 1, 31), D(2026, 11, 30), "month", 1)
    assert not on_schedule(D(2027, 1, 31), D(2027, 2, 27), "month", 1)
    assert on_schedule(D(2027, 11, 30), D(2028, 2, 29), "month", 3)
    assert not on_schedule(D(2027, 11, 30), D(2027, 12, 30), "month", 3)
    assert on_schedule(D(2028, 2, 29), D(2029, 2, 28), "year", 1)
    assert not on_schedule(D(2028, 2, 29), D(2029, 3, 1), "year", 1)
