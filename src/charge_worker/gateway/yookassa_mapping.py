"""YooKassa's answers (API v3), as the domain reads them: pure functions, no I/O
(docs/adapters.md has the same table for people).

| YooKassa answers                                   | the domain                               |
|----------------------------------------------------|------------------------------------------|
| 200 payment `succeeded`                            | `ChargeResult(succeeded, payment id)`;   |
|                                                    | `replayed` None: YooKassa never says     |
| 200 `pending` (the bank is working),               | `ChargeResult(processing, payment id)`:  |
| `waiting_for_capture` (never with `capture: true`) | open, never re-sent; the notification or |
|                                                    | reconcile settles it                     |
| 200 `canceled` + `cancellation_details.reason`     | `ChargeResult(declined, reason)` (ADR    |
|                                                    | 0008; no reason: a `generic_decline`)    |
| 202 `processing` (`retry_after` ms)                | `RequestInProgress`                      |
| 400 `invalid_request` (a parameter, or the key     | `GatewayRejected`                        |
| duplicated with another body)                      |                                          |
| 401 `invalid_credentials`, 403 `forbidden`         | `DependencyUnavailable` (our key)        |
| 404 `not_found` on a read by id                    | no such object (`retrieve`: None)        |
| 429 `too_many_requests`                            | `RateLimited(Retry-After, else 1 s)`     |
| any other 4xx, or a 4xx without YooKassa's body    | `DependencyUnavailable` (not accepted)   |
| 5xx, an unreadable 200                             | `OutcomeUnknown`                         |

A payment's `amount.value` is a decimal string (`"990.00"`), read exactly by the currency's
ISO 4217 minor unit (`charge_worker.money`): a value with other digits is unreadable, never
rounded. A payment's customer is its saved method (`payment_method.id`): the id a
subscription's `customer_id` carries (docs/adapters.md).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from charge_worker import money
from charge_worker.errors import (
    DependencyUnavailable,
    GatewayRejected,
    OutcomeUnknown,
    RateLimited,
    RequestInProgress,
)
from charge_worker.gateway.guard import retry_after
from charge_worker.gateway.results import ChargeResult, GatewayCharge, try_of

IN_PROGRESS_RETRY_S = 2.0  # a 202 without `retry_after`
REFUND_TAKEN = frozenset({"succeeded", "pending"})
MAX_IN_PROGRESS_RETRY_S = 60.0
# a payment's status -> the charge's (`GatewayCharge.status`)
STATUS = {
    "succeeded": "succeeded",
    "canceled": "failed",
    "pending": "processing",
    "waiting_for_capture": "processing",  # authorised, not captured: money held, not taken
}


class Unreadable(ValueError):
    """A payment object that is not what YooKassa's reference describes."""


