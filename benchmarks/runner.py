"""`python -m benchmarks`: every case in one run, the table, the ratios, the JSON record."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import latency_bound, memory, month_start, report, sliced, throughput
from benchmarks.bench import DEFAULT, QUICK, ROOT, Bench, Sizes
from benchmarks.stack import Stack
from benchmarks.stats import median
from charge_worker import streams
from charge_worker.settings import NatsSettings

RUN_BUDGET_S = 540.0  # the whole default run, start to JSON, stays under 10 minutes
QUICK_BUDGET_S = 300.0
MEMORY_RESERVE_S = 25.0  # publishing, start-up and stopping around the memory drain
PUBLISH_PER_S = 15_000.0  # backlog publishing speed, for the memory case's budget
CASES = ("throughput", "latency", "memory", "month-start")
DEFAULT_CASES = CASES[:3]  # month-start takes ~15 minutes of its own: asked for by name
PACKAGES = (
    "charge-worker",
    "nats-py",
    "asyncpg",
    "httpx",
    "httpx-aiohttp",
    "aiohttp",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "structlog",
    "prometheus-client",
    "uvicorn",
    "starlette",
    "psutil",
    "uvloop",
    "orjson",
    "msgspec",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure charge-worker against the bare pipeline, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller N")
    parser.add_argument("--repeats", type=int, help="samples per case")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=CASES,
        help=f"run only these cases (default: {' '.join(DEFAULT_CASES)})",
    )
    parser.add_argument(
        "--month-start-charges",
        type=int,
        default=100_000,
        help="month-start: due charges produced and drained (100000; 1000000 for the docs)",
    )
    parser.add_argument("--memory-messages", type=int, help="memory case goal (100000)")
    parser.add_argument(
        "--memory-budget-s",
        type=float,
        help="longest the memory drain may take (default: "
        "what is left of the run's 10-minute budget)",
    )
    parser.add_argument("--budget-s", type=float, help="the whole run's time budget")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "latest.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs directory")
    parser.add_argument(
        "--nats-cluster",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: every case on an embedded 3-node JetStream cluster, streams replicated 3x",
    )
    return parser.parse_args(argv)


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line),
        platform.processor(),
    )
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_total = next(
        (
            line.split(":")[1].strip()
            for line in meminfo.splitlines()
            if line.startswith("MemTotal")
        ),
        "?",
    )
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "mem_total": mem_total,
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
    }


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


async def server_versions(stack: Stack) -> dict[str, str]:
    nc = await streams.connect(NatsSettings(url=stack.nats_url), name="bench", reconnect=False)
    try:
        v = nc.connected_server_version
        nats_version = f"{v.major}.{v.minor}.{v.patch}{'-' + v.dev if v.dev else ''}"
    finally:
        await nc.close()
    return {"nats-server": nats_version, **await stack.server_versions()}


async def run_cases(
    bench: Bench,
    only: set[str],
    budget_s: float,
    *,
    out: Path,
    month_start_charges: int = 100_000,
) -> report.Results:
    sizes = bench.sizes
    probe = bench.settings("postgresql://unused/x")
    results = report.Results(concurrency=probe.worker.concurrency)
    case_count = len(only)
    step = 0
    if "throughput" in only:
        step += 1
        bench.say(
            f"== case group {step}/{case_count}: bare pipeline vs worker, without its outbox, "
            "and with the subscription check on, zero latency"
        )
        for k in range(1, sizes.repeats + 1):
            results.bare.append(await throughput.bare_sample(bench, k))
            results.worker.append(await throughput.worker_sample(bench, k))
            results.worker_no_outbox.append(await throughput.no_outbox_sample(bench, k))
            results.worker_verified.append(await throughput.verified_sample(bench, k))
        # one more: every worker sample is then set against a bare sample on either side
        results.bare.append(await throughput.bare_sample(bench, sizes.repeats + 1))
        bench.say(f"2s, in turns: bare pipeline and worker, {sizes.sliced_turns} turns each")
        results.sliced = await sliced.sliced_sample(bench, sizes.sliced_turns)
    if "latency" in only:
        step += 1
        bench.say(
            f"== case group {step}/{case_count}: latency-bound (bare, worker), scale-out x2, "
            "incident"
        )
        for k in range(1, sizes.repeats + 1):
            results.bare_latency_bound.append(
                await latency_bound.bare_latency_bound_sample(bench, k)
            )
            results.latency_bound.append(await latency_bound.latency_bound_sample(bench, k))
            results.scale_out.append(await latency_bound.scale_out_sample(bench, k))
            results.incident.append(await latency_bound.incident_sample(bench, k))
    if "memory" in only:
        step += 1
        rate = median([s.rate for s in results.worker]) if results.worker else 200.0
        elapsed = time.monotonic() - bench.started
        reserve = MEMORY_RESERVE_S + sizes.memory_messages / PUBLISH_PER_S
        left = memory.budget_left(budget_s, elapsed, reserve)
        memory_budget = min(sizes.memory_budget_s, left)
        bench.say(
            f"== case group {step}/{case_count}: memory ({memory_budget:.0f} s of the run's "
            f"{budget_s:.0f} s budget left for it)"
        )
        bench.sizes = dataclasses.replace(sizes, memory_budget_s=memory_budget)
        results.memory = await memory.memory_case(bench, rate)
    if "month-start" in only:
        step += 1
        bench.say(f"== case group {step}/{case_count}: month start")
        results.month_start = await month_start.month_start(
            bench.stack,
            ROOT,
            bench.log_dir,
            charges=month_start_charges,
            history=month_start.HISTORY,
            new=month_start.NEW,
            rate_limit=month_start.RATE_LIMIT,
            limited_charges=month_start.LIMITED_CHARGES,
            png=out.parent / "month_start.png",
            say=bench.say,
        )
    return results


def record(
    results: report.Results,
    found: list[report.Ratio],
    *,
    sizes: Sizes,
    meta: dict[str, Any],
) -> dict[str, Any]:
    def samples(items: list[Any]) -> list[dict[str, Any]]:
        return [item.as_json() for item in items]

    return {
        **meta,
        "sizes": dataclasses.asdict(sizes),
        "cases": {
            "latency_bound": {
                "gateway": latency_bound.GATEWAY.model_dump(),
                "scoring": latency_bound.SCORING.model_dump(),
                "mean_latency_s": latency_bound.mean_latency_s(latency_bound.SCORING),
            },
            "incident": {
                "gateway": latency_bound.GATEWAY.model_dump(),
                "scoring": latency_bound.INCIDENT_SCORING.model_dump(),
                "scoring_timeout_s": latency_bound.SCORING_TIMEOUT_S,
                "mean_latency_s": latency_bound.mean_latency_s(latency_bound.INCIDENT_SCORING),
            },
        },
        "ratios": [item.as_json() for item in found],
        "outbox_cost": cost.as_json() if (cost := report.outbox_cost(results)) else None,
        "sliced": results.sliced.as_json() if results.sliced else None,
        "anomalies": report.anomalies(results),
        "contended": report.contended(results),
        "samples": {
            "bare": samples(results.bare),
            "worker": samples(results.worker),
            "worker_verified": samples(results.worker_verified),
            "worker_no_outbox": samples(results.worker_no_outbox),
            "bare_latency_bound": samples(results.bare_latency_bound),
            "latency_bound": samples(results.latency_bound),
            "incident": samples(results.incident),
            "scale_out": samples(results.scale_out),
            "memory": results.memory.as_json() if results.memory else None,
            "month_start": results.month_start.as_json() if results.month_start else None,
        },
    }


async def _main(args: argparse.Namespace, stack: Stack, log_dir: Path, t0: float) -> int:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    sizes = QUICK if args.quick else DEFAULT
    if args.repeats:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    if args.memory_messages:
        sizes = dataclasses.replace(sizes, memory_messages=args.memory_messages)
    budget_s = args.budget_s or (QUICK_BUDGET_S if args.quick else RUN_BUDGET_S)
    if args.memory_budget_s:
        sizes = dataclasses.replace(sizes, memory_budget_s=args.memory_budget_s)
        if args.budget_s is None:  # an explicit memory budget is not cut to the run's
            budget_s = math.inf
    only = set(args.only or DEFAULT_CASES)
    async with httpx.AsyncClient(timeout=10.0) as http:
        bench = Bench(stack, http, sizes, log_dir)
        bench.say(f"stack: nats {stack.nats_url}, postgres {stack.admin_url}")
        bench.say(f"simulators: gateway {stack.gateway.url}, scoring {stack.scoring.url}")
        await stack.prepare()
        meta: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks", *sys.argv[1:]]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(),
            "python": sys.version,
            "servers": await server_versions(stack),
            "external_servers": stack.external,
            "packages": package_versions(),
            "settings": bench.settings("postgresql://127.0.0.1/sample").model_dump(mode="json"),
        }
        bench.say(f"versions: {meta['servers']}, python {platform.python_version()}")
        try:
            results = await run_cases(
                bench,
                only,
                budget_s,
                out=args.out,
                month_start_charges=args.month_start_charges,
            )
        finally:
            for consumers in list(bench.live):
                consumers.kill()
            await stack.cleanup_databases()
        wall_s = time.monotonic() - t0
    found = report.ratios(results)
    lines = [
        *report.table(results),
        *report.cpu_split(results),
        *report.ledger_lines(results),
        *report.check_lines(results),
        *report.ratio_lines(found),
        *(results.month_start.lines() if results.month_start else []),
    ]
    print("\n" + "\n".join(lines), flush=True)
    meta["wall_s"] = wall_s
    meta["loadavg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record(results, found, sizes=sizes, meta=meta), indent=1))
    print(f"\nraw samples in {args.out}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="charge-worker-bench-"))
    print(f"logs in {log_dir}", flush=True)
    done = False
    try:
        with Stack(log_dir, nats_cluster=args.nats_cluster) as stack:
            code = asyncio.run(_main(args, stack, log_dir, t0))
        done = True
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted: every process started has been stopped", file=sys.stderr)
        return 130
    else:
        print(f"wall time {time.monotonic() - t0:.0f} s, every process stopped", flush=True)
        return code
    finally:
        if done and not args.keep_logs:
            with contextlib.suppress(OSError):
                shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"logs kept in {log_dir}", file=sys.stderr)
