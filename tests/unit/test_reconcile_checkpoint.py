"""Which history a run reads and whether it may move the checkpoint:
`reconcile/checkpoint.py`'s `plan`, a table of cases."""

from __future__ import annotations

import datetime as dt

import pytest

from charge_worker.reconcile.checkpoint import Plan, plan

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
WINDOW, OVERLAP = dt.timedelta(hours=48), dt.timedelta(seconds=60)
START = NOW - WINDOW
LAST = NOW - dt.timedelta(minutes=15)


@pytest.mark.parametrize(
    ("checkpoint", "since", "full", "expected"),
    [
        pytest.param(None, None, False, Plan("window", START, NOW, stores=True), id="first-run"),
        pytest.param(
            LAST, None, False, Plan("incremental", LAST - OVERLAP, NOW, stores=True), id="next-run"
        ),
        pytest.param(
            NOW - dt.timedelta(days=5),
            None,
            False,
            Plan("incremental", START, NOW, stores=True),
            id="checkpoint-older-than-the-window",
        ),
        pytest.param(LAST, None, True, Plan("full", START, NOW, stores=True), id="full"),
        pytest.param(
            LAST,
            LAST - dt.timedelta(hours=1),
            False,
            Plan("since", LAST - dt.timedelta(hours=1), NOW, stores=True),
            id="since-before-the-checkpoint",
        ),
        pytest.param(
            LAST,
            NOW - dt.timedelta(minutes=1),
            False,
            Plan("since", NOW - dt.timedelta(minutes=1), NOW, stores=False),
            id="since-after-the-checkpoint-leaves-a-gap",
        ),
        pytest.param(
            None,
            NOW - dt.timedelta(hours=1),
            False,
            Plan("since", NOW - dt.timedelta(hours=1), NOW, stores=False),
            id="since-inside-the-window-on-the-first-run",
        ),
        pytest.param(
            None,
            NOW - dt.timedelta(days=7),
            False,
            Plan("since", NOW - dt.timedelta(days=7), NOW, stores=True),
            id="since-before-the-window",
        ),
    ],
)
def test_plan(
    checkpoint: dt.datetime | None, since: dt.datetime | None, full: bool, expected: Plan
) -> None:
    got = plan(
        NOW,
        checkpoint=checkpoint,
        since=since,
        full=full,
        window_s=WINDOW.total_seconds(),
        overlap_s=OVERLAP.total_seconds(),
    )
    assert got == expected


def test_what_the_next_run_reads_again_and_what_discrepancies_look_back_to() -> None:
    got = plan(NOW, checkpoint=LAST, since=None, full=False, window_s=172800, overlap_s=60)
    assert got.defer_from == NOW - OVERLAP
    assert got.settled_from == START  # rows not shown yet are checked for the whole window
    older = plan(
        NOW,
        checkpoint=None,
        since=NOW - dt.timedelta(days=7),
        full=False,
        window_s=172800,
        overlap_s=60,
    )
    assert older.settled_from == NOW - dt.timedelta(days=7)
    none = plan(NOW, checkpoint=None, since=None, full=False, window_s=172800, overlap_s=0)
    assert none.defer_from is None  # nothing is read twice: nothing may wait for it
