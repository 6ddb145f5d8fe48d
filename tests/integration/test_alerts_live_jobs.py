"""The jobs, reconcile, webhook-receiver and kill-switch alerts of `config/alerts.yml` on a
real Prometheus (tests/support/prometheus.py: every duration divided by 60), scraping a real
worker and a real webhook receiver: each fires, and each resolves once its cause is gone.

One Prometheus, one scenario. The worker pods export the job figures from PostgreSQL at their
start (and every 30 s): the test seeds `job_runs` and the ledger before the worker starts, and
restarts it to have it read the repaired state. The thresholds of these rules are numbers of
seconds in the expressions, not durations, so the runs are seeded that old (27 h, 51 h, 2 h)
and the due charge 7 h late.

1. Paused, with a produce run 27 h old, a maintain run 51 h old, a reconcile run 2 h old that
   found one of each finding, and a due charge 7 h late whose message was lost: the jobs and
   reconcile alerts fire, and so does ChargeWorkerWebhookReceiverAbsent (no receiver yet).
2. The receiver starts (its absence resolves) and is sent deliveries signed with a secret it
   does not hold, as after a botched rotation: ChargeWorkerWebhooksUnauthorized fires.
3. ChargeWorkerPaused fires, and ChargeWorkerDueChargesWaiting never left `inactive` while
   paused though the charge is over 6 h late: the inhibition.
4. Resume: ChargeWorkerDueChargesWaiting fires (the same charge, no longer inhibited) while
   every alert of steps 1-2 but the receiver's absence still fires.
5. Every cause removed: the lost message re-published and charged, good deliveries, fresh
   successful runs, a reconcile run with no finding, the worker restarted: all resolve.

ChargeWorkerWebhookReceiverAbsent and ChargeWorkerWebhooksUnauthorized cannot fire together
(the second needs a receiver to count refusals), nor can ChargeWorkerPaused and
ChargeWorkerDueChargesWaiting (the first inhibits the second): so the scenario goes in steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

import asyncpg
import httpx
import pytest
from nats.aio.client import Client

from charge_worker.admin.pause import pause, resume
from charge_worker.jobs.figures import RECONCILE_COUNTS
from charge_worker.jobs.runs import Job, record
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    PERIOD,
    RunningWorker,
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
    settings_for,
)
from tests.support.prometheus import (
    PROMETHEUS,
    alert_states,
    evaluated_after,
    prometheus,
    ready,
    rules_loaded,
    scraping,
    value,
)
from tests.support.webhooks import WRONG_SECRET, Receiver, event, running_receiver, webhook_settings

WAIT_S = 60.0  # generous: the longest `for:` here is ChargeWorkerPaused's 30 s
HOUR_S = 3600
PRODUCE = "ChargeWorkerProduceNotSucceeding"
MAINTAIN = "ChargeWorkerMaintainNotSucceeding"
RECONCILE = "ChargeWorkerReconcileNotRunning"
FINDINGS = {  # alert: the count of the run's summary that fires it
    "ChargeWorkerReconcileDoubleCharges": "double_charges",
    "ChargeWorkerReconcileDiscrepancies": "discrepancies",
    "ChargeWorkerReconcileUnmatchedCharges": "unmatched_charges",
    "ChargeWorkerReconcileUnrecordedCharges": "unrecorded_charges",
}
DUE = "ChargeWorkerDueChargesWaiting"
ABSENT = "ChargeWorkerWebhookReceiverAbsent"
UNAUTHORIZED = "ChargeWorkerWebhooksUnauthorized"
PAUSED = "ChargeWorkerPaused"
JOBS = (PRODUCE, MAINTAIN, RECONCILE, *FINDINGS)
NEW = (*JOBS, DUE, ABSENT, UNAUTHORIZED, PAUSED)
SUCCESS = "charge_worker_job_last_success_timestamp_seconds"
REFUSED = 'charge_worker_webhook_deliveries_total{result="unauthorized"}'
ORDER = 1  # the due charge whose message was lost

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus not installed: apt-get install prometheus"
    ),
]


async def ran(
    conn: asyncpg.Connection, job: Job, *, hours_ago: float = 0, **summary: object
) -> None:
    """A successful run of `job` that finished `hours_ago`."""
    finished = dt.datetime.now(dt.UTC) - dt.timedelta(hours=hours_ago)
    started = finished - dt.timedelta(minutes=1)
    await record(conn, job, started_at=started, ok=True, summary=summary)
    await conn.execute(  # finished_at is the database's now(): moved back
        "UPDATE job_runs SET finished_at = $1 WHERE id = (SELECT max(id) FROM job_runs)", finished
    )


def reconciled(**found: int) -> dict[str, int]:
    """A finished reconcile run's summary: every count 0 but `found`."""
    return dict.fromkeys(RECONCILE_COUNTS, 0) | found


