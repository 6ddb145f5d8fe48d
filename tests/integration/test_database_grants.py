"""The database grants of docs/deploying.md, set up exactly as written: every long-running
command works with them, and its `/readyz` fails naming the table when one is missing. The
internet-facing webhook receiver has a role of its own, holding exactly what
`privileges.WEBHOOKS` names. No role may write the outbox of outcome events: the ledger
row's triggers do, as the schema owner.

The roles come from that page's own SQL (tests/support/grants.py); the test server is the
embedded PostgreSQL, where the suite connects as a superuser.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from nats.aio.client import Client

from charge_worker import privileges
from charge_worker.errors import SettingsError
from charge_worker.migrate import migrate
from charge_worker.outcomes.outbox import Outbox
from charge_worker.ratelimit import RateLimiter
from charge_worker.retries.starts import retry_now, start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.integration.test_retry_starts import PERIOD, put_try
from tests.support.grants import PASSWORD, Roles, readme_roles, with_user
from tests.support.harness import due, eventually, provisioned, running_worker, settings_for
from tests.support.outcomes import outcomes
from tests.support.webhooks import (
    add_row,
    event,
    ledger,
    running_receiver,
    settled,
    status_of,
    webhook_settings,
)


@pytest.fixture
async def roles(pg_admin_url: str) -> AsyncIterator[Roles]:
    roles = await readme_roles(pg_admin_url, migrate)
    yield roles
    await roles.drop()


@pytest.fixture
async def owner(roles: Roles) -> AsyncIterator[asyncpg.Connection]:
    """The schema owner's connection: it writes what the billing system would."""
    conn = await asyncpg.connect(roles.owner_url)
    yield conn
    await conn.close()


async def readyz(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"{url}/readyz")


