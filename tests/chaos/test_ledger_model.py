"""The ledger and the decisions as a state machine, against the real PostgreSQL ledger.

Three workers take deliveries of three orders' due charges and run the real `Pipeline`
(claim -> lookup-before-resend -> score -> charge -> record) on the real `Ledger`; the real
`decide()` turns each result into what JetStream would be told. Each order has one charge
due at a time; once it is charged, the next month's falls due, so the machine never runs
out of work. Scoring and the gateway are in-memory fakes whose every call parks at a gate:
hypothesis chooses which parked call goes on, what it comes to, and when a worker dies
(kill -9 at any gate: after its claim, before its request reaches the gateway, or after the
gateway charged but before the answer is recorded; it writes nothing more and its leases
stay until they expire).

The adapter's flavour is drawn too: 0-2 reads before its charge (the contract adapter:
none; Stripe: the customer, maybe its cards), each parked at a `read` gate, then the charge
request's rate-limit token at a `token` gate, and only then the pipeline's `before_send`
(issue 34 item 1). Time may pass while a flight waits at any of them, so its lease expires
or is taken over between the worker's last look and its request; time may also pass short
of expiry (`AWhilePasses`), so that a request may start only after a renewal.

The fake gateway follows docs/contracts/gateway.md: the same Idempotency-Key replays the first
answer, unless the gateway keeps no keys at all or has forgotten them, which leaves the
ledger as the only barrier. A request whose client timed out may still land. Time passes by
moving `lease_until` into the past, as the ledger's own tests do, and the workers' clock
past every lease they hold; every gateway request made under the leases it expires has then
landed or never will (DESIGN.md: a lease outlives the gateway timeout).

Checked after every step: never two effective charges for one key; a worker in a gateway
call keeps its lease, and a timed-out request keeps the key leased, until time passes; a
charge request starts only under its caller's live lease (neither expired nor taken over); no
gateway call while another on the key may be under way, none resent without a lookup in the
same delivery; a call that reached the gateway is counted in the ledger, or its key is still
leased (by its caller, or by a worker that took the lease over and looks it up); a recorded
charge id is a real charge; a charge made without a verdict has a deferred check; an ack only
once a final state is committed; a valid charge never dead-lettered. At the end a worker
that never crashes drives every key home: each is charged exactly once and `succeeded` with
that charge's id, under a verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import itertools
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import asyncpg
import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from prometheus_client import CollectorRegistry

from charge_worker.errors import DependencyUnavailable, LeaseHeld, OutcomeUnknown, RateLimited
from charge_worker.gateway import ChargeResult, GatewayCharge
from charge_worker.ledger import Ledger
from charge_worker.messages import ChargeDue
from charge_worker.scoring import ScoringFailure, Verdict
from charge_worker.settings import LEASE_MARGIN_S
from charge_worker.worker.decisions import Ack, Action, DeadLetter, Outcome, Policy, Requeue
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Delivery, Pipeline, Processed

T = TypeVar("T")

ORDERS = (101, 102, 103)
WORKERS = ("w1", "w2", "w3")
MONTHS = tuple(dt.date(2026, month, 1) for month in range(1, 13))
LEASE_S = 60.0
CALL_S = 1.0  # the fake gateway's charge deadline
MAX_DELIVER = 3  # small, so deliveries run out and messages are requeued
BACKOFF_S = (1.0, 5.0)
ACK_WAIT_S = 30.0
POLICY = Policy(MAX_DELIVER, BACKOFF_S, ACK_WAIT_S, lease_s=LEASE_S)

# What a parked call may come to when it goes on: the healthy answer, then the failures
# (a timeout twice: unknown outcomes are what the ledger is for).
ANSWERS = {
    "score": ("approve", "fail"),
    "lookup": ("answer", "fail"),
    "read": ("answer", "fail"),  # a read the adapter makes before its charge (its token too)
    "token": ("granted",),  # the charge request's rate-limit token: waited for, never refused
    "send": ("reach", "timeout", "refused", "timeout", "rate_limited"),
    "answer": ("deliver", "lose"),
}
RETRYABLE = frozenset(
    {Outcome.OUTCOME_UNKNOWN, Outcome.LEASE_HELD, Outcome.UNAVAILABLE, Outcome.RATE_LIMITED}
)

_ROWS = """
SELECT c.idempotency_key, c.status, c.gateway_charge_id, c.gateway_calls, c.scoring,
       c.lease_owner, c.attempt,
       EXISTS (SELECT FROM deferred_scoring_checks d
                WHERE (d.order_id, d.billing_period) = (c.order_id, c.billing_period))
           AS deferred_check
  FROM charge_attempts AS c
