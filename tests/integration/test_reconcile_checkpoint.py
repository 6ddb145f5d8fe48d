"""Reconcile costs what happened since its last run: the checkpoint, the follow-ups, and
the ledger rows the gateway's history has shown (real PostgreSQL, the gateway simulator
over HTTP).

The gateway's `created` is in whole seconds, so these tests run with no overlap and wait
for the clock's next second where a charge must fall before a checkpoint.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import asyncpg
import pytest

from charge_worker.reconcile import checkpoint as checkpoints
from charge_worker.reconcile.discrepancies import UNSEEN
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import PERIOD, eventually, set_sim, settings_for

from .test_reconcile import (
    NO_SCORING,
    _waiting_on_the_row,
    charge_id,
    key,
    ledger,
    put_row,
    refund_at,
    sim,
)


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(
        nats_settings, database_url, gateway_sim.url, NO_SCORING, reconcile_overlap_s=0.0
    )


async def next_second() -> None:
    """Until the wall clock's second moves on: the unit of the gateway's `created`."""
    now = int(time.time())
    await eventually(lambda: int(time.time()) > now, "the next second")


async def gateway_reads(gateway_url: str) -> int:
    """`GET /v1/charges` requests the simulator answered: history pages and lookups."""
    return int((await sim(gateway_url, "/_sim/stats"))["by_endpoint"].get("GET /v1/charges", 0))


async def checkpoint(conn: asyncpg.Connection) -> dt.datetime | None:
    value: dt.datetime | None = await conn.fetchval(
        "SELECT reconciled_until FROM reconcile_checkpoint WHERE source = 'gateway'"
    )
    return value


async def recorded(conn: asyncpg.Connection, gateway_url: str, *orders: int) -> list[str]:
    """A charge at the gateway and its `succeeded` row, per order."""
    made = []
    for order_id in orders:
        made.append(await charge_id(gateway_url, order_id))
        await put_row(conn, order_id, "succeeded", charge_id=made[-1])
    return made


async def test_a_run_reads_only_the_history_since_the_last_one(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The issue: every run re-read the whole 48 h window. The second run pages from the
    first one's checkpoint, so it reads the 3 new charges, not the 150 before them."""
    await recorded(conn, gateway_sim.url, *range(100, 250))
    await next_second()

    first = await run_reconcile(settings)

    assert (first.mode, first.pages, first.charges_seen) == ("window", 2, 150)
    assert first.checkpoint == first.until
    assert await checkpoint(conn) == first.until
    await recorded(conn, gateway_sim.url, 1, 2, 3)
    before = await gateway_reads(gateway_sim.url)

    second = await run_reconcile(settings)

    assert (second.mode, second.since) == ("incremental", first.until)
    assert (second.pages, second.charges_seen) == (1, 3)
    assert (second.candidates, second.lookups) == (0, 0)
    assert await gateway_reads(gateway_sim.url) - before == 1
    assert await checkpoint(conn) == second.until


