"""The gateway simulator's webhooks (docs/contracts/gateway.md, "Webhooks the gateway sends").

Every change of a charge object becomes an event `{"id": "evt_…", "type", "created", "data":
{"object": <the charge with its revision>}}`, POSTed to `webhook_url` and signed with
`webhook_secret` per Standard Webhooks (`webhook-id` is the event id, the same on every
attempt and copy). The Stripe flavour sends Stripe's envelope (`"object": "event"`,
`api_version`) with its object (a PaymentIntent, a Charge, a Dispute: no revision), signed
`Stripe-Signature: t=<now>,v1=<hex HMAC-SHA256 of "t.body">` with the secret as is. The
YooKassa flavour sends YooKassa's notification `{"type": "notification", "event", "object"}`
(a payment, or a refund for `refund.*`), unsigned (YooKassa's are authenticated by their
source address only), and retries anything but a `200`, over 24 h by default.
A delivery that gets no 2xx within `webhook_timeout_s` is tried again after
each step of `webhook_retry_schedule_s` (the contract's: at once, 30 s, 3 min, then growing
gaps up to 3 days), each step times `webhook_time_scale`, so tests run the schedule in moments.
URL and secret are read at every attempt, as a real gateway reads its endpoint settings.

Chaos: `webhook_reorder` is the probability that an event is held back until a later event
of the same charge has been delivered (or given up on), so it arrives after it: out of
revision order for sure, not by a timing chance; `webhook_reorder_delay_s` (not scaled)
bounds the hold for an event no later one follows. `webhook_duplicate` is the probability
that an event is delivered twice, both copies at once. Draws come from a generator seeded
with the simulator's `seed`.

`GET /_sim/webhooks` lists every delivery and its attempts (`pending`: how many are still
going), so tests can wait for the simulator to be done without sleeping.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from charge_worker.webhooks.signature import signed_headers, stripe_signature

STRIPE_API_VERSION = "2026-10-28.endive"  # stripe-python 16's pinned version
# again at once, 30 s, 3 min, then growing gaps: 246 810 s in all, within the 3 days
CONTRACT_RETRY_SCHEDULE_S = (0.0, 30.0, 180.0, 1800.0, 7200.0, 21600.0, 43200.0, 86400.0, 86400.0)
# YooKassa retries for 24 h; its gaps are not published: growing ones, 85 860 s in all
YOOKASSA_RETRY_SCHEDULE_S = (60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 28800.0)


class WebhookKnobs(Protocol):
    """The part of the gateway simulator's config that shapes delivery."""

    @property
    def seed(self) -> int | None: ...
    @property
    def webhook_url(self) -> str | None: ...
    @property
    def webhook_secret(self) -> str: ...
    @property
    def webhook_retry_schedule_s(self) -> tuple[float, ...]: ...
    @property
    def webhook_time_scale(self) -> float: ...
    @property
    def webhook_timeout_s(self) -> float: ...
    @property
    def webhook_reorder(self) -> float: ...
    @property
    def webhook_reorder_delay_s(self) -> float: ...
    @property
    def webhook_duplicate(self) -> float: ...
    @property
    def flavour(self) -> str: ...


@dataclass
class Delivery:
    """One copy of one event on its way: each attempt's status code or error."""

    event_id: str
    type: str
    charge_id: str
    revision: int
    copy: int
    held_back_s: float
    attempts: list[int | str] = field(default_factory=list)
    delivered: bool = False
    gave_up: bool = False


