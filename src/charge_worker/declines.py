"""Decline codes and their classes: the one table (`docs/contracts/gateway.md`, "Retrying a
declined renewal") every adapter's codes are read through. A provider's own reasons keep
their names (YooKassa's `cancellation_details.reason`, ADR 0008): the names of the two
vocabularies do not collide, and a code means the same in both where they share it.

A class says what may follow a decline: `soft` (the bank may say yes another day),
`customer_action` (nothing changes until the customer does something), `hard` (never again
for this period). A code not in the table is `soft`; a decline that names no code is a
`generic_decline`.
"""

from __future__ import annotations

from typing import Literal

DeclineClass = Literal["soft", "customer_action", "hard"]

GENERIC_DECLINE = "generic_decline"

# the card gateways' codes: docs/contracts/gateway.md's table
CONTRACT_CLASSES: dict[str, DeclineClass] = {
    "insufficient_funds": "soft",
    "try_again_later": "soft",
    "do_not_honor": "soft",
    "processing_error": "soft",
    "issuer_not_available": "soft",
    GENERIC_DECLINE: "soft",
    "authentication_required": "customer_action",
    "expired_card": "customer_action",
    "incorrect_cvc": "customer_action",
    "card_not_supported": "customer_action",
    "stolen_card": "hard",
    "lost_card": "hard",
    "pickup_card": "hard",
    "fraudulent": "hard",
    "revocation_of_authorization": "hard",
    "restricted_card": "hard",
    "security_violation": "hard",
}
# YooKassa's `cancellation_details.reason`s: docs/decisions/0008-yookassa-declines.md's table
YOOKASSA_CLASSES: dict[str, DeclineClass] = {
    "insufficient_funds": "soft",
    "general_decline": "soft",
    "issuer_unavailable": "soft",
    "payment_method_limit_exceeded": "soft",
    "internal_timeout": "soft",
    "expired_on_capture": "soft",
    "3d_secure_failed": "customer_action",
    "call_issuer": "customer_action",
    "card_expired": "customer_action",
    "invalid_card_number": "customer_action",
    "invalid_csc": "customer_action",
    "identification_required": "customer_action",
    "expired_on_confirmation": "customer_action",
    "unsupported_mobile_operator": "customer_action",
    "fraud_suspected": "hard",
    "payment_method_restricted": "hard",
    "permission_revoked": "hard",
    "country_forbidden": "hard",
    "canceled_by_merchant": "hard",
    "payment_expired": "hard",
}
CLASSES: dict[str, DeclineClass] = CONTRACT_CLASSES | YOOKASSA_CLASSES
# the codes a bank uses to want the customer present (billing e-mails them)
AUTHENTICATION_CODES = frozenset({"authentication_required", "3d_secure_failed"})


def decline_class(code: str | None) -> DeclineClass:
    """The class of a gateway's decline code (None: a `generic_decline`)."""
    return CLASSES.get(code or GENERIC_DECLINE, "soft")


def label(code: str | None) -> str:
    """A decline code as a metric's label: a code of the table, or `other` (a label per code
    a gateway may invent would be unbounded)."""
    code = code or GENERIC_DECLINE
    return code if code in CLASSES else "other"
