"""The pull loop: fetch to free capacity, hand each message to the pipeline, act, drain.

A fetched message's AckWait clock is already running, so the loop fetches only as many
messages as it has free slots. Each message goes one way (`_handle`): under a heartbeat
(`+WPI`), `Pipeline.conclude` turns it into what it came to and the action it calls for
(decided and recorded there); `_act` executes that action, once, and is the one place that
acks, naks, requeues or terminates; `_account` counts it and writes its canonical line (a
redelivery by its cause, known once the claim has read the ledger row: asked for by a nak,
or `unacked`).
While the gateway's breaker is open nothing is fetched (messages wait in the stream and
spend no deliveries); a cheap probe closes it again. On stop: no more fetches, in-flight
work gets `drain_s` to finish, and anything cancelled is left un-acked for JetStream to
redeliver.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Protocol, assert_never

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry.trace import Span, StatusCode

from charge_worker import tracing
from charge_worker.errors import ChargeWorkerError
from charge_worker.gateway import GatewayClient
from charge_worker.ledger import Settlement
from charge_worker.messages import ChargeDue, valid_traceparent
from charge_worker.settings import Settings
from charge_worker.worker.decisions import (
    Ack,
    Action,
    DeadLetter,
    Nak,
    Outcome,
    Policy,
    Requeue,
    describe,
)
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.heartbeat import Heartbeats
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Concluded, Delivery, Pipeline, Processed

log = structlog.get_logger(__name__)
RECONNECT_PAUSE_S = 0.5
THROTTLED_PAUSE_S = 0.05


class Message(Protocol):
    """A delivered JetStream message, as the consumer uses it: nats-py's `Msg`, or
    `tests/support/fakes.FakeMessage` in unit tests."""

    @property
    def subject(self) -> str: ...
    @property
    def reply(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def headers(self) -> dict[str, str] | None: ...
    @property
    def metadata(self) -> Msg.Metadata: ...
    async def ack(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def term(self) -> None: ...
    async def in_progress(self) -> None: ...


class HandOver(Protocol):
    """Where a message goes that is not acked or nak'd: `dlq.DeadLetters` (the dead-letter
    stream, and a fresh copy on the charges subject), or `FakeDeadLetters` in unit tests."""

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
        """Store a dead letter; `DependencyUnavailable` if it could not be."""

    async def requeue(
        self, body: bytes, headers: Mapping[str, object] | None, *, from_seq: int
    ) -> int:
        """Publish a fresh copy; its stream sequence. `DependencyUnavailable` if it could
        not be."""


class Consumer:
    def __init__(
        self,
        settings: Settings,
        *,
        js: JetStreamContext,
        pipeline: Pipeline,
        dead_letters: HandOver,
        gateway: GatewayClient,
        metrics: Metrics,
        failpoints: Failpoints,
    ) -> None:
        self.settings = settings
        self.policy = Policy.of(settings)
        self.js = js
        self.pipeline = pipeline
        self.dead_letters = dead_letters
        self.gateway = gateway
        self.metrics = metrics
        self.failpoints = failpoints
        self.heartbeats = Heartbeats(
            settings.heartbeat_s, settings.worker.processing_budget_s, metrics
        )
        # read at each scrape: no lock taken twice per message
        metrics.in_flight.set_function(lambda: len(self.heartbeats.beating))
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
                # fetch no more than the fleet's gateway rate lets us send: the rest waits
                # in the stream and spends no delivery
                free = await self.gateway.limiter.reserve(free)
                if free <= 0:
                    await asyncio.sleep(THROTTLED_PAUSE_S)
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
        if breaker.state == "closed":
            return True
        if (left := breaker.open_for_s()) > 0:
            await asyncio.sleep(min(left, 1.0))
            return False
        if await self.gateway.probe():
            log.info("consumer.gateway_back")
            return True
        return False

    async def _handle(self, msg: Message, fetched_at: float) -> None:
        """One message, fetch to ack, in a task of its own (`run`): concluded by the pipeline
        under a heartbeat, its action executed once, counted and told in one canonical
        line; one span, and the task's lines bound to the delivery."""
        delivery = _delivery(msg)
        # this task's lines name the delivery, and once parsed the charge (`pipeline`)
        structlog.contextvars.bind_contextvars(
            stream_seq=delivery.stream_seq, delivery=delivery.num_delivered
        )
        name = f"process {msg.subject}"
        attributes = self._span_attributes(msg, delivery) if tracing.enabled() else None
        with tracing.continued(name, delivery.traceparent, attributes) as span:
            beat = self.heartbeats.start(msg)
            try:
                concluded = await self.pipeline.conclude(delivery, self.policy)
            finally:
                self.heartbeats.stop(beat)
            done = await self._act(msg, concluded)
            self._account(concluded.processed, done, time.monotonic() - fetched_at)
            if span.is_recording():
                _annotate(span, concluded.processed, done)

    def _span_attributes(self, msg: Message, delivery: Delivery) -> tracing.Attributes:
        headers = msg.headers or {}
        return tracing.messaging("process", msg.subject, headers.get("Nats-Msg-Id")) | {
            "messaging.consumer.group.name": self.settings.nats.durable,
            "messaging.message.body.size": len(msg.data),
            "charge_worker.stream_seq": delivery.stream_seq,
            "charge_worker.delivery": delivery.num_delivered,
        }

    async def _act(self, msg: Message, concluded: Concluded) -> Action:
        """The one place that acks, naks, requeues or terminates. Returns what was done: a
        dead letter or a fresh copy that cannot be stored becomes a nak (nothing is
        dropped: the message comes back after AckWait), and the delivery's story says so."""
        processed, action = concluded.processed, concluded.action
        try:
            await self._execute(msg, processed, action)
        except ChargeWorkerError as error:  # the dead letter or the copy was not stored
            # a requeue left undone is picked up by the advisory and by reconcile
            log.error("dlq.write_failed", action=describe(action)["action"], error=str(error))
            action = Nak(self.settings.nats.ack_wait_s)
            await self.pipeline.tell(processed, action)
            await self._execute(msg, processed, action)
        return action

    async def _execute(self, msg: Message, processed: Processed, action: Action) -> None:
        """Tell JetStream `action`. A dead letter or a fresh copy is stored first: when it
        cannot be, `ChargeWorkerError` is raised and the message is left untouched."""
        delivery = processed.delivery
        try:
            match action:
                case Ack():
                    self.failpoints.hit("after_commit_before_ack")
                    await msg.ack()
                case Nak(delay_s=delay_s):
                    await msg.nak(delay=delay_s)
                case DeadLetter(reason=reason):
                    await self.dead_letters.write(
                        msg.data,
                        reason=reason,
                        error=processed.result.error or reason,
                        stream_seq=delivery.stream_seq,
                        num_delivered=delivery.num_delivered,
                        original=msg.headers,
                    )
                    self.metrics.dead_letters.labels(reason).inc()
                    self.failpoints.hit("after_dead_letter_before_term")
                    await msg.term()
                case Requeue():
                    seq = await self.dead_letters.requeue(
                        msg.data, msg.headers, from_seq=delivery.stream_seq
                    )
                    self.metrics.requeues.inc()
                    await self.pipeline.requeued(processed, seq)
                    self.failpoints.hit("after_commit_before_ack")
                    await msg.ack()
                case _:
                    assert_never(action)
        except nats.errors.Error as error:
            # the connection is down: JetStream redelivers after AckWait; the ledger decides
            log.warning("consumer.settle_failed", error=repr(error))

    def _count_try(self, charge: ChargeDue, settled: Settlement) -> None:
        """A try ended with its state written: by what it came to, and what retries won."""
        retry = charge.attempt > 1
        kind = settled.decline_class or "none"
        self.metrics.tries.labels(settled.status, kind, "retry" if retry else "first").inc()
        if retry and settled.status == "succeeded":
            self.metrics.recovered.labels(charge.currency).inc(charge.amount_minor)
        if settled.exhausted:
            self.metrics.periods_exhausted.inc()

    def _account(self, processed: Processed, action: Action, seconds: float) -> None:
        delivery = processed.delivery
        outcome, described = processed.result.outcome, describe(action)
        self.metrics.messages.labels(outcome.value, str(described["action"])).inc()
        self.metrics.processing.observe(seconds)
        # counted once its cause is known: after the claim read the row's nak
        if (redelivery := processed.redelivery) is not None:
            self.metrics.redeliveries.labels(redelivery.value).inc()
        if outcome is Outcome.DUPLICATE:
            self.metrics.duplicates.inc()
        if outcome in (Outcome.CHARGED, Outcome.DECLINED, Outcome.BLOCKED):
            self.metrics.charges.labels(outcome.value).inc()
        charge = processed.charge
        if (settled := processed.settlement) is not None and charge is not None:
            self._count_try(charge, settled)
        log.info(
            "charge.settled",
            stream_seq=delivery.stream_seq,
            delivery=delivery.num_delivered,
            redelivery=redelivery.value if redelivery else None,
            order_id=charge.order_id if charge else None,
            billing_period=charge.billing_period.isoformat() if charge else None,
            outcome=outcome.value,
            error=processed.result.error,
            **described,
            duration_s=round(seconds, 4),
            trace_id=tracing.trace_id(delivery.traceparent),  # the span's, when one is recorded
        )


