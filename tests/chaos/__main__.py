"""`make chaos`: every scenario at 10,000 keys, then all nemeses at once; prints the table.

    python -m tests.chaos [--size N] [--seed S] [--only NAME ...] [--out DIR]

Each scenario's report (chronicle, bad keys with `explain`) goes to DIR/<name>.txt and
every row to DIR/results.json; exit 1 when any scenario has a fatal outcome or never got
quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from charge_worker.sandbox.embedded import find_binary
from tests.chaos.checker import FATAL
from tests.chaos.cluster import ServerPool
from tests.chaos.run import Result, run_scenario
from tests.chaos.scenarios import BY_NAME, CLUSTER_SCENARIOS, COMBINED, FULL_ONLY, SCENARIOS

GOOD = (
    "charged_once",
    "declined",
    "action_required",
    "blocked",
    "blocked_post_hoc",
    "dead_lettered",
)
COLUMNS = (
    ("scenario", 24),
    ("keys", 6),
    *((g, 9) for g in GOOD),
    ("fatal", 6),
    ("gw calls p50/max", 16),
    ("redeliv", 8),
    ("lookups (nothing)", 17),
    ("converge s", 10),
    ("stall s", 8),
    ("commits lost", 12),
    ("dbl refunded", 12),
    ("unknown p99/max s", 17),
    ("DLQ got/exp", 11),
    ("result", 7),
)


def _cells(result: Result) -> list[str]:
    row, out = result.row(), result.verdict.outcomes
    return [
        result.scenario.name,
        str(result.size),
        *(str(out.get(g, 0)) for g in GOOD),
        str(sum(out[f] for f in FATAL)),
        f"{row['gateway_calls_p50']:g}/{row['gateway_calls_max']}",
        str(row["redeliveries"]),
        f"{row['lookups']} ({row['lookups_found_nothing']})",
        f"{row['converge_after_faults_s']:.1f}",
        f"{row.get('stall_s', '-')}",
        f"{row.get('commits_lost', '-')}",
        str(row["doubles_refunded"]),
        f"{row['unknown_resolution_p99_s']:.1f}/{row['unknown_resolution_max_s']:.1f}",
        f"{row['dead_letters']}/{row['dead_letters_expected']}",
        "pass" if result.passed else "FAIL",
    ]


def _line(cells: list[str]) -> str:
    widths = [max(w, len(name)) for name, w in COLUMNS]
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def _versions() -> dict[str, Any]:
    nats = subprocess.run(
        [str(find_binary("nats-server")), "--version"], capture_output=True, text=True, check=False
    )
    return {
        "python": platform.python_version(),
        "nats-server": nats.stdout.strip(),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
    }


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--size", type=int, default=10_000, help="keys per scenario")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--only", nargs="*", choices=sorted(BY_NAME), help="these scenarios")
    parser.add_argument("--out", type=Path, default=Path(".chaos"))
    parser.add_argument(
        "--nats-cluster",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: run every scenario on a 3-node JetStream cluster with a PostgreSQL standby",
    )
    args = parser.parse_args(argv)
    everything = [*SCENARIOS, *FULL_ONLY, COMBINED, *CLUSTER_SCENARIOS]
    chosen = [BY_NAME[n] for n in args.only] if args.only else everything
    if args.nats_cluster == 3:
        chosen = [s if s.shape != "single" else replace(s, shape="cluster") for s in chosen]
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos: {len(chosen)} scenario(s), {args.size} keys each (fewer where a scenario"
        f" says so), seed {args.seed}",
        flush=True,
    )
    print(_line([name for name, _ in COLUMNS]), flush=True)
    print(_line(["-" * max(w, len(name)) for name, w in COLUMNS]), flush=True)
    rows, failed = [], 0
    pool = ServerPool()
    try:
        for scenario in chosen:
            with pool.lend(scenario.shape, fresh=scenario.fresh_servers) as servers:
                size = min(args.size, scenario.max_size or args.size)
                result = await run_scenario(
                    servers, scenario, size=size, seed=args.seed, root=args.out / scenario.name
                )
            (args.out / f"{scenario.name}.txt").write_text(result.report() + "\n")
            print(_line(_cells(result)), flush=True)
            rows.append(result.row())
            failed += not result.passed
    finally:
        pool.stop()
    document = {"seed": args.seed, "size": args.size, "versions": _versions(), "results": rows}
    (args.out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"{len(rows) - failed} passed, {failed} failed; reports in {args.out}/", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the workers and servers of the run are stopped too
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(asyncio.run(main(sys.argv[1:])))
