"""What each scheme's delivery body is, and the journal row it makes (`journal_entry`).

The `standard` scheme's body is the contract's event (docs/contracts/gateway.md): its
charge snapshot carries the revision the processor applies it at.

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

import datetime as dt
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from charge_worker.errors import MalformedDelivery
from charge_worker.webhooks.inbox import Entry
from charge_worker.webhooks.signature import Scheme

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


M = TypeVar("M", bound=BaseModel)


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


def _parsed(model: type[M], body: bytes, what: str) -> M:
    """`body` as `model`, or `MalformedDelivery` saying what is wrong (no body text in it)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise MalformedDelivery(f"not {what}: {where}: {first['msg']}") from error


def parse_event(body: bytes) -> GatewayEvent:
    """The event, or `MalformedDelivery` saying what is wrong."""
    return _parsed(GatewayEvent, body, "a gateway event")


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
    """The Stripe event, or `MalformedDelivery` saying what is wrong."""
    return _parsed(StripeEvent, body, "a Stripe event")


# a YooKassa object's id (a UUID): it goes into the re-fetch's path, so nothing else
YooKassaId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class YooKassaObject(_Model):
    """A notification's object: a payment, or a refund naming its payment (`payment_id`)."""

    id: YooKassaId
    payment_id: YooKassaId | None = None


class YooKassaNotification(_Model):
    """A YooKassa notification body (`"type": "notification"`); it carries no id."""

    type: Literal["notification"]
    event: Annotated[str, Field(min_length=1, max_length=100)]
    object: YooKassaObject


def parse_notification(body: bytes) -> YooKassaNotification:
    """The notification, or `MalformedDelivery` saying what is wrong."""
    return _parsed(YooKassaNotification, body, "a YooKassa notification")


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
