"""Reconcile's sweeps over one ledger connection, and the two that start from open rows.

| sweep              | looks at                                     | repairs by                   |
|--------------------|----------------------------------------------|------------------------------|
| double charges     | >1 gateway charge still captured for a key   | refunding the proven doubles |
| unrecorded charges | captured charges for declined, failed or     | recording the matching one   |
|                    | blocked rows (paid; the ledger says no)      |                              |
| unknown outcomes   | quiet, unleased `pending` rows that called   | recording what lookup finds  |
| lost messages      | quiet, unleased `scheduled`/`pending` rows   | recording what lookup finds, |
|                    | whose message no longer waits in the stream  | else re-publishing           |
| discrepancies      | `succeeded` rows the gateway does not know   | nothing: for a human         |
| unmatched charges  | captured charges not proven the key's own    | nothing: for a human         |
|                    | (no row; another amount, currency, customer) |                              |

The ones that start from the gateway's charges live in `charges.py` (what they may do
alone: `proof.py`); unknown outcomes and lost messages are here, with what all share
(`Sweeper`).

Nothing here ever charges. Every ledger write is one statement guarded by the status and
the fence (`attempt`) read before and by an expired lease, so it never races a worker that
has just taken the row. A key that fails is reported and the sweep goes on; only
`DependencyUnavailable` ends the run. The SQL lives in these modules, not in `ledger.py`:
it is not the worker's hot path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
import structlog
from pydantic import ValidationError

from charge_worker import events
from charge_worker.errors import (
    ChargeWorkerError,
    DependencyUnavailable,
    PoisonMessage,
    SettingsError,
)
from charge_worker.gateway import GatewayCharge, GatewayClient
from charge_worker.messages import SCHEMA, ChargeDue, idempotency_key
from charge_worker.reconcile.history import patiently
from charge_worker.reconcile.report import Finding, Report, Sweep
from charge_worker.streams import Position

ACTOR = "reconcile"
PROGRESS_EVERY = 100  # rows
log = structlog.get_logger(__name__)
Key = tuple[int, dt.date]

# The state and fence read before, and no live lease: a worker that took the row wins.
_SETTLE = """
UPDATE charge_attempts
   SET status = $4, gateway_charge_id = $5, last_error = $6, lease_owner = NULL,
       lease_until = NULL, settled_at = now(), updated_at = now()
 WHERE order_id = $1 AND billing_period = $2 AND status IN ('scheduled', 'pending')
   AND attempt = $3 AND (lease_until IS NULL OR lease_until < now())
"""

_UNKNOWN = """
SELECT order_id, billing_period, attempt FROM charge_attempts
 WHERE status = 'pending' AND gateway_calls > 0
   AND (lease_until IS NULL OR lease_until < now())
   AND updated_at < now() - make_interval(secs => $1)
 ORDER BY updated_at, order_id, billing_period
"""

# Quiet, unleased open rows whose newest message no longer waits in the stream: at or below
# the consumer's ack floor ($2), older than the stream's first message ($3), deleted ($4),
# or never published. A month-start queue is not a loss, however long it takes.
_NEWEST = "greatest(published_seq, last_stream_seq)"
_OPEN_AND_QUIET = """
 WHERE status IN ('scheduled', 'pending') AND (lease_until IS NULL OR lease_until < now())
   AND updated_at < now() - make_interval(secs => $1)
"""
_WAITING = f"""
coalesce({_NEWEST} > $2 AND {_NEWEST} >= $3 AND NOT {_NEWEST} = ANY($4::bigint[]), false)
"""
_QUIET = f"""
SELECT order_id, billing_period, subscription_id, customer_id, amount_minor, currency,
       due_at, status, attempt, updated_at
  FROM charge_attempts {_OPEN_AND_QUIET} AND NOT {_WAITING}
 ORDER BY updated_at, order_id, billing_period
"""
_STILL_WAITING = f"SELECT count(*) FROM charge_attempts {_OPEN_AND_QUIET} AND {_WAITING}"

# Only the quiet clock moves, and where the new message is; a row a worker has taken since
# (another attempt) is its own.
_TOUCH = """
UPDATE charge_attempts SET updated_at = now(), published_seq = greatest(published_seq, $5)
 WHERE order_id = $1 AND billing_period = $2 AND status = $3 AND attempt = $4
