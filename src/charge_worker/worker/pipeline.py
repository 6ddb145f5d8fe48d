"""What happens to one delivery: parse, claim, look up, score, charge; then record it.

`process` turns a delivery into a `Processed`: its result, and the final state it found for
the charge (a `Settlement`) still to be written. `decisions.decide` maps the result to an
action, and `record` is the one place that writes what the delivery came to: the final
state, or staying pending, or giving up, each with the delivery's event, in one statement.
Neither touches the message itself (consumer.py does).

The claim in the ledger comes before any side effect; the gateway's idempotency key is the
second barrier; a row whose earlier gateway call may have charged with no outcome recorded
(one is counted, or the lease taken over may have died mid-call) is looked up before
anything is sent again. The request that can move money starts only while the claim's
lease outlives it (`Claim.outlives`, checked by the adapter's `before_send` hook after any
read or rate-limit wait of its own; a slow delivery renews the lease there, fenced): no
other write precedes it, and the write that records what the delivery came to also counts
the call and keeps the verdict it was made under (`Attempted`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from charge_worker import logs, tracing
from charge_worker.errors import (
    AlreadySettled,
    ChargeWorkerError,
    LeaseHeld,
    NoVerdict,
    OutcomeUnknown,
)
from charge_worker.gateway import AUTHENTICATION_REQUIRED, CARD_DECLINED, Gateway
from charge_worker.ledger import Attempted, Claim, Ledger, Scoring, Settlement
from charge_worker.messages import ChargeDue, parse
from charge_worker.scoring import ScoringClient, ScoringFailure, Verdict
from charge_worker.settings import LEASE_RENEWAL_S
from charge_worker.worker.decisions import (
    Action,
    DeadLetter,
    Outcome,
    Result,
    describe,
    result_of,
)
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)
UNRECORDED_VERDICT = "charged by a worker that died before recording its verdict"


@dataclass(frozen=True)
class Delivery:
    """What the pipeline needs to know about one delivery of a message."""

    data: bytes
    stream_seq: int
    num_delivered: int
    traceparent: str | None = None
    replayed: bool = False  # republished from the dead-letter stream by an operator


@dataclass
class Processed:
    """What one delivery came to, and what happened on the way (for `explain`)."""

    result: Result
    delivery: Delivery
    charge: ChargeDue | None = None
    claim: Claim | None = None
    settlement: Settlement | None = None  # the final state found, not written yet
    called: bool = False  # the charge call was sent: a charge may be in flight
    # the verdict the charge was sent (or blocked, or found charged) under, to be kept, and
    # why it was deferred when it was
    verdict: Scoring | None = None
    deferred_reason: str | None = None
    state_written: bool = False  # the ledger write was made (or refused): events only now
    notes: dict[str, object] = field(default_factory=dict)

    def attempted(self) -> Attempted:
        """What the ledger write keeps of this delivery: the calls that may have charged (its
        own, and its predecessor's when it took over a lease that nobody looked up behind),
        and the verdict."""
        claim = self.claim
        inherited = (
            claim is not None
            and claim.taken_from is not None
            and claim.gateway_calls == 0
            and self.notes.get("lookup") != "nothing"
        )
        return Attempted(self.called + inherited, self.verdict, self.deferred_reason)

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


class Pipeline:
    def __init__(
        self,
        ledger: Ledger,
        gateway: Gateway,
        scoring: ScoringClient,
        *,
        owner: str,
        metrics: Metrics,
        failpoints: Failpoints,
    ) -> None:
        self.metrics = metrics
        self.ledger = ledger
        self.gateway = gateway
        self.scoring = scoring
        self.owner = owner
        self.failpoints = failpoints

    async def process(self, delivery: Delivery) -> Processed:
        """Run one delivery to a result. Nothing escapes: errors become results."""
        done = Processed(Result(Outcome.UNAVAILABLE), delivery)
        try:
            done.charge = parse(delivery.data)
            # the delivery's lines name the charge from here on (consumer.py unbinds them)
            logs.bind(
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
        return done

    async def record(self, done: Processed, action: Action) -> Result | None:
        """Write what this delivery came to, with its event, in one statement.

        A final state found goes with an ack or dead letter; a retry stays pending (the
        lease kept while a call may be in flight); the last delivery gives up. Returns the
        result that replaces `done.result` when the ledger refused to write a final state
        (decide again, then record that); else None. Once the state is written (or refused),
        a later call for the same delivery only appends its event.
        """
        if done.charge is None:  # poison: no charge to tell the story of
            return None
        story = done.story(action)
        if done.claim is not None and not done.state_written:
            done.state_written = True
            try:
                with tracing.span("charge.settle"):
                    await self._write(done, done.claim, action, story)
            except ChargeWorkerError as error:
                if done.settlement is not None:
                    done.settlement = None
                    return result_of(error)
                # nothing final was lost: the lease expires by itself, a redelivery goes on
                log.warning("ledger.write_failed", error=str(error))
            else:
                return None
        try:
            await self.ledger.tell(done.charge, self.owner, story)
        except ChargeWorkerError as error:
            log.warning("events.write_failed", error=str(error))
        return None

    async def requeued(self, done: Processed, stream_seq: int) -> None:
        """The message went back to the stream as a fresh copy at `stream_seq`."""
        if done.charge is None:
            return
        try:
            await self.ledger.published(
                done.charge.order_id, done.charge.billing_period, stream_seq
            )
        except ChargeWorkerError as error:  # reconcile then looks the charge up: no loss
            log.warning("ledger.write_failed", error=str(error))

    async def _write(
        self, done: Processed, claim: Claim, action: Action, story: dict[str, object]
    ) -> None:
        attempted = done.attempted()
        if done.settlement is not None:
            await self.ledger.settle(claim, done.settlement, story=story, attempted=attempted)
        elif isinstance(action, DeadLetter):
            why = f"dead-lettered: {action.reason}"
            await self.ledger.give_up(claim, why, story=story, attempted=attempted)
        else:
            error = done.result.error or done.result.outcome.value
            keep = done.result.call_in_flight
            await self.ledger.retry_later(
                claim, error, keep_lease=keep, story=story, attempted=attempted
            )

    async def _charge(self, done: Processed, charge: ChargeDue, claim: Claim) -> Result:
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

    async def _score(self, done: Processed, charge: ChargeDue) -> Verdict | ScoringFailure:
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

    async def _call_gateway(self, done: Processed, charge: ChargeDue) -> Result:
        renewing = False

        async def before_send() -> None:
            nonlocal renewing
            renewing = True
            await self._keep_lease(done, self.gateway.charge_deadline_s)
            renewing = False
            self.failpoints.hit("before_gateway_call")
            done.called = True

        try:
            with tracing.span("charge.gateway"):
                answer = await self.gateway.charge(
                    charge, traceparent=done.delivery.traceparent, before_send=before_send
                )
        except ChargeWorkerError as error:
            if renewing:  # the lease could not be kept (or the ledger answer): nothing sent
                raise
            self._gateway_answered(done, result_of(error).outcome.value)
            if error.outcome == Outcome.REJECTED:
                done.settlement = Settlement("failed", error=str(error))
            raise
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
        self.metrics.declines.labels(answer.decline_kind or CARD_DECLINED).inc()
        done.settlement = Settlement(
            "declined", error=answer.decline_code, decline_code=answer.decline_code
        )
        return Result(Outcome.DECLINED)

    async def _keep_lease(self, done: Processed, call_s: float) -> None:
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

    def _gateway_answered(self, done: Processed, label: str) -> None:
        done.notes["gateway"] = label
        self.metrics.gateway_calls.labels(label).inc()

    async def _look_up(self, done: Processed, charge: ChargeDue) -> Result | None:
        """What the gateway already did for this key, as a result to settle; None if nothing."""
        listed = await self.gateway.lookup(
            charge.order_id, charge.billing_period, customer_id=charge.customer_id
        )
        # found by metadata, which anyone with the account's key can set: only a charge with
        # the period's fingerprint is the period's; the rest is for a person (reconcile
        # reports it as unmatched), and the due charge goes ahead
        found = [c for c in listed if c.fingerprint == charge.fingerprint]
        if unmatched := [c.id for c in listed if c.fingerprint != charge.fingerprint]:
            done.notes["unmatched"] = unmatched
            log.warning("charge.unmatched_found", charges=unmatched)
        # a charge refunded since was made all the same: record it, never charge again
        charged = [c for c in found if c.captured] or [c for c in found if c.charged]
        if charged:
            done.settlement = Settlement("succeeded", charge_id=charged[0].id)
            return Result(Outcome.CHARGED)
        if processing := [c for c in found if c.processing]:  # the bank settles it: wait
            done.settlement = Settlement("processing", charge_id=processing[0].id)
            return Result(Outcome.PROCESSING)
        if failed := [c for c in found if c.status == "failed"]:
            code = failed[-1].decline_code
            kind = AUTHENTICATION_REQUIRED if code == AUTHENTICATION_REQUIRED else CARD_DECLINED
            self.metrics.declines.labels(kind).inc()
            done.settlement = Settlement(
                "declined", error=f"{code or 'declined'} (found by lookup)", decline_code=code
            )
            return Result(Outcome.DECLINED)
        return None
