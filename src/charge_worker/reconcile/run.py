"""`charge-worker reconcile`: the gateway's history against the ledger, every 15 minutes.

A run costs what happened since the last one: it pages the gateway's history from its
checkpoint (`checkpoint.py`, less an overlap; the first run and `--full` the whole
window), one page at a time, and each page costs one ledger statement to sort out
(`candidates.py`) and one to mark the rows it shows. Only the keys a page shows something
odd for (a double, a charge the ledger said no to or forgot) are looked up and decided
(`charges.py`), several at once; so are the keys earlier runs left unsettled
(`followups.py`). Then, from the ledger: unknown outcomes, lost messages (recorded from a
lookup, else re-published: a broker that lost acknowledged messages loses no charge),
both in `sweeps.py`, and the `succeeded` rows no page or lookup has shown
(`discrepancies.py`). Nothing here ever charges; the worker's claim keeps every
re-published charge to at most one. The findings: `report.py`.

A real run holds a PostgreSQL session advisory lock (`LOCK_KEY`) on its one ledger
connection for its whole length: a second run finds it taken, says so and exits 0. Its
keys are worked on from a small pool of other connections. A dry run writes nothing (not
even the checkpoint), so it takes no lock and never keeps the CronJob's run from working.
Driver errors (asyncpg, httpx, nats) become domain errors at this module's edge.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path

import asyncpg

from charge_worker import database, logs, privileges, tracing
from charge_worker.database import translated
from charge_worker.errors import ChargeWorkerError
from charge_worker.gateway import GatewayCharge, build_gateway
from charge_worker.jobs import note_run
from charge_worker.ratelimit import RateLimiter
from charge_worker.reconcile import checkpoint, discrepancies, followups
from charge_worker.reconcile.candidates import Key, Recorded, ours, sort_page
from charge_worker.reconcile.charges import decide
from charge_worker.reconcile.checkpoint import Plan
from charge_worker.reconcile.history import pages
from charge_worker.reconcile.report import Report, table, to_json, write_metrics
from charge_worker.reconcile.republisher import NatsRepublisher
from charge_worker.reconcile.sweeper import CONCURRENCY, Sweeper
from charge_worker.reconcile.sweeps import lost_messages, unknown_outcomes
from charge_worker.settings import DbSettings, Settings

# Any constant of reconcile's own; "reconcil" in ASCII (migrate.py's is "charge-w").
LOCK_KEY = 0x7265636F6E63696C
SKIPPED = "another reconcile is running (it holds the advisory lock)"
APPLICATION = "charge-worker reconcile"
PROGRESS_PAGES = 100  # pages between stores of how far a long run has got

_RECORDED = """
SELECT order_id, billing_period, status, gateway_charge_id, gateway_seen_charge_id
  FROM charge_attempts
 WHERE (order_id, billing_period) IN (SELECT * FROM unnest($1::bigint[], $2::date[]))
