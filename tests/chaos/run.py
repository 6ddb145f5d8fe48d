"""One scenario end to end: plan, publish, attack, heal, wait for quiet, judge.

`run_scenario` returns a `Result`; its `report()` is what a failing test or `make chaos`
prints: the verdict, the stats, the seed, the chronicle and `charge-worker explain` for the
first bad keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.client import Client

from charge_worker.sandbox.gateway.app import GatewayConfig
from charge_worker.sandbox.scoring import ScoringConfig
from tests.chaos import checker, generator, nemesis
from tests.chaos.cluster import Chronicle, Cluster, Completed, Servers, cluster, connect_direct
from tests.chaos.scenarios import Scenario

EXPLAIN_AT_MOST = 5
MIN_ATTACKS = 2  # the fault phase lasts until every nemesis struck this often
RECONCILE_EVERY_S = 5.0
PRODUCE_WITHIN_S = 600.0  # the producer's runs may fail (faults) for this long in all
PRODUCE_EVERY_S = (0.5, 1.0)  # a scenario's `producers` run again after this long


class NotQuiet(AssertionError):
    """The system did not get quiet within the scenario's bound: itself a failure."""


@dataclass
class Result:
    scenario: Scenario
    seed: int
    size: int
    verdict: checker.Verdict
    chronicle: Chronicle
    timings: dict[str, Any] = field(default_factory=dict)
    explained: dict[str, str] = field(default_factory=dict)
    not_quiet: str | None = None

    @property
    def attacked(self) -> bool:
        """Every nemesis struck at least `MIN_ATTACKS` times: else the run proved nothing."""
        needed = self.scenario.attacks(MIN_ATTACKS)
        return all(self.chronicle.attacks[name] >= n for name, n in needed.items())

    @property
    def passed(self) -> bool:
        return self.not_quiet is None and not self.verdict.fatal and self.attacked

    def row(self) -> dict[str, Any]:
        """The figures of `make chaos`'s table and JSON."""
        return {
            "scenario": self.scenario.name,
            "seed": self.seed,
            "keys": self.size,
            "outcomes": dict(sorted(self.verdict.outcomes.items())),
            "attacks": dict(self.chronicle.attacks),
            **self.verdict.stats,
            **self.timings,
            "passed": self.passed,
        }

    def report(self) -> str:
        lines = [
            f"scenario {self.scenario.name} ({self.scenario.what}), seed {self.seed}, "
            f"{self.size} keys: {'PASSED' if self.passed else 'FAILED'}",
            f"outcomes: {dict(self.verdict.outcomes)}",
            f"stats: {json.dumps(self.verdict.stats | self.timings)}",
        ]
        if self.not_quiet:
            lines.append(f"NOT QUIET: {self.not_quiet}")
        if not self.attacked:
            lines.append(f"NOT ATTACKED ENOUGH: {dict(self.chronicle.attacks)}")
        lines += [f"BAD {key}: {outcome} {detail}" for key, outcome, detail in self.verdict.bad]
        lines += ["chronicle:", self.chronicle.render()]
        for key, story in self.explained.items():
            lines += [f"--- charge-worker explain {key}", story]
        return "\n".join(lines)


async def run_scenario(
    servers: Servers, scenario: Scenario, *, size: int, seed: int, root: Path
) -> Result:
    chronicle = Chronicle()
    entries = generator.plan(
        seed,
        size,
        poison_share=scenario.poison_share,
        conflicts=scenario.conflicts,
        retry_schedule=scenario.retry_schedule,
        processing_share=scenario.processing_share,
    )
    root.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240  # once, before anything runs
    generator.write_manifest(root / "manifest.jsonl", entries)
    chronicle("harness", f"manifest: {len(entries)} keys, seed {seed}")
    async with cluster(
        servers,
        root,
        chronicle,
        gateway=GatewayConfig(seed=seed, **scenario.gateway),
        scoring=ScoringConfig(seed=seed, **scenario.scoring),
        overrides=scenario.settings
        | (scenario.full_settings if size > scenario.quick_size else {}),
    ) as system:
        nc = await connect_direct(system)
        try:
            return await _attack_and_judge(system, nc, scenario, entries, seed, size)
        finally:
            await nc.close()


