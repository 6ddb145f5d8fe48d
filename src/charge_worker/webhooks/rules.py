"""What one gateway webhook does to the ledger: a pure function of the event and the row.

The event carries a snapshot of one gateway charge object at a `revision`; the ledger row
(`charge_attempts`, found by the charge's metadata) records which charge it holds
(`gateway_charge_id`) and the revision of it applied last (`gateway_revision`).

| ledger row                           | snapshot                       | decision                |
|--------------------------------------|--------------------------------|-------------------------|
| none yet                             | any                            | wait                    |
| holds another charge id              | newer revision already applied | stale                   |
|                                      | succeeded, or a dispute        | review (double charge)  |
|                                      | refunded / failed              | applied, no change      |
| this charge, revision >= the event's | any                            | stale                   |
| `scheduled`/`pending`, live lease    | any                            | wait (a worker owns it) |
| `scheduled`/`pending`, no live lease | succeeded / failed             | succeeded / declined    |
|                                      | refunded, or a dispute         | wait (unless confirmed) |
| same status as the snapshot          | any                            | record the revision     |
| `succeeded`                          | refunded                       | refunded                |
| `failed`                             | failed                         | record the revision     |
| anything else                        | any                            | review                  |

A dispute also sets the row's dispute flag and review reason. `confirmed` means the
snapshot's status comes from a gateway lookup made after the wait bound: it may then record a
charge the ledger never saw, and a wait becomes a review (nothing is left to wait for), unless
a worker's live lease holds the row (the worker will record it: keep waiting).
"""

from __future__ import annotations

from dataclasses import dataclass

# the gateway's charge status -> the ledger status that records it
LEDGER_STATUS = {"succeeded": "succeeded", "refunded": "refunded", "failed": "declined"}
EVENT_TYPES = frozenset(
    {"charge.succeeded", "charge.failed", "charge.refunded", "charge.dispute_created"}
)
DISPUTE = "charge.dispute_created"
OPEN = frozenset({"scheduled", "pending"})


@dataclass(frozen=True)
class Snapshot:
    """What an event says: charge `charge_id` had gateway `status` at `revision`."""

    event_type: str
    charge_id: str
    revision: int
    status: str


@dataclass(frozen=True)
class Row:
    """The ledger row of the charge's key, as the decision needs it."""

    status: str
    charge_id: str | None
    revision: int | None
    lease_free: bool


@dataclass(frozen=True)
class Apply:
    """Write the snapshot: its revision, the charge id, `status` (None: unchanged), a dispute."""

    status: str | None
    disputed: bool
    change: str


@dataclass(frozen=True)
class Unchanged:
    """Processed; the ledger has nothing to record (journal status `applied`)."""

    why: str


@dataclass(frozen=True)
class Stale:
    """Older than what the ledger holds: changes nothing."""

    why: str


@dataclass(frozen=True)
class Wait:
    """The ledger has not reached the state this event builds on: retry later.

    `worker_owned`: a live worker lease holds the row, so waiting stays right even after a
    lookup (the worker records what the gateway did)."""

    why: str
    worker_owned: bool = False


@dataclass(frozen=True)
class Review:
    """A gap nothing here can explain: a human looks (journal status `needs_review`)."""

    why: str


Decision = Apply | Unchanged | Stale | Wait | Review


def decide(
    event: Snapshot, row: Row | None, *, confirmed: bool = False, newest_applied: int = 0
) -> Decision:
    """The decision for `event` against `row`; `newest_applied` is the newest revision of
    this charge object the journal has applied (it matters for charges the row does not hold)."""
    decision = _decide(event, row, confirmed=confirmed, newest_applied=newest_applied)
    if confirmed and isinstance(decision, Wait) and not decision.worker_owned:
        return Review(f"still unresolved after a gateway lookup: {decision.why}")
    return decision


def _decide(event: Snapshot, row: Row | None, *, confirmed: bool, newest_applied: int) -> Decision:
    target = LEDGER_STATUS.get(event.status)
    if event.event_type not in EVENT_TYPES:
        return Review(f"unknown event type {event.event_type!r}")
    if target is None:
        return Review(f"unknown charge status {event.status!r}")
    if row is None:
        return Wait("no ledger row for this charge's order and period yet")
    dispute = event.event_type == DISPUTE
    if row.charge_id is not None and row.charge_id != event.charge_id:
        return _other_charge(event, row.charge_id, target, dispute, newest_applied)
    return _this_charge(event, row, target, dispute, confirmed=confirmed)


def _this_charge(
    event: Snapshot, row: Row, target: str, dispute: bool, *, confirmed: bool
) -> Decision:
    if row.charge_id is not None and row.revision is not None and row.revision >= event.revision:
        return Stale(f"the ledger holds revision {row.revision} of {event.charge_id}")
    if row.status in OPEN:
        return _not_recorded(event, row, target, dispute, confirmed=confirmed)
    if row.status == target or (row.status, target) == ("failed", "declined"):
        return Apply(None, dispute, f"{row.status}, revision {event.revision}")
    if (row.status, target) == ("succeeded", "refunded"):
        return Apply(target, dispute, "succeeded -> refunded")
    return Review(
        f"the gateway says {event.charge_id} is {event.status} (revision {event.revision}) "
        f"but the ledger records {row.status}"
    )


def _not_recorded(
    event: Snapshot, row: Row, target: str, dispute: bool, *, confirmed: bool
) -> Decision:
    """A charge the ledger row has not recorded yet (`scheduled`/`pending`)."""
    if not row.lease_free:
        return Wait(f"a worker holds the lease on this {row.status} charge", worker_owned=True)
    if (target == "refunded" or dispute) and not confirmed:
        return Wait(f"the ledger has not recorded {event.charge_id} yet ({row.status})")
    return Apply(target, dispute, f"{row.status} -> {target}")


def _other_charge(
    event: Snapshot, recorded: str, target: str, dispute: bool, newest_applied: int
) -> Decision:
    if newest_applied >= event.revision:
        return Stale(f"revision {newest_applied} of {event.charge_id} was applied already")
    if dispute:
        return Review(
            f"a dispute on {event.charge_id}, which the ledger does not record "
            f"(it records {recorded})"
        )
    if target == "succeeded":
        return Review(
            f"a second successful charge {event.charge_id} for a key the ledger records as "
            f"{recorded}: a double charge (reconcile refunds it)"
        )
    return Unchanged(f"{event.charge_id} is {event.status}; the ledger records {recorded}")
