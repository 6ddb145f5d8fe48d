"""What happens to one delivery: parse, claim, look up, score, charge, record.

It returns a `Result` (decisions.py decides what JetStream is told; consumer.py tells it)
and never touches the message itself. The claim in the ledger comes before any side
effect; the gateway's idempotency key is the second barrier; a row whose earlier gateway
call has no recorded outcome is looked up before anything is sent again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import structlog

from charge_worker.errors import (
    ChargeWorkerError,
    GatewayRejected,
    OutcomeUnknown,
    TransientError,
)
from charge_worker.gateway import GatewayClient
from charge_worker.ledger import Claim, FinalStatus, Ledger, Scoring
from charge_worker.messages import ChargeDue, parse
from charge_worker.scoring import ScoringClient, ScoringFailure, Verdict
from charge_worker.worker.decisions import FINAL, Ack, Action, Outcome, Result, describe, result_of
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)


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
    gateway_called: bool = False
    notes: dict[str, object] = field(default_factory=dict)
    recorded: bool = False  # the `delivery` event was written with the settle

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
        gateway: GatewayClient,
        scoring: ScoringClient,
        *,
        owner: str,
        metrics: Metrics,
        failpoints: Failpoints | None = None,
    ) -> None:
        self.metrics = metrics
        self.ledger = ledger
        self.gateway = gateway
        self.scoring = scoring
        self.owner = owner
        self.failpoints = failpoints or Failpoints()

    async def process(self, delivery: Delivery) -> Processed:
        """Run one delivery to a result. Nothing escapes: errors become results."""
        done = Processed(Result(Outcome.UNAVAILABLE), delivery)
        try:
            done.charge = parse(delivery.data)
            done.claim = await self.ledger.claim(
                done.charge, self.owner, delivery.stream_seq, revive_failed=delivery.replayed
            )
            self.failpoints.hit("after_claim")
            done.result = await self._charge(done)
        except ChargeWorkerError as error:
            done.result = result_of(error)
            if isinstance(error, TransientError):
                await self._retry_later(done, str(error), isinstance(error, OutcomeUnknown))
        except Exception as error:  # a bug must neither kill the loop nor go silent
            log.exception("charge.crashed")
            done.result = Result(Outcome.CRASHED, error=f"unexpected: {error!r}")
            await self._retry_later(done, done.result.error or "", done.gateway_called)
        return done

    async def _retry_later(self, done: Processed, error: str, keep_lease: bool) -> None:
        """Stay pending. Keep the lease only while a gateway call may still be in flight."""
        if done.claim is None:
            return
        # if the ledger is down too, the lease expires by itself and a redelivery takes over
        with contextlib.suppress(ChargeWorkerError):
            await self.ledger.retry_later(done.claim, error, keep_lease=keep_lease)

    async def _charge(self, done: Processed) -> Result:
        charge, claim, traceparent = done.charge, done.claim, done.delivery.traceparent
        assert charge is not None
        assert claim is not None
        if claim.outcome_unknown:
            found = await self._resolve_by_lookup(charge, claim)
            done.notes["lookup"] = found.outcome.value if found else "nothing"
            if found:
                return found
        scoring, deferred_reason = claim.scoring, None
        if scoring is None:
            verdict = await self.scoring.score(
                order_id=charge.order_id,
                customer_id=charge.customer_id,
                amount_minor=charge.amount_minor,
                currency=charge.currency,
                traceparent=traceparent,
            )
            done.notes["scoring"] = _scoring_label(verdict, self.scoring.policy)
            if isinstance(verdict, ScoringFailure):
                done.notes["scoring_error"] = verdict.reason
            self.metrics.scoring.labels(done.notes["scoring"]).inc()
            self.failpoints.hit("after_scoring")
            if isinstance(verdict, ScoringFailure):
                if self.scoring.policy == "hold":
                    raise _NoVerdict(verdict.reason)
                scoring, deferred_reason = "deferred", verdict.reason
            elif verdict.decision == "block":
                return await self._settle(done, Outcome.BLOCKED, "blocked", scoring="blocked")
            else:
                scoring = "approved"
        await self.ledger.begin_gateway_call(
            claim, scoring=scoring, deferred_reason=deferred_reason
        )
        done.gateway_called = True
        return await self._call_gateway(done, charge, claim)

    async def _call_gateway(self, done: Processed, charge: ChargeDue, claim: Claim) -> Result:
        self.failpoints.hit("before_gateway_call")
        try:
            answer = await self.gateway.charge(charge, traceparent=done.delivery.traceparent)
        except ChargeWorkerError as error:
            self._gateway_answered(done, result_of(error).outcome.value)
            if isinstance(error, GatewayRejected):
                await self.ledger.settle(claim, "failed", error=str(error))
            elif isinstance(error, OutcomeUnknown):
                # retry once the lease (which outlives this call) has run out
                raise OutcomeUnknown(str(error), retry_after_s=self.ledger.lease_s) from error
            raise
        self._gateway_answered(done, answer.status)
        done.notes.update(charge_id=answer.charge_id, replayed=answer.replayed or None)
        self.failpoints.hit("after_gateway_response_before_commit")
        if answer.status == "succeeded":
            return await self._settle(
                done, Outcome.CHARGED, "succeeded", charge_id=answer.charge_id
            )
        return await self._settle(done, Outcome.DECLINED, "declined", error=answer.decline_code)

    async def _settle(
        self,
        done: Processed,
        outcome: Outcome,
        status: FinalStatus | Literal["blocked"],
        *,
        charge_id: str | None = None,
        error: str | None = None,
        scoring: Scoring | None = None,
    ) -> Result:
        """Record a final outcome and this delivery's event in one statement.

        `decide` acks every final outcome, so the event can say so before the ack is sent.
        """
        assert done.claim is not None
        assert outcome in FINAL
        done.result = Result(outcome)
        await self.ledger.settle(
            done.claim, status, charge_id=charge_id, error=error, scoring=scoring,
            story=done.story(Ack()),
        )  # fmt: skip
        done.recorded = True
        return done.result

    def _gateway_answered(self, done: Processed, label: str) -> None:
        done.notes["gateway"] = label
        self.metrics.gateway_calls.labels(label).inc()

    async def _resolve_by_lookup(self, charge: ChargeDue, claim: Claim) -> Result | None:
        """Record what the gateway already did for this key; None if it did nothing."""
        found = await self.gateway.lookup(charge.order_id, charge.billing_period)
        charged = [c for c in found if c.status in ("succeeded", "refunded")]
        if charged:
            await self.ledger.settle(claim, "succeeded", charge_id=charged[0].id)
            return Result(Outcome.CHARGED)
        if any(c.status == "failed" for c in found):
            await self.ledger.settle(claim, "declined", error="declined (found by lookup)")
            return Result(Outcome.DECLINED)
        return None


def _scoring_label(verdict: Verdict | ScoringFailure, policy: str) -> str:
    if isinstance(verdict, ScoringFailure):
        return f"failed_{policy}"
    return verdict.decision


class _NoVerdict(TransientError):
    """Scoring gave no verdict and the policy is `hold`: wait for one."""
