"""What every gateway adapter answers with: the domain's results, whatever the provider.

A charge call ends in a `ChargeResult` (charged, declined, or processing) or raises one of
the domain errors in `charge_worker.errors` (outcome unknown, retry after, in progress,
rejected, unavailable). A provider's charge object, as lookups and history pages show it,
is a `GatewayCharge`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from charge_worker.declines import AUTHENTICATION_CODES
from charge_worker.messages import ChargeDue

AUTHENTICATION_REQUIRED = "authentication_required"  # a decline: the bank wants the customer
CARD_DECLINED = "card_declined"
ChargeStatus = Literal["succeeded", "declined", "processing"]


@dataclass(frozen=True)
class ChargeResult:
    """A definitive answer to a charge: charged (possibly replayed), declined with a code,
    or processing (accepted; the bank settles it days later: not final, never re-sent)."""

    status: ChargeStatus
    charge_id: str | None
    # the provider's first answer to this key, told again; None: the provider never says
    # (YooKassa replays without a mark)
    replayed: bool | None = False
    decline_code: str | None = None

    @property
    def decline_kind(self) -> str | None:
        """A decline's `decline_kind`; None for anything else."""
        return decline_kind(self.decline_code) if self.status == "declined" else None


def decline_kind(code: str | None) -> str:
    """What the declines metric counts a decline with `code` as: `authentication_required`
    (the customer must authenticate: billing e-mails them; `declines.AUTHENTICATION_CODES`)
    or `card_declined` (any other)."""
    return AUTHENTICATION_REQUIRED if code in AUTHENTICATION_CODES else CARD_DECLINED


@dataclass(frozen=True)
class GatewayCharge:
    """A charge as the gateway's lookups and history show it.

    `status` is `succeeded` (money taken, refunded since or not), `failed` (declined),
    `processing` (accepted, the bank settles it later) or `incomplete` (made nothing and
    will not by itself). A refunded charge keeps `status == "succeeded"`
    (docs/contracts/gateway.md, "Refunds"): `amount_refunded` and `refunded` show the refund
    (`refunded` is in full: `amount_refunded` is then the amount, whatever was said), and
    `captured` says whether money is still held by it. `currency` is upper case, as
    the ledger spells it.
    """

    id: str
    status: str
    amount: int
    currency: str
    customer: str
    order_id: str | None
    billing_period: str | None
    created: int
    amount_refunded: int = 0
    refunded: bool = False
    decline_code: str | None = None  # of a failed one, when the provider says
    attempt: int = 1  # the period's try that made it (`metadata.attempt`; absent: 1)

    def __post_init__(self) -> None:
        # `refunded` means refunded in full: a provider that says so without
        # `amount_refunded` (or with less) must not leave the charge holding money, or
        # reconcile refunds it again on every run
        if self.refunded and self.amount_refunded < self.amount:
            object.__setattr__(self, "amount_refunded", self.amount)

    @property
    def charged(self) -> bool:
        """The gateway made this charge (whether refunded since or not)."""
        return self.status == "succeeded"

    @property
    def captured(self) -> bool:
        """Money is still held by this charge: made, and not refunded in full."""
        return self.charged and self.amount - self.amount_refunded > 0

    @property
    def processing(self) -> bool:
        """Accepted, not settled yet: neither made nor failed, and never to be re-sent."""
        return self.status == "processing"

    @property
    def fingerprint(self) -> str:
        """Amount, currency and customer, as `charge_attempts.fingerprint` spells them."""
        return f"{self.amount} {self.currency} {self.customer}"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GatewayCharge:
        """A charge object of docs/contracts/gateway.md (a failed one with its
        `decline_code`, when it says)."""
        metadata = data.get("metadata") or {}
        amount, status = int(data["amount"]), str(data["status"])
        code = data.get("decline_code")
        refunded_in_full = status == "refunded"  # the status an older gateway reported
        return cls(
            id=str(data["id"]),
            status="succeeded" if refunded_in_full else status,
            amount=amount,
            currency=str(data["currency"]).upper(),
            customer=str(data["customer"]),
            order_id=metadata.get("order_id"),
            billing_period=metadata.get("billing_period"),
            created=int(data["created"]),
            amount_refunded=amount if refunded_in_full else int(data.get("amount_refunded") or 0),
            refunded=refunded_in_full or data.get("refunded") is True,
            decline_code=code if status == "failed" and isinstance(code, str) and code else None,
            attempt=try_of(metadata),
        )


def charge_metadata(charge: ChargeDue) -> dict[str, str]:
    """The metadata every adapter puts on a try's charge: `order_id`, `billing_period`, and
    `attempt` for a try `n >= 2` (try 1 is the request from before retries, unchanged)."""
    metadata = {
        "order_id": str(charge.order_id),
        "billing_period": charge.billing_period.isoformat(),
    }
    if charge.attempt > 1:
        metadata["attempt"] = str(charge.attempt)
    return metadata


def try_of(metadata: dict[str, Any]) -> int:
    """The try a charge's metadata names (`"attempt": "2"`); 1 when it names none, or
    something that is no try number (metadata anyone with the key can write)."""
    value = metadata.get("attempt")
    text = str(value) if isinstance(value, str | int) else ""
    return int(text) if text.isdigit() and 1 <= len(text) <= 4 and int(text) >= 1 else 1


LookedUp = tuple[Literal["succeeded", "processing", "declined"], GatewayCharge]


def period_answer(charges: list[GatewayCharge], current_try: int) -> LookedUp | None:
    """What a lookup's charges of one period (those proven the period's) say its current
    try came to, the one rule the worker, reconcile and their tests read it by: the earliest
    charge still holding money, of any try, else the earliest made (refunded since: made all
    the same), `succeeded`; else one the bank still settles, `processing`; else the current
    try's last failed one, `declined`. An earlier try's decline is that try's: no answer."""
    if made := [c for c in charges if c.captured] or [c for c in charges if c.charged]:
        return "succeeded", made[0]
    if processing := [c for c in charges if c.processing]:
        return "processing", processing[0]
    if failed := [c for c in charges if c.status == "failed" and c.attempt == current_try]:
        return "declined", failed[-1]
    return None


@dataclass(frozen=True)
class HistoryPage:
    """One page of the gateway's charge history, in the adapter's `history_order`.

    `next_after` is what to pass as `starting_after` for the next page: the provider's own
    cursor when it pages by one (`cursor`: YooKassa's `next_cursor`), else the last charge's
    id (Stripe, the contract)."""

    charges: list[GatewayCharge]
    has_more: bool
    cursor: str | None = None

    @property
    def next_after(self) -> str | None:
        """The next page's `starting_after`; None when there is nothing to page on from."""
        if self.cursor is not None:
            return self.cursor
        return self.charges[-1].id if self.charges else None
