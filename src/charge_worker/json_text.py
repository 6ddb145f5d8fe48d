"""JSON text for the hot path: orjson, and the standard library for what orjson refuses.

Two values are encoded per charge (the `delivery` event's detail and the canonical log
line); orjson encodes each in about a tenth of `json`'s time. It refuses an integer beyond
64 bits, a key that is not a string and a lone surrogate, where `json` writes them (the
value may come from a message, and a line must never be lost for it): those go to `json`,
with the same compact separators. orjson writes a datetime as RFC 3339 and a dataclass or
an enum by value, without asking `default`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import orjson


def dumps(obj: Any, default: Callable[[Any], Any] = str) -> str:
    """`obj` as compact JSON text; `default` turns what neither encoder knows into a value."""
    try:
        return orjson.dumps(obj, default=default).decode()
    except TypeError:  # orjson.JSONEncodeError is one
        return _encoder(default).encode(obj)


@functools.cache
def _encoder(default: Callable[[Any], Any]) -> json.JSONEncoder:
    return json.JSONEncoder(default=default, separators=(",", ":"))
