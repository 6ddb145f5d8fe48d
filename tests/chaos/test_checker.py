"""The money-counting checker's own rules, on facts written by hand (no servers)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.chaos.checker import FATAL, Facts, judge
from tests.chaos.generator import Entry

KEY = "1:2026-12-01"
ENTRY = Entry(KEY, "charged_once", order_id=1, customer="cus_ok", amount=1000)


def _charge(charge_id: str, *, refunded: bool = False) -> dict[str, Any]:
    return {
        "id": charge_id,
        "status": "succeeded",
        "amount": 1000,
        "amount_refunded": 1000 if refunded else 0,
        "refunded": refunded,
        "customer": "cus_ok",
        "idempotency_key": KEY,
    }


def _facts(charges: list[dict[str, Any]], recorded: str) -> Facts:
    row = {
        "status": "succeeded",
        "gateway_charge_id": recorded,
        "deferred": None,
        "review_reason": None,
        "gateway_calls": 1,
    }
    return Facts({KEY: charges}, {KEY: row}, [], Counter(), 0, [], Counter())  # type: ignore[dict-item]


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
    facts = _facts([_charge("ch_1", refunded=True), _charge("ch_2")], "ch_1")
    verdict = judge([ENTRY], facts, ledger_forgets=True, doubles_possible=True)
    assert [outcome for _, outcome, _ in verdict.fatal] == ["wrong_charge_recorded"]
    assert "wrong_charge_recorded" in FATAL
