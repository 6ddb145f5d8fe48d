"""The decline classes in code are the table the gateway contract prints
(docs/contracts/gateway.md, "Retrying a declined renewal"): one table, read both ways."""

from __future__ import annotations

import re
from pathlib import Path

from charge_worker.declines import (
    CLASSES,
    CONTRACT_CLASSES,
    GENERIC_DECLINE,
    YOOKASSA_CLASSES,
    decline_class,
    label,
)

DOCS = Path(__file__).parents[2] / "docs"
CONTRACT = DOCS / "contracts" / "gateway.md"
YOOKASSA_ADR = DOCS / "decisions" / "0008-yookassa-declines.md"


def printed(path: Path, heading: str) -> dict[str, set[str]]:
    """A document's table under `heading`: class -> the codes its row names."""
    section = path.read_text().split(heading, 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|", section, flags=re.MULTILINE)
    return {klass: set(re.findall(r"`(\w+)`", codes)) for klass, codes in rows}


def test_the_code_holds_the_contracts_table() -> None:
    table = printed(CONTRACT, "## Retrying a declined renewal")
    assert set(table) == {"soft", "customer_action", "hard"}
    for klass, codes in table.items():
        assert codes == {code for code, k in CONTRACT_CLASSES.items() if k == klass}, klass


def test_the_code_holds_the_yookassa_adrs_table() -> None:
    table = printed(YOOKASSA_ADR, "## Decision")
    assert set(table) == {"soft", "customer_action", "hard"}
    for klass, codes in table.items():
        assert codes == {code for code, k in YOOKASSA_CLASSES.items() if k == klass}, klass


def test_a_code_both_vocabularies_name_has_one_class() -> None:
    for code in CONTRACT_CLASSES.keys() & YOOKASSA_CLASSES.keys():
        assert CONTRACT_CLASSES[code] == YOOKASSA_CLASSES[code] == CLASSES[code], code


def test_a_code_nobody_listed_is_soft_and_no_code_is_a_generic_decline() -> None:
    assert decline_class("card_velocity_exceeded") == "soft"
    assert decline_class(None) == decline_class(GENERIC_DECLINE) == "soft"


def test_a_code_is_its_own_label_when_the_table_lists_it_and_other_when_not() -> None:
    """The declines metric's `code` label stays bounded whatever a gateway sends."""
    assert label("stolen_card") == "stolen_card"
    assert label(None) == GENERIC_DECLINE
    assert label("card_velocity_exceeded") == label("x" * 200) == "other"
