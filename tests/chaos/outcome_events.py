"""The outcome rule: `CHARGE_OUTCOMES`, read as a downstream consumer, agrees with the ledger
and the gateway, key by key (docs/contracts/charge-outcome.md, "The promise").

Read after the system went quiet and the outbox drained. Per `(order_id, billing_period)`:
one message per `event_id` (the relay re-publishes under the same `Nats-Msg-Id`, which the
stream drops); the key's events in `sequence` order, 1..`outcome_seq` none missing and none
beyond; the last one's type the row's status (a dispute or a late verdict, `charge.blocked`
with `review: true`, may follow the charge on a charged row); every charge that still holds
money at the gateway announced by a `charge.succeeded` naming it; no terminal event after
the last change of a row that is not final; no event for a key the ledger has no row for.
Tries (`attempt`): never lower than an earlier sequence's, the last one's the row's
`current_try`, and one `charge.retry_scheduled` for each try before it (each was declined
soft, then the next one started).

Where the ledger forgets (a failover lost acknowledged commits) the relay may have
published an event whose change was lost: an event beyond `outcome_seq`, without a row, or
a terminal one on a row the new ledger still holds open is `event_of_lost_commit`, reported,
not fatal. The change made again is published under a higher sequence (the relay never
reuses an id the stream holds), so the last event's type and the announcement of every
charge that holds money stay fatal there, with a duplicate, a sequence out of order or
missing, an event never published, a malformed message.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tests.support.outcomes import Outcome

DUPLICATE = "outcome_duplicate"
OUT_OF_ORDER = "outcome_out_of_order"
MISSING = "outcome_missing"
UNPUBLISHED = "outcome_unpublished"
MALFORMED = "outcome_malformed"
WITHOUT_CHANGE = "outcome_without_change"
WITHOUT_ROW = "outcome_without_row"
WRONG_LAST = "outcome_wrong_last"
CHARGE_UNANNOUNCED = "outcome_charge_unannounced"
AFTER_OPEN = "outcome_after_open"
WRONG_TRY = "outcome_wrong_try"
FATAL = frozenset(
    {
        WRONG_TRY,
        DUPLICATE,
        OUT_OF_ORDER,
        MISSING,
        UNPUBLISHED,
        MALFORMED,
        WITHOUT_CHANGE,
        WITHOUT_ROW,
        WRONG_LAST,
        CHARGE_UNANNOUNCED,
        AFTER_OPEN,
    }
)
LOST_COMMIT = "event_of_lost_commit"
# what a commit the failover lost explains (see the module docstring)
FORGETTABLE = frozenset({WITHOUT_CHANGE, WITHOUT_ROW, AFTER_OPEN})

OPEN = frozenset({"scheduled", "pending", "processing"})
TERMINAL = frozenset(
    {"charge.succeeded", "charge.declined", "charge.blocked", "charge.failed", "charge.refunded"}
)
CHARGED = frozenset({"succeeded", "refunded"})
SUCCEEDED = "charge.succeeded"
RETRY_SCHEDULED = "charge.retry_scheduled"

Violation = tuple[str, str, str]  # key, outcome, detail
Row = Any  # a ledger row (an asyncpg.Record, or a dict in the checker's tests) read by column


def judge(
    events: Sequence[Outcome],
    rows: Mapping[str, Row],
    held: Mapping[str, Sequence[str]],
    unsent: Mapping[str, int],
    *,
    ledger_forgets: bool = False,
) -> list[Violation]:
    """Every violation of the rule. `rows`: the ledger by key (`status`, `outcome_seq`,
    `updated_at`); `held`: per key the ids of the gateway charges that still hold money;
    `unsent`: per key the outbox's events not marked sent."""
    by_key: dict[str, list[Outcome]] = defaultdict(list)
    for event in events:
        by_key[f"{event.body.get('order_id')}:{event.body.get('billing_period')}"].append(event)
    found: list[Violation] = []
    for key in sorted({*rows, *by_key, *held, *unsent}):
        for outcome, detail in _key(key, by_key[key], rows.get(key), held.get(key, ()), unsent):
            forgotten = ledger_forgets and outcome in FORGETTABLE
            found.append(
                (key, LOST_COMMIT, f"{outcome}: {detail}") if forgotten else (key, outcome, detail)
            )
    return found


