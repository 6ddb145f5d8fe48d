"""`worker_pods`: a running worker writes its own row (its breakers closed at its start), a
breaker that opens is in the row at once and in what `status` gathers; a row not written
for 2 minutes is counted as not seen, not shown; `maintain` deletes the rows not seen for
a day and keeps the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json

import asyncpg
from nats.aio.client import Client

from charge_worker.admin import maintain_command
from charge_worker.admin.screen import render
from charge_worker.admin.status import Status, gather
from charge_worker.breaker import Breaker
from charge_worker.jobs import pods
from charge_worker.jobs.pods import BreakerState
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from charge_worker.worker.presence import Presence
from tests.support.harness import due, eventually, publish, running_worker, set_sim, settings_for

_ROW = "SELECT breakers, started_at, seen_at FROM worker_pods WHERE worker = $1"


def states(row: asyncpg.Record | None) -> dict[str, str] | None:
    """The row's breakers, by dependency, as state names."""
    if row is None:
        return None
    return {name: b["state"] for name, b in json.loads(row["breakers"]).items()}


async def test_a_worker_writes_itself_and_a_breaker_that_opens_shows_in_status(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    conn: asyncpg.Connection,
) -> None:
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, scoring_breaker_failures=1
    )
    async with running_worker(settings) as worker:
        name = worker.consumer.pipeline.owner
        await eventually(
            lambda: _states(conn, name, {"gateway": "closed", "scoring": "closed"}),
            "the worker's row, its breakers closed",
        )

        await set_sim(scoring_sim.url, error_rate=1.0)
        await publish(nc.jetstream(), settings.nats.subject, due(1))
        await eventually(
            lambda: _states(conn, name, {"gateway": "closed", "scoring": "open"}),
            "the scoring breaker open in the worker's row",
        )
        row = await conn.fetchrow(_ROW, name)
        status = await gather(settings)

    assert row is not None
    assert row["started_at"] <= row["seen_at"]
    assert status.pods is not None
    [pod] = status.pods.seen
    assert (pod.worker, status.pods.not_seen) == (name, 0)
    assert {n: b.state for n, b in pod.breakers.items()} == {"gateway": "closed", "scoring": "open"}
    assert pod.breakers["scoring"].since > pod.started_at  # it changed after the start
    assert pod.breakers["gateway"].since == pod.started_at
    assert pod.paused is False
    text = "\n".join(render(status))
    assert "pods:         1 seen in the last 2m 0s (each writes every 30s), 0 not seen" in text
    assert f"{name}: seen " in text
    assert "gateway closed, scoring OPEN for " in text


async def _states(conn: asyncpg.Connection, name: str, wanted: dict[str, str]) -> bool:
    return states(await conn.fetchrow(_ROW, name)) == wanted


async def test_a_breaker_change_is_written_at_once_not_at_the_next_tick(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    breaker = Breaker("scoring", fail_max=1, reset_s=30.0, counts=lambda _error: True)
    presence = Presence("p1", [breaker], in_flight=lambda: 0, paused=lambda: False)
    stop = asyncio.Event()
    writing = asyncio.create_task(presence.run(pool, stop, interval_s=3600.0))  # no tick here
    try:
        await eventually(lambda: _states(conn, "p1", {"scoring": "closed"}), "the first write")
        with contextlib.suppress(RuntimeError), breaker:
            raise RuntimeError("scoring answered 500")  # one failure opens it

        # only the change can write it: the next tick is an hour away
        await eventually(lambda: _states(conn, "p1", {"scoring": "open"}), "the change written")
    finally:
        stop.set()
        await writing


async def test_a_pod_unseen_for_2_minutes_is_counted_and_maintain_prunes_a_day_old_one(
    nats_settings: NatsSettings, database_url: str, conn: asyncpg.Connection
) -> None:
    started = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    closed = {"gateway": BreakerState("closed", started)}
    for name in ("fresh", "stuck", "gone"):
        await pods.record(
            conn, name, started_at=started, breakers=closed, in_flight=2, paused=False
        )
    aged = "UPDATE worker_pods SET seen_at = now() - $2::interval WHERE worker = $1"
    await conn.execute(aged, "stuck", dt.timedelta(minutes=2, seconds=5))
    await conn.execute(aged, "gone", dt.timedelta(days=1, minutes=1))

    found = await pods.recent(conn)

    assert [pod.worker for pod in found.seen] == ["fresh"]
    assert (found.not_seen, found.seen_within_s) == (2, 120.0)
    assert found.seen[0].breakers == closed
    assert found.seen[0].in_flight == 2
    screen = render(Status(checked_at=dt.datetime.now(dt.UTC), pods=found))
    assert "pods:         1 seen in the last 2m 0s (each writes every 30s), 2 not seen" in (
        "\n".join(screen)
    )

    settings = settings_for(nats_settings, database_url, "http://127.0.0.1:9", "http://127.0.0.1:9")
    assert await maintain_command(settings, dry_run=True, as_json=True) == 0
    assert await conn.fetchval("SELECT count(*) FROM worker_pods") == 3  # a dry run deletes none
    assert await maintain_command(settings, dry_run=False, as_json=True) == 0

    left = await conn.fetch("SELECT worker FROM worker_pods ORDER BY worker")
    assert [r["worker"] for r in left] == ["fresh", "stuck"]
    summary = await conn.fetchval("SELECT summary FROM job_runs WHERE job = 'maintain'")
    assert json.loads(summary)["pods_pruned"] == 1