async def _attack_and_judge(
    system: Cluster,
    nc: Client,
    scenario: Scenario,
    entries: list[generator.Entry],
    seed: int,
    size: int,
) -> Result:
    chronicle = system.chronicle
    await generator.load_subscriptions(system.database_url, entries)
    stop_faults, stop_supervisor = asyncio.Event(), asyncio.Event()
    stop_producers = asyncio.Event()
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    producing: asyncio.Task[None] | None = None
    if scenario.purge_fraction:
        await _produce(system)
        await _purge(system, nc, scenario.purge_fraction, rng)
    system.spawn(scenario.workers)
    tasks.append(asyncio.create_task(system.supervise(stop_supervisor)))
    tasks += [
        asyncio.create_task(nemesis.run(n, system, random.Random(rng.random()), stop_faults))
        for n in scenario.nemeses
    ]
    cron = asyncio.create_task(_cron_reconcile(system, stop_faults))
    tasks.append(cron)
    started = time.monotonic()
    try:
        if not scenario.purge_fraction:
            await _produce(system)
        # from now on the scenario's producers start due tries and publish them, until quiet
        producing = asyncio.create_task(
            _producers(system, scenario.producers, random.Random(seed), stop_producers)
        )
        extras = generator.extras(entries)
        await generator.publish_all(nc.jetstream(), system.settings.nats.subject, extras)
        chronicle("harness", f"published {len(extras)} direct copies and poison")
        await _until_done_or(
            system, nc, scenario, scenario.fault_window_s - (time.monotonic() - started)
        )
        stop_faults.set()
        cron.cancel()  # a sweep against the slow gateway may run for minutes
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        system.heal()
        system.deploy_fix()
        chronicle("harness", "faults stopped, everything healed")
        if scenario.produce_after_faults:  # the subscriptions' advance may be lost too
            await _produce(system)
        faults_over = time.monotonic()
        not_quiet = None
        try:
            await _quiesce(system, nc, scenario.quiet_within_s)
        except NotQuiet as error:
            not_quiet = str(error)
        converged = time.monotonic() - faults_over
        # the relays run in the workers, kept alive by the supervisor until the outbox drained
        if not await checker.outbox_drained(system.database_url):
            chronicle("harness", f"the outbox did not drain in {checker.OUTBOX_DRAIN_S:g}s")
    finally:
        stop_faults.set()
        stop_producers.set()
        await asyncio.gather(*([producing] if producing else []), return_exceptions=True)
        stop_supervisor.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    facts = await checker.gather(system.gateway.url, system.database_url, nc, system.direct_nats)
    retries = system.settings.retries
    verdict = checker.judge(
        entries,
        facts,
        ledger_forgets=scenario.ledger_forgets,
        doubles_possible=scenario.gateway.get("idempotency_enabled", True) is False,
        # every try of a run starts within 30 days: the cap bounds them all
        tries_allowed=min(1 + len(retries.retry_schedule), retries.retry_cap_30d),
    )
    timings = {
        "worker_restarts": system.restarts,
        "converge_after_faults_s": round(converged, 1),
        "run_s": round(time.monotonic() - started, 1),
        **await _stalls(system),
        **await _leases(system),
        **system.chronicle.figures,
    }
    result = Result(scenario, seed, size, verdict, chronicle, timings, not_quiet=not_quiet)
    if not result.passed:
        for key, _, _ in verdict.bad[:EXPLAIN_AT_MOST]:
            result.explained[key] = await _explain(system, key)
    return result