def _key(
    key: str,
    events: list[Outcome],
    row: Row | None,
    held: Iterable[str],
    unsent: Mapping[str, int],
) -> Iterable[tuple[str, str]]:
    yield from _form(key, events)
    if unsent.get(key):
        yield UNPUBLISHED, f"{unsent[key]} event(s) in the outbox not marked sent"
    sequences = [_sequence(event) for event in events]
    if twice := sorted(eid for eid, n in Counter(_event_id(e) for e in events).items() if n > 1):
        yield DUPLICATE, f"event_id(s) {twice} more than once: stream seqs {_seqs(events)}"
    if any(b < a for a, b in itertools.pairwise(sequences)):
        yield OUT_OF_ORDER, f"sequences {sequences} at stream seqs {_seqs(events)}"
    charged = {e.body.get("gateway_charge_id") for e in events if _type(e) == SUCCEEDED}
    if unannounced := [charge for charge in held if charge not in charged]:
        yield CHARGE_UNANNOUNCED, f"{unannounced} hold money; charge.succeeded named {charged}"
    if row is None:
        if events:
            yield WITHOUT_ROW, f"{len(events)} event(s), no ledger row: {_types(events)}"
        return
    last_seq = row["outcome_seq"]
    if missing := sorted(set(range(1, last_seq + 1)) - set(sequences)):
        yield MISSING, f"sequences {missing} of 1..{last_seq} not in the stream"
    if beyond := sorted({s for s in sequences if not 1 <= s <= last_seq}):
        yield WITHOUT_CHANGE, f"sequences {beyond} beyond the ledger's outcome_seq {last_seq}"
    yield from _against_status(events, row)


def _against_status(events: list[Outcome], row: Row) -> Iterable[tuple[str, str]]:
    """The events against the row's state: none terminal after an open row's last change;
    a settled row's last event its status, and its tries (`_tries`)."""
    status = row["status"]
    if status in OPEN:
        since = row["updated_at"]
        if late := [e for e in events if _type(e) in TERMINAL and _at(e) > since]:
            yield AFTER_OPEN, f"{_types(late)} after the {status} row's last change {since}"
    elif not events:
        yield MISSING, f"the row is {status}, the stream has no event"
    elif not _agrees(status, last := max(events, key=_sequence)):
        yield WRONG_LAST, f"the row is {status}, the last event {_types([last])}"
    else:
        yield from _tries(events, row["current_try"], status)


def _tries(events: list[Outcome], current_try: int, status: str) -> Iterable[tuple[str, str]]:
    """A settled row's events by try: in sequence order the try never goes back, the last
    event is of the row's current try, and each earlier try made one retry_scheduled (the
    current one too, while the row waits for the next)."""
    ordered = sorted(events, key=_sequence)
    tries = [_attempt(e) for e in ordered]
    scheduled = sorted(_attempt(e) for e in ordered if _type(e) == RETRY_SCHEDULED)
    waiting = status == "retry_scheduled"
    if (
        any(b < a for a, b in itertools.pairwise(tries))
        or tries[-1] != current_try
        or scheduled != list(range(1, current_try + waiting))
    ):
        yield WRONG_TRY, f"events {_types(ordered)} of tries {tries}: the row is on {current_try}"


def _form(key: str, events: list[Outcome]) -> Iterable[tuple[str, str]]:
    """Each message as the relay must publish it: its id, subject and header from its body."""
    for event in events:
        kind = _type(event).removeprefix("charge.")
        if (
            event.body.get("event_id") != f"{key}:{event.body.get('sequence')}"
            or event.headers.get("Nats-Msg-Id") != f"outcome:{event.body.get('event_id')}"
            or not event.subject.endswith(f".{kind}")
        ):
            yield MALFORMED, f"stream seq {event.seq}: {event.subject} {event.headers} {event.body}"


def _agrees(status: str, last: Outcome) -> bool:
    kind = _type(last)
    if kind == f"charge.{status}":
        return True
    late_verdict = kind == "charge.blocked" and last.body.get("review") is True
    return status in CHARGED and (kind == "charge.disputed" or late_verdict)


def _type(event: Outcome) -> str:
    return str(event.body.get("type"))


def _sequence(event: Outcome) -> int:
    sequence = event.body.get("sequence")
    return sequence if isinstance(sequence, int) else 0


def _attempt(event: Outcome) -> int:
    attempt = event.body.get("attempt", 1)
    return attempt if isinstance(attempt, int) else 0


def _event_id(event: Outcome) -> str:
    return str(event.body.get("event_id"))


def _at(event: Outcome) -> dt.datetime:
    """When the event's change committed (to the millisecond: never later than it did)."""
    at = event.body.get("occurred_at")
    return (
        dt.datetime.fromisoformat(at)
        if isinstance(at, str)
        else dt.datetime.max.replace(tzinfo=dt.UTC)
    )


def _seqs(events: list[Outcome]) -> list[int]:
    return [event.seq for event in events]


def _types(events: list[Outcome]) -> list[str]:
    return [f"{_sequence(e)} {_type(e)}" for e in events]
