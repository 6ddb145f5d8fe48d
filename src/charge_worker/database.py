"""PostgreSQL connections for every command, and the one translation of driver errors.

Each command opens one pool (`create_pool`) or, for a run that holds a session lock or
works one statement at a time, one connection (`connect`). `translated()` turns asyncpg's
errors and socket errors into `DependencyUnavailable`, and a value PostgreSQL cannot store
into `UnstorableValue`, keeping `__cause__`, so that nothing above the adapters imports
asyncpg's exceptions.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

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


@contextlib.asynccontextmanager
async def translated(what: str = "ledger") -> AsyncIterator[None]:
    """Driver errors inside become `DependencyUnavailable("<what>: …")`; a value that cannot
    be stored (SQLSTATE class 22, or one asyncpg cannot encode) becomes `UnstorableValue`:
    retrying it would fail the same way for ever."""
    try:
        yield
    except asyncpg.DataError as error:
        raise UnstorableValue(f"{what}: {type(error).__name__}: {error}") from error
    except DRIVER_ERRORS as error:
        raise DependencyUnavailable(f"{what}: {type(error).__name__}: {error}") from error


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
