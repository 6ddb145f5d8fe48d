"""Stripe's answers, as the domain reads them: pure functions, no I/O (docs/adapters.md has
the same table for people).

| Stripe answers (stripe-python raises)              | the domain                               |
|----------------------------------------------------|------------------------------------------|
| 200 PaymentIntent `succeeded` (replayed or not)    | `ChargeResult(succeeded, pi id)`         |
| 200 `processing` (a bank debit)                    | `ChargeResult(processing, pi id)`: open, |
|                                                    | never re-sent; a webhook or reconcile    |
|                                                    | settles it                               |
| 402 `card_error` (`CardError`)                     | `ChargeResult(declined, decline_code)`   |
| 402 `authentication_required`                      | `ChargeResult(declined,                  |
|                                                    | authentication_required)`: its own kind  |
| 200 `requires_action` / `requires_payment_method`  | declined (`authentication_required` /    |
| / `canceled` (not off-session Stripe's way)        | the last error's code)                   |
| 200 any other status                               | `GatewayRejected` (not an end state)     |
| 409 `idempotency_key_in_use` (`APIError`)          | `RequestInProgress`                      |
| 400 `idempotency_error` (`IdempotencyError`)       | `GatewayRejected` (key reused)           |
| 400 `invalid_request_error` (`InvalidRequestError`)| `GatewayRejected`                        |
| 429 `rate_limit`, `lock_timeout` (`RateLimitError`)| `RateLimited(Retry-After, else 1 s)`     |
| 401 / 403 (`AuthenticationError`, `PermissionError`)| `DependencyUnavailable` (our key)       |
| any other 4xx, or a 4xx without Stripe's body      | `DependencyUnavailable` (not accepted)   |
| 5xx `api_error`, an unreadable answer (`APIError`) | `OutcomeUnknown`                         |
| 5xx with `Idempotent-Replayed: true`               | `ReplayedFailure` (unknown, not counted  |
|                                                    | by the breaker: no new failure)          |
| timeout, reset (`APIConnectionError`)              | `OutcomeUnknown`                         |
| connection refused (`APIConnectionError`, never sent) | `DependencyUnavailable`               |
"""

from __future__ import annotations

from typing import Any

import stripe

from charge_worker.errors import (
    ChargeWorkerError,
    DependencyUnavailable,
    GatewayRejected,
    OutcomeUnknown,
    RateLimited,
    ReplayedFailure,
    RequestInProgress,
)
from charge_worker.gateway.guard import never_sent, retry_after
from charge_worker.gateway.results import (
    AUTHENTICATION_REQUIRED,
    CARD_DECLINED,
    ChargeResult,
    GatewayCharge,
    try_of,
)

IN_PROGRESS_RETRY_S = 2.0
ALREADY_REFUNDED = "charge_already_refunded"
# A PaymentIntent's status -> the charge's status (`GatewayCharge.status`)
STATUS = {
    "succeeded": "succeeded",
    "processing": "processing",
    "requires_action": "failed",  # off-session: the bank wants the customer
    "canceled": "failed",
}


def _summary(error: stripe.StripeError) -> str:
    """Status, type and code; the message only where it names no credential."""
    body = error.error
    kind = "/".join(x for x in (body and body.type, body and body.code) if x)
    text = f"gateway {error.http_status or '-'} {kind}".rstrip()
    if isinstance(error, stripe.AuthenticationError | stripe.PermissionError):
        return text  # Stripe's message quotes part of the key
    message = " ".join(str(body.message or "").split())[:200] if body else ""
    return f"{text}: {message}" if message else text


def domain_error(error: stripe.StripeError) -> ChargeWorkerError:
    """The domain error an SDK exception stands for (a decline is no error: see
    `declined`). Raised inside the breaker: `OutcomeUnknown` and `DependencyUnavailable`
    count toward it."""
    summary = _summary(error)
    if isinstance(error, stripe.APIConnectionError):
        if never_sent(error):
            return DependencyUnavailable(f"gateway unreachable: {summary}")
        return OutcomeUnknown(f"gateway connection lost: {summary}")
    if isinstance(error, stripe.RateLimitError):
        header = (error.headers or {}).get("Retry-After")
        return RateLimited(summary, retry_after_s=retry_after(header))
    return _answered(error, summary)


def _answered(error: stripe.StripeError, summary: str) -> ChargeWorkerError:
    """An answer that is no success, by its class and status."""
    status = error.http_status
    if isinstance(error, stripe.AuthenticationError | stripe.PermissionError):
        return DependencyUnavailable(f"{summary}: check GATEWAY_API_KEY")
    if isinstance(error, stripe.IdempotencyError):
        return GatewayRejected(f"{summary} (the key was used with other parameters)")
    if status == 409:
        return RequestInProgress(summary, retry_after_s=IN_PROGRESS_RETRY_S)
    if isinstance(error, stripe.InvalidRequestError) and status == 400:
        return GatewayRejected(summary)
    if status is not None and 400 <= status < 500:
        return DependencyUnavailable(
            f"{summary}: not accepted, nothing charged, retried later"
            " (a wrong GATEWAY_URL, a proxy, a limit?)"
        )
    return _unknown(error, summary)