"""
_ROW = "SELECT {} FROM charge_attempts WHERE order_id = $1 AND billing_period = $2"
_LEASE = _ROW.format("lease_owner, attempt, lease_until > now() AS live")
_EXPIRE = """
UPDATE charge_attempts SET lease_until = now() - interval '1 second'
 WHERE lease_until IS NOT NULL AND ($1::bigint IS NULL OR order_id = $1)
"""

_database: dict[str, str] = {}  # this test's database, for the machines hypothesis builds


async def _clean_pool(url: str) -> asyncpg.Pool:
    """A small pool on the test's database, every ledger table emptied: a clean example."""
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
    assert pool is not None
    await pool.execute(
        "TRUNCATE charge_attempts, charge_tries, deferred_scoring_checks, charge_events,"
        " charge_outcomes"
    )
    return pool


def due(order_id: int, month: dt.date, amount_minor: int = 99000) -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": month,
            "subscription_id": f"sub_{order_id}",
            "customer_id": f"cus_{order_id}",
            "amount_minor": amount_minor,
            "currency": "RUB",
            "due_at": dt.datetime.combine(month, dt.time(), dt.UTC),
        },
        strict=False,
    )


class FakeGateway:
    """docs/contracts/gateway.md in memory: every charge it made, and its idempotency store."""

    def __init__(self) -> None:
        self.idempotent = True
        self.charges: list[GatewayCharge] = []
        self.replies: dict[str, ChargeResult] = {}  # Idempotency-Key -> the first answer
        self.requests: Counter[str] = Counter()  # POSTs that reached the gateway, per key
        self.in_flight: list[ChargeDue] = []  # POSTs whose client gave up, still under way

    def process(self, charge: ChargeDue) -> ChargeResult:
        """A `POST /v1/charges` arriving: replay the key's first answer, or charge."""
        self.requests[charge.key] += 1
        if self.idempotent and (first := self.replies.get(charge.key)):
            return dataclasses.replace(first, replayed=True)
        made = GatewayCharge(
            id=f"ch_{len(self.charges) + 1}",
            status="succeeded",
            amount=charge.amount_minor,
            currency=charge.currency,
            customer=charge.customer_id,
            order_id=str(charge.order_id),
            billing_period=charge.billing_period.isoformat(),
            created=len(self.charges),
        )
        self.charges.append(made)
        answer = ChargeResult("succeeded", made.id)
        if self.idempotent:
            self.replies[charge.key] = answer
        return answer

    def time_passes(self, order_id: int | None, *, landed: bool) -> None:
        """Requests still under way for this order (or all) have landed, or never will."""
        still = []
        for charge in self.in_flight:
            if order_id not in (None, charge.order_id):
                still.append(charge)
            elif landed:
                self.process(charge)
        self.in_flight = still

    def lookup(self, order_id: int, month: dt.date) -> list[GatewayCharge]:
        wanted = (str(order_id), month.isoformat())
        return [c for c in self.charges if (c.order_id, c.billing_period) == wanted]

    def effective(self, key: str) -> list[GatewayCharge]:
        order_id, _, month = key.partition(":")
        found = self.lookup(int(order_id), dt.date.fromisoformat(month))
        return [c for c in found if c.status == "succeeded"]


