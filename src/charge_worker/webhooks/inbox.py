"""Every SQL statement on the webhook journal (`webhook_inbox`) and its effect on the ledger.

A row's life: `received` (journaled by the receiver, before its 2xx; or `ignored` at once, an
event about a charge that is not ours, final like `applied`) -> `processing` (leased
by one processor: `lease_owner`, until `next_attempt_at`) -> `applied` | `stale` |
`needs_review`, or `awaiting_dependency` (taken again at `next_attempt_at`). A processor that
dies leaves its rows `processing` with a lease that expires: they are taken again, so an event
journaled before a crash is applied after it. Every processor write names its lease
(`lease_owner = $me AND status = 'processing'`); the ledger change, the row's status and the
charge's `webhook` event are one transaction, with the ledger row locked (`FOR UPDATE`,
under a lock timeout) while the rules decide.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from charge_worker import events
from charge_worker.database import translated
from charge_worker.declines import decline_class
from charge_worker.errors import GuardRefused, LeaseHeld, MalformedDelivery
from charge_worker.gateway.results import try_of
from charge_worker.retries.schedule import DECLINE_STATES
from charge_worker.webhooks.metrics import OPEN_STATUSES
from charge_worker.webhooks.rules import (
    Apply,
    Decision,
    Fingerprint,
    Review,
    Row,
    Snapshot,
    Stale,
    Unchanged,
    Wait,
    decide,
)

log = structlog.get_logger(__name__)
ACTOR = "webhooks"

_JOURNAL = """
INSERT INTO webhook_inbox (source, event_id, message_id, event_type, object_id, revision,
                           order_id, billing_period, payload, status, finished_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10,
        CASE WHEN $10 = 'ignored' THEN now() END)
ON CONFLICT (source, event_id) DO NOTHING
RETURNING id
"""

_TAKE = """
UPDATE webhook_inbox AS w
   SET status = 'processing', lease_owner = $1, attempts = w.attempts + 1,
       next_attempt_at = now() + make_interval(secs => $3), updated_at = now()
 WHERE w.id IN (SELECT id FROM webhook_inbox
                 WHERE status IN ('received', 'processing', 'awaiting_dependency')
                   AND next_attempt_at <= now()
                 ORDER BY next_attempt_at, id
                 LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING w.id, w.source, w.event_id, w.event_type, w.object_id, w.revision, w.order_id,
          w.billing_period, w.attempts, extract(epoch FROM now() - w.received_at)::float8 AS age_s,
          w.payload -> 'data' -> 'object' ->> 'status' AS object_status,
          -- rows journaled before these fields were read may hold anything there
          coalesce(w.payload -> 'data' -> 'object' -> 'refunded' = 'true'::jsonb, false)
              AS refunded,
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'amount_refunded') = 'number'
               THEN greatest((w.payload -> 'data' -> 'object' ->> 'amount_refunded')::numeric, 0)
               ELSE 0 END AS amount_refunded,
          -- the fingerprint: NULL unless the snapshot says it (then nothing is proven)
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'amount') = 'number'
               THEN (w.payload -> 'data' -> 'object' ->> 'amount')::numeric END AS amount,
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'currency') = 'string'
               THEN w.payload -> 'data' -> 'object' ->> 'currency' END AS currency,
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'customer') = 'string'
               THEN w.payload -> 'data' -> 'object' ->> 'customer' END AS customer,
          -- the period's try that made the charge (read as `results.try_of` reads it)
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'metadata') = 'object'
               THEN w.payload -> 'data' -> 'object' -> 'metadata' ->> 'attempt' END AS try,
          CASE WHEN jsonb_typeof(w.payload -> 'data' -> 'object' -> 'decline_code') = 'string'
               THEN w.payload -> 'data' -> 'object' ->> 'decline_code' END AS decline_code
"""

_LEDGER_BY_KEY = """
SELECT order_id, billing_period, status, gateway_charge_id, gateway_revision,
       amount_minor, currency, customer_id, current_try,
       (lease_until IS NULL OR lease_until < now()) AS lease_free
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
   FOR UPDATE
"""

_LEDGER_BY_CHARGE = """
SELECT order_id, billing_period, status, gateway_charge_id, gateway_revision,
       amount_minor, currency, customer_id, current_try,
       (lease_until IS NULL OR lease_until < now()) AS lease_free
  FROM charge_attempts WHERE gateway_charge_id = $1
   FOR UPDATE
