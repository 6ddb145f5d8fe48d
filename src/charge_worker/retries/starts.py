"""Every statement that starts a period's next try (docs/decisions/0007-retries.md).

Starting try `n + 1` is one statement per row: it copies try `n` to `charge_tries` as the
row holds it (key, charge, decline, times), and resets the row to `scheduled` for try
`n + 1`, with its key `<order_id>:<billing_period>:<n + 1>` and nothing of try `n` left
(charge, decline, error, verdict, calls, publish, lease). `scheduled` makes no outcome event:
the period's next event is what try `n + 1` comes to. The producer then publishes the row
like any `scheduled` one, with `attempt: n + 1`.

Two ways in:
- `start_due`, the producer's step: rows `retry_scheduled` whose `retry_at` has come, a
  batch at a time, locked `FOR UPDATE SKIP LOCKED`, so two runs at once start each try once.
- `retry_now`, `charge-worker retry`: one period's next try, now, on purpose; refused
  (`RetryRefused`, one sentence naming the state) where no try may follow.

The 30-day cap (`CHARGE_WORKER_RETRY_CAP_30D`) counts the tries started in the last
`CAP_WINDOW_S`, the current one included: a due try it would exceed is pushed to the first
moment the window allows (its oldest counted start + 30 days), and stays `retry_scheduled`.

Driver errors become domain errors (`database.translated`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import asyncpg
from asyncpg.pool import PoolConnectionProxy
from pydantic import ValidationError

from charge_worker.database import translated
from charge_worker.errors import RetryRefused
from charge_worker.messages import SCHEMA, ChargeDue, idempotency_key
from charge_worker.settings import CAP_WINDOW_S

# The tries of the row `{row}` started in the window ending at `{now}` ($2: its length in
# seconds): the archived ones, and the current one (try 1 started with the row).
_IN_WINDOW = """
SELECT count(*) AS started, min(s.at) AS oldest
  FROM (SELECT t.started_at AS at FROM charge_tries AS t
         WHERE t.order_id = {row}.order_id AND t.billing_period = {row}.billing_period
        UNION ALL
        SELECT coalesce({row}.try_started_at, {row}.created_at)) AS s
 WHERE s.at > {now} - make_interval(secs => $2)
"""

# $1 the clock (NULL: the database's), $2 the window in seconds, $3 the cap; `due` locks
# the rows to start (with its own parameters from $4) and reads them as locked.
_NOW = "coalesce($1::timestamptz, now())"


def _start(due: str) -> str:
    """The statement that starts the next try of each row `due` locks, or postpones it
    where the cap would be exceeded: answers how many of each."""
    return f"""
