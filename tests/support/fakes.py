"""In-memory fakes of the worker's ports, for unit tests of its logic on a fake clock.

As procrastinate's `InMemoryConnector` and httpx's `MockTransport` do, each fake implements a
port of our own, injected where the real adapter would be; nothing is monkeypatched:

| fake              | stands in for                                    | port                  |
|-------------------|--------------------------------------------------|-----------------------|
| `InMemoryLedger`  | `ledger.Ledger` (PostgreSQL)                     | `pipeline.LedgerPort` |
| `FakeGateway`     | the gateway, behind the real `ContractGateway`   | `httpx.MockTransport` |
| `FakeScoring`     | scoring, behind the real `ScoringClient`         | `httpx.MockTransport` |
| `FakeMessage`     | a JetStream message (nats-py's `Msg`)            | `consumer.Message`    |
| `FakeDeadLetters` | `dlq.DeadLetters` (JetStream)                    | `consumer.HandOver`   |

The ledger keeps the rules of `ledger.py`'s SQL (one row per `(order_id, billing_period)`;
a claim inserts it, or takes over a `scheduled` row, an expired lease, or with a replay a
`failed` row; every later write fenced by owner and attempt), on one `FakeClock` that both
dates the leases and is the worker's clock. The gateway answers as docs/contracts/gateway.md
says (idempotency keys replayed, `key_reused`, declines, lookups), with scripted faults.
The real adapters (`ContractGateway`, `ScoringClient`) run over them unchanged.
Integration tests (tests/integration/test_ledger.py, test_worker*.py) keep the servers'
own semantics honest: SQL, JetStream, sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import itertools
import json
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import httpx
import nats.errors
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from charge_worker import events
from charge_worker.errors import (
    AlreadySettled,
    DependencyUnavailable,
    LeaseHeld,
    PayloadConflict,
    Unverified,
)
from charge_worker.gateway import ContractGateway
from charge_worker.ledger import NOTHING_ATTEMPTED, Attempted, Claim, Settlement
from charge_worker.messages import ChargeDue
from charge_worker.scoring import ScoringClient
from charge_worker.settings import GatewaySettings, ScoringSettings
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Pipeline
from tests.support import harness

PERIOD = harness.PERIOD
LEASE_S = 30.0
GATEWAY_URL = "https://gateway.test"
SCORING_URL = "https://scoring.test"
API_KEY = "sk_test_fake"


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def due(order_id: int = 1, customer: str = "cus_ok", amount: int = 99000) -> ChargeDue:
    """A due charge of `PERIOD`: the harness's message body, parsed."""
    return ChargeDue.model_validate_json(harness.due(order_id, customer, amount))


# ---- the ledger -----------------------------------------------------------------------------


@dataclass
class Row:
    """One `charge_attempts` row, the columns the worker reads or writes."""

    order_id: int
    billing_period: dt.date
    fingerprint: str
    status: str
    lease_owner: str | None = None
    lease_until: float | None = None
    attempt: int = 0
    gateway_calls: int = 0
    scoring: str | None = None
    gateway_charge_id: str | None = None
    last_error: str | None = None
    decline_code: str | None = None
    settled: bool = False
    last_stream_seq: int | None = None
    nak_delivery: int | None = None  # the delivery that nak'd last (`retry_later`)
    published_seq: int = 0
    current_try: int = 1
    retry_in_s: float | None = None  # `retry_scheduled`: the wait the settle set


@dataclass(frozen=True)
class Event:
    """One `charge_events` row."""

    key: tuple[int, dt.date]
    kind: str
    actor: str
    detail: dict[str, Any]