class WebhookDelivery:
    """Publishes charge changes as webhooks, signed as the flavour signs them (the
    simulator's `ChargeEvents`)."""

    def __init__(self, knobs: Callable[[], WebhookKnobs]) -> None:
        self.knobs = knobs
        self.rng = random.Random()
        self.deliveries: list[Delivery] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._holds: dict[str, list[tuple[int, asyncio.Event]]] = {}
        self.clear()

    def clear(self) -> None:
        """Forget every delivery and stop those still going; reseed."""
        for task in self._tasks:
            task.cancel()
        self.deliveries = []
        self._holds = {}
        self.rng.seed(self.knobs().seed)

    def publish(
        self,
        event_type: str,
        snapshot: dict[str, Any],
        *,
        object_id: str | None = None,
        revision: int | None = None,
    ) -> None:
        """Start delivering an event about `snapshot`; never blocks (no URL: dropped).

        `object_id` and `revision` order the deliveries of one charge (reordering holds an
        event until a later one of the same charge went out); by default the snapshot's own
        (a Stripe object carries no revision: the Stripe flavour passes them)."""
        knobs = self.knobs()
        if knobs.webhook_url is None:
            return
        event_id = f"evt_{self.rng.getrandbits(64):016x}"
        event: dict[str, Any] = {
            "id": event_id,
            "type": event_type,
            "created": int(time.time()),
            "data": {"object": snapshot},
        }
        if knobs.flavour == "stripe":  # Stripe's event envelope
            event |= {"object": "event", "api_version": STRIPE_API_VERSION, "livemode": False}
        elif knobs.flavour == "yookassa":  # no id: the event id only names the delivery here
            event = {"type": "notification", "event": event_type, "object": snapshot}
        body = json.dumps(event).encode()
        object_id = object_id or snapshot["id"]
        revision = revision if revision is not None else snapshot["revision"]
        held_back = (
            knobs.webhook_reorder_delay_s if self.rng.random() < knobs.webhook_reorder else 0
        )
        copies = 2 if self.rng.random() < knobs.webhook_duplicate else 1
        for copy in range(copies):
            delivery = Delivery(event_id, event_type, object_id, revision, copy, held_back)
            self.deliveries.append(delivery)
            task = asyncio.get_running_loop().create_task(self._deliver(delivery, body))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def report(self) -> dict[str, Any]:
        """Every delivery and how many are still going."""
        return {
            "pending": len(self._tasks),
            "deliveries": [asdict(delivery) for delivery in self.deliveries],
        }

    async def aclose(self) -> None:
        """Stop every delivery still going."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _deliver(self, delivery: Delivery, body: bytes) -> None:
        try:
            if delivery.held_back_s:
                await self._overtaken(delivery)
            await self._attempts(delivery, body)
        finally:
            for revision, gate in self._holds.get(delivery.charge_id, []):
                if revision < delivery.revision:
                    gate.set()

    async def _overtaken(self, delivery: Delivery) -> None:
        """Wait until a later event of the charge is done, or the hold's bound."""
        gate = asyncio.Event()
        holds = self._holds.setdefault(delivery.charge_id, [])
        holds.append((delivery.revision, gate))
        try:
            async with asyncio.timeout(delivery.held_back_s):
                await gate.wait()
        except TimeoutError:
            pass
        finally:
            holds.remove((delivery.revision, gate))

    async def _attempts(self, delivery: Delivery, body: bytes) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            for step_s in (0.0, *self.knobs().webhook_retry_schedule_s):
                knobs = self.knobs()
                await asyncio.sleep(step_s * knobs.webhook_time_scale)
                if knobs.webhook_url is None:
                    break
                answer = await _attempt(client, knobs, delivery.event_id, body)
                delivery.attempts.append(answer)
                if answer in ((200,) if knobs.flavour == "yookassa" else range(200, 300)):
                    delivery.delivered = True
                    return
        delivery.gave_up = True


async def _attempt(
    client: httpx.AsyncClient, knobs: WebhookKnobs, event_id: str, body: bytes
) -> int | str:
    """One POST: its status code, or the name of the error that stood for an answer."""
    assert knobs.webhook_url is not None
    headers = {"content-type": "application/json"}
    if knobs.flavour == "stripe":
        headers["Stripe-Signature"] = stripe_signature(knobs.webhook_secret, body)
    elif knobs.flavour != "yookassa":  # YooKassa signs nothing
        headers |= signed_headers(knobs.webhook_secret, event_id, body)
    try:
        async with asyncio.timeout(knobs.webhook_timeout_s):  # httpx's timeout is per phase
            response = await client.post(knobs.webhook_url, content=body, headers=headers)
    except (httpx.HTTPError, TimeoutError) as error:
        return type(error).__name__
    return response.status_code