WITH due AS ({due}),
counted AS (
    SELECT d.*, w.started, w.oldest
      FROM due AS d CROSS JOIN LATERAL ({_IN_WINDOW.format(row="d", now=_NOW)}) AS w
),
archived AS (
    INSERT INTO charge_tries (order_id, billing_period, try_no, idempotency_key,
                              gateway_charge_id, decline_code, decline_class, last_error,
                              started_at, ended_at)
    SELECT order_id, billing_period, current_try, idempotency_key, gateway_charge_id,
           decline_code, decline_class, last_error, coalesce(try_started_at, created_at),
           coalesce(settled_at, updated_at)
      FROM counted WHERE started < $3
),
started AS (
    UPDATE charge_attempts AS a
       SET status = 'scheduled', current_try = c.current_try + 1,
           idempotency_key = a.order_id::text || ':' || to_char(a.billing_period, 'YYYY-MM-DD')
                             || ':' || (c.current_try + 1)::text,
           try_started_at = {_NOW}, retry_at = NULL,
           gateway_charge_id = NULL, gateway_revision = NULL, gateway_seen_charge_id = NULL,
           decline_code = NULL, decline_class = NULL, last_error = NULL, settled_at = NULL,
           scoring = NULL, gateway_calls = 0, published_at = NULL, published_seq = NULL,
           last_stream_seq = NULL, lease_owner = NULL, lease_until = NULL, updated_at = now()
      FROM counted AS c
     WHERE a.order_id = c.order_id AND a.billing_period = c.billing_period
       AND a.status = 'retry_scheduled' AND c.started < $3
    RETURNING a.order_id
),
postponed AS (
    UPDATE charge_attempts AS a
       SET retry_at = c.oldest + make_interval(secs => $2), updated_at = now()
      FROM counted AS c
     WHERE a.order_id = c.order_id AND a.billing_period = c.billing_period
       AND a.status = 'retry_scheduled' AND c.started >= $3
    RETURNING a.retry_at
)
SELECT (SELECT count(*) FROM started) AS started, (SELECT count(*) FROM postponed) AS postponed
"""  # noqa: S608 (assembled from this module's constants, never from input)


# the producer's step: due rows, oldest due first (charge_attempts_retry_idx); $4 the batch
_START_DUE = _start(
    f"""SELECT * FROM charge_attempts
     WHERE status = 'retry_scheduled' AND retry_at <= {_NOW}
     ORDER BY retry_at LIMIT $4
       FOR UPDATE SKIP LOCKED"""  # noqa: S608 (module constants)
)
# `charge-worker retry`: one row ($4, $5), locked already by the caller's transaction
_START_ONE = _start(
    f"""SELECT * FROM charge_attempts
     WHERE order_id = $4 AND billing_period = $5
       AND status = 'retry_scheduled' AND retry_at <= {_NOW}
       FOR UPDATE"""  # noqa: S608 (module constants)
)

_LOCK = """
SELECT status, decline_code, decline_class, disputed_at, current_try, review_reason
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
   FOR UPDATE
"""
# ($2 is the window's length, as in `_IN_WINDOW`)
_WINDOW = f"""
SELECT w.* FROM charge_attempts AS a
 CROSS JOIN LATERAL ({_IN_WINDOW.format(row="a", now="now()")}) AS w
 WHERE a.order_id = $1 AND a.billing_period = $3
"""  # noqa: S608 (module constants)
# a try made due now; from `action_required` or `declined`, this change is the period's
# `charge.retry_scheduled` event (its `retry_at` now)
_DUE_NOW = """
UPDATE charge_attempts SET status = 'retry_scheduled', retry_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status = $3
"""

# the started try's message, as the producer publishes a `scheduled` row
_MESSAGE = """
SELECT order_id, billing_period, subscription_id, customer_id, amount_minor, currency,
       coalesce(due_at, billing_period::timestamp AT TIME ZONE 'UTC') AS due_at,
       current_try AS attempt, traceparent
  FROM charge_attempts WHERE order_id = $1 AND billing_period = $2
