"""Every SQL statement on `charge_attempts` and `deferred_scoring_checks`.

The ledger is the lock. A claim is one atomic statement: insert the row, or take over a
`scheduled` row or a `pending` row whose lease has expired, bumping the fencing `attempt`.
Every later write names the attempt it belongs to (`WHERE lease_owner = $me AND attempt =
$n`), so a worker whose lease was taken over can never write. No transaction stays open
across a network call. asyncpg errors become `DependencyUnavailable` here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import asyncpg

from charge_worker import events
from charge_worker.database import translated
from charge_worker.errors import AlreadySettled, LeaseHeld, PayloadConflict
from charge_worker.messages import ChargeDue

Scoring = Literal["approved", "blocked", "deferred"]
# what a delivery may settle a charge as; `processing` is no final state: the provider
# accepted the charge and settles it later (a bank debit), and nothing is re-sent meanwhile
FinalStatus = Literal["succeeded", "declined", "failed", "blocked", "processing"]

_CLAIM = """
WITH inserted AS (
    INSERT INTO charge_attempts (
        order_id, billing_period, idempotency_key, subscription_id, customer_id,
        amount_minor, currency, due_at, status, lease_owner, lease_until, attempt,
        last_stream_seq)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9,
            now() + make_interval(secs => $10), 1, $11)
    ON CONFLICT DO NOTHING
    RETURNING attempt, gateway_calls, scoring
), previous AS (  -- the row as it was, to tell a takeover of an expired lease
    SELECT lease_owner FROM charge_attempts
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
       AND (c.status = 'scheduled'
            OR (c.status = 'pending' AND (c.lease_until IS NULL OR c.lease_until < now()))
            OR ($12 AND c.status = 'failed'))
    RETURNING c.attempt, c.gateway_calls, c.scoring, p.lease_owner AS taken_from
)
SELECT attempt, gateway_calls, scoring, NULL::text AS taken_from FROM inserted
UNION ALL SELECT * FROM taken
"""

_WHY_NOT = """
SELECT status, fingerprint, extract(epoch FROM lease_until - now()) AS lease_left_s
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

_FENCE = (
    "order_id = $1 AND billing_period = $2 AND status = 'pending' "
    "AND lease_owner = $3 AND attempt = $4"
)

_BEGIN_CALL = f"""
WITH updated AS (
    UPDATE charge_attempts
       SET gateway_calls = gateway_calls + 1, scoring = coalesce($5, scoring),
           lease_until = now() + make_interval(secs => $6), updated_at = now()
     WHERE {_FENCE}
    RETURNING order_id, billing_period, gateway_calls
), deferred AS (
    INSERT INTO deferred_scoring_checks (order_id, billing_period, reason)
    SELECT order_id, billing_period, $7 FROM updated WHERE $7::text IS NOT NULL
    ON CONFLICT DO NOTHING
), story AS (
    INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
    SELECT order_id, billing_period, 'gateway_call', $3,
           jsonb_build_object('attempt', $4::int, 'call', gateway_calls, 'scoring', $5::text)
      FROM updated
)
SELECT count(*) FROM updated
"""


def _with_story(update: str, story: str) -> str:
    """A fenced UPDATE (without RETURNING) that also appends this delivery's event, given as
    the jsonb parameter `story`, when it changed the row; returns the rows it changed. One
    round trip, and a fenced-out worker writes neither."""
    return f"""
WITH updated AS ({update} RETURNING order_id, billing_period),
story AS (
    INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
    SELECT order_id, billing_period, 'delivery', $3, {story}::jsonb
      FROM updated WHERE {story}::jsonb IS NOT NULL
)
SELECT count(*) FROM updated
"""


_SETTLE = _with_story(
    f"""UPDATE charge_attempts
       SET status = $5, gateway_charge_id = coalesce($6, gateway_charge_id), last_error = $7,
           scoring = coalesce($8, scoring), lease_owner = NULL, lease_until = NULL,
           decline_code = $10,
           settled_at = CASE WHEN $5 = 'processing' THEN NULL ELSE now() END,
           updated_at = now()
     WHERE {_FENCE}""",
    "$9",
)

_RETRY_LATER = _with_story(
    f"""UPDATE charge_attempts
       SET last_error = $5, updated_at = now(),
           lease_owner = CASE WHEN $6 THEN lease_owner END,
           lease_until = CASE WHEN $6 THEN lease_until END
     WHERE {_FENCE}""",
    "$7",
)

