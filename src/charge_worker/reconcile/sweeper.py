"""What every sweep of one reconcile run shares (`Sweeper`), and how keys are worked on
several at once (`together`).

The run's own connection holds its advisory lock; it reads the rows the sweeps work on and
writes what the run itself keeps (the rows a page shows, the follow-ups, the checkpoint).
Each key is worked on from the run's pool, `CONCURRENCY` keys at a time, on a connection of
its own. Every ledger write of a key is one statement guarded by the status and the fence
(`attempt`) read before and by an expired lease, so it never races a worker that has just
taken the row. A key that fails is reported and the sweep goes on; only
`DependencyUnavailable` ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import asyncpg
import structlog

from charge_worker import events, tracing
from charge_worker.declines import decline_class
from charge_worker.errors import ChargeWorkerError, DependencyUnavailable, SettingsError
from charge_worker.gateway import Gateway, GatewayCharge
from charge_worker.messages import idempotency_key
from charge_worker.reconcile import proof, reviews
from charge_worker.reconcile.candidates import Key
from charge_worker.reconcile.history import patiently
from charge_worker.reconcile.report import Finding, Report, Sweep
from charge_worker.retries.schedule import DECLINE_STATES
from charge_worker.streams import Position

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

ACTOR = "reconcile"
PROGRESS_EVERY = 100  # rows
CONCURRENCY = 8  # keys worked on at once, each on its own ledger connection
BATCH = 1000  # rows read at a time
log = structlog.get_logger(__name__)
Db: TypeAlias = "asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]"  # a key's own
T = TypeVar("T")

# The state and fence read before, and no live lease: a worker that took the row wins. The
# charge comes from the gateway's own lookup: shown, so no possible discrepancy.
# A charge found made with no verdict kept (its worker died mid-call: the verdict is
# written with the outcome) gets the post-hoc scoring check a deferred verdict has.
# A decline found leaves the period as the worker's would (`retry_scheduled` with its
# `retry_at` in `$9` seconds, `action_required`, `declined`), with its code and class.
_SETTLE = """
WITH updated AS (
    UPDATE charge_attempts
       SET status = $4, gateway_charge_id = coalesce($5, gateway_charge_id),
           gateway_seen_charge_id = $5, last_error = $6, decline_code = $7,
           decline_class = $8,
           retry_at = CASE WHEN $4 = 'retry_scheduled' THEN now() + make_interval(secs => $9)
                      END,
           scoring = CASE WHEN $4 IN ('succeeded', 'processing')
                          THEN coalesce(scoring, 'deferred') ELSE scoring END,
           lease_owner = NULL, lease_until = NULL, updated_at = now(),
           settled_at = CASE WHEN $4 = 'processing' THEN NULL ELSE now() END
     WHERE order_id = $1 AND billing_period = $2
       AND status IN ('scheduled', 'pending', 'processing')
       AND attempt = $3 AND (lease_until IS NULL OR lease_until < now())
    RETURNING order_id, billing_period, scoring
), deferred AS (
    INSERT INTO deferred_scoring_checks (order_id, billing_period, reason)
    SELECT order_id, billing_period, 'charged with no verdict kept (found by reconcile)'
      FROM updated WHERE scoring = 'deferred'
    ON CONFLICT DO NOTHING
)
SELECT count(*) FROM updated
"""

# whose charges a lookup lists: the row's customer, else the subscription's
_CUSTOMER = """
SELECT coalesce(
    (SELECT customer_id FROM charge_attempts WHERE order_id = $1 AND billing_period = $2),
    (SELECT customer_id FROM subscriptions WHERE order_id = $1))
"""


# One `discrepancy` event per charge, not one per run every 15 minutes.
_REPORTED = """
SELECT EXISTS (SELECT 1 FROM charge_events
                WHERE order_id = $1 AND billing_period = $2 AND kind = 'discrepancy'
                  AND detail->>$3 = $4)
"""


class Republisher(Protocol):
    """The charges stream: where the consumer stands, and where lost messages go back to
    (the charges subject, with a fresh `Nats-Msg-Id`)."""

    async def position(self) -> Position:
        """The consumer's position in the stream now."""

    async def republish(self, body: bytes, msg_id: str, *, traceparent: str | None) -> int:
        """Publish, wait for the ack, return the stream sequence. The copy continues the
        trace its row names (`traceparent`), as every copy of a charge's message does."""


