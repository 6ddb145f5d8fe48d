"""The gateway simulator's Stripe flavour: the subset of Stripe's API charge-worker uses.

`build_gateway_app(GatewayConfig(flavour="stripe"))` (or `charge-worker sandbox gateway
--config '{"flavour": "stripe"}'`). The same knobs, faults, `/_sim/*` routes and webhook
delivery as the contract flavour (`app.py`), in Stripe's wire format (`stripe_wire.py`):

* `GET /v1/customers/{id}`: every `cus_…` exists, with a saved card as
  `invoice_settings.default_payment_method` (`pm_card_<id>`), except `cus_nocard…` (none);
  `GET /v1/payment_methods?customer=…&type=card` lists it; with `invoice_default` false no
  customer has a default, the card is only listed (a charge is then three requests);
* `POST /v1/payment_intents` (form-encoded; `confirm=true`, `off_session=true`, the
  customer's card): declined as `cards.py` says by the customer and the try
  `metadata[attempt]` names (`402 card_error`, the intent left `requires_payment_method`
  with its `last_payment_error`, and stored; `decline_code` the bank's reason, `code`
  `card_declined` or the reason Stripe names by its own code: `stripe_wire.error_code`),
  `cus_processing…` answers `processing` and succeeds `processing_settle_s` later (a bank
  debit), any other `succeeded`;
* idempotency (`Idempotency-Key`, optional as on Stripe): a replay answers the original
  status and body with `Idempotent-Replayed: true`; other parameters: `400
  idempotency_error`; the key still executing: `409 idempotency_key_in_use`;
* `GET /v1/payment_intents/{id}` and `GET /v1/payment_intents` (`customer`,
  `created[gte|gt|lt|lte]`, `limit` 1..100, `starting_after`), newest first, `expand` of
  `latest_charge` (`amount_refunded`, `refunded`);
* `POST /v1/refunds` (`payment_intent` or `charge`, `reason`): in full; a second one is `400
  charge_already_refunded`;
* errors as Stripe shapes them: 401 and 429 (`rate_limit`, with `Retry-After`) and 409 as
  `invalid_request_error`, 5xx as `api_error`, 402 as `card_error`;
* webhooks `payment_intent.succeeded`, `.payment_failed`, `.processing`, `charge.refunded`,
  `charge.dispute.created`, signed `Stripe-Signature` (`webhooks.py`).

`GET /_sim/charges` shows each PaymentIntent as the contract flavour shows a charge (`status`
succeeded, failed or processing; `idempotency_key`; `metadata`, `attempt` included), so the
chaos checker counts money on either flavour the same way.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from charge_worker.sandbox.gateway.app import GatewaySimulator
from charge_worker.sandbox.gateway.state import ChargeBook, RefundRefused, StoredResponse
from charge_worker.sandbox.gateway.stripe_wire import (
    Intent,
    IntentParams,
    IntentQuery,
    RefundParams,
    StripeError,
    charge_json,
    customer_json,
    decline,
    decode_form,
    expand_of,
    intent_json,
    invalid,
    page,
    parse_intent,
    parse_list,
    parse_refund,
    payment_method_json,
    refund_json,
    sim_json,
)

PROCESSING_PREFIX = "cus_processing"  # a bank debit: succeeds `processing_settle_s` later
NO_CARD_PREFIX = "cus_nocard"  # a customer with no saved payment method
Handler = Callable[[Request], Any]


def default_payment_method(customer: str) -> str | None:
    """The card a customer saved (None for `cus_nocard…`)."""
    if customer.startswith(NO_CARD_PREFIX):
        return None
    return f"pm_card_{customer.removeprefix('cus_')}"


class StripeSimulator(GatewaySimulator):
    """The gateway simulator, speaking Stripe."""

    def clear(self) -> None:
        """Forget everything; also the intents waiting to settle and the customer index."""
        for timer in getattr(self, "timers", []):
            timer.cancel()
        self.timers: list[asyncio.TimerHandle] = []
        self.by_customer: dict[str, list[Intent]] = {}
        super().clear()

    def routes(self) -> list[Route]:
        """Stripe's routes, and the simulator's own."""
        api: list[tuple[str, str, Handler]] = [
            ("GET", "/v1/customers/{id}", self.get_customer),
            ("GET", "/v1/payment_methods", self.list_payment_methods),
            ("POST", "/v1/payment_intents", self.create_intent),
            ("GET", "/v1/payment_intents", self.list_intents),
            ("GET", "/v1/payment_intents/{id}", self.get_intent),
            ("POST", "/v1/refunds", self.create_refund),
        ]
        return [
            *(
                Route(path, self._counted(f"{method} {path}", self._stripe(fn)), methods=[method])
                for method, path, fn in api
            ),
            Route("/_sim/charges", self.all_charges, methods=["GET"]),
            Route("/_sim/disputes", self.create_dispute, methods=["POST"]),
            Route("/_sim/webhooks", self.webhook_deliveries, methods=["GET"]),
            *self.control_routes(),
        ]

    def _stripe(self, handler: Handler) -> Callable[[Request], Any]:
        """Auth and injected faults first; a `StripeError` becomes its answer."""

        async def guarded(request: Request) -> Response:
            if (refused := self._guard(request)) is not None:
                return refused
            try:
                response: Response = await handler(request)
            except StripeError as error:
                return error.response()
            return response

        return guarded

    # Stripe's answers to what the simulator refuses

    def unauthorized(self) -> Response:
        return invalid("api_key_invalid", "Invalid API Key provided.", status=401).response()

    def too_many(self) -> Response:
        retry_after = {"Retry-After": str(self.config.retry_after_s)}
        error = invalid(
            "rate_limit",
            "Request rate limit exceeded. Learn more about rate limits here "
            "https://stripe.com/docs/rate-limits.",
            status=429,
        )
        return error.response(retry_after)

    def injected(self, status: int) -> Response:
        body = {"type": "api_error", "message": f"Simulated {status}."}
        return StripeError(status, body).response()

    def in_progress(self) -> Response:
        return invalid(
            "idempotency_key_in_use",
            "There is currently another in-progress request using this Idempotent Key "
            "(that probably means you submitted twice, and the other request is still going "
            "through). Please retry that request later.",
            status=409,
        ).response()

    def key_reused(self) -> Response:
        body = {
            "type": "idempotency_error",
            "message": "Keys for idempotent requests can only be used with the same "
            "parameters they were first used with.",
        }
        return StripeError(400, body).response()

    def lost(self) -> Response:
        return StripeError(502, {"type": "api_error", "message": "Bad gateway."}).response()

    # customers and their cards

    async def get_customer(self, request: Request) -> Response:
        """`GET /v1/customers/{id}`."""
        customer = request.path_params["id"]
        expand_of(_query(request))
        if not customer.startswith("cus_"):
            raise invalid(
                "resource_missing", f"No such customer: '{customer[:60]}'", "id", status=404
            )
        await self.delay(request)
        default = default_payment_method(customer) if self.config.invoice_default else None
        return JSONResponse(customer_json(customer, default))

    async def list_payment_methods(self, request: Request) -> Response:
        """`GET /v1/payment_methods?customer=…&type=card`."""
        query = _query(request)
        customer = query.get("customer")
        if not isinstance(customer, str) or query.get("type", "card") != "card":
            raise invalid("parameter_missing", "Missing required param: customer.", "customer")
        await self.delay(request)
        card = default_payment_method(customer)
        data = [payment_method_json(card, customer)] if card else []
        return JSONResponse(page("/v1/payment_methods", data, False))

    # payment intents

    async def create_intent(self, request: Request) -> Response:
        """`POST /v1/payment_intents`."""
        params = parse_intent(decode_form((await request.body()).decode(errors="replace")))
        if params.payment_method != default_payment_method(params.customer):
            raise invalid(
                "resource_missing",
                f"No such PaymentMethod: '{params.payment_method[:60]}'",
                "payment_method",
            )
        key = request.headers.get("idempotency-key") or None
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._charge_intent(book, params, key or ""),
            answer_may_be_lost=True,
        )

    def _charge_intent(self, book: ChargeBook, params: IntentParams, key: str) -> StoredResponse:
        code = self.decline_code(params.customer, params.metadata)
        processing = params.customer.startswith(PROCESSING_PREFIX)
        intent = Intent(
            id=self._new_id("pi", book),
            amount=params.amount,
            currency=params.currency,
            customer=params.customer,
            metadata=params.metadata,
            created=int(time.time()),
            status="failed" if code else "processing" if processing else "succeeded",
            idempotency_key=key,
            charge_id=self._new_id("ch", book),
            payment_method=params.payment_method,
            decline_code=code,
        )
        book.add(intent)
        self.by_customer.setdefault(intent.customer, []).append(intent)
        self._announce(intent)
        if code:
            error = decline(intent)
            return StoredResponse(error.status_code, {"error": error.body})
        if processing:
            settle = self.config.processing_settle_s
            loop = asyncio.get_running_loop()
            self.timers.append(loop.call_later(settle, self._settle, book, intent))
        return StoredResponse(200, intent_json(intent, expand=params.expand))

    def _settle(self, book: ChargeBook, intent: Intent) -> None:
        """The bank debit went through: the processing intent succeeds."""
        if book is self.book and intent.status == "processing":
            intent.status = "succeeded"
            intent.revision += 1
            self._announce(intent)

    def _announce(self, intent: Intent) -> None:
        kind = {
            "succeeded": "payment_intent.succeeded",
            "failed": "payment_intent.payment_failed",
            "processing": "payment_intent.processing",
        }[intent.status]
        self.events.publish(
            kind, intent_json(intent), object_id=intent.id, revision=intent.revision
        )

    async def get_intent(self, request: Request) -> Response:
        """`GET /v1/payment_intents/{id}`."""
        expand = expand_of(_query(request))
        await self.delay(request)
        intent = self._intent(request.path_params["id"], "id", status=404)
        return JSONResponse(intent_json(intent, expand=expand))

    async def list_intents(self, request: Request) -> Response:
        """`GET /v1/payment_intents`: newest first."""
        query = parse_list(_query(request))
        await self.delay(request)
        found, has_more = self._find(query)
        data = [intent_json(intent, expand=query.expand) for intent in found]
        return JSONResponse(page("/v1/payment_intents", data, has_more))

    def _find(self, query: IntentQuery) -> tuple[list[Intent], bool]:
        """A page newest first: the customer's intents (or all), after the cursor, in the
        `created` bounds."""
        everything = query.customer is None
        pool = self._intents() if everything else self.by_customer.get(query.customer or "", [])
        end = len(pool)
        if query.starting_after is not None:
            cursor = self._intent(query.starting_after, "starting_after")
            # the book's records are its intents, in order: a record's seq is its index
            end = (
                cursor.seq if everything else bisect.bisect_left([i.seq for i in pool], cursor.seq)
            )
        matches: list[Intent] = []
        for intent in _newest_first(pool, end):
            if query.created_lt is not None and intent.created >= query.created_lt:
                continue
            if query.created_gte is not None and intent.created < query.created_gte:
                if self.book.in_order:  # every older one is older still
                    break
                continue
            matches.append(intent)
            if len(matches) > query.limit:
                return matches[: query.limit], True
        return matches, False

    def _intents(self) -> list[Intent]:
        """Every PaymentIntent, oldest first (the book holds nothing else)."""
        return self.book.charges  # type: ignore[return-value]  # only `Intent`s are added

    def _intent(self, intent_id: str, param: str, status: int = 400) -> Intent:
        found = self.book.get(intent_id)
        if not isinstance(found, Intent):
            raise invalid(
                "resource_missing", f"No such payment_intent: '{intent_id[:60]}'", param, status
            )
        return found

    # refunds

    async def create_refund(self, request: Request) -> Response:
        """`POST /v1/refunds`."""
        params = parse_refund(decode_form((await request.body()).decode(errors="replace")))
        key = request.headers.get("idempotency-key") or None
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._refund_intent(book, params),
            answer_may_be_lost=False,
        )

    def _refund_intent(self, book: ChargeBook, params: RefundParams) -> StoredResponse:
        if params.payment_intent is not None:
            intent = self._intent(params.payment_intent, "payment_intent")
        else:
            by_charge = (i for i in self._intents() if i.charge_id == params.charge)
            found = next(by_charge, None)
            if found is None:
                raise invalid("resource_missing", "No such charge.", "charge")
            intent = found
        try:
            refund = book.refund(intent.id, self._new_id("re", book), int(time.time()))
        except RefundRefused as refused:
            code = (
                "charge_already_refunded"
                if refused.code == "charge_already_refunded"
                else "payment_intent_unexpected_state"
            )
            message = (
                f"Charge {intent.charge_id} has already been refunded."
                if code == "charge_already_refunded"
                else "This PaymentIntent does not have a successful charge to refund."
            )
            error = invalid(code, message)
            return StoredResponse(error.status_code, {"error": error.body})
        self.events.publish(
            "charge.refunded", charge_json(intent), object_id=intent.id, revision=intent.revision
        )
        body = refund_json(refund.id, intent, params.reason, refund.created)
        return StoredResponse(200, body)

    # the simulator's own routes

    async def all_charges(self, request: Request) -> Response:
        """`GET /_sim/charges`: every PaymentIntent, shaped as the contract's charges."""
        return JSONResponse({"data": [sim_json(i) for i in self._intents()]})

    async def create_dispute(self, request: Request) -> Response:
        """`POST /_sim/disputes` `{"charge": <pi_… or ch_…>}`: a chargeback opens."""
        body = await request.json()
        wanted = body.get("charge") if isinstance(body, dict) else None
        intent = next(
            (i for i in self._intents() if wanted in (i.id, i.charge_id)),
            None,
        )
        if intent is None or intent.status != "succeeded" or intent.refunded:
            return invalid("charge_not_disputable", "Not a succeeded charge.").response()
        intent.revision += 1
        dispute = {
            "id": self._new_id("dp", self.book),
            "object": "dispute",
            "amount": intent.amount,
            "charge": intent.charge_id,
            "payment_intent": intent.id,
            "status": "needs_response",
            "created": int(time.time()),
        }
        self.events.publish(
            "charge.dispute.created", dispute, object_id=intent.id, revision=intent.revision
        )
        return JSONResponse(dispute)


def _query(request: Request) -> dict[str, Any]:
    return decode_form(request.url.query)


def _newest_first(pool: list[Intent], end: int) -> Iterator[Intent]:
    for index in range(end - 1, -1, -1):
        yield pool[index]