"""

# A live worker lease on the open row of the event's key (or, without one, of its charge):
# the worker records what the gateway did, so the event waits without asking the provider.
# A row that holds another charge is not waited on: that is a double charge to review now.
# With it, the database's clock (microseconds) that stamps the re-fetch about to be made as
# its revision: one clock for every pod, read before the fetch, so a fetch begun later never
# gets an older revision than one begun earlier.
_WORKER_LEASE = """
SELECT (SELECT status FROM charge_attempts
         WHERE CASE WHEN $1::bigint IS NULL THEN gateway_charge_id = $3
                    ELSE order_id = $1 AND billing_period = $2 END
           AND status IN ('scheduled', 'pending') AND lease_until > now()
           AND (gateway_charge_id IS NULL OR gateway_charge_id = $3)) AS held,
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now_us
"""

# the other events about this charge object: the newest revision applied, and journaled
_NEWEST = """
SELECT coalesce(max(revision) FILTER (WHERE status = 'applied'), 0) AS applied,
       coalesce(max(revision), 0) AS known
  FROM webhook_inbox WHERE source = $1 AND object_id = $2 AND id <> $3
"""

# Guarded although the row is locked: only a newer snapshot of the same (or a not yet
# recorded) charge, only from the status decided on, and never under a live worker's lease.
# An open row found charged with no verdict kept (its worker died mid-call: the verdict is
# written with the outcome) gets the post-hoc scoring check a deferred verdict has.
# A decline keeps its code and class (`$9`, `$10`), and `retry_scheduled` its `retry_at` in
# `$11` seconds; a period waiting for its next try records the charge that holds its money
# in place of its declined try's (`retries.schedule.WAITING`), and its `retry_at` goes.
_APPLY = """
WITH updated AS (
UPDATE charge_attempts
   SET status = coalesce($5, status),
       decline_code = CASE WHEN $5 IN ('declined', 'retry_scheduled', 'action_required')
                           THEN $9 ELSE decline_code END,
       decline_class = CASE WHEN $5 IN ('declined', 'retry_scheduled', 'action_required')
                            THEN $10 ELSE decline_class END,
       retry_at = CASE WHEN coalesce($5, status) = 'retry_scheduled'
                       THEN coalesce(now() + make_interval(secs => $11::float8), retry_at) END,
       scoring = CASE WHEN status IN ('scheduled', 'pending')
                       AND coalesce($5, status) IN ('succeeded', 'processing')
                      THEN coalesce(scoring, 'deferred') ELSE scoring END,
       gateway_charge_id = CASE WHEN status IN ('retry_scheduled', 'action_required') THEN $3
                                ELSE coalesce(gateway_charge_id, $3) END,
       gateway_revision = $4,
       disputed_at = CASE WHEN $6 THEN coalesce(disputed_at, now()) ELSE disputed_at END,
       review_reason = CASE WHEN $6 AND disputed_at IS NULL
                            THEN concat_ws('; ', review_reason, $7::text)
                            ELSE review_reason END,
       lease_owner = CASE WHEN status IN ('scheduled', 'pending') THEN NULL ELSE lease_owner END,
       lease_until = CASE WHEN status IN ('scheduled', 'pending') THEN NULL ELSE lease_until END,
       -- `processing` is open: settled once it becomes anything else
       settled_at = CASE WHEN coalesce($5, status) = 'processing' THEN NULL
                         WHEN status IN ('scheduled', 'pending', 'processing') THEN now()
                         ELSE settled_at END,
       updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status = $8
   AND (gateway_charge_id IS NULL OR gateway_charge_id = $3
        OR status IN ('retry_scheduled', 'action_required'))
   AND coalesce(gateway_revision, 0) < $4
   AND (status NOT IN ('scheduled', 'pending') OR lease_until IS NULL OR lease_until < now())
RETURNING order_id, billing_period, scoring
), deferred AS (
    INSERT INTO deferred_scoring_checks (order_id, billing_period, reason)
    SELECT order_id, billing_period, 'charged with no verdict kept (found by a webhook)'
      FROM updated WHERE scoring = 'deferred'
    ON CONFLICT DO NOTHING
)
SELECT count(*) FROM updated
"""

_FINISH = """
UPDATE webhook_inbox
   SET status = $3, outcome = $4, last_error = $5, lease_owner = NULL, updated_at = now(),
       next_attempt_at = now() + make_interval(secs => $6),
       finished_at = CASE WHEN $3 IN ('applied', 'stale', 'needs_review', 'ignored')
                          THEN now() END
 WHERE id = $1 AND lease_owner = $2 AND status = 'processing'
