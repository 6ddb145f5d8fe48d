"""Forward-only schema migrations: `migrations/NNNN_name.sql`, each applied once, in order.

Every run takes a session advisory lock, so processes racing at deploy time apply each file
exactly once between them. Each file runs in its own transaction together with its row in
`schema_migrations` (version, sha256 checksum). A file edited after it was applied is an
error, raised before anything new is applied.

Online-safe: each try waits at most `lock_timeout_s` for a lock, so a migration queued for a
table's lock never stalls the workers' statements behind it for longer than that. A try that
timed out (`lock_not_available`) is rolled back and tried again after a growing gap; after
the last try the run fails naming the migration and the lock wait.

A file whose first line is `-- migrate: no-transaction` runs one statement at a time outside
a transaction (`CREATE INDEX CONCURRENTLY`) and is recorded after its last statement. Such a
file may be run again after a failure part way, so each of its statements must be idempotent
(`IF NOT EXISTS`); an index an interrupted concurrent build left INVALID is dropped before its
`CREATE ... INDEX CONCURRENTLY IF NOT EXISTS` runs again, which would otherwise keep it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from charge_worker.errors import DependencyUnavailable, MigrationError, MigrationLockTimeout

# Any constant shared by every charge-worker process; "charge-w" in ASCII.
ADVISORY_LOCK_KEY = 0x6368617267652D77
NO_TRANSACTION = "-- migrate: no-transaction"
# Under the workers' CHARGE_WORKER_DB_COMMAND_TIMEOUT_S (10 s): a statement queued behind a
# migration's lock request is released before it times out.
LOCK_TIMEOUT_S = 3.0
LOCK_RETRIES = 10
FIRST_GAP_S = 1.0
MAX_GAP_S = 30.0

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# Statements whose lock (SHARE UPDATE EXCLUSIVE) blocks no worker's reads or writes, and
# which wait for older transactions by design: no lock_timeout, or a long transaction would
# cancel the build after its scans for nothing.
_CONCURRENTLY = re.compile(r"^\s*(CREATE|DROP|REINDEX)\b[^;]*?\bCONCURRENTLY\b", re.I)
_CREATE_CONCURRENTLY = re.compile(
    r"^\s*CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+(\"[^\"]+\"|[\w.]+)",
    re.I,
)
_TOKEN = re.compile(r"--[^\n]*|/\*.*?\*/|'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\$(\w*)\$|;", re.S)
_LEADING_COMMENTS = re.compile(r"(?:\s+|--[^\n]*|/\*.*?\*/)*", re.S)

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""
_RECORD = "INSERT INTO schema_migrations (version, checksum) VALUES ($1, $2)"
_INVALID_INDEX = """
SELECT format('%I.%I', n.nspname, c.relname)
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.indexrelid = to_regclass($1) AND NOT i.indisvalid"""


@dataclass(frozen=True)
class Migration:
    version: str
    path: Path
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def transactional(self) -> bool:
        """False when the first line is the `-- migrate: no-transaction` marker."""
        return self.sql.split("\n", 1)[0].strip().lower() != NO_TRANSACTION


@dataclass(frozen=True)
class LockWait:
    """A try of `migration` timed out waiting for a lock; the next starts in `retry_in_s`."""

    migration: Migration
    attempt: int  # the try that timed out, from 1
    tries: int  # how many there may be
    lock_timeout_s: float
    retry_in_s: float


def retry_gap_s(attempt: int, *, first_s: float = FIRST_GAP_S, max_s: float = MAX_GAP_S) -> float:
    """The wait after try `attempt` (from 1) timed out: first_s, doubling, at most max_s."""
    return float(min(max_s, first_s * 2 ** (attempt - 1)))


def statements(sql: str) -> list[str]:
    """`sql` cut at each `;` outside comments, quotes and dollar quotes, each piece without
    its leading comments; blank pieces dropped."""
    pieces, start, pos = [], 0, 0
    while (token := _TOKEN.search(sql, pos)) is not None:
        pos = token.end()
        if token.group() == ";":
            pieces.append(sql[start:pos])
            start = pos
        elif token.group(1) is not None:  # a dollar quote runs to the same tag
            close = sql.find(token.group(), pos)
            pos = len(sql) if close < 0 else close + len(token.group())
    pieces.append(sql[start:])
    pieces = [_LEADING_COMMENTS.sub("", p, count=1).strip() for p in pieces]
    return [p for p in pieces if p.strip("; \n\t")]


def default_directory() -> Path:
    """The migrations shipped in the wheel, or the repository's `migrations/` when editable."""
    packaged = Path(__file__).parent / "migrations"
    return packaged if packaged.is_dir() else Path(__file__).parents[2] / "migrations"


