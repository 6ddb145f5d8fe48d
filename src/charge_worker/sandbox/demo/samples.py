"""The demo's sample due charges: ordinary ones, and each kind of trouble the worker absorbs.

Twenty ordinary customers, a card the gateway declines on every try, a customer scoring
blocks, a duplicate publish (JetStream drops it), the same charge under a new `Nats-Msg-Id`
(two stream messages, one key: the ledger absorbs it), a conflicting copy (same key, another
amount), two poison messages, and three declines whose classes lead to different paths
(docs/contracts/gateway.md, "Retrying a declined renewal"): a soft one the card recovers
from on try 2, a hard one, and an expired card that waits for its customer.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

import click
from nats.js import JetStreamContext

from charge_worker.messages import ChargeDue

PERIOD = dt.date(2026, 12, 1)
ORDINARY = (
    "alice",
    "bob",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "ken",
    "leo",
    "mia",
    "nina",
    "oscar",
    "peggy",
    "quinn",
    "rupert",
    "sybil",
    "trent",
    "uma",
)
CURRENCIES = ("RUB", "EUR", "USD")
DECLINED_CUSTOMER = "cus_decline_carol"  # the gateway simulator declines cus_decline*
BLOCKED_CUSTOMER = "cus_block_mallory"  # the scoring simulator blocks cus_block*
# the gateway simulator's cards (sandbox/gateway/cards.py)
SOFT_CUSTOMER = "cus_soft2_dan"  # insufficient_funds on try 1, charged on try 2
# a hard decline (never tried again) and one that waits for the customer, in the codes of
# the provider the demo runs on (YooKassa's: ADR 0008)
HARD_CODE = {"yookassa": "permission_revoked"}
ACTION_CODE = {"yookassa": "card_expired"}


def hard_customer(kind: str) -> str:
    """The customer whose card the provider declines for good."""
    return f"cus_code_{HARD_CODE.get(kind, 'stolen_card')}_victor"


def action_customer(kind: str) -> str:
    """The customer whose card waits for them to act (they update it later)."""
    return f"cus_code_{ACTION_CODE.get(kind, 'expired_card')}_wendy"


@dataclass(frozen=True)
class Published:
    """What the demo put on the stream."""

    period: dt.date
    order_ids: tuple[int, ...]  # every valid charge, one per key
    messages: int  # stream messages written (the dropped duplicate is not one)
    declined_order: int
    blocked_order: int
    conflict_order: int
    soft_order: int
    hard_order: int
    action_order: int
    action_customer: str


def sample(order_id: int, customer: str, amount_minor: int, currency: str) -> ChargeDue:
    """A valid `charge.due/v1` message for `order_id` in the demo's billing period."""
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD,
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer,
            "amount_minor": amount_minor,
            "currency": currency,
            "due_at": dt.datetime(PERIOD.year, PERIOD.month, PERIOD.day, tzinfo=dt.UTC),
        },
        strict=False,
    )


def _line(what: str, detail: str) -> None:
    click.echo(f"    {what:<52} {detail}")


async def publish_samples(
    js: JetStreamContext, subject: str, order_base: int, kind: str = "contract"
) -> Published:
    """Publish the sample set to `subject`, one line per kind of message; the declines in
    the codes of the provider `kind` (`GATEWAY_KIND`)."""

    written: list[int] = []

    async def put(body: bytes, msg_id: str) -> int:
        ack = await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
        written.append(ack.seq)
        return ack.seq

    ordinary = [
        sample(order_base + i, f"cus_{name}", 1000 * (i + 1) + 990, CURRENCIES[i % 3])
        for i, name in enumerate(ORDINARY)
    ]
    seqs = [await put(charge.to_json(), charge.msg_id) for charge in ordinary]
    first, last = ordinary[0].order_id, ordinary[-1].order_id
    _line(f"{len(ordinary)} ordinary charges, orders {first}..{last}", f"seq {seqs[0]}..{seqs[-1]}")
    declined = sample(last + 1, DECLINED_CUSTOMER, 1500, "USD")
    seq = await put(declined.to_json(), declined.msg_id)
    _line(f"order {declined.order_id}: {DECLINED_CUSTOMER} (gateway declines)", f"seq {seq}")
    blocked = sample(last + 2, BLOCKED_CUSTOMER, 250000, "RUB")
    seq = await put(blocked.to_json(), blocked.msg_id)
    _line(f"order {blocked.order_id}: {BLOCKED_CUSTOMER} (scoring blocks)", f"seq {seq}")

    again = ordinary[0]
    ack = await js.publish(subject, again.to_json(), headers={"Nats-Msg-Id": again.msg_id})
    _line(
        f"order {again.order_id} again, same Nats-Msg-Id",
        "dropped by JetStream (duplicate)" if ack.duplicate else f"NOT deduplicated: seq {ack.seq}",
    )
    retried = ordinary[1]
    seq = await put(retried.to_json(), f"{retried.msg_id}:retry")
    _line(f"order {retried.order_id} again, new Nats-Msg-Id", f"seq {seq}: 2nd message, same key")
    original = ordinary[2]
    amended = sample(
        original.order_id, original.customer_id, original.amount_minor + 1, original.currency
    )
    seq = await put(amended.to_json(), f"{amended.msg_id}:amended")
    _line(f"order {amended.order_id} again with another amount", f"seq {seq}: a conflict")
    seq = await put(b"order 1 please, {not json", "demo:poison:not-json")
    _line("a body that is not JSON", f"seq {seq}: poison")
    zero = json.loads(sample(last + 3, "cus_zero", 1, "RUB").to_json()) | {"amount_minor": 0}
    seq = await put(json.dumps(zero).encode(), "demo:poison:zero")
    _line(f"order {last + 3} with amount 0", f"seq {seq}: poison")
    declines = [
        (sample(last + 4, SOFT_CUSTOMER, 4900, "EUR"), "insufficient_funds on try 1 only"),
        (sample(last + 5, hard_customer(kind), 7500, "USD"), "a hard decline"),
        (sample(last + 6, action_customer(kind), 12900, "RUB"), "the customer must act"),
    ]
    for charge, what in declines:
        seq = await put(charge.to_json(), charge.msg_id)
        _line(f"order {charge.order_id}: {charge.customer_id}", f"seq {seq}: {what}")
    soft, hard, action = (charge.order_id for charge, _ in declines)

    return Published(
        period=PERIOD,
        order_ids=(
            *(c.order_id for c in ordinary),
            declined.order_id,
            blocked.order_id,
            soft,
            hard,
            action,
        ),
        messages=len(written),
        declined_order=declined.order_id,
        blocked_order=blocked.order_id,
        conflict_order=amended.order_id,
        soft_order=soft,
        hard_order=hard,
        action_order=action,
        action_customer=action_customer(kind),
    )