async def _consume(pipeline: Pipeline, delivery: Delivery) -> tuple[Processed, Action]:
    """What a consumer does with one delivery, up to telling JetStream: process, decide, record."""
    concluded = await pipeline.conclude(delivery, POLICY)
    return concluded.processed, concluded.action


@dataclasses.dataclass(eq=False, repr=False)
class Flight:
    """One delivery in one worker, parked at a gate until the machine lets it go on."""

    id: int
    worker: str
    charge: ChargeDue
    delivery: int
    conflicting: bool
    wake: asyncio.Future[None]  # resolved when the flight parks
    task: asyncio.Task[tuple[Processed, Action]] | None = None
    gate: str | None = None
    go: asyncio.Future[str] | None = None
    looked_up: bool = False
    timed_out: bool = False  # its lease expired mid-call: the answer is lost
    attempt: int | None = None  # the fence of its claim

    def __str__(self) -> str:
        what = "conflicting payload" if self.conflicting else f"delivery {self.delivery}"
        return f"flight {self.id} ({self.worker}, {self.charge.key}, {what})"


@dataclasses.dataclass(frozen=True)
class Deliver:
    """JetStream delivers an order's due charge to a worker: at least once, to anyone.
    `again`: the month before instead (a duplicate once that one is final)."""

    worker: str
    order_id: int
    again: bool = False


@dataclasses.dataclass(frozen=True)
class Conflicting:
    """The due charge's key with another amount: dead-lettered, nothing written."""

    worker: str
    order_id: int


@dataclasses.dataclass(frozen=True)
class GoOn:
    """A parked call goes on. `flight` picks one of the parked flights (by age, modulo
    their number); `fault` None: the healthy answer; 0: the worker dies right there (kill
    -9: all its deliveries stop, its leases stay); else one of the failures the gate
    allows (ANSWERS, modulo their number)."""

    flight: int
    fault: int | None


@dataclasses.dataclass(frozen=True)
class AWhilePasses:
    """The workers' clock moves on far enough that no lease they hold outlives a charge
    request any more, though none has expired: a request may start only after a renewal."""


@dataclasses.dataclass(frozen=True)
class TimePasses:
    """Leases expire (all, or one order's); gateway requests under them have landed or
    never will (`landed`); with `forget`, the gateway's key retention ran out too, so a
    repeated key is a new charge."""

    order_id: int | None
    landed: bool
    forget: bool


_worker, _order = st.sampled_from(WORKERS), st.sampled_from(ORDERS)
_go_on = st.builds(GoOn, st.integers(0, 3), st.none() | st.integers(0, 4))
_deliver = st.builds(Deliver, _worker, _order)
# One rule draws every step, weighted by repeating a branch: with a rule per kind of step,
# hypothesis' swarm testing switches whole rules off per example, and without deliveries
# (half the examples, measured) nothing happens at all.
STEPS = st.one_of(
    _go_on,
    _go_on,
    _go_on,
    _deliver,
    _deliver,
    st.builds(TimePasses, st.none() | _order, st.booleans(), st.booleans()),
    st.just(AWhilePasses()),
    st.builds(Deliver, _worker, _order, st.just(True)),
    st.builds(Conflicting, _worker, _order),
)


