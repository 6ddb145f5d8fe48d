"""Case 2s: the worker and the bare pipeline side by side, taking turns of `TURN_S`.

The drain samples (cases 1 and 2) run one after the other, 15-25 s each, and this VM's
speed drifts by a third within a minute: their ratio moves by 0.1-0.3 from run to run.
Here both pipelines drain at once, each on its own database and streams over the same
simulators, PostgreSQL and nats-server, but only one runs at a time: the harness stops the
other's processes (SIGSTOP) and swaps them every `TURN_S`. A turn is a short sample of one
pipeline alone on the machine; a drift slower than a turn falls on both alike.

Each turn's figures are read while both pipelines are stopped, between two turns: the
messages acked (the consumer's pending and ack-pending counts) and the CPU of every
process group. Each worker turn is then set against the bare pipeline's turns just before
and after it (`stats.against_moments`), as the drain samples are. The first `WARM_TURNS` of
each pipeline are left out (connections, the first fetch). Each backlog is sized to outlast
its turns at `MAX_RATE`; after the last turn both consumers are stopped gracefully,
mid-backlog.

A stop of 1 s is far inside every timeout the worker keeps (a lease, an ack wait, a
scoring deadline of 2 s counts from its request, which a stopped worker has not sent).
The relay's transaction, held across its publishes, may be stopped with it: the outbox
waits `2 x outbox_publish_timeout_s` before PostgreSQL ends it.

Same load as cases 1 and 2: zero latency, 1 customer in 10 declined (soft).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.js import JetStreamContext

from benchmarks import load, throughput
from benchmarks.bench import Bench
from benchmarks.drain import Consumers, Workers, delete_streams, disable_outbox, provision_paused
from benchmarks.processes import OTHER, STEAL, CpuMeter
from benchmarks.stats import against_moments, per_item_us, ratio
from charge_worker import streams
from charge_worker.settings import Settings

TURN_S = 1.0
WARM_TURNS = 1  # per pipeline, left out of the figures
MAX_RATE = 1500.0  # charges/s a pipeline could reach alone: the backlog outlasts the turns
PIPELINES = ("bare", "worker")


@dataclass(frozen=True)
class Turn:
    pipeline: str  # "bare" or "worker"
    started: float  # the harness's monotonic clock
    seconds: float
    acked: int
    cpu_s: dict[str, float]  # by process group; the pipeline's own consumer as "consumer"

    @property
    def midpoint(self) -> float:
        return self.started + self.seconds / 2

    @property
    def rate(self) -> float:
        return ratio(self.acked, self.seconds)

    def cpu_us_per_charge(self, group: str | None = None) -> float:
        """CPU µs per charge of one group, or of every group of the benchmark's (`None`;
        not the machine's other load, nor the time the hypervisor stole)."""
        if group is None:
            spent = sum(v for name, v in self.cpu_s.items() if name not in (OTHER, STEAL))
        else:
            spent = self.cpu_s.get(group, 0.0)
        return per_item_us(spent, self.acked)


@dataclass
class Sliced:
    turns: list[Turn] = field(default_factory=list)

    def measured(self, pipeline: str) -> list[Turn]:
        """The pipeline's turns but its first `WARM_TURNS`."""
        return [turn for turn in self.turns if turn.pipeline == pipeline][WARM_TURNS:]

    def against_bare(self, figure: str) -> list[float]:
        """Each measured worker turn's figure against the bare pipeline's at its moment:
        `rate`, `all` (the CPU per charge of every group), or a group's CPU per charge
        (`consumer`, `postgres`, ...)."""

        def value(turn: Turn) -> float:
            if figure == "rate":
                return turn.rate
            return turn.cpu_us_per_charge(None if figure == "all" else figure)

        bare = [(turn.midpoint, value(turn)) for turn in self.measured("bare")]
        if not bare:
            return []
        return against_moments(
            [(turn.midpoint, value(turn)) for turn in self.measured("worker")], bare
        )

    def as_json(self) -> dict[str, Any]:
        return {"turn_s": TURN_S, "turns": [dataclasses.asdict(turn) for turn in self.turns]}


