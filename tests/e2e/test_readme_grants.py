"""Every command, as a process, with exactly the database grants docs/deploying.md gives.

Its SQL block ("PostgreSQL roles") is run as written (tests/support/grants.py): `migrate`
as the schema owner, then `produce`, `run` (its relay publishing the outcome event),
`retry` (of a period waiting for its customer, whose try 2 `run` then claims), `webhooks`,
`reconcile`, `explain` and `dlq` as the worker role. Each must do its work; then a grant
taken away turns `/readyz` of `run` and `webhooks` to 503, naming the table.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest
from nats.aio.client import Client

from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from charge_worker.webhooks.signature import signed_headers
from tests.support.grants import readme_roles
from tests.support.harness import WorkerProcess, eventually, settings_env, settings_for
from tests.support.producer import DAY, Sub, add_subscriptions
from tests.support.webhooks import SECRET, WebhooksProcess, event, settled

pytestmark = pytest.mark.slow  # eight commands, each a Python process
EXPIRED = "cus_code_expired_card_2"  # the gateway simulator declines it: the customer must act


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


async def cli(*args: str, env: dict[str, str]) -> Result:
    """`charge-worker ARGS` in a subprocess with only `env` of our variables."""
    ours = ("CHARGE_WORKER_", "NATS_URL", "DATABASE_URL", "GATEWAY_", "SCORING_URL")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "charge_worker",
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean | env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def readyz(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"{url}/readyz")


async def answers(url: str) -> bool:
    try:
        return (await readyz(url)).status_code == 200
    except httpx.TransportError:
        return False


async def test_every_command_works_with_exactly_the_readme_grants(
    pg_admin_url: str,
    nats_settings: NatsSettings,
    nc: Client,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    tmp_path: Path,
) -> None:
    async def migrate_as_owner(url: str) -> None:
        migrated = await cli("migrate", env={"DATABASE_URL": url})
        assert migrated.returncode == 0, migrated.stderr

    roles = await readme_roles(pg_admin_url, migrate_as_owner)
    owner = await asyncpg.connect(roles.owner_url)
    port = free_port()
    settings = settings_for(
        nats_settings, roles.worker_url, gateway_sim.url, scoring_sim.url, metrics_port=port
    )
    env = settings_env(settings) | {"CHARGE_WORKER_LOG_FORMAT": "json"}
    worker = webhooks = None
    try:
        await add_subscriptions(  # the billing system's rows
            roles.owner_url, Sub("sub_1", 1), Sub("sub_2", 2, customer_id=EXPIRED)
        )

        produced = await cli("produce", "--date", DAY.isoformat(), "--json", env=env)
        assert produced.returncode == 0, produced.stderr

        worker = WorkerProcess(settings, tmp_path / "worker.log")
        worker_url = f"http://127.0.0.1:{port}"
        await eventually(lambda: answers(worker_url), "the worker ready")

        async def charged() -> bool:
            status = await owner.fetchval("SELECT status FROM charge_attempts WHERE order_id = 1")
            return status == "succeeded"

        await eventually(charged, "the due charge made by the worker")

        async def waits(try_no: int) -> bool:
            row = await owner.fetchrow(
                "SELECT status, current_try FROM charge_attempts WHERE order_id = 2"
            )
            return row is not None and tuple(row) == ("action_required", try_no)

        await eventually(lambda: waits(1), "try 1 declined: the customer must act")
        retried = await cli("retry", "2", DAY.isoformat(), "--json", env=env)
        assert retried.returncode == 0, retried.stderr
        started = json.loads(retried.stdout)
        assert (started["try"], started["published"]) == (2, True)
        await eventually(lambda: waits(2), "try 2 claimed and declined by the worker")

        async def relayed() -> bool:
            sent = await owner.fetchval(
                "SELECT sent_at IS NOT NULL FROM charge_outcomes"
                " WHERE order_id = 1 AND type = 'charge.succeeded'"
            )
            return bool(sent)

        await eventually(relayed, "the outcome event published by the worker's relay")
        charge_id = await owner.fetchval(
            "SELECT gateway_charge_id FROM charge_attempts WHERE order_id = 1"
        )

        webhooks = WebhooksProcess(roles.webhooks_url, gateway_sim.url, tmp_path / "webhooks.log")
        await webhooks.ready()
        succeeded = event(charge_id, "charge.succeeded", order_id=1)
        raw = json.dumps(succeeded).encode()
        async with httpx.AsyncClient() as client:
            delivered = await client.post(
                f"{webhooks.url}/webhooks/gateway",
                content=raw,
                headers=signed_headers(SECRET, succeeded["id"], raw),
            )
        assert delivered.status_code == 200
        await eventually(lambda: settled(owner, succeeded["id"]), "the webhook applied")

        reconciled = await cli("reconcile", "--json", env=env)
        assert reconciled.returncode == 0, reconciled.stderr
        explained = await cli("explain", "1", DAY.isoformat(), env=env)
        assert explained.returncode == 0, explained.stderr
        assert f"succeeded {charge_id}" in explained.stdout
        listed = await cli("dlq", "list", "--json", env=env)
        assert listed.returncode == 0, listed.stderr

        await roles.as_owner("REVOKE DELETE ON webhook_inbox FROM charge_webhooks")
        await roles.as_owner("REVOKE INSERT ON deferred_scoring_checks FROM charge_worker")
        receiver_ready = await readyz(webhooks.url)
        worker_ready = await readyz(worker_url)
    finally:
        if worker is not None:
            worker.kill()
        if webhooks is not None:
            webhooks.stop()
        await owner.close()
        await roles.drop()
    assert (receiver_ready.status_code, receiver_ready.text) == (
        503,
        # the receiver's own role: what is revoked from the worker's does not touch it
        "the database role lacks DELETE on webhook_inbox",
    )
    assert (worker_ready.status_code, worker_ready.text) == (
        503,
        "the database role lacks INSERT on deferred_scoring_checks",
    )
