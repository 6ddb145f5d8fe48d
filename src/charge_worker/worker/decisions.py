"""Pure decisions: what happened to a message -> what to tell JetStream. No I/O here.

| outcome                                   | action                                   |
|-------------------------------------------|------------------------------------------|
| charged, declined, blocked, duplicate,    | ack                                      |
| processing (the provider settles it later)|                                          |
| poison, conflict, unverified, rejected    | dead letter with that reason, then term  |
| any retryable outcome, deliveries left    | nak with delay (its own, else backoff)   |
| crashed, last delivery                    | dead letter `max_deliveries`, then term  |
| any other retryable outcome, last delivery| requeue: publish a fresh copy, then ack  |

The delay of a retryable outcome is the one it carries (the gateway's `Retry-After`, the
time left on another worker's lease), clamped to 0 .. the last backoff step (a `Retry-After`
of a year would park a charge for a year), or else the consumer's backoff step for this
delivery, so a nak waits as long as an ack timeout would have. A charge call whose answer
was lost keeps its lease, so its retry waits the lease out: by then the call has surely
ended.

Why requeue: a gateway that rate-limits, is down, or has not answered is no fault of the
message, and every nak spends a delivery. Dead-lettering a valid due charge for that would
turn an outage into lost revenue that needs a human. So such a message goes round again
as a fresh copy (the ledger row stays pending; the claim still allows one charge), at the
pace of the backoff steps. Only a message whose processing keeps crashing, or whose worker
keeps dying, runs out of deliveries into the dead-letter stream.

A worker that dies (kill -9, OOM) decides nothing: its message's deliveries run out
without a verdict, and JetStream's MAX_DELIVERIES advisory says so
(`after_deliveries_ran_out`). A death is no verdict on the message either: every message
in flight dies with the one that caused it, and each death spends two deliveries (the
redelivery that finds the dead worker's lease, then the one that takes it over). So a
charge the ledger holds as settled is forgotten (only its ack was lost), a valid open one
is requeued, and only the `MAX_EXHAUSTIONS`-th copy to run out is dead-lettered
`max_deliveries`: a charge that keeps killing its workers, or a fleet in a crash loop, for
a human to look at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from charge_worker import errors
from charge_worker.settings import Settings


class Outcome(StrEnum):
    """What processing one delivery came to; also the `outcome` label of the metrics."""

    CHARGED = "charged"
    DECLINED = "declined"
    PROCESSING = "processing"  # accepted; the bank settles it later: open, never re-sent
    BLOCKED = "blocked"
    DUPLICATE = "duplicate"
    POISON = "poison"
    CONFLICT = "conflict"
    UNVERIFIED = "unverified"  # no subscription says so (CHARGE_WORKER_VERIFY_SUBSCRIPTION)
    REJECTED = "rejected"
    OUTCOME_UNKNOWN = "outcome_unknown"
    IN_PROGRESS = "in_progress"
    RATE_LIMITED = "rate_limited"
    LEASE_HELD = "lease_held"
    UNAVAILABLE = "unavailable"
    CRASHED = "crashed"  # an unexpected error while processing: a bug, not the world


FINAL = frozenset(
    {Outcome.CHARGED, Outcome.DECLINED, Outcome.PROCESSING, Outcome.BLOCKED, Outcome.DUPLICATE}
)
PERMANENT = frozenset({Outcome.POISON, Outcome.CONFLICT, Outcome.UNVERIFIED, Outcome.REJECTED})


@dataclass(frozen=True)
class Result:
    """An outcome, with the delay it asks for and a one-line cause when it is not final.

    `call_in_flight`: this delivery's charge call may still be running at the gateway (its
    answer was lost or it crashed after sending); the lease is kept until it is over.
    """

    outcome: Outcome
    retry_after_s: float | None = None
    error: str | None = None
    call_in_flight: bool = False


@dataclass(frozen=True)
class Ack:
    pass


@dataclass(frozen=True)
class Nak:
    delay_s: float


@dataclass(frozen=True)
class DeadLetter:
    reason: str  # poison | conflict | unverified | rejected | max_deliveries


@dataclass(frozen=True)
class Requeue:
    pass


Action = Ack | Nak | DeadLetter | Requeue


def result_of(error: errors.ChargeWorkerError, *, call_in_flight: bool = False) -> Result:
    """The result a domain error stands for: the outcome its class names (see `errors`)."""
    retry = error.retry_after_s if isinstance(error, errors.TransientError) else None
    return Result(Outcome(error.outcome), retry, str(error), call_in_flight)


@dataclass(frozen=True)
class Policy:
    """The consumer's shape that decisions depend on (from the settings)."""

    max_deliver: int
    backoff_s: tuple[float, ...]
    ack_wait_s: float
    lease_s: float

    @classmethod
    def of(cls, settings: Settings) -> Policy:
        nats = settings.nats
        return cls(nats.max_deliver, nats.backoff_s, nats.ack_wait_s, settings.worker.lease_s)

    def backoff_delay(self, delivery: int) -> float:
        """The consumer's backoff step for this delivery (the last step repeats)."""
        if not self.backoff_s:
            return self.ack_wait_s
        return self.backoff_s[min(max(delivery, 1), len(self.backoff_s)) - 1]

    @property
    def longest_delay_s(self) -> float:
        """The longest a nak may wait: the last backoff step."""
        return self.backoff_s[-1] if self.backoff_s else self.ack_wait_s


