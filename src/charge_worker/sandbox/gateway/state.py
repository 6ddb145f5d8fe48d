"""The gateway simulator's memory: charges, refunds and idempotency keys. Pure, no I/O.

Time comes in as arguments (`now`: a monotonic clock for key expiry, `created`: unix seconds
for the charge objects), so everything here is deterministic and unit-testable.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

ChargeStatus = Literal["succeeded", "failed", "processing"]  # processing: Stripe flavour


@dataclass
class Charge:
    """One charge the gateway made (or declined: status `failed`, with its `decline_code`).

    As Stripe's, a refunded charge keeps `status: "succeeded"`: the refund shows in
    `amount_refunded` and `refunded` (docs/contracts/gateway.md, "Refunds").
    """

    id: str
    amount: int
    currency: str
    customer: str
    metadata: dict[str, str]
    created: int
    status: ChargeStatus
    idempotency_key: str
    seq: int = 0
    revision: int = 1
    amount_refunded: int = 0
    decline_code: str | None = None  # of a failed one: the bank's reason

    @property
    def refunded(self) -> bool:
        """Refunded in full."""
        return self.amount_refunded >= self.amount

    def to_json(self) -> dict[str, Any]:
        """The charge object as the API shows it; a failed one with its `decline_code`,
        named as in the contract's 402."""
        shown: dict[str, Any] = {
            "id": self.id,
            "object": "charge",
            "status": self.status,
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "metadata": dict(self.metadata),
            "created": self.created,
            "revision": self.revision,
            "amount_refunded": self.amount_refunded,
            "refunded": self.refunded,
        }
        if self.decline_code is not None:
            shown["decline_code"] = self.decline_code
        return shown


@dataclass(frozen=True)
class Refund:
    """A full refund of one charge."""

    id: str
    charge_id: str
    amount: int
    created: int

    def to_json(self) -> dict[str, Any]:
        """The refund object as the API shows it."""
        return {
            "id": self.id,
            "object": "refund",
            "charge": self.charge_id,
            "amount": self.amount,
            "status": "succeeded",
            "created": self.created,
        }


@dataclass(frozen=True)
class StoredResponse:
    """A response kept under an idempotency key, replayed as is."""

    status_code: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Claimed:
    """The key is new (or expired): the caller executes the request, then `complete`s it."""


@dataclass(frozen=True)
class Replay:
    """The key was used with the same parameters: answer the original response."""

    response: StoredResponse


@dataclass(frozen=True)
class InProgress:
    """A request with this key is executing right now."""


@dataclass(frozen=True)
class KeyReused:
    """The key was used with different parameters."""


KeyClaim = Claimed | Replay | InProgress | KeyReused


@dataclass
class _KeyRecord:
    fingerprint: str
    expires_at: float
    response: StoredResponse | None = None


@dataclass
class IdempotencyKeys:
    """Idempotency keys with the responses they produced, each kept for a retention period.

    Expiry is a heap of (expires_at, key): each request pops what has expired, O(log n),
    instead of scanning every key kept (the simulator's cost per charge grew with them).
    """

    _records: dict[str, _KeyRecord] = field(default_factory=dict)
    _expiry: list[tuple[float, str]] = field(default_factory=list)

    def claim(self, key: str, fingerprint: str, *, now: float, retention_s: float) -> KeyClaim:
        """Decide what a request with `key` and these parameters (`fingerprint`) gets."""
        self._forget_expired(now)
        record = self._records.get(key)
        if record is None:
            self._records[key] = _KeyRecord(fingerprint, now + retention_s)
            return Claimed()
        if record.fingerprint != fingerprint:
            return KeyReused()
        if record.response is None:
            return InProgress()
        return Replay(record.response)

    def complete(self, key: str, response: StoredResponse) -> None:
        """Keep the response of a claimed key for replay, until it expires."""
        if (record := self._records.get(key)) is not None:
            record.response = response
            heapq.heappush(self._expiry, (record.expires_at, key))

    def release(self, key: str) -> None:
        """Forget a claim whose request did not finish, so the key can be retried."""
        record = self._records.get(key)
        if record is not None and record.response is None:
            del self._records[key]

    def in_flight(self) -> int:
        """Keys whose request is still executing."""
        return sum(1 for record in self._records.values() if record.response is None)

    def _forget_expired(self, now: float) -> None:
        # A key is on the heap once it has a response: one still executing is kept, since
        # forgetting it would let a retry charge twice.
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry)
            record = self._records.get(key)
            if record is not None and record.expires_at == expires_at:
                del self._records[key]


