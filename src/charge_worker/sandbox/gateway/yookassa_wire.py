"""The YooKassa flavour's wire format: JSON bodies and queries in, YooKassa's objects and
error shapes out. Pure, no I/O.

Only the subset charge-worker speaks (API v3: autopayments with a saved payment method,
retrieved and listed; refunds). Money is `{"value": "990.00", "currency": "RUB"}`: `value`
a decimal string with exactly the currency's ISO 4217 exponent of digits after the point
(`EXPONENTS`, this simulator's own table), held here in minor units as an int. Every error
is `{"type": "error", "id", "code", "description", "parameter"?}`; a bad request is `400
invalid_request` naming the `parameter` (a dotted path: `amount.value`, `metadata.order_id`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.responses import JSONResponse

from charge_worker.sandbox.gateway.state import Charge

# ISO 4217 minor-unit exponents of the currencies this simulator takes
EXPONENTS: dict[str, int] = {
    "RUB": 2,
    "EUR": 2,
    "USD": 2,
    "GBP": 2,
    "CNY": 2,
    "KZT": 2,
    "BYN": 2,
    "UZS": 2,
    "JPY": 0,
    "KRW": 0,
    "KWD": 3,
    "BHD": 3,
}
IDEMPOTENCE_KEY = "Idempotence-Key"
MAX_KEY_LENGTH = 64
MAX_LIMIT = 100
DEFAULT_LIMIT = 10
# YooKassa's documented limits: metadata keys, their length and their values' length
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 32, 512
MAX_PAYMENT_DESCRIPTION, MAX_REFUND_DESCRIPTION = 128, 250
GATEWAY_ID = "100700"
CARD_TITLE = "Bank card *4444"
COMMISSION_PER_MILLE = 35  # what `income_amount` keeps back: 3.5 %
# the reasons YooKassa itself cancels for (party `yoo_kassa`); the merchant's own; every
# other reason is the bank's or the card network's (`payment_network`)
YOO_KASSA_REASONS = frozenset(
    {"fraud_suspected", "expired_on_confirmation", "expired_on_capture", "internal_timeout"}
)
MERCHANT_REASONS = frozenset({"canceled_by_merchant"})
STATUS = {"succeeded": "succeeded", "failed": "canceled", "processing": "pending"}
LIST_STATUSES = frozenset({"pending", "waiting_for_capture", "succeeded", "canceled"})
_NUMBER = r"(?:0|[1-9][0-9]{0,11})"


class YooKassaError(Exception):
    """A request YooKassa refuses: `status_code` and the error body's fields."""

    def __init__(
        self, status_code: int, code: str, description: str, parameter: str | None = None
    ) -> None:
        super().__init__(description)
        self.status_code = status_code
        self.code = code
        self.description = description
        self.parameter = parameter

    def body(self) -> dict[str, Any]:
        """`{"type": "error", "id", "code", "description", "parameter"?}`, a fresh id."""
        body = {
            "type": "error",
            "id": str(uuid.uuid4()),
            "code": self.code,
            "description": self.description,
        }
        if self.parameter is not None:
            body["parameter"] = self.parameter
        return body

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The answer."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def invalid(description: str, parameter: str | None = None) -> YooKassaError:
    """A `400 invalid_request`."""
    return YooKassaError(400, "invalid_request", description, parameter)


def not_found(description: str, parameter: str) -> YooKassaError:
    """A `404 not_found`."""
    return YooKassaError(404, "not_found", description, parameter)


def idempotence_key(headers: Mapping[str, str]) -> str:
    """The request's `Idempotence-Key`: required, at most 64 characters."""
    key = headers.get(IDEMPOTENCE_KEY.lower(), "")
    if not key:
        raise invalid("Idempotence-Key header is required", IDEMPOTENCE_KEY)
    if len(key) > MAX_KEY_LENGTH:
        raise invalid(
            f"Idempotence-Key is longer than {MAX_KEY_LENGTH} characters", IDEMPOTENCE_KEY
        )
    return key


# money


def parse_money(body: Mapping[str, Any], name: str) -> tuple[int, str]:
    """`body[name]` as (minor units, currency): a positive decimal string with exactly the
    currency's exponent of digits after the point."""
    money = body.get(name)
    if money is None:
        raise invalid(f"{name} is required", name)
    if not isinstance(money, dict) or set(money) != {"value", "currency"}:
        raise invalid(f"{name} must be an object with value and currency", name)
    currency, value = money["currency"], money["value"]
    if not isinstance(currency, str) or currency not in EXPONENTS:
        raise invalid(f"{name}.currency is not a supported ISO 4217 code", f"{name}.currency")
    exponent = EXPONENTS[currency]
    shape = _NUMBER + (rf"\.[0-9]{{{exponent}}}" if exponent else "")
    if not isinstance(value, str) or not re.fullmatch(shape, value):
        digits = f"{exponent} digits after the point" if exponent else "no fraction"
        raise invalid(
            f"{name}.value must be a decimal string with {digits} for {currency}",
            f"{name}.value",
        )
    minor = int(value.replace(".", ""))
    if minor <= 0:
        raise invalid(f"{name}.value must be positive", f"{name}.value")
    return minor, currency


