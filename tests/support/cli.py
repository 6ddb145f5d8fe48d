"""The `charge-worker` command run in the test's own process through click's `CliRunner`:
its stdout, its stderr and its exit status, as a user's shell sees them, without starting
Python for every call. Only the variables a test gives reach the command's settings.

The long-running commands (`run`, `webhooks`, `sandbox`, `demo`) are started as processes
by their own tests: signals, readiness and a clean stop are what those show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from click.testing import CliRunner

from charge_worker.cli import main

# what the settings read besides CHARGE_WORKER_*
OUR_VARIABLES = ("NATS_URL", "DATABASE_URL", "SCORING_URL")


@dataclass(frozen=True)
class Ran:
    """What a finished command left: the shape of `subprocess.CompletedProcess`."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: Mapping[str, str] | None = None) -> Ran:
    """`charge-worker ARGS` with the project's variables of this process unset and `env`
    set, for the call only. A test calling it must not be a coroutine: the command runs
    its own event loop, as it does in a shell."""
    unset: dict[str, str | None] = {
        name: None
        for name in os.environ
        if name.startswith(("CHARGE_WORKER_", "GATEWAY_")) or name in OUR_VARIABLES
    }
    result = CliRunner().invoke(
        main, list(args), prog_name="charge-worker", env={**unset, **(env or {})}
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash, not an answer: the test shows its traceback
    return Ran(result.exit_code, result.stdout, result.stderr)
