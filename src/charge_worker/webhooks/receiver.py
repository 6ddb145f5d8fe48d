"""`POST /webhooks/gateway`: check, verify, journal, answer. Nothing slow happens here.

In this order, each step refusing with no side effect:

| step                                                    | refused with              |
|---------------------------------------------------------|---------------------------|
| `Content-Length` over the limit (nothing read yet)      | 413                       |
| a signature header missing or malformed                 | 400                       |
| `webhook-timestamp` further from now than the tolerance | 401                       |
| the body, read as a stream, passes the limit (stops)    | 413                       |
| the body is not complete within the body deadline       | 408                       |
| no signature matches a configured secret                | 401                       |
| the body is no event of the contract                    | 400                       |
| the journal insert fails or outlasts `JOURNAL_BUDGET_S` | 503 (the gateway retries) |

Then `200`, whether the event is new or a redelivery (counted as a duplicate). Applying it
is the processor's business, after the answer. Log lines carry the event and message ids,
never a secret or a signature.

The `stripe` scheme (`GATEWAY_KIND=stripe`) checks `Stripe-Signature` instead, and reads
Stripe's event envelope: its object (a PaymentIntent, or a Charge or Dispute naming one)
carries no revision, so the journal row names the PaymentIntent and the processor applies
the PaymentIntent as the adapter re-fetches it (`STRIPE_EVENT_TYPES`). Event types the
ledger has no use for, and a Charge or Dispute naming no PaymentIntent, are answered 200 and
not journaled (`ignored`); a PaymentIntent without our `order_id`/`billing_period` metadata
(Checkout, Billing, another integration) is journaled `ignored`, final at once: answered 200,
never retried, never reviewed.

The `yookassa` scheme (`GATEWAY_KIND=yookassa`) has no signature: a delivery is taken only
from YooKassa's networks (`sources.SourceCheck`, checked first: `403` outside them, nothing
read), and its body only names the payment to re-fetch, as for Stripe. A notification has no
id of its own: it is journaled as `<event>:<object id>`, so a duplicate delivery of one
event about one object is one row; a refund's under its `payment_id`
(`YOOKASSA_EVENT_TYPES`). Other events (`payment.waiting_for_capture`: we always capture)
are answered 200 and not journaled. Whether a payment is ours is the re-fetched payment's
to say (its metadata): the processor marks a payment of another integration `ignored`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from charge_worker import tracing
from charge_worker.errors import (
    DeliveryRejected,
    DeliveryTooLarge,
    DeliveryTooSlow,
    DependencyUnavailable,
    MalformedDelivery,
)
from charge_worker.webhooks.inbox import Entry, Inbox
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.signature import Scheme, StripeVerifier, Verifier
from charge_worker.webhooks.sources import ForeignSource, SourceCheck

log = structlog.get_logger(__name__)
JOURNAL_BUDGET_S = 3.0  # the gateway gives up on an answer after 5 s
Id = Annotated[str, Field(min_length=1, max_length=255)]
# Stripe's event types the ledger uses -> the journal's (`rules.EVENT_TYPES`)
STRIPE_EVENT_TYPES = {
    "payment_intent.succeeded": "charge.succeeded",
    "payment_intent.payment_failed": "charge.failed",
    "payment_intent.processing": "charge.processing",
    "charge.refunded": "charge.refunded",
    "charge.dispute.created": "charge.dispute_created",
}
# journaled for events of objects the processor re-fetches (Stripe, YooKassa); it applies
# the fetched object at the fetch's own revision
STRIPE_REVISION = 1
# YooKassa's notification events the ledger uses -> the journal's (`rules.EVENT_TYPES`)
YOOKASSA_EVENT_TYPES = {
    "payment.succeeded": "charge.succeeded",
    "payment.canceled": "charge.failed",
    "refund.succeeded": "charge.refunded",
}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class ChargeObject(_Model):
    """The charge snapshot an event carries. A refunded charge keeps `status: "succeeded"`
    and says `refunded` (in full) and `amount_refunded`; a gateway from before that contract
    sent `status: "refunded"` and neither field, which is read the same way (`rules.state_of`)."""

    id: Id
    status: Annotated[str, Field(max_length=64)]
    revision: Annotated[StrictInt, Field(ge=1, le=2**63 - 1)]
    refunded: StrictBool = False
    amount_refunded: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] = 0
    metadata: dict[str, Any] = Field(default_factory=dict)


class EventData(_Model):
    object: ChargeObject


class GatewayEvent(_Model):
    """A webhook body (docs/contracts/gateway.md)."""

    id: Id
    type: Annotated[str, Field(min_length=1, max_length=100)]
    created: StrictInt
    data: EventData

    def key(self) -> tuple[int | None, dt.date | None]:
        """The ledger key from the charge's metadata; (None, None) when it has none."""
        return _key_of(self.data.object.metadata)