"""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


async def reconcile_command(
    settings: Settings,
    *,
    since: dt.datetime | None,
    dry_run: bool,
    as_json: bool,
    fail_on_discrepancy: bool,
    metrics_file: Path | None,
    full: bool = False,
) -> int:
    """Run every sweep once, print the findings, and return the exit code.

    Exit codes:

    * 0: the run finished and handled every key it found: double charges found are
      refunded (that is a repair, not a failure), unrecorded charges recorded, unknown
      outcomes resolved, quiet charges re-published, discrepancies and unmatched charges
      reported (without `fail_on_discrepancy`), or,
      in a dry run, all of it only reported; also when another reconcile holds the lock
      and this one did nothing;
    * 4: `fail_on_discrepancy` and at least one `succeeded` ledger row whose charge the
      gateway does not have for that key, or one captured charge not proven its key's
      own (an unmatched charge) (this takes precedence over 1);
    * 1: a dependency (PostgreSQL, the gateway, NATS) was unreachable, or the gateway's
      history unreadable, so the run ended early (one line on stderr, no metrics
      written); or some key could not be handled (listed; the others were); or the
      metrics file could not be written.

    `metrics_file` gets the run's gauges in Prometheus text format, only when the run
    finished (so `charge_worker_reconcile_last_run_timestamp_seconds` goes stale when
    runs fail, and a run skipped for the lock leaves the other run's file alone).

    A real run is recorded in `job_runs` after its output (a dry run, and one skipped for
    the lock, are not): ok when it finished and handled every key; its counts, under the
    metrics file's names, and `full`, when it finished (the worker pods export those as
    the file's gauges); the error's name when it ended early.
    """
    started = dt.datetime.now(dt.UTC)
    try:
        progress = logs.progress(settings.log, __package__)
        report = await run_reconcile(
            settings, since=since, dry_run=dry_run, full=full, progress=progress
        )
    except ChargeWorkerError as error:
        _stderr(f"Error: {type(error).__name__}: {_one_line(error)}")
        if not dry_run:
            ended = {"full": full, "error": type(error).__name__}
            await note_run(
                settings.db, "reconcile", started_at=started, ok=False, summary=ended, quiet=True
            )
        return 1
    code = 0 if report.skipped else report.exit_code(fail_on_discrepancy=fail_on_discrepancy)
    if as_json:
        print(json.dumps(to_json(report, exit_code=code), ensure_ascii=False, default=str))
    else:
        for line in table(report):
            print(line)
    if not dry_run and not report.skipped:
        await note_run(
            settings.db,
            "reconcile",
            started_at=report.started_at,
            ok=not report.failures,
            summary=asdict(report.counts) | {"full": full, "held": report.held is not None},
        )
    if metrics_file is not None and not report.skipped:
        try:
            write_metrics(report, metrics_file)
        except OSError as error:
            _stderr(f"Error: cannot write the metrics file {metrics_file}: {_one_line(error)}")
            return 1
    return code


async def run_reconcile(
    settings: Settings,
    *,
    since: dt.datetime | None = None,
    dry_run: bool = False,
    full: bool = False,
    progress: Callable[[str], None] = lambda _line: None,
    progress_pages: int = PROGRESS_PAGES,
) -> Report:
    """Run the sweeps once and return what they found and did.

    The history read: from `since` when given, else the whole window with `full` or on
    the first run, else from the stored checkpoint less `reconcile_overlap_s`. A long
    real run stores how far it has got every `progress_pages` pages, so one stopped by its
    deadline (the first run on a full window) is taken on from there by the next. Returns a
    `Report` with `skipped` set when another (non-dry) run holds the lock. Raises
    `DependencyUnavailable` when PostgreSQL, the gateway or NATS cannot be reached (or
    `SettingsError` when one is not configured); a key that fails on its own is in
    `Report.failures` instead.
    """
    attributes = {"charge_worker.dry_run": dry_run} if tracing.enabled() else None
    with tracing.span("reconcile.run", attributes):
        report = await _run(
            settings,
            since=since,
            full=full,
            dry_run=dry_run,
            progress=progress,
            every=progress_pages,
        )
        if tracing.enabled():
            tracing.note({"charge_worker.skipped": report.skipped})
    return report


async def _run(
    settings: Settings,
    *,
    since: dt.datetime | None,
    full: bool,
    dry_run: bool,
    progress: Callable[[str], None],
    every: int,
) -> Report:
    cfg = settings.reconcile
    gateway = build_gateway(settings.gateway)  # checks GATEWAY_URL / GATEWAY_API_KEY first
    try:
        async with _ledger(settings.db) as conn, translated():
            started = await checkpoint.now(conn)  # the database's clock, never the pod's
            report = Report(started_at=started, since=started, dry_run=dry_run)
            await privileges.require(conn, privileges.RECONCILE)
            if not dry_run and not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
                report.skipped = SKIPPED
                return report
            plan = checkpoint.plan(
                started,
                checkpoint=await checkpoint.read(conn),
                since=since,
                full=full,
                window_s=cfg.reconcile_window_s,
                overlap_s=cfg.reconcile_overlap_s,
            )
            report.mode, report.since, report.until = plan.mode, plan.since, plan.until
            concurrency = min(CONCURRENCY, settings.db.db_pool_max)
            async with (
                _pool(settings.db, concurrency) as pool,
                _pool(settings.db, 1) as tokens,  # keys hold `pool`'s while they wait for one
                NatsRepublisher(settings.nats) as publisher,
            ):
                # the kill switch is on: find, and change nothing (no refund, no re-publish,
                # no repair, no checkpoint) until `charge-worker resume`
                report.held = None if dry_run else await publisher.paused()
                gateway.limiter = RateLimiter(
                    tokens, rate_per_s=settings.gateway.gateway_rate_limit
                )
                sweeper = Sweeper(
                    conn,
                    pool,
                    gateway,
                    publisher,
                    report,
                    quiet_s=cfg.reconcile_quiet_s,
                    dry_run=dry_run or report.held is not None,
                    progress=progress,
                    concurrency=concurrency,
                    retry_schedule=tuple(settings.retries.retry_schedule),
                )
                await _sweep(sweeper, plan, window_s=cfg.reconcile_window_s, every=every)
    finally:
        await gateway.aclose()
    report.sort()
    return report


async def _sweep(run: Sweeper, plan: Plan, *, window_s: float, every: int) -> None:
    """The history first, then the sweeps in the order that lets each see what the one
    before settled: a resolved outcome is not re-published."""
    window = plan.until - dt.timedelta(seconds=window_s)
    await _history(run, plan, every=every)
    await _followups(run, since=window)
    if not run.dry_run:
        await followups.expire(run.conn, window)
        if plan.stores:  # after every read and repair it vouches for
            await checkpoint.store(run.conn, plan.until)
            run.report.checkpoint = plan.until
    await unknown_outcomes(run)
    await lost_messages(run)
    assert plan.settled_from is not None
    await discrepancies.discrepancies(run, settled_from=plan.settled_from, until=plan.until)


async def _history(run: Sweeper, plan: Plan, *, every: int) -> None:
    """Page through the history; decide each page's candidates before the next page, and,
    when the history is oldest first, every `every` pages store how far the run has got
    (the next run reads the overlap before it again). A history newest first (Stripe's) has
    read nothing whole until its last page: only the run's end stores it."""
    defer_from = int(plan.defer_from.timestamp()) if plan.defer_from else None
    oldest_first = run.gateway.history_order == "oldest_first"
    stored, stores = plan.previous, plan.stores and not run.dry_run and oldest_first
    history = pages(run.gateway, since=plan.since, until=plan.until, progress=run.progress)
    async with contextlib.aclosing(history):  # a failure here stops the page asked for next
        async for page in history:
            await _page(run, page, defer_from)
            if stores and page and run.report.pages % every == 0:
                newest = dt.datetime.fromtimestamp(max(c.created for c in page), dt.UTC)
                got = min(newest, plan.until)
                if stored is None or stored < got:
                    await checkpoint.store(run.conn, got)
                    stored = got


async def _page(run: Sweeper, page: list[GatewayCharge], defer_from: int | None) -> None:
    """Sort one page out, mark the rows it shows, decide its candidates."""
    run.report.pages += 1
    run.report.charges_seen += len(page)
    for charge in page:  # whose charges a key's lookup lists, should its row be gone
        if (key := ours(charge.order_id, charge.billing_period)) is not None:
            run.customers.setdefault(key, charge.customer)
    work = sort_page(page, await _recorded(run, page), defer_from=defer_from)
    await discrepancies.shown(run, work.shown)
    await _decide(run, [key for key in work.candidates if key not in run.decided])


async def _followups(run: Sweeper, *, since: dt.datetime) -> None:
    """Decide again the keys earlier runs left unsettled (not decided by this run yet)."""
    before = await run.conn.fetchval("SELECT now()")  # the clock `updated_at` is written by
    async for batch in followups.batches(run.conn, since=since, before=before):
        keys = [key for key in batch if key not in run.decided]
        run.report.followups += len(keys)
        await _decide(run, keys)


async def _recorded(run: Sweeper, page: list[GatewayCharge]) -> dict[Key, Recorded]:
    """The ledger rows of a page's keys, in one statement."""
    keys = sorted({key for c in page if (key := ours(c.order_id, c.billing_period)) is not None})
    rows = await run.conn.fetch(_RECORDED, [k[0] for k in keys], [k[1] for k in keys])
    return {
        (r["order_id"], r["billing_period"]): Recorded(
            r["status"], r["gateway_charge_id"], r["gateway_seen_charge_id"]
        )
        for r in rows
    }


async def _decide(run: Sweeper, keys: list[Key]) -> None:
    """Decide keys several at once; queue those left unsettled, drop the rest."""
    reasons: dict[Key, followups.Reason | None] = {}

    async def one(key: Key) -> None:
        reasons[key] = await decide(run, key)

    run.decided.update(keys)
    run.report.candidates += len(keys)
    await run.together(keys, one)
    if not run.dry_run:
        await followups.keep(run.conn, {k: r for k, r in reasons.items() if r is not None})
        await followups.drop(run.conn, sorted(k for k, r in reasons.items() if r is None))


@contextlib.asynccontextmanager
async def _ledger(cfg: DbSettings) -> AsyncIterator[asyncpg.Connection]:
    """One connection for the whole run: it holds the lock, and closing it releases it."""
    conn = await database.connect(cfg, application_name=APPLICATION)
    try:
        yield conn
    finally:
        await database.close_quietly(conn)


@contextlib.asynccontextmanager
async def _pool(cfg: DbSettings, size: int) -> AsyncIterator[asyncpg.Pool]:
    """Connections of the run besides its own (opened when first used), named as it is."""
    async with translated("cannot connect to the database"):
        pool = await asyncpg.create_pool(
            cfg.dsn,
            min_size=0,
            max_size=size,
            command_timeout=cfg.db_command_timeout_s,
            server_settings={"application_name": APPLICATION},
            reset=database.keep_session,
        )
    assert pool is not None
    try:
        yield pool
    finally:
        with contextlib.suppress(*database.DRIVER_ERRORS):
            await pool.close()
