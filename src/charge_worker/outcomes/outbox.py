"""Every SQL statement on `charge_outcomes`, the outbox of outcome events.

The rows are written by the ledger row's triggers, never here. A relay takes a batch under
row locks (`FOR UPDATE SKIP LOCKED`: each pod its own rows, no leader), publishes it while
the transaction holds them, and marks in the same transaction what the stream acknowledged
and what failed. A relay that dies or stalls anywhere in between commits nothing: its rows
are unlocked (its connection closes, or `idle_in_transaction_session_timeout` ends the
transaction) and published again, under the same `Nats-Msg-Id`.

Only the lowest unsent event of a period is ever taken, so a period's events reach the
stream in `sequence` order whatever fails.

An event id is never given to two events. A failover to an asynchronous standby may lose
commits whose events the relay had published; the period's next change then gets a
sequence number the stream already holds. Inside the duplicate window the stream answers
"duplicate" and keeps the lost event: the relay compares the bodies, and when they differ
(`Taken`) moves the period's unsent events and its counter up by one, so the change is
published under a higher sequence, which a consumer that keeps the highest applies. Past
the window nothing can tell, and a consumer's dedup by `event_id` drops it: the stated
limit in docs/outcomes.md.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import asyncpg

from charge_worker.database import translated
from charge_worker.declines import GENERIC_DECLINE, decline_class
from charge_worker.settings import WorkerSettings

# `e.stream_seq IS NULL`, not `e.sent_at IS NULL` (the same rows: a CHECK holds them
# together): a predicate no partial index matches keeps the probe on the primary key, where
# an analyzed, mostly sent outbox would have the planner scan every unsent row per candidate
_TAKE = """
SELECT o.order_id, o.billing_period, o.sequence, o.type, o.subscription_id, o.customer_id,
       o.amount_minor, o.currency, o.gateway_charge_id, o.decline_code, o.decline_class,
       o.review, o.traceparent, o.occurred_at, o.attempt, o.retry_at
  FROM charge_outcomes AS o
 WHERE o.sent_at IS NULL AND o.next_try_at <= now()
   AND NOT EXISTS (SELECT FROM charge_outcomes AS e
                    WHERE e.order_id = o.order_id AND e.billing_period = o.billing_period
                      AND e.sequence < o.sequence AND e.stream_seq IS NULL)
 ORDER BY o.occurred_at
 LIMIT $1
   FOR UPDATE SKIP LOCKED
"""

_SENT = """
UPDATE charge_outcomes AS o
   SET sent_at = now(), stream_seq = k.stream_seq, tries = o.tries + 1, last_error = NULL
  FROM unnest($1::bigint[], $2::date[], $3::int[], $4::bigint[])
       AS k(order_id, billing_period, sequence, stream_seq)
 WHERE (o.order_id, o.billing_period, o.sequence) = (k.order_id, k.billing_period, k.sequence)
"""

# the next try after 0.5 s, 1 s, 2 s, ... up to `$5`
_FAILED = """
UPDATE charge_outcomes AS o
   SET tries = o.tries + 1, last_error = $4,
       next_try_at = now() + make_interval(secs => least($5, 0.5 * 2 ^ least(o.tries, 30)))
  FROM unnest($1::bigint[], $2::date[], $3::int[]) AS k(order_id, billing_period, sequence)
 WHERE (o.order_id, o.billing_period, o.sequence) = (k.order_id, k.billing_period, k.sequence)
"""

# the period's row first: no change of it can write an event while its events move
_LOCK_PERIOD = """
UPDATE charge_attempts SET outcome_seq = outcome_seq + 1
 WHERE order_id = $1 AND billing_period = $2
"""

_UNSENT_FROM = """
SELECT sequence FROM charge_outcomes
 WHERE order_id = $1 AND billing_period = $2 AND sent_at IS NULL AND sequence >= $3
 ORDER BY sequence DESC
"""

# one event up by one; the highest first, so that no two ever share a number
_MOVE_UP = """
UPDATE charge_outcomes SET sequence = sequence + 1, next_try_at = now(), last_error = $4
 WHERE order_id = $1 AND billing_period = $2 AND sequence = $3
"""

_OLDEST_UNSENT = """
SELECT coalesce(extract(epoch FROM now() - min(occurred_at)), 0)::float8
  FROM charge_outcomes WHERE sent_at IS NULL
"""

_PRUNE = """
DELETE FROM charge_outcomes WHERE (order_id, billing_period, sequence) IN (
    SELECT order_id, billing_period, sequence FROM charge_outcomes
     WHERE sent_at < now() - make_interval(secs => $1)
     ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)
