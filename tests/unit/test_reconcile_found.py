"""What a lookup's charges say an open row comes to (`sweeps.found`): the worker's rule."""

from __future__ import annotations

import pytest

from charge_worker.gateway import GatewayCharge
from charge_worker.reconcile.sweeps import Found, found

SCHEDULE = (600.0, 1200.0)


def charge(
    n: int, status: str, attempt: int = 1, *, code: str | None = None, refunded: bool = False
) -> GatewayCharge:
    return GatewayCharge(
        f"ch_{n}",
        status,
        99000,
        "RUB",
        "cus_ok",
        "1",
        "2026-12-01",
        n,
        refunded=refunded,
        decline_code=code,
        attempt=attempt,
    )


SOFT_1 = charge(1, "failed", 1, code="insufficient_funds")
SOFT_2 = charge(2, "failed", 2, code="insufficient_funds")
CHARGED_1 = charge(3, "succeeded", 1)
CHARGED_2 = charge(4, "succeeded", 2)

CASES: dict[str, tuple[list[GatewayCharge], int, Found | None]] = {
    "nothing": ([], 2, None),
    "an earlier try's decline only": ([SOFT_1], 2, None),
    "the current try's soft decline, a step left": (
        [SOFT_1, SOFT_2],
        2,
        Found("retry_scheduled", SOFT_2, SCHEDULE[1]),
    ),
    "the current try's soft decline, no step left": (
        [charge(5, "failed", 3, code="insufficient_funds")],
        3,
        Found("declined", charge(5, "failed", 3, code="insufficient_funds"), exhausted=True),
    ),
    "the current try's customer-action decline": (
        [charge(6, "failed", 1, code="expired_card")],
        1,
        Found("action_required", charge(6, "failed", 1, code="expired_card")),
    ),
    "the current try's hard decline": (
        [charge(7, "failed", 2, code="stolen_card")],
        2,
        Found("declined", charge(7, "failed", 2, code="stolen_card")),
    ),
    "a decline with no code is a generic one: soft": (
        [charge(8, "failed", 1)],
        1,
        Found("retry_scheduled", charge(8, "failed", 1), SCHEDULE[0]),
    ),
    "an earlier try's money beside the current try's decline": (
        [CHARGED_1, SOFT_2],
        2,
        Found("succeeded", CHARGED_1),
    ),
    "the current try's money": ([SOFT_1, CHARGED_2], 2, Found("succeeded", CHARGED_2)),
    "money refunded since is made all the same": (
        [charge(9, "succeeded", 1, refunded=True), SOFT_2],
        2,
        Found("succeeded", charge(9, "succeeded", 1, refunded=True)),
    ),
}


@pytest.mark.parametrize(("charges", "current_try", "expected"), CASES.values(), ids=CASES)
def test_found(charges: list[GatewayCharge], current_try: int, expected: Found | None) -> None:
    assert found(charges, current_try, SCHEDULE) == expected