def gateway_charge(payment: dict[str, Any]) -> GatewayCharge:
    """A payment object as lookups and history pages show a charge. Raises `Unreadable`."""
    try:
        amount = payment["amount"]
        currency = str(amount["currency"]).upper()
        value = money.from_decimal_string(_string(amount["value"]), currency)
        refunded = payment.get("refunded_amount") or {"value": None}
        refunded_value = (
            0
            if refunded.get("value") is None
            else money.from_decimal_string(_string(refunded["value"]), currency)
        )
        status = STATUS[str(payment["status"])]
        metadata = payment.get("metadata") or {}
        method = payment.get("payment_method") or {}
        reason = (payment.get("cancellation_details") or {}).get("reason")
        return GatewayCharge(
            id=str(payment["id"]),
            status=status,
            amount=value,
            currency=currency,
            customer=str(method.get("id") or ""),
            order_id=_text(metadata.get("order_id")),
            billing_period=_text(metadata.get("billing_period")),
            created=int(instant(str(payment["created_at"])).timestamp()),
            amount_refunded=refunded_value,
            refunded=value > 0 and refunded_value >= value,
            decline_code=str(reason) if status == "failed" and reason else None,
            attempt=try_of(metadata),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise Unreadable(f"unreadable YooKassa payment: {error!r}"[:300]) from error


def charge_result(payment: dict[str, Any]) -> ChargeResult:
    """The answer to a payment's creation: charged, open (`processing`) or declined."""
    charge = gateway_charge(payment)
    if charge.status == "succeeded":
        return ChargeResult("succeeded", charge.id, replayed=None)
    if charge.status == "processing":
        return ChargeResult("processing", charge.id, replayed=None)
    return ChargeResult("declined", charge.id, replayed=None, decline_code=charge.decline_code)


def domain_error(status: int, body: object, headers: Mapping[str, str]) -> Exception:
    """The domain error for an answer that is no 200 (`status` its HTTP status, `body` its
    JSON or None when it had none)."""
    error = body if isinstance(body, dict) else {}
    code = str(error.get("code") or "")
    summary = f"YooKassa {status} {code}".rstrip()
    if parameter := error.get("parameter"):
        summary += f" ({parameter})"
    if status == 202:
        asked = error.get("retry_after")
        delay = asked / 1000 if isinstance(asked, int | float) and asked > 0 else None
        return RequestInProgress(
            "YooKassa 202: the request with this key is still being processed",
            retry_after_s=min(delay or IN_PROGRESS_RETRY_S, MAX_IN_PROGRESS_RETRY_S),
        )
    if not 400 <= status < 500:  # 5xx; or a 1xx/3xx where none belongs
        return OutcomeUnknown(summary)
    if status in (401, 403):
        return DependencyUnavailable(f"{summary}: check GATEWAY_API_KEY (<shopId>:<secret key>)")
    if status == 429:
        return RateLimited(summary, retry_after_s=retry_after(headers.get("Retry-After")))
    if status == 400 and error.get("type") == "error" and code == "invalid_request":
        description = str(error.get("description") or "")[:200]
        return GatewayRejected(f"{summary}: {description}".rstrip(": "))
    why = " without YooKassa's error body" if error.get("type") != "error" else ""
    return DependencyUnavailable(
        f"YooKassa answered {status}{why}: not accepted, nothing charged, retried later"
        " (a wrong GATEWAY_URL, a proxy, a limit?)"
    )


def not_found(status: int, body: object) -> bool:
    """YooKassa's own 404 about the object in the path (not a wrong URL or a proxy)."""
    return status == 404 and isinstance(body, dict) and body.get("code") == "not_found"


def instant(text: str) -> dt.datetime:
    """An ISO 8601 moment as YooKassa writes them (`2026-12-01T03:00:00.123Z`), aware."""
    moment = dt.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} names no time zone")
    return moment


def iso(unix_s: int) -> str:
    """Unix seconds as YooKassa's filters take a moment: ISO 8601 UTC, milliseconds, `Z`."""
    moment = dt.datetime.fromtimestamp(unix_s, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def metadata_matches(payment: object, wanted: Mapping[str, str]) -> bool:
    """A listed payment's metadata carries every item of `wanted` (read loosely: a payment
    of another integration may be shaped any way)."""
    metadata = payment.get("metadata") if isinstance(payment, dict) else None
    return isinstance(metadata, dict) and all(metadata.get(k) == v for k, v in wanted.items())


def refund_id(refund: dict[str, Any]) -> str:
    """A refund's answer: its id once YooKassa took it (`succeeded`, or `pending`: under
    way, and a retry under its key answers it again); `canceled` is a refusal."""
    found, status = refund.get("id"), refund.get("status")
    if status == "canceled":
        reason = (refund.get("cancellation_details") or {}).get("reason")
        raise GatewayRejected(f"YooKassa canceled the refund {found}: {reason}")
    if not isinstance(found, str) or not found or status not in REFUND_TAKEN:
        raise OutcomeUnknown(f"YooKassa answered a refund with {str(refund)[:200]}")
    return found


def _string(value: object) -> str:
    """A money value as YooKassa sends one: a string, never a JSON number."""
    if not isinstance(value, str):
        raise TypeError(f"an amount's value {value!r} is not a string")
    return value


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