def _unknown(error: stripe.StripeError, summary: str) -> OutcomeUnknown:
    """A 5xx or an unreadable answer; a 5xx Stripe replays (its first answer to this key)
    is no new failure of Stripe's (`ReplayedFailure`)."""
    replayed = str((error.headers or {}).get("Idempotent-Replayed", "")).lower() == "true"
    if replayed and (error.http_status or 0) >= 500:
        return ReplayedFailure(f"{summary} (replayed: Stripe's first answer to this key)")
    return OutcomeUnknown(summary)


def missing(error: stripe.StripeError) -> bool:
    """A 404 `resource_missing`: Stripe has no such object (not a wrong URL)."""
    return (
        isinstance(error, stripe.InvalidRequestError)
        and error.http_status == 404
        and error.error is not None
        and error.error.code == "resource_missing"
    )


def already_refunded(error: stripe.StripeError) -> bool:
    """`400 charge_already_refunded`: the refund was made before."""
    return (
        isinstance(error, stripe.InvalidRequestError)
        and error.error is not None
        and error.error.code == ALREADY_REFUNDED
    )


def declined(error: stripe.CardError) -> ChargeResult:
    """A 402: declined; `authentication_required` keeps its own kind, else the bank's
    `decline_code` (`insufficient_funds`, …), else the code."""
    body = error.error
    intent = body.payment_intent if body is not None else None
    intent_id = intent.id if intent is not None else None
    code = error.code or (body.code if body else None) or CARD_DECLINED
    if code != AUTHENTICATION_REQUIRED and body is not None and body.decline_code:
        code = body.decline_code
    return ChargeResult("declined", intent_id, decline_code=code)


def charge_result(intent: dict[str, Any], *, replayed: bool) -> ChargeResult:
    """A 200's PaymentIntent, as the result of an off-session confirmed charge."""
    intent_id, status = str(intent["id"]), intent.get("status")
    if status == "succeeded":
        return ChargeResult("succeeded", intent_id, replayed=replayed)
    if status == "processing":
        return ChargeResult("processing", intent_id, replayed=replayed)
    if status in ("requires_action", "requires_payment_method", "canceled"):
        return ChargeResult(
            "declined", intent_id, replayed=replayed, decline_code=_decline_code(intent)
        )
    raise GatewayRejected(
        f"PaymentIntent {intent_id} is {status!r}: no state an off-session confirmed charge"
        " ends in (capture_method=manual on the account?)"
    )


def _decline_code(intent: dict[str, Any]) -> str:
    """A failed intent's reason: `authentication_required` for `requires_action` (or that
    code), else its last payment error's `decline_code`, else its `code`."""
    if intent.get("status") == "requires_action":
        return AUTHENTICATION_REQUIRED
    error = intent.get("last_payment_error") or {}
    code = error.get("code") if isinstance(error, dict) else None
    if code == AUTHENTICATION_REQUIRED:
        return AUTHENTICATION_REQUIRED
    decline = error.get("decline_code") if isinstance(error, dict) else None
    return str(decline or code or intent.get("status") or CARD_DECLINED)


def gateway_charge(intent: dict[str, Any]) -> GatewayCharge:
    """A PaymentIntent (its `latest_charge` expanded) as the domain's charge: the intent's
    id, status and amount; the refund from its charge; upper-case currency; the try its
    `metadata[attempt]` names (absent: 1)."""
    latest = intent.get("latest_charge")
    charge = latest if isinstance(latest, dict) else {}
    status = str(intent["status"])
    error = intent.get("last_payment_error")
    if status == "requires_payment_method":
        state = "failed" if error else "incomplete"
    else:
        state = STATUS.get(status, "incomplete")
    customer = intent.get("customer")
    if isinstance(customer, dict):
        customer = customer.get("id")
    metadata = intent.get("metadata") or {}
    return GatewayCharge(
        id=str(intent["id"]),
        status=state,
        amount=int(intent["amount"]),
        currency=str(intent["currency"]).upper(),
        customer=str(customer or ""),
        order_id=metadata.get("order_id"),
        billing_period=metadata.get("billing_period"),
        created=int(intent["created"]),
        amount_refunded=int(charge.get("amount_refunded") or 0),
        refunded=charge.get("refunded") is True,
        decline_code=_decline_code(intent) if state == "failed" else None,
        attempt=try_of(metadata),
    )
