"""`charge-worker run` as a process: killed mid-charge, and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx
from nats.aio.client import Client

from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    WorkerProcess,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    set_sim,
    settings_env,
    settings_for,
)

FAST = {"gateway_timeout_s": 1.0, "lease_s": 7.0, "ack_wait_s": 2.0, "backoff_s": (2.0, 4.0)}


async def row(database_url: str, order_id: int) -> asyncpg.Record | None:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchrow(
            "SELECT status, gateway_calls, gateway_charge_id, lease_owner, scoring"
            " FROM charge_attempts"
            " WHERE order_id = $1",
            order_id,
        )
    finally:
        await conn.close()


async def test_kill_9_after_the_gateway_charged_another_worker_finishes_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url, **FAST)
    js = await provisioned(nc, settings)
    doomed = WorkerProcess(
        settings,
        tmp_path / "doomed.log",
        CHARGE_WORKER_FAILPOINTS="after_gateway_response_before_commit:exit",
    )
    spawn.append(doomed)
    await publish(js, settings.nats.subject, due(21))
    assert await doomed.exited() == -signal.SIGKILL
    assert await gateway_charges(gateway_sim.url) == {"21:2026-12-01": 1}  # charged, then died
    before = await row(database_url, 21)
    assert before is not None
    # nothing recorded the call (no write precedes one): the lease says a worker holds it
    assert (before["status"], before["gateway_calls"]) == ("pending", 0)
    assert before["lease_owner"] is not None

    survivor = WorkerProcess(settings, tmp_path / "survivor.log")
    spawn.append(survivor)

    async def recorded() -> bool:
        after = await row(database_url, 21)
        return after is not None and after["status"] == "succeeded"

    await eventually(recorded, "the survivor recorded the charge by lookup")
    survivor.proc.send_signal(signal.SIGTERM)
    assert await survivor.exited() == 0
    assert await gateway_charges(gateway_sim.url) == {"21:2026-12-01": 1}

    explained = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "charge_worker", "explain", "21", "2026-12-01", "--gateway"],
        env={**os.environ, **settings_env(settings)},
        capture_output=True,
        text=True,
        check=True,
    )
    story = explained.stdout
    (tmp_path / "explain.txt").write_text(story)
    assert "charge 21:2026-12-01: succeeded" in story
    assert "took over the expired lease of" in story
    assert "looked up first: charged" in story
    after = await row(database_url, 21)
    assert after is not None
    # the doomed worker's call, counted by the survivor that found what it made; the verdict
    # it was made under died with it, so the charge is scored after the fact
    assert (after["gateway_calls"], after["scoring"]) == (1, "deferred")
    assert story.count("succeeded") >= 2  # the ledger and the gateway agree


async def _in_flight(gateway_url: str) -> int:
    async with httpx.AsyncClient() as client:
        return int((await client.get(f"{gateway_url}/_sim/stats")).json()["in_flight"])


async def test_sigterm_finishes_in_flight_work_and_exits_0(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        gateway_timeout_s=5.0,
        drain_s=10.0,
    )
    await set_sim(gateway_sim.url, latency={"fixed_s": 1.5})
    js = await provisioned(nc, settings)
    for n in (31, 32, 33):
        await publish(js, settings.nats.subject, due(n))
    port = free_port()
    worker = WorkerProcess(settings, tmp_path / "worker.log", CHARGE_WORKER_METRICS_PORT=str(port))
    spawn.append(worker)
    await eventually(lambda: _in_flight(gateway_sim.url), "charges in flight at the gateway")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert "charge_worker_in_flight 3.0" in metrics
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exited() == 0
    for n in (31, 32, 33):
        stored = await row(database_url, n)
        assert stored is not None
        assert stored["status"] == "succeeded"
    info = await js.consumer_info(settings.nats.stream, settings.nats.durable)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


async def test_sigterm_past_the_drain_deadline_leaves_work_unacked_and_exits_0(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        gateway_timeout_s=20.0,
        lease_s=30.0,
        drain_s=0.5,
    )
    await set_sim(gateway_sim.url, latency={"fixed_s": 10.0})
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(41))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    spawn.append(worker)
    await eventually(lambda: _in_flight(gateway_sim.url), "the charge in flight")
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exited() == 0
    info = await js.consumer_info(settings.nats.stream, settings.nats.durable)
    assert info.num_ack_pending == 1  # never acked on cancel: JetStream will redeliver
    stored = await row(database_url, 41)
    assert stored is not None
    assert stored["status"] == "pending"
