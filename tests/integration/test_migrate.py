"""Migrations against a real PostgreSQL: empty database, concurrent runs, edited files."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from charge_worker.errors import MigrationError
from charge_worker.migrate import default_directory, discover, migrate

STATUSES = {"scheduled", "pending", "succeeded", "declined", "blocked", "failed", "refunded"}


async def test_applies_every_migration_to_an_empty_database(empty_database_url: str) -> None:
    applied = await migrate(empty_database_url)
    assert [m.version for m in applied] == [m.version for m in discover(default_directory())]
    conn = await asyncpg.connect(empty_database_url)
    try:
        tables = {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables")}
        assert {
            "charge_attempts",
            "deferred_scoring_checks",
            "subscriptions",
            "schema_migrations",
        } <= tables
        columns = {
            r["column_name"]
            for r in await conn.fetch(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name = 'charge_attempts'"
            )
        }
        assert {
            "order_id",
            "billing_period",
            "idempotency_key",
            "fingerprint",
            "status",
            "gateway_charge_id",
            "gateway_calls",
            "last_error",
            "scoring",
            "lease_owner",
            "lease_until",
            "attempt",
            "created_at",
            "updated_at",
        } <= columns
    finally:
        await conn.close()
    assert await migrate(empty_database_url) == []  # a second run applies nothing


async def _insert(conn: asyncpg.Connection, **overrides: object) -> None:
    row: dict[str, object] = {
        "order_id": 1,
        "billing_period": dt.date(2026, 9, 1),
        "idempotency_key": "1:2026-09-01",
        "subscription_id": "sub_1",
        "customer_id": "cus_1",
        "amount_minor": 99000,
        "currency": "RUB",
        "status": "pending",
    }
    row.update(overrides)
    names = ", ".join(row)
    params = ", ".join(f"${i}" for i in range(1, len(row) + 1))
    await conn.execute(f"INSERT INTO charge_attempts ({names}) VALUES ({params})", *row.values())


@pytest.mark.parametrize(
    "bad",
    [
        {"amount_minor": 0},
        {"amount_minor": -5},
        {"currency": "rub"},
        {"status": "charged"},
        {"scoring": "maybe"},
        {"status": "succeeded"},  # without a gateway charge id
        {"order_id": 0},
        {"gateway_calls": -1},
        {"lease_owner": "w1"},  # an owner without an expiry
    ],
)
async def test_constraints_refuse_bad_rows(database_url: str, bad: dict[str, object]) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        with pytest.raises(asyncpg.IntegrityConstraintViolationError):
            await _insert(conn, **bad)
    finally:
        await conn.close()


async def test_every_status_is_accepted_and_the_fingerprint_is_derived(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        for n, status in enumerate(sorted(STATUSES), start=1):
            await _insert(
                conn,
                order_id=n,
                idempotency_key=f"{n}:2026-09-01",
                status=status,
                gateway_charge_id=f"ch_{n}",
            )
        assert await conn.fetchval("SELECT count(*) FROM charge_attempts") == len(STATUSES)
        assert await conn.fetchval("SELECT fingerprint FROM charge_attempts LIMIT 1") == (
            "99000 RUB cus_1"
        )
        with pytest.raises(asyncpg.UniqueViolationError):
            await _insert(conn, order_id=1, idempotency_key="other")
    finally:
        await conn.close()


def test_three_concurrent_migrate_processes_apply_each_file_once(empty_database_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": empty_database_url}
    cmd = [sys.executable, "-m", "charge_worker", "migrate"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    applied_lines = [
        line for out, _ in outputs for line in out.splitlines() if line.startswith("applied ")
    ]
    assert sorted(applied_lines) == sorted(
        f"applied {m.path.name}" for m in discover(default_directory())
    )

    async def count() -> int:
        conn = await asyncpg.connect(empty_database_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM schema_migrations"))
        finally:
            await conn.close()

    assert asyncio.run(count()) == len(discover(default_directory()))


async def test_an_edited_applied_file_is_refused(empty_database_url: str, tmp_path: Path) -> None:
    directory = tmp_path / "migrations"
    shutil.copytree(default_directory(), directory)
    await migrate(empty_database_url, directory)
    first = sorted(directory.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- an innocent-looking edit\n")
    (directory / "9999_later.sql").write_text("CREATE TABLE later (id int);")
    with pytest.raises(MigrationError, match="edited after it was applied"):
        await migrate(empty_database_url, directory)
    conn = await asyncpg.connect(empty_database_url)
    try:  # nothing new was applied either
        assert await conn.fetchval("SELECT to_regclass('later')") is None
    finally:
        await conn.close()


async def test_a_failing_migration_rolls_back_and_names_the_file(
    empty_database_url: str, tmp_path: Path
) -> None:
    (tmp_path / "0001_ok.sql").write_text("CREATE TABLE ok (id int);")
    (tmp_path / "0002_broken.sql").write_text("CREATE TABLE half (id int); SELECT nonsense;")
    with pytest.raises(MigrationError, match=r"0002_broken\.sql failed"):
        await migrate(empty_database_url, tmp_path)
    conn = await asyncpg.connect(empty_database_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('ok')") is not None
        assert await conn.fetchval("SELECT to_regclass('half')") is None
    finally:
        await conn.close()


def test_badly_named_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "add_table.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"NNNN_lower_snake\.sql"):
        discover(tmp_path)


async def test_partitioning_charge_events_keeps_the_stories_written_before(
    empty_database_url: str, tmp_path: Path
) -> None:
    """0008 turns charge_events into monthly partitions under a live database: the events
    already written stay readable, in order, and new ones keep their ids' order."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for migration in discover(default_directory()):
        if migration.version < "0008":
            shutil.copy(migration.path, earlier / migration.path.name)
    await migrate(empty_database_url, earlier)
    conn = await asyncpg.connect(empty_database_url)
    try:
        insert = (
            "INSERT INTO charge_events (order_id, billing_period, kind, actor)"
            " VALUES (7, '2026-12-01', $1, 'tests')"
        )
        await conn.execute(insert, "scheduled")
        await migrate(empty_database_url)
        await conn.execute(insert, "published")
        story = await conn.fetch(
            "SELECT id, kind, tableoid::regclass::text AS part FROM charge_events ORDER BY id"
        )
    finally:
        await conn.close()
    assert [r["kind"] for r in story] == ["scheduled", "published"]
    assert story[0]["part"] == "charge_events_before"
