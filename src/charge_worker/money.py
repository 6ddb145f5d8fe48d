"""Amounts between minor units and the decimal strings payment APIs speak.

The worker counts money as an `int` of minor units (kopecks, cents, yen); a provider such as
YooKassa sends and expects `{"value": "990.00", "currency": "RUB"}`. The two are converted
here, exactly, by the number of digits after the point that the currency has: its minor
unit in ISO 4217's list one (`EXPONENTS`). Nothing is rounded: a string that does not carry
exactly that many digits is refused (`AmountMismatch`), and a currency the table does not
hold is refused (`UnknownCurrency`). No floats: integer arithmetic only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

# ISO 4217 list one as published 2026-01-01: its alphabetic codes with their minor unit.
# Codes whose minor unit is "N.A." (the metals XAU XAG XPD XPT, XDR, XSU, XUA, the bond
# units XBA-XBD, XTS, XXX) have no decimal amount and are left out.
EXPONENTS: Mapping[str, int] = MappingProxyType(
    {
        "AED": 2, "AFN": 2, "ALL": 2, "AMD": 2, "AOA": 2, "ARS": 2, "AUD": 2, "AWG": 2, "AZN": 2,
        "BAM": 2, "BBD": 2, "BDT": 2, "BHD": 3, "BIF": 0, "BMD": 2, "BND": 2, "BOB": 2, "BOV": 2,
        "BRL": 2, "BSD": 2, "BTN": 2, "BWP": 2, "BYN": 2, "BZD": 2, "CAD": 2, "CDF": 2, "CHE": 2,
        "CHF": 2, "CHW": 2, "CLF": 4, "CLP": 0, "CNY": 2, "COP": 2, "COU": 2, "CRC": 2, "CUP": 2,
        "CVE": 2, "CZK": 2, "DJF": 0, "DKK": 2, "DOP": 2, "DZD": 2, "EGP": 2, "ERN": 2, "ETB": 2,
        "EUR": 2, "FJD": 2, "FKP": 2, "GBP": 2, "GEL": 2, "GHS": 2, "GIP": 2, "GMD": 2, "GNF": 0,
        "GTQ": 2, "GYD": 2, "HKD": 2, "HNL": 2, "HTG": 2, "HUF": 2, "IDR": 2, "ILS": 2, "INR": 2,
        "IQD": 3, "IRR": 2, "ISK": 0, "JMD": 2, "JOD": 3, "JPY": 0, "KES": 2, "KGS": 2, "KHR": 2,
        "KMF": 0, "KPW": 2, "KRW": 0, "KWD": 3, "KYD": 2, "KZT": 2, "LAK": 2, "LBP": 2, "LKR": 2,
        "LRD": 2, "LSL": 2, "LYD": 3, "MAD": 2, "MDL": 2, "MGA": 2, "MKD": 2, "MMK": 2, "MNT": 2,
        "MOP": 2, "MRU": 2, "MUR": 2, "MVR": 2, "MWK": 2, "MXN": 2, "MXV": 2, "MYR": 2, "MZN": 2,
        "NAD": 2, "NGN": 2, "NIO": 2, "NOK": 2, "NPR": 2, "NZD": 2, "OMR": 3, "PAB": 2, "PEN": 2,
        "PGK": 2, "PHP": 2, "PKR": 2, "PLN": 2, "PYG": 0, "QAR": 2, "RON": 2, "RSD": 2, "RUB": 2,
        "RWF": 0, "SAR": 2, "SBD": 2, "SCR": 2, "SDG": 2, "SEK": 2, "SGD": 2, "SHP": 2, "SLE": 2,
        "SOS": 2, "SRD": 2, "SSP": 2, "STN": 2, "SVC": 2, "SYP": 2, "SZL": 2, "THB": 2, "TJS": 2,
        "TMT": 2, "TND": 3, "TOP": 2, "TRY": 2, "TTD": 2, "TWD": 2, "TZS": 2, "UAH": 2, "UGX": 0,
        "USD": 2, "USN": 2, "UYI": 0, "UYU": 2, "UYW": 4, "UZS": 2, "VED": 2, "VES": 2, "VND": 0,
        "VUV": 0, "WST": 2, "XAD": 2, "XAF": 0, "XCD": 2, "XCG": 2, "XOF": 0, "XPF": 0, "YER": 2,
        "ZAR": 2, "ZMW": 2, "ZWG": 2,
    }
)  # fmt: skip


class UnknownCurrency(ValueError):
    """A currency code that ISO 4217's list one does not give a minor unit."""


class AmountMismatch(ValueError):
    """A decimal string that is not exactly an amount of its currency: never rounded."""


def exponent(currency: str) -> int:
    """The digits after the point in `currency`'s amounts (2 for RUB, 0 for JPY)."""
    try:
        return EXPONENTS[currency]
    except KeyError:
        raise UnknownCurrency(
            f"unknown currency {currency!r}: not an ISO 4217 code with a minor unit"
        ) from None


def to_decimal_string(amount_minor: int, currency: str) -> str:
    """`amount_minor` as the provider's decimal string: `(99000, "RUB")` -> `"990.00"`."""
    # bool is an int subclass: True would otherwise be one kopeck
    if isinstance(amount_minor, bool) or not isinstance(amount_minor, int):
        # every refused amount is a ValueError, whatever made it wrong: one except for callers
        raise ValueError(f"amount in minor units must be an int, not {amount_minor!r}")  # noqa: TRY004
    if amount_minor < 0:
        raise ValueError(f"amount in minor units must not be negative, not {amount_minor}")
    digits = exponent(currency)
    if digits == 0:
        return str(amount_minor)
    major, minor = divmod(amount_minor, 10**digits)
    return f"{major}.{minor:0{digits}d}"


# ASCII digits only (str.isdigit and \d in str patterns accept "١٢" and other scripts'
# digits). A leading zero is refused too: a provider never sends "0990.00", and a string
# that does not look like what it sends is rejected rather than guessed at.
_WHOLE = r"(?:0|[1-9][0-9]*)"


def from_decimal_string(value: str, currency: str) -> int:
    """The provider's decimal string as minor units: `("990.00", "RUB")` -> `99000`.

    Strict: digits, a point and exactly `exponent(currency)` digits after it (no point for a
    currency without a minor unit); no sign, exponent, spaces or separators.
    """
    digits = exponent(currency)
    pattern = _WHOLE if digits == 0 else rf"{_WHOLE}\.[0-9]{{{digits}}}"
    if not isinstance(value, str) or re.fullmatch(pattern, value, flags=re.ASCII) is None:
        raise AmountMismatch(
            f"{value!r} is not a {currency} amount: {currency} has {digits} digits after "
            "the point, written as ASCII digits with no sign, spaces or leading zeros"
        )
    return int(value.replace(".", ""))
