"""What a synchronous PostgreSQL standby costs the worker, against an asynchronous one.

`python -m benchmarks.standby [--repeats 3] [--messages 3000]`: two primaries, each with a
streaming standby (`synchronous_standby_names` on one of them), behind the same nats-server
and simulators; worker samples at zero latency alternate between them, so drift of the
machine falls on both alike. Prints each sample and the ratio of the medians: the price of
losing no acknowledged commit on a failover (docs/reliability.md, "Clustered engines").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.bench import QUICK, Bench
from benchmarks.stack import Stack
from benchmarks.stats import median
from benchmarks.throughput import worker_sample
from charge_worker.sandbox.embedded import PostgresServer

MODES = {"async": (), "sync": ("synchronous_standby_names=standby",)}


async def measure(
    stack: Stack, pairs: dict[str, PostgresServer], repeats: int, messages: int
) -> dict[str, object]:
    rates: dict[str, list[float]] = {mode: [] for mode in pairs}
    cpu: dict[str, list[float]] = {mode: [] for mode in pairs}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-standby-"))
    async with httpx.AsyncClient(timeout=30) as http:
        sizes = dataclasses.replace(QUICK, throughput_messages=messages)
        bench = Bench(stack, http, sizes, log_dir)
        for k in range(1, repeats + 1):
            for mode, primary in pairs.items():
                stack.postgres, stack.admin_url = primary, primary.url  # its CPU is measured
                stack.template = f"bench_template_{mode}"
                await stack.prepare()
                bench.say(f"{mode} standby, sample {k}/{repeats}")
                drained = await worker_sample(bench, k)
                rates[mode].append(drained.rate)
                cpu[mode].append(drained.cpu_us_per_charge("postgres"))
    ratio = median(rates["sync"]) / median(rates["async"])
    return {"rates": rates, "postgres_us_per_charge": cpu, "sync_over_async": ratio}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.standby", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--messages", type=int, default=3000)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as servers:
        pairs = {}
        for mode, settings in MODES.items():
            primary = servers.enter_context(PostgresServer(settings=settings))
            standby = PostgresServer.standby_of(primary).start()
            servers.callback(standby.stop)
            pairs[mode] = primary
        stack = Stack(Path(tempfile.mkdtemp(prefix="bench-standby-")))
        stack.admin_url = pairs["async"].url  # so that it starts no PostgreSQL of its own
        servers.enter_context(stack)
        result = asyncio.run(measure(stack, pairs, args.repeats, args.messages))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