def describe(action: Action) -> dict[str, object]:
    """An action as the `charge.settled` log line and the `delivery` event show it."""
    return {
        "action": type(action).__name__.lower(),
        "delay_s": action.delay_s if isinstance(action, Nak) else None,
        "dlq_reason": action.reason if isinstance(action, DeadLetter) else None,
    }


def decide(result: Result, delivery: int, policy: Policy) -> Action:
    """The one mapping from a delivery's result to what JetStream is told."""
    if result.outcome in FINAL:
        return Ack()
    if result.outcome in PERMANENT:
        return DeadLetter(result.outcome.value)
    if delivery >= policy.max_deliver:
        return DeadLetter("max_deliveries") if result.outcome is Outcome.CRASHED else Requeue()
    if result.call_in_flight and result.outcome is Outcome.OUTCOME_UNKNOWN:
        return Nak(policy.lease_s)  # the lease outlives the call: retry once both are over
    if result.retry_after_s is not None and not math.isnan(result.retry_after_s):
        return Nak(min(max(result.retry_after_s, 0.0), policy.longest_delay_s))
    return Nak(policy.backoff_delay(delivery))


class RedeliveryCause(StrEnum):
    """Why a message came again; the `cause` label of `charge_worker_redeliveries_total`."""

    NAK = "nak"  # its previous delivery nak'd it with a delay, on purpose (`decide`)
    UNACKED = "unacked"  # nobody told JetStream anything: AckWait ran out, a worker died


def redelivery_cause(delivery: int, nak_delivery: int | None) -> RedeliveryCause | None:
    """Why delivery `delivery` of a message came; None for a first delivery.

    `nak_delivery` is the delivery of the same message that the ledger row says nak'd it
    last (`Claim.nak_delivery`; None when nothing was claimed, or no nak was recorded). Only
    the row can tell, not the worker: another pod may have nak'd it. A redelivery is asked
    for when its previous delivery nak'd; anything else is `unacked`, including a nak that
    wrote nothing (the ledger away, a claim refused): when it cannot be shown to be asked
    for, a redelivery counts as the incident's pattern."""
    if delivery <= 1:
        return None
    if nak_delivery is not None and nak_delivery == delivery - 1:
        return RedeliveryCause.NAK
    return RedeliveryCause.UNACKED


MAX_EXHAUSTIONS = 3  # copies of one message that may run out of deliveries unsettled
EXHAUSTED_HEADER = "Charge-Exhausted"  # on a requeued copy: how many copies ran out before
# processing: settled by the provider's webhook or reconcile, never by a redelivery; a
# period waiting for its next try: that try comes as a message of its own (retries/starts.py)
SETTLED_STATUSES = frozenset(
    {
        "succeeded",
        "declined",
        "blocked",
        "failed",
        "refunded",
        "processing",
        "retry_scheduled",
        "action_required",
    }
)


def after_deliveries_ran_out(
    status: str | None, *, valid: bool, exhausted: int
) -> Literal["forget", "requeue", "dead_letter"]:
    """A message's last delivery died with its worker: what becomes of its stream copy.

    `status` is the ledger row's (None: no row), `valid` whether the body parses, and
    `exhausted` how many earlier copies of it ran out the same way.
    """
    if not valid:
        return "dead_letter"
    if status in SETTLED_STATUSES:
        return "forget"
    return "requeue" if exhausted + 1 < MAX_EXHAUSTIONS else "dead_letter"
