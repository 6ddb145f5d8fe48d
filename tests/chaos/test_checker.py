"""The money-counting checker's own rules, on facts written by hand (no servers)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest

from charge_worker.retries.schedule import after_decline
from charge_worker.sandbox.gateway import cards
from tests.chaos.checker import FATAL, Facts, judge
from tests.chaos.generator import FIRST_ORDER, Entry, plan
from tests.chaos.outcome_events import LOST_COMMIT
from tests.chaos.scenarios import RETRY_SCHEDULE
from tests.support.outcomes import Outcome

KEY = "1:2026-12-01"
ENTRY = Entry(KEY, "charged_once", order_id=1, customer="cus_ok", amount=1000)
DECLINED = Entry("2:2026-12-01", "declined", order_id=2, customer="cus_decline", amount=1000)
CHANGED_AT = dt.datetime(2026, 12, 1, 0, 0, 5, tzinfo=dt.UTC)


def _charge(
    charge_id: str,
    *,
    refunded: bool = False,
    key: str = KEY,
    attempt: int = 1,
    customer: str = "cus_ok",
    declined: str | None = None,
) -> dict[str, Any]:
    """A charge as `/_sim/charges` shows it: try `attempt` of `key`'s period, under that
    try's key; `declined`: failed with this decline code."""
    order_id, _, period = key.partition(":")
    metadata = {"order_id": order_id, "billing_period": period}
    return {
        "id": charge_id,
        "status": "failed" if declined else "succeeded",
        "amount": 1000,
        "amount_refunded": 1000 if refunded else 0,
        "refunded": refunded,
        "customer": customer,
        "metadata": metadata | ({"attempt": str(attempt)} if attempt > 1 else {}),
        "idempotency_key": key if attempt == 1 else f"{key}:{attempt}",
        **({"decline_code": declined} if declined else {}),
    }


def _row(
    status: str, recorded: str | None, outcome_seq: int = 1, current_try: int = 1
) -> dict[str, Any]:
    return {
        "status": status,
        "gateway_charge_id": recorded,
        "deferred": None,
        "review_reason": None,
        "gateway_calls": 1,
        "outcome_seq": outcome_seq,
        "updated_at": CHANGED_AT,
        "current_try": current_try,
    }


def _event(
    sequence: int,
    kind: str = "succeeded",
    *,
    key: str = KEY,
    charge: str | None = "ch_1",
    at: dt.datetime = CHANGED_AT,
    **extra: Any,
) -> Outcome:
    """A message as the relay publishes it (stream seq: filled in by `_stream`)."""
    order_id, _, period = key.partition(":")
    event_id = f"{key}:{sequence}"
    body = {
        "event_id": event_id,
        "type": f"charge.{kind}",
        "sequence": sequence,
        "order_id": int(order_id),
        "billing_period": period,
        "gateway_charge_id": charge if kind in ("succeeded", "refunded", "disputed") else None,
        "occurred_at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        **extra,
    }
    return Outcome(0, f"charges.outcome.{kind}", {"Nats-Msg-Id": f"outcome:{event_id}"}, body)


def _stream(*events: Outcome) -> list[Outcome]:
    return [Outcome(n, e.subject, e.headers, e.body) for n, e in enumerate(events, 1)]


def _facts(
    charges: list[dict[str, Any]],
    recorded: str,
    events: list[Outcome] | None = None,
    *,
    outcome_seq: int = 1,
) -> Facts:
    rows = {KEY: _row("succeeded", recorded, outcome_seq)}
    stream = _stream(_event(1, charge=recorded)) if events is None else events
    return Facts({KEY: charges}, rows, [], Counter(), 0, [], Counter(), stream)  # type: ignore[arg-type]


def _fatal(facts: Facts, entries: list[Entry] | None = None) -> list[str]:
    return [outcome for _, outcome, _ in judge(entries or [ENTRY], facts).fatal]


