"""Where the CPU goes: cProfile of the worker and of the bare pipeline at saturation.

py-spy is not installed, and `src/` is not the harness's to change, so the worker is
profiled by running its own entry point in-process under cProfile: this module's `worker`
command does what `charge-worker run` does (`load_settings`, `logs.configure`,
`run_worker` until SIGTERM) with a profiler around it, in a child process started with
the same environment as the real worker. The bare pipeline has a `--profile` flag.

The profiler's clock is `time.process_time` (CPU, not wall time), so waiting in epoll
costs nothing and the shares are shares of CPU. cProfile's own overhead inflates every
Python call (roughly 1.5-2x here), so these runs are not timed: only the split is used.
Functions are grouped by the package that owns their code.
"""

from __future__ import annotations

import cProfile
import pstats
import signal
import sys
import sysconfig
import time
import tracemalloc
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench import ROOT, Bench
from benchmarks.drain import ChildConsumer, Drained, Plan, child_env
from benchmarks.processes import Child, python_argv
from benchmarks.throughput import bare_consumer, zero_latency_plan
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import HttpSettings, Settings, env_name

TOP_FUNCTIONS = 20
TRACE_FRAMES = 6
# Steps of one charge: (file, function, label). A coroutine's cumulative time is the CPU of
# its synchronous stretches between awaits, callees included; I/O callbacks run by the
# event loop (protocols parsing answers) are not under them.
STEPS = {
    "worker": (
        ("charge_worker/worker/consumer.py", "_handle", "one delivery, whole (all below)"),
        ("charge_worker/messages.py", "parse", "  parse + validate the message (pydantic)"),
        ("charge_worker/ledger.py", "claim", "  ledger claim (INSERT ... RETURNING)"),
        ("charge_worker/scoring.py", "score", "  scoring call (breaker, deadline, httpx)"),
        ("charge_worker/gateway/contract.py", "charge", "  gateway charge call (breaker, httpx)"),
        ("charge_worker/ledger.py", "settle", "  ledger settle + call, verdict, event"),
        ("nats/aio/msg.py", "ack", "  ack"),
        ("charge_worker/worker/consumer.py", "_account", "  metrics + charge.settled log line"),
        ("charge_worker/ledger.py", "tell", "  delivery event INSERT (no ledger write)"),
        ("charge_worker/worker/heartbeat.py", "start", "  heartbeat (start)"),
        ("charge_worker/worker/consumer.py", "run", "pull loop (fetch, spawn)"),
    ),
    "bare": (
        ("benchmarks/bare_pipeline.py", "handle", "one message, whole (all below)"),
        ("benchmarks/bare_pipeline.py", "_claim", "  ledger claim (INSERT)"),
        ("benchmarks/bare_pipeline.py", "_score", "  scoring call (httpx)"),
        ("benchmarks/bare_pipeline.py", "_charge", "  gateway charge call (httpx)"),
        ("benchmarks/bare_pipeline.py", "_mark", "  ledger mark (UPDATE)"),
        ("nats/aio/msg.py", "ack", "  ack"),
        ("benchmarks/bare_pipeline.py", "run", "pull loop (fetch, spawn)"),
    ),
}
_STDLIB = sysconfig.get_path("stdlib")
_BUILTIN_GROUPS = (
    ("epoll", "event loop: epoll/select"),
    ("socket", "socket syscalls"),
    ("send", "socket syscalls"),
    ("recv", "socket syscalls"),
    ("_json", "json (C)"),
    ("json", "json (C)"),
    ("pydantic_core", "pydantic (C)"),
    ("_asyncio", "asyncio (C)"),
    ("_contextvars", "asyncio (C)"),
)


def package_of(filename: str, function: str) -> str:
    """The group a profiled function's time is charged to."""
    if filename == "~":
        groups = (group for needle, group in _BUILTIN_GROUPS if needle in function)
        return next(groups, "builtins (other)")
    group = "other"
    if "site-packages/" in filename:
        group = filename.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    elif "/charge_worker/" in filename:
        module = filename.split("/charge_worker/", 1)[1].removesuffix(".py")
        group = f"charge_worker.{module.replace('/', '.')}"
    elif "/benchmarks/" in filename:
        group = "bare pipeline (benchmarks)"
    elif filename.startswith(_STDLIB):
        rest = filename[len(_STDLIB) :].lstrip("/")
        group = f"stdlib {rest.split('/', 1)[0].removesuffix('.py')}"
    return group


@dataclass(frozen=True)
class Profile:
    """A profile's CPU split by package, and its costliest functions (own time)."""

    total_s: float
    by_package: list[tuple[str, float]]
    top_functions: list[tuple[str, float, int]]  # (where, own seconds, calls)
    steps: list[tuple[str, float]]  # (step, cumulative seconds)

    def as_json(self) -> dict[str, Any]:
        return {
            "total_s": self.total_s,
            "by_package": self.by_package,
            "top_functions": self.top_functions,
            "steps": self.steps,
        }