def _delivery(msg: Message) -> Delivery:
    stream_seq, num_delivered = position(msg)
    headers = msg.headers or {}
    return Delivery(
        data=msg.data,
        stream_seq=stream_seq,
        num_delivered=num_delivered,
        traceparent=valid_traceparent(headers.get("traceparent")),
        replayed=headers.get("Nats-Msg-Id", "").startswith("replay:"),
    )


def position(msg: Message) -> tuple[int, int]:
    """The message's stream sequence and delivery count, read off its ack subject:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.…` (9 tokens), or with a domain
    and an account hash after `ACK` (11 or more). `msg.metadata` parses the same subject
    into five objects, a datetime among them, which the hot path does not need; anything
    else goes to it, and it raises what nats-py raises."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"] and (len(tokens) == 9 or len(tokens) >= 11):
        delivered = 4 if len(tokens) == 9 else 6
        return int(tokens[delivered + 1]), int(tokens[delivered])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_delivered


def _annotate(span: Span, processed: Processed, action: Action) -> None:
    """What the delivery came to, on its span: the charge, the outcome and the action (the
    `charge.settled` line's fields, under `charge_worker.`)."""
    result = processed.result
    attributes: tracing.Attributes = {"charge_worker.outcome": result.outcome.value}
    for key, value in describe(action).items():
        if isinstance(value, str | int | float):
            attributes[f"charge_worker.{key}"] = value
    if charge := processed.charge:
        attributes["charge_worker.order_id"] = charge.order_id
        attributes["charge_worker.billing_period"] = charge.billing_period.isoformat()
    if result.error:
        attributes["charge_worker.error"] = result.error
    span.set_attributes(attributes)
    if isinstance(action, DeadLetter) or result.outcome is Outcome.CRASHED:
        span.set_status(StatusCode.ERROR, result.error or result.outcome.value)
