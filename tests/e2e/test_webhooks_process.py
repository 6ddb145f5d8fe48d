"""`charge-worker webhooks` as a process: killed -9 right after a 2xx, and stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from charge_worker.sandbox.serve import ServedApp
from charge_worker.webhooks.signature import signed_headers
from tests.support.harness import eventually
from tests.support.webhooks import (
    SECRET,
    WebhooksProcess,
    add_row,
    event,
    journal,
    ledger,
    settled,
)


@pytest.fixture
def spawn() -> Iterator[list[WebhooksProcess]]:
    processes: list[WebhooksProcess] = []
    yield processes
    for process in processes:
        process.stop()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


async def deliver(url: str, body: dict[str, object]) -> httpx.Response:
    raw = json.dumps(body).encode()
    headers = signed_headers(SECRET, str(body["id"]), raw)
    async with httpx.AsyncClient() as client:
        return await client.post(f"{url}/webhooks/gateway", content=raw, headers=headers, timeout=5)


@pytest.mark.slow  # the dead process's lease on the event must expire first (15 s)
async def test_killed_right_after_the_2xx_the_event_is_still_applied(
    database_url: str,
    gateway_sim: ServedApp,
    db: asyncpg.Connection,
    spawn: list[WebhooksProcess],
    tmp_path: Path,
) -> None:
    await add_row(db, 1, "succeeded", charge_id="ch_1")
    doomed = WebhooksProcess(database_url, gateway_sim.url, tmp_path / "doomed.log")
    spawn.append(doomed)
    await doomed.ready()
    locker = await asyncpg.connect(database_url)
    held = locker.transaction()
    await held.start()
    try:
        # the ledger row is busy, so the event cannot be applied before the kill
        await locker.execute("SELECT 1 FROM charge_attempts WHERE order_id = 1 FOR UPDATE")
        refund = event("ch_1", "charge.refunded", revision=2)
        answer = await deliver(doomed.url, refund)
        doomed.proc.send_signal(signal.SIGKILL)
        assert answer.status_code == 200
        assert await doomed.exited() == -signal.SIGKILL
    finally:
        await held.rollback()
        await locker.close()
    [entry] = await journal(db)
    assert entry["status"] in ("received", "processing")  # journaled, not applied
    assert (await ledger(db, 1))["status"] == "succeeded"

    survivor = WebhooksProcess(database_url, gateway_sim.url, tmp_path / "survivor.log")
    spawn.append(survivor)
    await eventually(lambda: settled(db, refund["id"]), "the journaled event applied")
    assert (await ledger(db, 1))["status"] == "refunded"
    survivor.proc.send_signal(signal.SIGTERM)
    assert await survivor.exited() == 0


async def test_sigterm_stops_the_receiver_with_exit_0(
    database_url: str,
    gateway_sim: ServedApp,
    db: asyncpg.Connection,
    spawn: list[WebhooksProcess],
    tmp_path: Path,
) -> None:
    await add_row(db, 2, "succeeded", charge_id="ch_2")
    receiver = WebhooksProcess(database_url, gateway_sim.url, tmp_path / "receiver.log")
    spawn.append(receiver)
    await receiver.ready()
    refund = event("ch_2", "charge.refunded", revision=2, order_id=2)
    assert (await deliver(receiver.url, refund)).status_code == 200
    await eventually(lambda: settled(db, refund["id"]), "the event applied")
    async with httpx.AsyncClient() as client:
        scraped = (await client.get(f"{receiver.url}/metrics")).text
    assert 'charge_worker_webhook_events_total{status="applied"} 1.0' in scraped

    receiver.proc.send_signal(signal.SIGTERM)

    assert await receiver.exited() == 0
    log = receiver.log.read_text()
    assert '"event":"webhooks.stopped"' in log
    assert SECRET not in log
    assert SECRET.removeprefix("whsec_") not in log


def test_without_a_secret_the_receiver_refuses_to_start(
    database_url: str, gateway_sim: ServedApp, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARGE_WORKER_")}
    env |= {"DATABASE_URL": database_url, "GATEWAY_URL": gateway_sim.url, "GATEWAY_API_KEY": "k"}
    done = subprocess.run(
        [sys.executable, "-m", "charge_worker", "webhooks"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "CHARGE_WORKER_WEBHOOK_SECRETS is not set" in done.stderr
