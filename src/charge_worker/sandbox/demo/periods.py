"""The demo's declined periods, told one by one in plain words: each try, its decline code
and class, and what followed it (docs/contracts/gateway.md, "Retrying a declined renewal").

The ledger tells the tries (`charge_tries`, then the row's current one); the gateway
simulator tells how many tries reached it (its charges per period, across every try's key).
`print_periods` returns the broken expectations of the demo's three decline paths: soft,
recovered on try 2 by the schedule; hard, sent once; customer action, charged on try 2
after a retry on purpose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

from charge_worker.sandbox.demo.ledger import CHARGED, EarlierTry, LedgerRow
from charge_worker.sandbox.demo.samples import Published

INDENT = "      "
CLASS_WORDS = {"soft": "soft", "customer_action": "customer action", "hard": "hard"}


@dataclass(frozen=True)
class Retries:
    """How the demo retried: its schedule, and the orders support retried on purpose."""

    schedule: tuple[float, ...]
    on_purpose: frozenset[int]

    @property
    def last_try(self) -> int:
        """The last try the schedule allows a soft decline."""
        return 1 + len(self.schedule)


def period_of(idempotency_key: str) -> str:
    """`<order_id>:<billing_period>` of a try's key (`...:<n>` after try 1)."""
    return ":".join(idempotency_key.split(":")[:2])


def tries_at_gateway(charges: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """The charges the gateway made or declined, per period: how many tries reached it."""
    return Counter(period_of(charge["idempotency_key"]) for charge in charges)


def _decline(code: str | None, klass: str | None) -> str:
    return f"declined {code or 'generic_decline'} ({CLASS_WORDS.get(klass or '', klass)})"


def _followed(earlier: EarlierTry, order_id: int, retries: Retries) -> str:
    """What followed an earlier try: the next one, started how."""
    if order_id not in retries.on_purpose:
        return "retry scheduled; charge-worker produce started the next try when it came due"
    waited = "waited for the customer; " if earlier.decline_class == "customer_action" else ""
    return f"{waited}support retried on purpose (charge-worker retry)"


def _current(row: LedgerRow, retries: Retries) -> str:
    """What the period's current try came to."""
    if row.status in CHARGED:
        return "charged"
    decline = _decline(row.decline_code, row.decline_class)
    if row.status == "declined" and row.decline_class == "hard":
        return f"{decline}: final, never tried again"
    if row.status == "declined" and row.current_try >= retries.last_try:
        return f"{decline}: final, the schedule has no try left"
    if row.status == "action_required":
        return f"{decline}: waits for the customer"
    if row.status == "retry_scheduled" and row.retry_at is not None:
        return f"{decline}: next try due at {row.retry_at:%H:%M:%S}"
    return row.status


def headline(row: LedgerRow, earlier: Sequence[EarlierTry], retries: Retries, sent: int) -> str:
    """The period's fate in a few words."""
    tries = f"{sent} {'try' if sent == 1 else 'tries'} at the gateway"
    if row.status in CHARGED and row.current_try > 1:
        if row.order_id not in retries.on_purpose:
            return f"recovered on try {row.current_try} by the retry schedule"
        acted = any(t.decline_class == "customer_action" for t in earlier)
        after = " after the customer acted" if acted else ""
        return f"charged on try {row.current_try}, retried on purpose{after}"
    if row.status == "declined" and row.decline_class == "hard":
        return f"a hard decline, never retried ({tries})"
    if row.status == "declined":
        return f"declined for good after {row.current_try} tries ({tries})"
    return f"{row.status} on try {row.current_try} ({tries})"


def _declined_ever(row: LedgerRow, earlier: Sequence[EarlierTry]) -> bool:
    return bool(earlier) or row.decline_code is not None or row.status == "declined"


def print_periods(
    rows: Sequence[LedgerRow],
    tries: Mapping[int, list[EarlierTry]],
    charges: Iterable[Mapping[str, Any]],
    published: Published,
    retries: Retries,
) -> list[str]:
    """Print each declined period's tries; return the demo's broken decline expectations."""
    period = published.period.isoformat()
    sent = tries_at_gateway(charges)
    shown = [row for row in rows if _declined_ever(row, tries.get(row.order_id, []))]
    schedule = ",".join(f"{step:g}s" for step in retries.schedule) or "none"
    click.secho(
        f"    declined renewals, period by period (CHARGE_WORKER_RETRY_SCHEDULE={schedule}):"
        f" {len(shown)}",
        bold=True,
    )
    for row in shown:
        money = f"{row.amount_minor} {row.currency}"
        on_gateway = sent[f"{row.order_id}:{period}"]
        click.echo(
            f"{INDENT}order {row.order_id} {row.customer_id} ({money}):"
            f" {headline(row, tries.get(row.order_id, []), retries, on_gateway)}"
        )
        for earlier in tries.get(row.order_id, []):
            what = _decline(earlier.decline_code, earlier.decline_class)
            followed = _followed(earlier, row.order_id, retries)
            click.echo(f"{INDENT}  try {earlier.try_no}: {what}; {followed}")
        click.echo(f"{INDENT}  try {row.current_try}: {_current(row, retries)}")
    return _broken(rows, sent, published, retries)


def _broken(
    rows: Sequence[LedgerRow], sent: Counter[str], published: Published, retries: Retries
) -> list[str]:
    by_order = {row.order_id: row for row in rows}
    period = published.period.isoformat()
    wanted = {  # order: (status, its current try, tries at the gateway)
        published.soft_order: ("succeeded", 2, 2),
        published.hard_order: ("declined", 1, 1),
        published.action_order: ("succeeded", 2, 2),
        published.declined_order: ("declined", retries.last_try, retries.last_try),
    }
    problems = []
    for order_id, (status, try_no, at_gateway) in wanted.items():
        row = by_order.get(order_id)
        found = (row.status, row.current_try) if row else (None, None)
        reached = sent[f"{order_id}:{period}"]
        if found != (status, try_no) or reached != at_gateway:
            problems.append(
                f"order {order_id} is {found[0]} on try {found[1]} with {reached} tries at the"
                f" gateway, expected {status} on try {try_no} with {at_gateway}"
            )
    return problems