async def due_row(conn: asyncpg.Connection, order_id: int, *, late_h: float) -> None:
    """A charge `scheduled` since it was due `late_h` hours ago, its message lost."""
    await conn.execute(
        "INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,"
        " customer_id, amount_minor, currency, due_at, status)"
        " VALUES ($1, $2, $3, $4, 'cus_ok', 99000, 'RUB', now() - make_interval(hours => $5),"
        " 'scheduled')",
        order_id,
        PERIOD,
        f"{order_id}:{PERIOD.isoformat()}",
        f"sub_{order_id}",
        late_h,
    )


class Refusals:
    """A botched secret rotation: the gateway's deliveries signed with a secret the receiver
    does not hold, in bursts that keep more than the rule's 10 refusals in its window (15 m,
    here 15 s) as Prometheus sees it, until `stop`."""

    BURST = 12
    KEEP = 20  # another burst once the window, as scraped, holds fewer than this

    def __init__(self, receiver: Receiver, prom: httpx.AsyncClient) -> None:
        self.receiver = receiver
        self.prom = prom
        self.sent = 0
        self.stop = asyncio.Event()

    async def turn(self) -> bool:
        """One turn of the sender; True once told to stop."""
        if self.stop.is_set():
            return True
        if await value(self.prom, f"sum({REFUSED})") < self.sent:
            return False  # the last burst not scraped yet
        if await value(self.prom, f"sum(increase({REFUSED}[15s]))") < self.KEEP:
            bodies = [event("ch_any", order_id=ORDER) for _ in range(self.BURST)]
            answers = await asyncio.gather(
                *(self.receiver.post(body, secret=WRONG_SECRET) for body in bodies)
            )
            assert {a.status_code for a in answers} == {401}
            self.sent += self.BURST
        return False


async def states_are(
    prom: httpx.AsyncClient,
    wanted: Collection[str],
    state: str,
    *,
    quiet: Collection[str] = (),
) -> bool:
    """Every alert of `wanted` in `state` (`inactive`: not listed); asserts that every alert
    of `quiet` is inactive meanwhile."""
    states = await alert_states(prom)
    woke = {name: states[name] for name in quiet if name in states}
    assert not woke, f"expected inactive: {woke}"
    return all(states.get(name, "inactive") == state for name in wanted)


def waiting_for(
    prom: httpx.AsyncClient, wanted: Collection[str], state: str, *, quiet: Collection[str] = ()
) -> Callable[[], Awaitable[bool]]:
    """`states_are` as `eventually` polls it."""
    return lambda: states_are(prom, wanted, state, quiet=quiet)


async def worker_read(worker: RunningWorker, *, paused: bool) -> bool:
    """The worker has read the consumer's pause and the job runs."""
    return (
        worker.metric("charge_worker_paused") == float(paused)
        and worker.metric(SUCCESS, command="produce") > 0
    )


