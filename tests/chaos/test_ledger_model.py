"""The ledger and the decisions as a state machine, against the real PostgreSQL ledger.

Three workers take deliveries of three orders' due charges and run the real `Pipeline`
(claim -> lookup-before-resend -> score -> charge -> record) on the real `Ledger`; the real
`decide()` turns each result into what JetStream would be told. Each order has one period
due at a time; once it is charged, or its declines end it, the next month's falls due, so
the machine never runs out of work. Scoring and the gateway are in-memory fakes whose every
call parks at a gate: hypothesis chooses which parked call goes on, what it comes to, and
when a worker dies (kill -9 at any gate: after its claim, before its request reaches the
gateway, or after the gateway charged but before the answer is recorded; it writes nothing
more and its leases stay until they expire).

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

Tries of a declined period (issue 37, docs/decisions/0007-retries.md): each order's card
answers every request that lands with a charge, or a decline of one class (`CARDS`:
`insufficient_funds` soft, `expired_card` customer action, `stolen_card` hard), and
hypothesis changes the card between any two steps. The workers run the pipeline with a
two-step retry schedule, so a period has three tries at most; the producer's real statement
(`retries.starts.start_due`, its clock past every `retry_at`, a 30-day cap of 2 or 8 tries)
starts due tries, once or twice in a row or twice at once, and from then on try `n`'s
message (`attempt` = the row's `current_try`, key `<o>:<p>:<n>`) may be delivered, as may
any earlier try's message again, which must change nothing.

Checked after every step: never two captured charges for one period, across every try's
key; a worker in a gateway call keeps its lease, and a timed-out request keeps the period
leased, until time passes; a charge request starts only under its caller's live lease
(neither expired nor taken over), for the period's current try, and try `n + 1` only once
try `n` is recorded declined and the period holds no money; no gateway call while another
on the period may be under way, none resent without a lookup in the same delivery; at the
gateway, no try's request before the previous try's decline, and none after a hard or
customer-action decline or the last try's; no more tries than the schedule has, nor more in
30 days than the cap; a period left declined, `retry_scheduled` or `action_required` has the
current try's decline at the gateway, no money and no call under way (an unknown outcome is
never followed by a new try), `retry_at` exactly while `retry_scheduled`, and its status as
its decline's class and try number say; every earlier try was a soft decline the gateway
gave; a call that reached the gateway is counted in the ledger, or its period is still
leased (by its caller, or by a worker that took the lease over and looks it up); a recorded
charge id is a real charge of the current try; a charge made without a verdict has a
deferred check; an ack only once the try's state is committed; a valid charge never
dead-lettered. At the end a worker that never crashes, with the producer run until no try
is due, drives every period home: `succeeded` on the first try its card did not decline
(charged once, with that charge's id, under a verdict), `declined` by a hard decline or the
last try's, `action_required` by a customer-action decline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import itertools
import sys
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Literal, TypeVar

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

from charge_worker.declines import decline_class
from charge_worker.errors import DependencyUnavailable, LeaseHeld, OutcomeUnknown, RateLimited
from charge_worker.gateway import ChargeResult, GatewayCharge
from charge_worker.ledger import Ledger
from charge_worker.messages import ChargeDue, idempotency_key
from charge_worker.retries.starts import Starts, start_due
from charge_worker.scoring import ScoringFailure, Verdict
from charge_worker.settings import CAP_WINDOW_S, LEASE_MARGIN_S
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
RETRY_SCHEDULE_S = (86400.0, 3 * 86400.0)  # the waits before tries 2 and 3
LAST_TRY = 1 + len(RETRY_SCHEDULE_S)
CAP_WINDOW = dt.timedelta(seconds=CAP_WINDOW_S)
# what an order's card answers a charge with: charged (None), or declined with a code of
# each class (soft, customer_action, hard)
CARDS = (None, "insufficient_funds", "expired_card", "stolen_card")
# what a declined try leaves the period in; with `succeeded`, a try's state once settled
AFTER_DECLINE = frozenset({"declined", "retry_scheduled", "action_required"})
ENDED = frozenset({"succeeded", "declined", "action_required"})  # nothing automatic follows
STATUSES = AFTER_DECLINE | {"scheduled", "pending", "succeeded"}  # what the model may lead to

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
SELECT c.order_id, c.billing_period, c.idempotency_key, c.status, c.gateway_charge_id,
       c.gateway_calls, c.scoring, c.lease_owner, c.attempt, c.current_try, c.retry_at,
       c.decline_code, c.decline_class, coalesce(c.try_started_at, c.created_at) AS started_at,
       EXISTS (SELECT FROM deferred_scoring_checks d
                WHERE (d.order_id, d.billing_period) = (c.order_id, c.billing_period))
           AS deferred_check
  FROM charge_attempts AS c
"""
_TRIES = """
SELECT order_id, billing_period, try_no, decline_code, decline_class, started_at
  FROM charge_tries ORDER BY order_id, billing_period, try_no
"""
_ROW = "SELECT {} FROM charge_attempts WHERE order_id = $1 AND billing_period = $2"
_LEASE = _ROW.format("lease_owner, attempt, current_try, lease_until > now() AS live")
_STATE = _ROW.format("status, current_try")
_TRIED = """
SELECT try_no, decline_class FROM charge_tries
 WHERE order_id = $1 AND billing_period = $2 ORDER BY try_no
"""
_EXPIRE = """
UPDATE charge_attempts SET lease_until = now() - interval '1 second'
 WHERE lease_until IS NOT NULL AND ($1::bigint IS NULL OR order_id = $1)
"""
_LAST_DUE = "SELECT greatest(max(retry_at), now()) FROM charge_attempts"

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


