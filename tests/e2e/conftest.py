"""Fixtures the end-to-end tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.harness import WorkerProcess


@pytest.fixture
def spawn() -> Iterator[list[WorkerProcess]]:
    """Worker processes a test starts; each is killed at its end, if still running."""
    workers: list[WorkerProcess] = []
    yield workers
    for worker in workers:
        worker.kill()