class RefundRefused(Exception):
    """A refund the gateway will not make; `status_code` and `code` are the API's answer."""

    def __init__(self, status_code: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ChargeQuery:
    """A validated `GET /v1/charges` query; `limit=None` means every match."""

    order_id: str | None = None
    billing_period: str | None = None
    created_gte: int | None = None
    created_lt: int | None = None
    limit: int | None = None
    starting_after: str | None = None


@dataclass
class ChargeBook:
    """Every charge and refund, in the order they were made, indexed: a lookup by key reads
    the key's charges, a history page starts where its window does (charges are made in
    `created` order), so neither costs more as the book grows."""

    charges: list[Charge] = field(default_factory=list)
    refunds: list[Refund] = field(default_factory=list)
    _by_id: dict[str, Charge] = field(default_factory=dict)
    _by_key: dict[tuple[str, str], list[Charge]] = field(default_factory=dict)
    _created: list[int] = field(default_factory=list)  # nondecreasing while `_in_order`
    _in_order: bool = True

    def add(self, charge: Charge) -> Charge:
        """Record a charge; it is ordered after every earlier one."""
        charge.seq = len(self.charges)
        if self._created and charge.created < self._created[-1]:
            self._in_order = False  # a clock set back: history pages scan from the cursor
        self.charges.append(charge)
        self._created.append(charge.created)
        self._by_id[charge.id] = charge
        key = (charge.metadata.get("order_id", ""), charge.metadata.get("billing_period", ""))
        self._by_key.setdefault(key, []).append(charge)
        return charge

    @property
    def in_order(self) -> bool:
        """Charges were made in `created` order (no clock was set back)."""
        return self._in_order

    def get(self, charge_id: str) -> Charge | None:
        """The charge with this id, if any."""
        return self._by_id.get(charge_id)

    def find(self, query: ChargeQuery) -> tuple[list[Charge], bool]:
        """Charges matching `query`, oldest first, and whether more follow the page.

        Raises `KeyError` when `starting_after` names no charge.
        """
        after = -1 if query.starting_after is None else self._by_id[query.starting_after].seq
        if query.order_id is not None and query.billing_period is not None:
            pool: Iterable[Charge] = self._by_key.get((query.order_id, query.billing_period), [])
            pool = (c for c in pool if c.seq > after)
        else:
            start = after + 1
            if self._in_order and query.created_gte is not None:
                start = max(start, bisect.bisect_left(self._created, query.created_gte))
            # by index: islice would walk the list from its start to the cursor
            pool = (self.charges[i] for i in range(start, len(self.charges)))
        matches: list[Charge] = []
        for charge in pool:
            if (
                query.created_lt is not None
                and self._in_order
                and charge.created >= query.created_lt
            ):
                break  # every later charge is later still
            if _matches(charge, query):
                matches.append(charge)
                if query.limit is not None and len(matches) > query.limit:
                    return matches[: query.limit], True
        return matches, False

    def refund(self, charge_id: str, refund_id: str, created: int) -> Refund:
        """Refund a charge in full, or raise `RefundRefused`."""
        charge = self._by_id.get(charge_id)
        if charge is None:
            raise RefundRefused(404, "resource_missing", f"No such charge: '{charge_id}'")
        if charge.status != "succeeded":
            raise RefundRefused(
                400, "charge_not_refundable", f"Charge {charge_id} failed; nothing to refund."
            )
        if charge.refunded:
            raise RefundRefused(
                400, "charge_already_refunded", f"Charge {charge_id} has already been refunded."
            )
        charge.amount_refunded = charge.amount
        charge.revision += 1
        refund = Refund(refund_id, charge_id, charge.amount, created)
        self.refunds.append(refund)
        return refund


def _matches(charge: Charge, query: ChargeQuery) -> bool:
    if query.order_id is not None and charge.metadata.get("order_id") != query.order_id:
        return False
    if (
        query.billing_period is not None
        and charge.metadata.get("billing_period") != query.billing_period
    ):
        return False
    if query.created_gte is not None and charge.created < query.created_gte:
        return False
    return query.created_lt is None or charge.created < query.created_lt
