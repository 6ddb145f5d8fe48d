"""Every money-moving job's real runs recorded in `job_runs`, and exported by the worker
pods as gauges: reconcile's figures under exactly the names, help and values of its
`--metrics-file`, each job's last success and failure, the oldest due charge still open.
A dry run records nothing; a read that fails keeps the gauges as they were; `maintain`
prunes old runs but the ones the gauges read.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from charge_worker.admin import maintain_command
from charge_worker.errors import DependencyUnavailable
from charge_worker.jobs import RECONCILE_GAUGES, JobGauges, note_run
from charge_worker.jobs.runs import RETENTION, record
from charge_worker.migrate import migrate
from charge_worker.producer import produce_command
from charge_worker.reconcile import reconcile_command
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import DbSettings, NatsSettings, Settings
from tests.integration.test_reconcile import put_row
from tests.support.grants import Roles, readme_roles
from tests.support.harness import provisioned, settings_for
from tests.support.producer import DAY, Sub, add_subscriptions

NO_SCORING = "http://127.0.0.1:9"  # no job here scores
SUCCESS = "charge_worker_job_last_success_timestamp_seconds"
FAILURE = "charge_worker_job_last_failure_timestamp_seconds"
OLDEST_DUE = "charge_worker_oldest_due_unsettled_seconds"
NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)


@pytest.fixture
async def roles(pg_admin_url: str) -> AsyncIterator[Roles]:
    roles = await readme_roles(pg_admin_url, migrate)
    yield roles
    await roles.drop()


async def runs(conn: asyncpg.Connection) -> list[tuple[str, bool, dict[str, object]]]:
    rows = await conn.fetch("SELECT job, ok, summary FROM job_runs ORDER BY id")
    return [(r["job"], r["ok"], json.loads(r["summary"])) for r in rows]


def families(exposition: str, prefix: str) -> dict[str, tuple[str, list[tuple[str, float]]]]:
    """Each family named `prefix…`: its help and samples."""
    return {
        f.name: (f.documentation, [(s.name, s.value) for s in f.samples])
        for f in text_string_to_metric_families(exposition)
        if f.name.startswith(prefix)
    }


async def test_a_real_reconcile_run_is_recorded_and_exported_as_its_metrics_file_says(
    nc: Client, settings: Settings, conn: asyncpg.Connection, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await provisioned(nc, settings)
    await put_row(conn, 1, "succeeded", charge_id="ch_unknown")  # a discrepancy
    await put_row(conn, 2, "scheduled")  # a lost message: re-published
    arguments = {"since": None, "as_json": True, "fail_on_discrepancy": False, "full": True}

    dry = await reconcile_command(settings, dry_run=True, metrics_file=None, **arguments)
    assert dry == 0
    assert await runs(conn) == []  # a dry run promises no write

    path = tmp_path / "reconcile.prom"
    code = await reconcile_command(settings, dry_run=False, metrics_file=path, **arguments)

    assert code == 0
    [(job, ok, summary)] = await runs(conn)
    assert (job, ok, summary.pop("full"), summary.pop("held")) == ("reconcile", True, True, False)
    assert set(summary) == set(RECONCILE_GAUGES) - {"last_run_timestamp_seconds"}
    assert (summary["discrepancies"], summary["republished"], summary["errors"]) == (1, 1, 0)

    registry = CollectorRegistry()
    assert await JobGauges(registry).refresh(pool)
    exported = families(generate_latest(registry).decode(), "charge_worker_reconcile_")
    # the very names, help and values of the textfile, the run's start included
    assert exported == families(path.read_text(), "charge_worker_reconcile_")
    assert len(exported) == len(RECONCILE_GAUGES)
    finished = await conn.fetchval("SELECT finished_at FROM job_runs")
    assert registry.get_sample_value(SUCCESS, {"command": "reconcile"}) == finished.timestamp()
    assert registry.get_sample_value(FAILURE, {"command": "reconcile"}) is None


async def test_a_reconcile_that_ends_early_is_recorded_failed_and_shows_no_figures(
    settings: Settings, conn: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    down = settings.nats.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})
    broken = settings.model_copy(update={"nats": down})

    code = await reconcile_command(
        broken,
        since=None,
        dry_run=False,
        as_json=True,
        fail_on_discrepancy=False,
        metrics_file=None,
    )

    assert code == 1
    assert await runs(conn) == [
        ("reconcile", False, {"full": False, "error": "DependencyUnavailable"})
    ]
    registry = CollectorRegistry()
    assert await JobGauges(registry).refresh(pool)
    assert registry.get_sample_value(FAILURE, {"command": "reconcile"}) is not None
    # like the textfile, which only a finished run writes: nothing to alert on as found
    assert registry.get_sample_value("charge_worker_reconcile_errors") is None
    assert registry.get_sample_value("charge_worker_reconcile_last_run_timestamp_seconds") is None


async def test_produce_records_its_run_ok_with_its_counts_or_failed(
    nc: Client, settings: Settings, conn: asyncpg.Connection
) -> None:
    await provisioned(nc, settings)
    await add_subscriptions(settings.db.dsn, Sub("sub_1", 1), Sub("sub_2", 2))

    assert await produce_command(settings, DAY, as_json=True) == 0
    down = settings.nats.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})
    with pytest.raises(DependencyUnavailable):
        await produce_command(settings.model_copy(update={"nats": down}), DAY, as_json=True)

    [(job, ok, summary), failed] = await runs(conn)
    assert (job, ok) == ("produce", True)
    assert (summary["day"], summary["due"], summary["scheduled"]) == ("2026-12-01", 2, 2)
    assert (summary["published"], summary["failed"], summary["abandoned"]) == (2, 0, 0)
    assert failed == ("produce", False, {"day": "2026-12-01", "error": "DependencyUnavailable"})


async def test_maintain_records_its_run_and_prunes_old_runs_but_each_jobs_latest(
    settings: Settings, conn: asyncpg.Connection
) -> None:
    old = NOW - RETENTION - dt.timedelta(days=1)
    ancient = old - dt.timedelta(days=30)
    finished = "INSERT INTO job_runs (job, started_at, finished_at, ok) VALUES ($1, $2, $2, $3)"
    await conn.executemany(
        finished,
        [
            ("produce", ancient, True),  # pruned: a later success is kept
            ("produce", old, True),  # produce's latest success: kept however old
            ("produce", ancient, False),  # produce's latest failure: kept
            ("reconcile", old, True),  # pruned: a recent success follows
            ("reconcile", NOW, True),
            ("maintain", old, False),  # maintain's latest failure: kept
        ],
    )

    assert await maintain_command(settings, dry_run=True, as_json=True) == 0
    assert await conn.fetchval("SELECT count(*) FROM job_runs") == 6  # a dry run writes nothing

    assert await maintain_command(settings, dry_run=False, as_json=True) == 0

    rows = await conn.fetch(
        "SELECT job, ok, finished_at = started_at AS inserted, summary FROM job_runs ORDER BY id"
    )
    kept = [(r["job"], r["ok"]) for r in rows if r["inserted"]]
    assert kept == [("produce", True), ("produce", False), ("reconcile", True), ("maintain", False)]
    assert (
        await conn.fetchval("SELECT started_at FROM job_runs WHERE job = 'produce' AND ok")
    ) == old
    [ran] = [r for r in rows if not r["inserted"]]
    assert (ran["job"], ran["ok"], json.loads(ran["summary"])["runs_pruned"]) == (
        "maintain",
        True,
        2,
    )


async def test_the_gauges_show_the_latest_runs_and_the_oldest_open_due_charge(
    conn: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    registry = CollectorRegistry()
    gauges = JobGauges(registry)
    assert await gauges.refresh(pool)
    assert registry.get_sample_value(OLDEST_DUE) == 0  # nothing open
    assert registry.get_sample_value(SUCCESS, {"command": "produce"}) is None  # no run, no series
    assert registry.get_sample_value("charge_worker_reconcile_double_charges") is None

    figures = dict.fromkeys(RECONCILE_GAUGES, 0) | {"double_charges": 2, "full": False}
    del figures["last_run_timestamp_seconds"]
    early, late = NOW - dt.timedelta(hours=2), NOW - dt.timedelta(hours=1)
    await record(conn, "reconcile", started_at=early, ok=True, summary=figures)
    await record(conn, "reconcile", started_at=late, ok=False, summary=figures | {"errors": 1})
    await record(conn, "reconcile", started_at=NOW, ok=False, summary={"error": "Settings"})
    await record(conn, "produce", started_at=NOW, ok=True, summary={"due": 1})
    due = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    for order_id, status, due_at in (
        (1, "pending", due),  # the oldest not yet charged
        (2, "scheduled", due + dt.timedelta(days=1)),
        (3, "succeeded", due - dt.timedelta(days=30)),  # settled: not late
        (4, "processing", due - dt.timedelta(days=3)),  # charged, its bank debit unsettled
        (5, "retry_scheduled", due - dt.timedelta(days=3)),  # waiting for its next try
    ):
        await _row(conn, order_id, status, due_at)

    assert await gauges.refresh(pool)

    produced = await conn.fetchval("SELECT finished_at FROM job_runs WHERE job = 'produce'")
    assert registry.get_sample_value(SUCCESS, {"command": "produce"}) == produced.timestamp()
    assert registry.get_sample_value(FAILURE, {"command": "produce"}) is None
    # reconcile's figures: its latest run that finished (a key not handled), not the one
    # that ended early
    assert registry.get_sample_value("charge_worker_reconcile_errors") == 1
    assert registry.get_sample_value("charge_worker_reconcile_double_charges") == 2
    assert (
        registry.get_sample_value("charge_worker_reconcile_last_run_timestamp_seconds")
        == late.timestamp()
    )
    now = await conn.fetchval("SELECT now()")
    lateness = registry.get_sample_value(OLDEST_DUE)
    assert lateness is not None
    assert (now - due).total_seconds() - 60 < lateness <= (now - due).total_seconds()


async def _row(conn: asyncpg.Connection, order_id: int, status: str, due_at: dt.datetime) -> None:
    await conn.execute(
        "INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,"
        " customer_id, amount_minor, currency, due_at, status, gateway_charge_id, retry_at)"
        " VALUES ($1, $2, $3, $4, 'cus_ok', 99000, 'RUB', $5, $6, $7,"
        " CASE WHEN $6 = 'retry_scheduled' THEN now() + interval '1 day' END)",
        order_id,
        due_at.date(),
        f"{order_id}:{due_at.date()}",
        f"sub_{order_id}",
        due_at,
        status,
        f"ch_{order_id}" if status in ("succeeded", "processing") else None,
    )


async def test_with_the_readme_grants_runs_are_recorded_and_read_and_a_failed_read_keeps_the_gauges(
    roles: Roles,
) -> None:
    """The worker role records (INSERT, no sequence grant: an identity column) and reads;
    without its SELECT, the read fails in one warning and the gauges stay as they were;
    without its INSERT, a run is not recorded, in one warning, and nothing is raised."""
    worker = DbSettings(url=roles.worker_url)
    await note_run(worker, "produce", started_at=NOW, ok=True, summary={"due": 3})
    pool = await asyncpg.create_pool(roles.worker_url, min_size=0, max_size=1)
    assert pool is not None
    try:
        registry = CollectorRegistry()
        gauges = JobGauges(registry)
        assert await gauges.refresh(pool)
        before = registry.get_sample_value(SUCCESS, {"command": "produce"})
        assert before is not None

        await roles.as_owner("REVOKE SELECT ON job_runs FROM charge_worker")
        await note_run(worker, "produce", started_at=NOW, ok=False, summary={"due": 3})
        with capture_logs() as logs:
            assert not await gauges.refresh(pool)
    finally:
        await pool.close()
    assert [log["event"] for log in logs] == ["jobs.read_failed"]
    assert logs[0]["log_level"] == "warning"
    assert registry.get_sample_value(SUCCESS, {"command": "produce"}) == before
    assert registry.get_sample_value(FAILURE, {"command": "produce"}) is None

    await roles.as_owner("REVOKE INSERT ON job_runs FROM charge_worker")
    with capture_logs() as logs:
        await note_run(worker, "reconcile", started_at=NOW, ok=True, summary={})
    assert [(log["event"], log["log_level"]) for log in logs] == [
        ("jobs.run_not_recorded", "warning")
    ]
    owner = await asyncpg.connect(roles.owner_url)
    try:
        assert [r["ok"] for r in await owner.fetch("SELECT ok FROM job_runs ORDER BY id")] == [
            True,
            False,
        ]
    finally:
        await owner.close()
