"""`json_text.dumps`: orjson's text, and the standard library's for what orjson refuses."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from charge_worker.json_text import dumps


def test_compact_text_that_json_reads_back() -> None:
    value = {"event": "charge.settled", "order_id": 42, "error": None, "duration_s": 0.5}
    text = dumps(value)
    assert text == '{"event":"charge.settled","order_id":42,"error":null,"duration_s":0.5}'
    assert json.loads(text) == value


@pytest.mark.parametrize(
    "value",
    [
        {"order_id": 2**64},  # beyond 64 bits
        {1: "a key that is no string"},
        {"customer_id": "\ud800"},  # a lone surrogate
    ],
    ids=["big-int", "int-key", "surrogate"],
)
def test_what_orjson_refuses_is_still_written(value: dict[object, object]) -> None:
    text = dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))


def test_default_names_what_neither_encoder_knows() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    assert dumps({"x": Opaque()}, repr) == '{"x":"<opaque>"}'
    assert dumps({"x": Opaque(), "big": 2**70}, repr) == f'{{"x":"<opaque>","big":{2**70}}}'


def test_dates_as_iso_text() -> None:
    at = dt.datetime(2026, 12, 1, 9, 30, tzinfo=dt.UTC)
    assert dumps({"at": at, "day": at.date()}) == (
        '{"at":"2026-12-01T09:30:00+00:00","day":"2026-12-01"}'
    )
