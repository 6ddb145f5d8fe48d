"""What reconcile may do on its own about a key's captured charges, and what is a person's.

A refund is money leaving the company and a ledger write is our word on what a customer
paid, so both need proof: the key has a ledger row, and the charge matches its fingerprint
(amount, currency, customer, as `charge_attempts.fingerprint`). Pure: no I/O.

| the key's charges with money still captured       | reconcile                                    |
|---------------------------------------------------|----------------------------------------------|
| more than one, some matching the ledger row       | keep the recorded one (else the earliest     |
|                                                   | matching), refund the other matching ones    |
| any that do not match the row, or no row at all   | unmatched: reported for a person, untouched  |
| the recorded one does not match its own row       | all unmatched: which is right is not ours    |
| any, for a row that is declined, failed, blocked, | record the earliest matching one (of any     |
| retry_scheduled or action_required                | try): a retry is never started then          |

A lookup for an open row (an unknown outcome, a lost message) records only what a charge
that matches the row says (`split`): a charge someone else made with our metadata (a
support agent's, another integration's, a verification charge) is never the period's
payment. Captured, it is a person's; the row stays open, so the due charge goes ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from charge_worker.gateway import GatewayCharge

# ledger rows that record no charge: the period said no (or its try did: a retry waits)
SAID_NO = frozenset({"declined", "failed", "blocked", "retry_scheduled", "action_required"})


@dataclass(frozen=True)
class LedgerRow:
    """What the proof needs of a key's ledger row."""

    status: str
    fingerprint: str
    charge_id: str | None

    def describe(self) -> str:
        return f"{self.status} {self.fingerprint}"


@dataclass(frozen=True)
class Doubles:
    """A key's captured charges sorted out: the one kept, the proven doubles, the rest."""

    keep: GatewayCharge | None
    refund: list[GatewayCharge] = field(default_factory=list)
    unmatched: list[GatewayCharge] = field(default_factory=list)


def doubles(captured: list[GatewayCharge], row: LedgerRow | None) -> Doubles:
    """Sort out a key's charges with money still captured (oldest first)."""
    if len(captured) < 2:
        return Doubles(captured[0] if captured else None)
    if row is None:
        return Doubles(None, unmatched=list(captured))
    matching = [c for c in captured if c.fingerprint == row.fingerprint]
    others = [c for c in captured if c.fingerprint != row.fingerprint]
    recorded = next((c for c in captured if c.id == row.charge_id), None)
    if recorded is not None and recorded.fingerprint != row.fingerprint:
        return Doubles(None, unmatched=list(captured))
    keep = recorded or (matching[0] if matching else None)
    return Doubles(keep, [c for c in matching if c is not keep], others)


def unrecorded(captured: list[GatewayCharge], row: LedgerRow) -> Doubles:
    """For a row the ledger said no to (`SAID_NO`): the charge to record as the key's
    (`keep`, the earliest that matches the row, if any) and those for a person."""
    lookup = split(captured, row)
    return Doubles(lookup.ours[0] if lookup.ours else None, unmatched=lookup.foreign)


@dataclass(frozen=True)
class Split:
    """A key's lookup against its row: the charges that match it (whatever their status:
    the only ones whose outcome may be recorded as the row's) and the captured ones that
    do not (for a person)."""

    ours: list[GatewayCharge]
    foreign: list[GatewayCharge]


def split(charges: list[GatewayCharge], row: LedgerRow) -> Split:
    """Sort a key's lookup (oldest first) out against its ledger row's fingerprint."""
    ours = [c for c in charges if c.fingerprint == row.fingerprint]
    foreign = [c for c in charges if c.captured and c.fingerprint != row.fingerprint]
    return Split(ours, foreign)