async def _produce(system: Cluster) -> None:
    """`charge-worker produce` until it exits 0, like a CronJob with retries.

    Bounded in time, not tries: under a nats-server restart every few seconds each run gets
    a few seconds of work done (what it published stays published) before its connection
    is lost, and a large manifest needs many such runs.
    """
    deadline, attempt = time.monotonic() + PRODUCE_WITHIN_S, 0
    while True:
        attempt += 1
        done = await system.command("produce", "--date", generator.PERIOD.isoformat(), "--json")
        system.chronicle("producer", f"attempt {attempt}: exit {done.returncode}")
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"produce kept failing for {PRODUCE_WITHIN_S:g}s ({attempt} runs); the last:"
                f" stdout {done.stdout[-1500:]!r} stderr {done.stderr[-1500:]!r}"
            )
        await asyncio.sleep(1.0)


async def _producers(system: Cluster, count: int, rng: random.Random, stop: asyncio.Event) -> None:
    """`count` runs of `charge-worker produce` at once, again every 0.5-1 s until `stop`:
    each starts the tries that came due and publishes them (nothing else is due after the
    first run). Their figures go to the chronicle's: runs, failed runs, tries started,
    messages JetStream dropped as another run's."""
    figures = system.chronicle.figures
    while count and not stop.is_set():
        runs = await asyncio.gather(
            *(
                system.command("produce", "--date", generator.PERIOD.isoformat(), "--json")
                for _ in range(count)
            )
        )
        for done in runs:
            figures["produce_runs"] = figures.get("produce_runs", 0) + 1
            try:
                summary = json.loads(done.stdout)
                started, dropped = int(summary["tries_started"]), int(summary["deduplicated"])
            except (ValueError, KeyError, TypeError):
                started, dropped = 0, 0
            figures["tries_started"] = figures.get("tries_started", 0) + started
            # a message another run published too, dropped by JetStream: runs overlapped
            figures["produce_deduplicated"] = figures.get("produce_deduplicated", 0) + dropped
            if done.returncode != 0:
                figures["produce_failed"] = figures.get("produce_failed", 0) + 1
                system.chronicle("producer", f"exit {done.returncode}: {_summary(done)}")
            elif started:
                system.chronicle("producer", f"started {started} tries")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(*PRODUCE_EVERY_S))


async def _purge(system: Cluster, nc: Client, fraction: float, rng: random.Random) -> None:
    """A broker that lost acknowledged messages: delete some before any worker saw them."""
    js = nc.jetstream()
    stream = system.settings.nats.stream
    state = (await js.stream_info(stream)).state
    doomed = [s for s in range(state.first_seq, state.last_seq + 1) if rng.random() < fraction]
    for seq in doomed:
        await js.delete_msg(stream, seq)
    system.chronicle("nemesis", f"deleted {len(doomed)} of {state.messages} stream messages")


async def _open_work(system: Cluster, nc: Client) -> dict[str, int]:
    """What is not done yet: messages pending or unacked, open ledger rows (`processing`
    ones too: the bank settles them, reconcile records it), periods whose next try is to
    come, deferred checks, outcome events not in their stream yet.

    Empty when the system is quiet."""
    cfg = system.settings.nats
    info = await nc.jetstream().consumer_info(cfg.stream, cfg.durable)
    conn = await asyncpg.connect(system.database_url)
    try:
        row = await conn.fetchrow(
            """SELECT (SELECT count(*) FROM charge_attempts
                        WHERE status IN ('scheduled', 'pending', 'processing'))
                        AS open_rows,
                      (SELECT count(*) FROM charge_attempts
                        WHERE status = 'retry_scheduled') AS tries_to_come,
                      (SELECT count(*) FROM deferred_scoring_checks
                        WHERE status = 'pending') AS deferred_checks,
                      (SELECT count(*) FROM charge_outcomes
                        WHERE sent_at IS NULL) AS unsent_events"""
        )
    finally:
        await conn.close()
    counts = {"pending": info.num_pending, "unacked": info.num_ack_pending, **dict(row or {})}
    return {name: int(count) for name, count in counts.items() if count}


