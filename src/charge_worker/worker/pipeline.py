"""One delivery, from its bytes to the action JetStream is told: the one way through.

`Pipeline.conclude(delivery, policy)` is the whole of it, in order:

1. `process`: parse, claim `(order_id, billing_period)` in the ledger, look the key up at
   the gateway if an earlier call may have charged with no outcome recorded, score, charge.
   Every error becomes a `Result`; what happened on the way is a frozen `Processed`.
2. `decisions.decide`: the result -> `Ack | Nak | DeadLetter | Requeue`.
3. `_record`: what the delivery came to, in one ledger statement with its event: the final
   state found, or staying pending (a nak records which delivery nak'd, so that its
   redelivery is known as asked for: `Processed.redelivery`), or giving up. When the
   ledger refuses a final state (another worker owns the charge now), the refusal is the
   result: decided again, told.

It returns a `Concluded` (the `Processed` and its action), and `consumer.py` executes that
action, once. Nothing here touches the message.

The claim comes before any side effect; the gateway's idempotency key is the second
barrier; a row whose earlier call may have charged with no outcome recorded (one is
counted, or the lease taken over may have died mid-call) is looked up before anything is
sent again. The request that can move money starts only while the claim's lease outlives it
(`Claim.outlives`, checked by the adapter's `before_send` hook after any read or rate-limit
wait of its own; a slow delivery renews the lease there, fenced): no other write precedes
it, and the write that records what the delivery came to also counts the call and keeps the
verdict it was made under (`Attempted`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from charge_worker import declines, tracing
from charge_worker.errors import (
    AlreadySettled,
    ChargeWorkerError,
    LeaseHeld,
    NoVerdict,
    OutcomeUnknown,
)
from charge_worker.gateway import (
    ChargeResult,
    Gateway,
    GatewayCharge,
    decline_kind,
    period_answer,
)
from charge_worker.ledger import Attempted, Claim, Scoring, Settlement
from charge_worker.messages import ChargeDue, parse
from charge_worker.retries.schedule import after_decline
from charge_worker.scoring import ScoringClient, ScoringFailure, Verdict
from charge_worker.settings import LEASE_RENEWAL_S
from charge_worker.worker.decisions import (
    Action,
    DeadLetter,
    Nak,
    Outcome,
    Policy,
    RedeliveryCause,
    Result,
    decide,
    describe,
    redelivery_cause,
    result_of,
)
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)
UNRECORDED_VERDICT = "charged by a worker that died before recording its verdict"
_UNFINISHED = Result(Outcome.UNAVAILABLE)  # a draft's result until it has one


@dataclass(frozen=True)
class Delivery:
    """What the pipeline needs to know about one delivery of a message."""

    data: bytes
    stream_seq: int
    num_delivered: int
    traceparent: str | None = None
    replayed: bool = False  # republished from the dead-letter stream by an operator


@dataclass(frozen=True)
class Processed:
    """What one delivery came to, and what happened on the way.

    The typed fields are what the decision, the ledger write and the consumer read; `notes`
    are the story only (the `delivery` event, for `explain`), never read by logic."""

    result: Result
    delivery: Delivery
    charge: ChargeDue | None = None  # None: the message is poison
    claim: Claim | None = None  # None: nothing claimed (poison, a duplicate, a held lease…)
    settlement: Settlement | None = None  # the final state found, for the ledger write
    called: bool = False  # the charge request was let go: a charge may be in flight
    looked_up: bool = False  # the gateway answered a lookup of the key
    found: GatewayCharge | None = None  # the key's charge that lookup found
    answer: ChargeResult | None = None  # the gateway's answer to this delivery's charge
    # the verdict the charge was sent (or blocked, or found charged) under, to be kept, and
    # why it was deferred when it was
    verdict: Scoring | None = None
    deferred_reason: str | None = None
    notes: Mapping[str, object] = field(default_factory=dict)

    def attempted(self) -> Attempted:
        """What the ledger write keeps of this delivery: the calls that may have charged (its
        own, and its predecessor's when it took over a lease from a worker that died with no
        call counted, unless a lookup found nothing of it), and the verdict."""
        claim = self.claim
        inherited = (
            claim is not None
            and claim.taken_from is not None
            and claim.gateway_calls == 0
            and not (self.looked_up and self.found is None)
        )
        return Attempted(self.called + inherited, self.verdict, self.deferred_reason)

    @property
    def redelivery(self) -> RedeliveryCause | None:
        """Why this delivery came again (None: the first): asked for when the claimed row says
        this message's previous delivery nak'd it."""
        claim = self.claim
        return redelivery_cause(
            self.delivery.num_delivered, claim.nak_delivery if claim is not None else None
        )

    def story(self, action: Action) -> dict[str, object]:
        """The `delivery` event: what this delivery came to and what JetStream was told."""
        claim = self.claim
        return {
            "stream_seq": self.delivery.stream_seq,
            "delivery": self.delivery.num_delivered,
            "attempt": claim.attempt if claim else None,
            "taken_from": claim.taken_from if claim else None,
            "outcome": self.result.outcome.value,
            "error": self.result.error,
            **self.notes,
            **describe(action),
        }


@dataclass(frozen=True)
class Concluded:
    """A delivery's end: what it came to, and the one action the consumer executes."""

    processed: Processed
    action: Action


