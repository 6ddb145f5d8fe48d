"""`charge-worker reconcile resolve` as the on-call types it, next to the plain `reconcile`
the CronJob runs: real servers, its output, exit codes."""

from __future__ import annotations

import json

import asyncpg
import pytest

from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import settings_env, settings_for

from .test_reconcile_cli import PERIOD, charges, reconcile, succeeded_row

NO_SCORING = "http://127.0.0.1:9"  # reconcile never scores


@pytest.fixture
def env(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> dict[str, str]:
    return settings_env(settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING))


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
