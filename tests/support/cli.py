"""The `charge-worker` command run in the test's own process through click's `CliRunner`:
its stdout, its stderr and its exit status, as a user's shell sees them, without starting
Python for every call. Only the variables a test gives reach the command's settings.

The long-running commands (`run`, `webhooks`, `sandbox`, `demo`) are started as processes
by their own tests: signals, readiness and a clean stop are what those show.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import structlog
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
    with logging_put_back():
        result = CliRunner().invoke(
            main, list(args), prog_name="charge-worker", env={**unset, **(env or {})}
        )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash, not an answer: the test shows its traceback
    return Ran(result.exit_code, result.stdout, result.stderr)


async def cli_off_loop(*args: str, env: Mapping[str, str] | None = None) -> Ran:
    """`cli` from a coroutine test: in a thread, off the test's event loop (the command
    runs a loop of its own)."""
    return await asyncio.to_thread(cli, *args, env=env)


@contextlib.contextmanager
def logging_put_back() -> Iterator[None]:
    """Logging as it was before a command configured it for its run (`logs.configure`
    routes every logger to the stderr of that run), so later tests in this process do not
    write to a stream that is gone."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # what uvicorn configures
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
