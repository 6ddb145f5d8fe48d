"""`config/alerts.yml` on a real Prometheus, scraping real workers: a storm of redeliveries
the workers asked for (naks with a delay) leaves `ChargeWorkerRedeliveries` quiet, a storm of
redeliveries nobody asked for (a worker died holding messages) fires it, and the alert
resolves once that storm is over.

Prometheus (Debian package `prometheus`; skipped where it is missing) scrapes two workers
running in the test's loop every second and evaluates the rules every second. The rules are
the real file with one change, made programmatically on a copy: every duration is divided
by 60 (`[5m]` becomes `[5s]`, `for: 15m` becomes `for: 15s`, `offset 15m` becomes
`offset 15s`, `[1h]` becomes `[1m]`), so that five minutes of the rules' time pass in five
seconds of the test's. Thresholds are unchanged: "more than 10 redeliveries in 5 minutes"
is read as "more than 10 in 5 seconds", a harder bar.

The nak storm: scoring fails on every call and the policy is `hold`, so every delivery is
nak'd with a one-second delay and comes back as a redelivery counted `cause="nak"` (a
message out of deliveries is requeued as a fresh copy and goes round again), as in a
gateway brownout. It is well over the threshold (what the rule summed before causes were
told apart), and the alert stays inactive through rule evaluations that saw it. Scoring
recovering ends it.

The unacked storm: before the workers start, a consumer of the same durable fetches a batch
of charges and keeps them in progress (`+WPI`), as a worker charging them would; then it
dies without a word. AckWait later JetStream redelivers every one to the workers, counted
`cause="unacked"`: the alert fires, and resolves once they are charged. Every charge is
made once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    RunningWorker,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
)
from tests.support.prometheus import (
    ALERTS,
    PROMETHEUS,
    alert_state,
    evaluated_after,
    minutes_as_seconds,
    prometheus,
    ready,
    scraping,
    value,
)
from tests.support.prometheus import api as _api

ALERT = "ChargeWorkerRedeliveries"
CHARGES = 20  # nak'd in the nak storm
HELD = 20  # held by the consumer that dies: the unacked storm
NAK_STORM = 'sum(increase(charge_worker_redeliveries_total{cause="nak"}[5s]))'
WAIT_S = 60.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus not installed: apt-get install prometheus"
    ),
]


def test_durations_are_shortened_and_nothing_else() -> None:
    assert minutes_as_seconds("sum(increase(x[5m])) > 10\nfor: 15m") == (
        "sum(increase(x[5s])) > 10\nfor: 15s"
    )
    assert minutes_as_seconds("x[1h] offset 15m, y[5m:1m], z[30s], 250ms, $5m") == (
        "x[1m] offset 15s, y[5s:1s], z[30s], 250ms, $5m"
    )
    assert minutes_as_seconds("in the last 5 minutes, 10 m") == "in the last 5 minutes, 10 m"


@contextlib.asynccontextmanager
async def two_workers(settings: Settings) -> AsyncIterator[list[RunningWorker]]:
    async with running_worker(settings) as first, running_worker(settings) as second:
        yield [first, second]


async def test_a_nak_storm_stays_quiet_and_an_unacked_storm_fires_and_resolves(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    tmp_path: Path,
) -> None:
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        scoring_policy="hold",
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        max_deliver=3,
        heartbeat_s=0.3,
        scoring_breaker_failures=1_000_000,  # every call reaches the failing simulator
    )
    js = await provisioned(nc, settings)
    for order_id in range(CHARGES + 1, CHARGES + HELD + 1):
        await publish(js, settings.nats.subject, due(order_id))
    async with held(js, settings, HELD) as die, two_workers(settings) as workers:
        targets = [w.http_url.removeprefix("http://") for w in workers]
        with prometheus(tmp_path, targets) as url:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                await eventually(lambda: ready(client), "Prometheus ready", within_s=WAIT_S)
                await eventually(lambda: scraping(client, 2), "both workers scraped")
                groups = (await _api(client, "/api/v1/rules"))["groups"]
                loaded = [r for g in groups for r in g["rules"]]
                assert len(loaded) == ALERTS.read_text().count("- alert:")
                assert all(r["health"] != "err" for r in loaded), loaded
                assert await alert_state(client, ALERT) == "inactive"

                # the nak storm: over the threshold, asked for, quiet
                await set_sim(scoring_sim.url, error_rate=1.0)
                for order_id in range(1, CHARGES + 1):
                    await publish(js, settings.nats.subject, due(order_id))
                await eventually(
                    lambda: over_threshold(client, NAK_STORM), "a nak storm", within_s=WAIT_S
                )
                seen = time.time()
                await eventually(lambda: evaluated_after(client, seen), "rules evaluated")
                assert await alert_state(client, ALERT) == "inactive"
                # nor pending or firing at any evaluation so far (`ALERTS` keeps each)
                assert (
                    await value(client, f'count_over_time(ALERTS{{alertname="{ALERT}"}}[5m])') == 0
                )
                await set_sim(scoring_sim.url, error_rate=0.0)  # the nak storm ends
                await eventually(lambda: charged_once(gateway_sim.url, CHARGES), "naks charged")

                # the unacked storm: the holder dies, its messages come back unasked
                die.set()
                await eventually(
                    lambda: alert_state_is(client, "firing"), f"{ALERT} firing", within_s=WAIT_S
                )
                unacked = sum(
                    w.metric("charge_worker_redeliveries_total", cause="unacked") for w in workers
                )
                assert unacked > 10
                await eventually(
                    lambda: charged_once(gateway_sim.url, CHARGES + HELD),
                    "every charge made",
                    within_s=WAIT_S,
                )
                await eventually(
                    lambda: alert_state_is(client, "inactive"), f"{ALERT} resolved", within_s=WAIT_S
                )
    assert set((await gateway_charges(gateway_sim.url)).values()) == {1}


@contextlib.asynccontextmanager
async def held(
    js: JetStreamContext, settings: Settings, count: int
) -> AsyncIterator[asyncio.Event]:
    """A consumer of the workers' durable that fetches `count` messages and keeps them in
    progress until the event it yields is set; then it dies: no ack, no nak."""
    sub = await js.pull_subscribe_bind(durable=settings.nats.durable, stream=settings.nats.stream)
    msgs: list[Msg] = []
    while len(msgs) < count:
        msgs += await sub.fetch(count - len(msgs), timeout=5)
    die = asyncio.Event()

    async def beat() -> None:
        while not die.is_set():
            for msg in msgs:
                await msg.in_progress()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(die.wait(), settings.heartbeat_s)

    task = asyncio.create_task(beat())
    try:
        yield die
    finally:
        die.set()
        await task
        await sub.unsubscribe()


async def over_threshold(client: httpx.AsyncClient, query: str) -> bool:
    return await value(client, query) > 10


async def alert_state_is(client: httpx.AsyncClient, state: str) -> bool:
    return await alert_state(client, ALERT) == state


async def charged_once(gateway_url: str, count: int) -> bool:
    charges = await gateway_charges(gateway_url)
    return len(charges) == count and set(charges.values()) == {1}
