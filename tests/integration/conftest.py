"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A small pool on this test's fresh database (a module may define a pool of its own)."""
    created = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert created is not None
    yield created
    await created.close()
