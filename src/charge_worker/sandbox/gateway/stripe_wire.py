"""The Stripe flavour's wire format: form bodies and queries in, Stripe's objects and error
shapes out. Pure, no I/O.

Only the subset charge-worker uses (docs/adapters.md): PaymentIntents created with
`confirm` and `off_session`, retrieved and listed; refunds; customers and their saved
payment methods, read. Bodies and queries are form-encoded as stripe-python sends them
(`metadata[order_id]=…`, `expand[0]=…`, `created[gte]=…`, booleans as `true`/`false`).
A parameter Stripe does not know here is `400 parameter_unknown`, a missing one `400
parameter_missing`, a bad value `400 parameter_invalid_*`: all `invalid_request_error`,
naming the `param`, as Stripe answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse

from charge_worker.declines import GENERIC_DECLINE
from charge_worker.sandbox.gateway import cards
from charge_worker.sandbox.gateway.state import Charge

CURRENCY = re.compile(r"[a-z]{3}")
REFUND_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer"})
MAX_LIMIT = 100
DEFAULT_LIMIT = 10
_SEGMENT = re.compile(r"\[([^\[\]]*)\]")


class StripeError(Exception):
    """A request Stripe refuses; the answer is `{"error": body}` with `status_code`."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", ""))
        self.status_code = status_code
        self.body = body

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": self.body}, status_code=self.status_code, headers=headers)


def invalid(code: str, message: str, param: str | None = None, status: int = 400) -> StripeError:
    """An `invalid_request_error`."""
    body: dict[str, Any] = {"type": "invalid_request_error", "code": code, "message": message}
    if param is not None:
        body["param"] = param
    return StripeError(status, body)


def decode_form(text: str) -> dict[str, Any]:
    """`a[b][0]=x&flag=true` as `{"a": {"b": ["x"]}, "flag": "true"}`: nested keys become
    objects, numeric or empty ones lists; values stay strings."""
    root: dict[str, Any] = {}
    for key, value in parse_qsl(text, keep_blank_values=True):
        head, _, rest = key.partition("[")
        path = [head, *_SEGMENT.findall("[" + rest)] if rest else [head]
        node = root
        for part in path[:-1]:
            child = node.setdefault(part or str(len(node)), {})
            if not isinstance(child, dict):
                raise invalid("parameter_invalid", f"Invalid parameter: {key[:60]}", key[:60])
            node = child
        last = path[-1] or str(len(node))
        if isinstance(node.get(last), dict):
            raise invalid("parameter_invalid", f"Invalid parameter: {key[:60]}", key[:60])
        node[last] = value
    decoded: dict[str, Any] = _lists(root)
    return decoded


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(k.isdigit() for k in items):
        return [items[k] for k in sorted(items, key=int)]
    return items


def _allowed(params: Mapping[str, Any], names: frozenset[str]) -> None:
    for name in params:
        if name not in names:
            raise invalid("parameter_unknown", f"Received unknown parameter: {name}", name)


def _required(params: Mapping[str, Any], name: str) -> str:
    value = params.get(name)
    if value is None or value == "":
        raise invalid("parameter_missing", f"Missing required param: {name}.", name)
    if not isinstance(value, str):
        raise invalid("parameter_invalid_string", f"Invalid string: {name}.", name)
    return value


def _integer(value: str, name: str, minimum: int, maximum: int | None = None) -> int:
    if not value.isdigit() or int(value) < minimum or (maximum and int(value) > maximum):
        raise invalid("parameter_invalid_integer", f"Invalid integer: {value[:40]}", name)
    return int(value)


def _boolean(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name, "false")
    if value not in ("true", "false"):
        raise invalid("parameter_invalid_boolean", f"Invalid boolean: {name}.", name)
    return bool(value == "true")