def discover(directory: Path) -> list[Migration]:
    """Every migration file in `directory`, in version order; a badly named file is an error."""
    migrations = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration files are named NNNN_lower_snake.sql")
        migrations.append(Migration(match.group(1), path, path.read_text(encoding="utf-8")))
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version in {directory}")
    if not migrations:
        raise MigrationError(f"no migrations found in {directory}")
    return migrations


async def migrate(
    dsn: str,
    directory: Path | None = None,
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    lock_retries: int = LOCK_RETRIES,
    first_gap_s: float = FIRST_GAP_S,
    on_apply: Callable[[Migration], None] = lambda _m: None,
    on_lock_wait: Callable[[LockWait], None] = lambda _w: None,
) -> list[Migration]:
    """Apply the migrations not applied yet; return them. Safe to run concurrently."""
    migrations = discover(directory or default_directory())
    try:
        conn: asyncpg.Connection = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as error:
        raise DependencyUnavailable(f"cannot connect to the database: {error}") from error
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_KEY)
        await conn.execute(_CREATE_TABLE)
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        applied = {row["version"]: row["checksum"] for row in rows}
        for migration in migrations:
            recorded = applied.get(migration.version)
            if recorded is not None and recorded != migration.checksum:
                raise MigrationError(
                    f"{migration.path.name} was edited after it was applied "
                    f"(recorded sha256 {recorded[:12]}, file {migration.checksum[:12]}); "
                    "add a new migration instead"
                )
        done = []
        tries = lock_retries + 1
        for migration in migrations:
            if migration.version in applied:
                continue
            for attempt in range(1, tries + 1):
                try:
                    await _apply(conn, migration, lock_timeout_s)
                    break
                except asyncpg.LockNotAvailableError as error:
                    if attempt == tries:
                        raise MigrationLockTimeout(
                            f"{migration.path.name} not applied: each of its {tries} tries "
                            f"waited {lock_timeout_s:g} s for a lock another session held "
                            f"({error}); find the blocker in pg_locks, then run migrate again"
                        ) from error
                    gap = retry_gap_s(attempt, first_s=first_gap_s)
                    on_lock_wait(LockWait(migration, attempt, tries, lock_timeout_s, gap))
                    await asyncio.sleep(gap)
                except asyncpg.PostgresError as error:
                    raise MigrationError(f"{migration.path.name} failed: {error}") from error
            on_apply(migration)
            done.append(migration)
        return done
    finally:
        await conn.close()  # closing the session releases the advisory lock


async def _apply(conn: asyncpg.Connection, migration: Migration, lock_timeout_s: float) -> None:
    timeout = f"{round(lock_timeout_s * 1000)}ms"
    if migration.transactional:
        async with conn.transaction():
            await conn.execute("SELECT set_config('lock_timeout', $1, true)", timeout)
            await conn.execute(migration.sql)
            await conn.execute(_RECORD, migration.version, migration.checksum)
        return
    for statement in statements(migration.sql):
        concurrent = _CONCURRENTLY.match(statement) is not None
        await conn.execute(
            "SELECT set_config('lock_timeout', $1, false)", "0" if concurrent else timeout
        )
        if (build := _CREATE_CONCURRENTLY.match(statement)) is not None:
            invalid = await conn.fetchval(_INVALID_INDEX, build.group(1))
            if invalid is not None:  # what an interrupted build left: build it again
                await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {invalid}")
        await conn.execute(statement)
    await conn.execute(_RECORD, migration.version, migration.checksum)
    await conn.execute("RESET lock_timeout")
