"""The latest job runs and the oldest due charge, as gauges on every worker pod.

A side task of `charge-worker run` reads `job_runs` (runs.py) and the ledger's open rows
(backlog.py) every `INTERVAL_S` into the worker's registry. Every pod exports the same
values, so the rules take `max` over pods. Reconcile's figures carry exactly the names,
help and meaning of its `--metrics-file` (figures.py): the latest run that finished, its
start as `charge_worker_reconcile_last_run_timestamp_seconds`; like the textfile's, they
appear only once such a run exists. A read that fails logs one warning (`jobs.read_failed`)
and leaves every gauge as the last read set it.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import structlog
from prometheus_client import CollectorRegistry, Gauge

from charge_worker.database import translated
from charge_worker.errors import ChargeWorkerError
from charge_worker.event_loop import raise_if_cancelled
from charge_worker.jobs import backlog, runs
from charge_worker.jobs.figures import LAST_RUN, RECONCILE_GAUGES, RECONCILE_PREFIX

log = structlog.get_logger(__name__)

INTERVAL_S = 30.0
READ_TIMEOUT_S = 10.0  # a read that waits longer (a pool busy charging) is a failed one


class JobGauges:
    """The gauges, on `registry`; `show` sets them from one read."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.last_success = Gauge(
            "charge_worker_job_last_success_timestamp_seconds",
            "Unix time the job's last successful run finished (produce: exit status 0;"
            " reconcile: finished, every key handled; maintain: finished).",
            ["command"],
            registry=registry,
        )
        self.last_failure = Gauge(
            "charge_worker_job_last_failure_timestamp_seconds",
            "Unix time the job's last failed run finished (produce: exit status not 0;"
            " reconcile: ended early, or a key not handled; maintain: ended early).",
            ["command"],
            registry=registry,
        )
        self.oldest_due = Gauge(
            "charge_worker_oldest_due_unsettled_seconds",
            "Seconds since the oldest charge still scheduled or pending (not yet charged) was due"
            " (0: none).",
            registry=registry,
        )
        self.reconcile: dict[str, Gauge] = {}  # made at the first finished run read

    def show(self, latest: runs.Latest, oldest_due_s: float) -> None:
        """Set every gauge from one read."""
        for job, moment in latest.succeeded.items():
            self.last_success.labels(job).set(moment.timestamp())
        for job, moment in latest.failed.items():
            self.last_failure.labels(job).set(moment.timestamp())
        self.oldest_due.set(oldest_due_s)
        run = latest.reconciled
        if run is None:
            return
        if not self.reconcile:
            self.reconcile = {
                name: Gauge(f"{RECONCILE_PREFIX}_{name}", help_text, registry=self.registry)
                for name, help_text in RECONCILE_GAUGES.items()
            }
        for name, gauge in self.reconcile.items():
            gauge.set(run.started_at.timestamp() if name == LAST_RUN else run.summary.get(name, 0))

    async def refresh(self, pool: asyncpg.Pool) -> bool:
        """Read and show; False, logged, the gauges left as they were, when the read fails."""
        try:
            async with (
                asyncio.timeout(READ_TIMEOUT_S),
                translated("job runs"),
                pool.acquire() as conn,
            ):
                latest = await runs.latest(conn)
                oldest = await backlog.oldest_due_s(conn)
        except (ChargeWorkerError, TimeoutError) as error:
            log.warning("jobs.read_failed", error=" ".join(str(error).split()) or repr(error))
            return False
        self.show(latest, oldest)
        return True


async def export_job_runs(
    pool: asyncpg.Pool,
    registry: CollectorRegistry,
    stop: asyncio.Event,
    *,
    interval_s: float = INTERVAL_S,
) -> None:
    """Read the runs into gauges on `registry`, at once and every `interval_s`, until `stop`."""
    gauges = JobGauges(registry)
    while not stop.is_set():
        await gauges.refresh(pool)
        raise_if_cancelled()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