# The attempt alone fences here: the lease may have been released by this same attempt.
_GIVE_UP = _with_story(
    """UPDATE charge_attempts
       SET status = CASE WHEN gateway_calls = 0 THEN 'failed' ELSE status END,
           last_error = $5, lease_owner = NULL, lease_until = NULL, updated_at = now(),
           settled_at = CASE WHEN gateway_calls = 0 THEN now() END
     WHERE order_id = $1 AND billing_period = $2 AND status = 'pending'
       AND (lease_owner = $3 OR lease_owner IS NULL) AND attempt = $4""",
    "$6",
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
    scoring: Scoring | None = None
    decline_code: str | None = None  # of a decline, as the provider said


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

    @property
    def outcome_unknown(self) -> bool:
        """An earlier gateway call has no recorded outcome: look up before sending again."""
        return self.gateway_calls > 0


class Ledger:
    """The charge ledger on one asyncpg pool."""

    def __init__(self, pool: asyncpg.Pool, *, lease_s: float) -> None:
        self.pool = pool
        self.lease_s = lease_s

    async def claim(
        self, charge: ChargeDue, owner: str, stream_seq: int, *, revive_failed: bool = False
    ) -> Claim:
        """Take the charge for `owner`, or raise what stands in the way.

        `revive_failed` (an operator's `dlq replay`) also takes a `failed` row, so a charge
        dead-lettered for a bug (or an answer that charged nothing) can be charged once
        fixed. A row that called the gateway before comes back with `outcome_unknown`: the
        worker looks the key up before any new call, and records a charge it finds.

        Raises `AlreadySettled` (final already), `PayloadConflict` (same key, other
        amount/currency/customer), `LeaseHeld` (a live worker owns it).
        """
        key = (charge.order_id, charge.billing_period)
        async with translated(), self.pool.acquire() as conn:
            row = await conn.fetchrow(
                _CLAIM,
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
            )
            if row is not None:
                return Claim(*key, owner, *row.values())
            why = await conn.fetchrow(_WHY_NOT, *key)
        if why is None:  # deleted between the two statements; let the redelivery retry
            raise LeaseHeld("the row vanished during the claim", retry_after_s=0)
        fingerprint = f"{charge.amount_minor} {charge.currency} {charge.customer_id}"
        if why["fingerprint"] != fingerprint:
            raise PayloadConflict(
                f"{charge.key} is recorded as '{why['fingerprint']}', message says '{fingerprint}'"
            )
        if why["status"] not in ("pending", "scheduled"):
            raise AlreadySettled(f"{charge.key} is {why['status']} already")
        left = float(why["lease_left_s"] or 0.0)
        raise LeaseHeld(f"{charge.key} is leased by another worker", retry_after_s=max(left, 0.0))

    async def begin_gateway_call(
        self, claim: Claim, *, scoring: Scoring | None, deferred_reason: str | None
    ) -> None:
        """Count the call about to be made, renew the lease, record a deferred check."""
        await self._fenced(_BEGIN_CALL, claim, scoring, self.lease_s, deferred_reason)

    async def settle(
        self, claim: Claim, settlement: Settlement, *, story: Mapping[str, object] | None
    ) -> None:
        """Record a final state, and `story` as this delivery's event when given.

        `LeaseHeld` if this worker no longer owns the charge (and then no event is written).
        """
        await self._fenced(
            _SETTLE,
            claim,
            settlement.status,
            settlement.charge_id,
            settlement.error,
            settlement.scoring,
            _detail(story),
            settlement.decline_code,
        )

    async def retry_later(
        self,
        claim: Claim,
        error: str,
        *,
        keep_lease: bool,
        story: Mapping[str, object] | None = None,
    ) -> None:
        """Stay pending; keep the lease while an earlier call may still be in flight."""
        await self._fenced(_RETRY_LATER, claim, error, keep_lease, _detail(story))

    async def give_up(
        self, claim: Claim, error: str, *, story: Mapping[str, object] | None = None
    ) -> None:
        """Out of deliveries: `failed` if the gateway was never called, else left for
        reconcile's lookup (an outcome may be unknown)."""
        await self._fenced(_GIVE_UP, claim, error, _detail(story))

    async def tell(self, charge: ChargeDue, owner: str, story: Mapping[str, object]) -> None:
        """Append a `delivery` event that no ledger write carried (none was allowed)."""
        async with translated("events"):
            await events.record(
                self.pool, charge.order_id, charge.billing_period, "delivery", owner, **story
            )

    async def _fenced(self, sql: str, claim: Claim, *args: object) -> None:
        """Run a write fenced by the claim; every such statement returns the rows it changed."""
        async with translated():
            updated = await self.pool.fetchval(
                sql, claim.order_id, claim.billing_period, claim.owner, claim.attempt, *args
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