def due(order_id: int, month: dt.date, amount_minor: int = 99000, attempt: int = 1) -> ChargeDue:
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
            "attempt": attempt,
        },
        strict=False,
    )


def period_of(charge: ChargeDue) -> str:
    """The period's own key (try 1's): what the model keeps rows and requests by."""
    return idempotency_key(charge.order_id, charge.billing_period)


class FakeGateway:
    """docs/contracts/gateway.md in memory: every charge it made, and its idempotency store.
    Each order's card decides what a request that lands comes to (`cards`)."""

    def __init__(self) -> None:
        self.idempotent = True
        self.cards: dict[int, str | None] = {}  # order -> its card's decline code (None: pays)
        self.charges: list[GatewayCharge] = []
        self.replies: dict[str, ChargeResult] = {}  # Idempotency-Key -> the first answer
        self.requests: Counter[str] = Counter()  # POSTs that reached the gateway, per key
        # every POST that reached the gateway, in order, with the decline it met (None: none)
        self.sent: list[tuple[ChargeDue, str | None]] = []
        self.in_flight: list[ChargeDue] = []  # POSTs whose client gave up, still under way

    def process(self, charge: ChargeDue) -> ChargeResult:
        """A `POST /v1/charges` arriving: replay the key's first answer, or charge the card
        (try `n >= 2` carries `metadata.attempt`: the charge object's `attempt`)."""
        self.requests[charge.key] += 1
        if self.idempotent and (first := self.replies.get(charge.key)):
            self.sent.append((charge, first.decline_code))
            return dataclasses.replace(first, replayed=True)
        code = self.cards.get(charge.order_id)
        made = GatewayCharge(
            id=f"ch_{len(self.charges) + 1}",
            status="failed" if code else "succeeded",
            amount=charge.amount_minor,
            currency=charge.currency,
            customer=charge.customer_id,
            order_id=str(charge.order_id),
            billing_period=charge.billing_period.isoformat(),
            created=len(self.charges),
            decline_code=code,
            attempt=charge.attempt,
        )
        self.charges.append(made)
        self.sent.append((charge, code))
        if code:  # the contract's 402: no charge id in the answer, the code in its body
            answer = ChargeResult("declined", None, decline_code=code)
        else:
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
        """`GET /v1/charges` by order_id and billing_period: every try's charges."""
        wanted = (str(order_id), month.isoformat())
        return [c for c in self.charges if (c.order_id, c.billing_period) == wanted]

    def captured(self, period: str) -> list[GatewayCharge]:
        """The period's charges that took money, whichever try made them."""
        order_id, _, month = period.partition(":")
        found = self.lookup(int(order_id), dt.date.fromisoformat(month))
        return [c for c in found if c.status == "succeeded"]

    def declines(self, period: str, try_no: int) -> set[str | None]:
        """The decline codes of the period's try `try_no`'s failed charges."""
        order_id, _, month = period.partition(":")
        found = self.lookup(int(order_id), dt.date.fromisoformat(month))
        return {c.decline_code for c in found if c.status == "failed" and c.attempt == try_no}


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

    @property
    def period(self) -> str:
        return period_of(self.charge)

    def __str__(self) -> str:
        what = "conflicting payload" if self.conflicting else f"delivery {self.delivery}"
        return f"flight {self.id} ({self.worker}, {self.charge.key}, {what})"