class LedgerPort(Protocol):
    """What the pipeline needs of the ledger: `ledger.Ledger` (PostgreSQL) in production,
    `tests/support/fakes.InMemoryLedger` in unit tests. The rules are `ledger.py`'s."""

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock a claim's `lease_deadline` is dated on."""

    async def claim(
        self, charge: ChargeDue, owner: str, stream_seq: int, *, revive_failed: bool = False
    ) -> Claim:
        """Take the charge, or raise what stands in the way (`AlreadySettled`,
        `PayloadConflict`, `LeaseHeld`, `Unverified`)."""

    async def extend(self, claim: Claim) -> Claim:
        """Renew the lease (fenced); `LeaseHeld` if it was taken over."""

    async def settle(
        self,
        claim: Claim,
        settlement: Settlement,
        *,
        story: Mapping[str, object] | None,
        attempted: Attempted = ...,
    ) -> None:
        """Write a final state (fenced); `LeaseHeld`, nothing written, if no longer ours."""

    async def retry_later(
        self,
        claim: Claim,
        error: str,
        *,
        keep_lease: bool,
        nak_delivery: int | None = None,
        story: Mapping[str, object] | None = None,
        attempted: Attempted = ...,
    ) -> None:
        """Stay pending (fenced); the lease kept while a call may be in flight; the delivery
        that naks (`nak_delivery`) recorded for the next claim to read."""

    async def give_up(
        self,
        claim: Claim,
        error: str,
        *,
        story: Mapping[str, object] | None = None,
        attempted: Attempted = ...,
    ) -> None:
        """Out of deliveries (fenced): `failed` if never sent, else left for reconcile."""

    async def tell(self, charge: ChargeDue, owner: str, story: Mapping[str, object]) -> None:
        """Append a `delivery` event that no ledger write carried."""

    async def published(self, order_id: int, billing_period: dt.date, stream_seq: int) -> None:
        """A fresh copy of the charge's message went out at `stream_seq`."""


@dataclass
class _Draft:
    """A `Processed` while it is being found out: written step by step, frozen when done."""

    delivery: Delivery
    result: Result = _UNFINISHED
    charge: ChargeDue | None = None
    claim: Claim | None = None
    settlement: Settlement | None = None
    called: bool = False
    looked_up: bool = False
    found: GatewayCharge | None = None
    answer: ChargeResult | None = None
    verdict: Scoring | None = None
    deferred_reason: str | None = None
    notes: dict[str, object] = field(default_factory=dict)

    def freeze(self) -> Processed:
        return Processed(
            self.result,
            self.delivery,
            self.charge,
            self.claim,
            self.settlement,
            self.called,
            self.looked_up,
            self.found,
            self.answer,
            self.verdict,
            self.deferred_reason,
            self.notes,
        )