async def test_the_jobs_reconcile_receiver_and_pause_alerts_fire_and_resolve(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    tmp_path: Path,
) -> None:
    settings: Settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        metrics_port=free_port(),  # the same target across the worker's restart
        stats_interval_s=0.2,
        fetch_wait_s=0.2,
    )
    base = webhook_settings(database_url, gateway_sim.url)
    receiving = base.model_copy(
        update={"webhooks": base.webhooks.model_copy(update={"webhook_port": free_port()})}
    )
    targets = [
        f"127.0.0.1:{settings.http.metrics_port}",
        f"127.0.0.1:{receiving.webhooks.webhook_port}",
    ]
    cfg = settings.nats
    js = await provisioned(nc, settings)
    conn = await asyncpg.connect(database_url)
    try:
        await ran(conn, "produce", hours_ago=27, due=1)  # ChargeWorkerProduceNotSucceeding: 26 h
        await ran(conn, "maintain", hours_ago=51)  # ChargeWorkerMaintainNotSucceeding: 50 h
        found = dict.fromkeys(FINDINGS.values(), 1) | {"refunds": 1, "ledger_repaired": 1}
        await ran(conn, "reconcile", hours_ago=2, **reconciled(**found))  # NotRunning: 1 h
        await due_row(conn, ORDER, late_h=7)  # ChargeWorkerDueChargesWaiting: 6 h
        await pause(js, cfg, reason="alerts test", by="test", now=dt.datetime.now(dt.UTC))

        async with contextlib.AsyncExitStack() as stack:
            first = contextlib.AsyncExitStack()
            stack.push_async_callback(first.aclose)
            worker = await first.enter_async_context(running_worker(settings))
            # read before the first scrape: a worker exports `paused` 0 until it has read it
            await eventually(lambda: worker_read(worker, paused=True), "the worker read it all")
            url = stack.enter_context(prometheus(tmp_path, targets))
            prom = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
            await eventually(lambda: ready(prom), "Prometheus ready", within_s=WAIT_S)
            await eventually(lambda: scraping(prom, 1), "the worker scraped")
            await rules_loaded(prom)

            # 1. the jobs and findings, and no receiver
            await eventually(
                waiting_for(prom, (*JOBS, ABSENT), "firing", quiet=(DUE,)),
                "the jobs, reconcile and receiver-absent alerts firing",
                within_s=WAIT_S,
            )

            # 2. the receiver back, refusing a rotated-away secret
            receiver = await stack.enter_async_context(running_receiver(receiving))
            await eventually(lambda: scraping(prom, 2), "the receiver scraped")
            await eventually(
                waiting_for(prom, (ABSENT,), "inactive", quiet=(DUE,)),
                f"{ABSENT} resolved",
                within_s=WAIT_S,
            )
            refusals = Refusals(receiver, prom)
            sender = asyncio.create_task(
                eventually(refusals.turn, "told to stop refusing", within_s=10 * WAIT_S)
            )
            stack.push_async_callback(lambda: asyncio.wait_for(sender, WAIT_S))
            stack.callback(refusals.stop.set)
            await eventually(
                waiting_for(prom, (UNAUTHORIZED,), "firing", quiet=(DUE,)),
                f"{UNAUTHORIZED} firing",
                within_s=WAIT_S,
            )

            # 3. the kill switch on for "30 minutes"; the charge late all along, not told
            await eventually(
                waiting_for(prom, (PAUSED,), "firing", quiet=(DUE,)),
                f"{PAUSED} firing",
                within_s=WAIT_S,
            )
            assert await value(prom, "max(charge_worker_oldest_due_unsettled_seconds)") > 6 * HOUR_S
            assert await value(prom, "max(charge_worker_paused)") == 1

            # 4. resumed: the same late charge is told
            await resume(js, cfg)
            await eventually(waiting_for(prom, (DUE,), "firing"), f"{DUE} firing", within_s=WAIT_S)
            states = await alert_states(prom)
            assert {name: states.get(name, "inactive") for name in NEW} == dict.fromkeys(
                NEW, "firing"
            ) | {PAUSED: "inactive", ABSENT: "inactive"}

            # 5. every cause removed
            await publish(js, cfg.subject, due(ORDER))  # as reconcile re-publishes a lost one
            await eventually(lambda: charged(conn, ORDER), "the late charge made", within_s=WAIT_S)
            refusals.stop.set()
            await asyncio.wait_for(sender, WAIT_S)
            charge_id = await conn.fetchval(
                "SELECT gateway_charge_id FROM charge_attempts WHERE order_id = $1", ORDER
            )
            good = [event(charge_id, order_id=ORDER) for _ in range(refusals.sent + 1)]
            answers = await asyncio.gather(*(receiver.post(body) for body in good))
            assert {a.status_code for a in answers} == {200}  # more than were refused
            await ran(conn, "produce", due=1)
            await ran(conn, "maintain")
            await ran(conn, "reconcile", **reconciled())
            await first.aclose()  # a worker reads the runs at its start
            worker = await stack.enter_async_context(running_worker(settings))
            await eventually(lambda: worker_read(worker, paused=False), "the worker read it all")
            # resolved on what the restarted worker read, not for its series missing while
            # it restarted: rules evaluated once Prometheus holds the fresh figures
            produced = worker.metric(SUCCESS, command="produce")
            await eventually(lambda: scraped(prom, produced), "the fresh runs scraped")
            seen = time.time()
            await eventually(lambda: evaluated_after(prom, seen + 1), "the rules evaluated on them")
            await eventually(
                waiting_for(prom, NEW, "inactive"), "every new alert resolved", within_s=WAIT_S
            )
    finally:
        await conn.close()


async def scraped(prom: httpx.AsyncClient, produced: float) -> bool:
    """Prometheus holds the produce run the worker read last."""
    return abs(await value(prom, f'max({SUCCESS}{{command="produce"}})') - produced) < 1e-3


async def charged(conn: asyncpg.Connection, order_id: int) -> bool:
    status = await conn.fetchval("SELECT status FROM charge_attempts WHERE order_id = $1", order_id)
    return bool(status == "succeeded")
