"""/healthz's rule: alive while the pull loop turns; wedged after WEDGED_AFTER_S without."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.errors
from prometheus_client import CollectorRegistry

from charge_worker.http import WEDGED_AFTER_S
from charge_worker.worker.health import Health, report_consumer_stats
from charge_worker.worker.metrics import Metrics


def health(last_tick: float) -> Health:
    nothing: Any = None  # wedged() touches neither NATS nor PostgreSQL
    return Health(last_tick=lambda: last_tick, consuming=lambda: True, nc=nothing, pool=nothing)


def test_alive_while_the_loop_turns() -> None:
    assert health(last_tick=100.0).wedged(now=100.0 + WEDGED_AFTER_S - 1) is None


def test_wedged_once_the_loop_stops_turning() -> None:
    assert health(last_tick=100.0).wedged(now=100.0 + WEDGED_AFTER_S + 1)


class _SwallowingJetStream:
    """A client call that turns the caller's cancellation into its own timeout, as
    `asyncio.wait_for` on Python 3.11 may when its future completes at the same moment."""

    def __init__(self) -> None:
        self.called = asyncio.Event()

    async def consumer_info(self, *_: object, **__: object) -> Any:
        self.called.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise nats.errors.TimeoutError from None
        raise AssertionError("unreachable")


async def test_the_consumer_stats_loop_ends_when_cancelled_whatever_a_client_swallows() -> None:
    """It once went on for ever: /healthz then never named it dead (CI, 2026-12-01)."""
    js = _SwallowingJetStream()
    nc: Any = SimpleNamespace(jetstream=lambda: js)
    cfg: Any = SimpleNamespace(stream="CHARGES", durable="workers", dlq_stream="CHARGES_DLQ")
    metrics = Metrics(CollectorRegistry())
    task = asyncio.create_task(
        report_consumer_stats(nc, cfg, metrics, asyncio.Event(), interval_s=3600)
    )
    await js.called.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)  # a bound on a hang, not a speed
    assert task in done
    assert task.cancelled()