class InMemoryLedger:
    """`ledger.Ledger`'s rules in memory (see the module docstring).

    `down` names operations that fail as PostgreSQL being away would (`DependencyUnavailable`);
    `verified` (None: verification off) says whether a subscription agrees with a charge that
    has no row yet, as `CHARGE_WORKER_VERIFY_SUBSCRIPTION=match` does."""

    def __init__(
        self,
        clock: FakeClock,
        *,
        lease_s: float = 30.0,
        verified: Callable[[ChargeDue], bool] | None = None,
    ) -> None:
        self.clock = clock
        self.lease_s = lease_s
        self.verified = verified
        self.rows: dict[tuple[int, dt.date], Row] = {}
        self.events: list[Event] = []
        self.deferred: dict[tuple[int, dt.date], str] = {}  # deferred scoring checks: reason
        self.down: set[str] = set()

    # ---- what tests set up and read -------------------------------------------------------

    def schedule(self, charge: ChargeDue) -> Row:
        """The producer's `scheduled` row, before its message is published."""
        row = Row(charge.order_id, charge.billing_period, charge.fingerprint, "scheduled")
        self.rows[charge.order_id, charge.billing_period] = row
        return row

    def row(self, charge: ChargeDue) -> Row:
        return self.rows[charge.order_id, charge.billing_period]

    def story(self, charge: ChargeDue) -> list[dict[str, Any]]:
        """The details of the charge's `delivery` events, oldest first."""
        key = (charge.order_id, charge.billing_period)
        return [e.detail for e in self.events if e.key == key and e.kind == "delivery"]

    # ---- the port -------------------------------------------------------------------------

    async def claim(
        self, charge: ChargeDue, owner: str, stream_seq: int, *, revive_failed: bool = False
    ) -> Claim:
        self._unless_down("claim")
        key = (charge.order_id, charge.billing_period)
        now = self.clock()
        deadline = now + self.lease_s
        row = self.rows.get(key)
        if row is None:
            if charge.attempt > 1:
                raise Unverified(f"{charge.key}: try {charge.attempt} of a period with no row")
            if self.verified is not None and not self.verified(charge):
                raise Unverified(f"{charge.key}: no active subscription says so")
            row = Row(*key, charge.fingerprint, "pending", owner, deadline, attempt=1)
            row.last_stream_seq = stream_seq
            self.rows[key] = row
            return Claim(*key, owner, 1, 0, None, None, deadline)
        expired = row.lease_until is None or row.lease_until < now
        this_try = row.fingerprint == charge.fingerprint and row.current_try == charge.attempt
        if this_try and (
            row.status == "scheduled"
            or (row.status == "pending" and expired)
            or (revive_failed and row.status == "failed")
        ):
            taken_from = row.lease_owner
            # a nak counts for this delivery only if it was this message's
            nak = row.nak_delivery if row.last_stream_seq == stream_seq else None
            row.status, row.lease_owner, row.lease_until = "pending", owner, deadline
            row.attempt += 1
            row.last_stream_seq = stream_seq
            scoring: Any = row.scoring
            return Claim(
                *key, owner, row.attempt, row.gateway_calls, scoring, taken_from, deadline, nak
            )
        if row.fingerprint != charge.fingerprint:
            raise PayloadConflict(
                f"{charge.key} is recorded as '{row.fingerprint}', "
                f"message says '{charge.fingerprint}'"
            )
        if charge.attempt < row.current_try:
            raise AlreadySettled(f"{charge.key}: the period is at try {row.current_try}")
        if charge.attempt > row.current_try:
            raise Unverified(f"{charge.key}: try {charge.attempt} was never started")
        if row.status not in ("pending", "scheduled"):
            raise AlreadySettled(f"{charge.key} is {row.status} already")
        left = (row.lease_until or now) - now
        raise LeaseHeld(f"{charge.key} is leased by another worker", retry_after_s=max(left, 0.0))

    async def extend(self, claim: Claim) -> Claim:
        self._unless_down("extend")
        deadline = self.clock() + self.lease_s
        row = self._fenced(claim)
        if row is None:
            raise LeaseHeld("the lease was taken over; this worker may not call")
        row.lease_until = deadline
        return dataclasses.replace(claim, lease_deadline=deadline)

    async def settle(
        self,
        claim: Claim,
        settlement: Settlement,
        *,
        story: Mapping[str, object] | None,
        attempted: Attempted = NOTHING_ATTEMPTED,
    ) -> None:
        self._unless_down("settle")
        row = self._write(self._fenced(claim), claim, story, attempted)
        row.status = settlement.status
        row.gateway_charge_id = settlement.charge_id or row.gateway_charge_id
        row.last_error, row.decline_code = settlement.error, settlement.decline_code
        row.retry_in_s = settlement.retry_in_s
        row.lease_owner = row.lease_until = None
        row.settled = settlement.status != "processing"

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
        self._unless_down("retry_later")
        row = self._write(self._fenced(claim), claim, story, attempted)
        row.last_error, row.nak_delivery = error, nak_delivery
        if not keep_lease:
            row.lease_owner = row.lease_until = None

    async def give_up(
        self,
        claim: Claim,
        error: str,
        *,
        story: Mapping[str, object] | None = None,
        attempted: Attempted = NOTHING_ATTEMPTED,
    ) -> None:
        self._unless_down("give_up")
        row = self.rows.get((claim.order_id, claim.billing_period))
        fenced = (
            row is not None
            and row.status == "pending"
            and row.lease_owner in (claim.owner, None)  # this attempt may have released it
            and row.attempt == claim.attempt
        )
        row = self._write(row if fenced else None, claim, story, attempted)
        if row.gateway_calls == 0:  # never sent: nothing for reconcile to look up
            row.status, row.settled = "failed", True
        row.last_error = error
        row.lease_owner = row.lease_until = None

    async def tell(self, charge: ChargeDue, owner: str, story: Mapping[str, object]) -> None:
        self._unless_down("tell")
        key = (charge.order_id, charge.billing_period)
        self.events.append(Event(key, "delivery", owner, _stored(story)))

    async def published(self, order_id: int, billing_period: dt.date, stream_seq: int) -> None:
        self._unless_down("published")
        if row := self.rows.get((order_id, billing_period)):
            row.published_seq = max(row.published_seq, stream_seq)

    async def status_of(self, order_id: int, billing_period: dt.date) -> str | None:
        row = self.rows.get((order_id, billing_period))
        return None if row is None else row.status

    # ---- the rules every fenced write shares ---------------------------------------------

    def _unless_down(self, operation: str) -> None:
        if operation in self.down:
            raise DependencyUnavailable(f"PostgreSQL unavailable (the fake's {operation} is down)")

    def _fenced(self, claim: Claim) -> Row | None:
        row = self.rows.get((claim.order_id, claim.billing_period))
        if row is None or row.status != "pending":
            return None
        return row if (row.lease_owner, row.attempt) == (claim.owner, claim.attempt) else None

    def _write(
        self,
        row: Row | None,
        claim: Claim,
        story: Mapping[str, object] | None,
        attempted: Attempted,
    ) -> Row:
        """What every fenced write keeps (the calls, the verdict, the deferred check, the
        event), or `LeaseHeld` with nothing written; the calls are counted before any rule
        reads them, as `give_up`'s SQL reads `gateway_calls + $6`."""
        if row is None:
            raise LeaseHeld("the lease was taken over; this worker may not write")
        key = (row.order_id, row.billing_period)
        row.gateway_calls += attempted.calls
        row.scoring = attempted.scoring or row.scoring
        if attempted.deferred_reason is not None:
            self.deferred.setdefault(key, attempted.deferred_reason)
        if story is not None:
            self.events.append(Event(key, "delivery", claim.owner, _stored(story)))
        return row


