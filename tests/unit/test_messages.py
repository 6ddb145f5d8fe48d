"""The charge.due/v1 contract: valid bodies parse; every breach is poison with a reason."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from charge_worker.errors import PoisonMessage
from charge_worker.messages import (
    MAX_BODY_BYTES,
    ChargeDue,
    _unique_keys,
    parse,
)

VALID: dict[str, object] = {
    "schema": "charge.due/v1",
    "order_id": 48291,
    "billing_period": "2026-09-01",
    "subscription_id": "sub_7Q2",
    "customer_id": "cus_42",
    "amount_minor": 99000,
    "currency": "RUB",
    "due_at": "2026-09-01T00:00:00Z",
}


def body(**changes: object) -> bytes:
    data = {**VALID, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


def test_contract_example_parses() -> None:
    charge = parse(body(unknown_future_field={"x": 1}))
    assert charge.key == "48291:2026-09-01"
    assert charge.msg_id == "charge:48291:2026-09-01"
    assert charge.billing_period == dt.date(2026, 9, 1)
    assert charge.amount_minor == 99000


POISON = [
    (b"not json", "not UTF-8 JSON"),
    (b"\xff\xfe", "not UTF-8 JSON"),
    (b"[1, 2]", "not an object"),
    (b'{"order_id": ' + b"9" * 5000 + b"}", "not UTF-8 JSON"),
    # found by the chaos suite: RecursionError is no ValueError, and crashed the delivery
    (b'{"deep": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper than 100 levels"),
    (b" " * (MAX_BODY_BYTES + 1), "byte limit"),
    (body(schema="charge.due/v2"), "schema"),
    (body(schema=...), "schema"),
    (body(order_id=...), "order_id"),
    (body(order_id="48291"), "order_id"),
    (body(order_id=0), "order_id"),
    (body(order_id=2**63), "order_id"),
    (body(order_id=True), "order_id"),
    (body(amount_minor=0), "amount_minor"),
    (body(amount_minor=-100), "amount_minor"),
    (body(amount_minor=990.5), "amount_minor"),
    (body(amount_minor=990.0), "amount_minor"),
    (body(amount_minor="990"), "amount_minor"),
    (body(currency="rub"), "currency"),
    (body(currency="RUBL"), "currency"),
    (body(billing_period="2026-9-1"), "billing_period"),
    (body(billing_period="2026-09-01T00:00:00Z"), "billing_period"),
    (body(due_at="2026-09-01T00:00:00"), "due_at"),
    (body(customer_id=""), "customer_id"),
    (body(customer_id="c" * 65), "customer_id"),
    (body(subscription_id=17), "subscription_id"),
]


@pytest.mark.parametrize(("raw", "reason"), POISON)
def test_breach_is_poison_with_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(PoisonMessage, match=reason) as caught:
        parse(raw)
    assert "\n" not in str(caught.value)


@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_escape_as_another_error(raw: bytes) -> None:
    with contextlib.suppress(PoisonMessage):
        parse(raw)


@given(
    order_id=st.integers(1, 2**63 - 1),
    amount=st.integers(1, 10**12),
    day=st.dates(dt.date(2000, 1, 1), dt.date(2100, 1, 1)),
)
def test_round_trip(order_id: int, amount: int, day: dt.date) -> None:
    charge = parse(body(order_id=order_id, amount_minor=amount, billing_period=day.isoformat()))
    assert parse(charge.to_json()) == charge
    assert isinstance(charge, ChargeDue)


def test_brackets_inside_strings_are_no_nesting() -> None:
    raw = json.loads(body())
    raw["note"] = "[{" * 5000 + '\\"]'
    assert parse(json.dumps(raw).encode()).order_id == raw["order_id"]


def test_nesting_is_measured_before_json_sees_it() -> None:
    raw = json.loads(body())
    raw["deep"] = json.loads("[" * 99 + "]" * 99)  # inside the body's object: 100 levels
    assert parse(json.dumps(raw).encode()).order_id == raw["order_id"]
    raw["deep"] = [raw["deep"]]
    with pytest.raises(PoisonMessage, match="deeper than 100 levels"):
        parse(json.dumps(raw).encode())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("customer_id", "cus\x00"),  # PostgreSQL text cannot hold a NUL
        ("subscription_id", "\x00"),
        ("customer_id", "cus\x1b[2J"),  # a terminal escape
        ("subscription_id", "sub\n7Q2"),
        ("customer_id", "cus\x7f"),
        ("customer_id", "cus\x9b31m"),  # C1 CSI
    ],
    ids=repr,
)
def test_control_characters_in_an_id_are_poison(field: str, value: str) -> None:
    """Found in production: a NUL passed the parser and failed in PostgreSQL on every
    delivery, taken for an outage and requeued for ever."""
    with pytest.raises(PoisonMessage, match=field):
        parse(body(**{field: value}))


@pytest.mark.parametrize(
    "due_at",
    [
        "0001-01-01T00:30:00+01:00",  # year 0 in UTC
        "9999-12-31T23:30:00-01:00",  # year 10000 in UTC
        "0001-01-01T00:00:00.000001+00:01",
    ],
)
def test_a_timestamp_outside_the_utc_years_1_to_9999_is_poison(due_at: str) -> None:
    """Found in production: it parsed, and failed to be stored on every delivery."""
    with pytest.raises(PoisonMessage, match="due_at"):
        parse(body(due_at=due_at))


@pytest.mark.parametrize(
    "changes",
    [
        {"customer_id": "клиент-42", "subscription_id": "sub_Ω_ü"},
        {"due_at": "0001-01-01T00:00:00Z"},
        {"due_at": "9999-12-31T23:59:59.999999Z"},
        {"due_at": "0001-01-01T01:30:00+01:00"},
    ],
    ids=repr,
)
def test_printable_unicode_ids_and_the_edges_of_the_range_still_parse(
    changes: dict[str, object],
) -> None:
    assert parse(body(**changes)).order_id == VALID["order_id"]


class _CountedKey(str):
    """A key that counts how often a dict hashes it: one per lookup or insert."""

    hashes = 0

    def __hash__(self) -> int:
        _CountedKey.hashes += 1
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def test_duplicate_key_detection_is_linear_in_the_number_of_keys() -> None:
    """Found in production: ~8,700 keys and one repeated at the end took 1.1 s of CPU on the
    event loop (every key was looked up in a fresh dict of all keys before it).

    Counted, not timed: each dict lookup or insert hashes the key once, so the number of
    hashes is the number of dict operations. Linear detection makes a few per key; the
    quadratic one made n²/2 (2 million here), whatever the machine's speed."""
    count = 2_000
    pairs: list[tuple[str, Any]] = [(_CountedKey(f"k{i}"), i) for i in range(count)]
    pairs.append((_CountedKey(f"k{count - 1}"), "again"))
    _CountedKey.hashes = 0
    with pytest.raises(PoisonMessage, match=f"'k{count - 1}' appears more than once"):
        _unique_keys(pairs)
    assert _CountedKey.hashes <= 4 * len(pairs)


def test_the_first_repeated_key_is_named() -> None:
    raw = b'{"a": 1, "b": 2, "b": 3, "a": 4}'
    with pytest.raises(PoisonMessage, match="'b' appears more than once"):
        parse(raw)
