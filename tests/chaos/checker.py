"""Judge a quiet system the way an auditor would: count the money at the gateway.

Every manifest key gets exactly one outcome. Good ones: `charged_once`, `declined`,
`action_required`, `blocked`, `blocked_post_hoc` (scoring was down, the charge went through,
the deferred check flagged it for review: the designed degradation) and `dead_lettered`
(poison, with the right reason). Everything in `FATAL` fails the run. Charges are counted
per period, `(order_id, billing_period)`, from the charge's metadata, whatever try and
idempotency key it came with, and a refunded charge still counts: a refund repairs a double
charge, it does not undo it.

Tries (docs/decisions/0007-retries.md), counted at the gateway from each charge's
`metadata.attempt`: a period ends on the try its entry says (charged on it, or declined on
its last), with a gateway charge for each try up to it and none after; no period is tried
more often than the schedule and the 30-day cap allow (`tried_beyond_schedule`); a try
declined hard or for the customer to act is sent once and followed by no other
(`final_decline_sent_again`), whatever the manifest expected.

A key that settles later (`settles_later`: the gateway answers `pending`) must also have
had its payment recorded `processing` by the delivery that sent it, unless a delivery of
it met an unknown outcome or looked up (the payment may have settled before anyone read
it): else `processing_unrecorded`.

Every scenario also judges the outcome events (`outcome_events.py`): the `CHARGE_OUTCOMES`
stream, read as a downstream consumer once the outbox drained, must agree with the ledger
and the gateway key by key; its violations are fatal like the rest.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import httpx
import nats.js.errors
from nats.aio.client import Client

from charge_worker.declines import decline_class
from charge_worker.settings import NatsSettings
from tests.chaos import outcome_events
from tests.chaos.generator import Entry
from tests.support.harness import eventually
from tests.support.outcomes import Outcome, outcomes_batched

FATAL = frozenset(
    {
        "charged_twice",
        "missing",
        "unexpected",
        "valid_message_dead_lettered",
        "poison_escaped",
        "key_param_mismatch",
        "conflict_escaped",
        "wrong_charge_recorded",
        "wrong_try",
        "tried_beyond_schedule",
        "final_decline_sent_again",
        "processing_unrecorded",
        *outcome_events.FATAL,
    }
)
REPAIRED_DOUBLE = "charged_twice_refunded"  # fine only where the ledger forgets and the
# gateway keeps no idempotency keys
CONFLICT_REPORTED = "conflict_reported"  # likewise
_ORDER_ID = re.compile(rb'"order_id":\s*(\d{1,19})[,}]')
_PERIOD = re.compile(rb'"billing_period":\s*"(\d{4}-\d{2}-\d{2})"')
T = TypeVar("T")
Row = Any  # a ledger row (an asyncpg.Record, or a dict in the checker's tests) read by column


@dataclass(frozen=True)
class Letter:
    body: bytes
    reason: str | None
    key: str | None  # `order_id:billing_period` when the body names one


@dataclass
class Facts:
    """Everything the checker reads, gathered once after the system went quiet."""

    charges: dict[str, list[dict[str, Any]]]  # gateway charges by metadata period
    rows: dict[str, asyncpg.Record]  # ledger rows by period (`order_id:billing_period`)
    letters: list[Letter]
    deliveries: Counter[str]
    redeliveries: int
    unknown_resolution_s: list[float]
    lookups: Counter[str]  # lookups before a call, by what they found ("nothing": spent)
    events: list[Outcome] = field(default_factory=list)  # CHARGE_OUTCOMES, in stream order
    unsent: Counter[str] = field(default_factory=Counter)  # outbox events not marked sent
    # per key, the charges a delivery recorded `processing` (the gateway answered pending)
    processing: dict[str, set[str]] = field(default_factory=dict)
    # keys a delivery of which met an unknown outcome or looked up first
    looked_up: set[str] = field(default_factory=set)


@dataclass
class Verdict:
    outcomes: Counter[str] = field(default_factory=Counter)
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # key, outcome, detail
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def fatal(self) -> list[tuple[str, str, str]]:
        return [b for b in self.bad if b[1] in FATAL]

    def add(self, key: str, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome in FATAL:
            self.bad.append((key, outcome, detail))


async def gather(gateway_url: str, database_url: str, nc: Client, cfg: NatsSettings) -> Facts:
    async with httpx.AsyncClient() as client:
        data = (await client.get(f"{gateway_url}/_sim/charges", timeout=30)).json()["data"]
    charges: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for charge in data:
        meta = charge.get("metadata") or {}
        charges[f"{meta.get('order_id')}:{meta.get('billing_period')}"].append(charge)
    conn = await asyncpg.connect(database_url)
    try:
        rows = {
            r["key"]: r
            for r in await conn.fetch(
                """SELECT a.order_id::text || ':' || to_char(a.billing_period, 'YYYY-MM-DD')
                          AS key, a.idempotency_key, a.status, a.amount_minor, a.customer_id,
                          a.gateway_calls, a.gateway_charge_id, a.review_reason,
                          a.outcome_seq, a.updated_at, a.current_try, a.decline_code,
                          a.decline_class, d.status AS deferred
                     FROM charge_attempts a
                LEFT JOIN deferred_scoring_checks d USING (order_id, billing_period)"""
            )
        }
        deliveries = Counter(
            {
                f"{r['order_id']}:{r['billing_period'].isoformat()}": r["n"]
                for r in await conn.fetch(
                    """SELECT order_id, billing_period, count(*) AS n FROM charge_events
                        WHERE kind = 'delivery' GROUP BY 1, 2"""
                )
            }
        )
        redeliveries = await conn.fetchval(
            """SELECT count(*) FROM charge_events
                WHERE kind = 'delivery' AND (detail->>'delivery')::int > 1"""
        )
        lookups = Counter(
            {
                r["found"]: r["n"]
                for r in await conn.fetch(
                    """SELECT detail->>'lookup' AS found, count(*) AS n FROM charge_events
                        WHERE kind = 'delivery' AND detail ? 'lookup' GROUP BY 1"""
                )
            }
        )
        unsent = Counter(
            {
                f"{r['order_id']}:{r['billing_period'].isoformat()}": r["n"]
                for r in await conn.fetch(
                    """SELECT order_id, billing_period, count(*) AS n FROM charge_outcomes
                        WHERE sent_at IS NULL GROUP BY 1, 2"""
                )
            }
        )
        processing: dict[str, set[str]] = defaultdict(set)
        for r in await conn.fetch(
            """SELECT order_id, billing_period, detail->>'charge_id' AS charge FROM charge_events
                WHERE kind = 'delivery' AND detail->>'outcome' = 'processing'"""
        ):
            processing[f"{r['order_id']}:{r['billing_period'].isoformat()}"].add(r["charge"])
        looked_up = {
            f"{r['order_id']}:{r['billing_period'].isoformat()}"
            for r in await conn.fetch(
                """SELECT DISTINCT order_id, billing_period FROM charge_events
                    WHERE kind = 'delivery'
                      AND (detail ? 'lookup' OR detail->>'outcome' = 'outcome_unknown')"""
            )
        }
        unknown = await conn.fetch(
            """SELECT extract(epoch FROM a.settled_at - min(e.at)) AS s
                 FROM charge_events e JOIN charge_attempts a USING (order_id, billing_period)
                WHERE e.kind = 'delivery' AND e.detail->>'outcome' = 'outcome_unknown'
                  AND a.settled_at IS NOT NULL
                GROUP BY a.order_id, a.billing_period, a.settled_at"""
        )
    finally:
        await conn.close()
    return Facts(
        charges,
        rows,
        await read_letters(nc, cfg),
        deliveries,
        redeliveries,
        [float(r["s"]) for r in unknown],
        lookups,
        await _patiently(lambda: outcomes_batched(nc.jetstream(), cfg)),
        unsent,
        dict(processing),
        looked_up,
    )


OUTBOX_DRAIN_S = 60.0


async def outbox_drained(database_url: str, within_s: float = OUTBOX_DRAIN_S) -> bool:
    """Wait until the relays marked every outbox event sent (`charge_outcomes.sent_at`), for
    up to `within_s`; whether they did. The relays run in the workers: keep one alive."""
    conn = await asyncpg.connect(database_url)

    async def drained() -> bool:
        unsent = "SELECT count(*) FROM charge_outcomes WHERE sent_at IS NULL"
        return bool(await conn.fetchval(unsent) == 0)

    try:
        await eventually(drained, "the outbox drained", within_s)
    except AssertionError:
        return False
    finally:
        await conn.close()
    return True


LEADERLESS_S = 30.0


async def read_letters(nc: Client, cfg: NatsSettings) -> list[Letter]:
    """Every dead letter."""
    return await _patiently(lambda: _letters(nc, cfg))


async def _patiently(read: Callable[[], Awaitable[T]]) -> T:
    """`read()`; a clustered stream answers 503 while it elects a leader (a healed
    partition, a killed leader): read again, for up to `LEADERLESS_S`."""
    deadline = time.monotonic() + LEADERLESS_S
    while True:
        try:
            return await read()
        except nats.js.errors.ServiceUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _letters(nc: Client, cfg: NatsSettings) -> list[Letter]:
    js = nc.jetstream()
    state = (await js.stream_info(cfg.dlq_stream)).state
    letters = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg(cfg.dlq_stream, seq)
        headers = msg.headers or {}
        letters.append(Letter(msg.data or b"", headers.get("Dlq-Reason"), _key_of(msg.data)))
    return letters


def _key_of(body: bytes | None) -> str | None:
    """The charge key a letter's body names, read without a JSON parser: a 5,000-deep poison
    body must not reach `json.loads` in this process (see `messages._depth`)."""
    order = _ORDER_ID.search(body or b"")
    period = _PERIOD.search(body or b"")
    return f"{int(order[1])}:{period[1].decode()}" if order and period else None


def judge(
    entries: list[Entry],
    facts: Facts,
    *,
    ledger_forgets: bool = False,
    doubles_possible: bool = False,
    tries_allowed: int = 1,
) -> Verdict:
    """Every key's outcome. `tries_allowed`: the most tries a period may have (the first,
    the schedule's, within the 30-day cap). `ledger_forgets` (a failover lost acknowledged
    commits): a conflicting copy that found no row to conflict with and was refused by the gateway
    (`key_reused`, dead-lettered `rejected`) while the key was charged once, right, is
    `conflict_reported` (reconcile reports the ledger's mismatch for a person); and, with
    `doubles_possible` too (a gateway without idempotency), a key charged twice whose extra
    charges were all refunded is `charged_twice_refunded` (reconcile must repair it).
    Reported, not fatal. A key charged once must name, in its row, the charge that holds
    the money. Then the outcome events (`outcome_events.judge`), in every scenario."""
    verdict = Verdict()
    letters_by_key: dict[str, list[Letter]] = defaultdict(list)
    for letter in facts.letters:
        if letter.key is not None:
            letters_by_key[letter.key].append(letter)
    poison_letters = Counter((letter.body, letter.reason) for letter in facts.letters)
    known: set[str] = set()
    for entry in entries:
        if entry.poison is not None:
            found = poison_letters[entry.body(), entry.reason]
            verdict.add(entry.key, "dead_lettered" if found else "poison_escaped")
            continue
        known.add(entry.key)
        outcome, detail = _valid(
            entry,
            facts,
            letters_by_key[entry.key],
            ledger_forgets=ledger_forgets,
            doubles_possible=ledger_forgets and doubles_possible,
            tries_allowed=tries_allowed,
        )
        verdict.add(entry.key, outcome, detail)
    for key, charges in facts.charges.items():
        if key in known:
            continue
        if any(_made(c) for c in charges):
            verdict.add(key, "unexpected", f"{len(charges)} gateway charge(s) for no manifest key")
        elif tried := _tries_violation(charges, facts.rows.get(key), tries_allowed):
            verdict.add(key, *tried)
    held = {
        key: [c["id"] for c in charges if _captured(c)] for key, charges in facts.charges.items()
    }
    for key, outcome, detail in outcome_events.judge(
        facts.events, facts.rows, held, facts.unsent, ledger_forgets=ledger_forgets
    ):
        verdict.add(key, outcome, detail)
    calls = [r["gateway_calls"] for r in facts.rows.values()] or [0]
    verdict.stats = {
        "gateway_calls_p50": statistics.median(calls),
        "gateway_calls_max": max(calls),
        "redeliveries": facts.redeliveries,
        # a takeover looks up whatever the dead worker did: "nothing" is what that costs
        "lookups": sum(facts.lookups.values()),
        "lookups_found_nothing": facts.lookups["nothing"],
        "doubles_refunded": verdict.outcomes[REPAIRED_DOUBLE],
        "dead_letters": len(facts.letters),
        "dead_letters_expected": sum(
            1 for e in entries if e.poison is not None or e.conflict_amount is not None
        ),
        "unknown_outcomes": len(facts.unknown_resolution_s),
        "unknown_resolution_p99_s": _p99(facts.unknown_resolution_s),
        "unknown_resolution_max_s": max(facts.unknown_resolution_s, default=0.0),
        "outcome_events": len(facts.events),
        "outcome_events_unsent": sum(facts.unsent.values()),
        # keys a delivery recorded `processing` (the gateway answered pending)
        "recorded_processing": len(facts.processing),
        "events_of_lost_commits": verdict.outcomes[outcome_events.LOST_COMMIT],
        # the tries after the first the ledger's periods started (`tries_started` of the
        # producers' runs must add up to it)
        "ledger_tries_started": sum(r["current_try"] - 1 for r in facts.rows.values()),
        # gateway charges by the try they were sent as: {1: n, 2: n, ...}
        "gateway_charges_by_try": dict(
            sorted(Counter(_try(c) for cs in facts.charges.values() for c in cs).items())
        ),
    }
    return verdict


# expected outcome -> (charged at the gateway, ledger status)
SETTLED = {
    "charged_once": (True, "succeeded"),
    "declined": (False, "declined"),
    "action_required": (False, "action_required"),
    "blocked": (False, "blocked"),
}
SENT = frozenset({"charged_once", "declined", "action_required"})  # reach the gateway
FINAL_CLASSES = frozenset({"hard", "customer_action"})  # never sent again automatically


def _made(charge: dict[str, Any]) -> bool:
    """A charge that took money, refunded since or not (a refund keeps it `succeeded`)."""
    return bool(charge["status"] == "succeeded")


def _captured(charge: dict[str, Any]) -> bool:
    """A charge that still holds money."""
    return _made(charge) and charge["amount"] - charge.get("amount_refunded", 0) > 0


def _try(charge: dict[str, Any]) -> int:
    """The try a gateway charge was sent as: its `metadata.attempt` (absent: the first)."""
    attempt = (charge.get("metadata") or {}).get("attempt", "1")
    return int(attempt) if str(attempt).isdigit() else 0


def _try_key(key: str, attempt: int) -> str:
    """The idempotency key of the period's try `attempt` (`o:p`, then `o:p:n`)."""
    return key if attempt == 1 else f"{key}:{attempt}"


def _decline_class(charge: dict[str, Any]) -> str | None:
    """A failed charge's decline class, by the product's one table; None: not failed."""
    if charge["status"] != "failed":
        return None
    return decline_class(charge.get("decline_code"))


def _valid(
    entry: Entry,
    facts: Facts,
    letters: list[Letter],
    *,
    ledger_forgets: bool,
    doubles_possible: bool,
    tries_allowed: int = 1,
) -> tuple[str, str]:
    charges = facts.charges.get(entry.key, [])
    effective = [c for c in charges if _made(c)]
    held = [c for c in effective if _captured(c)] if doubles_possible else effective
    if ledger_forgets and _conflict_refused(entry, held, letters):
        return CONFLICT_REPORTED, "the gateway refused the conflicting copy: key_reused"
    row = facts.rows.get(entry.key)
    if violation := _violation(entry, charges, held, letters) or _tries_violation(
        charges, row, tries_allowed
    ):
        return violation
    status = row["status"] if row else None
    charged = len(held) == 1
    if SETTLED[entry.expect] == (charged, status):
        assert row is not None
        if wrong := _wrong_settlement(entry, charges, held, row) or _processing_unrecorded(
            entry, facts, held
        ):
            return wrong
        repaired = entry.expect == "charged_once" and len(effective) > 1
        return (REPAIRED_DOUBLE, _listed(effective)) if repaired else (entry.expect, "")
    if (
        entry.expect == "blocked"
        and charged
        and row
        and (row["deferred"] == "blocked" or row["review_reason"])
    ):
        return "blocked_post_hoc", ""
    detail = f"ledger {status}, {len(effective)} effective of {len(charges)} gateway charge(s)"
    return ("unexpected" if charged else "missing"), detail


def _violation(
    entry: Entry,
    charges: list[dict[str, Any]],
    effective: list[dict[str, Any]],
    letters: list[Letter],
) -> tuple[str, str] | None:
    """A fatal outcome whatever the key was meant to become."""
    if len(effective) > 1:
        return "charged_twice", _listed(effective)
    amounts = {entry.amount, entry.conflict_amount} - {None}
    for charge in charges:
        if (
            charge.get("idempotency_key") != _try_key(entry.key, _try(charge))
            or charge.get("customer") != entry.customer
            or charge.get("amount") not in amounts
        ):
            return "key_param_mismatch", json.dumps(charge)[:300]
    if stray := [letter.reason for letter in letters if letter.reason != "conflict"]:
        return "valid_message_dead_lettered", f"Dlq-Reason {stray}"
    if entry.conflict_amount is not None and not letters:
        return "conflict_escaped", "the conflicting copy was not dead-lettered `conflict`"
    return None


def _tries_violation(
    charges: list[dict[str, Any]], row: Row | None, tries_allowed: int
) -> tuple[str, str] | None:
    """A fatal outcome of the period's tries, whatever the key was meant to become: more
    tries than allowed (at the gateway or in the ledger), or a try after one declined hard
    or for the customer to act, or that try sent twice."""
    tries = sorted(_try(c) for c in charges)
    ledger_try = row["current_try"] if row is not None else 1
    if max([*tries, ledger_try]) > tries_allowed or min(tries, default=1) < 1:
        return "tried_beyond_schedule", (
            f"tries {tries} at the gateway, the ledger's {ledger_try}: {tries_allowed} allowed"
        )
    for charge in charges:
        if _decline_class(charge) in FINAL_CLASSES:
            n = _try(charge)
            if again := [c for c in charges if _try(c) > n or (_try(c) == n and c is not charge)]:
                code = charge.get("decline_code")
                return "final_decline_sent_again", (
                    f"try {n} declined {code} ({charge['id']}), then {_listed(again)} "
                    f"as tries {[_try(c) for c in again]}"
                )
    return None


def _wrong_settlement(
    entry: Entry, charges: list[dict[str, Any]], held: list[dict[str, Any]], row: Row
) -> tuple[str, str] | None:
    """A key settled as expected, but not right: its row names another charge than the one
    holding the money, or the period did not end on the try its entry says (charged on it,
    or declined on it) with a gateway charge for each try up to it."""
    if held and row["gateway_charge_id"] != held[0]["id"]:
        return "wrong_charge_recorded", f"ledger {row['gateway_charge_id']}, {_listed(held)}"
    if entry.expect not in SENT:
        return None
    sent = sorted({_try(c) for c in charges})
    if row["current_try"] != entry.tries or sent != list(range(1, entry.tries + 1)):
        return "wrong_try", (
            f"ends on try {row['current_try']}, tries {sent} at the gateway: {entry.tries} due"
        )
    if held and _try(held[0]) != entry.tries:
        return "wrong_try", (
            f"charged on try {_try(held[0])} ({held[0]['id']}), due on try {entry.tries}"
        )
    return None


def _processing_unrecorded(
    entry: Entry, facts: Facts, held: list[dict[str, Any]]
) -> tuple[str, str] | None:
    """A key that settles later, charged, whose payment no delivery recorded `processing`
    though none of them met an unknown outcome or looked up."""
    if not entry.settles_later or not held or entry.key in facts.looked_up:
        return None
    recorded = facts.processing.get(entry.key, set())
    if held[0]["id"] in recorded:
        return None
    return "processing_unrecorded", f"{held[0]['id']} held; recorded processing: {recorded}"


def _conflict_refused(entry: Entry, held: list[dict[str, Any]], letters: list[Letter]) -> bool:
    reasons = {letter.reason for letter in letters}
    return (
        entry.conflict_amount is not None
        and "rejected" in reasons
        and reasons <= {"rejected", "conflict"}
        and [c["amount"] for c in held] == [entry.amount]
    )


def _listed(charges: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{c['id']} ({'refunded' if c.get('refunded') else c['status']})" for c in charges
    )


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
