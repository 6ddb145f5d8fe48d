"""What one gateway webhook does to the ledger: a pure function of the event and the row.

The event carries a snapshot of one gateway charge object at a `revision`; the ledger row
(`charge_attempts`, found by the charge's metadata) records which charge it holds
(`gateway_charge_id`) and the revision of it applied last (`gateway_revision`). A snapshot
is the whole charge, so only the newest one known counts: an older one is stale even when
it is processed first (the journal holds a newer one, in the same batch or not).

A refunded charge keeps `status: "succeeded"` and says `refunded: true` (docs/contracts/gateway.md);
its state here is `refunded`. The shape from before that contract (`status: "refunded"`) is
still read the same way: journal rows written before an upgrade, and a gateway not on it yet.

| ledger row                           | snapshot                       | decision                |
|--------------------------------------|--------------------------------|-------------------------|
| any                                  | a newer revision is journaled  | stale                   |
| any                                  | partly refunded                | review                  |
| none, and no metadata of ours        | any                            | stale (not ours)        |
| none yet                             | any                            | wait                    |
| at try n                             | failed, of an earlier try      | applied, no change      |
|                                      | failed, of a try after n       | review                  |
| `retry_scheduled`/`action_required`  | failed                         | applied, no change      |
| (waiting for the next try)           | another fingerprint            | review (unmatched)      |
|                                      | succeeded / a dispute /        | succeeded / processing  |
|                                      | processing / refunded in full  | / refunded: no next try |
| holds another charge id              | newer revision already applied | stale                   |
|                                      | succeeded, or a dispute        | review (double charge)  |
|                                      | refunded / failed              | applied, no change      |
| this charge, revision >= the event's | any                            | stale                   |
| `scheduled`/`pending`, live lease    | any                            | wait (a worker owns it) |
| `scheduled`/`pending`, no live lease | another fingerprint            | review (unmatched)      |
|                                      | succeeded / failed             | succeeded / declined    |
|                                      | refunded in full               | refunded                |
|                                      | a dispute, an older refund     | wait (unless confirmed) |
|                                      | shape                          |                         |
| same status as the snapshot          | any                            | record the revision     |
| `succeeded`                          | refunded                       | refunded                |
| `processing` (the bank settles it)   | succeeded / failed / refunded  | succeeded / declined /  |
|                                      |                                | refunded                |
| `failed`                             | failed                         | record the revision     |
| anything else                        | any                            | review                  |

A charge's try is its metadata's `attempt` (absent: 1); the row holds the period's current
try (`current_try`). As in the worker's lookup, money of any try is the period's, and only the
current try's failed charge is its decline: it leaves the period in the state the retry
schedule says (`retries.schedule.after_decline`: `retry_scheduled`, `action_required` or
`declined`, with the decline code the snapshot names). An earlier try's decline was recorded
when that try ended: it changes nothing. A period waiting for its next try that turns out to
hold money (a charge of any try, proven by its fingerprint) is recorded with it, so the next
try never starts; a `declined` one is final, and a charge found for it is reviewed (reconcile
records it).

`processing` (a Stripe PaymentIntent the bank settles days later) is a snapshot's state like
the others: an open row records it as `processing` (still not final), and a `processing` row
records what it settled as.

Recording a charge the row does not hold yet makes it the period's payment (or its
decline), so the charge must prove it is the one the row was due: its fingerprint (amount,
currency, customer) is the row's. A charge someone else made with our metadata (a support
agent, another integration, a verification charge) records nothing: `review` (unmatched),
and the row stays as it was, so the due charge goes ahead. A full refund's snapshot is the
whole charge (made for this key with this fingerprint, then refunded), so it proves the state
before it and applies at once, even ahead of the charge's own event (revision 3 before 2).

A dispute also sets the row's dispute flag and review reason. `confirmed` means the
snapshot's status comes from a gateway lookup made after the wait bound: it may then record a
charge the ledger never saw, and a wait becomes a review (nothing is left to wait for), unless
a worker's live lease holds the row (the worker will record it: keep waiting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from charge_worker.retries.schedule import WAITING, after_decline

# the charge's state (`state_of`) -> the ledger status that records it
LEDGER_STATUS = {
    "succeeded": "succeeded",
    "refunded": "refunded",
    "failed": "declined",
    "processing": "processing",
}
EVENT_TYPES = frozenset(
    {
        "charge.succeeded",
        "charge.failed",
        "charge.refunded",
        "charge.dispute_created",
        "charge.processing",
    }
)
DISPUTE = "charge.dispute_created"
OPEN = frozenset({"scheduled", "pending"})


def state_of(status: str, *, refunded: bool) -> str:
    """The charge's state from its `status` and `refunded` flag: `refunded` once fully
    refunded (the contract keeps its status `succeeded`), else its status."""
    return "refunded" if refunded and status == "succeeded" else status


@dataclass(frozen=True)
class Fingerprint:
    """What makes a charge the one a ledger row was due: amount (minor units), currency,
    customer. Currencies compare in upper case (the ledger's spelling; Stripe's is lower)."""

    amount: int
    currency: str
    customer: str

    @classmethod
    def of(cls, amount: int | None, currency: str | None, customer: str | None) -> Self | None:
        """The fingerprint, or None when a part is missing (nothing is proven then)."""
        if amount is None or currency is None or customer is None:
            return None
        return cls(amount, currency.upper(), customer)

    def __str__(self) -> str:
        return f"{self.amount} {self.currency} for {self.customer or 'no customer'}"


@dataclass(frozen=True)
class Snapshot:
    """What an event says: charge `charge_id` had gateway `status` at `revision`, with
    `amount_refunded` (minor units) of it refunded, all of it when `refunded`; `keyed`: it
    carries our `order_id`/`billing_period` metadata; `fingerprint` its amount, currency
    and customer (None when the event does not say); `attempt` the period's try that made it
    (`metadata.attempt`, absent: 1); `decline_code` a failed one's, when it says."""

    event_type: str
    charge_id: str
    revision: int
    status: str
    refunded: bool = False
    amount_refunded: int = 0
    keyed: bool = True
    fingerprint: Fingerprint | None = None
    attempt: int = 1
    decline_code: str | None = None

    @property
    def state(self) -> str:
        """`succeeded`, `failed` or `refunded` (or whatever unknown status it has)."""
        return state_of(self.status, refunded=self.refunded)