@dataclasses.dataclass(frozen=True)
class Deliver:
    """JetStream delivers an order's due charge to a worker: at least once, to anyone, as
    the period's current try. `again`: the month before instead (a duplicate once that one
    is over); `back`: the message of that many tries before (a redelivery of an earlier try,
    which must change nothing)."""

    worker: str
    order_id: int
    again: bool = False
    back: int = 0


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
class CardIs:
    """From now on the order's card is charged (None), or declined with `code`."""

    order_id: int
    code: str | None


@dataclasses.dataclass(frozen=True)
class StartDue:
    """The producer's run starts the due tries (`start_due`, its clock past every
    `retry_at`), `limit` rows a batch: once, twice in a row, or two runs at once."""

    limit: int
    runs: Literal["once", "twice", "at_once"]


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
_fault = st.integers(0, 4)
_RUNS = ("once", "twice", "at_once")
# paying and a soft decline twice as likely as a customer-action or a hard one
_card = st.sampled_from((None, "insufficient_funds", *CARDS))


def _weighs(times: int, strategy: st.SearchStrategy[T]) -> list[st.SearchStrategy[T]]:
    """`strategy` as `times` branches of a `one_of`: it drops a branch equal to another
    (and `st.builds` answers equal arguments with the same object), so only a new object
    per repeat weighs."""
    return [strategy.map(_same) for _ in range(times)]


def _same(step: T) -> T:
    return step


