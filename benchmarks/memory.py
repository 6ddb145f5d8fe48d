"""Case 6: the worker's resident memory after 10,000 charges and after many more.

One `charge-worker run` drains one large backlog at zero latency; each time another
10,000 messages are acked the harness reads the worker's RSS (`/proc`, via psutil). The
goal is 100,000 charges; when the throughput measured in case 2 says that would not fit
the run's time budget, the case drains the largest multiple of 10,000 that does, and the
report says so. Nothing is extrapolated into the figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.bench import Bench
from benchmarks.drain import Drained, Plan, Workers
from benchmarks.stats import growth
from benchmarks.throughput import ZERO

STEP = 10_000
MIN_MESSAGES = 2 * STEP
SAFETY = 0.85  # plan for a slower drain than case 2 measured


@dataclass(frozen=True)
class MemoryPlan:
    goal: int
    messages: int
    why: str


def plan_size(goal: int, budget_s: float, rate_per_s: float) -> MemoryPlan:
    """How many messages fit `budget_s` at `rate_per_s`, in steps of 10,000, up to `goal`."""
    fits = int(rate_per_s * SAFETY * budget_s) // STEP * STEP if rate_per_s > 0 else 0
    messages = max(min(goal, fits), MIN_MESSAGES)
    if messages >= goal:
        return MemoryPlan(goal, goal, f"{goal:,} charges fit the {budget_s:.0f} s budget")
    return MemoryPlan(
        goal,
        messages,
        f"{goal:,} charges would take ~{goal / rate_per_s:,.0f} s at the measured "
        f"{rate_per_s:,.0f}/s, over this run's {budget_s:.0f} s budget: measuring {messages:,}",
    )


@dataclass(frozen=True)
class MemoryResult:
    plan: MemoryPlan
    drained: Drained
    at_first_step: tuple[int, int]  # (acked, RSS bytes) at the first 10,000
    at_last_step: tuple[int, int]  # ... at the largest multiple of 10,000 reached

    @property
    def growth(self) -> float:
        """RSS growth from the first step to the last; NaN with only one step reached."""
        if self.at_last_step[0] <= self.at_first_step[0]:
            return math.nan
        return growth(self.at_first_step[1], self.at_last_step[1])

    def as_json(self) -> dict[str, Any]:
        return {
            "goal": self.plan.goal,
            "messages": self.plan.messages,
            "why": self.plan.why,
            "at_first_step": self.at_first_step,
            "at_last_step": self.at_last_step,
            "growth": self.growth,
            "drained": self.drained.as_json(),
        }


async def memory_case(bench: Bench, worker_rate: float) -> MemoryResult:
    """The memory case: as many charges as fit the budget, RSS at every 10,000."""
    sizes = bench.sizes
    plan = plan_size(sizes.memory_messages, sizes.memory_budget_s, worker_rate)
    bench.say(f"memory: {plan.why}")
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    log_dir = bench.log_dir / "memory"
    log_dir.mkdir(exist_ok=True)
    drain_plan = Plan(
        messages=plan.messages,
        gateway=ZERO,
        scoring=ZERO,
        timeout_s=max(sizes.memory_budget_s, 60.0),
        rss_every=STEP,
    )
    drained = await bench.sample("memory", drain_plan, settings, Workers(settings, log_dir))
    steps = [(acked, rss[0]) for acked, rss in drained.rss_by_acked]
    if drained.acked < plan.messages:
        plan = MemoryPlan(
            plan.goal,
            plan.messages,
            f"{plan.why}; the time budget ran out after {drained.acked:,}: "
            f"RSS is reported at the last 10,000 step reached",
        )
    if not steps:
        raise RuntimeError("the memory case did not reach 10,000 charges")
    return MemoryResult(plan, drained, steps[0], steps[-1])


def budget_left(total_s: float, elapsed_s: float, reserve_s: float) -> float:
    """Seconds the memory drain may take so the whole run ends within `total_s`."""
    return max(total_s - elapsed_s - reserve_s, 0.0)
