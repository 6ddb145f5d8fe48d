"""The journal's processor: lease due events, apply them to the ledger, purge old rows.

Why a lease on the table rather than a publish to JetStream in the same step: the journal row
*is* the durable promise behind the 2xx, and a publish after the insert is a second write that
can be lost between the two (it would need an outbox, which is this table again). Taking work
with `FOR UPDATE SKIP LOCKED` spreads it over any number of receiver pods, and an expired lease
hands a dead processor's rows to a live one. Webhook volume is a few events per charge, so
polling (woken at once by this process's own receiver) costs nothing worth a broker.

Per event: the rules decide under a lock of the ledger row (`webhook_rules`). A wait is
retried with backoff; once it has lasted `wait_bound_tries` tries or `wait_bound_s`, the
charge is looked up at the gateway and what the gateway says is applied, or the event goes to
`needs_review`. An event whose processing keeps failing (database errors, a bug) goes to
`needs_review` after `give_up_tries`.

Events of providers whose webhooks carry no revision (`REFETCHED`: Stripe, YooKassa) are
applied from the object as the adapter re-fetches it (Stripe's own advice; YooKassa's, whose
notifications are not signed), so their order never matters: the fetched state is the
provider's now, and its revision is the moment of the fetch (microseconds, by the database's
clock, read just before it), so a fetch older than the one applied last is stale. The ledger
key it is applied to is the fetched object's metadata too, never the event's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from charge_worker import tracing
from charge_worker.errors import ChargeWorkerError, LeaseHeld, TransientError
from charge_worker.gateway import GatewayCharge, WebhookScheme
from charge_worker.webhooks.inbox import Inbox, Job, status_of
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.rules import Apply, Decision, Review, Wait, state_of

log = structlog.get_logger(__name__)
LEASE_USE = 0.8  # of a batch's lease, before the rest of the batch is handed back
# schemes whose events carry no revision: their object is re-fetched (`retrieve`)
REFETCHED: frozenset[WebhookScheme] = frozenset({"stripe", "yookassa"})


class ChargeLookup(Protocol):
    """What the processor asks of the gateway adapter (`Gateway`)."""

    @property
    def webhook_scheme(self) -> WebhookScheme:
        """`stripe`, `yookassa`: events carry no revision, their object is re-fetched
        (`retrieve`)."""

    async def lookup(
        self, order_id: int, billing_period: dt.date, *, customer_id: str | None = None
    ) -> list[GatewayCharge]:
        """Every charge the gateway holds for this key."""

    async def retrieve(self, charge_id: str) -> GatewayCharge | None:
        """The charge as the provider holds it now; None when it has no such charge."""


@dataclass(frozen=True)
class ProcessorTuning:
    """How the processor paces itself; the defaults suit production, tests shrink them."""

    batch: int = 20
    lease_s: float = 15.0  # one batch's work; a longer one only risks doing an event twice
    poll_s: float = 1.0
    backoff_base_s: float = 2.0
    backoff_max_s: float = 120.0
    wait_bound_tries: int = 10
    wait_bound_s: float = 900.0
    give_up_tries: int = 20
    purge_interval_s: float = 600.0
    stats_interval_s: float = 15.0

    def backoff_s(self, attempts: int) -> float:
        """The delay before try `attempts + 1`: doubling from the base, capped."""
        exponent = min(max(attempts - 1, 0), 30)
        return float(min(self.backoff_base_s * 2**exponent, self.backoff_max_s))


class Processor:
    """Applies journaled events until stopped; safe to run in every receiver pod."""

    def __init__(
        self,
        inbox: Inbox,
        gateway: ChargeLookup,
        metrics: WebhookMetrics,
        *,
        owner: str,
        retention_s: float,
        tuning: ProcessorTuning | None = None,
    ) -> None:
        self.inbox = inbox
        self.gateway = gateway
        self.metrics = metrics
        self.owner = owner
        self.retention_s = retention_s
        self.tuning = tuning or ProcessorTuning()
        self.last_tick = time.monotonic()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Look for work now (a new event was journaled)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Process, purge and report until `stop`; an unavailable database is waited out."""
        tuning = self.tuning
        next_purge = next_stats = time.monotonic()
        relay = asyncio.create_task(_set_when(stop, self._wake))
        try:
            await self._loop(stop, tuning, next_purge, next_stats)
        finally:
            relay.cancel()

    async def _loop(
        self, stop: asyncio.Event, tuning: ProcessorTuning, next_purge: float, next_stats: float
    ) -> None:
        while not stop.is_set():
            self.last_tick = now = time.monotonic()
            done = 0
            try:
                # scheduled before they run: a purge that fails (no DELETE granted, say)
                # must not keep the loop from applying events
                if now >= next_purge:
                    next_purge = now + tuning.purge_interval_s
                    await self.purge()
                if now >= next_stats:
                    next_stats = now + tuning.stats_interval_s
                    await self.report()
                done = await self.run_once(stop)
            except TransientError as error:
                log.warning("webhook.processor_unavailable", error=str(error))
            if done < tuning.batch:
                self._wake.clear()
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(tuning.poll_s):
                        await self._wake.wait()

    async def run_once(self, stop: asyncio.Event | None = None) -> int:
        """Lease one batch of due events and process each; the number taken."""
        tuning = self.tuning
        jobs = await self.inbox.take(self.owner, limit=tuning.batch, lease_s=tuning.lease_s)
        lease_ends = time.monotonic() + tuning.lease_s * LEASE_USE
        # grouped by charge, in revision order; any order leaves the same ledger, since an
        # event older than one journaled is stale (rules.decide)
        for job in sorted(jobs, key=lambda j: (j.charge_id, j.revision, j.id)):
            if time.monotonic() < lease_ends and not (stop and stop.is_set()):
                await self.process(job)
            else:  # stopping, or slow events ate the lease: hand the rest back at once
                with contextlib.suppress(ChargeWorkerError):
                    await self.inbox.retry(job, self.owner, "handed back", delay_s=0.0)
        return len(jobs)

    async def process(self, job: Job) -> None:
        """Apply one leased event, or put it back to wait or retry."""
        attributes = _span_attributes(job) if tracing.enabled() else None
        with tracing.span("webhook.process", attributes):
            await self._process(job)

    async def _process(self, job: Job) -> None:
        try:
            fetched: GatewayCharge | None = None
            if self.gateway.webhook_scheme in REFETCHED:
                # decided first: under a worker's live lease nothing fetched would change
                # the wait, and each try would be a request against the account's limit
                revision = await self.inbox.revision_or_wait(
                    job, self.owner, wait_s=self.tuning.backoff_s(job.attempts)
                )
                if isinstance(revision, Wait):
                    self._count(job, revision)
                    return
                fetched = await self.gateway.retrieve(job.charge_id)
                if fetched is None:
                    why = f"the provider has no {job.charge_id}"
                    await self.inbox.review(job, self.owner, why)
                    self._count(job, Review(why))
                    return
                job = refetched(job, fetched, revision=revision)
                if job.key is None:  # another integration's charge, as the provider says
                    why = f"{job.charge_id} carries no order_id/billing_period of ours"
                    await self.inbox.ignore(job, self.owner, why)
                    self.metrics.events.labels("ignored").inc()
                    log.info("webhook.processed", **job.describe(), status="ignored", detail=why)
                    return
            decision = await self._decide(job, fetched)
        except LeaseHeld as error:
            log.warning("webhook.lease_lost", **job.describe(), error=str(error))
            return
        except ChargeWorkerError as error:
            await self._failed(job, f"{type(error).__name__}: {error}")
            return
        except Exception as error:  # a bug must not stop every other event
            log.exception("webhook.crashed", **job.describe())
            await self._failed(job, f"crashed: {type(error).__name__}: {error}")
            return
        if tracing.enabled():
            tracing.note({"charge_worker.outcome": status_of(decision)})
        self._count(job, decision)

    async def _decide(self, job: Job, fetched: GatewayCharge | None = None) -> Decision:
        tuning = self.tuning
        bound = job.attempts >= tuning.wait_bound_tries or job.age_s >= tuning.wait_bound_s
        decision = await self.inbox.decide_and_write(
            job, self.owner, wait_s=None if bound else tuning.backoff_s(job.attempts)
        )
        if not (bound and isinstance(decision, Wait)):
            return decision
        if fetched is not None:  # what the provider holds now: nothing more to look up
            state = state_of(fetched.status, refunded=fetched.refunded)
            return await self.inbox.decide_and_write(
                job, self.owner, confirmed_status=state, wait_s=tuning.backoff_max_s
            )
        if job.key is None:
            why = f"{decision.why}; the charge has no order_id/billing_period to look it up by"
            await self.inbox.review(job, self.owner, why)
            return Review(why)
        try:
            found = await self.gateway.lookup(*job.key)
        except TransientError as error:
            wait = Wait(f"{decision.why}; the lookup failed: {error}")
            await self.inbox.wait(job, self.owner, wait.why, delay_s=tuning.backoff_max_s)
            return wait
        charge = next((c for c in found if c.id == job.charge_id), None)
        if charge is not None:  # what the gateway holds proves (or not) the fingerprint
            job = dataclasses.replace(
                job,
                amount=charge.amount,
                currency=charge.currency,
                customer=charge.customer,
                charge_try=charge.attempt,
                decline_code=charge.decline_code or job.decline_code,
            )
        if charge is None:
            held = ", ".join(f"{c.id} {state_of(c.status, refunded=c.refunded)}" for c in found)
            held = held or "none"
            why = f"{decision.why}; the gateway holds no {job.charge_id} for this key ({held})"
            await self.inbox.review(job, self.owner, why)
            return Review(why)
        state = state_of(charge.status, refunded=charge.refunded)
        return await self.inbox.decide_and_write(
            job, self.owner, confirmed_status=state, wait_s=tuning.backoff_max_s
        )

    async def _failed(self, job: Job, error: str) -> None:
        if job.attempts >= self.tuning.give_up_tries:
            why = f"processing failed {job.attempts} times; last: {error}"
            with contextlib.suppress(ChargeWorkerError):
                await self.inbox.review(job, self.owner, why)
                self._count(job, Review(why))
            return
        log.warning("webhook.retry", **job.describe(), error=error)
        with contextlib.suppress(ChargeWorkerError):  # else the lease expires: retried anyway
            await self.inbox.retry(
                job, self.owner, error, delay_s=self.tuning.backoff_s(job.attempts)
            )

    def _count(self, job: Job, decision: Decision) -> None:
        status = status_of(decision)
        self.metrics.events.labels(status).inc()
        detail = decision.change if isinstance(decision, Apply) else decision.why
        if isinstance(decision, Review) and decision.unmatched:
            self.metrics.unmatched_charges.inc()
        if status == "needs_review":
            self.metrics.needs_review.inc()
            log.warning("webhook.needs_review", **job.describe(), why=detail)
        else:
            log.info("webhook.processed", **job.describe(), status=status, detail=detail)

    async def purge(self) -> int:
        """Delete final rows older than the retention period."""
        deleted = await self.inbox.purge(self.retention_s)
        if deleted:
            self.metrics.purged.inc(deleted)
            log.info("webhook.purged", rows=deleted)
        return deleted

    async def report(self) -> None:
        """Copy the journal's open rows into the gauges."""
        counts = await self.inbox.open_counts()
        for status, count in counts.by_status.items():
            self.metrics.inbox_rows.labels(status).set(count)
        self.metrics.oldest_open_s.set(counts.oldest_unprocessed_s)