class Pipeline:
    def __init__(
        self,
        ledger: LedgerPort,
        gateway: Gateway,
        scoring: ScoringClient,
        *,
        owner: str,
        metrics: Metrics,
        failpoints: Failpoints,
        retry_schedule: Sequence[float] = (),
    ) -> None:
        """`retry_schedule`: the waits before tries 2, 3, ... of a period whose try was
        declined soft (`CHARGE_WORKER_RETRY_SCHEDULE`); empty: a decline ends the period."""
        self.metrics = metrics
        self.retry_schedule = tuple(retry_schedule)
        self.ledger = ledger
        self.gateway = gateway
        self.scoring = scoring
        self.owner = owner
        self.failpoints = failpoints

    async def conclude(self, delivery: Delivery, policy: Policy) -> Concluded:
        """The one way through a delivery: process it, decide, record; see the module."""
        processed = await self.process(delivery)
        action = decide(processed.result, delivery.num_delivered, policy)
        if (refused := await self._record(processed, action)) is not None:
            # the final state found was not written: what stood in the way is the result
            processed = dataclasses.replace(processed, result=refused, settlement=None)
            action = decide(refused, delivery.num_delivered, policy)
            await self.tell(processed, action)
        return Concluded(processed, action)

    async def process(self, delivery: Delivery) -> Processed:
        """Run one delivery to a result. Nothing escapes: errors become results."""
        done = _Draft(delivery)
        try:
            done.charge = parse(delivery.data)
            # the delivery's lines name the charge from here on (its task ends with them)
            structlog.contextvars.bind_contextvars(
                order_id=done.charge.order_id,
                billing_period=done.charge.billing_period.isoformat(),
            )
            # what stands in the way of a claim is an answer, not a fault of the claim
            with tracing.span("charge.claim", expected=(AlreadySettled, LeaseHeld)):
                done.claim = await self.ledger.claim(
                    done.charge, self.owner, delivery.stream_seq, revive_failed=delivery.replayed
                )
            self.failpoints.hit("after_claim")
            done.result = await self._charge(done, done.charge, done.claim)
        except ChargeWorkerError as error:
            unknown = isinstance(error, OutcomeUnknown)  # only the charge call raises it then
            done.result = result_of(error, call_in_flight=unknown and done.called)
        except Exception as error:  # a bug must neither kill the loop nor go silent
            log.exception("charge.crashed")
            done.result = Result(
                Outcome.CRASHED, error=f"unexpected: {error!r}", call_in_flight=done.called
            )
        return done.freeze()

    async def tell(self, processed: Processed, action: Action) -> None:
        """Append the delivery's event for an action no ledger write carried: nothing was
        claimed, the write was refused, or the consumer did something else than decided (a
        dead letter or a fresh copy it could not write became a nak)."""
        if processed.charge is None:  # poison: no charge to tell the story of
            return
        try:
            await self.ledger.tell(processed.charge, self.owner, processed.story(action))
        except ChargeWorkerError as error:
            log.warning("events.write_failed", error=str(error))

    async def requeued(self, processed: Processed, stream_seq: int) -> None:
        """The message went back to the stream as a fresh copy at `stream_seq`."""
        if processed.charge is None:
            return
        charge = processed.charge
        try:
            await self.ledger.published(charge.order_id, charge.billing_period, stream_seq)
        except ChargeWorkerError as error:  # reconcile then looks the charge up: no loss
            log.warning("ledger.write_failed", error=str(error))

    # ---- 1. process -------------------------------------------------------------------------

    async def _charge(self, done: _Draft, charge: ChargeDue, claim: Claim) -> Result:
        if claim.outcome_unknown:
            with tracing.span("charge.lookup"):
                found = await self._look_up(done, charge)
            done.notes["lookup"] = found.outcome.value if found else "nothing"
            if found:
                if found.outcome is not Outcome.DECLINED and claim.scoring is None:
                    # made by a worker that died before recording its verdict: check it now
                    done.verdict, done.deferred_reason = "deferred", UNRECORDED_VERDICT
                return found
        scoring, deferred_reason = claim.scoring, None
        if scoring is None:
            verdict = await self._score(done, charge)
            if isinstance(verdict, ScoringFailure):
                if self.scoring.policy == "hold":
                    raise NoVerdict(verdict.reason)
                scoring, deferred_reason = "deferred", verdict.reason
            elif verdict.decision == "block":
                done.verdict = "blocked"
                done.settlement = Settlement("blocked")
                return Result(Outcome.BLOCKED)
            else:
                scoring = "approved"
        done.verdict, done.deferred_reason = scoring, deferred_reason
        return await self._call_gateway(done, charge)

    async def _look_up(self, done: _Draft, charge: ChargeDue) -> Result | None:
        """What the gateway already did for this key, as a result to settle; None if nothing."""
        listed = await self.gateway.lookup(
            charge.order_id,
            charge.billing_period,
            customer_id=charge.customer_id,
            since=done.claim.since if done.claim else None,
        )
        done.looked_up = True
        # found by metadata, which anyone with the account's key can set: only a charge with
        # the period's fingerprint is the period's; the rest is for a person (reconcile
        # reports it as unmatched), and the due charge goes ahead
        found = [c for c in listed if c.fingerprint == charge.fingerprint]
        if unmatched := [c.id for c in listed if c.fingerprint != charge.fingerprint]:
            done.notes["unmatched"] = unmatched
            log.warning("charge.unmatched_found", charges=unmatched)
        answer = period_answer(found, charge.attempt)
        if answer is None:
            return None
        status, done.found = answer
        if status == "succeeded":
            done.settlement = Settlement("succeeded", charge_id=done.found.id)
            return Result(Outcome.CHARGED)
        if status == "processing":  # the bank settles it: wait
            done.settlement = Settlement("processing", charge_id=done.found.id)
            return Result(Outcome.PROCESSING)
        code = done.found.decline_code
        return self._declined(done, charge, code, error=f"{code or 'declined'} (found by lookup)")

    async def _score(self, done: _Draft, charge: ChargeDue) -> Verdict | ScoringFailure:
        verdict = await self.scoring.score(
            order_id=charge.order_id,
            customer_id=charge.customer_id,
            amount_minor=charge.amount_minor,
            currency=charge.currency,
            traceparent=done.delivery.traceparent,
        )
        label = (
            f"failed_{self.scoring.policy}"
            if isinstance(verdict, ScoringFailure)
            else verdict.decision
        )
        done.notes["scoring"] = label
        if isinstance(verdict, ScoringFailure):
            done.notes["scoring_error"] = verdict.reason
        self.metrics.scoring.labels(label).inc()
        self.failpoints.hit("after_scoring")
        return verdict

    async def _call_gateway(self, done: _Draft, charge: ChargeDue) -> Result:
        renewing = False
        sent: float | None = None  # the monotonic time of the (last) charge request's send

        async def before_send() -> None:
            nonlocal renewing, sent
            renewing = True
            await self._keep_lease(done, self.gateway.charge_deadline_s)
            renewing = False
            self.failpoints.hit("before_gateway_call")
            done.called = True
            sent = time.monotonic()

        try:
            with tracing.span("charge.gateway"):
                answer = await self.gateway.charge(
                    charge, traceparent=done.delivery.traceparent, before_send=before_send
                )
        except ChargeWorkerError as error:
            if sent is not None:
                self.metrics.gateway_seconds.observe(time.monotonic() - sent)
            if renewing:  # the lease could not be kept (or the ledger answer): nothing sent
                raise
            self._gateway_answered(done, result_of(error).outcome.value)
            if error.outcome == Outcome.REJECTED:
                done.settlement = Settlement("failed", error=str(error))
            raise
        if sent is not None:
            self.metrics.gateway_seconds.observe(time.monotonic() - sent)
        done.answer = answer
        self._gateway_answered(done, answer.status)
        done.notes.update(charge_id=answer.charge_id, replayed=answer.replayed or None)
        self.failpoints.hit("after_gateway_response_before_commit")
        if answer.status == "succeeded":
            done.settlement = Settlement("succeeded", charge_id=answer.charge_id)
            return Result(Outcome.CHARGED)
        if answer.status == "processing":
            done.settlement = Settlement("processing", charge_id=answer.charge_id)
            return Result(Outcome.PROCESSING)
        done.notes["decline"] = answer.decline_code
        return self._declined(done, charge, answer.decline_code, error=answer.decline_code)

    def _declined(
        self, done: _Draft, charge: ChargeDue, code: str | None, *, error: str | None
    ) -> Result:
        """The try was declined with `code`: the period's state follows its class and the
        try's number (retries/schedule.py)."""
        self.metrics.declines.labels(
            decline_kind(code), declines.label(code), declines.decline_class(code)
        ).inc()
        after = after_decline(code, charge.attempt, self.retry_schedule)
        done.notes["after_decline"] = after.status
        done.settlement = Settlement(
            after.status,
            error=error,
            decline_code=code,
            retry_in_s=after.retry_in_s,
            exhausted=after.exhausted,
        )
        return Result(Outcome.DECLINED)

    async def _keep_lease(self, done: _Draft, call_s: float) -> None:
        """Right before the request that can move money: the lease must outlive that request
        (and the margin), whatever came before it (scoring, a lookup, the adapter's reads,
        rate-limit waits). Renew it (fenced) when it no longer does, and send nothing when
        even the renewed lease does not."""
        assert done.claim is not None
        if done.claim.outlives(self.ledger.clock(), call_s):
            return
        done.claim = await self.ledger.extend(done.claim)
        if not done.claim.outlives(self.ledger.clock(), call_s):
            raise LeaseHeld(
                "the lease was renewed too slowly to outlive the charge request",
                retry_after_s=LEASE_RENEWAL_S,
            )

    def _gateway_answered(self, done: _Draft, label: str) -> None:
        done.notes["gateway"] = label
        self.metrics.gateway_calls.labels(label).inc()

    # ---- 3. record ----------------------------------------------------------------------------

    async def _record(self, processed: Processed, action: Action) -> Result | None:
        """Write what this delivery came to, with its event, in one statement: a final state
        found (with an ack or a dead letter), staying pending (the lease kept while a call
        may be in flight), or giving up (a dead letter). Returns what stood in the way when
        the ledger did not write a final state found (another worker owns the charge now, or
        the ledger is away); None otherwise."""
        claim = processed.claim
        if claim is None:  # nothing claimed: only the event can be written
            await self.tell(processed, action)
            return None
        story = processed.story(action)
        attempted = processed.attempted()
        try:
            with tracing.span("charge.settle"):
                if processed.settlement is not None:
                    await self.ledger.settle(
                        claim, processed.settlement, story=story, attempted=attempted
                    )
                elif isinstance(action, DeadLetter):
                    why = f"dead-lettered: {action.reason}"
                    await self.ledger.give_up(claim, why, story=story, attempted=attempted)
                else:
                    await self.ledger.retry_later(
                        claim,
                        processed.result.error or processed.result.outcome.value,
                        keep_lease=processed.result.call_in_flight,
                        nak_delivery=(
                            processed.delivery.num_delivered if isinstance(action, Nak) else None
                        ),
                        story=story,
                        attempted=attempted,
                    )
        except ChargeWorkerError as error:
            if processed.settlement is not None:
                return result_of(error)
            # nothing final was lost: the lease expires by itself, a redelivery goes on
            log.warning("ledger.write_failed", error=str(error))
            await self.tell(processed, action)
        return None
