"""Dead letters as text: the headers written, and what `dlq list` / `dlq show` print."""

from __future__ import annotations

import json

from charge_worker.dlq import DeadLetterSummary, Letter, envelope_headers, replay_headers, table

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NON_ASCII = "00-4bf92f3577b34da6a3ce929d0e0e473ü-00f067aa0ba902b7-01"


def envelope(error: str, original: dict[str, str] | None = None) -> dict[str, str]:
    return envelope_headers(
        reason="poison", error=error, stream_seq=7, num_delivered=1, original=original
    )


def test_every_header_written_is_printable_ascii() -> None:
    """Found in production: a non-ASCII Dlq-Error broke `dlq list` for every dead letter."""
    headers = envelope(
        "field 'überweisung' \x1b[2J appears more than once 💳",
        {"Nats-Msg-Id": "заказ-7\x1b[2J", "traceparent": VALID},
    )
    assert headers["Dlq-Error"] == (
        "field '\\xfcberweisung' \\x1b[2J appears more than once \\U0001f4b3"
    )
    assert headers["Dlq-Orig-Msg-Id"] == "\\u0437\\u0430\\u043a\\u0430\\u0437-7\\x1b[2J"
    assert headers["traceparent"] == VALID
    assert all(value.isascii() and value.isprintable() for value in headers.values())


def test_an_invalid_traceparent_is_not_kept_nor_replayed() -> None:
    """Found in production: `dlq replay` copied a non-ASCII traceparent back, and the charge
    crashed again on every delivery."""
    assert "traceparent" not in envelope("x", {"traceparent": NON_ASCII})
    assert replay_headers(3, {"traceparent": NON_ASCII}) == {"Nats-Msg-Id": "replay:3"}
    assert replay_headers(4, {"traceparent": VALID}) == {
        "Nats-Msg-Id": "replay:4",
        "traceparent": VALID,
    }


def test_table_escapes_what_a_terminal_would_obey() -> None:
    """Found in production: escape sequences from a message body reached the terminal."""
    row = DeadLetterSummary(
        seq=1,
        dead_at="2026-12-01T00:00:05Z",
        reason="poison",
        stream_seq=3,
        num_delivered=1,
        order_id="\x1b[2J",
        billing_period="\x9b31m",
        error="bad \x1b]0;owned\x07 body \u202e",
    )
    _, line = table([row], width=200)
    assert line.isprintable()
    assert "\\x1b[2J" in line
    assert "\\x9b31m" in line
    assert line.endswith("bad \\x1b]0;owned\\x07 body \\u202e")


def test_pretty_body_escapes_what_a_terminal_would_obey() -> None:
    body = json.dumps({"order_id": "\x1b[2J", "note": "\x9b31m\u202egnp.exe"}).encode()
    shown = Letter(1, {}, body).pretty_body()
    assert all(line.isprintable() for line in shown.splitlines())
    assert "\\x9b31m\\u202egnp.exe" in shown
    assert len(shown.splitlines()) == 4  # still indented JSON
    assert "über" in Letter(2, {}, json.dumps({"a": "über"}).encode()).pretty_body()