def refetched(job: Job, charge: GatewayCharge, *, revision: int) -> Job:
    """The job as the re-fetched object says: its state and refund, its try and decline
    code, its key from its metadata (none when it has none: whatever the event said, since
    an unsigned one may say anything), and `revision`, the fetch's moment by the database's
    clock (`Inbox.revision_or_wait`: never a pod's, which may run ahead)."""
    key: tuple[int, dt.date] | None = None
    if charge.order_id and charge.order_id.isdigit() and charge.billing_period:
        with contextlib.suppress(ValueError):
            key = int(charge.order_id), dt.date.fromisoformat(charge.billing_period)
    order_id, period = key if key is not None else (None, None)
    return dataclasses.replace(
        job,
        object_status=charge.status,
        refunded=charge.refunded,
        amount_refunded=charge.amount_refunded,
        amount=charge.amount,
        currency=charge.currency,
        customer=charge.customer,
        charge_try=charge.attempt,
        decline_code=charge.decline_code,
        revision=revision,
        order_id=order_id,
        billing_period=period,
    )


def _span_attributes(job: Job) -> tracing.Attributes:
    return {
        "charge_worker.event_id": job.event_id,
        "charge_worker.event_type": job.event_type,
        "charge_worker.charge_id": job.charge_id,
        "charge_worker.revision": job.revision,
        "charge_worker.attempt": job.attempts,
    }


async def _set_when(stop: asyncio.Event, wake: asyncio.Event) -> None:
    await stop.wait()
    wake.set()
