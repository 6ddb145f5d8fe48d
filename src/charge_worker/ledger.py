"""Every SQL statement on `charge_attempts` and `deferred_scoring_checks`.

The ledger is the lock. A claim is one atomic statement: insert the row, or take over a
`scheduled` row or a `pending` row whose lease has expired, bumping the fencing `attempt`.
Every later write names the attempt it belongs to (`WHERE lease_owner = $me AND attempt =
$n`), so a worker whose lease was taken over can never write. No transaction stays open
across a network call. asyncpg errors become `DependencyUnavailable` here.

No write precedes a gateway call while the lease holds. The worker dates its lease on its
own clock too, and starts a call only while the lease outlives it (`Claim.outlives`), else
renews it first (`extend`, fenced): nobody can take the charge over until that call is
over. The call is counted by the write that records what it came to (`Attempted`); a
worker that dies mid-call writes nothing, so a claim that takes over an expired lease
treats the outcome as unknown and looks the key up first.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import asyncpg

from charge_worker import events
from charge_worker.database import translated
from charge_worker.declines import DeclineClass, decline_class
from charge_worker.errors import AlreadySettled, LeaseHeld, PayloadConflict, Unverified
from charge_worker.messages import ChargeDue
from charge_worker.retries.schedule import DECLINE_STATES
from charge_worker.settings import LEASE_MARGIN_S

Scoring = Literal["approved", "blocked", "deferred"]
# what a delivery may settle a charge's try as; `processing` is no final state: the provider
# accepted the charge and settles it later (a bank debit), and nothing is re-sent meanwhile;
# a declined try leaves the period `declined` (final), `retry_scheduled` or `action_required`
# (retries/schedule.py)
FinalStatus = Literal[
    "succeeded",
    "declined",
    "failed",
    "blocked",
    "processing",
    "retry_scheduled",
    "action_required",
]

# CHARGE_WORKER_VERIFY_SUBSCRIPTION=match: a message with no row yet is inserted only when
# an active subscription says so: its customer, amount and currency, and the period one of
# its schedule's (periods.on_schedule, in SQL). A row the producer scheduled was written
# from the subscription: the fingerprint check of a takeover proves the rest. A subscription
# no producer of ours advanced has no anchor but its next billing date, which may have been
# clamped to a month's end already (Jan 31 -> Feb 28): then any month's last day is its day.
_PERIOD_END = "(date_trunc('month', {0}) + interval '1 month - 1 day')::date"
_VERIFIED = f"""
SELECT FROM subscriptions AS s
 CROSS JOIN LATERAL (SELECT coalesce(s.billing_anchor, s.next_billing_date) AS anchor,
                            CASE s.billing_interval WHEN 'year' THEN 12 ELSE 1 END
                                * s.billing_interval_count AS step) AS k
 WHERE s.order_id = $1 AND s.active AND s.subscription_id = $4 AND s.customer_id = $5
   AND s.amount_minor = $6 AND s.currency = $7
   AND mod(((extract(year FROM $2::date) - extract(year FROM k.anchor)) * 12
            + extract(month FROM $2::date) - extract(month FROM k.anchor))::int, k.step) = 0
   AND (extract(day FROM $2::date)
            = least(extract(day FROM k.anchor), extract(day FROM {_PERIOD_END.format("$2::date")}))
        OR (s.billing_anchor IS NULL AND k.anchor = {_PERIOD_END.format("k.anchor")}
            AND $2::date = {_PERIOD_END.format("$2::date")}))