"""

_PURGE = """
DELETE FROM webhook_inbox WHERE id IN (
    SELECT id FROM webhook_inbox
     WHERE status IN ('applied', 'stale', 'ignored')
       AND received_at < now() - make_interval(secs => $1)
     ORDER BY received_at LIMIT $2)
"""

_OPEN_COUNTS = """
SELECT status, count(*) AS n,
       coalesce(extract(epoch FROM now() - min(received_at)), 0)::float8 AS oldest_s
  FROM webhook_inbox WHERE status NOT IN ('applied', 'stale', 'ignored') GROUP BY status
"""

_STATUS_OF: dict[type, str] = {
    Apply: "applied", Unchanged: "applied", Stale: "stale", Review: "needs_review",
    Wait: "awaiting_dependency",
}  # fmt: skip


def status_of(decision: Decision) -> str:
    """The journal status a decision gives its event."""
    return _STATUS_OF[type(decision)]


@dataclass(frozen=True)
class Entry:
    """One verified event, as the receiver journals it."""

    source: str
    event_id: str
    message_id: str
    event_type: str
    object_id: str
    revision: int
    order_id: int | None
    billing_period: dt.date | None
    payload: str
    status: str = "received"  # or `ignored`: final at once, never processed


@dataclass(frozen=True)
class Job:
    """A journal row a processor has leased."""

    id: int
    source: str
    event_id: str
    event_type: str
    charge_id: str
    revision: int
    order_id: int | None
    billing_period: dt.date | None
    object_status: str
    attempts: int
    age_s: float
    refunded: bool = False
    amount_refunded: int = 0
    # the charge's fingerprint, as far as the snapshot says it
    amount: int | None = None
    currency: str | None = None
    customer: str | None = None
    charge_try: int = 1  # the period's try that made the charge (`metadata.attempt`)
    decline_code: str | None = None  # a failed charge's, when the snapshot says

    @property
    def key(self) -> tuple[int, dt.date] | None:
        """The ledger key from the charge's metadata, when it has one."""
        if self.order_id is None or self.billing_period is None:
            return None
        return self.order_id, self.billing_period

    def snapshot(self, state: str | None = None) -> Snapshot:
        """What the event says; `state` (a lookup's answer, `rules.state_of`) replaces the
        charge's status and refund fields."""
        keyed = self.key is not None
        fingerprint = Fingerprint.of(self.amount, self.currency, self.customer)
        if state is not None:
            return Snapshot(
                self.event_type,
                self.charge_id,
                self.revision,
                state,
                keyed=keyed,
                fingerprint=fingerprint,
                attempt=self.charge_try,
                decline_code=self.decline_code,
            )
        return Snapshot(
            self.event_type,
            self.charge_id,
            self.revision,
            self.object_status,
            refunded=self.refunded,
            amount_refunded=self.amount_refunded,
            keyed=keyed,
            fingerprint=fingerprint,
            attempt=self.charge_try,
            decline_code=self.decline_code,
        )

    def describe(self) -> dict[str, Any]:
        """The fields a log line or a story event carries."""
        return {
            "event_id": self.event_id,
            "type": self.event_type,
            "charge_id": self.charge_id,
            "revision": self.revision,
            "attempt": self.attempts,
        }


@dataclass(frozen=True)
class OpenCounts:
    """Journal rows not final-and-fine, by status, and the age of the oldest unprocessed."""

    by_status: dict[str, int]
    oldest_unprocessed_s: float


