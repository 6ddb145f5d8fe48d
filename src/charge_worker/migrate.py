"""Forward-only schema migrations: `migrations/NNNN_name.sql`, each applied once, in order.

Every run takes a session advisory lock, so processes racing at deploy time apply each file
exactly once between them. Each file runs in its own transaction together with its row in
`schema_migrations` (version, sha256 checksum). A file edited after it was applied is an
error, raised before anything new is applied.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from charge_worker.errors import DependencyUnavailable, MigrationError

# Any constant shared by every charge-worker process; "charge-w" in ASCII.
ADVISORY_LOCK_KEY = 0x6368617267652D77
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass(frozen=True)
class Migration:
    version: str
    path: Path
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


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
    on_apply: Callable[[Migration], None] = lambda _m: None,
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
        for migration in migrations:
            if migration.version in applied:
                continue
            try:
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, checksum) VALUES ($1, $2)",
                        migration.version,
                        migration.checksum,
                    )
            except asyncpg.PostgresError as error:
                raise MigrationError(f"{migration.path.name} failed: {error}") from error
            on_apply(migration)
            done.append(migration)
        return done
    finally:
        await conn.close()  # closing the session releases the advisory lock