"""

_NEW_ROW = """$1::bigint, $2::date, $3::text, $4::text, $5::text, $6::bigint, $7::text,
           $8::timestamptz, 'pending', $9::text, now() + make_interval(secs => $10), 1,
           $11::bigint"""


def _claim(new_row: str) -> str:
    """The claim: insert the row (`new_row` is the INSERT's source; try 1 only), or take over
    a `scheduled` row, an expired lease, or (`$12`, a replay) a `failed` row, of the try the
    message asks for (`$13`). A takeover also returns the delivery of this message (`$11`,
    its stream sequence) that nak'd the charge last, if one did (`nak_delivery`, 0016)."""
    return f"""
WITH inserted AS (
    INSERT INTO charge_attempts (
        order_id, billing_period, idempotency_key, subscription_id, customer_id,
        amount_minor, currency, due_at, status, lease_owner, lease_until, attempt,
        last_stream_seq)
    {new_row}
    ON CONFLICT DO NOTHING
    RETURNING attempt, gateway_calls, scoring, created_at AS since
), previous AS (  -- the row as it was: a takeover of an expired lease, this message's nak
    SELECT lease_owner, last_stream_seq, nak_delivery FROM charge_attempts
     WHERE order_id = $1 AND billing_period = $2 AND NOT EXISTS (SELECT 1 FROM inserted)
       FOR UPDATE
), taken AS (
    UPDATE charge_attempts AS c
       SET status = 'pending', lease_owner = $9, lease_until = now() + make_interval(secs => $10),
           attempt = c.attempt + 1, last_stream_seq = $11,
           updated_at = now()
      FROM previous AS p
     WHERE c.order_id = $1 AND c.billing_period = $2
       AND c.fingerprint = $6::bigint::text || ' ' || $7 || ' ' || $5
       AND c.current_try = $13
       AND (c.status = 'scheduled'
            OR (c.status = 'pending' AND (c.lease_until IS NULL OR c.lease_until < now()))
            OR ($12 AND c.status = 'failed'))
    RETURNING c.attempt, c.gateway_calls, c.scoring,
              coalesce(c.try_started_at, c.created_at) AS since, p.lease_owner AS taken_from,
              CASE WHEN p.last_stream_seq = $11 THEN p.nak_delivery END AS nak_delivery
)
SELECT attempt, gateway_calls, scoring, since, NULL::text AS taken_from,
       NULL::bigint AS nak_delivery
  FROM inserted
UNION ALL SELECT * FROM taken
"""


# Two statements, not one with a flag: a generic plan checks SELECT on `subscriptions` even
# where the flag would skip it, and verification off must need no grant on that table.
# A row is inserted for try 1 only: a later try's row is the period's, started by the producer.
_CLAIM = _claim(f"SELECT {_NEW_ROW}\n     WHERE $13::int = 1")
_CLAIM_VERIFIED = _claim(f"SELECT {_NEW_ROW}\n     WHERE $13::int = 1 AND EXISTS ({_VERIFIED})")

_WHY_NOT = """
SELECT status, fingerprint, current_try, extract(epoch FROM lease_until - now()) AS lease_left_s
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

_FENCE = (
    "order_id = $1 AND billing_period = $2 AND status = 'pending' "
    "AND lease_owner = $3 AND attempt = $4"
)


# the slow path only: a delivery whose lease no longer outlives a call renews it first
_EXTEND = f"""
UPDATE charge_attempts SET lease_until = now() + make_interval(secs => $5), updated_at = now()
 WHERE {_FENCE}
"""


def _fenced_write(update: str) -> str:
    """A fenced UPDATE (without RETURNING) that also records the delivery in the same
    statement: its event (the jsonb `$5`, when given) and the deferred scoring check its
    charge was made under (the reason `$8`, when given); returns the rows it changed. One
    round trip, and a fenced-out worker writes none of it.

    Parameters: `$1`-`$4` the fence, `$5` the event, `$6` the gateway calls this attempt
    made or inherited unrecorded, `$7` the verdict to keep, `$8` the deferred check's reason,
    then the statement's own."""
    return f"""
WITH updated AS ({update} RETURNING order_id, billing_period),
deferred AS (  -- one check per period: a resolved one (an earlier try's) is opened again
    INSERT INTO deferred_scoring_checks (order_id, billing_period, reason)
    SELECT order_id, billing_period, $8 FROM updated WHERE $8::text IS NOT NULL
    ON CONFLICT (order_id, billing_period) DO UPDATE
       SET status = 'pending', reason = EXCLUDED.reason, tries = 0, next_try_at = now(),
           last_error = NULL, resolved_at = NULL
     WHERE deferred_scoring_checks.status <> 'pending'
),
story AS (
    INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
    SELECT order_id, billing_period, 'delivery', $3, $5::jsonb
      FROM updated WHERE $5::jsonb IS NOT NULL
)
SELECT count(*) FROM updated
"""


# what every write of an attempt keeps: the calls it made, the verdict it charged under
_KEPT = "gateway_calls = gateway_calls + $6, scoring = coalesce($7, scoring), updated_at = now()"

_SETTLE = _fenced_write(
    f"""UPDATE charge_attempts
       SET status = $9, gateway_charge_id = coalesce($10, gateway_charge_id), last_error = $11,
           decline_code = $12, decline_class = $13, lease_owner = NULL, lease_until = NULL,
           settled_at = CASE WHEN $9 = 'processing' THEN NULL ELSE now() END,
           retry_at = CASE WHEN $9 = 'retry_scheduled' THEN now() + make_interval(secs => $14)
                      END, {_KEPT}
     WHERE {_FENCE}"""
)

# `$11`: the delivery that naks (NULL when it does not: a requeue acks), read back by the
# next claim of the same message (`last_stream_seq` is this delivery's: it claimed)
_RETRY_LATER = _fenced_write(
    f"""UPDATE charge_attempts
       SET last_error = $9, lease_owner = CASE WHEN $10 THEN lease_owner END,
           lease_until = CASE WHEN $10 THEN lease_until END, nak_delivery = $11, {_KEPT}
     WHERE {_FENCE}"""
)

# The attempt alone fences here: the lease may have been released by this same attempt.
# `failed` only when no call was ever made (counting this attempt's): else reconcile's
# lookup decides.
_GIVE_UP = _fenced_write(
    f"""UPDATE charge_attempts
       SET status = CASE WHEN gateway_calls + $6 = 0 THEN 'failed' ELSE status END,
           settled_at = CASE WHEN gateway_calls + $6 = 0 THEN now() END,
           last_error = $9, lease_owner = NULL, lease_until = NULL, {_KEPT}
     WHERE order_id = $1 AND billing_period = $2 AND status = 'pending'
       AND (lease_owner = $3 OR lease_owner IS NULL) AND attempt = $4"""
)


_PUBLISHED = """
UPDATE charge_attempts SET published_seq = greatest(published_seq, $3)
 WHERE order_id = $1 AND billing_period = $2
"""


@dataclass(frozen=True)
class Settlement:
    """A final state for a claimed charge, written with the delivery's event."""

    status: FinalStatus
    charge_id: str | None = None
    error: str | None = None
    decline_code: str | None = None  # of a decline, as the provider said
    retry_in_s: float | None = None  # `retry_scheduled`: the wait before the next try
    exhausted: bool = False  # `declined` for want of a try left (a soft decline)

    @property
    def decline_class(self) -> DeclineClass | None:
        return decline_class(self.decline_code) if self.status in DECLINE_STATES else None


@dataclass(frozen=True)
class Attempted:
    """What an attempt did that its write keeps, whatever the write.

    `calls`: gateway calls that may have charged, this attempt's and its predecessor's that
    no write recorded (a worker that died mid-call): any makes the next claim look up
    first. `scoring`: the verdict the charge was made (or blocked) under; `deferred_reason`
    with `deferred`, so the post-hoc check exists exactly when the verdict says so."""

    calls: int = 0
    scoring: Scoring | None = None
    deferred_reason: str | None = None


NOTHING_ATTEMPTED = Attempted()


@dataclass(frozen=True)
class Claim:
    """This worker's hold on one charge: the fence every later write must present."""

    order_id: int
    billing_period: dt.date
    owner: str
    attempt: int
    gateway_calls: int
    scoring: Scoring | None
    taken_from: str | None = None  # the owner of the expired lease this claim took over
    lease_deadline: float = math.inf  # `Ledger.clock` time by which the lease has expired
    # the delivery of this claim's message that nak'd the charge last (`retry_later`), if
    # any: a redelivery it asked for (`decisions.redelivery_cause`)
    nak_delivery: int | None = None
    # when the current try began, by the database's clock: none of its charges is older
    # (`Gateway.lookup(since=)`)
    since: dt.datetime | None = None

    @property
    def outcome_unknown(self) -> bool:
        """A gateway call may have been made with no outcome recorded: an earlier one is
        counted, or the lease taken over was a worker's that may have died mid-call (no
        write counts a call before it is made). Look up before sending again."""
        return self.gateway_calls > 0 or self.taken_from is not None

    def outlives(self, now: float, call_s: float) -> bool:
        """The lease still holds for a call of `call_s` starting at `now` (and a margin):
        no other worker can take the charge over before that call is over."""
        return now + call_s + LEASE_MARGIN_S <= self.lease_deadline


class Ledger:
    """The charge ledger on one asyncpg pool.

    `clock` (monotonic seconds) dates each claim's lease on this side: read before the claim
    is sent, it runs out no later than the `lease_until` PostgreSQL sets, so a worker that
    asks `Claim.outlives` before a call needs no write to know its lease still holds."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        verify_subscription: bool = False,
    ) -> None:
        self.pool = pool
        self.lease_s = lease_s
        self.clock = clock
        self.verify_subscription = verify_subscription
        self._claim_sql = _CLAIM_VERIFIED if verify_subscription else _CLAIM

    async def claim(
        self, charge: ChargeDue, owner: str, stream_seq: int, *, revive_failed: bool = False
    ) -> Claim:
        """Take the charge for `owner`, or raise what stands in the way.

        `revive_failed` (an operator's `dlq replay`) also takes a `failed` row, so a charge
        dead-lettered for a bug (or an answer that charged nothing) can be charged once
        fixed. A row that called the gateway before comes back with `outcome_unknown`: the
        worker looks the key up before any new call, and records a charge it finds.

        Only the period's current try is claimed (`charge.attempt`, the row's `current_try`).

        Raises `AlreadySettled` (final already, or the message's try is over), `PayloadConflict`
        (same key, other amount/currency/customer), `LeaseHeld` (a live worker owns it),
        `Unverified` (`verify_subscription`: no row yet, and no subscription says the charge
        is due; or a try no row started).
        """
        key = (charge.order_id, charge.billing_period)
        deadline = self.clock() + self.lease_s
        async with translated(), self.pool.acquire() as conn:
            row = await conn.fetchrow(
                self._claim_sql,
                *key,
                charge.key,
                charge.subscription_id,
                charge.customer_id,
                charge.amount_minor,
                charge.currency,
                charge.due_at,
                owner,
                self.lease_s,
                stream_seq,
                revive_failed,
                charge.attempt,
            )
            if row is not None:
                return Claim(
                    *key,
                    owner,
                    row["attempt"],
                    row["gateway_calls"],
                    row["scoring"],
                    row["taken_from"],
                    deadline,
                    row["nak_delivery"],
                    row["since"],
                )
            why = await conn.fetchrow(_WHY_NOT, *key)
        if why is None:
            if charge.attempt > 1:
                raise Unverified(f"{charge.key}: try {charge.attempt} of a period with no row")
            if self.verify_subscription:
                raise Unverified(
                    f"{charge.key}: no active subscription {charge.subscription_id} of order "
                    f"{charge.order_id} charges '{charge.fingerprint}' for the period "
                    f"{charge.billing_period}"
                )
            # deleted between the two statements; let the redelivery retry
            raise LeaseHeld("the row vanished during the claim", retry_after_s=0)
        fingerprint = charge.fingerprint
        if why["fingerprint"] != fingerprint:
            raise PayloadConflict(
                f"{charge.key} is recorded as '{why['fingerprint']}', message says '{fingerprint}'"
            )
        current, status = why["current_try"], why["status"]
        if charge.attempt < current:
            raise AlreadySettled(f"{charge.key}: the period is at try {current} ({status})")
        if charge.attempt > current:
            raise Unverified(
                f"{charge.key}: try {charge.attempt} was never started; the period is at try "
                f"{current} ({status})"
            )
        if status not in ("pending", "scheduled"):
            raise AlreadySettled(f"{charge.key} is {status} already")
        left = float(why["lease_left_s"] or 0.0)
        raise LeaseHeld(f"{charge.key} is leased by another worker", retry_after_s=max(left, 0.0))

    async def extend(self, claim: Claim) -> Claim:
        """Renew the lease for another `lease_s`: the claim with its new deadline.

        `LeaseHeld` if this worker no longer owns the charge."""
        deadline = self.clock() + self.lease_s
        fence = (claim.order_id, claim.billing_period, claim.owner, claim.attempt)
        async with translated():
            status = await self.pool.execute(_EXTEND, *fence, self.lease_s)
        if status != "UPDATE 1":
            raise LeaseHeld("the lease was taken over; this worker may not call")
        return dataclasses.replace(claim, lease_deadline=deadline)

    async def settle(
        self,
        claim: Claim,
        settlement: Settlement,
        *,
        story: Mapping[str, object] | None,
        attempted: Attempted = NOTHING_ATTEMPTED,
    ) -> None:
        """Record a final state, what the attempt did, and `story` as this delivery's event
        when given.

        `LeaseHeld` if this worker no longer owns the charge (and then nothing is written).
        """
        await self._fenced(
            _SETTLE,
            claim,
            story,
            attempted,
            settlement.status,
            settlement.charge_id,
            settlement.error,
            settlement.decline_code,
            settlement.decline_class,
            settlement.retry_in_s,
        )

    async def retry_later(
        self,
        claim: Claim,
        error: str,
        *,
        keep_lease: bool,
        nak_delivery: int | None = None,
        story: Mapping[str, object] | None = None,
        attempted: Attempted = NOTHING_ATTEMPTED,
    ) -> None:
        """Stay pending; keep the lease while an earlier call may still be in flight.

        `nak_delivery`: the delivery (`num_delivered`) that naks the message now, so that its
        redelivery is known as asked for; None when the message is not nak'd (a requeue)."""
        await self._fenced(_RETRY_LATER, claim, story, attempted, error, keep_lease, nak_delivery)

    async def give_up(
        self,
        claim: Claim,
        error: str,
        *,
        story: Mapping[str, object] | None = None,
        attempted: Attempted = NOTHING_ATTEMPTED,
    ) -> None:
        """Out of deliveries: `failed` if the gateway was never called, else left for
        reconcile's lookup (an outcome may be unknown)."""
        await self._fenced(_GIVE_UP, claim, story, attempted, error)

    async def tell(self, charge: ChargeDue, owner: str, story: Mapping[str, object]) -> None:
        """Append a `delivery` event that no ledger write carried (none was allowed)."""
        async with translated("events"):
            await events.record(
                self.pool, charge.order_id, charge.billing_period, "delivery", owner, **story
            )

    async def _fenced(
        self,
        sql: str,
        claim: Claim,
        story: Mapping[str, object] | None,
        attempted: Attempted,
        *args: object,
    ) -> None:
        """Run a write fenced by the claim (`_fenced_write`); `LeaseHeld` when it changed
        nothing."""
        async with translated():
            updated = await self.pool.fetchval(
                sql,
                claim.order_id,
                claim.billing_period,
                claim.owner,
                claim.attempt,
                _detail(story),
                attempted.calls,
                attempted.scoring,
                attempted.deferred_reason,
                *args,
            )
        if updated != 1:
            raise LeaseHeld("the lease was taken over; this worker may not write")

    async def published(self, order_id: int, billing_period: dt.date, stream_seq: int) -> None:
        """A fresh copy of the charge's message went out at `stream_seq` (a requeue): where
        reconcile looks for it before taking the row for lost."""
        async with translated():
            await self.pool.execute(_PUBLISHED, order_id, billing_period, stream_seq)

    async def status_of(self, order_id: int, billing_period: dt.date) -> str | None:
        async with translated():
            value = await self.pool.fetchval(
                "SELECT status FROM charge_attempts WHERE order_id = $1 AND billing_period = $2",
                order_id,
                billing_period,
            )
        return None if value is None else str(value)


def _detail(story: Mapping[str, object] | None) -> str | None:
    return None if story is None else events.to_json(story)


@dataclass(frozen=True)
class DeferredCheck:
    """A charge made without a scoring verdict, due to be scored now."""

    order_id: int
    billing_period: dt.date
    customer_id: str
    amount_minor: int
    currency: str


# Taking checks pushes their next try forward: that is their lease across pods.
_TAKE_CHECKS = """
UPDATE deferred_scoring_checks AS d
   SET tries = d.tries + 1, next_try_at = now() + make_interval(secs => $2)
  FROM charge_attempts AS c
 WHERE (d.order_id, d.billing_period) IN (
           SELECT order_id, billing_period FROM deferred_scoring_checks
            WHERE status = 'pending' AND next_try_at <= now()
            ORDER BY next_try_at LIMIT $1 FOR UPDATE SKIP LOCKED)
   AND c.order_id = d.order_id AND c.billing_period = d.billing_period
RETURNING d.order_id, d.billing_period, c.customer_id, c.amount_minor, c.currency
"""

_RETRY_CHECKS = """
UPDATE deferred_scoring_checks SET next_try_at = now() + make_interval(secs => $3)
 WHERE (order_id, billing_period) IN (SELECT * FROM unnest($1::bigint[], $2::date[]))
   AND status = 'pending'
"""

_RESOLVE_CHECK = """
WITH resolved AS (
    UPDATE deferred_scoring_checks SET status = $3, resolved_at = now(), last_error = NULL
     WHERE order_id = $1 AND billing_period = $2 AND status = 'pending'
    RETURNING order_id, billing_period
)
UPDATE charge_attempts AS c
   SET review_reason = 'scoring blocked it after the charge (deferred check)', updated_at = now()
  FROM resolved AS r
 WHERE $3 = 'blocked' AND c.order_id = r.order_id AND c.billing_period = r.billing_period
"""


class DeferredChecks:
    """The queue of post-hoc scoring checks, in the ledger's database."""

    def __init__(self, pool: asyncpg.Pool, *, retry_s: float) -> None:
        self.pool = pool
        self.retry_s = retry_s

    async def take(self, limit: int) -> list[DeferredCheck]:
        async with translated():
            rows = await self.pool.fetch(_TAKE_CHECKS, limit, self.retry_s)
        return [DeferredCheck(*row.values()) for row in rows]

    async def retry_in(self, checks: list[DeferredCheck], delay_s: float) -> None:
        """Taken checks that were not scored come due again after `delay_s`, not `retry_s`."""
        async with translated():
            await self.pool.execute(
                _RETRY_CHECKS,
                [c.order_id for c in checks],
                [c.billing_period for c in checks],
                delay_s,
            )

    async def pending(self) -> int:
        async with translated():
            count = await self.pool.fetchval(
                "SELECT count(*) FROM deferred_scoring_checks WHERE status = 'pending'"
            )
        return int(count)

    async def resolve(self, check: DeferredCheck, verdict: Literal["approved", "blocked"]) -> None:
        async with translated():
            await self.pool.execute(_RESOLVE_CHECK, check.order_id, check.billing_period, verdict)