def test_one_charge_recorded_by_its_id_is_charged_once() -> None:
    verdict = judge([ENTRY], _facts([_charge("ch_1")], "ch_1"))
    assert verdict.outcomes == Counter({"charged_once": 1})


def test_a_refunded_double_passes_only_where_the_gateway_could_double() -> None:
    facts = _facts([_charge("ch_1"), _charge("ch_2", refunded=True)], "ch_1")
    forgot = judge([ENTRY], facts, ledger_forgets=True, doubles_possible=True)
    assert forgot.outcomes == Counter({"charged_twice_refunded": 1})
    assert not forgot.fatal
    idempotent = judge([ENTRY], facts, ledger_forgets=True)
    assert [outcome for _, outcome, _ in idempotent.fatal] == ["charged_twice"]


def test_a_ledger_that_names_another_charge_than_the_one_held_is_fatal() -> None:
    facts = _facts(
        [_charge("ch_1", refunded=True), _charge("ch_2")],
        "ch_1",
        _stream(_event(1, charge="ch_2")),
    )
    verdict = judge([ENTRY], facts, ledger_forgets=True, doubles_possible=True)
    assert [outcome for _, outcome, _ in verdict.fatal] == ["wrong_charge_recorded"]
    assert "wrong_charge_recorded" in FATAL


PENDING = Entry(KEY, "charged_once", order_id=1, customer="cus_ok", amount=1000, settles_later=True)


@pytest.mark.parametrize(
    ("processing", "looked_up", "outcome"),
    [
        ({KEY: {"ch_1"}}, set(), "charged_once"),
        ({}, set(), "processing_unrecorded"),
        ({KEY: {"ch_other"}}, set(), "processing_unrecorded"),
        ({}, {KEY}, "charged_once"),  # a lookup may find it settled already
    ],
    ids=["recorded processing", "never processing", "another payment", "looked up"],
)
def test_a_key_that_settles_later_was_recorded_processing_with_its_payment(
    processing: dict[str, set[str]], looked_up: set[str], outcome: str
) -> None:
    facts = _facts([_charge("ch_1")], "ch_1")
    facts.processing, facts.looked_up = processing, looked_up
    verdict = judge([PENDING], facts)
    assert list(verdict.outcomes) == [outcome]


def test_the_processing_share_draws_keys_that_settle_later() -> None:
    entries, plain = plan(1, 1000, processing_share=0.2), plan(1, 1000)
    later = [e for e in entries if e.settles_later]
    assert 150 < len(later) < 250
    assert {e.customer for e in later} == {
        f"cus_processing_{e.order_id - FIRST_ORDER}" for e in later
    }
    # only which charged keys settle later changes: the rest of the plan is the same
    assert [e.expect for e in entries] == [e.expect for e in plain]
    assert not any(e.settles_later for e in plain)


# --- the outcome events: CHARGE_OUTCOMES against the ledger and the gateway


@pytest.mark.parametrize(
    ("events", "outcome_seq", "fatal"),
    [
        # the relay died between the publish and the mark and the re-publish was stored
        ([_event(1), _event(1)], 1, ["outcome_duplicate"]),
        ([_event(1)], 2, ["outcome_missing"]),
        ([_event(2, "blocked", review=True), _event(1)], 2, ["outcome_out_of_order"]),
        ([_event(1), _event(2, "blocked", review=True)], 1, ["outcome_without_change"]),
        ([_event(1), _event(2, "declined")], 2, ["outcome_wrong_last"]),
        ([], 0, ["outcome_missing", "outcome_charge_unannounced"]),
        ([_event(1, charge="ch_other")], 1, ["outcome_charge_unannounced"]),
    ],
    ids=[
        "duplicate event_id",
        "sequence missing",
        "out of sequence order",
        "beyond outcome_seq",
        "wrong last type",
        "charged, no event",
        "succeeded names another charge",
    ],
)
def test_the_outcome_stream_must_agree_with_the_ledger_and_the_gateway(
    events: list[Outcome], outcome_seq: int, fatal: list[str]
) -> None:
    facts = _facts([_charge("ch_1")], "ch_1", _stream(*events), outcome_seq=outcome_seq)
    assert sorted(_fatal(facts)) == sorted(fatal)
    assert set(fatal) <= FATAL


