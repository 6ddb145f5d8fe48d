"""The webhook rules as a table: what one snapshot does to one ledger row."""

from __future__ import annotations

from typing import Any

import pytest

from charge_worker.webhooks.rules import (
    Apply,
    Decision,
    Fingerprint,
    Review,
    Row,
    Snapshot,
    Stale,
    Unchanged,
    Wait,
    decide,
    state_of,
)

OURS = Fingerprint(99000, "RUB", "cus_ok")
SUCCEEDED = Row("succeeded", "ch_1", 1, lease_free=True, fingerprint=OURS)
PENDING = Row("pending", None, None, lease_free=True, fingerprint=OURS)


def snapshot(
    kind: str = "charge.succeeded",
    status: str = "succeeded",
    *,
    revision: int = 2,
    charge_id: str = "ch_1",
    refunded: bool = False,
    amount_refunded: int = 0,
    fingerprint: Fingerprint | None = OURS,
) -> Snapshot:
    return Snapshot(
        kind, charge_id, revision, status, refunded, amount_refunded, fingerprint=fingerprint
    )


REFUND = snapshot("charge.refunded", refunded=True, amount_refunded=99000)
OLD_REFUND = snapshot("charge.refunded", "refunded")  # before the contract change

CASES: dict[str, tuple[Snapshot, Row | None, dict[str, int], type[Decision], str | None]] = {
    "a refund (refunded true) of a succeeded row": (REFUND, SUCCEEDED, {}, Apply, "refunded"),
    "a refund in the old shape": (OLD_REFUND, SUCCEEDED, {}, Apply, "refunded"),
    # issue 34 item 13: the refund's body proves the charge (fingerprint checked)
    "a refund of a charge not recorded yet applies": (REFUND, PENDING, {}, Apply, "refunded"),
    "a refund in the old shape of a charge not recorded yet waits": (
        OLD_REFUND,
        PENDING,
        {},
        Wait,
        None,
    ),
    "a refund of a charge not recorded yet, another fingerprint": (
        snapshot("charge.refunded", refunded=True, fingerprint=Fingerprint(1, "RUB", "cus_ok")),
        PENDING,
        {},
        Review,
        None,
    ),
    "a lost answer, newest known": (snapshot(), PENDING, {}, Apply, "succeeded"),
    "an older snapshot than one journaled": (
        snapshot("charge.failed", "failed", revision=1),
        PENDING,
        {"newest_known": 2},
        Stale,
        None,
    ),
    "an older snapshot with no ledger row yet": (
        snapshot(revision=1),
        None,
        {"newest_known": 2},
        Stale,
        None,
    ),
    "the same revision journaled twice is no newer": (
        snapshot(),
        PENDING,
        {"newest_known": 2},
        Apply,
        "succeeded",
    ),
    "a partial refund": (
        snapshot("charge.refunded", amount_refunded=500),
        SUCCEEDED,
        {},
        Review,
        None,
    ),
    "a refund of a second charge for the key": (
        snapshot("charge.refunded", refunded=True, charge_id="ch_2"),
        SUCCEEDED,
        {},
        Unchanged,
        None,
    ),
    "an unknown status": (snapshot(status="disputed"), SUCCEEDED, {}, Review, None),
    # issue 34 item 2: recording a charge makes it the period's: it must prove it
    "a lost answer for another amount": (
        snapshot(fingerprint=Fingerprint(100, "RUB", "cus_ok")),
        PENDING,
        {},
        Review,
        None,
    ),
    "a lost answer for another customer": (
        snapshot(fingerprint=Fingerprint(99000, "RUB", "cus_agent")),
        PENDING,
        {},
        Review,
        None,
    ),
    "a decline of another currency": (
        snapshot("charge.failed", "failed", fingerprint=Fingerprint(99000, "EUR", "cus_ok")),
        PENDING,
        {},
        Review,
        None,
    ),
    # a snapshot without amount, currency or customer (the contract's webhook example):
    # the lookup after the wait bound proves or refuses it
    "a lost answer that says no fingerprint waits": (
        snapshot(fingerprint=None),
        PENDING,
        {},
        Wait,
        None,
    ),
    "a second charge for the key with another fingerprint": (
        snapshot(charge_id="ch_2", fingerprint=Fingerprint(1, "RUB", "cus_ok")),
        SUCCEEDED,
        {},
        Review,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decision(case: str) -> None:
    event, row, journal, kind, status = CASES[case]
    decision = decide(event, row, **journal)
    assert isinstance(decision, kind), decision
    if isinstance(decision, Apply):
        assert decision.status == status
    if isinstance(decision, Review) and "fingerprint" in case:
        assert decision.unmatched
        assert decision.why.startswith("unmatched charge:")


def test_a_lookup_confirms_a_refund_as_a_state() -> None:
    # the lookup's charge says succeeded + refunded: recorded as refunded, not left waiting
    state = state_of("succeeded", refunded=True)
    decision = decide(snapshot("charge.refunded", state), PENDING, confirmed=True)
    assert decision == Apply("refunded", False, "pending -> refunded")


@pytest.mark.parametrize(
    ("status", "refunded", "state"),
    [
        ("succeeded", False, "succeeded"),
        ("succeeded", True, "refunded"),
        ("refunded", False, "refunded"),
        ("failed", False, "failed"),
    ],
)
def test_state_of(status: str, refunded: bool, state: str) -> None:
    assert state_of(status, refunded=refunded) == state


PROCESSING = Row("processing", "pi_1", 5, lease_free=True, fingerprint=OURS)


@pytest.mark.parametrize(
    ("event", "row", "expected"),
    [
        # a bank debit the provider accepted: an open row records it, still not final
        (snapshot("charge.processing", "processing", charge_id="pi_1"), PENDING, "processing"),
        # ... and what it settled as, once it did
        (snapshot("charge.succeeded", charge_id="pi_1", revision=6), PROCESSING, "succeeded"),
        (
            snapshot("charge.failed", "failed", charge_id="pi_1", revision=6),
            PROCESSING,
            "declined",
        ),
        (
            snapshot("charge.refunded", refunded=True, charge_id="pi_1", revision=6),
            PROCESSING,
            "refunded",
        ),
        # still processing: only the revision is recorded
        (
            snapshot("charge.processing", "processing", charge_id="pi_1", revision=6),
            PROCESSING,
            None,
        ),
    ],
)
def test_processing_is_open_until_it_settles(
    event: Snapshot, row: Row, expected: str | None
) -> None:
    decision = decide(event, row)
    assert isinstance(decision, Apply), decision
    assert decision.status == expected


def test_a_fetch_older_than_the_one_applied_is_stale() -> None:
    # re-fetched objects carry the moment of the fetch as their revision
    assert isinstance(decide(snapshot(charge_id="pi_1", revision=4), PROCESSING), Stale)


def test_a_snapshot_without_our_metadata_and_no_row_holding_it_is_stale() -> None:
    """Issue 34 item 5: nothing will ever record a charge that is not ours: not a wait."""
    foreign = Snapshot("charge.refunded", "pi_9", 2, "succeeded", True, 1500, keyed=False)
    decision = decide(foreign, None)
    assert isinstance(decision, Stale), decision


# --- tries: money of any try is the period's; only the current try's decline is its own ----

SCHEDULE = (600.0, 1200.0)


def try_snapshot(kind: str, attempt: int, *, code: str | None = None, **kw: Any) -> Snapshot:
    status = {"charge.failed": "failed"}.get(kind, "succeeded")
    base = snapshot(kind, status, **kw)
    return Snapshot(
        base.event_type,
        base.charge_id,
        base.revision,
        base.status,
        base.refunded,
        base.amount_refunded,
        fingerprint=base.fingerprint,
        attempt=attempt,
        decline_code=code,
    )


def at_try(status: str, current_try: int, *, lease_free: bool = True) -> Row:
    return Row(status, None, None, lease_free, fingerprint=OURS, current_try=current_try)


TRIES: dict[str, tuple[Snapshot, Row, type[Decision], str | None]] = {
    "try 2's charge recorded for the period at try 2": (
        try_snapshot("charge.succeeded", 2),
        at_try("pending", 2),
        Apply,
        "succeeded",
    ),
    "try 1's late capture settles the period at try 2": (
        try_snapshot("charge.succeeded", 1),
        at_try("pending", 2),
        Apply,
        "succeeded",
    ),
    "an earlier try's decline does not decline the current try": (
        try_snapshot("charge.failed", 1, code="insufficient_funds"),
        at_try("pending", 2),
        Unchanged,
        None,
    ),
    "an earlier try's decline does not schedule a waiting period again": (
        try_snapshot("charge.failed", 1, code="insufficient_funds"),
        at_try("retry_scheduled", 2),
        Unchanged,
        None,
    ),
    "an earlier try's decline leaves a final period alone": (
        try_snapshot("charge.failed", 1, code="insufficient_funds"),
        at_try("declined", 2),
        Unchanged,
        None,
    ),
    "a decline of a try never started": (
        try_snapshot("charge.failed", 3),
        at_try("pending", 2),
        Review,
        None,
    ),
    "the current try's soft decline schedules the next": (
        try_snapshot("charge.failed", 2, code="insufficient_funds"),
        at_try("pending", 2),
        Apply,
        "retry_scheduled",
    ),
    "the last try's soft decline is final": (
        try_snapshot("charge.failed", 3, code="insufficient_funds"),
        at_try("pending", 3),
        Apply,
        "declined",
    ),
    "the current try's customer-action decline waits for the customer": (
        try_snapshot("charge.failed", 1, code="expired_card"),
        at_try("pending", 1),
        Apply,
        "action_required",
    ),
    "the current try's hard decline is final": (
        try_snapshot("charge.failed", 2, code="stolen_card"),
        at_try("pending", 2),
        Apply,
        "declined",
    ),
    "the current try's decline, recorded already while waiting": (
        try_snapshot("charge.failed", 2, code="insufficient_funds"),
        at_try("retry_scheduled", 2),
        Unchanged,
        None,
    ),
    "money while waiting for the next try: recorded, no next try": (
        try_snapshot("charge.succeeded", 1),
        at_try("retry_scheduled", 2),
        Apply,
        "succeeded",
    ),
    "money while waiting for the customer: recorded": (
        try_snapshot("charge.succeeded", 2),
        at_try("action_required", 2),
        Apply,
        "succeeded",
    ),
    "a dispute while waiting: the money was taken": (
        try_snapshot("charge.dispute_created", 1),
        at_try("retry_scheduled", 2),
        Apply,
        "succeeded",
    ),
    "money of another fingerprint while waiting": (
        try_snapshot("charge.succeeded", 1, fingerprint=Fingerprint(1, "RUB", "cus_ok")),
        at_try("retry_scheduled", 2),
        Review,
        None,
    ),
    "money for a period declined for good: a person (reconcile records it)": (
        try_snapshot("charge.succeeded", 2),
        at_try("declined", 2),
        Review,
        None,
    ),
}


@pytest.mark.parametrize("case", list(TRIES))
def test_tries(case: str) -> None:
    event, row, kind, status = TRIES[case]
    decision = decide(event, row, schedule=SCHEDULE)
    assert isinstance(decision, kind), decision
    if isinstance(decision, Apply):
        assert decision.status == status
        if event.status == "failed":
            assert decision.decline_code == event.decline_code


def test_a_soft_decline_scheduled_names_the_wait_before_the_next_try() -> None:
    decision = decide(
        try_snapshot("charge.failed", 2, code="insufficient_funds"),
        at_try("pending", 2),
        schedule=SCHEDULE,
    )
    assert decision == Apply(
        "retry_scheduled",
        False,
        "pending -> retry_scheduled",
        decline_code="insufficient_funds",
        retry_in_s=SCHEDULE[1],
    )


def test_a_processing_try_that_fails_follows_the_schedule() -> None:
    row = Row("processing", "pi_1", 5, lease_free=True, fingerprint=OURS, current_try=1)
    event = try_snapshot("charge.failed", 1, charge_id="pi_1", revision=6)
    decision = decide(event, row, schedule=SCHEDULE)
    assert isinstance(decision, Apply)
    assert (decision.status, decision.retry_in_s) == ("retry_scheduled", SCHEDULE[0])
