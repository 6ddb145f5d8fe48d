"""`charge-worker reconcile`: the gateway's history against the ledger, every 15 minutes.

Seven sweeps, in this order (`charges.py`, `sweeps.py`): record charges the gateway made
for keys whose ledger row was lost altogether (a database failover), refund proven double
charges, record charges the gateway made for rows the ledger said no to, resolve unknown
outcomes by lookup, recover quiet rows whose message no longer waits in the stream
(recorded from a lookup, else re-published: a broker that lost acknowledged messages
loses no charge), report charges the ledger has and the gateway does not, and report
captured charges not proven a key's own (for a person: never refunded). Nothing here ever
charges; the worker's claim keeps every re-published charge to at most one. The findings:
`report.py`.

A real run holds a PostgreSQL session advisory lock (`LOCK_KEY`) on its one ledger
connection for its whole length: a second run finds it taken, says so and exits 0. A dry
run writes nothing, so it takes no lock and never keeps the CronJob's run from working.
Driver errors (asyncpg, httpx, nats) become domain errors at this module's edge.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import database, privileges, streams
from charge_worker.database import translated
from charge_worker.errors import (
    ChargeWorkerError,
    DependencyUnavailable,
    PermanentError,
    TransientError,
)
from charge_worker.gateway import GatewayClient
from charge_worker.reconcile.charges import (
    discrepancies,
    double_charges,
    forgotten_charges,
    unrecorded_charges,
)
from charge_worker.reconcile.history import fetch_history
from charge_worker.reconcile.report import Report, table, to_json, write_metrics
from charge_worker.reconcile.sweeps import Sweeper, lost_messages, unknown_outcomes
from charge_worker.settings import DbSettings, NatsSettings, Settings

# Any constant of reconcile's own; "reconcil" in ASCII (migrate.py's is "charge-w").
LOCK_KEY = 0x7265636F6E63696C
SKIPPED = "another reconcile is running (it holds the advisory lock)"


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
    """
    try:
        report = await run_reconcile(settings, since=since, dry_run=dry_run, progress=_stderr)
    except ChargeWorkerError as error:
        _stderr(f"Error: {type(error).__name__}: {_one_line(error)}")
        return 1
    code = 0 if report.skipped else report.exit_code(fail_on_discrepancy=fail_on_discrepancy)
    if as_json:
        print(json.dumps(to_json(report, exit_code=code), ensure_ascii=False, default=str))
    else:
        for line in table(report):
            print(line)
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
    progress: Callable[[str], None] = lambda _line: None,
) -> Report:
    """Run the six sweeps once and return what they found and did.

    `since` defaults to `reconcile_window_s` ago. Returns a `Report` with `skipped` set
    when another (non-dry) run holds the lock. Raises `DependencyUnavailable` when
    PostgreSQL, the gateway or NATS cannot be reached (or `SettingsError` when one is
    not configured); a key that fails on its own is in `Report.failures` instead.
    """
    started = dt.datetime.now(dt.UTC)
    report = Report(
        started_at=started,
        since=since or started - dt.timedelta(seconds=settings.reconcile.reconcile_window_s),
        dry_run=dry_run,
    )
    gateway = GatewayClient(settings.gateway)  # checks GATEWAY_URL / GATEWAY_API_KEY first
    try:
        async with _ledger(settings.db) as conn, translated():
            await privileges.require(conn, privileges.RECONCILE)
            if not dry_run and not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
                report.skipped = SKIPPED
                return report
            async with _NatsRepublisher(settings.nats) as publisher:
                sweeper = Sweeper(
                    conn,
                    gateway,
                    publisher,
                    report,
                    quiet_s=settings.reconcile.reconcile_quiet_s,
                    dry_run=dry_run,
                    progress=progress,
                )
                await _sweep(sweeper, since=report.since, until=started)
    finally:
        await gateway.aclose()
    return report


async def _sweep(run: Sweeper, *, since: dt.datetime, until: dt.datetime) -> None:
    """History first (doubles need it whole), then the sweeps in the order that lets each
    see what the one before settled: a resolved outcome is not re-published."""
    history = await fetch_history(run.gateway, since=since, until=until, progress=run.progress)
    run.report.pages, run.report.charges_seen = history.pages, len(history.charges)
    await forgotten_charges(run, history)
    await double_charges(run, history)
    await unrecorded_charges(run, history)
    await unknown_outcomes(run)
    await lost_messages(run)
    await discrepancies(run, history, since=since)


@contextlib.asynccontextmanager
async def _ledger(cfg: DbSettings) -> AsyncIterator[asyncpg.Connection]:
    """One connection for the whole run: it holds the lock, and closing it releases it."""
    conn = await database.connect(cfg, application_name="charge-worker reconcile")
    try:
        yield conn
    finally:
        await database.close_quietly(conn)


class _NatsRepublisher:
    """The charges stream over one NATS connection, opened on first use."""

    def __init__(self, cfg: NatsSettings) -> None:
        self.cfg = cfg
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None

    async def __aenter__(self) -> _NatsRepublisher:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self.nc.close()

    async def _connected(self) -> tuple[Client, JetStreamContext]:
        if self.nc is None or self.js is None:
            self.nc = await streams.connect(
                self.cfg, name="charge-worker-reconcile", reconnect=False
            )
            self.js = self.nc.jetstream()
        return self.nc, self.js

    async def position(self) -> streams.Position:
        """Where the consumer stands: which quiet rows still have a message waiting."""
        nc, _ = await self._connected()
        return await streams.position(nc, self.cfg)

    async def republish(self, body: bytes, msg_id: str) -> int:
        """Publish and wait for the stream's ack; return its sequence."""
        _, js = await self._connected()
        subject = self.cfg.subject
        try:
            ack = await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError) as error:
            raise DependencyUnavailable(f"JetStream could not store {subject}: {error}") from error
        except nats.js.errors.APIError as error:
            raise PermanentError(f"JetStream refused the message: {error.description}") from error
        except (nats.errors.Error, OSError) as error:
            raise DependencyUnavailable(f"NATS publish to {subject}: {error!r}") from error
        if ack.duplicate:  # only another publish with this msg id in the same second
            raise TransientError(f"JetStream dropped {msg_id} as a duplicate")
        return ack.seq
