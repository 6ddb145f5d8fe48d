"""What every case gets: the stack, an HTTP client, the sizes, a log directory, progress."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.drain import Consumers, Drained, Plan, drain, worker_settings
from benchmarks.stack import Stack
from charge_worker.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sizes:
    """How much each case does; `--quick` uses `QUICK`."""

    repeats: int
    throughput_messages: int  # bare pipeline and worker at zero latency
    latency_messages: int  # per worker process, latency-bound and incident cases
    memory_messages: int  # the memory case's goal
    memory_budget_s: float  # ...and the longest its drain may take
    paced_s: float  # the latency phase after each worker throughput sample
    sliced_turns: int  # case 2s: turns of each pipeline (`sliced.TURN_S` each)


# The default run ends near its 540 s budget (`runner.RUN_BUDGET_S`) on 2 cores: the
# throughput and latency groups take what they take, and the memory case gets what is left
# (fewer than 100,000 charges; see memory.py). `--quick` has a 300 s budget.
DEFAULT = Sizes(
    repeats=3,
    # a sample of 3,000 drained in ~3 s on a fast machine: one hiccup of the VM moved its
    # ratio by 0.1; 10,000 (~10 s) halved the spread of the samples (0.79-0.87, not 0.71-0.95)
    throughput_messages=10_000,
    latency_messages=600,
    memory_messages=100_000,
    memory_budget_s=600.0,
    paced_s=5.0,
    sliced_turns=20,
)
QUICK = Sizes(
    repeats=2,
    throughput_messages=1000,
    latency_messages=300,
    memory_messages=20_000,
    memory_budget_s=90.0,
    paced_s=3.0,
    sliced_turns=5,
)


@dataclass
class Bench:
    stack: Stack
    http: httpx.AsyncClient
    sizes: Sizes
    log_dir: Path
    started: float = field(default_factory=time.monotonic)
    live: list[Consumers] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def settings(self, database_url: str, **overrides: object) -> Settings:
        return worker_settings(self.stack, database_url, **overrides)

    async def sample(
        self, label: str, plan: Plan, settings: Settings, consumers: Consumers
    ) -> Drained:
        """One measured sample, with progress lines prefixed by `label`."""
        self.say(f"{label}: start")
        self.live.append(consumers)
        try:
            result = await drain(
                self.stack,
                self.http,
                plan,
                settings,
                consumers,
                progress=lambda text: self.say(f"{label}: {text}"),
            )
        finally:
            self.live.remove(consumers)
        self.say(
            f"{label}: {result.acked:,} in {result.seconds:.2f} s, steady {result.rate:,.0f}/s, "
            f"consumer CPU {result.cpu_us_per_charge():,.0f} us/charge"
        )
        return result
