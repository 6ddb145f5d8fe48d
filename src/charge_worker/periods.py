"""Billing periods: every `count` months or years from an anchor day, as card billing does.

A subscription anchored on the 31st is billed on the 31st of every month that has one and
on the month's last day otherwise, and it stays on the 31st: each period is computed from
the anchor, never from the previous period (which drifts to the 28th after February).
Pure functions of dates; no I/O. The producer schedules by them; reconcile checks that a
charge it would adopt is for a period of its subscription.
"""

from __future__ import annotations

import calendar
import datetime as dt
import functools
from typing import Literal

Interval = Literal["month", "year"]
MAX_CATCH_UP = 1200  # periods due in one run for one subscription: 100 years of months


def _months(interval: Interval, count: int) -> int:
    return count * (12 if interval == "year" else 1)


@functools.lru_cache(maxsize=4096)  # a month start's subscriptions share few anchors
def on_anchor(anchor: dt.date, months_after: int) -> dt.date:
    """The anchor's day, `months_after` months after the anchor's month, clamped to the
    month's last day."""
    index = anchor.year * 12 + anchor.month - 1 + months_after
    year, month = divmod(index, 12)
    last = calendar.monthrange(year, month + 1)[1]
    return dt.date(year, month + 1, min(anchor.day, last))


def next_period(anchor: dt.date, current: dt.date, interval: Interval, count: int) -> dt.date:
    """The period after `current`, itself a period of the schedule (its month says which)."""
    step = _months(interval, count)
    elapsed = (current.year - anchor.year) * 12 + current.month - anchor.month
    return on_anchor(anchor, (elapsed // step + 1) * step)


def due_periods(
    anchor: dt.date, first: dt.date, interval: Interval, count: int, day: dt.date
) -> tuple[list[dt.date], dt.date]:
    """`first` and every following period on or before `day`, oldest first (at most
    `MAX_CATCH_UP`: a subscription decades behind is caught up over several runs), and the
    period after the last of them: where the subscription moves on to."""
    periods: list[dt.date] = []
    period = first
    while period <= day and len(periods) < MAX_CATCH_UP:
        periods.append(period)
        period = next_period(anchor, period, interval, count)
    return periods, period


def on_schedule(anchor: dt.date, period: dt.date, interval: Interval, count: int) -> bool:
    """Whether `period` is one of the schedule's periods (before the anchor's too)."""
    step = _months(interval, count)
    elapsed = (period.year - anchor.year) * 12 + period.month - anchor.month
    return elapsed % step == 0 and on_anchor(anchor, elapsed) == period
