"""`produce --processes N` is recorded in `job_runs` once, by the parent, for the whole run:
each process runs on a share of the ids and records nothing. With too few due subscriptions
to cut, the run is the parent's own, and is recorded once as well."""

from __future__ import annotations

import json

import pytest

from charge_worker.settings import NatsSettings
from tests.e2e.test_produce_cli import env_for, produce
from tests.support.producer import Sub, add_subscriptions, connected


async def _runs(database_url: str) -> list[tuple[str, bool, dict[str, object]]]:
    async with connected(database_url) as conn:
        rows = await conn.fetch("SELECT job, ok, summary FROM job_runs ORDER BY id")
    return [(r["job"], r["ok"], json.loads(r["summary"])) for r in rows]


@pytest.mark.parametrize("due", [1200, 1])  # cut in two; too few to cut
@pytest.mark.usefixtures("nc")  # deletes the streams afterwards
async def test_produce_in_processes_is_recorded_once_for_the_whole_run(
    due: int, nats_settings: NatsSettings, database_url: str
) -> None:
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, due + 1)))

    result = await produce("--json", "--processes", "2", env=env_for(nats_settings, database_url))

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["due"] == due
    [(job, ok, summary)] = await _runs(database_url)
    assert (job, ok, summary["due"], summary["published"]) == ("produce", True, due, due)