def parse_event(body: bytes) -> GatewayEvent:
    """The event, or `MalformedDelivery` saying what is wrong (no body text in it)."""
    try:
        return GatewayEvent.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise MalformedDelivery(f"not a gateway event: {where}: {first['msg']}") from error


class StripeObject(_Model):
    """A Stripe event's object: a PaymentIntent (`pi_…`), or a Charge or Dispute naming
    its PaymentIntent (`payment_intent`)."""

    id: Id
    object: Annotated[str, Field(max_length=64)] = ""
    payment_intent: Id | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def is_intent(self) -> bool:
        return self.object == "payment_intent" or self.id.startswith("pi_")

    @property
    def intent_id(self) -> str | None:
        """The PaymentIntent the event is about (the ledger's `gateway_charge_id`); None
        for a Charge or Dispute naming none (made without one: not by us)."""
        return self.id if self.is_intent else self.payment_intent


class StripeEventData(_Model):
    object: StripeObject


class StripeEvent(_Model):
    """A Stripe webhook body (`"object": "event"`)."""

    id: Id
    type: Annotated[str, Field(min_length=1, max_length=100)]
    created: StrictInt
    data: StripeEventData


def parse_stripe_event(body: bytes) -> StripeEvent:
    """The Stripe event, or `MalformedDelivery` saying what is wrong (no body text in it)."""
    try:
        return StripeEvent.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise MalformedDelivery(f"not a Stripe event: {where}: {first['msg']}") from error


class YooKassaObject(_Model):
    """A notification's object: a payment, or a refund naming its payment (`payment_id`)."""

    id: Id
    payment_id: Id | None = None


class YooKassaNotification(_Model):
    """A YooKassa notification body (`"type": "notification"`); it carries no id."""

    type: Literal["notification"]
    event: Annotated[str, Field(min_length=1, max_length=100)]
    object: YooKassaObject


def parse_notification(body: bytes) -> YooKassaNotification:
    """The notification, or `MalformedDelivery` saying what is wrong (no body text in it)."""
    try:
        return YooKassaNotification.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise MalformedDelivery(f"not a YooKassa notification: {where}: {first['msg']}") from error


def _yookassa_entry(source: str, body: bytes) -> Entry | None:
    """The journal row of a notification from YooKassa's networks; None for an event the
    ledger does not use. Only the event and the object's id (a refund's `payment_id`) are
    read: an unsigned body decides nothing else, not even whether the payment is ours (a
    body stripped of our metadata, arriving first, would otherwise take the real delivery's
    event id as `ignored`). The processor re-fetches the payment and finds out."""
    notification = parse_notification(body)
    kind = YOOKASSA_EVENT_TYPES.get(notification.event)
    if kind is None:
        return None
    found = notification.object
    payment = found.payment_id if notification.event.startswith("refund.") else found.id
    if payment is None:
        raise MalformedDelivery(f"{notification.event} names no payment_id")
    event_id = f"{notification.event}:{found.id}"[:255]
    return Entry(
        source, event_id, event_id, kind, payment, STRIPE_REVISION, None, None, body.decode()
    )


def _key_of(metadata: dict[str, Any]) -> tuple[int | None, dt.date | None]:
    """`metadata[order_id]` and `metadata[billing_period]`; (None, None) unless both read."""
    order_id, period = metadata.get("order_id"), metadata.get("billing_period")
    if not (isinstance(order_id, str) and order_id.isdigit() and isinstance(period, str)):
        return None, None
    try:
        return int(order_id), dt.date.fromisoformat(period)
    except ValueError:
        return None, None


def journal_entry(source: str, scheme: Scheme, body: bytes, message_id: str) -> Entry | None:
    """The journal row of a verified body; None for a Stripe or YooKassa event the ledger
    does not use (its type, or a charge naming no intent). `MalformedDelivery` when the body
    is no event of the scheme."""
    if scheme == "yookassa":
        return _yookassa_entry(source, body)
    if scheme == "stripe":
        stripe_event = parse_stripe_event(body)
        kind = STRIPE_EVENT_TYPES.get(stripe_event.type)
        found = stripe_event.data.object
        intent = found.intent_id
        if kind is None or intent is None:
            return None
        order_id, period = _key_of(found.metadata)
        # an intent carries its metadata: without ours it is another integration's. A
        # Charge's or Dispute's may not: the processor re-fetches its intent to know.
        foreign = found.is_intent and order_id is None
        return Entry(
            source,
            stripe_event.id,
            message_id or stripe_event.id,
            kind,
            intent,
            STRIPE_REVISION,
            order_id,
            period,
            body.decode(),
            "ignored" if foreign else "received",
        )
    event = parse_event(body)
    order_id, period = event.key()
    return Entry(
        source,
        event.id,
        message_id,
        event.type,
        event.data.object.id,
        event.data.object.revision,
        order_id,
        period,
        body.decode(),
    )


