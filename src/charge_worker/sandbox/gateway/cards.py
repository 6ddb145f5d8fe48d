"""Whose card the gateway simulator declines, on which try, with which decline code: the
customer-id conventions every flavour shares, and the `succeeds_on_try` knob.

| customer                                   | its charge                                    |
|--------------------------------------------|-----------------------------------------------|
| in `succeeds_on_try` (`{customer: k}`)     | declined `insufficient_funds` on tries < k,   |
|                                            | charged from try k on                         |
| `cus_decline…`                             | declined `generic_decline` (YooKassa:         |
|                                            | `general_decline`)                            |
| `cus_auth…`                                | declined `authentication_required`            |
|                                            | (YooKassa: `3d_secure_failed`)                |
| `cus_code_<code>…`                         | declined `<code>`: the longest code of        |
|                                            | `declines.CLASSES` after the prefix (followed |
|                                            | by `_` or the end), else the rest of the id   |
| `cus_soft<k>…` (`k` digits)                | as `succeeds_on_try` `k`                      |
| `cus_soft…` (no digits)                    | declined `insufficient_funds` on every try    |
| any other                                  | charged                                       |

A try is the charge's `metadata.attempt` (absent: 1), read as the worker's adapters read it
(`gateway.results.try_of`). The decline code is the bank's reason (the contract's
`decline_code`, YooKassa's `cancellation_details.reason`); each flavour puts it on its wire
(`app.py`, `stripe_wire.py`, `yookassa_wire.py`) and names the two prefix declines in its own
vocabulary (`Vocabulary`: `STRIPE`, `YOOKASSA`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from charge_worker.declines import CLASSES, GENERIC_DECLINE
from charge_worker.gateway.results import try_of

DECLINE_PREFIX = "cus_decline"  # every try: generic_decline
AUTH_PREFIX = "cus_auth"  # every try: the bank wants the customer to authenticate
CODE_PREFIX = "cus_code_"  # cus_code_<decline_code>…: every try, that code
SOFT_PREFIX = "cus_soft"  # cus_soft<k>…: insufficient_funds before try k; no k: every try
SOFT_DECLINE = "insufficient_funds"
AUTHENTICATION_REQUIRED = "authentication_required"
_SOFT_UNTIL = re.compile(rf"{SOFT_PREFIX}(\d+)")
# longest first: `cus_code_do_not_honor_1` is `do_not_honor`, never a shorter code
_CODES = sorted(CLASSES, key=len, reverse=True)


@dataclass(frozen=True)
class Vocabulary:
    """A flavour's names for the decline of `cus_decline…` and of `cus_auth…`."""

    generic: str
    authentication: str


STRIPE = Vocabulary(GENERIC_DECLINE, AUTHENTICATION_REQUIRED)  # and the contract's
YOOKASSA = Vocabulary("general_decline", "3d_secure_failed")
MESSAGES = {
    GENERIC_DECLINE: "Your card was declined.",
    AUTHENTICATION_REQUIRED: "Your card was declined. This transaction requires authentication.",
    "insufficient_funds": "Your card has insufficient funds.",
    "expired_card": "Your card has expired.",
    "incorrect_cvc": "Your card's security code is incorrect.",
    "processing_error": "An error occurred while processing your card. Try again in a little bit.",
}


def decline_code(
    customer: str,
    metadata: Mapping[str, str] | None = None,
    *,
    succeeds_on_try: Mapping[str, int] | None = None,
    vocabulary: Vocabulary = STRIPE,
) -> str | None:
    """The decline code this customer's charge gets on the try its `metadata` names, or
    None: charged."""
    attempt = try_of(dict(metadata or {}))
    if succeeds_on_try and customer in succeeds_on_try:
        return SOFT_DECLINE if attempt < succeeds_on_try[customer] else None
    if customer.startswith(DECLINE_PREFIX):
        return vocabulary.generic
    if customer.startswith(AUTH_PREFIX):
        return vocabulary.authentication
    if customer.startswith(CODE_PREFIX):
        return _code(customer.removeprefix(CODE_PREFIX))
    if customer.startswith(SOFT_PREFIX):
        until = _SOFT_UNTIL.match(customer)
        return SOFT_DECLINE if until is None or attempt < int(until.group(1)) else None
    return None


def message(code: str) -> str:
    """What the decline says to a person (Stripe's wording where it has one)."""
    return MESSAGES.get(code, MESSAGES[GENERIC_DECLINE])


def _code(rest: str) -> str:
    for code in _CODES:
        if rest == code or rest.startswith(f"{code}_"):
            return code
    return rest or GENERIC_DECLINE