def money_json(minor: int, currency: str) -> dict[str, str]:
    """Minor units as YooKassa's money object."""
    exponent = EXPONENTS[currency]
    if not exponent:
        return {"value": str(minor), "currency": currency}
    whole, fraction = divmod(minor, 10**exponent)
    return {"value": f"{whole}.{fraction:0{exponent}d}", "currency": currency}


# requests


def _object(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise invalid(f"Unknown parameter: {str(name)[:60]}", str(name)[:60])
    return body


def _string(body: Mapping[str, Any], name: str, parameter: str | None = None) -> str:
    parameter = parameter or name
    value = body.get(name)
    if value is None:
        raise invalid(f"{parameter} is required", parameter)
    if not isinstance(value, str) or not value:
        raise invalid(f"{parameter} must be a non-empty string", parameter)
    return value


def _description(body: Mapping[str, Any], longest: int) -> str | None:
    value = body.get("description")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > longest:
        raise invalid(f"description must be a string of at most {longest}", "description")
    return value


def _metadata(body: Mapping[str, Any]) -> dict[str, str]:
    """YooKassa's `metadata`: optional (another integration on the shop may send none),
    string values; ours carries `order_id` and `billing_period`."""
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise invalid(f"metadata must be an object of at most {MAX_METADATA_KEYS}", "metadata")
    for name, value in metadata.items():
        if len(name) > MAX_METADATA_KEY:
            raise invalid(f"metadata keys are at most {MAX_METADATA_KEY} long", "metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise invalid(
                f"metadata values are strings of at most {MAX_METADATA_VALUE}",
                f"metadata.{name}",
            )
    return dict(metadata)


@dataclass(frozen=True)
class PaymentParams:
    """A valid `POST /v3/payments` (an autopayment with a saved method, captured at once)."""

    amount: int
    currency: str
    payment_method_id: str
    description: str | None
    metadata: dict[str, str]

    def fingerprint(self) -> str:
        """What must match for a repeated idempotence key to be a replay."""
        return "POST /v3/payments " + json.dumps(asdict(self), sort_keys=True)


PAYMENT_PARAMS = frozenset({"amount", "capture", "payment_method_id", "description", "metadata"})


def parse_payment(body: Any) -> PaymentParams:
    """Validate a payment creation as this simulator supports it."""
    body = _object(body, PAYMENT_PARAMS)
    amount, currency = parse_money(body, "amount")
    if body.get("capture") is not True:
        raise invalid("This simulator only takes payments with capture true", "capture")
    return PaymentParams(
        amount,
        currency,
        _string(body, "payment_method_id"),
        _description(body, MAX_PAYMENT_DESCRIPTION),
        _metadata(body),
    )


@dataclass(frozen=True)
class RefundParams:
    """A valid `POST /v3/refunds`."""

    payment_id: str
    amount: int
    currency: str
    description: str | None

    def fingerprint(self) -> str:
        """What must match for a repeated idempotence key to be a replay."""
        return "POST /v3/refunds " + json.dumps(asdict(self), sort_keys=True)


def parse_refund(body: Any) -> RefundParams:
    """Validate a refund (the amount is required; checked against the payment later)."""
    body = _object(body, frozenset({"payment_id", "amount", "description"}))
    payment_id = _string(body, "payment_id")
    amount, currency = parse_money(body, "amount")
    return RefundParams(payment_id, amount, currency, _description(body, MAX_REFUND_DESCRIPTION))


@dataclass(frozen=True)
class PaymentQuery:
    """A valid `GET /v3/payments`: creation bounds in milliseconds (`created_from_ms`
    inclusive, `created_until_ms` exclusive), newest first from `before_seq` (the cursor)."""

    created_from_ms: int | None = None
    created_until_ms: int | None = None
    status: str | None = None
    limit: int = DEFAULT_LIMIT
    before_seq: int | None = None


def parse_list(query: Mapping[str, str]) -> PaymentQuery:
    """Validate a payment listing (`created_at.gte|gt|lt|lte`, `status`, `limit`, `cursor`)."""
    bounds = ("created_at.gte", "created_at.gt", "created_at.lt", "created_at.lte")
    for name in query:
        if name not in {*bounds, "status", "limit", "cursor"}:
            raise invalid(f"Unknown parameter: {name[:60]}", name[:60])
    lower: list[int] = []
    upper: list[int] = []
    for name in bounds:
        if name in query:
            micros = _instant_us(query[name], name)
            # to whole milliseconds, the precision of `created_at`
            match name.rpartition(".")[2]:
                case "gte":
                    lower.append(-(-micros // 1000))
                case "gt":
                    lower.append(micros // 1000 + 1)
                case "lt":
                    upper.append(-(-micros // 1000))
                case _:
                    upper.append(micros // 1000 + 1)
    status = query.get("status")
    if status is not None and status not in LIST_STATUSES:
        raise invalid(f"status must be one of {sorted(LIST_STATUSES)}", "status")
    raw_limit = query.get("limit", str(DEFAULT_LIMIT))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
        raise invalid(f"limit must be an integer 1..{MAX_LIMIT}", "limit")
    cursor = query.get("cursor")
    return PaymentQuery(
        created_from_ms=max(lower) if lower else None,
        created_until_ms=min(upper) if upper else None,
        status=status,
        limit=int(raw_limit),
        before_seq=None if cursor is None else decode_cursor(cursor),
    )


def _instant_us(text: str, name: str) -> int:
    """An ISO 8601 instant as unix microseconds (without an offset: UTC)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise invalid(f"{name} must be an ISO 8601 date and time", name) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def encode_cursor(seq: int) -> str:
    """The opaque cursor of the page after the payment numbered `seq`."""
    return base64.urlsafe_b64encode(f"before:{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The payment number a cursor continues before; a bad cursor is `400 cursor`."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    prefix, _, number = text.partition(":")
    if prefix != "before" or not number.isdigit():
        raise invalid("cursor is not a cursor this API gave", "cursor")
    return int(number)


# objects


@dataclass
class Payment(Charge):
    """A payment: the record a `Charge` keeps (`customer` is the payment method id; a
    canceled one is `failed` with its reason in `decline_code`, a pending one
    `processing`), with YooKassa's own fields."""

    description: str | None = None
    created_ms: int = 0
    captured_ms: int | None = None


def iso(ms: int) -> str:
    """Unix milliseconds as YooKassa writes a time: ISO 8601 UTC, milliseconds, `Z`."""
    moment = datetime.fromtimestamp(ms // 1000, UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def party(reason: str) -> str:
    """Who canceled a payment for `reason` (`cancellation_details.party`)."""
    if reason in YOO_KASSA_REASONS:
        return "yoo_kassa"
    if reason in MERCHANT_REASONS:
        return "merchant"
    return "payment_network"


def payment_json(payment: Payment, shop_id: str) -> dict[str, Any]:
    """The payment object as YooKassa shows it."""
    status = STATUS[payment.status]
    succeeded = status == "succeeded"
    shown: dict[str, Any] = {
        "id": payment.id,
        "status": status,
        "paid": succeeded,
        "amount": money_json(payment.amount, payment.currency),
    }
    if succeeded:
        commission = (payment.amount * COMMISSION_PER_MILLE + 500) // 1000
        shown["income_amount"] = money_json(payment.amount - commission, payment.currency)
    if payment.description is not None:
        shown["description"] = payment.description
    shown |= {
        "recipient": {"account_id": shop_id, "gateway_id": GATEWAY_ID},
        "payment_method": {
            "type": "bank_card",
            "id": payment.customer,
            "saved": True,
            "title": CARD_TITLE,
        },
    }
    if payment.captured_ms is not None:
        shown["captured_at"] = iso(payment.captured_ms)
    shown |= {
        "created_at": iso(payment.created_ms),
        "test": True,
        "refunded_amount": money_json(payment.amount_refunded, payment.currency),
        "refundable": succeeded and payment.amount_refunded < payment.amount,
        "metadata": dict(payment.metadata),
    }
    if status == "canceled":
        reason = payment.decline_code or "general_decline"
        shown["cancellation_details"] = {"party": party(reason), "reason": reason}
    return shown


def refund_json(
    refund_id: str, payment: Payment, params: RefundParams, created_ms: int
) -> dict[str, Any]:
    """A succeeded refund of `payment`."""
    shown: dict[str, Any] = {
        "id": refund_id,
        "payment_id": payment.id,
        "status": "succeeded",
        "amount": money_json(params.amount, params.currency),
        "created_at": iso(created_ms),
    }
    if params.description is not None:
        shown["description"] = params.description
    return shown


def sim_json(payment: Payment) -> dict[str, Any]:
    """What `GET /_sim/charges` shows of it: the contract flavour's charge shape (`customer`
    the payment method id; status succeeded, failed or processing), with its key."""
    return payment.to_json() | {
        "object": "payment",
        "idempotency_key": payment.idempotency_key,
        "yookassa_status": STATUS[payment.status],
    }


def processing(retry_after_ms: int) -> dict[str, Any]:
    """The `202` body of a key whose first request is still executing."""
    return {"type": "processing", "description": "Request accepted", "retry_after": retry_after_ms}


def page(items: list[dict[str, Any]], next_cursor: str | None) -> dict[str, Any]:
    """A list answer; `next_cursor` only when another page follows."""
    listed: dict[str, Any] = {"type": "list", "items": items}
    if next_cursor is not None:
        listed["next_cursor"] = next_cursor
    return listed
