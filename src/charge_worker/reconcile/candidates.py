"""Which charges of one history page reconcile must decide on a lookup. Pure: no I/O.

A page is sorted out against the ledger rows of its keys, read in one statement:

| a charge on the page                                     | is                              |
|----------------------------------------------------------|---------------------------------|
| captured, and the key's row records another charge, or   | a candidate: its key is decided |
| none, or has no row (a double, a charge the ledger said  | on its own lookup (`charges.py`)|
| no to, a key the ledger forgot)                          |                                 |
| ... for an open row, alone on the page for its key, made | deferred: the next run reads it |
| inside the overlap (a worker that has not recorded yet)  | again, recorded by then         |
| made (refunded since or not), and the charge a succeeded | shown: the row is no possible   |
| row records                                              | discrepancy any more            |
| anything else (declined, refunded, not our metadata)     | nothing to do                   |
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from charge_worker.gateway import GatewayCharge
from charge_worker.messages import MAX_ORDER_ID

Key = tuple[int, dt.date]
OPEN = frozenset({"scheduled", "pending"})


@dataclass(frozen=True)
class Recorded:
    """What the ledger row of a key says: its status, its charge, and the charge the
    gateway's history (or a lookup) has shown for it."""

    status: str
    charge_id: str | None
    seen: str | None = None


@dataclass
class PageWork:
    """A page sorted out: the keys to decide (sorted), the rows it shows, what waits."""

    candidates: list[Key]
    shown: list[tuple[Key, str]]
    deferred: int = field(default=0)


def ours(order_id: str | None, billing_period: str | None) -> Key | None:
    """The key a charge's metadata names, or None when it could name no ledger row."""
    if order_id is None or billing_period is None:
        return None
    try:
        key = int(order_id), dt.date.fromisoformat(billing_period)
    except ValueError:
        return None
    return key if 0 < key[0] <= MAX_ORDER_ID else None


def sort_page(
    charges: Sequence[GatewayCharge], recorded: Mapping[Key, Recorded], *, defer_from: int | None
) -> PageWork:
    """Sort out one page against the ledger rows of its keys (a key with no row is
    missing from `recorded`). `defer_from`: unix seconds from which the next run reads
    the history again (None: nothing is read twice, nothing waits)."""
    captured: dict[Key, list[GatewayCharge]] = defaultdict(list)
    shown: list[tuple[Key, str]] = []
    for charge in charges:
        key = ours(charge.order_id, charge.billing_period)
        if key is None:
            continue
        row = recorded.get(key)
        if charge.captured:
            captured[key].append(charge)
        if (
            charge.charged
            and row is not None
            and row.status == "succeeded"
            and row.charge_id == charge.id
            and row.seen != charge.id
        ):
            shown.append((key, charge.id))
    work = PageWork([], shown)
    for key, found in sorted(captured.items()):
        row = recorded.get(key)
        if row is not None and all(c.id == row.charge_id for c in found):
            continue
        if _waits(found, row, defer_from):
            work.deferred += 1
        else:
            work.candidates.append(key)
    return work


def _waits(found: list[GatewayCharge], row: Recorded | None, defer_from: int | None) -> bool:
    """A worker's charge it has not recorded yet, which the next run reads again."""
    return (
        defer_from is not None
        and row is not None
        and row.status in OPEN
        and len(found) == 1
        and found[0].created >= defer_from
    )
