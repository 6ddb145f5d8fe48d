"""The `stripe` adapter: off-session recurring charges as Stripe documents them, through the
official SDK (stripe-python 16, its async client; `stripe_http.py` puts it on the
project's own HTTP client, its retries off: the worker retries, with the same key).

| call       | Stripe                                                                    |
|------------|---------------------------------------------------------------------------|
| `charge`   | `GET /v1/customers/{id}` (its saved card: `invoice_settings.default_`     |
|            | `payment_method`, else its newest card), then `POST /v1/payment_intents`  |
|            | with `customer`, `payment_method`, `off_session=true`, `confirm=true`,    |
|            | `metadata[order_id]`, `metadata[billing_period]` (and                     |
|            | `metadata[attempt]=<n>` for a try n >= 2) and the try's key               |
|            | `Idempotency-Key: <order_id>:<billing_period>` (`:<n>` after for n >= 2)  |
| `lookup`   | `GET /v1/payment_intents?customer=…&created[gte]=<period - 31 days>`,     |
|            | every page, matched on the metadata (every try's intents of the period):  |
|            | a list is read-your-writes; Stripe's Search API is eventually consistent  |
|            | and its documentation says not to use it for that                         |
| `history`  | `GET /v1/payment_intents?created[gte]=…&created[lt]=…`, newest first      |
|            | (Stripe's order), `latest_charge` expanded for `amount_refunded`          |
| `refund`   | `POST /v1/refunds` `payment_intent`, `reason=duplicate`,                  |
|            | `Idempotency-Key: refund:<payment intent id>`                             |
| `retrieve` | `GET /v1/payment_intents/{id}?expand[]=latest_charge`                     |

Every `Idempotency-Key` starts with `CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX` (empty unless set).
The charge id the ledger records is the PaymentIntent's (`pi_…`). How each answer maps:
`stripe_mapping.py`. Every request (a charge is up to three) spends a token of the fleet's rate.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import stripe
from stripe.params import PaymentIntentCreateParams, PaymentIntentListParams

from charge_worker.errors import (
    DependencyUnavailable,
    GatewayRejected,
    OutcomeUnknown,
    SettingsError,
)
from charge_worker.gateway import stripe_mapping as mapping
from charge_worker.gateway.guard import BeforeSend, Guarded
from charge_worker.gateway.protocol import GatewayKind, HistoryOrder, WebhookScheme
from charge_worker.gateway.results import (
    ChargeResult,
    GatewayCharge,
    HistoryPage,
    charge_metadata,
)
from charge_worker.gateway.stripe_http import OwnedHTTPClient
from charge_worker.http import build_client
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewaySettings

STRIPE_API = "https://api.stripe.com"
# A period's charge is made once it is due: at its first day, or a little before when billed
# ahead. Lookups list the customer's intents from this long before the period's first day.
LOOKUP_LEAD = dt.timedelta(days=31)
LOOKUP_MAX_PAGES = 20  # 2,000 intents of one customer since the period: something is wrong
NO_PAYMENT_METHOD = "no_payment_method"
T = TypeVar("T")


class StripeGateway(Guarded):
    """One shared client per process; `transport` is for unit tests only."""

    kind: GatewayKind = "stripe"
    history_order: HistoryOrder = "newest_first"
    webhook_scheme: WebhookScheme = "stripe"
    reads_by_id = True

    def __init__(
        self,
        cfg: GatewaySettings,
        *,
        limiter: RateLimiter | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        api_key = cfg.required_api_key()
        if not api_key.startswith(("sk_", "rk_")):
            raise SettingsError(
                "GATEWAY_API_KEY: a Stripe secret key starts with sk_ (or rk_, restricted)"
            )
        super().__init__(cfg, limiter=limiter)
        base = cfg.url or STRIPE_API
        self.http = OwnedHTTPClient(
            build_client(
                base,
                timeout_s=cfg.gateway_timeout_s,
                max_connections=cfg.gateway_max_connections,
                transport=transport,
            )
        )
        self.stripe = stripe.StripeClient(
            api_key,
            base_addresses={"api": base},
            max_network_retries=0,  # ours: the same key, after a lookup when in doubt
            http_client=self.http,
        )

    async def aclose(self) -> None:
        """Release the connections."""
        await self.http.close_async()

    async def charge(
        self,
        charge: ChargeDue,
        *,
        traceparent: str | None = None,
        before_send: BeforeSend | None = None,
    ) -> ChargeResult:
        """An off-session PaymentIntent with the customer's saved card, confirmed at once:
        up to three requests, `before_send` awaited before the last (the one that charges)."""
        card = await self._saved_card(charge.customer_id)
        if card is None:
            return ChargeResult("declined", None, decline_code=NO_PAYMENT_METHOD)
        metadata = charge_metadata(charge)
        params: PaymentIntentCreateParams = {
            "amount": charge.amount_minor,
            "currency": charge.currency.lower(),
            "customer": charge.customer_id,
            "payment_method": card,
            "off_session": True,
            "confirm": True,
            "metadata": metadata,
        }
        options: stripe.RequestOptions = {"idempotency_key": f"{self.key_prefix}{charge.key}"}
        if traceparent:
            options["headers"] = {"traceparent": traceparent}

        async def create() -> ChargeResult:
            try:
                intent = await self.stripe.v1.payment_intents.create_async(params, options)
            except stripe.CardError as error:
                return mapping.declined(error)
            response = intent.last_response
            replayed = response is not None and (
                str(response.headers.get("Idempotent-Replayed", "")).lower() == "true"
            )
            return mapping.charge_result(intent.to_dict(), replayed=replayed)

        return await self._call("POST /v1/payment_intents", create, before_send=before_send)

    async def _saved_card(self, customer: str) -> str | None:
        """The customer's default payment method, else its newest card, else None."""

        async def read() -> str | None:
            found = await self.stripe.v1.customers.retrieve_async(customer)
            settings = found.to_dict().get("invoice_settings") or {}
            default = settings.get("default_payment_method")
            if isinstance(default, dict):
                default = default.get("id")
            return str(default) if default else None

        async def newest() -> str | None:
            cards = await self.stripe.v1.payment_methods.list_async(
                {"customer": customer, "type": "card", "limit": 1}
            )
            return str(cards.data[0].id) if cards.data else None

        try:
            card = await self._call("GET /v1/customers/{id}", read, absent_ok=True, read=True)
            if card is None:
                card = await self._call("GET /v1/payment_methods", newest, read=True)
        except _Missing as error:
            raise GatewayRejected(f"Stripe has no customer {customer}") from error
        except OutcomeUnknown as error:  # a read: nothing was charged
            raise DependencyUnavailable(str(error)) from error
        return card

    async def lookup(
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        """Every intent of this period (every try's), oldest first: the customer's intents
        created since `LOOKUP_LEAD` before the period, matched on their metadata
        (read-your-writes). A customer's intents are few: `since` is not needed."""
        if not customer_id:
            raise OutcomeUnknown(
                f"a Stripe lookup of {order_id}:{billing_period} needs the customer id"
            )
        since = dt.datetime.combine(billing_period - LOOKUP_LEAD, dt.time(), dt.UTC)
        wanted = (str(order_id), billing_period.isoformat())
        found: list[GatewayCharge] = []
        after: str | None = None
        for _ in range(LOOKUP_MAX_PAGES):
            page = await self._list(
                {"customer": customer_id, "created": {"gte": int(since.timestamp())}}, after
            )
            found += [c for c in page.charges if (c.order_id, c.billing_period) == wanted]
            if not page.has_more or not page.charges:
                return found[::-1]
            after = page.charges[-1].id
        raise OutcomeUnknown(
            f"customer {customer_id} has over {LOOKUP_MAX_PAGES * 100} intents since"
            f" {since.date()}: the lookup of {order_id}:{billing_period} stopped"
        )

    async def history(
        self,
        *,
        created_gte: int,
        created_lt: int,
        starting_after: str | None = None,
        limit: int = 100,
    ) -> HistoryPage:
        """One page of intents created in the window, newest first."""
        return await self._list(
            {"created": {"gte": created_gte, "lt": created_lt}}, starting_after, limit=limit
        )

    async def _list(
        self, params: PaymentIntentListParams, after: str | None, *, limit: int = 100
    ) -> HistoryPage:
        params = params | {"limit": limit, "expand": ["data.latest_charge"]}
        if after:
            params["starting_after"] = after

        async def read() -> HistoryPage:
            page = await self.stripe.v1.payment_intents.list_async(params)
            data = page.to_dict()
            try:
                charges = [mapping.gateway_charge(item) for item in data["data"]]
            except (KeyError, TypeError, ValueError) as error:
                raise OutcomeUnknown(f"unreadable PaymentIntent list: {error!r}") from error
            return HistoryPage(charges, bool(data.get("has_more")))

        return await self._call("GET /v1/payment_intents", read)

    async def refund(self, charge_id: str, *, reason: str = "duplicate") -> str:
        """Refund an intent in full; the refund id, or "already" if it was refunded."""

        async def create() -> str:
            try:
                refund = await self.stripe.v1.refunds.create_async(
                    {"payment_intent": charge_id, "reason": reason},
                    {"idempotency_key": f"{self.key_prefix}refund:{charge_id}"},
                )
            except stripe.InvalidRequestError as error:
                if mapping.already_refunded(error):
                    return "already"
                raise
            return str(refund.id)

        return await self._call("POST /v1/refunds", create)

    async def retrieve(self, charge_id: str) -> GatewayCharge | None:
        """The intent as Stripe holds it now (None: no such intent)."""

        async def read() -> GatewayCharge:
            intent = await self.stripe.v1.payment_intents.retrieve_async(
                charge_id, {"expand": ["latest_charge"]}
            )
            return mapping.gateway_charge(intent.to_dict())

        try:
            return await self._call("GET /v1/payment_intents/{id}", read, absent_ok=True)
        except _Missing:
            return None

    async def probe(self) -> bool:
        """A cheap read that lets an open breaker close again without spending a charge."""
        try:
            await self.history(created_gte=0, created_lt=1, limit=1)
        except (DependencyUnavailable, OutcomeUnknown):
            return False
        return True

    async def _call(
        self,
        what: str,
        request: Callable[[], Awaitable[T]],
        *,
        absent_ok: bool = False,
        read: bool = False,
        before_send: BeforeSend | None = None,
    ) -> T:
        """`request` under the guard, its SDK errors translated inside the breaker.
        `absent_ok`: a 404 `resource_missing` is Stripe's answer about the object in the
        path (`_Missing`), not a wrong URL. `read`: the saved-card read a charge makes
        first, whose success must not reset the breaker's count (`Guarded.guarded`)."""

        async def translated() -> T:
            try:
                return await request()
            except stripe.StripeError as error:
                if absent_ok and mapping.missing(error):
                    raise _Missing(what) from error  # an answer: no breaker count
                raise mapping.domain_error(error) from error

        return await self.guarded(
            what, translated, success_counts=not read, before_send=before_send
        )


class _Missing(GatewayRejected):
    """Stripe has no such object (404 `resource_missing`)."""