# One rule draws every step, weighted by repeating a branch: with a rule per kind of step,
# hypothesis' swarm testing switches whole rules off per example, and without deliveries
# (half the examples, measured) nothing happens at all.
STEPS = st.one_of(
    *_weighs(8, st.builds(GoOn, st.integers(0, 3), st.one_of(*_weighs(2, st.none()), _fault))),
    *_weighs(3, st.builds(Deliver, _worker, _order)),
    st.builds(Deliver, _worker, _order, st.just(True)),
    st.builds(Deliver, _worker, _order, st.just(False), st.integers(1, 2)),
    st.builds(Conflicting, _worker, _order),
    st.builds(TimePasses, st.none() | _order, st.booleans(), st.booleans()),
    st.just(AWhilePasses()),
    st.builds(CardIs, _order, _card),
    *_weighs(2, st.builds(StartDue, st.integers(1, 3), st.sampled_from(_RUNS))),
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
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
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
    """Workers, a broker that delivers anything to anyone, a gateway, cards that decline,
    a producer that starts due tries, and passing time."""

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
        self.cap = 8  # CHARGE_WORKER_RETRY_CAP_30D
        self.produced_at: dt.datetime | None = None  # the producer's clock, never back
        self.month = dict.fromkeys(ORDERS, 0)  # each order's period due now, in MONTHS
        self.flights: dict[int, Flight] = {}
        self.ids = itertools.count(1)
        self.deliveries: Counter[str] = Counter()  # num_delivered of each try's message
        self.rows: dict[str, asyncpg.Record] = {}  # by period
        self.tries: dict[str, list[asyncpg.Record]] = {}  # each period's archived tries
        self.violations: list[str] = []
        self.homing = False  # the end: a worker that never crashes drives every period home

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def seen(self, what: str) -> None:
        """A hypothesis event, told apart when it happened on the way home."""
        event(f"{what} (home)" if self.homing else what)

    # ---- what happens next ---------------------------------------------------------------

    @initialize(
        idempotent=st.booleans(),
        policy=st.sampled_from(["defer", "hold"]),
        requests_before_charge=st.integers(0, 2),
        cards=st.tuples(*(_card for _ in ORDERS)),
        cap=st.sampled_from([2, 8]),
    )
    def configure(
        self,
        idempotent: bool,
        policy: str,
        requests_before_charge: int,
        cards: tuple[str | None, ...],
        cap: int,
    ) -> None:
        """A gateway with or without idempotency keys; scoring policy `defer` or `hold`; an
        adapter that makes 0..2 reads before its charge request (the contract adapter: none;
        Stripe: the customer, then maybe its cards); each order's card as the run begins; a
        30-day cap that postpones the last try (2) or never (8)."""
        self.gateway.idempotent = idempotent
        self.policy = policy
        self.requests_before_charge = requests_before_charge
        self.gateway.cards = dict(zip(ORDERS, cards, strict=True))
        self.cap = cap

    @rule(step=STEPS)
    def happens(
        self,
        step: Deliver | Conflicting | GoOn | CardIs | StartDue | AWhilePasses | TimePasses,
    ) -> None:
        """One thing happens in the world (see STEPS)."""
        match step:
            case Deliver(worker, order_id, again, back):
                month = MONTHS[max(self.month[order_id] - again, 0)]
                current = self._current_try(order_id, month)
                self._deliver(worker, due(order_id, month, attempt=max(current - back, 1)))
            case Conflicting(worker, order_id):
                month = MONTHS[self.month[order_id]]
                attempt = self._current_try(order_id, month)
                charge = due(order_id, month, amount_minor=1, attempt=attempt)
                if period_of(charge) in self.rows:  # before that it would be the first payload
                    self._start(worker, charge, 1, conflicting=True)
            case GoOn(flight, fault):
                self._go_on(flight, fault)
            case CardIs(order_id, code):
                note(f"order {order_id}'s card: {code or 'pays'}")
                self.gateway.cards[order_id] = code
            case StartDue(limit, runs):
                self._produce(limit, runs)
            case AWhilePasses():
                self.now += LEASE_S - LEASE_MARGIN_S  # short of every lease, by the margin
            case TimePasses(order_id, landed, forget):
                self._expire(order_id, landed=landed)
                if forget:
                    self.gateway.replies.clear()

    def _deliver(self, worker: str, charge: ChargeDue) -> None:
        self.deliveries[charge.key] += 1
        if charge.attempt >= self._current_try(charge.order_id, charge.billing_period):
            self._start(worker, charge, self.deliveries[charge.key])
            return
        # an earlier try's message again: answered "settled already", and nothing written
        before = self._row(charge)
        flight = self._start(worker, charge, self.deliveries[charge.key])
        assert flight.id not in self.flights, f"{flight}: an earlier try's message was claimed"
        assert flight.task is not None
        processed, action = flight.task.result()
        assert (processed.result.outcome, action) == (Outcome.DUPLICATE, Ack()), processed.result
        assert self._row(charge) == before, f"{flight}: an earlier try's message changed the row"
        event("an earlier try's message redelivered")

    def _produce(self, limit: int, runs: str) -> list[Starts]:
        """The producer's run starts due tries; each row it takes is started once, or
        postponed by the cap; nothing else changes."""
        before = dict(self.rows)
        latest = self.run(self.pool.fetchval(_LAST_DUE))
        at = max(latest, self.produced_at or latest) + dt.timedelta(seconds=1)
        self.produced_at = at

        async def producer() -> Starts:
            return await start_due(self.pool, limit, self.cap, now=at)

        async def produce() -> list[Starts]:
            if runs == "at_once":
                return list(await asyncio.gather(producer(), producer()))
            return [await producer() for _ in range(1 + (runs == "twice"))]

        done = self.run(produce())
        self._refresh()
        due_now = [p for p, r in before.items() if r["status"] == "retry_scheduled"]
        started = [p for p in due_now if self.rows[p]["current_try"] != before[p]["current_try"]]
        postponed = [p for p in due_now if self.rows[p]["retry_at"] != before[p]["retry_at"]]
        note(f"start_due x{len(done)} at {at:%m-%d %H:%M:%S}: {done}")
        self.seen(f"start_due: {'some' if started else 'no'} try started ({runs})")
        if postponed and not started:
            self.seen("start_due: a try postponed by the 30-day cap")
        assert sum(s.started for s in done) == len(started), (done, started)
        assert sum(s.postponed for s in done) == len(set(postponed) - set(started)), done
        assert min(limit, len(due_now)) <= sum(s.rows for s in done) <= len(due_now), done
        for period, row in self.rows.items():
            was = before.get(period)
            assert was is not None, f"{period}: a row the producer's start made"
            if period in started:
                assert row["current_try"] == was["current_try"] + 1, dict(row)
                assert row["status"] == "scheduled", dict(row)
            elif period in postponed:
                assert row["status"] == "retry_scheduled", dict(row)
                assert row["retry_at"] > at, dict(row)
            else:
                assert row["current_try"] == was["current_try"], dict(row)
                assert row["status"] == was["status"], dict(row)
        return done

    # ---- invariants ----------------------------------------------------------------------

    def _refresh(self) -> None:
        """The model's view of the ledger until the next step."""
        rows = self.run(self.pool.fetch(_ROWS))
        self.rows = {idempotency_key(r["order_id"], r["billing_period"]): r for r in rows}
        self.tries = defaultdict(list)
        if all(r["current_try"] == 1 for r in rows):  # no try archived: spare the statement
            return
        for tried in self.run(self.pool.fetch(_TRIES)):
            period = idempotency_key(tried["order_id"], tried["billing_period"])
            self.tries[period].append(tried)

    @invariant()
    def charged_at_most_once(self) -> None:
        assert not self.violations, self.violations
        self._refresh()
        periods = {period_of(c) for c, _ in self.gateway.sent}
        for period in self.rows.keys() | periods:
            charged = self.gateway.captured(period)
            assert len(charged) <= 1, f"{period} charged {len(charged)} times, across its tries"
            row = self.rows.get(period)
            assert row is not None, f"{period} sent to the gateway without a row"
            if self.gateway.requests[row["idempotency_key"]] > row["gateway_calls"]:
                # nobody may take it without a lookup
                assert row["lease_owner"] is not None, (
                    f"{period}: a call neither counted nor leased"
                )
            # a check outlives a declined try: the next try's verdict starts anew
            if row["scoring"] == "deferred" or row["current_try"] == 1:
                assert row["deferred_check"] == (row["scoring"] == "deferred"), dict(row)
            assert row["status"] in STATUSES, dict(row)
            if row["status"] == "succeeded":
                ids = {c.id: c.attempt for c in charged}
                assert ids.get(row["gateway_charge_id"]) == row["current_try"], (dict(row), ids)
            elif charged:
                event("a charge made and not yet recorded")
            self._check_tries(period, row)
        self._check_requests()
        # the lease outlives every call made under it: nobody else may act meanwhile
        for flight in self.flights.values():
            if flight.gate in ("send", "answer") and not flight.timed_out:
                row = self.rows[flight.period]
                lease = (row["lease_owner"], row["attempt"])
                assert lease == (flight.worker, flight.attempt), f"{flight} in its call: {lease}"
        for charge in self.gateway.in_flight:
            row = self.rows[period_of(charge)]
            assert row["lease_owner"] is not None, f"{charge.key} let go while a call is on"

    def _check_tries(self, period: str, row: asyncpg.Record) -> None:
        """A period's tries: as many as the schedule and the cap allow, each earlier one a
        soft decline the gateway gave, and the current one's state what its decline says."""
        current, status, tried = row["current_try"], row["status"], self.tries.get(period, [])
        assert current <= LAST_TRY, f"{period} at try {current}, past the schedule's"
        assert [t["try_no"] for t in tried] == list(range(1, current)), (dict(row), tried)
        for earlier in tried:
            code = earlier["decline_code"]
            assert (earlier["decline_class"], decline_class(code)) == ("soft", "soft"), earlier
            declines = self.gateway.declines(period, earlier["try_no"])
            assert code in declines, f"{period} try {earlier['try_no']}: {code} not in {declines}"
        starts = [t["started_at"] for t in tried] + [row["started_at"]]
        for first, beyond in zip(starts, starts[self.cap :], strict=False):
            assert beyond - first >= CAP_WINDOW, f"{period}: over {self.cap} tries in 30 days"
        if current > 1:
            self.seen(f"a period at try {current} ({status})")
        assert (row["retry_at"] is not None) == (status == "retry_scheduled"), dict(row)
        if status not in AFTER_DECLINE:
            return
        # what the try's decline says, and nothing of it still open: no money, no call on
        code, klass = row["decline_code"], row["decline_class"]
        assert code is not None, dict(row)
        assert klass == decline_class(code), dict(row)
        assert code in self.gateway.declines(period, current), (dict(row), self.gateway.charges)
        assert not self.gateway.captured(period), f"{period} {status} while holding money"
        assert not any(period_of(c) == period for c in self.gateway.in_flight), dict(row)
        expected = {
            "hard": "declined",
            "customer_action": "action_required",
            "soft": "declined" if current == LAST_TRY else "retry_scheduled",
        }
        assert status == expected[klass], f"{period} try {current} {code}: {status}"

    def _check_requests(self) -> None:
        """At the gateway, each period's requests go try by try: try `n + 1` only after try
        `n`'s decline, and nothing after a hard or customer-action decline, or the last
        try's."""
        nexts: dict[str, int] = defaultdict(lambda: 1)  # the try a request may be for
        ended: dict[str, str] = {}
        for charge, code in self.gateway.sent:
            period, n = period_of(charge), charge.attempt
            assert period not in ended, f"{charge.key} requested after {ended[period]}"
            assert n == nexts[period], f"{charge.key} requested while at try {nexts[period]}"
            if code is None:
                continue
            klass = decline_class(code)
            if klass != "soft":
                ended[period] = f"a {klass} decline ({code}) of try {n}"
            elif n == LAST_TRY:
                ended[period] = f"the last try's decline ({code})"
            else:
                nexts[period] = n + 1

    async def check_call_may_start(self, flight: Flight) -> None:
        """As a charge is sent: the caller holds a live lease on the period (not expired,
        not taken over) for the message's try, the period's current one, whose earlier tries
        are recorded declined and hold no money; no other call on the period is live (its
        lease would be), and a key called before was looked up first in this delivery."""
        key, period, charge = flight.charge.key, flight.period, flight.charge
        row = await self.pool.fetchrow(_LEASE, charge.order_id, charge.billing_period)
        assert row is not None
        if (row["lease_owner"], row["attempt"]) != (flight.worker, flight.attempt):
            lease = (row["lease_owner"], row["attempt"])
            self.violations.append(f"{flight} sends under a lease taken over: {lease}")
        elif not row["live"]:
            self.violations.append(f"{flight} sends under an expired lease")
        if row["current_try"] != charge.attempt:
            self.violations.append(
                f"{flight} sends while the period is at try {row['current_try']}"
            )
        if charge.attempt > 1:
            tried = await self.pool.fetch(_TRIED, charge.order_id, charge.billing_period)
            recorded = [t["try_no"] for t in tried if t["decline_class"] is not None]
            if recorded != list(range(1, charge.attempt)):
                self.violations.append(f"{flight} sends with earlier tries {recorded} declined")
            if self.gateway.captured(period):
                self.violations.append(f"{flight} sends while the period holds money")
            self.seen(f"try {charge.attempt} sent")
        for other in self.flights.values():
            live = other.gate in ("send", "answer") and not other.timed_out
            if live and other is not flight and other.period == period:
                self.violations.append(f"{flight} calls while {other} is in its call")
        if any(period_of(c) == period for c in self.gateway.in_flight):
            self.violations.append(f"{flight} calls while an earlier request is under way")
        calls = await self.row_value("gateway_calls", charge)
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

    def _row(self, charge: ChargeDue) -> dict[str, object] | None:
        row = self.run(self.pool.fetchrow(_ROW.format("*"), charge.order_id, charge.billing_period))
        return None if row is None else dict(row)

    def _current_try(self, order_id: int, month: dt.date) -> int:
        row = self.rows.get(idempotency_key(order_id, month))
        return 1 if row is None else int(row["current_try"])

    # ---- driving the flights -------------------------------------------------------------

    def _start(
        self, worker: str, charge: ChargeDue, delivery: int, *, conflicting: bool = False
    ) -> Flight:
        wake = self.loop.create_future()
        flight = Flight(next(self.ids), worker, charge, delivery, conflicting, wake)
        port = Port(self, flight, self.policy)
        # the port stands in for both clients; the rest is the worker's own pipeline
        pipeline = Pipeline(
            self.ledger,
            port,
            port,
            owner=worker,
            metrics=self.metrics,
            failpoints=Failpoints(),
            retry_schedule=RETRY_SCHEDULE_S,
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
        row = self.rows.get(flight.period)
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
        self.seen(f"try {charge.attempt}: {result.outcome.value}")
        row = self.run(self.pool.fetchrow(_STATE, charge.order_id, charge.billing_period))
        status = None if row is None else row["status"]
        if isinstance(action, Ack):  # only once the try's state is committed, or it is over
            acked = f"acked {result.outcome} of try {charge.attempt} while the row is {status}"
            assert row is not None, acked
            if result.outcome is Outcome.CHARGED:
                assert status == "succeeded", acked
            elif result.outcome is Outcome.DECLINED:
                assert processed.settlement is not None, result
                assert status == processed.settlement.status, acked
                self.seen(f"try {charge.attempt} declined: {status}")
            else:
                assert result.outcome is Outcome.DUPLICATE, result
                assert status in ENDED | {"retry_scheduled"} or row["current_try"] > charge.attempt
            assert row["current_try"] >= charge.attempt, acked
            if result.outcome is not Outcome.DUPLICATE:
                assert row["current_try"] == charge.attempt, acked
        else:
            assert result.outcome in RETRYABLE, result
        if isinstance(action, Requeue):  # a fresh copy: its deliveries unspent
            self.deliveries[charge.key] = 0
        month = self.month[charge.order_id]
        ended = result.outcome in (Outcome.CHARGED, Outcome.DECLINED) and status in ENDED
        if ended and charge.billing_period == MONTHS[month]:  # the next one falls due
            self.month[charge.order_id] = min(month + 1, len(MONTHS) - 1)

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

    # ---- the end: every period home ------------------------------------------------------

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
        """A worker that never crashes, facing a healthy world (the cards as they are), and
        the producer run until no try is due, take every period as far as its declines let."""
        periods = [(o, MONTHS[m]) for o in ORDERS for m in range(self.month[o] + 1)]
        self.homing = True
        for _ in range(2 * LAST_TRY + 2):  # a lookup, then each try, at most
            self.charged_at_most_once()
            for _ in range(2 * LAST_TRY):  # the producer's runs: due, postponed, due
                if not sum(s.rows for s in self._produce(10, "once")):
                    break
            waiting = [p for p in periods if self._status(*p) not in ENDED]
            if not waiting:
                break
            self._expire(None, landed=False)
            for order_id, month in waiting:
                charge = due(order_id, month, attempt=self._current_try(order_id, month))
                self.deliveries[charge.key] += 1
                flight = self._start("healer", charge, self.deliveries[charge.key])
                for _ in range(8):  # every gate a charge may park at, at most
                    if flight.gate is None:
                        break
                    self._resume(flight, ANSWERS[flight.gate][0])
                assert flight.id not in self.flights, f"{flight} stuck at {flight.gate}"
        self.charged_at_most_once()
        for order_id, month in periods:
            self._as_its_declines_say(idempotency_key(order_id, month))

    def _as_its_declines_say(self, period: str) -> None:
        """`succeeded` on the first try the card did not decline, charged once; `declined`
        by a hard decline or the last try's; `action_required` by a customer-action one."""
        row, charged = self.rows[period], self.gateway.captured(period)
        current, status = row["current_try"], row["status"]
        assert status in ENDED, dict(row)
        for try_no in range(1, current):  # each a soft decline at the gateway (invariant)
            assert not [c for c in charged if c.attempt == try_no], f"{period} try {try_no}"
        if charged:
            assert len(charged) == 1, f"{period} charged {len(charged)} times"
            assert (status, row["gateway_charge_id"]) == ("succeeded", charged[0].id), dict(row)
            assert charged[0].attempt == current, dict(row)
            assert row["gateway_calls"] >= 1, dict(row)
            assert row["scoring"] in ("approved", "deferred"), dict(row)  # a decline needs none
            event(f"home: succeeded on try {current}")
            return
        assert status != "succeeded", dict(row)
        code = row["decline_code"]
        assert code in self.gateway.declines(period, current), dict(row)
        event(f"home: {status} ({decline_class(code)}) on try {current}")
        if decline_class(code) == "soft":
            assert (status, current) == ("declined", LAST_TRY), f"{period}: not exhausted"

    def _status(self, order_id: int, month: dt.date) -> str | None:
        row = self.rows.get(idempotency_key(order_id, month))
        return None if row is None else str(row["status"])


MODEL_SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None)


@pytest.fixture
def model_database(database_url: str) -> Iterator[str]:
    """This test's fresh database, for the machines hypothesis builds without fixtures."""
    _database["url"] = database_url
    yield database_url
    _database.clear()


@pytest.mark.slow
@pytest.mark.timeout(600)  # passing takes ~30 s; shrinking a failure may take minutes
def test_the_ledger_charges_each_period_once_whatever_crashes_and_declines(
    model_database: str,
) -> None:
    run_state_machine_as_test(LedgerModel, settings=MODEL_SETTINGS)
