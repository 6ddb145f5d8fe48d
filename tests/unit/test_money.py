"""Minor units and providers' decimal strings convert exactly, both ways, or not at all."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from charge_worker.money import (
    EXPONENTS,
    AmountMismatch,
    UnknownCurrency,
    exponent,
    from_decimal_string,
    to_decimal_string,
)


@pytest.mark.parametrize(
    ("amount_minor", "currency", "value"),
    [
        (99000, "RUB", "990.00"),
        (5, "RUB", "0.05"),
        (0, "RUB", "0.00"),
        (100, "USD", "1.00"),
        (500, "JPY", "500"),
        (0, "JPY", "0"),
        (1234, "KWD", "1.234"),
        (7, "BHD", "0.007"),
        (12345, "CLF", "1.2345"),
        (1, "UYW", "0.0001"),
        (10**30 + 1, "EUR", "10000000000000000000000000000.01"),
    ],
)
def test_the_table_of_examples_reads_both_ways(
    amount_minor: int, currency: str, value: str
) -> None:
    assert to_decimal_string(amount_minor, currency) == value
    assert from_decimal_string(value, currency) == amount_minor


@given(
    currency=st.sampled_from(sorted(EXPONENTS)),
    amount_minor=st.integers(min_value=0, max_value=10**18),
)
def test_every_currency_round_trips(currency: str, amount_minor: int) -> None:
    value = to_decimal_string(amount_minor, currency)
    assert from_decimal_string(value, currency) == amount_minor


def test_every_currency_writes_its_exponent_digits_after_the_point_and_reads_them_back() -> None:
    for currency, digits in EXPONENTS.items():
        value = to_decimal_string(1, currency)
        assert value == ("1" if digits == 0 else "0." + "0" * (digits - 1) + "1"), currency
        for amount_minor in (0, 1, 10**digits, 99000, 10**20 + 7):
            text = to_decimal_string(amount_minor, currency)
            assert from_decimal_string(text, currency) == amount_minor, (currency, text)


@pytest.mark.parametrize(
    ("currency", "digits"),
    [
        ("RUB", 2), ("EUR", 2), ("USD", 2), ("JPY", 0), ("KRW", 0), ("CLP", 0), ("ISK", 0),
        ("VND", 0), ("XAF", 0), ("XOF", 0), ("XPF", 0), ("BHD", 3), ("IQD", 3), ("JOD", 3),
        ("KWD", 3), ("LYD", 3), ("OMR", 3), ("TND", 3), ("CLF", 4), ("UYW", 4), ("VES", 2),
        ("SLE", 2), ("ZWG", 2), ("STN", 2), ("MRU", 2),
    ],
)  # fmt: skip
def test_known_exponents(currency: str, digits: int) -> None:
    assert exponent(currency) == digits


def test_the_table_is_iso_codes_only() -> None:
    assert 150 <= len(EXPONENTS) <= 180
    assert all(len(code) == 3 and code.isascii() and code.isupper() for code in EXPONENTS)
    assert set(EXPONENTS.values()) == {0, 2, 3, 4}


@pytest.mark.parametrize(
    "currency",
    ["XAU", "XDR", "XXX", "HRK", "SLL", "ZWL", "rub", "", "RUBX"],
)
def test_a_currency_without_a_minor_unit_is_unknown_and_named(currency: str) -> None:
    for call in (
        lambda: exponent(currency),
        lambda: to_decimal_string(100, currency),
        lambda: from_decimal_string("1.00", currency),
    ):
        with pytest.raises(UnknownCurrency) as caught:
            call()
        message = str(caught.value)
        assert repr(currency) in message
        assert "\n" not in message
    assert issubclass(UnknownCurrency, ValueError)


@pytest.mark.parametrize("amount_minor", [True, False, -1, 1.0, 990.0, "99000", None])
def test_only_a_non_negative_int_is_an_amount(amount_minor: object) -> None:
    with pytest.raises(ValueError, match="amount in minor units") as caught:
        to_decimal_string(amount_minor, "RUB")  # type: ignore[arg-type]
    assert not isinstance(caught.value, UnknownCurrency)


@pytest.mark.parametrize(
    ("value", "currency"),
    [
        ("990.0", "RUB"),  # one digit short
        ("990.001", "RUB"),  # one too many: never rounded
        ("990", "RUB"),  # no point
        ("990.", "RUB"),
        (".00", "RUB"),
        ("1e3", "RUB"),
        ("1E3", "JPY"),
        ("-1.00", "RUB"),
        ("+1.00", "RUB"),
        (" 1.00", "RUB"),
        ("1.00 ", "RUB"),
        ("1.00\n", "RUB"),
        ("1,00", "RUB"),
        ("1_000.00", "RUB"),
        ("\u0661\u0662.\u0660\u0660", "RUB"),  # Arabic-Indic digits: isdigit() says yes
        ("\uff11\uff12.\uff10\uff10", "RUB"),  # fullwidth digits: int() reads them
        ("0990.00", "RUB"),  # leading zero
        ("00.00", "RUB"),
        ("NaN", "RUB"),
        ("Infinity", "RUB"),
        ("", "RUB"),
        ("500.0", "JPY"),  # JPY has no minor unit: no point at all
        ("500.", "JPY"),
        ("0500", "JPY"),
        ("1.23", "KWD"),
        ("1.2345", "KWD"),
        ("1.234", "CLF"),
    ],
)
def test_a_string_that_is_not_exactly_an_amount_is_refused(value: str, currency: str) -> None:
    with pytest.raises(AmountMismatch) as caught:
        from_decimal_string(value, currency)
    message = str(caught.value)
    assert repr(value) in message
    assert f"{currency} has {exponent(currency)} digits" in message
    assert "\n" not in message
    assert issubclass(AmountMismatch, ValueError)


def test_a_value_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(AmountMismatch):
        from_decimal_string(990.0, "RUB")  # type: ignore[arg-type]
