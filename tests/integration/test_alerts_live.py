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
import json
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client

from charge_worker.sandbox.embedded import free_port
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

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "config" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus")
ALERT = "ChargeWorkerRedeliveries"
CHARGES = 20
WAIT_S = 60.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus not installed: apt-get install prometheus"
    ),
]


def minutes_as_seconds(rules: str) -> str:
    """Every PromQL and `for:` duration divided by 60: 5m -> 5s, 1h -> 1m, 1d -> 1h."""
    shorter = {"m": "s", "h": "m", "d": "h"}
    return re.sub(r"(?<![\w$.])(\d+)([mhd])\b", lambda m: m.group(1) + shorter[m.group(2)], rules)


def test_durations_are_shortened_and_nothing_else() -> None:
    assert minutes_as_seconds("sum(increase(x[5m])) > 10\nfor: 15m") == (
        "sum(increase(x[5s])) > 10\nfor: 15s"
    )
    assert minutes_as_seconds("x[1h] offset 15m, y[5m:1m], z[30s], 250ms, $5m") == (
        "x[1m] offset 15s, y[5s:1s], z[30s], 250ms, $5m"
    )
    assert minutes_as_seconds("in the last 5 minutes, 10 m") == "in the last 5 minutes, 10 m"


@contextlib.contextmanager
def prometheus(workdir: Path, targets: list[str]) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping `targets` and evaluating the shortened
    rules every second; its URL. Its log is `workdir/prometheus.log`."""
    assert PROMETHEUS is not None
    rules = workdir / "alerts.yml"
    rules.write_text(minutes_as_seconds(ALERTS.read_text()))
    config = workdir / "prometheus.yml"
    config.write_text(  # JSON is YAML
        json.dumps(
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": "charge-worker", "static_configs": [{"targets": targets}]}
                ],
            }
        )
    )
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _api(client: httpx.AsyncClient, path: str) -> Any:
    response = await client.get(path)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


async def alert_state(client: httpx.AsyncClient, name: str) -> str:
    """`firing`, `pending`, or `inactive` (a resolved alert leaves the list)."""
    alerts = (await _api(client, "/api/v1/alerts"))["alerts"]
    states = {a["state"] for a in alerts if a["labels"]["alertname"] == name}
    return "firing" if "firing" in states else ("pending" if states else "inactive")


async def ready(client: httpx.AsyncClient) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return (await client.get("/-/ready")).status_code == 200
    return False


async def scraping(client: httpx.AsyncClient, count: int) -> bool:
    targets = (await _api(client, "/api/v1/targets"))["activeTargets"]
    return sum(t["health"] == "up" for t in targets) == count


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