async def _until_done_or(system: Cluster, nc: Client, scenario: Scenario, within_s: float) -> None:
    """Until the work is done and every nemesis struck `MIN_ATTACKS` times, or `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        needed = scenario.attacks(MIN_ATTACKS).items()
        struck = all(system.chronicle.attacks[name] >= n for name, n in needed)
        with contextlib.suppress(Exception):  # a server may be down right now
            if struck and not await _open_work(system, nc):
                return
        await asyncio.sleep(0.5)


async def _cron_reconcile(system: Cluster, stop: asyncio.Event) -> None:
    """`charge-worker reconcile` every few seconds while the faults last, as its CronJob."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RECONCILE_EVERY_S)
        if not stop.is_set():
            swept = await system.command("reconcile", "--json")
            system.chronicle("reconcile", f"exit {swept.returncode}: {_summary(swept)}")


async def _quiesce(system: Cluster, nc: Client, within_s: float) -> None:
    """Reconcile, then nothing open; again until a sweep finds nothing to do."""
    deadline = time.monotonic() + within_s
    open_work: dict[str, int] | None = None
    while time.monotonic() < deadline:
        swept = await system.command("reconcile", "--json")
        system.chronicle("reconcile", f"exit {swept.returncode}: {_summary(swept)}")
        wait_until = min(deadline, time.monotonic() + 15.0)
        while time.monotonic() < wait_until:
            with contextlib.suppress(Exception):
                open_work = await _open_work(system, nc)
                if not open_work:
                    break
            await asyncio.sleep(0.5)
        if open_work == {} and _nothing_done(swept.stdout):
            system.chronicle("harness", "quiet")
            return
    raise NotQuiet(f"still open after {within_s:.0f}s: {open_work} (see the chronicle)")


def _summary(done: Completed) -> str:
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return (done.stdout + done.stderr).strip()[-600:]
    return json.dumps(report.get("counts", report))[:300]


def _nothing_done(stdout: str) -> bool:
    """A sweep that ran and found nothing to refund, resolve or re-publish."""
    try:
        report = json.loads(stdout)
    except ValueError:
        return False
    counts = report.get("counts", {})
    work = ("double_charges", "unrecorded_charges", "unknown_resolved", "republished", "errors")
    return bool(report.get("ran")) and not any(counts.get(k) for k in work)


async def _stalls(system: Cluster) -> dict[str, Any]:
    """`stall_s`: the longest gap between settled deliveries from the first fault on (no
    delivery while work was left); per outage, seconds from its end to the next delivery."""
    first_fault = system.chronicle.first_fault
    if first_fault is None:
        return {}
    conn = await asyncpg.connect(system.database_url)
    try:
        times = [
            row["at"].timestamp()
            for row in await conn.fetch(
                "SELECT at FROM charge_events WHERE kind = 'delivery' AND at > $1 ORDER BY at",
                dt.datetime.fromtimestamp(first_fault, dt.UTC),
            )
        ]
        after_outages = []
        for _, ended in system.chronicle.outages:
            first = next((at for at in times if at > ended), None)
            if first is not None:
                after_outages.append(first - ended)
    finally:
        await conn.close()
    gaps = [b - a for a, b in zip([first_fault, *times], times, strict=False)]
    figures = {"stall_s": round(max(gaps), 2)} if gaps else {}
    if after_outages:
        figures["stall_after_outage_max_s"] = round(max(after_outages), 2)
    return figures


async def _leases(system: Cluster) -> dict[str, int]:
    """Deliveries that met a lease: another worker's live one (`lease_held`: a redelivery
    while the first worker was still at it), an expired one taken over (`taken_over`)."""
    conn = await asyncpg.connect(system.database_url)
    try:
        row = await conn.fetchrow(
            """SELECT count(*) FILTER (WHERE detail->>'outcome' = 'lease_held') AS lease_held,
                      count(*) FILTER (WHERE detail->>'taken_from' IS NOT NULL) AS taken_over
                 FROM charge_events WHERE kind = 'delivery'"""
        )
    finally:
        await conn.close()
    return {name: int(count) for name, count in dict(row or {}).items()}


async def _explain(system: Cluster, key: str) -> str:
    order_id, _, period = key.partition(":")
    if not period:
        return "(poison: no charge key)"
    done = await system.command("explain", order_id, period, "--gateway")
    return done.stdout or done.stderr