def _stored(story: Mapping[str, object]) -> dict[str, Any]:
    """The event's detail as PostgreSQL would hand it back: through the worker's JSON."""
    detail: dict[str, Any] = json.loads(events.to_json(story))
    return detail


# ---- the gateway ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Refuse:
    """The next answer, given before anything is recorded (a 409, a 429, a 5xx, a 404…)."""

    status: int
    error_type: str | None = None
    code: str | None = None
    retry_after: str | None = None


@dataclass(frozen=True)
class LoseAnswer:
    """The request is executed (a charge made), then its answer is lost: a 502, or with
    `dropped` the connection goes away mid-read."""

    dropped: bool = False


@dataclass(frozen=True)
class Unreachable:
    """No connection is made: the request never reaches the gateway."""


@dataclass(frozen=True)
class Meanwhile:
    """Something happens while the request is in flight (time passes, another worker takes
    the charge over); then it is served as usual."""

    happens: Callable[[], Awaitable[None]]


Script = Refuse | LoseAnswer | Unreachable | Meanwhile


class FakeGateway:
    """docs/contracts/gateway.md in memory, served to the real `ContractGateway` through
    `httpx.MockTransport`.

    A customer id starting with `cus_decline` is declined (`402 card_declined`, recorded
    as a `failed` charge), as the simulator does; `decline(customer, code, until_try=k)`
    declines a customer's tries before `k` with a `decline_code` (every try by default).
    `script("POST /v1/charges", ...)` queues what the next requests of that route meet
    instead of a plain answer (`Script`)."""

    def __init__(self, *, idempotent: bool = True) -> None:
        self.idempotent = idempotent
        self.charges: list[dict[str, Any]] = []
        self.keys: dict[str, tuple[str, int, dict[str, Any]]] = {}  # key: params, answer
        self.scripts: dict[str, deque[Script]] = {}
        self.requests: list[str] = []  # "POST /v1/charges" for each request that arrived
        self.ids = itertools.count(1)
        self.declines: dict[str, tuple[str, int | None]] = {}  # customer: code, until try

    def decline(self, customer: str, code: str, *, until_try: int | None = None) -> None:
        self.declines[customer] = (code, until_try)

    def adapter(self, **settings: Any) -> ContractGateway:
        """The `contract` adapter over this fake; `settings` are `GatewaySettings` fields."""
        cfg = GatewaySettings(url=GATEWAY_URL, api_key=SecretStr(API_KEY), **settings)
        return ContractGateway(cfg, transport=httpx.MockTransport(self.handle))

    def script(self, route: str, *answers: Script) -> None:
        self.scripts.setdefault(route, deque()).extend(answers)

    def charged_earlier(
        self, charge: ChargeDue, *, status: str = "succeeded", customer: str | None = None
    ) -> dict[str, Any]:
        """A charge of this key made before (by a worker whose answer was lost, or by
        someone else's integration under another customer)."""
        return self._record(
            charge_params(charge) | {"customer": customer or charge.customer_id}, status
        )

    def charges_of(self, charge: ChargeDue) -> list[dict[str, Any]]:
        """Every charge of the charge's period, whichever try made it."""
        return [
            c
            for c in self.charges
            if _of_period(c, str(charge.order_id), charge.billing_period.isoformat())
        ]

    def sent(self, route: str = "POST /v1/charges") -> int:
        return self.requests.count(route)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        route = f"{request.method} {request.url.path}"
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return _error(401, "invalid_request_error", "api_key_invalid")
        queued = self.scripts.get(route)
        script = queued.popleft() if queued else None
        match script:
            case Unreachable():
                raise httpx.ConnectError("connection refused (fake)", request=request)
            case Refuse(status, error_type, code, retry_after):
                self.requests.append(route)
                headers = {"Retry-After": retry_after} if retry_after is not None else {}
                return _error(status, error_type, code, headers)
            case Meanwhile(happens):
                await happens()
        self.requests.append(route)
        if route == "POST /v1/charges":
            response = self._charge(request)
        elif route == "GET /v1/charges":
            response = self._list(request)
        else:
            return _error(404, "invalid_request_error", "resource_missing")
        if isinstance(script, LoseAnswer):
            if script.dropped:
                raise httpx.ReadError("connection reset mid-answer (fake)", request=request)
            return _error(502, "api_error", "bad_gateway")
        return response

    def _charge(self, request: httpx.Request) -> httpx.Response:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return _error(400, "invalid_request_error", "parameter_missing")
        params = json.loads(request.content)
        seen = json.dumps(params, sort_keys=True)
        if self.idempotent and key in self.keys:
            first, status, body = self.keys[key]
            if first != seen:
                return _error(400, "idempotency_error", "key_reused")
            return httpx.Response(status, json=body, headers={"Idempotent-Replayed": "true"})
        customer = str(params.get("customer", ""))
        code, until_try = self.declines.get(customer, (None, None))
        try_no = int(params["metadata"].get("attempt", 1))
        declined = customer.startswith("cus_decline") or (
            code is not None and (until_try is None or try_no < until_try)
        )
        made = self._record(params, "failed" if declined else "succeeded")
        if declined:
            error = _body("card_error", "card_declined") | {"charge": made["id"]}
            status, body = 402, {"error": error | ({"decline_code": code} if code else {})}
        else:
            status, body = 200, made
        if self.idempotent:
            self.keys[key] = (seen, status, body)
        return httpx.Response(status, json=body)

    def _list(self, request: httpx.Request) -> httpx.Response:
        query = request.url.params
        if "order_id" in query:
            found = [
                c for c in self.charges if _of_period(c, query["order_id"], query["billing_period"])
            ]
        else:
            since, until = int(query.get("created_gte", 0)), int(query.get("created_lt", 2**62))
            found = [c for c in self.charges if since <= c["created"] < until]
        return httpx.Response(200, json={"object": "list", "data": found, "has_more": False})

    def _record(self, params: Mapping[str, Any], status: str) -> dict[str, Any]:
        made = {
            "id": f"ch_{next(self.ids)}",
            "object": "charge",
            "status": status,
            "amount": params["amount"],
            "currency": params["currency"],
            "customer": params["customer"],
            "metadata": dict(params["metadata"]),
            "created": len(self.charges) + 1,
            "amount_refunded": 0,
            "refunded": False,
        }
        self.charges.append(made)
        return made