def check_length(request: Request, max_bytes: int) -> None:
    """`DeliveryTooLarge` when the declared `Content-Length` is over `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise DeliveryTooLarge(f"Content-Length is over {max_bytes} bytes")


async def read_limited(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, or `DeliveryTooLarge` as soon as it passes `max_bytes` (the rest unread),
    or `DeliveryTooSlow` when it is not complete within `timeout_s`."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise DeliveryTooLarge(f"the body is over {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError as error:
        raise DeliveryTooSlow(f"the body took over {timeout_s:g}s") from error
    except ClientDisconnect as error:
        raise MalformedDelivery("the client left before the body was complete") from error
    return b"".join(chunks)


async def read_verified(
    request: Request,
    verifier: Verifier | StripeVerifier | None,
    max_bytes: int,
    timeout_s: float,
) -> tuple[bytes, str]:
    """The body and its signed message id: the signature headers and their time checked
    before the body is read, the signature after. Unsigned (`verifier=None`): the body, ""."""
    if verifier is None:
        return await read_limited(request, max_bytes, timeout_s), ""
    signed = verifier.read_headers(request.headers)
    verifier.check_time(signed)
    body = await read_limited(request, max_bytes, timeout_s)
    verifier.verify(body, signed)
    return body, signed.message_id


def receiver(
    *,
    source: str,
    verifier: Verifier | StripeVerifier | None,
    inbox: Inbox,
    scheme: Scheme = "standard",
    sources: SourceCheck | None = None,
    metrics: WebhookMetrics,
    max_bytes: int,
    body_timeout_s: float,
    on_journaled: Callable[[], None] = lambda: None,
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint for one source's webhooks: signed ones checked by `verifier`, unsigned
    ones (`verifier=None`) by where they come from (`sources`)."""
    assert verifier is not None or sources is not None, "an endpoint that admits anyone"

    @tracing.served("POST", f"/webhooks/{source}")
    async def receive(request: Request) -> Response:
        started = time.perf_counter()
        message_id = request.headers.get("webhook-id", "")[:255]
        sender: dict[str, str] = {}
        try:
            if sources is not None:  # before anything is read
                peer = request.client.host if request.client else None
                found = sources.check(peer, request.headers.getlist("x-forwarded-for"))
                sender = {"address": found.text}
            check_length(request, max_bytes)
            body, signed_id = await read_verified(request, verifier, max_bytes, body_timeout_s)
            entry = journal_entry(source, scheme, body, signed_id)
        except DeliveryRejected as rejected:
            if isinstance(rejected, ForeignSource):
                sender = {"address": rejected.source.text}
            metrics.deliveries.labels(source, rejected.result).inc()
            log.info(
                "webhook.rejected",
                source=source,
                message_id=message_id,
                status=rejected.status_code,
                reason=str(rejected),
                **sender,
            )
            return JSONResponse({"error": str(rejected)}, status_code=rejected.status_code)
        if tracing.enabled() and entry is not None:
            tracing.note(
                {
                    "charge_worker.event_id": entry.event_id,
                    "charge_worker.charge_id": entry.object_id,
                }
            )
        if entry is None:  # a Stripe or YooKassa event about nothing the ledger records
            metrics.deliveries.labels(source, "ignored").inc()
            return JSONResponse({"received": None, "ignored": True})
        try:
            async with asyncio.timeout(JOURNAL_BUDGET_S):
                new = await inbox.journal(entry)
        except MalformedDelivery as rejected:
            metrics.deliveries.labels(source, rejected.result).inc()
            log.info(
                "webhook.rejected", source=source, event_id=entry.event_id, reason=str(rejected)
            )
            return JSONResponse({"error": str(rejected)}, status_code=400)
        except (TimeoutError, DependencyUnavailable) as error:
            metrics.deliveries.labels(source, "unavailable").inc()
            log.warning(
                "webhook.not_journaled",
                source=source,
                event_id=entry.event_id,
                error=f"{type(error).__name__}: {error}",
            )
            return JSONResponse(
                {"error": "the journal is unavailable; retry"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        ignored = entry.status == "ignored"
        result = "ignored" if ignored else "journaled"
        metrics.deliveries.labels(source, result if new else "duplicate").inc()
        if new and not ignored:
            on_journaled()
        else:
            metrics.duplicates.labels(source).inc()
        metrics.journal_seconds.observe(time.perf_counter() - started)
        log.info(
            "webhook.received",
            source=source,
            event_id=entry.event_id,
            message_id=entry.message_id,
            type=entry.event_type,
            charge_id=entry.object_id,
            revision=entry.revision,
            duplicate=not new,
            ignored=ignored,
            **sender,
        )
        answer: dict[str, object] = {"received": entry.event_id, "duplicate": not new}
        return JSONResponse(answer | ({"ignored": True} if ignored else {}))

    return receive