def test_a_late_verdict_or_a_dispute_may_follow_the_charge() -> None:
    for last in (_event(2, "blocked", review=True), _event(2, "disputed")):
        facts = _facts([_charge("ch_1")], "ch_1", _stream(_event(1), last), outcome_seq=2)
        assert _fatal(facts) == []


def test_a_declined_key_ends_with_its_declined_event() -> None:
    rows = {DECLINED.key: _row("declined", None)}
    declined = _charge("ch_d", key=DECLINED.key, customer="cus_decline", declined="do_not_honor")
    for kind, fatal in (("declined", []), ("failed", ["outcome_wrong_last"])):
        stream = _stream(_event(1, kind, key=DECLINED.key))
        charges = {DECLINED.key: [declined]}
        facts = Facts(charges, rows, [], Counter(), 0, [], Counter(), stream)  # type: ignore[arg-type]
        assert _fatal(facts, [DECLINED]) == fatal


def test_an_event_for_a_key_the_ledger_has_no_row_for_is_fatal() -> None:
    stranger = _event(1, key="3:2026-12-01", charge=None)
    facts = _facts([_charge("ch_1")], "ch_1", _stream(_event(1), stranger))
    verdict = judge([ENTRY], facts)
    assert [(key, outcome) for key, outcome, _ in verdict.fatal] == [
        ("3:2026-12-01", "outcome_without_row")
    ]


def test_an_event_the_outbox_never_marked_sent_is_fatal() -> None:
    facts = _facts([_charge("ch_1")], "ch_1")
    facts.unsent[KEY] = 1
    assert _fatal(facts) == ["outcome_unpublished"]


def test_a_message_whose_id_is_not_its_event_id_is_fatal() -> None:
    event = _event(1)
    wrong = Outcome(0, event.subject, {"Nats-Msg-Id": "outcome:1:2026-12-01:9"}, event.body)
    assert _fatal(_facts([_charge("ch_1")], "ch_1", _stream(wrong))) == ["outcome_malformed"]


def test_an_open_row_has_no_terminal_event_after_its_last_change() -> None:
    later = CHANGED_AT + dt.timedelta(seconds=1)
    for at, fatal in ((CHANGED_AT, []), (later, ["outcome_after_open"])):
        # a failed row taken again (`pending`): its charge.failed came before that
        stream = _stream(_event(1, "failed", charge=None, at=at))
        rows = {KEY: _row("pending", None)}
        facts = Facts({}, rows, [], Counter(), 0, [], Counter(), stream)  # type: ignore[arg-type]
        assert [o for _, o, _ in judge([], facts).fatal] == fatal


def test_where_the_ledger_forgets_an_event_of_a_lost_commit_is_reported_not_fatal() -> None:
    # published before the failover lost its change (ch_1, refunded since as a double); the
    # change made again took the next sequence (the relay never reuses a taken id), and a
    # late verdict the failover also lost lies beyond the new ledger's outcome_seq
    stream = _stream(
        _event(1, charge="ch_1"), _event(2, charge="ch_2"), _event(3, "blocked", review=True)
    )
    charges = [_charge("ch_1", refunded=True), _charge("ch_2")]
    facts = _facts(charges, "ch_2", stream, outcome_seq=2)
    verdict = judge([ENTRY], facts, ledger_forgets=True, doubles_possible=True)
    assert not verdict.fatal
    assert verdict.outcomes[LOST_COMMIT] == 1  # the verdict beyond outcome_seq
    strict = judge([ENTRY], facts, ledger_forgets=False, doubles_possible=True)
    assert "outcome_without_change" in [o for _, o, _ in strict.fatal]


