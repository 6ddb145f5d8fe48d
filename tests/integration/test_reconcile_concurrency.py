"""Reconcile works on several keys at once, each on a ledger connection of its own, while
its advisory lock stays on the run's one connection (real PostgreSQL and gateway simulator).
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.reconcile.run import LOCK_KEY, run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import eventually, provisioned, settings_for

from .test_reconcile import NO_SCORING, charge_id, key, ledger, put_row

APP = "charge-worker reconcile"


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)


async def sessions(database_url: str) -> dict[str, int]:
    """Reconcile's sessions now: waiting on a row lock, and holding its advisory lock."""
    watcher = await asyncpg.connect(database_url)
    try:
        row = await watcher.fetchrow(
            """
            SELECT count(*) FILTER (WHERE a.wait_event_type = 'Lock') AS waiting,
                   count(*) FILTER (WHERE EXISTS (
                       SELECT 1 FROM pg_locks AS l
                        WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                          AND l.objid = $2)) AS locking,
                   count(*) AS open
              FROM pg_stat_activity AS a
             WHERE a.datname = current_database() AND a.application_name = $1
            """,
            APP,
            LOCK_KEY & 0xFFFFFFFF,
        )
    finally:
        await watcher.close()
    assert row is not None
    return dict(row)


async def test_the_keys_of_a_page_are_worked_on_at_once_each_on_its_own_connection(
    settings: Settings, database_url: str, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Nothing in reconcile ran concurrently: one key's write waited for the one before.
    Three keys whose rows a transaction holds now wait together, on three connections,
    none of them the one holding the run's lock."""
    made = {}
    for order_id in (1, 2, 3):  # paid, while the ledger says declined
        made[order_id] = await charge_id(gateway_sim.url, order_id)
        await put_row(conn, order_id, "declined", gateway_calls=1)
    holder = conn.transaction()
    await holder.start()
    await conn.execute("SELECT 1 FROM charge_attempts FOR UPDATE")
    running = asyncio.create_task(run_reconcile(settings))

    async def three_wait() -> bool:
        now = await sessions(database_url)
        return running.done() or (now["waiting"] == 3 and now["locking"] == 1)

    await eventually(three_wait, "three keys waiting at once")
    assert not running.done()
    await holder.rollback()
    report = await running

    assert [f.key for f in report.findings["unrecorded_charges"]] == [key(1), key(2), key(3)]
    assert report.counts.ledger_repaired == 3
    assert await ledger(conn) == {n: ("succeeded", made[n]) for n in (1, 2, 3)}


async def test_quiet_rows_are_republished_several_at_once(
    nc: Client, settings: Settings, database_url: str, conn: asyncpg.Connection
) -> None:
    """The lost-messages sweep looked up and re-published one row at a time."""
    await provisioned(nc, settings)
    for order_id in (1, 2, 3):
        await put_row(conn, order_id, "pending", gateway_calls=1, lease_s=-60.0)
    holder = conn.transaction()
    await holder.start()
    await conn.execute("SELECT 1 FROM charge_attempts FOR UPDATE")
    running = asyncio.create_task(run_reconcile(settings))

    async def three_wait() -> bool:
        return running.done() or (await sessions(database_url))["waiting"] == 3

    await eventually(three_wait, "three quiet rows worked on at once")
    assert not running.done()
    await holder.rollback()
    report = await running

    assert [f.key for f in report.findings["lost_messages"]] == [key(1), key(2), key(3)]
    assert report.counts.republished == 3


@pytest.mark.parametrize("rate_limit", [0.0, 1000.0])
async def test_more_keys_than_connections_never_wait_on_each_other(
    nats_settings: NatsSettings,
    database_url: str,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    rate_limit: float,
) -> None:
    """Each key worked on holds a connection of the pool while the gateway is asked; asking
    (the customer to ask for, a token of the fleet's rate) must not take a second one, or
    as many keys as connections wait for ever (a failover's hundreds of forgotten keys hung
    every run until the CronJob's deadline)."""
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        NO_SCORING,
        db_pool_max=2,
        gateway_rate_limit=rate_limit,
    )
    made = {}
    for order_id in (1, 2, 3, 4, 5):  # paid, while the ledger says declined
        made[order_id] = await charge_id(gateway_sim.url, order_id)
        await put_row(conn, order_id, "declined", gateway_calls=1)

    report = await asyncio.wait_for(run_reconcile(settings), 60)

    assert report.counts.ledger_repaired == 5
    assert await ledger(conn) == {n: ("succeeded", made[n]) for n in made}
