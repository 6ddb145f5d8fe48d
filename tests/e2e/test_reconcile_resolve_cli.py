"""`charge-worker reconcile resolve` as the on-call types it, next to the plain `reconcile`
the CronJob runs: real servers, its output, exit codes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings

from .test_reconcile_cli import API_KEY, PERIOD, charges, reconcile, succeeded_row


@pytest.fixture
def env(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> dict[str, str]:
    return {
        "NATS_URL": str(nats_settings.url),
        "CHARGE_WORKER_STREAM": nats_settings.stream,
        "CHARGE_WORKER_SUBJECT": nats_settings.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats_settings.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats_settings.dlq_subject,
        "DATABASE_URL": database_url,
        "GATEWAY_URL": gateway_sim.url,
        "GATEWAY_API_KEY": API_KEY,
    }


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    yield connection
    await connection.close()


async def test_a_resolved_discrepancy_no_longer_fails_the_run_and_plain_reconcile_still_runs(
    env: dict[str, str], conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await succeeded_row(conn, 7, "ch_never_made")
    note = "booked by hand in a test; finance agreed"

    nothing = await reconcile("resolve", "7", PERIOD, "--note", note, env=env)
    assert nothing.returncode == 1
    [line] = nothing.stderr.strip().splitlines()
    assert line.startswith(f"Error: nothing to review for 7:{PERIOD}:")

    found = await reconcile("--fail-on-discrepancy", env=env)  # the plain run, as before
    assert found.returncode == 4, found.stderr
    assert "ch_never_made" in found.stdout
    no_note = await reconcile("resolve", "7", PERIOD, env=env)
    assert no_note.returncode == 2
    assert "--note" in no_note.stderr

    resolved = await reconcile("resolve", "7", PERIOD, "--note", note, "--by", "ann@ops", env=env)
    assert resolved.returncode == 0, resolved.stderr
    assert f"reviewed 7:{PERIOD} discrepancy ch_never_made by ann@ops: {note}" in resolved.stdout
    again = await reconcile("resolve", "7", PERIOD, "--note", "twice", env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"already reviewed 7:{PERIOD} discrepancy ch_never_made")

    after = await reconcile("--fail-on-discrepancy", "--json", env=env)
    assert after.returncode == 0, after.stderr
    report = json.loads(after.stdout)
    assert (report["counts"]["discrepancies"], report["counts"]["unmatched_charges"]) == (0, 0)
    [item] = report["reviewed"]
    assert (item["order_id"], item["charges"], item["note"]) == (7, ["ch_never_made"], note)
    assert (item["action"], item["reviewed_by"]) == ("discrepancy, reviewed", "ann@ops")
    assert await charges(gateway_sim.url) == {}  # nothing charged, nothing refunded
