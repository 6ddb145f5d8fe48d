"""`reconcile resolve`: a person's review of a key's findings clears their alert on the next
run, changes no money, and covers exactly what it reviewed (real PostgreSQL, nats-server and
the gateway simulator over HTTP)."""

from __future__ import annotations

import json

import asyncpg
import pytest

from charge_worker.explain import explain_command
from charge_worker.reconcile import resolve_command
from charge_worker.reconcile.report import table
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import PERIOD, settings_for

from .test_reconcile import NO_SCORING, charge_id, charge_statuses, key, ledger, put_row

NOTE = "ch_never_made: a test charge booked by hand in the ledger; finance knows (INC-42)"


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)


async def kinds(conn: asyncpg.Connection) -> list[str]:
    return [r["kind"] for r in await conn.fetch("SELECT kind FROM charge_events ORDER BY id")]


async def test_reviewed_findings_are_counted_apart_until_a_new_charge_comes(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1: the ledger's charge the gateway never made; 2: its own charge and another
    # customer's with its metadata (unmatched)
    await put_row(conn, 1, "succeeded", charge_id="ch_never_made")
    own = await charge_id(gateway_sim.url, 2)
    await put_row(conn, 2, "succeeded", charge_id=own)
    foreign = await charge_id(gateway_sim.url, 2, idempotency_key="by-hand", customer="cus_x")

    found = await run_reconcile(settings)
    assert (found.counts.discrepancies, found.counts.unmatched_charges) == (1, 1)
    assert found.reviewed == 0

    assert await resolve_command(settings, 1, PERIOD, note=NOTE, by="ann@ops", as_json=False) == 0
    assert "reviewed 1:2026-12-01 discrepancy ch_never_made by ann@ops" in capsys.readouterr().out
    assert await resolve_command(settings, 2, PERIOD, note="cus_x's", by="bo", as_json=True) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(r["finding"], r["charge_id"]) for r in printed["reviewed"]] == [("unmatched", foreign)]
    money, rows, told = (
        await charge_statuses(gateway_sim.url),
        await ledger(conn),
        await kinds(conn),
    )

    reviewed = await run_reconcile(settings)

    # the alerts' counts are 0 (and `--fail-on-discrepancy` exits 0): both counted apart
    assert (reviewed.counts.discrepancies, reviewed.counts.unmatched_charges) == (0, 0)
    assert reviewed.reviewed == 2
    assert reviewed.exit_code(fail_on_discrepancy=True) == 0
    assert reviewed.findings["discrepancies"] == reviewed.findings["unmatched_charges"] == []
    listed = {f.key: f for f in reviewed.findings["reviewed"]}
    assert listed[key(1)].detail["note"] == NOTE
    assert listed[key(1)].detail["reviewed_by"] == "ann@ops"
    assert [c.split()[0] for c in listed[key(2)].detail["charges"]] == [foreign]
    printed_table = "\n".join(table(reviewed))
    assert "reviewed" in printed_table
    assert NOTE in printed_table
    # a review changes what is reported, never the money or the ledger
    assert (reviewed.counts.refunds, reviewed.counts.ledger_repaired) == (0, 0)
    assert await charge_statuses(gateway_sim.url) == money
    assert await ledger(conn) == rows
    assert await kinds(conn) == told

    # a charge found for the key later is a new finding: it alerts again
    later = await charge_id(gateway_sim.url, 2, idempotency_key="by-hand-2", customer="cus_y")
    again = await run_reconcile(settings)
    assert (again.counts.unmatched_charges, again.reviewed) == (1, 2)
    [new] = again.findings["unmatched_charges"]
    assert [c.split()[0] for c in new.detail["charges"]] == [later]


async def test_resolve_refuses_a_key_with_nothing_to_review_and_is_idempotent(
    settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    await put_row(conn, 1, "succeeded", charge_id="ch_never_made")

    # not found by a run yet: nothing to review
    assert await resolve_command(settings, 1, PERIOD, note=NOTE, by="ann", as_json=False) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("Error: nothing to review for 1:2026-12-01:")
    assert "charge-worker explain 1 2026-12-01" in line
    assert await conn.fetchval("SELECT count(*) FROM reconcile_reviews") == 0

    await run_reconcile(settings)
    assert await resolve_command(settings, 1, PERIOD, note=NOTE, by="ann", as_json=False) == 0
    capsys.readouterr()
    assert await resolve_command(settings, 1, PERIOD, note="again", by="cy", as_json=False) == 0
    out = capsys.readouterr().out
    assert out.startswith("already reviewed 1:2026-12-01 discrepancy ch_never_made by ann at")
    assert out.rstrip().endswith(NOTE)
    assert await conn.fetchval("SELECT count(*) FROM reconcile_reviews") == 1
    assert (await kinds(conn)).count("reviewed") == 1

    # explain tells the review: who, and the note
    assert await explain_command(settings, 1, PERIOD, as_json=False, ask_gateway=False) == 0
    [told] = [line for line in capsys.readouterr().out.splitlines() if " reviewed " in line]
    assert "ann" in told
    assert f"discrepancy ch_never_made reviewed: {NOTE}" in told
