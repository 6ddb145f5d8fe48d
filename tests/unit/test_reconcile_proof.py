"""What reconcile may refund or record on its own: the table in reconcile/proof.py."""

from __future__ import annotations

from charge_worker.gateway import GatewayCharge
from charge_worker.reconcile.proof import Doubles, LedgerRow, Split, doubles, split, unrecorded

OURS = "99000 RUB cus_ok"


def made(charge_id: str, amount: int = 99000, customer: str = "cus_ok") -> GatewayCharge:
    return GatewayCharge(charge_id, "succeeded", amount, "RUB", customer, "1", "2026-12-01", 1)


def row(status: str = "succeeded", charge_id: str | None = None) -> LedgerRow:
    return LedgerRow(status, OURS, charge_id)


A, B, C = made("ch_a"), made("ch_b"), made("ch_c")
OTHER_AMOUNT, OTHER_CUSTOMER = made("ch_amount", amount=1000), made("ch_cus", customer="cus_x")


def test_one_captured_charge_is_no_double() -> None:
    assert doubles([A], row(charge_id="ch_a")) == Doubles(A)
    assert doubles([], row()) == Doubles(None)


def test_the_recorded_charge_is_kept_and_the_matching_others_refunded() -> None:
    assert doubles([A, B, C], row(charge_id="ch_b")) == Doubles(B, [A, C])


def test_nothing_recorded_keeps_the_earliest_matching() -> None:
    assert doubles([OTHER_AMOUNT, A, B], row("pending")) == Doubles(A, [B], [OTHER_AMOUNT])


def test_charges_for_another_amount_or_customer_are_never_refunded() -> None:
    sorted_out = doubles([A, OTHER_AMOUNT, OTHER_CUSTOMER], row(charge_id="ch_a"))
    assert sorted_out == Doubles(A, [], [OTHER_AMOUNT, OTHER_CUSTOMER])


def test_no_ledger_row_refunds_nothing() -> None:
    assert doubles([A, B], None) == Doubles(None, [], [A, B])


def test_a_recorded_charge_that_does_not_match_its_row_refunds_nothing() -> None:
    assert doubles([OTHER_AMOUNT, A], row(charge_id="ch_amount")) == Doubles(
        None, [], [OTHER_AMOUNT, A]
    )


def test_no_charge_matching_the_row_refunds_nothing() -> None:
    assert doubles([OTHER_AMOUNT, OTHER_CUSTOMER], row()) == Doubles(
        None, [], [OTHER_AMOUNT, OTHER_CUSTOMER]
    )


def test_a_row_that_said_no_records_the_earliest_matching_charge() -> None:
    assert unrecorded([OTHER_CUSTOMER, A, B], row("declined")) == Doubles(A, [], [OTHER_CUSTOMER])
    assert unrecorded([OTHER_AMOUNT], row("blocked")) == Doubles(None, [], [OTHER_AMOUNT])


def test_a_refunded_charge_is_made_but_holds_no_money() -> None:
    refunded = GatewayCharge(
        "ch_r", "succeeded", 99000, "RUB", "cus_ok", "1", "2026-12-01", 1, 99000, True
    )
    partly = GatewayCharge(
        "ch_p", "succeeded", 99000, "RUB", "cus_ok", "1", "2026-12-01", 1, 1000, False
    )
    declined = GatewayCharge("ch_d", "failed", 99000, "RUB", "cus_ok", "1", "2026-12-01", 1)
    assert (refunded.charged, refunded.captured) == (True, False)
    assert (partly.charged, partly.captured) == (True, True)
    assert (declined.charged, declined.captured) == (False, False)
    assert A.fingerprint == OURS


def test_a_lookup_for_an_open_row_keeps_only_the_charges_that_match_it() -> None:
    declined = GatewayCharge("ch_no", "failed", 99000, "RUB", "cus_ok", "1", "2026-12-01", 1)
    declined_other = GatewayCharge("ch_x", "failed", 100, "RUB", "cus_ok", "1", "2026-12-01", 1)
    found = [OTHER_AMOUNT, declined_other, A, OTHER_CUSTOMER, declined]
    assert split(found, row("pending")) == Split([A, declined], [OTHER_AMOUNT, OTHER_CUSTOMER])
    assert split([OTHER_AMOUNT], row("pending")) == Split([], [OTHER_AMOUNT])