class Port:
    """One flight's scoring service and gateway; each call parks at its gate."""

    charge_deadline_s = CALL_S

    def __init__(self, model: LedgerModel, flight: Flight, policy: str) -> None:
        self.model = model
        self.flight = flight
        self.policy = policy

    async def score(self, **_: object) -> Verdict | ScoringFailure:
        if await self._park("score") == "approve":
            return Verdict("approve", 0.1)
        return ScoringFailure("scoring timed out")

    async def lookup(
        self, order_id: int, billing_period: dt.date, *, customer_id: str | None = None
    ) -> list[GatewayCharge]:
        found = self.model.gateway.lookup(order_id, billing_period)  # answered later
        if await self._park("lookup") == "fail":
            raise OutcomeUnknown("gateway GET /v1/charges: timeout")
        self.flight.looked_up = True
        return found

    async def charge(
        self,
        charge: ChargeDue,
        *,
        traceparent: str | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> ChargeResult:
        # the adapter's reads first (Stripe: the customer, its cards), each with its token,
        # then the charge request's own token: time may pass at any of them, and leases
        # expire or are taken over, before the request that can move money starts
        for _ in range(self.model.requests_before_charge):
            if await self._park("read") == "fail":
                raise OutcomeUnknown("gateway GET /v1/customers: timeout")
        await self._park("token")
        if before_send is not None:
            if await self.model.lease_lapsed(self.flight):
                event("the charge request's lease lapsed while it waited")
            try:
                await before_send()
            except LeaseHeld:
                event("before_send refused: the lease was taken over")
                raise
        await self.model.check_call_may_start(self.flight)
        how = await self._park("send")
        if self.flight.timed_out:  # landed or not when time passed; no late arrival
            raise OutcomeUnknown("gateway POST /v1/charges: timeout")
        if how == "refused":
            raise DependencyUnavailable("gateway unreachable: connection refused")
        if how == "rate_limited":
            raise RateLimited("gateway 429", retry_after_s=1.0)
        if how == "timeout":  # the request may land later, while the lease still holds
            self.model.gateway.in_flight.append(charge)
            raise OutcomeUnknown("gateway POST /v1/charges: timeout")
        answer = self.model.gateway.process(charge)
        if await self._park("answer") == "lose" or self.flight.timed_out:
            raise OutcomeUnknown("gateway POST /v1/charges: charged, answer lost")
        return answer

    async def _park(self, gate: str) -> str:
        flight = self.flight
        if flight.attempt is None:  # the first call after the claim: the row is ours
            flight.attempt = await self.model.row_value("attempt", flight.charge)
        flight.gate, flight.go = gate, asyncio.get_running_loop().create_future()
        flight.wake.set_result(None)
        how = await flight.go
        flight.gate = None
        return how


class LedgerModel(RuleBasedStateMachine):
    """Workers, a broker that delivers anything to anyone, a gateway, and passing time."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.pool = self.run(_clean_pool(_database["url"]))
        self.now = 0.0  # the workers' clock: moves when time passes
        self.ledger = Ledger(self.pool, lease_s=LEASE_S, clock=lambda: self.now)
        self.metrics = Metrics(CollectorRegistry())
        self.gateway = FakeGateway()
        self.policy = "defer"
        self.requests_before_charge = 0
        self.month = dict.fromkeys(ORDERS, 0)  # each order's charge due now, in MONTHS
        self.flights: dict[int, Flight] = {}
        self.ids = itertools.count(1)
        self.deliveries: Counter[str] = Counter()  # num_delivered of each charge's message
        self.rows: dict[str, asyncpg.Record] = {}
        self.violations: list[str] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # ---- what happens next ---------------------------------------------------------------

    @initialize(
        idempotent=st.booleans(),
        policy=st.sampled_from(["defer", "hold"]),
        requests_before_charge=st.integers(0, 2),
    )
    def configure(self, idempotent: bool, policy: str, requests_before_charge: int) -> None:
        """A gateway with or without idempotency keys; scoring policy `defer` or `hold`; an
        adapter that makes 0..2 reads before its charge request (the contract adapter: none;
        Stripe: the customer, then maybe its cards)."""
        self.gateway.idempotent = idempotent
        self.policy = policy
        self.requests_before_charge = requests_before_charge

    @rule(step=STEPS)
    def happens(self, step: Deliver | Conflicting | GoOn | AWhilePasses | TimePasses) -> None:
        """One thing happens in the world (see STEPS)."""
        match step:
            case Deliver(worker, order_id, again):
                charge = due(order_id, MONTHS[max(self.month[order_id] - again, 0)])
                self.deliveries[charge.key] += 1
                self._start(worker, charge, self.deliveries[charge.key])
            case Conflicting(worker, order_id):
                charge = due(order_id, MONTHS[self.month[order_id]], amount_minor=1)
                if charge.key in self.rows:  # before that it would be the first payload
                    self._start(worker, charge, 1, conflicting=True)
            case GoOn(flight, fault):
                self._go_on(flight, fault)
            case AWhilePasses():
                self.now += LEASE_S - LEASE_MARGIN_S  # short of every lease, by the margin
            case TimePasses(order_id, landed, forget):
                self._expire(order_id, landed=landed)
                if forget:
                    self.gateway.replies.clear()

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def charged_at_most_once(self) -> None:
        assert not self.violations, self.violations
        # also the model's view of the ledger until the next step
        self.rows = {r["idempotency_key"]: r for r in self.run(self.pool.fetch(_ROWS))}
        for key in self.rows.keys() | self.gateway.requests.keys():
            charged = self.gateway.effective(key)
            assert len(charged) <= 1, f"{key} charged {len(charged)} times"
            row, requests = self.rows.get(key), self.gateway.requests[key]
            assert row is not None, f"{key} sent to the gateway without a row"
            if requests > row["gateway_calls"]:  # nobody may take it without a lookup
                assert row["lease_owner"] is not None, f"{key}: a call neither counted nor leased"
            assert row["deferred_check"] == (row["scoring"] == "deferred"), dict(row)
            assert row["status"] in ("pending", "succeeded"), dict(row)
            if row["status"] == "succeeded":
                assert row["gateway_charge_id"] in {c.id for c in charged}, dict(row)
            elif charged:
                event("a charge made and not yet recorded")
        # the lease outlives every call made under it: nobody else may act meanwhile
        for flight in self.flights.values():
            if flight.gate in ("send", "answer") and not flight.timed_out:
                row = self.rows[flight.charge.key]
                lease = (row["lease_owner"], row["attempt"])
                assert lease == (flight.worker, flight.attempt), f"{flight} in its call: {lease}"
        for charge in self.gateway.in_flight:
            row = self.rows[charge.key]
            assert row["lease_owner"] is not None, f"{charge.key} let go while a call is on"

    async def check_call_may_start(self, flight: Flight) -> None:
        """As a charge is sent: the caller holds a live lease on the key (not expired, not
        taken over), no other call on the key is live (its lease would be), and a key called
        before was looked up first in this delivery."""
        key = flight.charge.key
        row = await self.pool.fetchrow(_LEASE, flight.charge.order_id, flight.charge.billing_period)
        assert row is not None
        if (row["lease_owner"], row["attempt"]) != (flight.worker, flight.attempt):
            lease = (row["lease_owner"], row["attempt"])
            self.violations.append(f"{flight} sends under a lease taken over: {lease}")
        elif not row["live"]:
            self.violations.append(f"{flight} sends under an expired lease")
        for other in self.flights.values():
            live = other.gate in ("send", "answer") and not other.timed_out
            if live and other is not flight and other.charge.key == key:
                self.violations.append(f"{flight} calls while {other} is in its call")
        if any(c.key == key for c in self.gateway.in_flight):
            self.violations.append(f"{flight} calls while an earlier request is under way")
        calls = await self.row_value("gateway_calls", flight.charge)
        if (calls or self.gateway.requests[key]) and not flight.looked_up:
            self.violations.append(f"{flight}: a call resent without a lookup")

    async def lease_lapsed(self, flight: Flight) -> bool:
        """The flight's lease has expired or was taken over (as it is about to send)."""
        row = await self.pool.fetchrow(_LEASE, flight.charge.order_id, flight.charge.billing_period)
        assert row is not None
        return not row["live"] or (row["lease_owner"], row["attempt"]) != (
            flight.worker,
            flight.attempt,
        )

    async def row_value(self, column: str, charge: ChargeDue) -> int:
        sql = _ROW.format(column)
        return int(await self.pool.fetchval(sql, charge.order_id, charge.billing_period))

    # ---- driving the flights -------------------------------------------------------------

    def _start(
        self, worker: str, charge: ChargeDue, delivery: int, *, conflicting: bool = False
    ) -> Flight:
        wake = self.loop.create_future()
        flight = Flight(next(self.ids), worker, charge, delivery, conflicting, wake)
        port = Port(self, flight, self.policy)
        # the port stands in for both clients; the rest is the worker's own pipeline
        pipeline = Pipeline(
            self.ledger, port, port, owner=worker, metrics=self.metrics, failpoints=Failpoints()
        )
        message = Delivery(charge.to_json(), stream_seq=flight.id, num_delivered=delivery)
        flight.task = self.loop.create_task(_consume(pipeline, message))
        self.flights[flight.id] = flight
        self._run(flight)
        return flight

    def _go_on(self, index: int, fault: int | None) -> None:
        parked = [f for f in self.flights.values() if f.gate is not None]
        if not parked:
            return
        flight = parked[index % len(parked)]
        assert flight.gate is not None
        if fault == 0:
            note(f"{flight.worker} is killed while {flight} waits on {flight.gate}")
            self._kill([f for f in self.flights.values() if f.worker == flight.worker])
            return
        answers = ANSWERS[flight.gate]
        failures = answers[1:]
        answer = failures[(fault - 1) % len(failures)] if fault and failures else answers[0]
        row = self.rows.get(flight.charge.key)
        if stale := (row is not None and (flight.attempt or 0) < row["attempt"]):
            event("a flight goes on after its lease was taken over")
        note(f"{flight}: the {flight.gate} call goes on: {answer}{' (taken over)' * stale}")
        self._resume(flight, answer)

    def _resume(self, flight: Flight, how: str) -> None:
        assert flight.go is not None
        flight.wake = self.loop.create_future()
        flight.go.set_result(how)
        self._run(flight)

    def _run(self, flight: Flight) -> None:
        """Run one flight, alone, until it parks at its next gate or finishes."""
        assert flight.task is not None
        self.run(asyncio.wait({flight.task, flight.wake}, return_when=asyncio.FIRST_COMPLETED))
        if not flight.task.done():
            note(f"{flight}: parked at {flight.gate}")
            return
        del self.flights[flight.id]
        self._settled(flight, *flight.task.result())

    def _settled(self, flight: Flight, processed: Processed, action: Action) -> None:
        """What the consumer would tell JetStream, and whether it may say so."""
        result, charge = processed.result, flight.charge
        note(f"{flight}: {result.outcome.value} ({result.error or 'final'}) -> {action}")
        assert result.outcome is not Outcome.CRASHED, result.error
        event(f"outcome {result.outcome.value}, lookup {processed.notes.get('lookup', '-')}")
        event(f"action {type(action).__name__}")
        if processed.claim is not None and processed.claim.taken_from is not None:
            event("an expired lease taken over")
        if flight.conflicting:
            assert action == DeadLetter("conflict"), result
            return
        assert not isinstance(action, DeadLetter), f"a valid charge dead-lettered: {result}"
        if isinstance(action, Ack):
            status = self.run(self.ledger.status_of(charge.order_id, charge.billing_period))
            assert status == "succeeded", f"acked {result.outcome} while the row is {status}"
            assert result.outcome in (Outcome.CHARGED, Outcome.DUPLICATE), result
        else:
            assert result.outcome in RETRYABLE, result
        if isinstance(action, Requeue):  # a fresh copy: its deliveries unspent
            self.deliveries[charge.key] = 0
        month = self.month[charge.order_id]
        if result.outcome is Outcome.CHARGED and charge.billing_period == MONTHS[month]:
            self.month[charge.order_id] = min(month + 1, len(MONTHS) - 1)  # next one falls due

    def _kill(self, flights: list[Flight]) -> None:
        tasks = {f.task for f in flights if f.task is not None}
        if not tasks:
            return
        for task in tasks:
            task.cancel()
        self.run(asyncio.wait(tasks))
        for flight in flights:
            assert flight.task is not None
            assert flight.task.cancelled(), "a killed worker went on working"
            del self.flights[flight.id]

    def _expire(self, order_id: int | None, *, landed: bool) -> None:
        """Leases expire; every gateway request made under them has landed or never will."""
        for flight in self.flights.values():
            if flight.gate not in ("send", "answer") or flight.timed_out:
                continue
            if order_id in (None, flight.charge.order_id):
                if flight.gate == "send" and landed:
                    self.gateway.process(flight.charge)
                flight.timed_out = True
        self.gateway.time_passes(order_id, landed=landed)
        self.run(self.pool.execute(_EXPIRE, order_id))
        self.now += LEASE_S  # past every lease held: a worker that wakes may not call

    # ---- the end: every key home ---------------------------------------------------------

    def teardown(self) -> None:
        try:
            if sys.exc_info()[1] is None:  # after a failed step, report that step alone
                self._kill(list(self.flights.values()))
                self._drive_home()
        finally:
            self._close()

    def _close(self) -> None:
        """Close the pool and the loop, even after a step was interrupted mid-statement."""
        if tasks := asyncio.all_tasks(self.loop):
            for task in tasks:
                task.cancel()
            self.run(asyncio.wait(tasks, timeout=5))
        try:
            self.run(asyncio.wait_for(self.pool.close(), timeout=5))
        except TimeoutError:  # a connection still held by a task cut off mid-statement
            self.pool.terminate()
            self.run(asyncio.sleep(0))
        self.loop.close()

    def _drive_home(self) -> None:
        """A worker that never crashes, facing a healthy world, finishes every due charge."""
        charges = [due(o, MONTHS[m]) for o in ORDERS for m in range(self.month[o] + 1)]
        for _ in range(3):
            self.charged_at_most_once()
            waiting = [c for c in charges if self._status(c.key) != "succeeded"]
            if not waiting:
                break
            self._expire(None, landed=False)
            for charge in waiting:
                self.deliveries[charge.key] += 1
                flight = self._start("healer", charge, self.deliveries[charge.key])
                for _ in range(8):  # every gate a charge may park at, at most
                    if flight.gate is None:
                        break
                    self._resume(flight, ANSWERS[flight.gate][0])
                assert flight.id not in self.flights, f"{flight} stuck at {flight.gate}"
        self.charged_at_most_once()
        for charge in charges:
            made, row = self.gateway.effective(charge.key), self.rows[charge.key]
            assert len(made) == 1, f"{charge.key} charged {len(made)} times"
            assert (row["status"], row["gateway_charge_id"]) == ("succeeded", made[0].id)
            assert row["gateway_calls"] >= 1, dict(row)
            assert row["scoring"] in ("approved", "deferred"), dict(row)

    def _status(self, key: str) -> str | None:
        row = self.rows.get(key)
        return None if row is None else str(row["status"])


MODEL_SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None)


@pytest.fixture
def model_database(database_url: str) -> Iterator[str]:
    """This test's fresh database, for the machines hypothesis builds without fixtures."""
    _database["url"] = database_url
    yield database_url
    _database.clear()


@pytest.mark.slow
@pytest.mark.timeout(600)  # passing takes ~20 s; shrinking a failure may take minutes
def test_the_ledger_charges_each_key_once_whatever_crashes(model_database: str) -> None:
    run_state_machine_as_test(LedgerModel, settings=MODEL_SETTINGS)
