"""Online-safe migrations against a real PostgreSQL: a lock wait times out and is retried
instead of stalling everyone queued behind it, and a `-- migrate: no-transaction` file builds
its index CONCURRENTLY, again after an interrupted build."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from charge_worker.errors import MigrationError, MigrationLockTimeout
from charge_worker.migrate import LockWait, Migration, migrate, retry_gap_s, statements
from tests.support.cli import cli
from tests.support.harness import eventually

TABLE = "CREATE TABLE notes (id bigint PRIMARY KEY, body text NOT NULL);\n"
ALTER = "ALTER TABLE notes ADD COLUMN author text;\n"
CONCURRENT = (
    "-- migrate: no-transaction\n"
    "-- the lookup by body; built without blocking writes\n"
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS notes_body_idx ON notes (body);\n"
)
FAST = {"lock_timeout_s": 0.05, "first_gap_s": 0.01}


@pytest.fixture
def migrations(tmp_path: Path) -> Path:
    """A folder holding one migration, the table the others change."""
    (tmp_path / "0001_notes.sql").write_text(TABLE)
    return tmp_path


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(url)
    try:
        yield conn
    finally:
        await conn.close()


async def recorded(url: str, version: str) -> int:
    async with connection(url) as conn:
        query = "SELECT count(*) FROM schema_migrations WHERE version = $1"
        return int(await conn.fetchval(query, version))


async def index_valid(url: str, name: str) -> bool | None:
    """Whether index `name` is valid; None when there is none."""
    async with connection(url) as conn:
        query = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)"
        valid: bool | None = await conn.fetchval(query, name)
        return valid


async def has_column(url: str, table: str, column: str) -> bool:
    async with connection(url) as conn:
        query = (
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_name = $1 AND column_name = $2"
        )
        return bool(await conn.fetchval(query, table, column))


async def test_a_lock_wait_times_out_is_retried_and_applies_once_the_lock_is_released(
    empty_database_url: str, migrations: Path
) -> None:
    await migrate(empty_database_url, migrations)
    (migrations / "0002_author.sql").write_text(ALTER)
    waits: list[LockWait] = []
    waited = asyncio.Event()

    def on_lock_wait(wait: LockWait) -> None:
        waits.append(wait)
        waited.set()

    async with connection(empty_database_url) as holder:
        reading = holder.transaction()
        await reading.start()
        await holder.execute("LOCK TABLE notes IN ACCESS SHARE MODE")  # a long read
        run = asyncio.create_task(
            migrate(
                empty_database_url, migrations, lock_retries=100, on_lock_wait=on_lock_wait, **FAST
            )
        )
        await asyncio.wait_for(waited.wait(), timeout=30)
        await reading.rollback()  # the reader finishes: the next try gets the lock
        applied = await run
    assert [m.path.name for m in applied] == ["0002_author.sql"]
    assert waits[0].migration.path.name == "0002_author.sql"
    assert [w.attempt for w in waits] == list(range(1, len(waits) + 1))
    assert await has_column(empty_database_url, "notes", "author")
    assert await recorded(empty_database_url, "0002") == 1


async def test_a_lock_never_released_gives_up_naming_the_migration_and_the_wait(
    empty_database_url: str, migrations: Path
) -> None:
    await migrate(empty_database_url, migrations)
    (migrations / "0002_author.sql").write_text(ALTER)
    waits: list[LockWait] = []
    async with connection(empty_database_url) as holder, holder.transaction():
        await holder.execute("LOCK TABLE notes IN ACCESS SHARE MODE")
        with pytest.raises(MigrationLockTimeout) as raised:
            await migrate(
                empty_database_url, migrations, lock_retries=2, on_lock_wait=waits.append, **FAST
            )
    message = str(raised.value)
    assert "0002_author.sql" in message
    assert "3 tries" in message
    assert "lock" in message
    assert isinstance(raised.value.__cause__, asyncpg.LockNotAvailableError)
    assert [(w.attempt, w.tries) for w in waits] == [(1, 3), (2, 3)]
    assert not await has_column(empty_database_url, "notes", "author")  # rolled back
    assert await recorded(empty_database_url, "0002") == 0


@contextlib.contextmanager
def table_held(url: str, table: str) -> Iterator[None]:
    """`table` read-locked by another session until the block ends (a thread: the command
    under test runs its own event loop in this one)."""
    ready, release = threading.Event(), threading.Event()

    async def hold() -> None:
        async with connection(url) as conn, conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN ACCESS SHARE MODE")
            ready.set()
            await asyncio.to_thread(release.wait)

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    try:
        assert ready.wait(timeout=30), "the lock holder did not start"
        yield
    finally:
        release.set()
        thread.join()


def test_the_command_prints_a_line_per_retry_then_one_error(
    empty_database_url: str, migrations: Path
) -> None:
    env = {"DATABASE_URL": empty_database_url}
    assert cli("migrate", "--dir", str(migrations), env=env).returncode == 0
    (migrations / "0002_author.sql").write_text(ALTER)
    args = ("migrate", "--dir", str(migrations), "--lock-timeout", "0.05", "--lock-retries", "1")
    with table_held(empty_database_url, "notes"):
        result = cli(*args, env=env)
    assert result.returncode == 1
    progress, error = result.stderr.strip().splitlines()
    assert progress.startswith("0002_author.sql: waited 0.05 s for a lock (try 1 of 2)")
    assert error.startswith("Error: MigrationLockTimeout: 0002_author.sql not applied")
    assert "applied 0002" not in result.stdout


async def test_a_no_transaction_migration_builds_its_index_concurrently_and_is_recorded_once(
    empty_database_url: str, migrations: Path
) -> None:
    await migrate(empty_database_url, migrations)
    (migrations / "0002_notes_body.sql").write_text(CONCURRENT)
    applied = await migrate(empty_database_url, migrations)
    assert [(m.path.name, m.transactional) for m in applied] == [("0002_notes_body.sql", False)]
    assert await index_valid(empty_database_url, "notes_body_idx") is True
    assert await recorded(empty_database_url, "0002") == 1
    assert await migrate(empty_database_url, migrations) == []
    # the checksum rule holds for these files too
    (migrations / "0002_notes_body.sql").write_text(CONCURRENT + "-- later\n")
    with pytest.raises(MigrationError, match="edited after it was applied"):
        await migrate(empty_database_url, migrations)


async def test_a_run_after_an_interrupted_concurrent_build_leaves_a_valid_index(
    empty_database_url: str, migrations: Path
) -> None:
    await migrate(empty_database_url, migrations)
    (migrations / "0002_notes_body.sql").write_text(CONCURRENT)
    async with (
        connection(empty_database_url) as writer,
        connection(empty_database_url) as admin,
    ):
        writing = writer.transaction()
        await writing.start()
        # an open write: the build, its index already in the catalog, waits for it to end
        await writer.execute("INSERT INTO notes VALUES (1, 'hello')")
        run = asyncio.create_task(migrate(empty_database_url, migrations, **FAST))
        find = (
            "SELECT pid FROM pg_stat_activity"
            " WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND wait_event_type = 'Lock'"
        )

        async def build_waits() -> bool:
            return await admin.fetchval(find) is not None

        await eventually(build_waits, "the concurrent build waiting", within_s=30)
        await admin.execute(f"SELECT pg_cancel_backend(({find}))")  # an operator's Ctrl-C
        with pytest.raises(MigrationError, match=r"0002_notes_body\.sql failed"):
            await run
        await writing.commit()
    assert await index_valid(empty_database_url, "notes_body_idx") is False  # left INVALID
    assert await recorded(empty_database_url, "0002") == 0

    applied = await migrate(empty_database_url, migrations)
    assert [m.path.name for m in applied] == ["0002_notes_body.sql"]
    assert await index_valid(empty_database_url, "notes_body_idx") is True
    assert await recorded(empty_database_url, "0002") == 1


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT 1; SELECT 2;", ["SELECT 1;", "SELECT 2;"]),
        ("SELECT 1", ["SELECT 1"]),
        ("-- only a comment;\n", []),
        ("SELECT 'a;b'; SELECT 'it''s;'", ["SELECT 'a;b';", "SELECT 'it''s;'"]),
        ('SELECT "x;y" FROM t;', ['SELECT "x;y" FROM t;']),
        ("/* a; b */ SELECT 1;", ["SELECT 1;"]),
        (
            "DO $f$ BEGIN PERFORM 1; END $f$; SELECT $$;$$;",
            ["DO $f$ BEGIN PERFORM 1; END $f$;", "SELECT $$;$$;"],
        ),
        (CONCURRENT, [CONCURRENT.splitlines()[-1]]),
    ],
)
def test_statements_are_cut_at_semicolons_outside_quotes_and_comments(
    sql: str, expected: list[str]
) -> None:
    assert statements(sql) == expected


@pytest.mark.parametrize(
    ("attempt", "gap_s"), [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)]
)
def test_the_gap_between_tries_doubles_up_to_its_cap(attempt: int, gap_s: float) -> None:
    assert retry_gap_s(attempt) == gap_s


@pytest.mark.parametrize(
    ("first_line", "transactional"),
    [
        ("-- migrate: no-transaction", False),
        ("-- Migrate: No-Transaction  ", False),
        ("-- a table", True),
        ("CREATE TABLE t (id int);", True),
    ],
)
def test_the_marker_on_the_first_line_alone_takes_a_file_out_of_a_transaction(
    first_line: str, transactional: bool
) -> None:
    sql = f"{first_line}\nSELECT 1;\n"
    assert Migration("0001", Path("0001_x.sql"), sql).transactional is transactional
    assert Migration("0001", Path("0001_x.sql"), f"SELECT 1;\n{sql}").transactional
