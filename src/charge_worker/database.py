"""PostgreSQL connections for every command, and the one translation of driver errors.

Each command opens one pool (`create_pool`) or, for a run that holds a session lock or
works one statement at a time, one connection (`connect`). `translated()` turns asyncpg's
errors and socket errors into `DependencyUnavailable`, and a value PostgreSQL cannot store
into `UnstorableValue`, keeping `__cause__`, so that nothing above the adapters imports
asyncpg's exceptions.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import asyncpg

from charge_worker.errors import DependencyUnavailable, UnstorableValue
from charge_worker.settings import DbSettings

PROBE_TIMEOUT_S = 2.0
# InternalClientError: a pooled connection whose server died mid-operation ("cannot switch
# to state …"); it is the driver's, not a bug of ours, and passes like the others.
DRIVER_ERRORS = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)


class translated:
    """Driver errors inside become `DependencyUnavailable("<what>: …")`; a value that cannot
    be stored (SQLSTATE class 22, or one asyncpg cannot encode) becomes `UnstorableValue`:
    retrying it would fail the same way for ever.

    A class rather than an `asynccontextmanager`: it wraps every statement of the hot path,
    where the generator machinery cost about a microsecond a statement."""

    __slots__ = ("what",)

    def __init__(self, what: str = "ledger") -> None:
        self.what = what

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(error, asyncpg.DataError):
            raise UnstorableValue(f"{self.what}: {type(error).__name__}: {error}") from error
        if isinstance(error, DRIVER_ERRORS):
            raise DependencyUnavailable(f"{self.what}: {type(error).__name__}: {error}") from error


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool's `reset`: none of our statements leaves session state behind (no SET, LISTEN,
    advisory lock or cursor), so asyncpg's default reset query, one more round trip on
    every release, is skipped. asyncpg still rolls back a transaction left open."""


async def create_pool(cfg: DbSettings) -> asyncpg.Pool:
    """The process's connection pool."""
    dsn = cfg.dsn
    async with translated("cannot connect to the database"):
        pool = await asyncpg.create_pool(
            dsn,
            min_size=cfg.db_pool_min,
            max_size=cfg.db_pool_max,
            command_timeout=cfg.db_command_timeout_s,
            reset=keep_session,
        )
    assert pool is not None
    return pool


async def connect(cfg: DbSettings, *, application_name: str) -> asyncpg.Connection:
    """One connection, named in `pg_stat_activity`."""
    dsn = cfg.dsn
    async with translated("cannot connect to the database"):
        conn: asyncpg.Connection = await asyncpg.connect(
            dsn,
            command_timeout=cfg.db_command_timeout_s,
            server_settings={"application_name": application_name},
        )
    return conn


async def close_quietly(conn: asyncpg.Connection) -> None:
    """Close a connection whatever state it is in (the server may be gone)."""
    with contextlib.suppress(*DRIVER_ERRORS):
        await conn.close(timeout=5)