@dataclass(frozen=True)
class Row:
    """The ledger row of the charge's key, as the decision needs it."""

    status: str
    charge_id: str | None
    revision: int | None
    lease_free: bool
    fingerprint: Fingerprint | None = None  # what the row is due: amount, currency, customer
    current_try: int = 1


@dataclass(frozen=True)
class Apply:
    """Write the snapshot: its revision, the charge id, `status` (None: unchanged), a dispute;
    a decline's code, and with `retry_scheduled` the wait before the next try."""

    status: str | None
    disputed: bool
    change: str
    decline_code: str | None = None
    retry_in_s: float | None = None


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
    """A gap nothing here can explain: a human looks (journal status `needs_review`).

    `unmatched`: a charge with our metadata whose fingerprint is not the row's."""

    why: str
    unmatched: bool = False


Decision = Apply | Unchanged | Stale | Wait | Review


def decide(
    event: Snapshot,
    row: Row | None,
    *,
    confirmed: bool = False,
    newest_applied: int = 0,
    newest_known: int = 0,
    schedule: Sequence[float] = (),
) -> Decision:
    """The decision for `event` against `row`. Of the other events about this charge object
    in the journal, `newest_applied` is the newest revision applied (it matters for charges
    the row does not hold), `newest_known` the newest journaled, whatever its status.
    `schedule`: the waits before tries 2, 3, ... (`CHARGE_WORKER_RETRY_SCHEDULE`), which
    decide what the current try's decline leaves the period in."""
    decision = _decide(
        event, row, confirmed=confirmed, newest_applied=newest_applied, newest_known=newest_known
    )
    if isinstance(decision, Apply) and decision.status == "declined" and row is not None:
        decision = _after_decline(event, row, decision, schedule)
    if confirmed and isinstance(decision, Wait) and not decision.worker_owned:
        return Review(f"still unresolved after a gateway lookup: {decision.why}")
    return decision


def _decide(
    event: Snapshot, row: Row | None, *, confirmed: bool, newest_applied: int, newest_known: int
) -> Decision:
    refused = _refused(event, newest_known)
    if refused is not None:
        return refused
    target = LEDGER_STATUS[event.state]
    if row is None and not event.keyed:  # no worker will ever record a charge not ours
        return Stale(
            f"{event.charge_id} carries no order_id/billing_period of ours and no ledger row "
            "holds it: not ours"
        )
    if row is None:
        return Wait("no ledger row for this charge's order and period yet")
    return _on_row(event, row, target, confirmed=confirmed, newest_applied=newest_applied)


def _on_row(
    event: Snapshot, row: Row, target: str, *, confirmed: bool, newest_applied: int
) -> Decision:
    if target == "declined" and event.attempt != row.current_try:
        return _another_try(event, row)
    dispute = event.event_type == DISPUTE
    if row.status in WAITING:
        return _waiting(event, row, target, dispute)
    if row.charge_id is not None and row.charge_id != event.charge_id:
        return _other_charge(event, row, target, dispute, newest_applied)
    return _this_charge(event, row, target, dispute, confirmed=confirmed)


def _another_try(event: Snapshot, row: Row) -> Decision:
    """A decline of a try that is not the period's current one."""
    if event.attempt < row.current_try:  # recorded when that try ended
        return Unchanged(
            f"{event.charge_id} is try {event.attempt}'s decline; the period is at try "
            f"{row.current_try} ({row.status})"
        )
    return Review(
        f"{event.charge_id} is a decline of try {event.attempt}, which was never started; "
        f"the period is at try {row.current_try} ({row.status})"
    )


