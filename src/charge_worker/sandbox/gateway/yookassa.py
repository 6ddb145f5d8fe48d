"""The gateway simulator's YooKassa flavour: the subset of YooKassa's API v3 charge-worker
speaks (autopayments with a saved payment method).

`build_gateway_app(GatewayConfig(flavour="yookassa"))` (or `charge-worker sandbox gateway
--config '{"flavour": "yookassa"}'`). The same knobs, faults, `/_sim/*` routes and webhook
delivery as the contract flavour (`app.py`), in YooKassa's wire format (`yookassa_wire.py`):

* auth: HTTP Basic `<shopId>:<secret key>` (`api_key`, the sandbox's `100500:test_sandbox`),
  else `401 invalid_credentials`;
* `POST /v3/payments` (`Idempotence-Key` required, at most 64 characters; `amount`,
  `capture: true`, `payment_method_id`, `description`, `metadata` (optional: ours carries
  `order_id` and `billing_period`, another integration's anything or nothing): the payment
  method id stands for the contract's customer, so `cards.py` decides by it and the try
  `metadata.attempt` names (in YooKassa's words: `cus_decline…` `general_decline`,
  `cus_auth…` `3d_secure_failed`). A decline is `200` with the payment `canceled` and its
  `cancellation_details` (`party` `yoo_kassa` for the reasons YooKassa cancels for itself,
  such as `fraud_suspected`, else `payment_network`); `cus_processing…` is `pending` and
  succeeds `processing_settle_s` later; any other `succeeded`, `paid`, `captured_at`;
* idempotency: a repeat with the same key and body answers the first status and body (no
  header says so); another body: `400 invalid_request` `parameter: Idempotence-Key`
  ("Idempotence key duplicated"); the key still executing: `202 {"type": "processing",
  "retry_after": <retry_after_s in ms>}`;
* `GET /v3/payments/{id}` (`404 not_found`) and `GET /v3/payments` (`created_at.gte|gt|lt|
  lte` ISO 8601, `status`, `limit` 1..100 default 10, an opaque `cursor`), newest first,
  `next_cursor` only when a page follows;
* `POST /v3/refunds` (`payment_id`, `amount` at most the refundable rest, `description`; its
  own key): the payment stays `succeeded` and shows `refunded_amount`, `refundable` false
  once refunded in full; more than the rest, or a payment not succeeded: `400
  invalid_request`; an unknown payment: `404 not_found`;
* errors `{"type": "error", "id", "code", "description", "parameter"?}`: 429
  `too_many_requests` (with `Retry-After`), 5xx `internal_server_error` (a lost answer's is
  `500`);
* notifications `payment.succeeded`, `payment.canceled`, `refund.succeeded` (the refund),
  unsigned, `{"type": "notification", "event", "object"}` (`webhooks.py`).

`GET /_sim/charges` shows each payment as the contract flavour shows a charge (`customer` the
payment method id; `status` succeeded, failed or processing; `idempotency_key`; `metadata`,
`attempt` included), so the chaos checker counts money on every flavour the same way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import bisect
import hmac
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from charge_worker.sandbox.gateway import cards
from charge_worker.sandbox.gateway.app import GatewaySimulator
from charge_worker.sandbox.gateway.state import ChargeBook, Refund, StoredResponse
from charge_worker.sandbox.gateway.stripe import PROCESSING_PREFIX
from charge_worker.sandbox.gateway.yookassa_wire import (
    STATUS,
    Payment,
    PaymentParams,
    PaymentQuery,
    RefundParams,
    YooKassaError,
    encode_cursor,
    idempotence_key,
    invalid,
    not_found,
    page,
    parse_list,
    parse_payment,
    parse_refund,
    payment_json,
    processing,
    refund_json,
    sim_json,
)
from charge_worker.sandbox.simulator import read_json

Handler = Callable[[Request], Awaitable[Response]]


class YooKassaSimulator(GatewaySimulator):
    """The gateway simulator, speaking YooKassa."""

    def clear(self) -> None:
        """Forget everything; also the payments waiting to settle."""
        for timer in getattr(self, "timers", []):
            timer.cancel()
        self.timers: list[asyncio.TimerHandle] = []
        self.created_ms: list[int] = []  # each payment's, by seq: nondecreasing
        super().clear()

    def routes(self) -> list[Route]:
        """YooKassa's routes, and the simulator's own."""
        api: list[tuple[str, str, Handler]] = [
            ("POST", "/v3/payments", self.create_payment),
            ("GET", "/v3/payments", self.list_payments),
            ("GET", "/v3/payments/{id}", self.get_payment),
            ("POST", "/v3/refunds", self.create_refund),
        ]
        return [
            *(
                Route(path, self._counted(f"{method} {path}", self._guarded(fn)), methods=[method])
                for method, path, fn in api
            ),
            Route("/_sim/charges", self.all_charges, methods=["GET"]),
            Route("/_sim/webhooks", self.webhook_deliveries, methods=["GET"]),
            *self.control_routes(),
        ]

    def _guarded(self, handler: Handler) -> Handler:
        """Auth and injected faults first; a `YooKassaError` becomes its answer."""

        async def guarded(request: Request) -> Response:
            if (refused := self._guard(request)) is not None:
                return refused
            try:
                return await handler(request)
            except YooKassaError as error:
                return error.response()

        return guarded

    @property
    def shop_id(self) -> str:
        """The shop the credentials name (`recipient.account_id`)."""
        return self.config.api_key.partition(":")[0]

    # YooKassa's auth and answers to what the simulator refuses

    def authorized(self, request: Request) -> bool:
        """HTTP Basic auth with `api_key` as `<shopId>:<secret key>`."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        try:
            given = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return scheme.lower() == "basic" and hmac.compare_digest(
            given, self.config.api_key.encode()
        )

    def unauthorized(self) -> Response:
        error = YooKassaError(
            401, "invalid_credentials", "Login or password is incorrect (HTTP Basic auth)"
        )
        return error.response({"WWW-Authenticate": 'Basic realm="YooKassa"'})

    def too_many(self) -> Response:
        error = YooKassaError(429, "too_many_requests", "Too many requests, slow down")
        return error.response({"Retry-After": str(self.config.retry_after_s)})

    def injected(self, status: int) -> Response:
        return YooKassaError(status, "internal_server_error", "Internal server error").response()

    def in_progress(self) -> Response:
        return JSONResponse(processing(int(self.config.retry_after_s * 1000)), status_code=202)

    def key_reused(self) -> Response:
        return invalid(
            "Idempotence key duplicated: it was used with another request body",
            "Idempotence-Key",
        ).response()

    def lost(self) -> Response:
        return YooKassaError(500, "internal_server_error", "Internal server error").response()

    def replay(self, response: StoredResponse) -> Response:
        """The first answer again, as it was: YooKassa marks no replay."""
        return JSONResponse(response.body, status_code=response.status_code)

    # payments

    async def create_payment(self, request: Request) -> Response:
        """`POST /v3/payments`."""
        key = idempotence_key(request.headers)
        params = parse_payment(await read_json(request))
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._pay(book, params, key),
            answer_may_be_lost=True,
        )

    def _pay(self, book: ChargeBook, params: PaymentParams, key: str) -> StoredResponse:
        code = cards.decline_code(
            params.payment_method_id,
            params.metadata,
            succeeds_on_try=self.config.succeeds_on_try,
            vocabulary=cards.YOOKASSA,
        )
        pending = code is None and params.payment_method_id.startswith(PROCESSING_PREFIX)
        # never earlier than the last one: the list pages by it
        now_ms = max(int(time.time() * 1000), self.created_ms[-1] if self.created_ms else 0)
        payment = Payment(
            id=self._payment_id(book),
            amount=params.amount,
            currency=params.currency,
            customer=params.payment_method_id,
            metadata=params.metadata,
            created=now_ms // 1000,
            status="failed" if code else "processing" if pending else "succeeded",
            idempotency_key=key,
            decline_code=code,
            description=params.description,
            created_ms=now_ms,
            captured_ms=None if code or pending else now_ms,
        )
        book.add(payment)
        if book is self.book:  # else a reset came meanwhile: the old book is gone
            self.created_ms.append(now_ms)
        if pending:
            settle = self.config.processing_settle_s
            loop = asyncio.get_running_loop()
            self.timers.append(loop.call_later(settle, self._settle, book, payment))
        else:
            self._announce(payment)
        return StoredResponse(200, payment_json(payment, self.shop_id))

    def _settle(self, book: ChargeBook, payment: Payment) -> None:
        """The bank has answered: the pending payment succeeds."""
        if book is self.book and payment.status == "processing":
            payment.status = "succeeded"
            payment.captured_ms = int(time.time() * 1000)
            payment.revision += 1
            self._announce(payment)

    def _announce(self, payment: Payment) -> None:
        event = "payment.succeeded" if payment.status == "succeeded" else "payment.canceled"
        self.events.publish(
            event,
            payment_json(payment, self.shop_id),
            object_id=payment.id,
            revision=payment.revision,
        )

    def _payment_id(self, book: ChargeBook) -> str:
        """A new id shaped as YooKassa's (a UUID-like string)."""
        bits = self.rng.getrandbits
        while book.get(new_id := f"{bits(32):08x}-000f-5000-8000-{bits(48):012x}") is not None:
            pass
        return new_id

    async def get_payment(self, request: Request) -> Response:
        """`GET /v3/payments/{id}`."""
        await self.delay(request)
        payment = self._payment(request.path_params["id"])
        return JSONResponse(payment_json(payment, self.shop_id))

    def _payment(self, payment_id: str) -> Payment:
        found = self.book.get(payment_id)
        if not isinstance(found, Payment):
            raise not_found("Payment not found or forbidden", "payment_id")
        return found

    async def list_payments(self, request: Request) -> Response:
        """`GET /v3/payments`: newest first."""
        query = parse_list(request.query_params)
        book, created_ms = self.book, self.created_ms
        if query.before_seq is not None and query.before_seq > len(book.charges):
            raise invalid("cursor is not a cursor this API gave", "cursor")
        await self.delay(request)
        found, more = _newest_first(book, created_ms, query)
        items = [payment_json(payment, self.shop_id) for payment in found]
        return JSONResponse(page(items, encode_cursor(found[-1].seq) if more else None))

    # refunds

    async def create_refund(self, request: Request) -> Response:
        """`POST /v3/refunds`."""
        key = idempotence_key(request.headers)
        params = parse_refund(await read_json(request))
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._refund_payment(book, params),
            answer_may_be_lost=False,
        )

    def _refund_payment(self, book: ChargeBook, params: RefundParams) -> StoredResponse:
        try:
            payment = self._payment(params.payment_id)
            if payment.status != "succeeded":
                raise invalid("Only a succeeded payment can be refunded", "payment_id")
            rest = payment.amount - payment.amount_refunded
            if rest <= 0:
                raise invalid("The payment has been refunded in full already", "payment_id")
            if params.currency != payment.currency:
                raise invalid("The refund's currency is not the payment's", "amount.currency")
            if params.amount > rest:
                raise invalid("The amount is more than the payment's refundable rest", "amount")
        except YooKassaError as refused:
            return StoredResponse(refused.status_code, refused.body())
        now_ms = int(time.time() * 1000)
        refund_id = f"{self.rng.getrandbits(32):08x}-0015-5000-9000-{self.rng.getrandbits(48):012x}"
        payment.amount_refunded += params.amount
        payment.revision += 1
        book.refunds.append(Refund(refund_id, payment.id, params.amount, now_ms // 1000))
        body = refund_json(refund_id, payment, params, now_ms)
        self.events.publish(
            "refund.succeeded", body, object_id=payment.id, revision=payment.revision
        )
        return StoredResponse(200, body)

    # the simulator's own routes

    async def all_charges(self, request: Request) -> Response:
        """`GET /_sim/charges`: every payment, shaped as the contract's charges."""
        payments = [p for p in self.book.charges if isinstance(p, Payment)]
        return JSONResponse({"data": [sim_json(p) for p in payments]})


def _newest_first(
    book: ChargeBook, created_ms: list[int], query: PaymentQuery
) -> tuple[list[Payment], bool]:
    """A page newest first: before the cursor, within the `created_at` bounds (payments are
    made in `created_ms` order, so the bounds are a slice), of the status asked for."""
    end = len(book.charges) if query.before_seq is None else query.before_seq
    if query.created_until_ms is not None:
        end = min(end, bisect.bisect_left(created_ms, query.created_until_ms))
    start = 0
    if query.created_from_ms is not None:
        start = bisect.bisect_left(created_ms, query.created_from_ms)
    found: list[Payment] = []
    for index in range(end - 1, start - 1, -1):
        payment = book.charges[index]
        if not isinstance(payment, Payment):
            continue
        if query.status is not None and STATUS[payment.status] != query.status:
            continue
        if len(found) == query.limit:
            return found, True
        found.append(payment)
    return found, False