async def test_a_dry_run_uses_the_checkpoint_and_never_moves_it(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await recorded(conn, gateway_sim.url, 1)

    dry = await run_reconcile(settings, dry_run=True)

    assert (dry.mode, dry.checkpoint) == ("window", None)
    assert await checkpoint(conn) is None
    real = await run_reconcile(settings)
    assert real.mode == "window"
    again = await run_reconcile(settings, dry_run=True)
    assert (again.mode, again.since, again.checkpoint) == ("incremental", real.until, None)
    assert await checkpoint(conn) == real.until


async def test_full_pages_the_whole_window_and_since_stores_only_what_it_covered(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """`--full`, the daily safety net, reads the window whatever the checkpoint says; a
    `--since` later than the checkpoint leaves it where it was (the gap is not read)."""
    await recorded(conn, gateway_sim.url, *range(100, 250))
    await next_second()
    first = await run_reconcile(settings)

    full = await run_reconcile(settings, full=True)

    assert (full.mode, full.pages, full.charges_seen) == ("full", 2, 150)
    assert full.since == full.started_at - dt.timedelta(
        seconds=settings.reconcile.reconcile_window_s
    )
    assert await checkpoint(conn) == full.until
    later = await run_reconcile(settings, since=full.until + dt.timedelta(seconds=1))
    assert (later.mode, later.checkpoint) == ("since", None)
    assert await checkpoint(conn) == full.until
    assert first.until < full.until


async def test_a_key_that_failed_is_looked_at_again_by_the_next_runs_until_it_is_settled(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The history a run has read is behind the next run's checkpoint: a key it could not
    handle waits in its follow-ups, not in the history."""
    made = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "declined", gateway_calls=1)
    await put_row(conn, 9, "succeeded", charge_id=made)  # a corrupt ledger: 1 cannot record it
    await next_second()

    first = await run_reconcile(settings)
    assert [(f.sweep, f.key) for f in first.failures] == [("unrecorded_charges", key(1))]
    await next_second()

    second = await run_reconcile(settings)
    assert second.charges_seen == 0
    assert (second.candidates, second.followups) == (1, 1)
    assert [(f.sweep, f.key) for f in second.failures] == [("unrecorded_charges", key(1))]

    await conn.execute("DELETE FROM charge_attempts WHERE order_id = 9")
    third = await run_reconcile(settings)
    assert [f.key for f in third.findings["unrecorded_charges"]] == [key(1)]
    assert not third.failures
    assert (await ledger(conn))[1] == ("succeeded", made)
    assert await conn.fetchval("SELECT count(*) FROM reconcile_followups") == 0
    fourth = await run_reconcile(settings)
    assert (fourth.candidates, fourth.followups, fourth.lookups) == (0, 0, 0)


async def test_charges_left_for_a_person_stay_reported_after_their_page(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The unmatched-charges gauge must not drop to 0 because the checkpoint moved on:
    until someone refunds them (or they leave the window) every run reports them again."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    strangers = [
        await charge_id(gateway_sim.url, 2, idempotency_key=f"by-hand-{n}") for n in (1, 2)
    ]
    await next_second()
    first = await run_reconcile(settings)
    assert first.counts.unmatched_charges == 2
    await next_second()

    second = await run_reconcile(settings)

    assert second.charges_seen == 0
    assert second.counts.unmatched_charges == 2
    await refund_at(gateway_sim.url, strangers[0])  # a person handled one
    third = await run_reconcile(settings)
    assert [f.detail["charges"] for f in third.findings["unmatched_charges"]] == [
        [f"{strangers[1]} 99000 RUB cus_ok"]
    ]
    await refund_at(gateway_sim.url, strangers[1])
    fourth = await run_reconcile(settings)
    assert fourth.counts.unmatched_charges == 0
    assert await conn.fetchval("SELECT count(*) FROM reconcile_followups") == 0
    assert fourth.counts.refunds == third.counts.refunds == 0


async def test_rows_the_history_showed_are_not_looked_up_again(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A `succeeded` row is checked against the gateway once: its charge on a history page
    (or a lookup) marks it. Only a row the gateway still does not show is looked up again."""
    shown = await recorded(conn, gateway_sim.url, 1, 2)
    await put_row(conn, 3, "succeeded", charge_id="ch_never_made")
    await next_second()

    first = await run_reconcile(settings)

    assert [f.key for f in first.findings["discrepancies"]] == [key(3)]
    assert first.lookups == 1
    seen = await conn.fetch(
        "SELECT order_id, gateway_seen_charge_id FROM charge_attempts ORDER BY order_id"
    )
    assert [tuple(r.values()) for r in seen] == [(1, shown[0]), (2, shown[1]), (3, None)]
    await next_second()
    second = await run_reconcile(settings)
    assert [f.key for f in second.findings["discrepancies"]] == [key(3)]
    assert (second.charges_seen, second.lookups) == (0, 1)


async def test_a_row_settled_after_its_page_was_read_is_confirmed_once_by_lookup(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The worker recorded the charge after reconcile read its page: the next run, past
    that page, confirms it by the key's lookup, then never again."""
    made = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=3600.0)
    await next_second()
    first = await run_reconcile(settings)
    assert first.candidates == 1  # a charge the pending row does not record yet
    await conn.execute(
        "UPDATE charge_attempts SET status = 'succeeded', gateway_charge_id = $1,"
        " lease_owner = NULL, lease_until = NULL, settled_at = now()",
        made,
    )
    await next_second()

    second = await run_reconcile(settings)
    third = await run_reconcile(settings)

    assert second.counts.discrepancies == 0
    assert second.lookups == 1  # its follow-up (the row was open) confirms it too
    assert await conn.fetchval("SELECT gateway_seen_charge_id FROM charge_attempts") == made
    assert (third.lookups, third.candidates) == (0, 0)


async def test_the_discrepancy_sweep_reads_its_partial_index_not_the_ledger(
    conn: asyncpg.Connection,
) -> None:
    """154 ms at 1M rows with no match: the sweep's filter had no index."""
    await conn.execute("SET enable_seqscan = off")
    since = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    plan = "\n".join(
        r[0]
        for r in await conn.fetch(
            f"EXPLAIN {UNSEEN}", since, dt.datetime.now(dt.UTC), since, 0, PERIOD, 1000
        )
    )
    assert "charge_attempts_unseen_idx" in plan, plan


async def test_a_charge_a_worker_has_not_recorded_yet_waits_for_the_next_run_unlooked_up(
    nats_settings: NatsSettings, database_url: str, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """At month start every run ends on charges whose workers have not recorded them yet.
    Inside the overlap the next run reads them again anyway: no lookup for them now."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)
    made = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=3600.0)

    first = await run_reconcile(settings)

    assert (first.charges_seen, first.candidates, first.lookups) == (1, 0, 0)
    assert await conn.fetchval("SELECT count(*) FROM reconcile_followups") == 0
    await conn.execute(
        "UPDATE charge_attempts SET status = 'succeeded', gateway_charge_id = $1,"
        " lease_owner = NULL, lease_until = NULL, settled_at = now()",
        made,
    )
    second = await run_reconcile(settings)
    assert (second.charges_seen, second.candidates, second.lookups) == (1, 0, 0)
    assert await conn.fetchval("SELECT gateway_seen_charge_id FROM charge_attempts") == made


async def test_a_run_stopped_partway_is_taken_on_by_the_next_from_where_it_got(
    settings: Settings, database_url: str, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The first run reads the whole window: at a million charges and a slow gateway it
    outlives the CronJob's deadline. Stopped there, it has stored how far it got, so the
    next run goes on from that page instead of starting the window over, for ever."""
    await recorded(conn, gateway_sim.url, *range(100, 150))  # page 1, over two seconds
    await next_second()
    await recorded(conn, gateway_sim.url, *range(150, 200))
    await next_second()
    await charge_id(gateway_sim.url, 1)  # page 2: paid, while the ledger says declined
    await put_row(conn, 1, "declined", gateway_calls=1)
    made = (await sim(gateway_sim.url, "/_sim/charges"))["data"]
    newest_on_page_1 = max(c["created"] for c in made if int(c["metadata"]["order_id"]) >= 100)
    from_there = sum(1 for c in made if c["created"] >= newest_on_page_1)  # page 2, and some
    holder = conn.transaction()
    await holder.start()
    await conn.execute("SELECT 1 FROM charge_attempts WHERE order_id = 1 FOR UPDATE")
    stopped = asyncio.create_task(run_reconcile(settings, progress_pages=1))
    await eventually(
        lambda: stopped.done() or _waiting_on_the_row(database_url), "the run at page 2"
    )
    assert not stopped.done()

    assert await checkpoint(conn) == dt.datetime.fromtimestamp(newest_on_page_1, dt.UTC)
    stopped.cancel()  # its deadline
    with pytest.raises(asyncio.CancelledError):
        await stopped
    await holder.rollback()
    next_run = await run_reconcile(settings)

    assert next_run.mode == "incremental"
    assert next_run.since == dt.datetime.fromtimestamp(newest_on_page_1, dt.UTC)
    assert (next_run.pages, next_run.charges_seen) == (1, from_there)
    assert from_there <= 51  # page 2, and page 1's last second again: not the window
    assert [f.key for f in next_run.findings["unrecorded_charges"]] == [key(1)]


async def test_a_checkpoint_is_never_stored_beyond_the_database_s_clock(
    conn: asyncpg.Connection,
) -> None:
    """A pod whose clock runs an hour ahead reads `until` an hour in the future: stored as
    is, the next run would start from there and skip the hour of history created in
    between. The checkpoint is the database's clock, whatever reading it is given."""
    ahead = await conn.fetchval("SELECT now() + interval '1 hour'")

    await checkpoints.store(conn, ahead)

    stored = await checkpoint(conn)
    assert stored is not None
    assert stored <= await conn.fetchval("SELECT now()")


async def test_a_run_reads_its_clock_from_the_database(
    settings: Settings, conn: asyncpg.Connection
) -> None:
    """The run's `until` (and so the checkpoint it stores) lies between the database's
    clock before the run and after it."""
    before = await conn.fetchval("SELECT now()")
    report = await run_reconcile(settings)
    after = await conn.fetchval("SELECT now()")

    assert report.until is not None
    assert before <= report.until <= after
    assert await checkpoint(conn) == report.until
