"""The gateway simulator's wire format: request validation (pure) and Stripe-like answers.

Rule of thumb, as documented in `gateway.py`: a request that cannot be read (not a JSON
object, a missing or unknown parameter, a bad query) is `400`; a parameter that is present but
has a wrong type or value is `422`. Both carry `invalid_request_error` and name the `param`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from starlette.responses import JSONResponse

from charge_worker.sandbox.gateway.state import ChargeQuery, StoredResponse

CURRENCY = re.compile(r"[A-Z]{3}")
REFUND_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer"})
MAX_LIMIT = 100
DEFAULT_LIMIT = 10


class InvalidRequest(Exception):
    """The request breaks the API; `status_code`, `code` and `param` go into the answer."""

    def __init__(self, status_code: int, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.param = param


def idempotency_key(headers: Mapping[str, str]) -> str:
    """The request's `Idempotency-Key` header; required on every POST."""
    key = headers.get("idempotency-key", "")
    if not key:
        raise _missing("Idempotency-Key")
    return key


def _missing(param: str) -> InvalidRequest:
    return InvalidRequest(400, "parameter_missing", f"Missing required param: {param}.", param)


def _invalid(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(422, "parameter_invalid", f"Invalid {param}: {why}.", param)


def _object(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest(400, "body_invalid", "The body must be a JSON object.", None)
    for name in body:
        if name not in allowed:
            raise InvalidRequest(
                400, "parameter_unknown", f"Received unknown parameter: {name}.", name
            )
    return body


def _string(body: Mapping[str, Any], name: str, param: str | None = None) -> str:
    param = param or name
    if name not in body:
        raise _missing(param)
    value = body[name]
    if not isinstance(value, str) or not value:
        raise _invalid(param, "must be a non-empty string")
    return value


@dataclass(frozen=True)
class ChargeParams:
    """A valid `POST /v1/charges` body."""

    amount: int
    currency: str
    customer: str
    metadata: dict[str, str]

    def fingerprint(self) -> str:
        """What must match for a repeated idempotency key to be a replay."""
        return "POST /v1/charges " + json.dumps(asdict(self), sort_keys=True)


def parse_charge(body: Any) -> ChargeParams:
    """Validate a charge body."""
    body = _object(body, frozenset({"amount", "currency", "customer", "metadata"}))
    if "amount" not in body:
        raise _missing("amount")
    amount = body["amount"]
    # bool is an int subclass, and 99000.0 is not an amount in minor units.
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise _invalid("amount", "must be a positive integer in minor units")
    currency = _string(body, "currency")
    if not CURRENCY.fullmatch(currency):
        raise _invalid("currency", "must be three upper-case letters (ISO 4217)")
    customer = _string(body, "customer")
    if "metadata" not in body:
        raise _missing("metadata")
    metadata = body["metadata"]
    if not isinstance(metadata, dict):
        raise _invalid("metadata", "must be an object")
    for name in ("order_id", "billing_period"):
        _string(metadata, name, f"metadata[{name}]")
    for name, value in metadata.items():
        if not isinstance(value, str):
            raise _invalid(f"metadata[{name}]", "metadata values are strings")
    return ChargeParams(amount, currency, customer, dict(metadata))


@dataclass(frozen=True)
class RefundParams:
    """A valid `POST /v1/refunds` body."""

    charge: str
    reason: str | None

    def fingerprint(self) -> str:
        """What must match for a repeated idempotency key to be a replay."""
        return "POST /v1/refunds " + json.dumps(asdict(self), sort_keys=True)


def parse_refund(body: Any) -> RefundParams:
    """Validate a refund body."""
    body = _object(body, frozenset({"charge", "reason"}))
    charge = _string(body, "charge")
    reason = body.get("reason")
    if reason is not None and reason not in REFUND_REASONS:
        raise _invalid("reason", f"must be one of {sorted(REFUND_REASONS)}")
    return RefundParams(charge, reason)


def _int(query: Mapping[str, str], name: str, minimum: int, maximum: int | None) -> int | None:
    raw = query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidRequest(400, "parameter_invalid", f"{name} must be an integer {bounds}.", name)
    return value


def parse_query(query: Mapping[str, str]) -> ChargeQuery:
    """Validate a `GET /v1/charges` query (the order pair, or time paging, or both)."""
    allowed = {"order_id", "billing_period", "created_gte", "created_lt", "limit", "starting_after"}
    for name in query:
        if name not in allowed:
            raise InvalidRequest(
                400, "parameter_unknown", f"Unknown query parameter: {name}.", name
            )
    order_id, period = query.get("order_id"), query.get("billing_period")
    if (order_id is None) != (period is None):
        raise _missing("billing_period" if period is None else "order_id")
    limit = _int(query, "limit", 1, MAX_LIMIT)
    if limit is None and order_id is None:
        limit = DEFAULT_LIMIT
    return ChargeQuery(
        order_id=order_id,
        billing_period=period,
        created_gte=_int(query, "created_gte", 0, None),
        created_lt=_int(query, "created_lt", 0, None),
        limit=limit,
        starting_after=query.get("starting_after") or None,
    )


def api_error(
    status_code: int,
    error_type: str,
    code: str,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A Stripe-like error answer: `{"error": {"type", "code", "message"[, "param"]}}`."""
    return JSONResponse(
        {"error": error_body(error_type, code, message, param)},
        status_code=status_code,
        headers=headers,
    )


def error_body(error_type: str, code: str, message: str, param: str | None) -> dict[str, Any]:
    """The inside of an error answer."""
    error = {"type": error_type, "code": code, "message": message}
    if param is not None:
        error["param"] = param
    return error


def rejected(exc: InvalidRequest) -> JSONResponse:
    """The answer to an invalid request."""
    return api_error(
        exc.status_code, "invalid_request_error", exc.code, exc.message, param=exc.param
    )


def answer(response: StoredResponse, *, replayed: bool = False) -> JSONResponse:
    """A stored answer; a replay carries `Idempotent-Replayed: true`."""
    headers = {"Idempotent-Replayed": "true"} if replayed else None
    return JSONResponse(response.body, status_code=response.status_code, headers=headers)