"""


class Republisher(Protocol):
    """The charges stream: where the consumer stands, and where lost messages go back to
    (the charges subject, with a fresh `Nats-Msg-Id`)."""

    async def position(self) -> Position:
        """The consumer's position in the stream now."""

    async def republish(self, body: bytes, msg_id: str) -> int:
        """Publish, wait for the ack, return the stream sequence."""


def stamp(moment: dt.datetime) -> str:
    """RFC 3339 in UTC, to the second."""
    return moment.astimezone(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class Sweeper:
    """What every sweep of one run shares: the ledger connection (holding the run's lock),
    the gateway, the publisher, the report, and the helpers that keep writes guarded."""

    conn: asyncpg.Connection
    gateway: GatewayClient
    publisher: Republisher
    report: Report
    quiet_s: float
    dry_run: bool = False
    progress: Callable[[str], None] = lambda _line: None
    # settled (or, dry, that would be) by an earlier sweep of this run: not re-published
    settled: set[Key] = field(default_factory=set)
    # gateway charges reported for a person by an earlier sweep of this run
    unmatched: set[str] = field(default_factory=set)
    # keys a sweep of this run could not handle: reported once, not tried again
    failed: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def each(self, sweep: Sweep, key: str) -> Iterator[None]:
        """One broken key is reported and skipped; an unreachable (or unconfigured)
        dependency ends the run."""
        try:
            yield
        except (DependencyUnavailable, SettingsError):
            raise
        except ChargeWorkerError as error:
            self._failed(sweep, key, f"{type(error).__name__}: {error}")
        except (asyncpg.IntegrityConstraintViolationError, asyncpg.DataError) as error:
            self._failed(sweep, key, f"the ledger refused the write: {error}")

    def _failed(self, sweep: Sweep, key: str, error: str) -> None:
        self.failed.add(key)
        self.report.fail(sweep, key, error)
        log.warning("reconcile.key_failed", sweep=sweep, key=key, error=error)

    def tick(self, what: str, done: int, total: int) -> None:
        """Progress on long sweeps, every `PROGRESS_EVERY` rows."""
        if done % PROGRESS_EVERY == 0:
            self.progress(f"reconcile: {what}: {done}/{total} rows")

    async def event(self, key: Key, kind: str, **detail: Any) -> None:
        """Append to the charge's story; losing an event never undoes what it records."""
        try:
            async with self.conn.transaction():  # a savepoint when inside a transaction
                await events.record(self.conn, *key, kind, ACTOR, **detail)
        except (asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError):
            raise
        except asyncpg.PostgresError as error:
            key_ = idempotency_key(*key)
            log.warning("reconcile.event_lost", kind=kind, key=key_, error=str(error))

    async def settle(
        self,
        key: Key,
        attempt: int,
        status: str,
        charge_id: str | None,
        error: str | None,
        **detail: Any,
    ) -> bool:
        """The guarded write, with its `resolved` event; False if a worker took the row."""
        async with self.conn.transaction():
            result = await self.conn.execute(_SETTLE, *key, attempt, status, charge_id, error)
            if result != "UPDATE 1":
                return False
            await self.event(key, "resolved", status=status, charge_id=charge_id, **detail)
        self.settled.add(key)
        return True


async def unknown_outcomes(run: Sweeper) -> None:
    """Sweep 2: record what the gateway did for quiet, unleased `pending` rows whose call
    has no recorded outcome. A charge found: `succeeded`; a failed one: `declined`;
    nothing: left pending for `lost_messages` (the worker looks up before charging)."""
    rows = await run.conn.fetch(_UNKNOWN, run.quiet_s)
    for done, row in enumerate(rows, 1):
        run.tick("unknown outcomes", done, len(rows))
        key = (row["order_id"], row["billing_period"])
        with run.each("unknown_outcomes", idempotency_key(*key)):
            await _resolve(run, key, row["attempt"])


def _found(charges: list[GatewayCharge]) -> tuple[str, GatewayCharge] | None:
    """What a lookup says happened: the earliest charge still captured, else the earliest
    made (refunded since), else a failed one."""
    made = [c for c in charges if c.captured] or [c for c in charges if c.charged]
    if made:
        return "succeeded", made[0]
    failed = [c for c in charges if c.status == "failed"]
    return ("declined", failed[0]) if failed else None


async def _resolve(run: Sweeper, key: Key, attempt: int) -> None:
    found = _found(await patiently(run.gateway.lookup, *key))
    if found is None:
        run.report.add("unknown_outcomes", Finding(*key, "not found: re-publish", {}))
        return
    status, charge = found
    detail = {"attempt": attempt, "charge_id": charge.id}
    if run.dry_run:
        run.settled.add(key)
        action = f"would record {status}"
    elif await run.settle(
        key,
        attempt,
        status,
        charge.id if status == "succeeded" else None,
        None if status == "succeeded" else f"declined: charge {charge.id} failed (reconcile)",
        lookup=charge.status,
    ):
        run.report.counts.unknown_resolved += 1
        action = f"recorded {status}"
    else:
        action = "taken by a worker: left alone"
    run.report.add("unknown_outcomes", Finding(*key, action, detail))


async def lost_messages(run: Sweeper) -> None:
    """Sweep 4: quiet, unleased `scheduled`/`pending` rows whose message no longer waits in
    the stream (`_QUIET`): a broker that lost it, or a ledger that forgot what a worker did
    (a failover). Each is looked up first: a charge (or a decline) the gateway made is
    recorded, not made again (a gateway without idempotency would charge twice); else the
    row is re-published with a fresh `Nats-Msg-Id` and its quiet clock restarts."""
    position = await run.publisher.position()
    where = (run.quiet_s, position.ack_floor, position.first_seq, list(position.deleted))
    run.report.counts.still_waiting = await run.conn.fetchval(_STILL_WAITING, *where)
    rows = await run.conn.fetch(_QUIET, *where)
    for done, row in enumerate(rows, 1):
        run.tick("lost messages", done, len(rows))
        key = (row["order_id"], row["billing_period"])
        if key not in run.settled and idempotency_key(*key) not in run.failed:
            with run.each("lost_messages", idempotency_key(*key)):
                await _recover(run, key, row)


async def _recover(run: Sweeper, key: Key, row: asyncpg.Record) -> None:
    found = _found(await patiently(run.gateway.lookup, *key))
    if found is None:
        await _republish(run, key, row)
        return
    status, charge = found
    detail = {"status": row["status"], "charge_id": charge.id}
    if run.dry_run:
        run.settled.add(key)
        action = f"would record {status} (found at the gateway)"
    elif await run.settle(
        key,
        row["attempt"],
        status,
        charge.id if status == "succeeded" else None,
        None if status == "succeeded" else f"declined: charge {charge.id} failed (reconcile)",
        lookup=charge.status,
        how="its message was gone; the gateway had it",
    ):
        run.report.counts.adopted += 1
        action = f"recorded {status} (found at the gateway)"
    else:
        action = "taken by a worker: left alone"
    run.report.add("lost_messages", Finding(*key, action, detail))


def _message(row: asyncpg.Record) -> ChargeDue:
    """The contract body rebuilt from a ledger row; `due_at` defaults to the period's start."""
    period: dt.date = row["billing_period"]
    due_at = row["due_at"] or dt.datetime.combine(period, dt.time(), tzinfo=dt.UTC)
    fields = ("order_id", "subscription_id", "customer_id", "amount_minor", "currency")
    try:
        return ChargeDue.model_validate(
            {"schema": SCHEMA, "billing_period": period, "due_at": due_at}
            | {name: row[name] for name in fields}
        )
    except ValidationError as error:
        why = error.errors()[0]["msg"]
        raise PoisonMessage(f"the row makes no valid {SCHEMA} message: {why}") from error


async def _republish(run: Sweeper, key: Key, row: asyncpg.Record) -> None:
    body = _message(row).to_json()
    detail: dict[str, Any] = {"status": row["status"], "quiet_since": stamp(row["updated_at"])}
    if run.dry_run:
        run.report.add("lost_messages", Finding(*key, "would re-publish", detail))
        return
    # fresh each run: the producer's `charge:<key>` may still sit in the dedup window
    msg_id = f"reconcile:{key[0]}:{key[1].isoformat()}:{int(time.time())}"
    seq = await run.publisher.republish(body, msg_id)
    run.report.counts.republished += 1
    detail |= {"stream_seq": seq, "msg_id": msg_id}
    async with run.conn.transaction():
        await run.conn.execute(_TOUCH, *key, row["status"], row["attempt"], seq)
        why = f"{row['status']} and quiet since {detail['quiet_since']}"
        await run.event(key, "republished", why=why, stream_seq=seq, msg_id=msg_id)
    run.report.add("lost_messages", Finding(*key, "re-published", detail))