"""

HOLDS_MONEY = ("succeeded", "refunded", "processing")
RETRYABLE = ("retry_scheduled", "action_required", "declined")  # `declined`: unless hard
_IN_FLIGHT = "{key} has a try in flight (try {try_no} is {status}): wait for what it comes to"
_REFUSED = {
    "scheduled": _IN_FLIGHT,
    "pending": _IN_FLIGHT,
    "blocked": "{key} is blocked by scoring{why}: a person reviews it, a retry would not change"
    " the verdict",
    "failed": "{key} is failed, nothing charged: replay its dead letter (`charge-worker dlq"
    " replay`) instead",
}


@dataclass(frozen=True)
class Starts:
    """What one batch of `start_due` did."""

    started: int = 0
    postponed: int = 0  # pushed to when the 30-day cap allows, still `retry_scheduled`

    @property
    def rows(self) -> int:
        """The rows the batch took: fewer than its limit when no more were due."""
        return self.started + self.postponed


@dataclass(frozen=True)
class StartedTry:
    """A try `retry_now` started: the row is `scheduled` for it, its message unpublished."""

    charge: ChargeDue  # attempt = the new try; its `key` and `msg_id` are the try's
    traceparent: str | None
    was: str  # the row's status before: retry_scheduled, action_required or declined

    @property
    def try_no(self) -> int:
        return self.charge.attempt


async def start_due(
    db: asyncpg.Pool | asyncpg.Connection,
    limit: int,
    cap: int,
    now: dt.datetime | None = None,
) -> Starts:
    """Start the next try of at most `limit` rows whose `retry_at` has come (at `now`, the
    database's clock by default), or postpone those the cap of `cap` tries in 30 days
    would not allow. One statement, one transaction; rows another run holds are skipped."""
    async with translated("cannot start due tries"):
        row = await db.fetchrow(_START_DUE, now, CAP_WINDOW_S, cap, limit)
    assert row is not None  # an aggregate answers one row
    return Starts(row["started"], row["postponed"])


async def retry_now(
    db: asyncpg.Pool | asyncpg.Connection, order_id: int, billing_period: dt.date, cap: int
) -> StartedTry:
    """Start the period's next try now (`charge-worker retry`), from `retry_scheduled`,
    `action_required`, or `declined` by a decline that is not `hard`; `RetryRefused` in one
    sentence otherwise, or when the cap of `cap` tries in 30 days is reached."""
    async with translated("cannot start the try"):
        if isinstance(db, asyncpg.Pool):
            async with db.acquire() as conn:
                return await _retry_now(conn, order_id, billing_period, cap)
        return await _retry_now(db, order_id, billing_period, cap)


async def _retry_now(
    conn: asyncpg.Connection | PoolConnectionProxy[asyncpg.Record],
    order_id: int,
    billing_period: dt.date,
    cap: int,
) -> StartedTry:
    key = idempotency_key(order_id, billing_period)
    async with conn.transaction():
        row = await conn.fetchrow(_LOCK, order_id, billing_period)
        if row is None:
            raise RetryRefused(f"no charge {key} in the ledger: nothing to retry")
        if why := refusal(key, row):
            raise RetryRefused(why)
        window = await conn.fetchrow(_WINDOW, order_id, CAP_WINDOW_S, billing_period)
        assert window is not None  # the row is locked: it is there
        if window["started"] >= cap:
            allowed = window["oldest"] + dt.timedelta(seconds=CAP_WINDOW_S)
            raise RetryRefused(
                f"{key} has started {window['started']} tries in the last 30 days, the cap"
                f" (CHARGE_WORKER_RETRY_CAP_30D={cap}): the next try is allowed from"
                f" {allowed.astimezone(dt.UTC).isoformat(timespec='seconds')}"
            )
        await conn.execute(_DUE_NOW, order_id, billing_period, row["status"])
        done = await conn.fetchrow(_START_ONE, None, CAP_WINDOW_S, cap, order_id, billing_period)
        assert done is not None
        assert done["started"] == 1, "the locked row, due now, was not started"
        message = await conn.fetchrow(_MESSAGE, order_id, billing_period)
        assert message is not None
        try:
            charge = ChargeDue.model_validate({"schema": SCHEMA, **dict(message)})
        except ValidationError as error:  # a row written by hand: nothing is started
            why = error.errors()[0]["msg"]
            raise RetryRefused(f"{key} makes no valid {SCHEMA} message: {why}") from error
        return StartedTry(charge, message["traceparent"], row["status"])


def refusal(key: str, row: asyncpg.Record) -> str | None:
    """Why the period's next try may not start now, in one sentence; None when it may."""
    status = row["status"]
    if row["disputed_at"] is not None or status in HOLDS_MONEY:
        dispute = ", disputed" if row["disputed_at"] is not None else ""
        return f"{key} holds money ({status}{dispute}): a period is charged at most once"
    if status == "declined" and row["decline_class"] == "hard":
        return f"{key} is final by a hard decline ({row['decline_code']}): never tried again"
    if status in RETRYABLE:
        return None
    why = f" ({row['review_reason']})" if row["review_reason"] else ""
    template = _REFUSED.get(status, "{key} is {status}: no try follows it")
    return template.format(key=key, status=status, try_no=row["current_try"], why=why)
