"""The relay: publishes the outbox's events to `CHARGE_OUTCOMES`, in every worker pod.

Each event goes to `<outcomes_subject>.<kind>` with `Nats-Msg-Id: outcome:<event_id>` (the
stream keeps one message per id within its duplicate window, so a re-publish after a crash
between the publish and the mark is dropped) and the charge's `traceparent`. A batch is
published at once (at most one event per period in it) and marked when the stream has
answered for every event. The relay never stops the worker: with NATS or PostgreSQL away,
events wait in the outbox and the worker charges on; `/metrics` shows the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge

from charge_worker.errors import ChargeWorkerError
from charge_worker.event_loop import raise_if_cancelled
from charge_worker.outcomes.outbox import Event, Outbox, Published, Result, Taken
from charge_worker.settings import NatsSettings, WorkerSettings

log = structlog.get_logger(__name__)

# how often the relay reads the age of its oldest unsent event and prunes sent ones
LOOK_EVERY_S = 5.0


class OutboxMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.oldest_unsent = Gauge(
            "charge_worker_outbox_oldest_unsent_seconds",
            "How long the oldest outcome event not yet in the stream has waited (0: none).",
            registry=registry,
        )
        publishes = Counter(
            "charge_worker_outbox_publishes",
            "Outcome events published by this pod's relay: `published` (stored), `duplicate`"
            " (the stream had it already: a re-publish), `failed` (tried again later),"
            " `renumbered` (its id was taken by the event of a commit a failover lost).",
            ["result"],
            registry=registry,
        )
        self.published = publishes.labels("published")
        self.duplicate = publishes.labels("duplicate")
        self.failed = publishes.labels("failed")
        self.renumbered = publishes.labels("renumbered")


class Relay:
    def __init__(
        self,
        outbox: Outbox,
        js: JetStreamContext,
        nats_cfg: NatsSettings,
        worker_cfg: WorkerSettings,
        metrics: OutboxMetrics,
        *,
        before_mark: Callable[[], None] = lambda: None,
    ) -> None:
        self.outbox = outbox
        self.js = js
        self.subject = nats_cfg.outcomes_subject
        self.cfg = worker_cfg
        self.metrics = metrics
        self.before_mark = before_mark

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until `stop` is set: at once while batches come full, else every poll."""
        next_look = 0.0
        while not stop.is_set():
            full = False
            try:
                full = await self.relay_once() == self.cfg.outbox_batch
            except ChargeWorkerError as error:
                log.warning("outbox.relay_failed", error=str(error))
            if time.monotonic() >= next_look:  # whatever the batch came to
                next_look = time.monotonic() + LOOK_EVERY_S
                try:
                    await self.look()
                except ChargeWorkerError as error:
                    log.warning("outbox.look_failed", error=str(error))
            raise_if_cancelled()
            if not full:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.cfg.outbox_poll_s)

    async def relay_once(self) -> int:
        """Publish one batch; how many events it held."""
        results = await self.outbox.relay(
            self.cfg.outbox_batch, self._publish, before_mark=self.before_mark
        )
        failed = [(event, result) for event, result in results if isinstance(result, Exception)]
        if failed:  # one line a batch: an outage fails every event of every batch
            self.metrics.failed.inc(len(failed))
            event, error = failed[0]
            log.warning(
                "outbox.publish_failed", events=len(failed), first=event.event_id, error=repr(error)
            )
        return len(results)

    async def look(self) -> None:
        """Export the oldest unsent event's age; delete events sent past the retention."""
        self.metrics.oldest_unsent.set(await self.outbox.oldest_unsent_s())
        await self.outbox.prune(self.cfg.outbox_retention_s)

    async def _publish(self, events: list[Event]) -> Published:
        published: list[Result] = []
        for result in await asyncio.gather(
            *(self._publish_one(event) for event in events), return_exceptions=True
        ):
            if not isinstance(result, int | Taken | Exception):
                raise result  # a cancellation: nothing is marked
            published.append(result)
        return published

    async def _publish_one(self, event: Event) -> int | Taken:
        headers = {"Nats-Msg-Id": f"outcome:{event.event_id}"}
        if event.traceparent:
            headers["traceparent"] = event.traceparent
        body = event.body()
        ack = await self.js.publish(
            f"{self.subject}.{event.kind}",
            body,
            timeout=self.cfg.outbox_publish_timeout_s,
            headers=headers,
        )
        if not ack.duplicate:
            self.metrics.published.inc()
            return ack.seq
        stored = await self.js.get_msg(ack.stream, ack.seq)
        if stored.data == body:  # this event, published by a relay that died before the mark
            self.metrics.duplicate.inc()
            return ack.seq
        self.metrics.renumbered.inc()
        log.warning("outbox.event_id_taken", event_id=event.event_id, stream_seq=ack.seq)
        return Taken(ack.seq)
