"""/healthz's rule: alive while the pull loop turns; wedged after WEDGED_AFTER_S without."""

from __future__ import annotations

from typing import Any

from charge_worker.http import WEDGED_AFTER_S
from charge_worker.worker.health import Health


def health(last_tick: float) -> Health:
    nothing: Any = None  # wedged() touches neither NATS nor PostgreSQL
    return Health(last_tick=lambda: last_tick, consuming=lambda: True, nc=nothing, pool=nothing)


def test_alive_while_the_loop_turns() -> None:
    assert health(last_tick=100.0).wedged(now=100.0 + WEDGED_AFTER_S - 1) is None


def test_wedged_once_the_loop_stops_turning() -> None:
    assert health(last_tick=100.0).wedged(now=100.0 + WEDGED_AFTER_S + 1)
