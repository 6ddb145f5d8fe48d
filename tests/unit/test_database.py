"""The one translation of driver errors (`database.translated`)."""

from __future__ import annotations

import asyncpg
import pytest

from charge_worker.database import translated
from charge_worker.errors import DependencyUnavailable, UnstorableValue


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "refused"),
        asyncpg.exceptions.ConnectionDoesNotExistError("closed"),
        asyncpg.InterfaceError("pool is closing"),
        # What a pooled connection raises when PostgreSQL died under it mid-operation: it
        # once escaped /readyz as a 500 instead of a 503 naming PostgreSQL.
        asyncpg.InternalClientError("cannot switch to state 11; another operation is in progress"),
    ],
    ids=type,
)
async def test_a_driver_error_becomes_dependency_unavailable(error: Exception) -> None:
    with pytest.raises(DependencyUnavailable, match="ledger: ") as caught:
        async with translated():
            raise error
    assert caught.value.__cause__ is error


async def test_a_value_postgresql_cannot_store_is_unstorable() -> None:
    with pytest.raises(UnstorableValue):
        async with translated():
            raise asyncpg.DataError("integer out of range")
