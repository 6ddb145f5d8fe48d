"""The pull loop: fetch to free capacity, process with bounded concurrency, settle, drain.

A fetched message's AckWait clock is already running, so the loop fetches only as many
messages as it has free slots. While a message is processed it sends `+WPI` every
heartbeat interval, up to the processing budget. `_settle` is the one place that acks,
naks or terminates. While the gateway's breaker is open nothing is fetched (messages wait
in the stream and spend no deliveries); a cheap probe closes it again. On stop: no more
fetches, in-flight work gets `drain_s` to finish, and anything cancelled is left un-acked
for JetStream to redeliver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping

import asyncpg
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from charge_worker import events
from charge_worker.dlq import DeadLetters
from charge_worker.errors import ChargeWorkerError, PoisonMessage
from charge_worker.gateway import GatewayClient
from charge_worker.http import open_for_s
from charge_worker.ledger import Ledger
from charge_worker.messages import parse
from charge_worker.settings import Settings
from charge_worker.worker.decisions import (
    EXHAUSTED_HEADER,
    Action,
    DeadLetter,
    Nak,
    Outcome,
    Requeue,
    after_deliveries_ran_out,
    decide,
    describe,
)
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Delivery, Pipeline, Processed

log = structlog.get_logger(__name__)
RECONNECT_PAUSE_S = 0.5


class Consumer:
    def __init__(
        self,
        settings: Settings,
        *,
        js: JetStreamContext,
        pipeline: Pipeline,
        dead_letters: DeadLetters,
        ledger: Ledger,
        gateway: GatewayClient,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.js = js
        self.pipeline = pipeline
        self.dead_letters = dead_letters
        self.ledger = ledger
        self.gateway = gateway
        self.metrics = metrics
        self.in_flight: set[asyncio.Task[None]] = set()
        self.ready = asyncio.Event()
        self.last_tick = time.monotonic()  # /healthz: the loop turns at least every second

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set, then drain within `drain_s`."""
        cfg = self.settings.nats
        sub = await self.js.pull_subscribe_bind(durable=cfg.durable, stream=cfg.stream)
        concurrency = self.settings.worker.concurrency
        self.ready.set()
        try:
            while not stop.is_set():
                self.last_tick = time.monotonic()
                if not await self._gateway_ready():
                    continue
                free = concurrency - len(self.in_flight)
                if free <= 0:
                    await asyncio.wait(
                        self.in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                try:
                    msgs = await sub.fetch(free, timeout=self.settings.worker.fetch_wait_s)
                except TimeoutError:  # nothing to fetch (nats-py raises the builtin one)
                    continue
                except nats.errors.Error as error:
                    log.warning("consumer.fetch_failed", error=repr(error))
                    await asyncio.sleep(RECONNECT_PAUSE_S)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._handle(msg, time.monotonic()))
                    self.in_flight.add(task)
                    task.add_done_callback(self.in_flight.discard)
        finally:
            self.ready.clear()
            await self._drain()
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _drain(self) -> None:
        if not self.in_flight:
            return
        log.info("consumer.draining", in_flight=len(self.in_flight))
        _, late = await asyncio.wait(self.in_flight, timeout=self.settings.worker.drain_s)
        for task in late:
            task.cancel()  # never acked: JetStream redelivers after AckWait
        if late:
            await asyncio.wait(late)
            log.warning("consumer.drain_deadline", left_unacked=len(late))

    async def _gateway_ready(self) -> bool:
        breaker = self.gateway.breaker
        if breaker.current_state == "closed":
            return True
        if (left := open_for_s(breaker)) > 0:
            await asyncio.sleep(min(left, 1.0))
            return False
        if await self.gateway.probe():
            log.info("consumer.gateway_back")
            return True
        return False

    async def _handle(self, msg: Msg, fetched_at: float) -> None:
        meta = msg.metadata
        headers = msg.headers or {}
        delivery = Delivery(
            data=msg.data,
            stream_seq=meta.sequence.stream,
            num_delivered=meta.num_delivered,
            traceparent=headers.get("traceparent"),
            replayed=headers.get("Nats-Msg-Id", "").startswith("replay:"),
        )
        if delivery.num_delivered > 1:
            self.metrics.redeliveries.inc()
        structlog.contextvars.bind_contextvars(
            stream_seq=delivery.stream_seq, delivery=delivery.num_delivered
        )
        self.metrics.in_flight.inc()
        heartbeat = _Heartbeat(
            msg, self.settings.heartbeat_s, self.settings.worker.processing_budget_s, self.metrics
        )
        try:
            processed = await self.pipeline.process(delivery)
        finally:
            heartbeat.stop()
            self.metrics.in_flight.dec()
        action = decide(
            processed.result,
            delivery.num_delivered,
            max_deliver=self.settings.nats.max_deliver,
            backoff_s=self.settings.nats.backoff_s,
            ack_wait_s=self.settings.nats.ack_wait_s,
        )
        action = await self._settle(msg, delivery, processed, action)
        self._account(delivery, processed, action, time.monotonic() - fetched_at)
        await self._record(processed, action)

    async def _settle(
        self, msg: Msg, delivery: Delivery, processed: Processed, action: Action
    ) -> Action:
        """The one place that acks, naks, requeues or terminates. Returns what was done."""
        try:
            if isinstance(action, DeadLetter):
                action = await self._dead_letter(msg, delivery, processed, action)
            elif isinstance(action, Requeue):
                action = await self._requeue(msg, delivery)
            if isinstance(action, DeadLetter):
                self.pipeline.failpoints.hit("after_dead_letter_before_term")
                await msg.term()
            elif isinstance(action, Nak):
                await msg.nak(delay=action.delay_s)
            else:
                self.pipeline.failpoints.hit("after_commit_before_ack")
                await msg.ack()
        except nats.errors.Error as error:
            # the connection is down: JetStream redelivers after AckWait; the ledger decides
            log.warning("consumer.settle_failed", error=repr(error))
        return action

    async def _dead_letter(
        self, msg: Msg, delivery: Delivery, processed: Processed, action: DeadLetter
    ) -> Action:
        """Write the dead letter; if that fails, nak: a message is never dropped."""
        if processed.claim is not None and action.reason == "max_deliveries":
            with contextlib.suppress(ChargeWorkerError):
                await self.ledger.give_up(processed.claim, "dead-lettered: max_deliveries")
        try:
            await self.dead_letters.write(
                msg.data,
                reason=action.reason,
                error=processed.result.error or action.reason,
                stream_seq=delivery.stream_seq,
                num_delivered=delivery.num_delivered,
                original=msg.headers,
            )
        except ChargeWorkerError as error:
            log.error("dlq.write_failed", error=str(error))
            return Nak(self.settings.nats.ack_wait_s)
        self.metrics.dead_letters.labels(action.reason).inc()
        return action

    async def _requeue(self, msg: Msg, delivery: Delivery) -> Action:
        """Publish a fresh copy (its deliveries unspent), then the original may be acked."""
        try:
            await self._publish_copy(msg.data, msg.headers, delivery.stream_seq)
        except (nats.errors.Error, TimeoutError) as error:
            # out of deliveries either way: the advisory and reconcile pick the charge up
            log.error("consumer.requeue_failed", error=repr(error))
            return Nak(self.settings.nats.ack_wait_s)
        return Requeue()

    async def _publish_copy(
        self, body: bytes, headers: Mapping[str, str] | None, stream_seq: int
    ) -> None:
        copy = {k: v for k, v in (headers or {}).items() if k != "Nats-Msg-Id"}
        copy["Nats-Msg-Id"] = f"requeue:{stream_seq}"  # one copy, however many workers try
        copy["Charge-Requeued-From"] = str(stream_seq)
        await self.js.publish(self.settings.nats.subject, body, headers=copy, timeout=5)
        self.metrics.requeues.inc()

    async def on_max_deliveries(self, advisory: Msg) -> None:
        """JetStream's MAX_DELIVERIES advisory: a last delivery died with its worker.

        Every worker hears it; the requeue's and the dead letter's `Nats-Msg-Id` keep it to
        one copy and one letter. See `decisions.after_deliveries_ran_out`.
        """
        event = json.loads(advisory.data)
        seq = int(event["stream_seq"])
        stored = await self.dead_letters.stream_copy(seq)
        if stored is None:
            return
        body, headers = stored.data or b"", dict(stored.headers or {})
        try:
            charge = parse(body)
        except PoisonMessage:
            status, valid = None, False
        else:
            status, valid = (
                await self.ledger.status_of(charge.order_id, charge.billing_period),
                True,
            )
        exhausted = _count(headers.get(EXHAUSTED_HEADER))
        verdict = after_deliveries_ran_out(status, valid=valid, exhausted=exhausted)
        log.warning(
            "consumer.deliveries_ran_out",
            stream_seq=seq, ledger_status=status, exhausted=exhausted, verdict=verdict,
        )  # fmt: skip
        self.metrics.exhausted.labels(verdict).inc()
        if verdict == "requeue":
            await self._publish_copy(body, headers | {EXHAUSTED_HEADER: str(exhausted + 1)}, seq)
        elif verdict == "dead_letter":
            await self.dead_letters.write(
                body,
                reason="max_deliveries",
                error=f"deliveries ran out unsettled, {exhausted + 1} time(s) (advisory)",
                stream_seq=seq,
                num_delivered=int(event.get("deliveries", 0)),
                original=stored.headers,
            )
            self.metrics.dead_letters.labels("max_deliveries").inc()

    async def _record(self, processed: Processed, action: Action) -> None:
        """Append this delivery to the charge's story (a final one went with the settle)."""
        charge = processed.charge
        if charge is None or processed.recorded:  # a poison message has no charge
            return
        try:
            await events.record(
                self.ledger.pool,
                charge.order_id,
                charge.billing_period,
                "delivery",
                self.pipeline.owner,
                **processed.story(action),
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
            log.warning("events.write_failed", error=repr(error))

    def _account(
        self, delivery: Delivery, processed: Processed, action: Action, seconds: float
    ) -> None:
        outcome, described = processed.result.outcome, describe(action)
        self.metrics.messages.labels(outcome.value, described["action"]).inc()
        self.metrics.processing.observe(seconds)
        if outcome is Outcome.DUPLICATE:
            self.metrics.duplicates.inc()
        if outcome in (Outcome.CHARGED, Outcome.DECLINED, Outcome.BLOCKED):
            self.metrics.charges.labels(outcome.value).inc()
        charge = processed.charge
        log.info(
            "charge.settled",
            stream_seq=delivery.stream_seq,
            delivery=delivery.num_delivered,
            order_id=charge.order_id if charge else None,
            billing_period=charge.billing_period.isoformat() if charge else None,
            outcome=outcome.value,
            error=processed.result.error,
            **described,
            duration_s=round(seconds, 4),
            trace_id=_trace_id(delivery.traceparent),
        )
        structlog.contextvars.clear_contextvars()


class _Heartbeat:
    """`+WPI` every `interval_s` while a message is processed, up to `budget_s`.

    A timer rather than a task per message: most charges finish before the first beat and
    then cost one cancelled timer.
    """

    def __init__(self, msg: Msg, interval_s: float, budget_s: float, metrics: Metrics) -> None:
        self.msg, self.interval_s, self.metrics = msg, interval_s, metrics
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + budget_s
        self.timer = self.loop.call_later(interval_s, self._beat)
        self.sending: asyncio.Task[None] | None = None

    def _beat(self) -> None:
        if self.loop.time() >= self.deadline:
            return
        if self.sending is None or self.sending.done():  # one `+WPI` in flight at a time
            self.sending = self.loop.create_task(self._send())
        self.timer = self.loop.call_later(self.interval_s, self._beat)

    async def _send(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.msg.in_progress()
            self.metrics.heartbeats.inc()

    def stop(self) -> None:
        self.timer.cancel()
        if self.sending is not None:
            self.sending.cancel()


def _trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) >= 4 else None


def _count(header: str | None) -> int:
    """A non-negative count from a header someone else may have written; junk counts as 0."""
    return int(header) if header and header.isdigit() else 0
