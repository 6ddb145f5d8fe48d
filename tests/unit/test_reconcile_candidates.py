"""Which of a history page's charges reconcile must decide on a lookup, and which ledger
rows the page vouches for: `reconcile/candidates.py`, a table of cases."""

from __future__ import annotations

import datetime as dt

import pytest

from charge_worker.gateway import GatewayCharge
from charge_worker.reconcile.candidates import Key, PageWork, Recorded, ours, sort_page

PERIOD = dt.date(2026, 12, 1)
RECENT = 1_000  # charges created at or after this are inside the next run's overlap


def charge(
    charge_id: str,
    order_id: str | None = "1",
    *,
    created: int = 10,
    status: str = "succeeded",
    refunded: bool = False,
    period: str | None = "2026-12-01",
) -> GatewayCharge:
    return GatewayCharge(
        charge_id,
        status,
        99000,
        "RUB",
        "cus_ok",
        order_id,
        period,
        created,
        99000 if refunded else 0,
        refunded,
    )


def k(order_id: int) -> Key:
    return (order_id, PERIOD)


@pytest.mark.parametrize(
    ("charges", "recorded", "expected"),
    [
        pytest.param(
            [charge("ch_a")],
            {k(1): Recorded("succeeded", "ch_a")},
            PageWork([], [(k(1), "ch_a")]),
            id="recorded-and-shown",
        ),
        pytest.param(
            [charge("ch_a")],
            {k(1): Recorded("succeeded", "ch_a", seen="ch_a")},
            PageWork([], []),
            id="shown-before",
        ),
        pytest.param(
            [charge("ch_b")],
            {k(1): Recorded("succeeded", "ch_a")},
            PageWork([k(1)], []),
            id="another-charge-captured",
        ),
        pytest.param([charge("ch_a")], {}, PageWork([k(1)], []), id="no-row"),
        pytest.param(
            [charge("ch_a")],
            {k(1): Recorded("declined", None)},
            PageWork([k(1)], []),
            id="said-no",
        ),
        pytest.param(
            [charge("ch_b", refunded=True)],
            {k(1): Recorded("succeeded", "ch_a")},
            PageWork([], []),
            id="refunded-extra",
        ),
        pytest.param(
            [charge("ch_b", status="failed")],
            {k(1): Recorded("succeeded", "ch_a")},
            PageWork([], []),
            id="declined-attempt",
        ),
        pytest.param(
            [charge("ch_a", refunded=True)],
            {k(1): Recorded("succeeded", "ch_a")},
            PageWork([], [(k(1), "ch_a")]),
            id="recorded-refunded-since-is-still-charged",
        ),
        pytest.param(
            [charge("ch_a", order_id="x"), charge("ch_b", order_id=None), charge("ch_c", "0")],
            {},
            PageWork([], []),
            id="metadata-naming-no-key",
        ),
        pytest.param(
            [charge("ch_b", "2"), charge("ch_a", "1"), charge("ch_c", "1")],
            {k(1): Recorded("succeeded", "ch_a"), k(2): Recorded("succeeded", "ch_b")},
            PageWork([k(1)], [(k(2), "ch_b"), (k(1), "ch_a")]),
            id="a-double-on-the-page",
        ),
    ],
)
def test_sort_page(
    charges: list[GatewayCharge], recorded: dict[Key, Recorded], expected: PageWork
) -> None:
    assert sort_page(charges, recorded, defer_from=None) == expected


def test_an_open_rows_recent_charge_is_left_to_the_next_run() -> None:
    """The worker has not recorded it yet; the next run reads it again (the overlap)."""
    pending = {k(1): Recorded("pending", None), k(2): Recorded("scheduled", None)}
    recent = [charge("ch_a", created=RECENT), charge("ch_b", "2", created=RECENT + 5)]
    assert sort_page(recent, pending, defer_from=RECENT) == PageWork([], [], deferred=2)


@pytest.mark.parametrize(
    ("charges", "recorded"),
    [
        pytest.param(
            [charge("ch_a", created=RECENT - 1)], {k(1): Recorded("pending", None)}, id="older"
        ),
        pytest.param(
            [charge("ch_a", created=RECENT), charge("ch_b", created=RECENT)],
            {k(1): Recorded("pending", None)},
            id="two-captured",
        ),
        pytest.param([charge("ch_a", created=RECENT)], {}, id="no-row"),
        pytest.param(
            [charge("ch_a", created=RECENT)], {k(1): Recorded("failed", None)}, id="said-no"
        ),
    ],
)
def test_what_is_decided_now_even_when_recent(
    charges: list[GatewayCharge], recorded: dict[Key, Recorded]
) -> None:
    assert sort_page(charges, recorded, defer_from=RECENT).candidates == [k(1)]


@pytest.mark.parametrize(
    ("order_id", "period", "key"),
    [
        ("1", "2026-12-01", (1, PERIOD)),
        (str(2**63 - 1), "2026-12-01", (2**63 - 1, PERIOD)),
        (str(2**63), "2026-12-01", None),
        ("0", "2026-12-01", None),
        ("-4", "2026-12-01", None),
        ("x", "2026-12-01", None),
        ("1", "December", None),
        (None, "2026-12-01", None),
        ("1", None, None),
    ],
)
def test_ours(order_id: str | None, period: str | None, key: Key | None) -> None:
    assert ours(order_id, period) == key