class Inbox:
    """The journal on one asyncpg pool. `retry_schedule`: the waits before tries 2, 3, ...
    (`CHARGE_WORKER_RETRY_SCHEDULE`), which decide what a try's decline leaves its period
    in (empty: a decline ends the period)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        lock_timeout_s: float = 2.0,
        retry_schedule: Sequence[float] = (),
    ) -> None:
        self.pool = pool
        self.lock_timeout = f"{int(lock_timeout_s * 1000)}ms"
        self.retry_schedule = tuple(retry_schedule)

    async def journal(self, entry: Entry) -> bool:
        """Record the event once; False when it was journaled before (a redelivery)."""
        async with translated():
            try:
                row_id = await self.pool.fetchval(
                    _JOURNAL,
                    entry.source,
                    entry.event_id,
                    entry.message_id,
                    entry.event_type,
                    entry.object_id,
                    entry.revision,
                    entry.order_id,
                    entry.billing_period,
                    entry.payload,
                    entry.status,
                )
            except asyncpg.DataError as error:  # e.g. \u0000, which jsonb cannot hold
                raise MalformedDelivery("the body cannot be stored as jsonb") from error
        return row_id is not None

    async def take(self, owner: str, *, limit: int, lease_s: float) -> list[Job]:
        """Lease up to `limit` due rows (new, waiting, or whose lease expired)."""
        async with translated():
            rows = await self.pool.fetch(_TAKE, owner, limit, lease_s)
        return [
            Job(
                r["id"],
                r["source"],
                r["event_id"],
                r["event_type"],
                r["object_id"],
                r["revision"],
                r["order_id"],
                r["billing_period"],
                r["object_status"] or "",
                r["attempts"],
                r["age_s"],
                r["refunded"],
                int(r["amount_refunded"]),
                None if r["amount"] is None else int(r["amount"]),
                r["currency"],
                r["customer"],
                try_of({"attempt": r["try"]}),
                r["decline_code"] if r["object_status"] == "failed" else None,
            )
            for r in rows
        ]

    async def decide_and_write(
        self, job: Job, owner: str, *, confirmed_status: str | None = None, wait_s: float | None
    ) -> Decision:
        """Decide and write in one transaction. A `Wait` is written as `awaiting_dependency`
        retried in `wait_s`, or with `wait_s=None` not written at all (the caller looks the
        charge up, then calls again with the `confirmed_status` it found)."""
        async with translated(), self.pool.acquire() as conn, conn.transaction():
            held = _Held(conn, job, owner)
            await conn.execute("SELECT set_config('lock_timeout', $1, true)", self.lock_timeout)
            if job.key is not None:
                record = await conn.fetchrow(_LEDGER_BY_KEY, *job.key)
            else:
                record = await conn.fetchrow(_LEDGER_BY_CHARGE, job.charge_id)
            newest = await conn.fetchrow(_NEWEST, job.source, job.charge_id, job.id)
            assert newest is not None  # an aggregate always returns one row
            row = (
                None
                if record is None
                else Row(
                    record["status"],
                    record["gateway_charge_id"],
                    record["gateway_revision"],
                    record["lease_free"],
                    Fingerprint.of(
                        record["amount_minor"], record["currency"], record["customer_id"]
                    ),
                    record["current_try"],
                )
            )
            decision = decide(
                job.snapshot(confirmed_status),
                row,
                confirmed=confirmed_status is not None,
                newest_applied=newest["applied"],
                newest_known=newest["known"],
                schedule=self.retry_schedule,
            )
            if isinstance(decision, Wait):
                if wait_s is not None:
                    await held.finish("awaiting_dependency", error=decision.why, delay_s=wait_s)
                return decision
            if isinstance(decision, Apply):
                assert record is not None
                await held.apply(record, decision)
            outcome = decision.change if isinstance(decision, Apply) else decision.why
            error = decision.why if isinstance(decision, Review) else None
            await held.finish(status_of(decision), outcome=outcome, error=error)
            if record is not None:
                key = (record["order_id"], record["billing_period"])
                await held.story(key, status_of(decision), outcome, confirmed_status)
        return decision

    async def revision_or_wait(self, job: Job, owner: str, *, wait_s: float) -> Wait | int:
        """A `Wait`, written as `awaiting_dependency` retried in `wait_s`, when a worker's
        live lease holds the event's open row; otherwise the database's clock (microseconds
        since the epoch), the revision of the re-fetch about to be made."""
        async with translated(), self.pool.acquire() as conn, conn.transaction():
            found = await conn.fetchrow(
                _WORKER_LEASE, job.order_id, job.billing_period, job.charge_id
            )
            assert found is not None  # a SELECT without FROM returns one row
            if found["held"] is None:
                return int(found["now_us"])
            status = found["held"]
            wait = Wait(f"a worker holds the lease on this {status} charge", worker_owned=True)
            await _Held(conn, job, owner).finish(
                "awaiting_dependency", error=wait.why, delay_s=wait_s
            )
        return wait

    async def review(self, job: Job, owner: str, why: str) -> None:
        """Give up on the event: `needs_review`, with its reason in the charge's story."""
        async with translated(), self.pool.acquire() as conn, conn.transaction():
            held = _Held(conn, job, owner)
            await held.finish("needs_review", outcome=why)
            if job.key is not None:
                await held.story(job.key, "needs_review", why, None)

    async def ignore(self, job: Job, owner: str, why: str) -> None:
        """Finish the event as `ignored`: its charge, as re-fetched, is not ours."""
        async with translated(), self.pool.acquire() as conn:
            await _Held(conn, job, owner).finish("ignored", outcome=why)

    async def wait(self, job: Job, owner: str, why: str, *, delay_s: float) -> None:
        """Put the event back to wait for its dependency another `delay_s`."""
        async with translated(), self.pool.acquire() as conn:
            held = _Held(conn, job, owner)
            await held.finish("awaiting_dependency", error=why, delay_s=delay_s)

    async def retry(self, job: Job, owner: str, error: str, *, delay_s: float) -> None:
        """Put the event back for another try in `delay_s` (processing failed)."""
        async with translated(), self.pool.acquire() as conn:
            await _Held(conn, job, owner).finish("received", error=error, delay_s=delay_s)

    async def purge(self, retention_s: float, *, batch: int = 1000) -> int:
        """Delete applied, stale and ignored rows received over `retention_s` ago; the
        number deleted."""
        deleted = 0
        while True:
            async with translated():
                status = await self.pool.execute(_PURGE, retention_s, batch)
            count = int(status.rsplit(" ", 1)[-1])
            deleted += count
            if count < batch:
                return deleted

    async def open_counts(self) -> OpenCounts:
        """Rows by open status (and needs_review), and the oldest unprocessed one's age."""
        async with translated():
            rows = await self.pool.fetch(_OPEN_COUNTS)
        counts = dict.fromkeys(OPEN_STATUSES, 0) | {r["status"]: int(r["n"]) for r in rows}
        unprocessed = [r["oldest_s"] for r in rows if r["status"] != "needs_review"]
        return OpenCounts(counts, max(unprocessed, default=0.0))