def summarise(path: Path, steps: tuple[tuple[str, str, str], ...] = ()) -> Profile:
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, Any]]
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    by_package: dict[str, float] = defaultdict(float)
    functions: list[tuple[str, float, int]] = []
    for (filename, line, function), (_cc, calls, own_s, _cum, _callers) in stats.items():
        by_package[package_of(filename, function)] += own_s
        short = filename if filename == "~" else "/".join(Path(filename).parts[-2:])
        functions.append((f"{short}:{line} {function}", own_s, calls))
    total = sum(by_package.values())
    functions.sort(key=lambda item: item[1], reverse=True)
    cumulative = [
        (
            label,
            sum(
                entry[3]
                for (filename, _line, function), entry in stats.items()
                if filename.endswith(suffix) and function == name
            ),
        )
        for suffix, name, label in steps
    ]
    return Profile(
        total,
        sorted(by_package.items(), key=lambda item: item[1], reverse=True),
        functions[:TOP_FUNCTIONS],
        cumulative,
    )


def instrumented_worker(
    bench: Bench, settings: Settings, command: str, path: Path
) -> ChildConsumer:
    """`charge-worker run` in a child under this module's `command` (worker, worker-traced)."""
    port = free_port()
    env = child_env(settings, ROOT)
    env[env_name(HttpSettings, "metrics_port")] = str(port)
    log_dir = bench.log_dir / command
    log_dir.mkdir(exist_ok=True)
    argv = python_argv("-m", "benchmarks.profiling", command, str(path))
    child = Child(command, argv, log_dir / "worker.log", env=env, cwd=log_dir)

    async def ready(http: httpx.AsyncClient) -> bool:
        try:
            return (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    return ChildConsumer(child, ready)


async def profile_sample(bench: Bench, which: str) -> tuple[Drained, Profile]:
    """Drain `profile_messages` at zero latency under cProfile; `which` is worker or bare."""
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    path = bench.log_dir / f"{which}.pstats"
    consumer = (
        instrumented_worker(bench, settings, "worker", path)
        if which == "worker"
        else bare_consumer(bench, settings, "bare-profiled", profile=path)
    )
    plan: Plan = zero_latency_plan(bench, bench.sizes.profile_messages)
    drained = await bench.sample(f"profile {which}", plan, settings, consumer)
    return drained, summarise(path, STEPS[which])


def _run_worker() -> None:
    """What `charge-worker run` does: settings, logging, the worker until SIGTERM."""
    from charge_worker import event_loop, logs  # noqa: PLC0415  # the child only
    from charge_worker.settings import load_settings  # noqa: PLC0415
    from charge_worker.worker import run_command  # noqa: PLC0415

    settings = load_settings()
    logs.configure(settings.log)
    event_loop.run(run_command(settings))


def run_worker_profiled(path: Path) -> None:
    """`charge-worker run`, in this process, under cProfile; stats to `path` on exit."""
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        _run_worker()
    finally:
        profiler.disable()
        profiler.dump_stats(str(path))


def run_worker_traced(path: Path) -> None:
    """`charge-worker run`; the first SIGUSR1 starts tracemalloc, the second dumps a snapshot.

    The snapshot then holds exactly the Python objects allocated between the two signals
    and still alive: what a leak over that stretch would be made of. Tracing only from the
    first signal on lets the worker reach it at full speed.
    """
    signals = [0]

    def on_signal(_signum: int, _frame: object) -> None:
        signals[0] += 1
        if signals[0] == 1:
            tracemalloc.start(TRACE_FRAMES)
        elif signals[0] == 2:
            tracemalloc.take_snapshot().dump(str(path))
            tracemalloc.stop()

    signal.signal(signal.SIGUSR1, on_signal)
    _run_worker()


def heap_growth(path: Path, top: int = 12) -> dict[str, Any]:
    """The objects a traced stretch left alive (`run_worker_traced`), by allocation site."""
    sites = tracemalloc.Snapshot.load(str(path)).statistics("traceback")
    return {
        "alive_bytes": sum(stat.size for stat in sites),
        "alive_objects": sum(stat.count for stat in sites),
        "top_sites": [
            {
                "size": stat.size,
                "count": stat.count,
                "traceback": [f"{frame.filename}:{frame.lineno}" for frame in stat.traceback],
            }
            for stat in sites[:top]
        ],
    }


COMMANDS = {"worker": run_worker_profiled, "worker-traced": run_worker_traced}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in COMMANDS:
        raise SystemExit("usage: python -m benchmarks.profiling worker|worker-traced PATH")
    COMMANDS[sys.argv[1]](Path(sys.argv[2]))
