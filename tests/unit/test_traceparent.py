"""`traceparent`: only a valid W3C Trace Context header (version 00) is forwarded or kept."""

from __future__ import annotations

import pytest

from charge_worker.messages import valid_traceparent

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    "header", [TRACEPARENT, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"]
)
def test_a_valid_traceparent_is_kept_as_it_is(header: str) -> None:
    assert valid_traceparent(header) == header


@pytest.mark.parametrize(
    "header",
    [
        "00-4bf92f3577b34da6a3ce929d0e0e473ü-00f067aa0ba902b7-01",  # found in production
        "00-\uff14bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a full-width 4
        f" {TRACEPARENT} ",
        TRACEPARENT + "\n",
        TRACEPARENT.upper(),  # the spec's hex digits are lower case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # no trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # no parent id
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a version we do not know
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden by the spec
        TRACEPARENT + "-extra",  # version 00 has exactly four fields
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        "00-4bf92f3577b34da6a3ce929d0e0e4736",
        "",
        None,
        TRACEPARENT.encode(),  # not text
    ],
    ids=repr,
)
def test_anything_else_is_dropped(header: object) -> None:
    assert valid_traceparent(header) is None
