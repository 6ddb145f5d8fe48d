"""A payment gateway simulator implementing `docs/contracts/gateway.md`, webhooks included.

`build_gateway_app(GatewayConfig(...))` returns a Starlette app; its state is the
`GatewaySimulator` at `app.state.sim`, in memory only. `GatewayConfig(flavour=...)` picks
the wire format: `"contract"` (this module, described below), `"stripe"` (Stripe's subset,
`stripe.py`) or `"yookassa"` (YooKassa's API v3 subset, `yookassa.py`); the flavours share
the knobs, faults, decline conventions (`cards.py`), `/_sim/*` routes and webhook delivery.

Rules:

* auth: every `/v1` request needs `Authorization: Bearer <api_key>`, else `401`;
* declines (`cards.py`): the customer id, and the try the charge's `metadata.attempt` names
  (absent: 1), pick a decline code: `cus_decline…` `generic_decline`, `cus_auth…`
  `authentication_required`, `cus_code_<code>…` that code, `cus_soft<k>…`
  `insufficient_funds` before try `k` and charged from it (also the `succeeds_on_try`
  knob), `cus_soft…` `insufficient_funds` on every try. A decline answers `402 {"error":
  {"type": "card_error", "code": "card_declined", "decline_code": <code>, "message",
  "charge": <id>}}`; the declined charge is recorded with status `failed` and its
  `decline_code` (lookups find it), and its answer is kept for replay like any other;
* validation: a body that is not a JSON object, a missing or unknown parameter, or a bad
  query is `400`; a present parameter with a wrong type or value is `422`
  (amount: positive int, not bool or float; currency: three upper-case letters; customer:
  non-empty string; metadata: string `order_id` and `billing_period`, string values);
* refunds (full only): the charge keeps `status: "succeeded"` and shows the refund in
  `amount_refunded` (its amount) and `refunded` (true), in every answer and in the
  `charge.refunded` webhook; `status` is only ever `succeeded` or `failed`. A charge
  refunded already: `400 charge_already_refunded`; a failed one: `400
  charge_not_refundable`; an unknown one: `404 resource_missing`;
* idempotency (charges and refunds, key required): same key and parameters replay the
  original status and body with `Idempotent-Replayed: true`; other parameters: `400
  key_reused`; the key still executing: `409 request_in_progress`. Invalid requests and
  injected errors are not kept; a key is kept `key_retention_s` after first use.

Knobs (`GatewayConfig`, in `config.py`; also `POST /_sim/config` at runtime):

* `api_key` (`sk_test_sandbox`; YooKassa flavour: `100500:test_sandbox`); `seed` (`None`:
  random);
* `latency`: a `LatencyModel` (default 0 s) for every `/v1` request; for a charge it is the
  time the key stays in progress; `endpoint_latency` (`{"GET /v1/charges": model}`, the
  names of `/_sim/stats`): an endpoint's own, instead;
* `error_rates`: `{status: probability}` for `429` and `5xx`, drawn for every `/v1` request
  after auth and before anything is recorded; `429` carries `Retry-After: retry_after_s`;
* `rate_limit_per_s` (`None`: none): the account's request rate, as a provider's limit: a
  token bucket of one second's worth; a `/v1` request over it gets `429` (`Retry-After`);
* `lost_answer_rate`, `lost_answer_mode`: a new charge (or decline) is recorded and its answer
  kept for replay, then `"timeout"` waits `lost_answer_delay_s` (30 s; cut short when the
  client hangs up) before answering, `"5xx"` answers `502`: an unknown outcome;
* `idempotency_enabled` (true): false charges every request anew;
* `key_retention_s` (86400);
* `succeeds_on_try` (`{customer: k}`): that customer's card is declined `insufficient_funds`
  on tries < k and charged from try k on;
* webhooks (`webhooks.py`): `webhook_url` (`None`: none are sent), `webhook_secret`
  (`whsec_…`), `webhook_retry_schedule_s` (the contract's), `webhook_time_scale` (1),
  `webhook_timeout_s` (5), `webhook_reorder` and `webhook_duplicate` (probabilities, 0),
  `webhook_reorder_delay_s` (1: the longest an event is held back to be overtaken).

Endpoints: `POST /v1/charges`, `GET /v1/charges` (`order_id` + `billing_period`: every
match; and/or paging by `created_gte`, `created_lt`, `limit` 1..100 default 10,
`starting_after`; oldest first, `has_more`), `POST /v1/refunds` (`charge`, `reason`); and,
without auth, `GET /_sim/charges` (every charge with its `idempotency_key` and `metadata`,
`attempt` included: charges per period across every try's key), `GET /_sim/stats`
(requests by endpoint, status and second, injected errors, 429s of the rate limit, lost
answers), `POST /_sim/disputes`
(`{"charge": id}`: the cardholder disputes a succeeded charge not refunded),
`GET /_sim/webhooks` (every webhook delivery and its attempts), `POST /_sim/charges/load`
(a month's history at once, for benchmarks) and the control routes of
`simulator.py` (`/_sim/config`, `/_sim/reset`).

Webhook seam: every change of a charge object is passed to `sim.events.publish(type,
snapshot)` (`charge.succeeded`, `charge.failed`, `charge.refunded`, `charge.dispute_created`);
the default sink is the simulator's `WebhookDelivery`, which sends nothing without a URL.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from charge_worker.sandbox.gateway import cards
from charge_worker.sandbox.gateway.cards import AUTH_PREFIX, DECLINE_PREFIX
from charge_worker.sandbox.gateway.config import GatewayConfig
from charge_worker.sandbox.gateway.requests import (
    ChargeParams,
    InvalidRequest,
    answer,
    api_error,
    error_body,
    idempotency_key,
    parse_charge,
    parse_query,
    parse_refund,
    rejected,
)
from charge_worker.sandbox.gateway.state import (
    Charge,
    ChargeBook,
    Claimed,
    IdempotencyKeys,
    InProgress,
    KeyReused,
    RefundRefused,
    Replay,
    StoredResponse,
)
from charge_worker.sandbox.gateway.webhooks import WebhookDelivery
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.simulator import Simulator, pause, read_json

__all__ = [  # GatewayConfig lives in config.py; callers import it from here
    "AUTH_PREFIX",
    "DECLINE_PREFIX",
    "ChargeEvents",
    "GatewayConfig",
    "GatewaySimulator",
    "NoEvents",
    "build_gateway_app",
]

Handler = Callable[[Request], Awaitable[Response]]


class ChargeEvents(Protocol):
    """Where the simulator announces each change of a charge object (webhook delivery).

    `object_id` and `revision` name the charge and its version when `snapshot` carries no
    revision of its own (the Stripe flavour's objects)."""

    def publish(
        self,
        event_type: str,
        snapshot: dict[str, Any],
        *,
        object_id: str | None = None,
        revision: int | None = None,
    ) -> None:
        """Take note of an event; must not block."""


class NoEvents:
    """Drops every event."""

    def publish(
        self,
        event_type: str,
        snapshot: dict[str, Any],
        *,
        object_id: str | None = None,
        revision: int | None = None,
    ) -> None:
        """Do nothing."""


class GatewaySimulator(Simulator[GatewayConfig]):
    """The gateway's state (charges, refunds, keys, counters) and its request handlers."""

    def __init__(self, config: GatewayConfig, events: ChargeEvents | None = None) -> None:
        self.config = config
        self.webhooks = WebhookDelivery(lambda: self.config)
        self.events: ChargeEvents = events or self.webhooks
        super().__init__(config)

    @property
    def seed(self) -> int | None:
        """The configured seed."""
        return self.config.seed

    def clear(self) -> None:
        """Forget every charge, refund, key and counter."""
        # Replaced, not emptied: a request in flight during a reset finishes on the old ones.
        self.book = ChargeBook()
        self.keys = IdempotencyKeys()
        self.by_endpoint: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.injected_errors = 0
        self.lost_answers = 0
        self.rate_limited = 0
        self.by_second: Counter[int] = Counter()  # /v1 requests per unix second
        self.bucket = (math.inf, time.monotonic())  # tokens (full: capped at use), when counted
        self.webhooks.clear()

    def stats(self) -> dict[str, Any]:
        """Requests by endpoint and by status, injected errors, lost answers, totals."""
        return {
            "requests": sum(self.by_endpoint.values()),
            "by_endpoint": dict(self.by_endpoint),
            "by_status": dict(self.by_status),
            "injected_errors": self.injected_errors,
            "rate_limited": self.rate_limited,
            "per_second": {str(second): n for second, n in sorted(self.by_second.items())},
            "lost_answers": self.lost_answers,
            "in_flight": self.keys.in_flight(),
            "charges": len(self.book.charges),
            "refunds": len(self.book.refunds),
        }

    def routes(self) -> list[Route]:
        """Every route of the simulator."""
        api = [
            ("POST", "/v1/charges", self.create_charge),
            ("GET", "/v1/charges", self.list_charges),
            ("POST", "/v1/refunds", self.create_refund),
        ]
        return [
            *(
                Route(path, self._counted(f"{method} {path}", fn), methods=[method])
                for method, path, fn in api
            ),
            Route("/_sim/charges", self.all_charges, methods=["GET"]),
            Route("/_sim/disputes", self.create_dispute, methods=["POST"]),
            Route("/_sim/charges/load", self.load_charges, methods=["POST"]),
            Route("/_sim/webhooks", self.webhook_deliveries, methods=["GET"]),
            *self.control_routes(),
        ]

    def latency_of(self, endpoint: str, config: GatewayConfig | None = None) -> LatencyModel:
        """How long a request to `endpoint` takes: its `endpoint_latency`, else `latency`."""
        config = config or self.config
        return config.endpoint_latency.get(endpoint, config.latency)

    async def delay(self, request: Request, config: GatewayConfig | None = None) -> None:
        """The simulated latency of `request` (its endpoint's, see `latency_of`)."""
        endpoint = getattr(request.state, "endpoint", "")
        await asyncio.sleep(self.latency_of(endpoint, config).sample(self.rng))

    def _counted(self, endpoint: str, handler: Handler) -> Handler:
        async def counted(request: Request) -> Response:
            request.state.endpoint = endpoint
            self.by_second[int(time.time())] += 1
            response = await handler(request)
            self.by_endpoint[endpoint] += 1
            self.by_status[str(response.status_code)] += 1
            return response

        return counted

    async def create_charge(self, request: Request) -> Response:
        """`POST /v1/charges`."""
        if (refused := self._guard(request)) is not None:
            return refused
        try:
            key = idempotency_key(request.headers)
            params = parse_charge(await read_json(request))
        except InvalidRequest as exc:
            return rejected(exc)
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._charge(book, params, key),
            answer_may_be_lost=True,
        )

    async def create_refund(self, request: Request) -> Response:
        """`POST /v1/refunds`."""
        if (refused := self._guard(request)) is not None:
            return refused
        try:
            key = idempotency_key(request.headers)
            params = parse_refund(await read_json(request))
        except InvalidRequest as exc:
            return rejected(exc)
        return await self._execute(
            request,
            key,
            params.fingerprint(),
            lambda book: self._refund(book, params.charge),
            answer_may_be_lost=False,
        )

    async def list_charges(self, request: Request) -> Response:
        """`GET /v1/charges`."""
        if (refused := self._guard(request)) is not None:
            return refused
        try:
            query = parse_query(request.query_params)
        except InvalidRequest as exc:
            return rejected(exc)
        book = self.book
        await self.delay(request)
        try:
            charges, has_more = book.find(query)
        except KeyError:
            return api_error(
                400,
                "invalid_request_error",
                "resource_missing",
                f"No such charge: '{query.starting_after}'",
                param="starting_after",
            )
        data = [charge.to_json() for charge in charges]
        return JSONResponse({"object": "list", "data": data, "has_more": has_more})

    async def all_charges(self, request: Request) -> Response:
        """`GET /_sim/charges`: every charge ever made, with the key that made it (and its
        metadata, as every charge object shows it: the try's `attempt` among it)."""
        data = [c.to_json() | {"idempotency_key": c.idempotency_key} for c in self.book.charges]
        return JSONResponse({"data": data})

    async def load_charges(self, request: Request) -> Response:
        """`POST /_sim/charges/load` `{"first_order_id", "count", "billing_period", "amount",
        "currency", "customer_prefix", "created"}`: that many succeeded charges made at once, as
        a month's history (ids `ch_load_<order_id>_<period>`, `created` unix seconds, now
        when absent), no request each; for benchmarks."""
        body = await read_json(request)
        if not isinstance(body, dict):
            return api_error(400, "invalid_request_error", "parameter_invalid", "An object.")
        first, count = int(body["first_order_id"]), int(body["count"])
        period, amount = str(body["billing_period"]), int(body["amount"])
        currency, prefix = str(body.get("currency", "RUB")), str(body["customer_prefix"])
        created = int(body.get("created", time.time()))
        for order_id in range(first, first + count):
            key = f"{order_id}:{period}"
            self.book.add(
                Charge(
                    id=f"ch_load_{order_id}_{period}",
                    amount=amount,
                    currency=currency,
                    customer=f"{prefix}{order_id}",
                    metadata={"order_id": str(order_id), "billing_period": period},
                    created=created,
                    status="succeeded",
                    idempotency_key=key,
                )
            )
        return JSONResponse({"loaded": count, "charges": len(self.book.charges)})

    async def create_dispute(self, request: Request) -> Response:
        """`POST /_sim/disputes` `{"charge": id}`: a chargeback opens on a succeeded charge."""
        body = await read_json(request)
        charge_id = body.get("charge") if isinstance(body, dict) else None
        charge = self.book.get(charge_id) if isinstance(charge_id, str) else None
        if charge is None:
            return api_error(404, "invalid_request_error", "resource_missing", "No such charge.")
        if charge.status != "succeeded" or charge.refunded:
            return api_error(
                400,
                "invalid_request_error",
                "charge_not_disputable",
                "Not a succeeded charge, or refunded.",
            )
        charge.revision += 1
        self.events.publish("charge.dispute_created", charge.to_json())
        return JSONResponse(charge.to_json())

    async def webhook_deliveries(self, request: Request) -> Response:
        """`GET /_sim/webhooks`: every webhook delivery, its attempts, and how many go on."""
        return JSONResponse(self.webhooks.report())

    def _guard(self, request: Request) -> Response | None:
        """Auth, then an injected error, if either stops the request here."""
        if not self.authorized(request):
            return self.unauthorized()
        if not self._within_rate():
            self.rate_limited += 1
            return self.too_many()
        status = self._draw_error()
        if status is None:
            return None
        self.injected_errors += 1
        return self.too_many() if status == 429 else self.injected(status)

    # The wire format's auth and answers to what the simulator refuses; a flavour overrides them.

    def authorized(self, request: Request) -> bool:
        """The request carries `Authorization: Bearer <api_key>`."""
        expected = f"Bearer {self.config.api_key}".encode()
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)

    def replay(self, response: StoredResponse) -> Response:
        """A repeated key's original answer, marked `Idempotent-Replayed: true`."""
        return answer(response, replayed=True)

    def unauthorized(self) -> Response:
        """A missing or wrong API key."""
        return api_error(
            401,
            "invalid_request_error",
            "api_key_invalid",
            "Invalid API key provided.",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def too_many(self) -> Response:
        """Over the account's rate (or a 429 drawn), with `Retry-After`."""
        retry_after = {"Retry-After": str(self.config.retry_after_s)}
        return api_error(
            429, "rate_limit_error", "rate_limit", "Too many requests.", headers=retry_after
        )

    def injected(self, status: int) -> Response:
        """A drawn 5xx, before anything is recorded."""
        return api_error(status, "api_error", "simulated_error", f"Simulated {status}.")

    def in_progress(self) -> Response:
        """The key's first request is still executing."""
        return api_error(
            409,
            "idempotency_error",
            "request_in_progress",
            "A request with this idempotency key is being processed.",
        )

    def key_reused(self) -> Response:
        """The key was used with other parameters."""
        return api_error(
            400,
            "idempotency_error",
            "key_reused",
            "This idempotency key was used with different parameters.",
        )

    def lost(self) -> Response:
        """A lost answer's 502: the request was executed, the answer is gone."""
        return api_error(502, "api_error", "bad_gateway", "The upstream answer was lost.")

    def _within_rate(self) -> bool:
        """A token bucket of one second's worth at `rate_limit_per_s`, as a provider's
        per-account limit: False when this request is over it."""
        rate = self.config.rate_limit_per_s
        if rate is None:
            return True
        tokens, counted = self.bucket
        now = time.monotonic()
        tokens = min(max(rate, 1.0), tokens + (now - counted) * rate)
        if tokens < 1:
            self.bucket = (tokens, now)
            return False
        self.bucket = (tokens - 1, now)
        return True

    def _draw_error(self) -> int | None:
        rates = self.config.error_rates
        if not rates:
            return None
        draw, cumulative = self.rng.random(), 0.0
        for status, rate in sorted(rates.items()):
            cumulative += rate
            if draw < cumulative:
                return status
        return None

    async def _execute(
        self,
        request: Request,
        key: str | None,
        fingerprint: str,
        execute: Callable[[ChargeBook], StoredResponse],
        *,
        answer_may_be_lost: bool,
    ) -> Response:
        """Run `execute` once per idempotency key, replaying its answer to repeats (a
        request without a key, which only the Stripe flavour allows, runs every time)."""
        config, book, keys = self.config, self.book, self.keys
        idempotent = config.idempotency_enabled and key is not None
        if idempotent:
            assert key is not None
            claim = keys.claim(
                key, fingerprint, now=time.monotonic(), retention_s=config.key_retention_s
            )
            match claim:
                case Replay(response):
                    return self.replay(response)
                case InProgress():
                    return self.in_progress()
                case KeyReused():
                    return self.key_reused()
                case Claimed():
                    pass
        try:
            await self.delay(request, config)
            response = execute(book)
        except BaseException:
            if idempotent:
                assert key is not None
                keys.release(key)
            raise
        if idempotent:
            assert key is not None
            keys.complete(key, response)
        if (
            answer_may_be_lost
            and config.lost_answer_rate
            and self.rng.random() < config.lost_answer_rate
        ):
            self.lost_answers += 1
            if config.lost_answer_mode == "5xx":
                return self.lost()
            await pause(request, config.lost_answer_delay_s)
        return answer(response)

    def _new_id(self, prefix: str, book: ChargeBook) -> str:
        while book.get(new_id := f"{prefix}_{self.rng.getrandbits(96):024x}") is not None:
            pass
        return new_id

    def decline_code(self, customer: str, metadata: dict[str, str]) -> str | None:
        """The decline code of this customer's charge on the try `metadata` names, or None
        (`cards.py`)."""
        return cards.decline_code(customer, metadata, succeeds_on_try=self.config.succeeds_on_try)

    def _charge(self, book: ChargeBook, params: ChargeParams, key: str) -> StoredResponse:
        code = self.decline_code(params.customer, params.metadata)
        declined = code is not None
        charge = book.add(
            Charge(
                id=self._new_id("ch", book),
                amount=params.amount,
                currency=params.currency,
                customer=params.customer,
                metadata=params.metadata,
                created=int(time.time()),
                status="failed" if declined else "succeeded",
                idempotency_key=key,
                decline_code=code,
            )
        )
        self.events.publish(f"charge.{charge.status}", charge.to_json())
        if code is None:
            return StoredResponse(200, charge.to_json())
        error = error_body("card_error", "card_declined", cards.message(code), None)
        return StoredResponse(402, {"error": error | {"decline_code": code, "charge": charge.id}})

    def _refund(self, book: ChargeBook, charge_id: str) -> StoredResponse:
        try:
            refund = book.refund(charge_id, self._new_id("re", book), int(time.time()))
        except RefundRefused as exc:
            error = error_body("invalid_request_error", exc.code, exc.message, "charge")
            return StoredResponse(exc.status_code, {"error": error})
        charge = book.get(charge_id)
        if charge is not None:
            self.events.publish("charge.refunded", charge.to_json())
        return StoredResponse(200, refund.to_json())


def build_gateway_app(config: GatewayConfig | None = None) -> Starlette:
    """The gateway simulator as an ASGI app, in the configured flavour (docs/contracts/gateway.md,
    or Stripe's: `stripe.py`, or YooKassa's: `yookassa.py`); its `GatewaySimulator` is
    `app.state.sim`."""
    config = config or GatewayConfig()
    if config.flavour == "stripe":
        from charge_worker.sandbox.gateway.stripe import StripeSimulator  # noqa: PLC0415

        sim: GatewaySimulator = StripeSimulator(config)
    elif config.flavour == "yookassa":
        from charge_worker.sandbox.gateway.yookassa import YooKassaSimulator  # noqa: PLC0415

        sim = YooKassaSimulator(config)
    else:
        sim = GatewaySimulator(config)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await sim.webhooks.aclose()  # deliveries still retrying end with the server

    app = Starlette(routes=sim.routes(), lifespan=lifespan)
    app.state.sim = sim
    return app