def _waiting(event: Snapshot, row: Row, target: str, dispute: bool) -> Decision:
    """A period waiting for its next try (`retry_scheduled`, `action_required`): its current
    try's decline is recorded already. A charge that made money (or that the bank still
    settles, or refunded since: made all the same, as the worker's lookup reads it) means
    the period must never be tried again: recorded, once its fingerprint proves it the
    period's (a dispute too: the money was taken)."""
    if target == "declined":
        return Unchanged(f"the ledger has try {row.current_try}'s decline ({row.status})")
    if event.fingerprint is None:  # a bare snapshot: the lookup after the wait proves it
        return Wait(f"{event.charge_id} does not say its amount, currency and customer")
    if (unmatched := _unmatched(event, row)) is not None:
        return unmatched
    return Apply(target, dispute, f"{row.status} -> {target}: the period holds money, no next try")


def _after_decline(event: Snapshot, row: Row, decision: Apply, schedule: Sequence[float]) -> Apply:
    """The current try's decline, written as the worker writes it: the state its class and
    the try's number leave the period in, its code and the wait before the next try."""
    after = after_decline(event.decline_code, row.current_try, schedule)
    change = decision.change.removesuffix("declined") + after.status
    return Apply(
        after.status,
        decision.disputed,
        change,
        decline_code=event.decline_code,
        retry_in_s=after.retry_in_s,
    )


def _refused(event: Snapshot, newest_known: int) -> Decision | None:
    """Why the event changes nothing whatever the ledger holds, or None."""
    if event.event_type not in EVENT_TYPES:
        return Review(f"unknown event type {event.event_type!r}")
    if event.state not in LEDGER_STATUS:
        return Review(f"unknown charge status {event.status!r}")
    if newest_known > event.revision:
        return Stale(f"revision {newest_known} of {event.charge_id} is journaled: only it applies")
    if event.amount_refunded > 0 and event.state != "refunded":
        return Review(
            f"{event.charge_id} is partly refunded ({event.amount_refunded} minor units); "
            "the ledger records only full refunds"
        )
    return None


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
    if row.status == "processing" and target in ("succeeded", "declined", "refunded"):
        return Apply(target, dispute, f"processing -> {target}")
    return Review(
        f"the gateway says {event.charge_id} is {event.state} (revision {event.revision}) "
        f"but the ledger records {row.status}"
    )


def _not_recorded(
    event: Snapshot, row: Row, target: str, dispute: bool, *, confirmed: bool
) -> Decision:
    """A charge the ledger row has not recorded yet (`scheduled`/`pending`)."""
    if not row.lease_free:
        return Wait(f"a worker holds the lease on this {row.status} charge", worker_owned=True)
    if row.charge_id is None:  # recording it makes it the period's charge: it must prove so
        if event.fingerprint is None:  # a bare snapshot: the lookup after the wait proves it
            return Wait(f"{event.charge_id} does not say its amount, currency and customer")
        if (unmatched := _unmatched(event, row)) is not None:
            return unmatched
    # a full refund's snapshot is the whole charge: made for this key with this fingerprint
    # (checked above), then refunded; it proves the state before it, nothing is left to wait
    proven = target == "refunded" and event.refunded and row.charge_id is None
    if dispute and not confirmed:
        return Wait(f"the ledger has not recorded {event.charge_id} yet ({row.status})")
    if target == "refunded" and not (confirmed or proven):
        return Wait(f"the ledger has not recorded {event.charge_id} yet ({row.status})")
    return Apply(target, dispute, f"{row.status} -> {target}")


def _unmatched(event: Snapshot, row: Row) -> Review | None:
    """A `Review` when the charge's fingerprint is not the one the row is due, else None."""
    if event.fingerprint is not None and event.fingerprint == row.fingerprint:
        return None
    said = f"is {event.fingerprint}" if event.fingerprint else "says no amount or customer"
    return Review(
        f"unmatched charge: {event.charge_id} {said}, the ledger's row is due {row.fingerprint}"
        "; nothing recorded, the due charge goes ahead",
        unmatched=True,
    )


def _other_charge(
    event: Snapshot, row: Row, target: str, dispute: bool, newest_applied: int
) -> Decision:
    recorded = row.charge_id
    if newest_applied >= event.revision:
        return Stale(f"revision {newest_applied} of {event.charge_id} was applied already")
    if dispute:
        return Review(
            f"a dispute on {event.charge_id}, which the ledger does not record "
            f"(it records {recorded})"
        )
    if target == "succeeded" and (unmatched := _unmatched(event, row)) is not None:
        return unmatched
    if target == "succeeded":
        return Review(
            f"a second successful charge {event.charge_id} for a key the ledger records as "
            f"{recorded}: a double charge (reconcile refunds it)"
        )
    return Unchanged(f"{event.charge_id} is {event.state}; the ledger records {recorded}")
