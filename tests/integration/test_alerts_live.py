"""`config/alerts.yml` on a real Prometheus, scraping real workers: a redelivery storm fires
`ChargeWorkerRedeliveries`, and the alert resolves once the storm is over.

Prometheus (Debian package `prometheus`; skipped where it is missing) scrapes two workers
running in the test's loop every second and evaluates the rules every second. The rules are
the real file with one change, made programmatically on a copy: every duration is divided
by 60 (`[5m]` becomes `[5s]`, `for: 15m` becomes `for: 15s`, `offset 15m` becomes
`offset 15s`, `[1h]` becomes `[1m]`), so that five minutes of the rules' time pass in five
seconds of the test's. Thresholds are unchanged: "more than 10 redeliveries in 5 minutes"
is read as "more than 10 in 5 seconds", a harder bar.

The storm: scoring fails on every call and the policy is `hold`, so every delivery is
nak'd with a one-second delay and comes back as a redelivery (a message out of deliveries
is requeued as a fresh copy and goes round again), the way a gateway slower than AckWait
makes every message come back. Scoring recovering ends it: every charge is made once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client

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
    minutes_as_seconds,
    prometheus,
    ready,
    scraping,
)
from tests.support.prometheus import api as _api

ALERT = "ChargeWorkerRedeliveries"
CHARGES = 20
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


async def test_a_redelivery_storm_fires_the_redelivery_alert_and_its_end_resolves_it(
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
    await set_sim(scoring_sim.url, error_rate=1.0)
    async with two_workers(settings) as workers:
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

                for order_id in range(1, CHARGES + 1):
                    await publish(js, settings.nats.subject, due(order_id))
                await eventually(
                    lambda: alert_state_is(client, "firing"), f"{ALERT} firing", within_s=WAIT_S
                )
                assert sum(w.metric("charge_worker_redeliveries_total") for w in workers) > 10

                await set_sim(scoring_sim.url, error_rate=0.0)  # the storm ends
                await eventually(
                    lambda: charged_once(gateway_sim.url), "every charge made", within_s=WAIT_S
                )
                await eventually(
                    lambda: alert_state_is(client, "inactive"), f"{ALERT} resolved", within_s=WAIT_S
                )
    assert set((await gateway_charges(gateway_sim.url)).values()) == {1}


async def alert_state_is(client: httpx.AsyncClient, state: str) -> bool:
    return await alert_state(client, ALERT) == state


async def charged_once(gateway_url: str) -> bool:
    charges = await gateway_charges(gateway_url)
    return len(charges) == CHARGES and set(charges.values()) == {1}