def test_where_the_ledger_forgets_the_change_made_again_must_still_be_announced() -> None:
    # what an id reused inside the duplicate window would leave: the stream names only the
    # lost charge, and nothing ever announced the one that holds the money
    stream = _stream(_event(1, charge="ch_1"))
    facts = _facts([_charge("ch_1", refunded=True), _charge("ch_2")], "ch_2", stream)
    verdict = judge([ENTRY], facts, ledger_forgets=True, doubles_possible=True)
    assert "outcome_charge_unannounced" in [o for _, o, _ in verdict.fatal]
    duplicated = _facts([_charge("ch_1")], "ch_1", _stream(_event(1), _event(1)))
    forgot = judge([ENTRY], duplicated, ledger_forgets=True)
    assert [o for _, o, _ in forgot.fatal] == ["outcome_duplicate"]


# --- tries (the retries family): counted per period at the gateway, across every try's key

SOFT = Entry(KEY, "charged_once", order_id=1, customer="cus_soft3_1", amount=1000, tries=3)
HARD = Entry(KEY, "declined", order_id=1, customer="cus_code_stolen_card_1", amount=1000)
ACTION = Entry(KEY, "action_required", order_id=1, customer="cus_auth_1", amount=1000)
RETRIES = 4  # tries allowed: the first and a schedule of three


def _soft(attempt: int, charge_id: str | None = None) -> dict[str, Any]:
    return _charge(
        charge_id or f"ch_{attempt}",
        attempt=attempt,
        customer=SOFT.customer or "",
        declined="insufficient_funds" if charge_id is None else None,
    )


def _tried(
    entry: Entry,
    charges: list[dict[str, Any]],
    row: dict[str, Any],
    events: list[Outcome],
) -> list[str]:
    rows: dict[str, Any] = {KEY: row}  # read by column, as the checker reads a Record
    facts = Facts({KEY: charges}, rows, [], Counter(), 0, [], Counter(), _stream(*events))
    verdict = judge([entry], facts, tries_allowed=RETRIES)
    return [outcome for _, outcome, _ in verdict.fatal] or list(verdict.outcomes)


SOFT_EVENTS = [
    _event(1, "retry_scheduled", charge=None, attempt=1),
    _event(2, "retry_scheduled", charge=None, attempt=2),
    _event(3, charge="ch_won", attempt=3),
]


def test_a_soft_decline_charged_on_its_try_is_charged_once() -> None:
    charges = [_soft(1), _soft(2), _soft(3, "ch_won")]
    row = _row("succeeded", "ch_won", outcome_seq=3, current_try=3)
    assert _tried(SOFT, charges, row, SOFT_EVENTS) == ["charged_once"]


def test_a_period_charged_twice_across_two_tries_keys_is_fatal() -> None:
    # try 1's charge went through, unseen, and try 2 was sent under its own key
    charges = [_soft(1, "ch_lost"), _soft(2, "ch_won")]
    row = _row("succeeded", "ch_won", outcome_seq=2, current_try=2)
    events = [_event(1, "retry_scheduled", charge=None), _event(2, charge="ch_won", attempt=2)]
    assert "charged_twice" in _tried(SOFT, charges, row, events)


def test_a_period_that_ends_on_another_try_than_its_card_allows_is_fatal() -> None:
    # charged on try 3 as due, but the ledger says try 2: the try 2 row was never started
    charges = [_soft(1), _soft(2), _soft(3, "ch_won")]
    row = _row("succeeded", "ch_won", outcome_seq=3, current_try=2)
    assert "wrong_try" in _tried(SOFT, charges, row, SOFT_EVENTS)