def _of_period(made: Mapping[str, Any], order_id: str, billing_period: str) -> bool:
    metadata = made["metadata"]
    return (metadata.get("order_id"), metadata.get("billing_period")) == (order_id, billing_period)


def charge_params(charge: ChargeDue) -> dict[str, Any]:
    """The body the `contract` adapter sends for a charge."""
    return {
        "amount": charge.amount_minor,
        "currency": charge.currency,
        "customer": charge.customer_id,
        "metadata": {
            "order_id": str(charge.order_id),
            "billing_period": charge.billing_period.isoformat(),
        }
        | ({"attempt": str(charge.attempt)} if charge.attempt > 1 else {}),
    }


def _body(error_type: str | None, code: str | None) -> dict[str, Any]:
    return {k: v for k, v in {"type": error_type, "code": code}.items() if v is not None}


def _error(
    status: int,
    error_type: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    body = {"error": _body(error_type, code)} if error_type or code else None
    return httpx.Response(status, json=body, headers=headers)


# ---- scoring --------------------------------------------------------------------------------


class FakeScoring:
    """docs/contracts/scoring.md in memory, served to the real `ScoringClient` through
    `httpx.MockTransport`: a customer id starting with `cus_block` is blocked, any other
    approved. `down`: it answers 503; `silent`: it never answers (the client's own timeout
    ends the call); `meanwhile`: awaited while each call is in flight (time passes)."""

    def __init__(self) -> None:
        self.down = False
        self.silent = False
        self.meanwhile: Callable[[], Awaitable[None]] | None = None
        self.calls = 0

    def client(self, **settings: Any) -> ScoringClient:
        cfg = ScoringSettings(url=SCORING_URL, **settings)
        return ScoringClient(cfg, transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.meanwhile is not None:
            await self.meanwhile()
        if self.silent:
            await asyncio.Event().wait()  # cancelled by the client's timeout
        if self.down:
            return httpx.Response(503, json={"error": "unavailable"})
        customer = str(json.loads(request.content)["customer_id"])
        decision = "block" if customer.startswith("cus_block") else "approve"
        return httpx.Response(200, json={"decision": decision, "score": 0.5})


# ---- JetStream ------------------------------------------------------------------------------


class FakeMessage:
    """A delivered JetStream message: what the consumer told it, in `told`.

    `closed`: the connection is gone, so every reply raises as nats-py's would."""

    def __init__(
        self,
        data: bytes,
        *,
        stream_seq: int = 1,
        delivered: int = 1,
        headers: dict[str, str] | None = None,
        subject: str = "charges.due",
    ) -> None:
        self.data = data
        self.subject = subject
        self.headers = headers
        self.stream_seq, self.delivered = stream_seq, delivered
        self.reply = f"$JS.ACK.CHARGES.charges-worker.{delivered}.{stream_seq}.{stream_seq}.0.0"
        self.told: list[tuple[str, float | None]] = []
        self.closed = False

    @property
    def metadata(self) -> Msg.Metadata:
        return Msg.Metadata(
            sequence=Msg.Metadata.SequencePair(self.stream_seq, self.stream_seq),
            num_pending=0,
            num_delivered=self.delivered,
            timestamp=dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
            stream="CHARGES",
            consumer="charges-worker",
        )

    async def ack(self) -> None:
        self._tell("ack")

    async def nak(self, delay: float | None = None) -> None:
        self._tell("nak", delay)

    async def term(self) -> None:
        self._tell("term")

    async def in_progress(self) -> None:
        self._tell("in_progress")

    def _tell(self, what: str, delay: float | None = None) -> None:
        if self.closed:
            raise nats.errors.ConnectionClosedError
        self.told.append((what, delay))


@dataclass
class FakeDeadLetters:
    """The dead-letter stream and the requeued copies; `down`: JetStream refuses both."""

    letters: list[dict[str, Any]] = field(default_factory=list)
    copies: list[tuple[bytes, int]] = field(default_factory=list)  # body, from stream seq
    down: bool = False
    next_seq: int = 1_000

    async def write(
        self,
        body: bytes,
        *,
        reason: str,
        error: str,
        stream_seq: int,
        num_delivered: int,
        original: Mapping[str, object] | None,
    ) -> None:
        if self.down:
            raise DependencyUnavailable("dead-letter stream not writable (fake)")
        self.letters.append(
            {
                "body": body,
                "reason": reason,
                "error": error,
                "stream_seq": stream_seq,
                "num_delivered": num_delivered,
            }
        )

    async def requeue(
        self, body: bytes, headers: Mapping[str, object] | None, *, from_seq: int
    ) -> int:
        if self.down:
            raise DependencyUnavailable("charges subject not writable (fake)")
        self.copies.append((body, from_seq))
        self.next_seq += 1
        return self.next_seq


# ---- one worker's ports, assembled --------------------------------------------------------


@dataclass
class World:
    """One worker's ports in memory, on one clock; `async with` closes the clients made."""

    clock: FakeClock = field(default_factory=FakeClock)
    gateway: FakeGateway = field(default_factory=FakeGateway)
    scoring: FakeScoring = field(default_factory=FakeScoring)
    dead_letters: FakeDeadLetters = field(default_factory=FakeDeadLetters)
    metrics: Metrics = field(default_factory=lambda: Metrics(CollectorRegistry()))
    ledger: InMemoryLedger = field(init=False)
    clients: list[ContractGateway | ScoringClient] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ledger = InMemoryLedger(self.clock, lease_s=LEASE_S)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for client in self.clients:
            await client.aclose()

    def pipeline(
        self,
        owner: str = "w1",
        *,
        failpoints: str = "",
        gateway: Mapping[str, Any] | None = None,
        scoring: Mapping[str, Any] | None = None,
        retry_schedule: tuple[float, ...] = (),
    ) -> Pipeline:
        """The real pipeline over these ports; `gateway` and `scoring` are settings fields."""
        adapter = self.gateway.adapter(**(gateway or {}))
        client = self.scoring.client(**(scoring or {}))
        self.clients += [adapter, client]
        return Pipeline(
            self.ledger,
            adapter,
            client,
            owner=owner,
            metrics=self.metrics,
            failpoints=Failpoints(failpoints),
            retry_schedule=retry_schedule,
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0
