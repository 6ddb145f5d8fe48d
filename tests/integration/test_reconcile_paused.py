"""Reconcile while the kill switch is on (`charge-worker pause`): it finds what it finds and
changes nothing, as a dry run does (no refund, no re-publish, no repair, no checkpoint),
and says why; the first run after `resume` does the work. A run that cannot tell whether
charging is paused (NATS down) moves no money either."""

from __future__ import annotations

import datetime as dt
import json

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.admin.pause import pause, resume
from charge_worker.errors import DependencyUnavailable
from charge_worker.reconcile import reconcile_command
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.integration.test_reconcile import (
    charge_id,
    charge_statuses,
    ledger,
    put_row,
    set_sim,
)
from tests.support.harness import provisioned, settings_for

NO_SCORING = "http://127.0.0.1:9"  # reconcile never scores


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)


async def test_a_paused_reconcile_finds_and_changes_nothing_and_after_resume_it_repairs(
    nc: Client,
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = await provisioned(nc, settings)
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    earliest = await charge_id(gateway_sim.url, 1)
    later = await charge_id(gateway_sim.url, 1)  # a double charge
    await put_row(conn, 1, "succeeded", charge_id=earliest)
    await put_row(conn, 2, "scheduled")  # its message lost: re-published by a real run
    messages = (await js.stream_info(settings.nats.stream)).state.messages
    now = dt.datetime.now(dt.UTC)
    await pause(js, settings.nats, reason="gateway incident", by="on-call", now=now)

    code = await reconcile_command(
        settings,
        since=None,
        dry_run=False,
        as_json=True,
        fail_on_discrepancy=False,
        metrics_file=None,
        full=True,
    )

    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert "is paused" in printed["held"]
    assert "gateway incident" in printed["held"]
    assert (printed["counts"]["double_charges"], printed["counts"]["refunds"]) == (1, 0)
    assert printed["counts"]["republished"] == 0
    assert printed["checkpoint"] is None
    assert await charge_statuses(gateway_sim.url) == {earliest: "succeeded", later: "succeeded"}
    assert (await js.stream_info(settings.nats.stream)).state.messages == messages
    assert await ledger(conn) == {1: ("succeeded", earliest), 2: ("scheduled", None)}
    assert await conn.fetchval("SELECT count(*) FROM reconcile_checkpoint") == 0
    summary = json.loads(await conn.fetchval("SELECT summary FROM job_runs"))
    assert (summary["held"], summary["double_charges"]) == (True, 1)  # the findings, exported

    await resume(js, settings.nats)
    report = await run_reconcile(settings, full=True)

    assert report.held is None
    assert (report.counts.refunds, report.counts.republished) == (1, 1)
    assert await charge_statuses(gateway_sim.url) == {earliest: "succeeded", later: "refunded"}
    assert (await js.stream_info(settings.nats.stream)).state.messages == messages + 1


async def test_a_run_that_cannot_tell_whether_charging_is_paused_moves_no_money(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """NATS down: the run ends early before its first repair (it used to refund the double
    it found in the history, then fail at the lost messages' sweep)."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    earliest = await charge_id(gateway_sim.url, 1)
    later = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "succeeded", charge_id=earliest)
    down = settings.nats.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})

    with pytest.raises(DependencyUnavailable, match="cannot connect to NATS"):
        await run_reconcile(settings.model_copy(update={"nats": down}), full=True)

    assert await charge_statuses(gateway_sim.url) == {earliest: "succeeded", later: "succeeded"}