def _expand(params: Mapping[str, Any]) -> tuple[str, ...]:
    value = params.get("expand", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid("parameter_invalid", "Invalid array: expand.", "expand")
    return tuple(value)


def _metadata(params: Mapping[str, Any]) -> dict[str, str]:
    value = params.get("metadata", {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise invalid("parameter_invalid", "Invalid hash: metadata.", "metadata")
    return dict(value)


@dataclass(frozen=True)
class IntentParams:
    """A valid `POST /v1/payment_intents` (off-session, confirmed at once)."""

    amount: int
    currency: str
    customer: str
    payment_method: str
    metadata: dict[str, str]
    expand: tuple[str, ...] = ()

    def fingerprint(self) -> str:
        """What must match for a repeated idempotency key to be a replay."""
        return "POST /v1/payment_intents " + json.dumps(asdict(self), sort_keys=True)


INTENT_PARAMS = frozenset(
    {
        "amount",
        "currency",
        "customer",
        "payment_method",
        "confirm",
        "off_session",
        "metadata",
        "expand",
        "payment_method_types",
    }
)


def parse_intent(params: Mapping[str, Any]) -> IntentParams:
    """Validate a PaymentIntent creation as this simulator supports it."""
    _allowed(params, INTENT_PARAMS)
    amount = _integer(_required(params, "amount"), "amount", 1, 99_999_999)
    currency = _required(params, "currency")
    if not CURRENCY.fullmatch(currency):
        raise invalid(
            "parameter_invalid_currency", f"Invalid currency: {currency[:10]}", "currency"
        )
    customer = _required(params, "customer")
    payment_method = _required(params, "payment_method")
    confirm, off_session = _boolean(params, "confirm"), _boolean(params, "off_session")
    if not confirm:
        raise invalid(
            "parameter_invalid", "This simulator only creates confirmed intents.", "confirm"
        )
    if not off_session:
        raise invalid(
            "parameter_invalid", "This simulator only charges off-session.", "off_session"
        )
    return IntentParams(
        amount, currency, customer, payment_method, _metadata(params), _expand(params)
    )


@dataclass(frozen=True)
class RefundParams:
    """A valid `POST /v1/refunds` (in full)."""

    payment_intent: str | None
    charge: str | None
    reason: str | None
    metadata: dict[str, str] = field(default_factory=dict)

    def fingerprint(self) -> str:
        return "POST /v1/refunds " + json.dumps(asdict(self), sort_keys=True)


def parse_refund(params: Mapping[str, Any]) -> RefundParams:
    """Validate a refund: of a PaymentIntent (or its charge), in full, with a reason."""
    _allowed(params, frozenset({"payment_intent", "charge", "reason", "metadata", "amount"}))
    intent, charge = params.get("payment_intent"), params.get("charge")
    if (intent is None) == (charge is None):
        raise invalid("parameter_missing", "One of payment_intent or charge is required.")
    reason = params.get("reason")
    if reason is not None and reason not in REFUND_REASONS:
        raise invalid("parameter_invalid", f"Invalid reason: {str(reason)[:40]}", "reason")
    if "amount" in params:
        raise invalid("parameter_unknown", "This simulator refunds in full only.", "amount")
    return RefundParams(intent, charge, reason, _metadata(params))


@dataclass(frozen=True)
class IntentQuery:
    """A valid `GET /v1/payment_intents`: newest first."""

    customer: str | None = None
    created_gte: int | None = None
    created_lt: int | None = None
    limit: int = DEFAULT_LIMIT
    starting_after: str | None = None
    expand: tuple[str, ...] = ()


_BOUNDS = {"gte": (0, "gte"), "gt": (1, "gte"), "lt": (0, "lt"), "lte": (1, "lt")}


def parse_list(params: Mapping[str, Any]) -> IntentQuery:
    """Validate a PaymentIntent listing (`created` bounds, `customer`, paging)."""
    _allowed(params, frozenset({"customer", "created", "limit", "starting_after", "expand"}))
    bounds: dict[str, int] = {}
    created = params.get("created")
    if isinstance(created, str):
        moment = _integer(created, "created", 0)
        bounds = {"gte": moment, "lt": moment + 1}
    elif isinstance(created, dict):
        for name, value in created.items():
            if name not in _BOUNDS or not isinstance(value, str):
                raise invalid("parameter_unknown", f"Received unknown parameter: created[{name}]")
            shift, bound = _BOUNDS[name]
            bounds[bound] = _integer(value, f"created[{name}]", 0) + shift
    elif created is not None:
        raise invalid("parameter_invalid", "Invalid created.", "created")
    limit = params.get("limit", str(DEFAULT_LIMIT))
    after = params.get("starting_after")
    customer = params.get("customer")
    return IntentQuery(
        customer=customer if isinstance(customer, str) and customer else None,
        created_gte=bounds.get("gte"),
        created_lt=bounds.get("lt"),
        limit=_integer(limit if isinstance(limit, str) else "", "limit", 1, MAX_LIMIT),
        starting_after=after if isinstance(after, str) and after else None,
        expand=_expand(params),
    )


def expand_of(params: Mapping[str, Any]) -> tuple[str, ...]:
    """`expand` of a retrieval, the only parameter it takes."""
    _allowed(params, frozenset({"expand"}))
    return _expand(params)


# Objects as Stripe shows them. A simulator `Charge` record stands for a PaymentIntent
# (`status`: succeeded, failed, processing) and its one charge (`charge_id`).

INTENT_STATUS = {
    "succeeded": "succeeded",
    "failed": "requires_payment_method",
    "processing": "processing",
}
CHARGE_STATUS = {"succeeded": "succeeded", "failed": "failed", "processing": "pending"}


# the decline codes Stripe also names as the error's `code`; any other is `card_declined`
OWN_CODES = frozenset(
    {"authentication_required", "expired_card", "incorrect_cvc", "processing_error"}
)


@dataclass
class Intent(Charge):
    """A PaymentIntent: the record a `Charge` keeps (a decline's reason in `decline_code`),
    its charge and card."""

    charge_id: str = ""
    payment_method: str = ""


def error_code(decline_code: str) -> str:
    """The `code` of Stripe's decline error (and its charge's `failure_code`) for a bank's
    `decline_code`: `card_declined`, unless Stripe names the reason by a code of its own."""
    return decline_code if decline_code in OWN_CODES else "card_declined"


def charge_json(intent: Intent) -> dict[str, Any]:
    """The PaymentIntent's charge (its `latest_charge`)."""
    failed = intent.status == "failed"
    return {
        "id": intent.charge_id,
        "object": "charge",
        "amount": intent.amount,
        "amount_captured": 0 if failed else intent.amount,
        "amount_refunded": intent.amount_refunded,
        "refunded": intent.refunded,
        "captured": not failed,
        "currency": intent.currency,
        "customer": intent.customer,
        "payment_intent": intent.id,
        "payment_method": intent.payment_method,
        "status": CHARGE_STATUS[intent.status],
        "paid": intent.status == "succeeded",
        "failure_code": error_code(intent.decline_code) if intent.decline_code else None,
        "metadata": dict(intent.metadata),
        "created": intent.created,
        "livemode": False,
    }


def intent_json(intent: Intent, *, expand: tuple[str, ...] = ()) -> dict[str, Any]:
    """The PaymentIntent; `expand` with `latest_charge` (or `data.latest_charge` in a list)
    embeds its charge."""
    last_error = None
    if intent.status == "failed":
        code = intent.decline_code or GENERIC_DECLINE
        last_error = {
            "type": "card_error",
            "code": error_code(code),
            "decline_code": code,
            "charge": intent.charge_id,
            "message": cards.message(code),
        }
    embedded = "latest_charge" in expand or "data.latest_charge" in expand
    return {
        "id": intent.id,
        "object": "payment_intent",
        "amount": intent.amount,
        "amount_received": intent.amount if intent.status == "succeeded" else 0,
        "currency": intent.currency,
        "customer": intent.customer,
        "payment_method": intent.payment_method,
        "status": INTENT_STATUS[intent.status],
        "capture_method": "automatic",
        "confirmation_method": "automatic",
        "latest_charge": charge_json(intent) if embedded else intent.charge_id,
        "last_payment_error": last_error,
        "metadata": dict(intent.metadata),
        "created": intent.created,
        "livemode": False,
    }


def sim_json(intent: Intent) -> dict[str, Any]:
    """What `GET /_sim/charges` shows of it: the contract flavour's charge shape (the chaos
    checker counts both the same way), with its key and its Stripe ids."""
    return intent.to_json() | {
        "object": "payment_intent",
        "charge": intent.charge_id,
        "idempotency_key": intent.idempotency_key,
        "decline_code": intent.decline_code,
    }


def decline(intent: Intent) -> StripeError:
    """The 402 of a declined off-session PaymentIntent, the intent inside."""
    code = intent.decline_code or GENERIC_DECLINE
    body = {
        "type": "card_error",
        "code": error_code(code),
        "decline_code": code,
        "message": cards.message(code),
        "charge": intent.charge_id,
        "payment_intent": intent_json(intent),
    }
    return StripeError(402, body)


def refund_json(refund_id: str, intent: Intent, reason: str | None, created: int) -> dict[str, Any]:
    return {
        "id": refund_id,
        "object": "refund",
        "amount": intent.amount,
        "charge": intent.charge_id,
        "payment_intent": intent.id,
        "currency": intent.currency,
        "reason": reason,
        "status": "succeeded",
        "created": created,
    }


def customer_json(customer: str, payment_method: str | None) -> dict[str, Any]:
    return {
        "id": customer,
        "object": "customer",
        "invoice_settings": {"default_payment_method": payment_method},
        "livemode": False,
    }


def payment_method_json(payment_method: str, customer: str) -> dict[str, Any]:
    return {
        "id": payment_method,
        "object": "payment_method",
        "type": "card",
        "customer": customer,
        "card": {"brand": "visa", "last4": "4242", "exp_month": 12, "exp_year": 2030},
        "livemode": False,
    }


def page(url: str, data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "url": url, "data": data, "has_more": has_more}