@dataclass(frozen=True)
class _Held:
    """A leased job inside one connection: every write names the lease."""

    conn: PoolConnectionProxy[asyncpg.Record]
    job: Job
    owner: str

    async def finish(
        self,
        status: str,
        *,
        outcome: str | None = None,
        error: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """Give the row `status` and release the lease; `LeaseHeld` if it is no longer ours."""
        result = await self.conn.execute(
            _FINISH, self.job.id, self.owner, status, outcome, error, delay_s
        )
        if result != "UPDATE 1":
            raise LeaseHeld(f"the lease on webhook {self.job.event_id} was taken over")

    async def apply(self, record: asyncpg.Record, decision: Apply) -> None:
        """The guarded ledger write of `decision`."""
        job = self.job
        updated = await self.conn.fetchval(
            _APPLY,
            record["order_id"],
            record["billing_period"],
            job.charge_id,
            job.revision,
            decision.status,
            decision.disputed,
            f"gateway: dispute opened on {job.charge_id}",
            record["status"],
            decision.decline_code,
            decline_class(decision.decline_code) if decision.status in DECLINE_STATES else None,
            decision.retry_in_s,
        )
        if updated != 1:  # the row is locked: only a bug in the rules gets here
            raise GuardRefused(f"the guarded ledger update matched no row ({decision.change})")

    async def story(
        self, key: tuple[int, dt.date], status: str, outcome: str, looked_up: str | None
    ) -> None:
        """Append the `webhook` event; losing it never undoes what it records (a savepoint)."""
        job = self.job
        # a pool's connection proxy forwards every Connection method
        conn = cast("asyncpg.Connection[asyncpg.Record]", self.conn)
        try:
            async with conn.transaction():
                await events.record(
                    conn,
                    *key,
                    "webhook",
                    ACTOR,
                    **job.describe(),
                    outcome=status,
                    detail=outcome,
                    looked_up=looked_up,
                )
        except (asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError):
            raise
        except asyncpg.PostgresError as error:
            log.warning("webhook.event_lost", event_id=job.event_id, error=str(error))
