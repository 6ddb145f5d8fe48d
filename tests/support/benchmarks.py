"""A benchmark module run as its docs run it: `PYTHONPATH=src:. python -m benchmarks.<name>`
from the repository's root, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    module: str, *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """`python -m benchmarks.<module> ARGS`, with `env` added to this process's."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        check=False,
        cwd=ROOT,
        env=os.environ
        | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        | dict(env or {}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
