"""What follows a declined try: a pure decision on its decline class and its number.

A `hard` decline ends the period (`declined`); a `customer_action` decline waits for a
retry on purpose (`action_required`); a `soft` one schedules the next try after the
schedule's step for it (`retry_scheduled`), or ends the period when no step is left (the
tries are exhausted). The 30-day cap is applied where a try is started (`starts`), from the
tries' own times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from charge_worker.declines import DeclineClass, decline_class

AfterDeclineStatus = Literal["declined", "retry_scheduled", "action_required"]
# a period whose try ended declined waits for its next one in these states...
WAITING = frozenset({"retry_scheduled", "action_required"})
# ...and these are every state a declined try leaves it in
DECLINE_STATES = frozenset({"declined", *WAITING})


@dataclass(frozen=True)
class AfterDecline:
    """The period's state after a declined try."""

    status: AfterDeclineStatus
    decline_class: DeclineClass
    retry_in_s: float | None = None  # with `retry_scheduled`: the wait before the next try
    exhausted: bool = False  # final because the schedule has no step left (a soft decline)


def after_decline(code: str | None, try_no: int, schedule: Sequence[float]) -> AfterDecline:
    """The state a period takes when its try `try_no` (1, 2, ...) is declined with `code`
    (its class from `declines.py`), under a schedule of waits before tries 2, 3, ..."""
    klass = decline_class(code)
    if klass == "hard":
        return AfterDecline("declined", klass)
    if klass == "customer_action":
        return AfterDecline("action_required", klass)
    if try_no <= len(schedule):
        return AfterDecline("retry_scheduled", klass, retry_in_s=schedule[try_no - 1])
    return AfterDecline("declined", klass, exhausted=True)
