"""What may be shown to an operator: printable text, and server addresses without secrets."""

from __future__ import annotations

import pytest

from charge_worker.display import printable, without_credentials


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text", "plain text"),
        ("Betrag ungültig, клиент 💳", "Betrag ungültig, клиент 💳"),  # printable Unicode stays
        ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),
        ("\x1b]0;owned\x07", "\\x1b]0;owned\\x07"),
        ("\x9b31m", "\\x9b31m"),  # C1 CSI: one byte that some terminals obey
        ("\x00\x7f", "\\x00\\x7f"),
        ("\u202egnp.exe", "\\u202egnp.exe"),  # right-to-left override
        ("one\ntwo\tthree\r", "one\\ntwo\\tthree\\r"),
        ("\u2028", "\\u2028"),
        ("\U000e0041", "\\U000e0041"),  # a tag character
        ("\ud800", "\\ud800"),
    ],
    ids=repr,
)
def test_printable_escapes_what_a_terminal_would_obey(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(text).isprintable()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://alice:pw@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("nats://s3cr3t-token@nats:4222", "nats://***@nats:4222"),
        ("tls://a:pw@n1:4222,tls://a:pw@n2:4222", "tls://***@n1:4222,tls://***@n2:4222"),
        ("nats://n1:4222,nats://n2:4222", "nats://n1:4222,nats://n2:4222"),
        ("alice:pw@n1:4222", "***@n1:4222"),
        ("postgresql://bob:pw@db:5432/ledger", "postgresql://***@db:5432/ledger"),
        ("postgresql://bob:p@s/s?w,rd@db/ledger", "postgresql://***@db/ledger"),
        (
            "postgresql://db/ledger?user=bob&password=pw",
            "postgresql://db/ledger?user=bob&password=***",
        ),
        (
            "postgresql://db/ledger?sslpassword=pw&sslmode=require",
            "postgresql://db/ledger?sslpassword=***&sslmode=require",
        ),
        (
            "host=db user=bob password=pw dbname=ledger",
            "host=db user=bob password=*** dbname=ledger",
        ),
        ("https://gw.example/v1?api_key=sk_live_1", "https://gw.example/v1?api_key=***"),
        ("http://[::1:4222", "http://[::1:4222"),
        ("", ""),
    ],
)
def test_without_credentials_hides_every_secret_of_an_address(url: str, shown: str) -> None:
    assert without_credentials(url) == shown
