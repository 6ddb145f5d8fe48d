"""The gateway simulator's decline table (`sandbox/gateway/cards.py`): whose card is
declined, on which try, with which code."""

from __future__ import annotations

import pytest

from charge_worker.declines import CLASSES
from charge_worker.sandbox.gateway.cards import decline_code, message
from charge_worker.sandbox.gateway.config import GatewayConfig


@pytest.mark.parametrize(
    ("customer", "attempt", "code"),
    [
        ("cus_42", 1, None),
        ("cus_decline", 1, "generic_decline"),
        ("cus_decline_7", 4, "generic_decline"),
        ("cus_auth_1", 2, "authentication_required"),
        ("cus_code_insufficient_funds", 1, "insufficient_funds"),
        ("cus_code_insufficient_funds_7", 3, "insufficient_funds"),
        ("cus_code_do_not_honor_1", 1, "do_not_honor"),
        ("cus_code_stolen_card_x", 1, "stolen_card"),
        ("cus_code_expired_card_2", 1, "expired_card"),
        ("cus_code_weird_reason", 1, "weird_reason"),  # a code the table does not know
        ("cus_soft3_1", 1, "insufficient_funds"),
        ("cus_soft3_1", 2, "insufficient_funds"),
        ("cus_soft3_1", 3, None),
        ("cus_soft3_1", 4, None),
        ("cus_soft1_1", 1, None),
        ("cus_soft12", 11, "insufficient_funds"),
        ("cus_soft12", 12, None),
        ("cus_soft_1", 9, "insufficient_funds"),  # no k: every try
    ],
)
def test_a_customer_id_picks_the_decline_of_each_try(
    customer: str, attempt: int, code: str | None
) -> None:
    metadata = {"order_id": "1", "billing_period": "2026-09-01"}
    if attempt > 1:
        metadata["attempt"] = str(attempt)
    assert decline_code(customer, metadata) == code


@pytest.mark.parametrize("code", sorted(CLASSES))
def test_every_code_of_the_table_has_its_customer(code: str) -> None:
    assert decline_code(f"cus_code_{code}_1", {}) == code
    assert decline_code(f"cus_code_{code}", {}) == code
    assert message(code)


@pytest.mark.parametrize(("attempt", "code"), [(1, "insufficient_funds"), (2, None), (3, None)])
def test_the_succeeds_on_try_knob_declines_softly_until_that_try(
    attempt: int, code: str | None
) -> None:
    knob = {"cus_decline_1": 2}  # the knob wins over the customer id
    assert decline_code("cus_decline_1", {"attempt": str(attempt)}, succeeds_on_try=knob) == code


def test_the_knob_refuses_a_try_below_one() -> None:
    with pytest.raises(ValueError, match="succeeds_on_try"):
        GatewayConfig(succeeds_on_try={"cus_1": 0})
