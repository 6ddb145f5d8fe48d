"""`benchmarks.overhead --fake-io`, the steady instrument's server-free mode, still runs the
worker's real pipeline to the end: its canned ledger answers what `Ledger.claim` reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_fake_io_mode_charges_and_acks_every_delivery() -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--fake-io", "--rounds", "1", "--batch", "8"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fake I/O; outcome events on" in done.stdout