@pytest.mark.parametrize(
    "again",
    [
        _charge("ch_2", customer="cus_code_stolen_card_1", declined="stolen_card"),
        _charge("ch_2", attempt=2, customer="cus_code_stolen_card_1", declined="stolen_card"),
    ],
    ids=["the same try again", "a next try"],
)
def test_a_hard_decline_sent_twice_is_fatal(again: dict[str, Any]) -> None:
    first = _charge("ch_1", customer="cus_code_stolen_card_1", declined="stolen_card")
    row = _row("declined", None)
    events = [_event(1, "declined", charge=None)]
    assert _tried(HARD, [first], row, events) == ["declined"]
    assert _tried(HARD, [first, again], row, events) == ["final_decline_sent_again"]


def test_a_customer_action_decline_is_never_sent_again_by_itself() -> None:
    first = _charge("ch_1", customer="cus_auth_1", declined="authentication_required")
    row = _row("action_required", None)
    events = [_event(1, "action_required", charge=None)]
    assert _tried(ACTION, [first], row, events) == ["action_required"]
    again = _charge("ch_2", attempt=2, customer="cus_auth_1", declined="authentication_required")
    assert _tried(ACTION, [first, again], row, events) == ["final_decline_sent_again"]


def test_a_try_beyond_the_schedule_is_fatal() -> None:
    exhausted = Entry(KEY, "declined", order_id=1, customer="cus_soft_1", amount=1000, tries=4)
    charges = [
        _charge(f"ch_{n}", attempt=n, customer="cus_soft_1", declined="insufficient_funds")
        for n in range(1, 6)
    ]
    events = [_event(n, "retry_scheduled", charge=None, attempt=n) for n in range(1, 5)]
    row = _row("declined", None, outcome_seq=5, current_try=5)
    events.append(_event(5, "declined", charge=None, attempt=5))
    assert "tried_beyond_schedule" in _tried(exhausted, charges, row, events)
    within = _row("declined", None, outcome_seq=4, current_try=4)
    last = _event(4, "declined", charge=None, attempt=4)
    assert _tried(exhausted, charges[:4], within, [*events[:3], last]) == ["declined"]


@pytest.mark.parametrize(
    "events",
    [
        [SOFT_EVENTS[0], _event(2, charge="ch_won", attempt=3)],
        [SOFT_EVENTS[0], SOFT_EVENTS[1], _event(3, charge="ch_won", attempt=2)],
        [
            _event(1, "retry_scheduled", charge=None, attempt=2),
            _event(2, "retry_scheduled", charge=None, attempt=1),
            SOFT_EVENTS[2],
        ],
    ],
    ids=["try 2's decline not announced", "the last event of another try", "tries going back"],
)
def test_the_events_must_tell_each_try(events: list[Outcome]) -> None:
    charges = [_soft(1), _soft(2), _soft(3, "ch_won")]
    row = _row("succeeded", "ch_won", outcome_seq=len(events), current_try=3)
    assert _tried(SOFT, charges, row, events) == ["outcome_wrong_try"]


def test_the_retries_oracle_is_what_the_simulator_and_the_schedule_make_of_each_card() -> None:
    """Each key the generator draws for the retries family, tried the way the worker and
    the producer would: the simulator's answer on each try (`cards.decline_code`), the
    product's decision after a decline (`after_decline`), until the period ends."""
    schedule = RETRY_SCHEDULE
    entries = [e for e in plan(7, 400, retry_schedule=schedule) if e.poison is None]
    drawn = Counter(e.expect for e in entries)
    assert {"charged_once", "declined", "action_required", "blocked"} <= set(drawn)
    assert max(e.tries for e in entries) == 1 + len(schedule)
    for entry in (e for e in entries if e.expect != "blocked"):
        assert entry.customer is not None
        for attempt in range(1, entry.tries + 1):
            code = cards.decline_code(entry.customer, {"attempt": str(attempt)})
            if code is None:
                outcome = "charged_once"
                break
            after = after_decline(code, attempt, schedule)
            outcome = after.status
            if outcome != "retry_scheduled":
                break
        assert (outcome, attempt) == (entry.expect, entry.tries), entry
