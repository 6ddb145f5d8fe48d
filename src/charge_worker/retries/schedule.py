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

from charge_worker.declines import DeclineClass

AfterDeclineStatus = Literal["declined", "retry_scheduled", "action_required"]


@dataclass(frozen=True)
class AfterDecline:
    """The period's state after a declined try."""

    status: AfterDeclineStatus
    retry_in_s: float | None = None  # with `retry_scheduled`: the wait before the next try
    exhausted: bool = False  # final because the schedule has no step left (a soft decline)


def after_decline(klass: DeclineClass, try_no: int, schedule: Sequence[float]) -> AfterDecline:
    """The state a period takes when its try `try_no` (1, 2, ...) is declined as `klass`,
    under a schedule of waits before tries 2, 3, ..."""
    if klass == "hard":
        return AfterDecline("declined")
    if klass == "customer_action":
        return AfterDecline("action_required")
    if try_no <= len(schedule):
        return AfterDecline("retry_scheduled", retry_in_s=schedule[try_no - 1])
    return AfterDecline("declined", exhausted=True)
