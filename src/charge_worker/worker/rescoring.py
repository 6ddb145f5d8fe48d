"""The background task that re-scores charges made without a verdict (policy `defer`).

It runs in every worker; checks are taken with `SKIP LOCKED` and a pushed-forward retry
time, so pods never score one check twice at once. It waits while scoring's breaker is
open. A late `block` marks the charge for review (`review_reason`) and counts in
`charge_worker_deferred_checks_resolved_total{verdict="blocked"}`; it never refunds by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

import structlog

from charge_worker.errors import ChargeWorkerError
from charge_worker.event_loop import raise_if_cancelled
from charge_worker.ledger import DeferredChecks
from charge_worker.scoring import ScoringClient, ScoringFailure
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)
BATCH = 50


async def rescore_deferred(
    checks: DeferredChecks,
    scoring: ScoringClient,
    metrics: Metrics,
    stop: asyncio.Event,
    *,
    interval_s: float,
) -> None:
    """Score due checks every `interval_s` until `stop` is set."""
    while not stop.is_set():
        try:
            if scoring.available:
                await _one_round(checks, scoring, metrics, retry_s=interval_s)
            metrics.deferred_checks_pending.set(await checks.pending())
        except ChargeWorkerError as error:
            log.warning("checks.round_failed", error=str(error))
        raise_if_cancelled()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def _one_round(
    checks: DeferredChecks, scoring: ScoringClient, metrics: Metrics, *, retry_s: float
) -> None:
    taken = await checks.take(BATCH)
    for done, check in enumerate(taken):
        verdict = await scoring.score(
            order_id=check.order_id,
            customer_id=check.customer_id,
            amount_minor=check.amount_minor,
            currency=check.currency,
        )
        if isinstance(verdict, ScoringFailure):
            # still unhealthy: the rest come due again at the next round (the breaker, once
            # open, keeps the rounds from calling until it half-opens)
            await checks.retry_in(taken[done:], retry_s)
            return
        resolved: Literal["approved", "blocked"] = (
            "blocked" if verdict.decision == "block" else "approved"
        )
        await checks.resolve(check, resolved)
        metrics.deferred_checks.labels(resolved).inc()
        if resolved == "blocked":
            log.warning(
                "checks.late_block",
                order_id=check.order_id,
                billing_period=check.billing_period.isoformat(),
            )