async def test_with_the_readme_grants_the_receiver_journals_and_applies_deliveries(
    roles: Roles, owner: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await add_row(owner, 1, "succeeded", charge_id="ch_1")
    refund = event("ch_1", "charge.refunded", revision=2)
    async with running_receiver(webhook_settings(roles.webhooks_url, gateway_sim.url)) as r:
        ready = await readyz(r.url)
        answer = await r.post(refund)
        await eventually(lambda: settled(owner, refund["id"]), "the refund applied")
        purged = await r.running.processor.purge()  # needs DELETE
    assert (ready.status_code, ready.text) == (200, "ready")
    assert answer.status_code == 200
    assert await status_of(owner, refund["id"]) == "applied"
    assert (await ledger(owner, 1))["status"] == "refunded"
    assert purged == 0
    # its change wrote its outcome event, though the receiver's role holds nothing on the outbox
    events = await owner.fetch(
        "SELECT type FROM charge_outcomes WHERE order_id = 1 ORDER BY sequence"
    )
    assert [e["type"] for e in events] == ["charge.succeeded", "charge.refunded"]


async def test_the_receivers_readyz_names_the_table_of_a_missing_grant(
    roles: Roles, owner: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await add_row(owner, 2, "succeeded", charge_id="ch_2")
    await roles.as_owner("REVOKE DELETE ON webhook_inbox FROM charge_webhooks")
    refund = event("ch_2", "charge.refunded", revision=2, order_id=2)
    async with running_receiver(webhook_settings(roles.webhooks_url, gateway_sim.url)) as r:
        ready = await readyz(r.url)
        assert (await r.post(refund)).status_code == 200
        # the purge fails, and the processor goes on applying events all the same
        await eventually(lambda: settled(owner, refund["id"]), "the refund applied")
    assert ready.status_code == 503
    assert ready.text == "the database role lacks DELETE on webhook_inbox"
    assert (await ledger(owner, 2))["status"] == "refunded"


@pytest.mark.parametrize(
    "grant",
    [
        "INSERT on deferred_scoring_checks",
        "DELETE on charge_outcomes",  # the relay's pruning
    ],
)
async def test_the_workers_readyz_names_the_table_of_a_missing_grant(
    grant: str,
    roles: Roles,
    nats_settings: NatsSettings,
    nc: Client,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(nats_settings, roles.worker_url, gateway_sim.url, scoring_sim.url)
    await provisioned(nc, settings)
    async with running_worker(settings) as worker:
        assert (await readyz(worker.http_url)).text == "ready"
        await roles.as_owner(f"REVOKE {grant} FROM charge_worker")
        lacking = await readyz(worker.http_url)
    assert lacking.status_code == 503
    assert lacking.text == f"the database role lacks {grant}"


async def test_with_the_readme_grants_the_relay_publishes_and_prunes_outcome_events(
    roles: Roles,
    owner: asyncpg.Connection,
    nats_settings: NatsSettings,
    nc: Client,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """The worker role takes, marks (SELECT, UPDATE) and prunes (DELETE) the outbox's rows,
    and cannot write one: the triggers do."""
    settings = settings_for(nats_settings, roles.worker_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    async with running_worker(settings) as worker:
        await js.publish(nats_settings.subject, due(5))

        async def marked() -> bool:
            return bool(await owner.fetchval("SELECT sent_at IS NOT NULL FROM charge_outcomes"))

        await eventually(marked, "the outcome event published and marked sent")
        ready = await readyz(worker.http_url)
    pool = await asyncpg.create_pool(roles.worker_url, min_size=1, max_size=1)
    try:
        pruned = await Outbox(pool, hold_s=10, retry_max_s=60).prune(retention_s=0)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await pool.execute(
                "INSERT INTO charge_outcomes (order_id, billing_period, sequence, type,"
                " subscription_id, customer_id, amount_minor, currency, review, occurred_at,"
                " next_try_at) VALUES (6, '2026-12-01', 1, 'charge.succeeded', 'sub_6',"
                " 'cus_ok', 99000, 'RUB', false, now(), now())"
            )
    finally:
        await pool.close()
    assert (ready.status_code, ready.text) == (200, "ready")
    assert [(o.subject, o.body["type"]) for o in await outcomes(js, nats_settings)] == [
        (f"{nats_settings.outcomes_subject}.succeeded", "charge.succeeded")
    ]
    assert pruned == 1
    assert await owner.fetchval("SELECT count(*) FROM charge_outcomes") == 0


async def test_the_readme_grants_give_every_command_what_it_needs(roles: Roles) -> None:
    for needs in privileges.EVERY_COMMAND:
        url = roles.webhooks_url if needs is privileges.WEBHOOKS else roles.worker_url
        conn = await asyncpg.connect(url)
        try:
            assert await privileges.missing(conn, needs) == [], needs.command
            await privileges.require(conn, needs)
        finally:
            await conn.close()


# what a role holds on the tables and sequences: (relation, privilege)
_HELD = """
SELECT c.relname AS relation, p.privilege_type AS privilege
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace,
       LATERAL aclexplode(c.relacl) p
 WHERE n.nspname = 'public' AND p.grantee = $1::regrole
"""


def named(needs: privileges.Needs) -> set[tuple[str, str]]:
    """(relation, privilege) pairs `needs` names, a serial column's as its sequence's."""
    return {
        (f"{table}_{serial}_seq", "USAGE") if serial else (table, privilege)
        for grant in needs.grants
        for table, privilege, serial in grant.requirements()
    }


async def test_the_webhooks_role_holds_exactly_what_the_receiver_uses(roles: Roles) -> None:
    """The internet-facing pods: their role can do what `webhooks` does and nothing else (no
    subscriptions, no INSERT of a charge row, no reconcile tables)."""
    conn = await asyncpg.connect(roles.superuser_url)
    try:
        held = {(r["relation"], r["privilege"]) for r in await conn.fetch(_HELD, roles.webhooks)}
        worker = {(r["relation"], r["privilege"]) for r in await conn.fetch(_HELD, roles.worker)}
    finally:
        await conn.close()
    assert held == named(privileges.WEBHOOKS)
    # and the worker role no longer holds the receiver's journal
    assert not {relation for relation, _ in worker} & {"webhook_inbox", "webhook_inbox_id_seq"}
    others = (
        privileges.RUN,
        privileges.PRODUCE,
        privileges.RETRY,
        privileges.RECONCILE,
        privileges.EXPLAIN,
    )
    assert worker == set().union(*(named(needs) for needs in others))
    assert named(privileges.RUN_VERIFYING) <= worker  # CHARGE_WORKER_VERIFY_SUBSCRIPTION=match


async def test_the_webhooks_role_may_spend_the_fleets_rate_limit_tokens(roles: Roles) -> None:
    """The receiver's gateway requests (re-fetches, lookups) take the fleet's tokens."""
    pool = await asyncpg.create_pool(roles.webhooks_url, min_size=1, max_size=1)
    try:
        await RateLimiter(pool, rate_per_s=100).spend()
    finally:
        await pool.close()


async def test_a_command_without_a_grant_fails_at_start_naming_it(roles: Roles) -> None:
    await roles.as_owner(
        "REVOKE UPDATE ON charge_attempts FROM charge_webhooks;"
        " REVOKE USAGE ON SEQUENCE charge_events_id_seq FROM charge_webhooks"
    )
    conn = await asyncpg.connect(roles.webhooks_url)
    try:
        with pytest.raises(SettingsError) as raised:
            await privileges.require(conn, privileges.WEBHOOKS)
    finally:
        await conn.close()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("DATABASE_URL: the role lacks UPDATE on charge_attempts; ")
    assert "USAGE on the sequence of charge_events.id" in message
    assert "`webhooks`" in message


async def test_before_the_migrations_the_tables_are_named_missing(empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        lacking = await privileges.missing(conn, privileges.WEBHOOKS)
    finally:
        await conn.close()
    assert lacking[0] == "table webhook_inbox (it does not exist: run charge-worker migrate)"
    # webhook_inbox, charge_attempts, deferred_scoring_checks, charge_events, rate_buckets,
    # once each
    assert len(lacking) == 5


@contextlib.asynccontextmanager
async def granted_exactly(roles: Roles, needs: privileges.Needs) -> AsyncIterator[str]:
    """The URL of a role of its own holding exactly what `needs` names, on the documented
    database: what one command may do, and nothing the worker role's other grants allow."""
    name = f"{roles.worker}_{needs.command}"
    admin = await asyncpg.connect(roles.superuser_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{PASSWORD}'")
        await admin.execute(f"GRANT CONNECT ON DATABASE {roles.database} TO {name}")
        await admin.execute(f"GRANT USAGE ON SCHEMA public TO {name}")
        for relation, privilege in named(needs):
            kind = "SEQUENCE " if relation.endswith("_seq") else ""
            await roles.as_owner(f"GRANT {privilege} ON {kind}{relation} TO {name}")
        yield with_user(roles.admin_url, name, roles.database)
    finally:
        await admin.execute(f"DROP OWNED BY {name}")
        await admin.execute(f"DROP ROLE {name}")
        await admin.close()


async def test_the_producers_grants_start_due_tries_and_retrys_start_one(
    roles: Roles, owner: asyncpg.Connection
) -> None:
    """Starting a try archives the one before (INSERT on charge_tries) and resets the row;
    from `action_required`, `retry`'s change writes its outcome event through the trigger."""
    for order_id, status in ((21, "retry_scheduled"), (22, "action_required")):
        await put_try(owner, order_id, status)
    async with granted_exactly(roles, privileges.PRODUCE) as producer_url:
        conn = await asyncpg.connect(producer_url)
        try:
            await privileges.require(conn, privileges.PRODUCE)
            starts = await start_due(conn, limit=10, cap=8)
        finally:
            await conn.close()
    async with granted_exactly(roles, privileges.RETRY) as retry_url:
        conn = await asyncpg.connect(retry_url)
        try:
            await privileges.require(conn, privileges.RETRY)
            started = await retry_now(conn, 22, PERIOD, cap=8)
        finally:
            await conn.close()
    assert (starts.started, started.try_no) == (1, 2)
    rows = await owner.fetch("SELECT status, current_try FROM charge_attempts ORDER BY order_id")
    assert [tuple(r) for r in rows] == [("scheduled", 2), ("scheduled", 2)]
    assert await owner.fetchval("SELECT count(*) FROM charge_tries") == 2
    events = await owner.fetch("SELECT type FROM charge_outcomes WHERE order_id = 22")
    assert [e["type"] for e in events] == ["charge.action_required", "charge.retry_scheduled"]