def stamp(moment: dt.datetime) -> str:
    """RFC 3339 in UTC, to the second."""
    return moment.astimezone(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def together(
    items: Iterable[T], work: Callable[[T], Awaitable[None]], *, limit: int = CONCURRENCY
) -> None:
    """`work` on every item, at most `limit` at once. The first error that escapes one
    (`work` reports a key's own errors itself) cancels the others and is raised as is."""
    gate, stopped = asyncio.Semaphore(limit), False

    async def one(item: T) -> None:
        nonlocal stopped
        async with gate:
            if stopped:  # cancelled already, but the slot came first
                return
            try:
                await work(item)
            except BaseException:
                stopped = True
                raise

    try:
        async with asyncio.TaskGroup() as group:
            for item in items:
                group.create_task(one(item))
    except BaseExceptionGroup as errors:
        raise _first(errors) from None


def _first(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    error = errors.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error


@dataclass
class Sweeper:
    """What every sweep of one run shares: the run's connection (holding its lock), the
    pool its keys are worked on from, the gateway, the publisher, the report, and the
    helpers that keep writes guarded."""

    conn: asyncpg.Connection
    pool: asyncpg.Pool
    gateway: Gateway
    publisher: Republisher
    report: Report
    quiet_s: float
    dry_run: bool = False
    progress: Callable[[str], None] = lambda _line: None
    concurrency: int = CONCURRENCY
    # settled (or, dry, that would be) by an earlier sweep of this run: not re-published
    settled: set[Key] = field(default_factory=set)
    # gateway charges reported for a person by an earlier sweep of this run
    unmatched: set[str] = field(default_factory=set)
    # keys a sweep of this run could not handle: reported once, not tried again
    failed: set[str] = field(default_factory=set)
    # succeeded rows whose charge a dry run saw (a real run records that on the row)
    shown: set[Key] = field(default_factory=set)
    # keys decided on a lookup by this run: once per run (bounded by the candidates)
    decided: set[Key] = field(default_factory=set)
    # the customer of keys the history showed, for lookups of keys with no row left
    customers: dict[Key, str] = field(default_factory=dict)
    # the waits before tries 2, 3, ... (`CHARGE_WORKER_RETRY_SCHEDULE`): what a decline
    # found leaves a period in, as the worker decides it (`retries.schedule.after_decline`)
    retry_schedule: tuple[float, ...] = ()

    @contextlib.contextmanager
    def each(self, sweep: Sweep, key: str) -> Iterator[None]:
        """One broken key is reported and skipped; an unreachable (or unconfigured)
        dependency ends the run. A span `reconcile.<sweep>` of the key while tracing."""
        attributes = {"charge_worker.key": key} if tracing.enabled() else None
        with tracing.span(f"reconcile.{sweep}", attributes):
            try:
                yield
            except (DependencyUnavailable, SettingsError) as error:
                tracing.failed(f"{type(error).__name__}: {error}")
                raise
            except ChargeWorkerError as error:
                self._failed(sweep, key, f"{type(error).__name__}: {error}")
            except (asyncpg.IntegrityConstraintViolationError, asyncpg.DataError) as error:
                self._failed(sweep, key, f"the ledger refused the write: {error}")

    def _failed(self, sweep: Sweep, key: str, error: str) -> None:
        tracing.failed(error)
        self.failed.add(key)
        self.report.fail(sweep, key, error)
        log.warning("reconcile.key_failed", sweep=sweep, key=key, error=error)

    def tick(self, what: str, done: int) -> None:
        """Progress on long sweeps, every `PROGRESS_EVERY` rows."""
        if done % PROGRESS_EVERY == 0:
            self.progress(f"reconcile: {what}: {done} rows")

    async def together(self, items: Iterable[T], work: Callable[[T], Awaitable[None]]) -> None:
        """`work` on every item, `concurrency` at a time."""
        await together(items, work, limit=self.concurrency)

    async def lookup(
        self,
        key: Key,
        customer: str | None = None,
        *,
        conn: Db | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        """Every charge the gateway holds for the key, counted in the report. Providers
        that list per customer (Stripe) get the key's: the one given, else the row's or the
        subscription's (read on `conn`, the caller's, when it holds one: a second
        connection per key would let as many keys as the pool has wait for ever), else the
        one the history showed. `since`: the caller knows none of the charges it asks about
        is older (`Gateway.lookup`)."""
        self.report.lookups += 1
        if customer is None:
            found = await (conn or self.pool).fetchval(_CUSTOMER, *key)
            customer = found or self.customers.get(key)
        return await patiently(self.gateway.lookup, *key, customer_id=customer, since=since)

    async def retrieve(self, charge_id: str) -> list[GatewayCharge]:
        """The charge `charge_id` as the gateway holds it now (none: it has no such
        charge), counted in the report as a lookup."""
        self.report.lookups += 1
        charge = await patiently(self.gateway.retrieve, charge_id)
        return [] if charge is None else [charge]

    async def refund(self, charge_id: str) -> str:
        """Refund a proven double in full (`Idempotency-Key: refund:<charge id>`); a span
        `reconcile.refund` while tracing."""
        attributes = {"charge_worker.charge_id": charge_id} if tracing.enabled() else None
        with tracing.span("reconcile.refund", attributes):
            refund_id = await patiently(self.gateway.refund, charge_id)
            if tracing.enabled():
                tracing.note({"charge_worker.refund_id": refund_id})
            return refund_id

    async def event(self, conn: Db, key: Key, kind: str, **detail: Any) -> None:
        """Append to the charge's story; losing an event never undoes what it records."""
        try:
            async with conn.transaction():  # a savepoint when inside a transaction
                await events.record(conn, *key, kind, ACTOR, **detail)  # type: ignore[arg-type]
        except (asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError):
            raise
        except asyncpg.PostgresError as error:
            key_ = idempotency_key(*key)
            log.warning("reconcile.event_lost", kind=kind, key=key_, error=str(error))

    async def settle(
        self,
        conn: Db,
        key: Key,
        attempt: int,
        status: str,
        *,
        charge_id: str | None,
        error: str | None,
        decline_code: str | None = None,
        retry_in_s: float | None = None,
        **detail: Any,
    ) -> bool:
        """The guarded write, with its `resolved` event; False if a worker took the row.
        A decline (`declined`, `retry_scheduled` due in `retry_in_s`, `action_required`)
        keeps its code and class."""
        klass = decline_class(decline_code) if status in DECLINE_STATES else None
        async with conn.transaction():
            updated = await conn.fetchval(
                _SETTLE, *key, attempt, status, charge_id, error, decline_code, klass, retry_in_s
            )
            if updated != 1:
                return False
            await self.event(conn, key, "resolved", status=status, charge_id=charge_id, **detail)
        self.settled.add(key)
        return True

    async def for_a_person(
        self,
        conn: Db,
        key: Key,
        ledger: proof.LedgerRow | None,
        charges: list[GatewayCharge],
    ) -> bool:
        """Report captured charges reconcile may neither refund nor record, for a person
        (once per run, one `discrepancy` event per charge ever); True if there are any.
        Those a person has reviewed (`reconcile resolve`) are reported as `reviewed`."""
        new = [c for c in charges if c.id not in self.unmatched]
        if not new:
            return bool(charges)
        self.unmatched.update(c.id for c in new)
        looked = await reviews.reviewed(conn, key, "unmatched", [c.id for c in new])
        if looked:
            described = {c.id: f"{c.id} {c.fingerprint}" for c in new}
            for finding in reviews.findings(key, "unmatched", described, looked):
                self.report.add("reviewed", finding)
            self.report.reviewed += len(looked)
            new = [c for c in new if c.id not in looked]
            if not new:
                return True
        self.report.counts.unmatched_charges += len(new)
        said = ledger.describe() if ledger else "no ledger row"
        detail = {"ledger": said, "charges": [f"{c.id} {c.fingerprint}" for c in new]}
        self.report.add("unmatched_charges", Finding(*key, "left for a person", detail))
        if self.dry_run:
            return True
        for charge in new:
            if not await conn.fetchval(_REPORTED, *key, "charge_id", charge.id):
                what = "captured at the gateway, not proven this key's charge: not refunded"
                await self.event(
                    conn,
                    key,
                    "discrepancy",
                    what=what,
                    charge_id=charge.id,
                    charge=charge.fingerprint,
                    ledger=said,
                )
        return True