"""


# the types whose event names the charge that holds the money
_HOLDS_MONEY = frozenset({"charge.succeeded", "charge.refunded", "charge.disputed"})
_DECLINES = frozenset({"charge.declined", "charge.action_required", "charge.retry_scheduled"})


@dataclass(frozen=True)
class Event:
    """An unsent outcome event: the ledger row's fields as its change committed them."""

    order_id: int
    billing_period: dt.date
    sequence: int
    type: str
    subscription_id: str
    customer_id: str
    amount_minor: int
    currency: str
    gateway_charge_id: str | None
    decline_code: str | None
    decline_class: str | None
    review: bool
    traceparent: str | None
    occurred_at: dt.datetime
    attempt: int = 1  # the period's try the change was made in
    retry_at: dt.datetime | None = None  # `charge.retry_scheduled`: when the next try is due

    @property
    def event_id(self) -> str:
        return f"{self.order_id}:{self.billing_period.isoformat()}:{self.sequence}"

    @property
    def kind(self) -> str:
        """The subject's last token: `charge.succeeded` -> `succeeded`."""
        return self.type.removeprefix("charge.")

    def body(self) -> bytes:
        """The message (`charge.outcome/v1`): the same bytes for the same event, always."""
        declined = self.type in _DECLINES
        code = (self.decline_code or GENERIC_DECLINE) if declined else None
        document: dict[str, object] = {
            "schema": "charge.outcome/v1",
            "event_id": self.event_id,
            "type": self.type,
            "sequence": self.sequence,
            "order_id": self.order_id,
            "billing_period": self.billing_period.isoformat(),
            "subscription_id": self.subscription_id,
            "customer_id": self.customer_id,
            "amount_minor": self.amount_minor,
            "currency": self.currency,
            "attempt": self.attempt,
            "gateway_charge_id": self.gateway_charge_id if self.type in _HOLDS_MONEY else None,
            "decline_code": code,
            "decline_class": (self.decline_class or decline_class(code)) if declined else None,
            "occurred_at": _rfc3339(self.occurred_at),
        }
        if self.type == "charge.retry_scheduled" and self.retry_at is not None:
            document["retry_at"] = _rfc3339(self.retry_at)
        if self.review:
            document["review"] = True
        return json.dumps(document, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Taken:
    """The stream holds another event under this one's id (at `stream_seq`): the event of
    a commit a failover lost."""

    stream_seq: int


# What publishing a batch came to, per event in order: the stream sequence it is stored
# at, or why it is not.
Result = int | Taken | Exception
Published = Sequence[Result]


class Outbox:
    def __init__(self, pool: asyncpg.Pool, *, hold_s: float, retry_max_s: float) -> None:
        """`hold_s`: the longest a relay may hold its rows before PostgreSQL ends its
        transaction; `retry_max_s`: the longest gap between two tries of a failing event."""
        self.pool = pool
        self.retry_max_s = retry_max_s
        self._hold = f"SET LOCAL idle_in_transaction_session_timeout = {math.ceil(hold_s * 1000)}"

    @classmethod
    def of_worker(cls, pool: asyncpg.Pool, cfg: WorkerSettings) -> Outbox:
        """The outbox as the worker's settings make it: a batch held for at most two publish
        timeouts, a failing event tried again within `outbox_retry_max_s`."""
        return cls(
            pool, hold_s=2 * cfg.outbox_publish_timeout_s, retry_max_s=cfg.outbox_retry_max_s
        )

    async def relay(
        self,
        limit: int,
        publish: Callable[[list[Event]], Awaitable[Published]],
        *,
        before_mark: Callable[[], None] = lambda: None,
    ) -> list[tuple[Event, Result]]:
        """Take up to `limit` events, `publish` them, record what came of each; returns it."""
        async with translated("outbox"), self.pool.acquire() as conn, conn.transaction():
            await conn.execute(self._hold)
            rows = await conn.fetch(_TAKE, limit)
            if not rows:
                return []
            taken = [Event(*row.values()) for row in rows]
            results = list(zip(taken, await publish(taken), strict=True))
            before_mark()
            sent = [(e, r) for e, r in results if isinstance(r, int)]
            failed = [(e, r) for e, r in results if isinstance(r, Exception)]
            if sent:
                await conn.execute(_SENT, *_keys([e for e, _ in sent]), [r for _, r in sent])
            if failed:
                error = f"{type(failed[0][1]).__name__}: {failed[0][1]}"[:500]
                await conn.execute(_FAILED, *_keys([e for e, _ in failed]), error, self.retry_max_s)
            for event, result in results:
                if isinstance(result, Taken):
                    key = (event.order_id, event.billing_period)
                    await conn.execute(_LOCK_PERIOD, *key)
                    why = f"{event.event_id} is taken in the stream (seq {result.stream_seq})"
                    for row in await conn.fetch(_UNSENT_FROM, *key, event.sequence):
                        await conn.execute(_MOVE_UP, *key, row["sequence"], why)
        return results

    async def oldest_unsent_s(self) -> float:
        """How long the oldest event not in the stream yet has waited (0: none waits)."""
        async with translated("outbox"):
            return float(await self.pool.fetchval(_OLDEST_UNSENT))

    async def prune(self, retention_s: float, limit: int = 10_000) -> int:
        """Delete up to `limit` events sent more than `retention_s` ago; how many."""
        async with translated("outbox"):
            status = await self.pool.execute(_PRUNE, retention_s, limit)
        return int(status.split()[-1])


def _rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _keys(events: list[Event]) -> tuple[list[int], list[dt.date], list[int]]:
    return (
        [e.order_id for e in events],
        [e.billing_period for e in events],
        [e.sequence for e in events],
    )