def _signal(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


async def sliced_sample(bench: Bench, turns: int) -> Sliced:
    """`turns` turns of each pipeline (the first `WARM_TURNS` of each not counted)."""
    messages = int((turns + 1) * TURN_S * MAX_RATE)
    plan = throughput.zero_latency_plan(bench, messages)
    stack = bench.stack
    await stack.gateway.set_latency(bench.http, plan.gateway)
    await stack.scoring.set_latency(bench.http, plan.scoring)
    settings = {name: bench.settings(await stack.new_database()) for name in PIPELINES}
    log_dir = bench.log_dir / "sliced"
    log_dir.mkdir(exist_ok=True)
    consumers: dict[str, Consumers] = {
        "bare": throughput.bare_consumer(bench, settings["bare"], "bare-sliced"),
        "worker": Workers(settings["worker"], log_dir),
    }
    nc = await streams.connect(settings["bare"].nats, name="charge-worker-bench", reconnect=False)
    result = Sliced()
    started: list[str] = []
    try:
        js = nc.jetstream()
        for name in PIPELINES:
            cfg = settings[name].nats
            await provision_paused(js, settings[name])
            bench.say(f"2s, in turns: publishing {messages:,} messages for the {name} pipeline")
            await load.publish_backlog(
                nc,
                js,
                cfg.subject,
                cfg.stream,
                range(1, messages + 1),
                decline_every=plan.decline_every,
            )
        await disable_outbox(settings["bare"].db.dsn)
        for name in PIPELINES:
            consumers[name].start()
            started.append(name)
            bench.live.append(consumers[name])
        for name in PIPELINES:
            await consumers[name].wait_ready(bench.http)
        _signal(consumers["worker"].pids, signal.SIGSTOP)
        for name in PIPELINES:
            await js.resume_consumer(settings[name].nats.stream, settings[name].nats.durable)
        result.turns = await _take_turns(
            bench, js, settings, consumers, turns=turns, messages=messages
        )
    finally:
        for name in started:
            _signal(consumers[name].pids, signal.SIGCONT)
        for name in started:
            codes = await consumers[name].stop()
            if any(code != 0 for code in codes):
                bench.say(f"2s, in turns: WARNING: {name} exit codes {codes}")
            bench.live.remove(consumers[name])
        for name in PIPELINES:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await delete_streams(nc.jetstream(), settings[name].nats)
        await nc.close()
        for name in PIPELINES:
            await stack.drop_database(settings[name].db.dsn)
    return result


async def _take_turns(
    bench: Bench,
    js: JetStreamContext,
    settings: dict[str, Settings],
    consumers: dict[str, Consumers],
    *,
    turns: int,
    messages: int,
) -> list[Turn]:
    """The bare pipeline running, the worker stopped: `turns` turns of each, in turn, and
    one more of the bare pipeline, so that every worker turn has a bare turn on each side."""
    taken: list[Turn] = []
    acked = dict.fromkeys(PIPELINES, 0)
    servers = bench.stack.pids()
    for n in range(2 * turns + 1):
        name = PIPELINES[n % 2]
        meter = CpuMeter(servers | {"consumer": consumers[name].pids}, frozenset({"postgres"}))
        meter.start()
        started = time.monotonic()
        await asyncio.sleep(TURN_S)
        _signal(consumers[name].pids, signal.SIGSTOP)
        seconds = time.monotonic() - started
        cpu = meter.stop()
        cfg = settings[name].nats
        done = await load.acked(js, cfg.stream, cfg.durable, messages)
        taken.append(Turn(name, started, seconds, done - acked[name], cpu))
        acked[name] = done
        _signal(consumers[PIPELINES[(n + 1) % 2]].pids, signal.SIGCONT)
        if n % 10 == 9:
            bench.say(f"2s, in turns: {n + 1}/{2 * turns + 1} turns, acked {acked}")
    return taken
