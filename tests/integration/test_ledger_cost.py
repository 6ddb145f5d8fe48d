"""`benchmarks.ledger_cost`, the diagnosis of the worker's PostgreSQL cost part by part, runs
against real PostgreSQL, and each of its variants writes what it claims to: a variant that
stopped writing its part (the outbox's rows, the stories, the relay's marks) would read
cheap, so every round checks its rows and the run fails on a mismatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.ledger_cost import VARIANTS

ROOT = Path(__file__).resolve().parents[2]


def test_every_variant_writes_its_part_and_is_reported(pg_admin_url: str) -> None:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "DATABASE_URL": pg_admin_url,
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ledger_cost", "--rounds", "1", "--charges", "20"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reported = [
        line.split(" us")[0].rsplit(maxsplit=1)[0].strip() for line in done.stdout.splitlines()[1:]
    ]
    assert reported == [variant.name for variant in VARIANTS]
    assert "round 1/1" in done.stderr
