"""The demo's workers: their settings, and `charge-worker run` as child processes.

`demo_settings` gives short timings that still pass the cross-field rules, a retry schedule
of seconds instead of days among them. Each worker gets them as environment variables
(nothing inherited from the caller's `CHARGE_WORKER_*` or server addresses), runs in the log
directory (so no stray `.env` is read), writes its JSON log to a file there and serves
`/metrics` on its own port. `run_cli` runs another command (`produce`, `retry`) the same way.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, SecretStr
from pydantic_settings import BaseSettings

from charge_worker.errors import ChargeWorkerError
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.gateway.app import GatewayConfig
from charge_worker.settings import (
    ENV_PREFIX,
    DbSettings,
    GatewaySettings,
    HttpSettings,
    LogSettings,
    NatsSettings,
    RetrySettings,
    ScoringSettings,
    Settings,
    WorkerSettings,
    env_name,
)

WORKERS = 2
READY_TIMEOUT_S = 30.0
RETRY_AFTER_S = 5.0  # the demo's retry schedule: one retry, 5 s after a soft decline
CLI_TIMEOUT_S = 60.0
SERVER_VARS = ("NATS_URL", "DATABASE_URL", "GATEWAY_URL", "GATEWAY_API_KEY", "SCORING_URL")

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]
G = TypeVar("G", bound=BaseSettings)


class DemoFailed(ChargeWorkerError):
    """The demo could not tell its story to the end."""


def _isolated(cls: type[G], **values: Any) -> G:
    """`cls` from its defaults and `values` only: the caller's environment and .env stay out."""
    defaults = {
        name: info.get_default(call_default_factory=True) for name, info in cls.model_fields.items()
    }
    return cls(**(defaults | values))


def demo_settings(
    nats_url: str, database_url: str, gateway_url: str, scoring_url: str, *, external: bool
) -> Settings:
    """Short timings so the story fits in seconds; the cross-field rules still apply.

    The scoring timeout (9 s) outlasts the incident's 6-8 s tail, so a slow verdict is
    waited for past the 5 s AckWait: only heartbeats keep such a message from redelivery.
    A soft decline is retried once, `RETRY_AFTER_S` later (the product's default: 1d,3d,5d,7d).
    With a server of your own (`external`) the streams get names of their own, once per run.
    """
    tag = secrets.token_hex(3)
    names = (
        {
            "stream": f"DEMO_{tag}_CHARGES",
            "subject": f"demo.{tag}.charges.due",
            "dlq_stream": f"DEMO_{tag}_CHARGES_DLQ",
            "dlq_subject": f"demo.{tag}.charges.dlq",
            "outcomes_stream": f"DEMO_{tag}_CHARGE_OUTCOMES",
            "outcomes_subject": f"demo.{tag}.charges.outcome",
        }
        if external
        else {}
    )
    return Settings(
        nats=_isolated(
            NatsSettings,
            url=nats_url,
            ack_wait_s=5.0,
            backoff_s=(5.0, 10.0, 20.0),
            max_deliver=4,
            **names,
        ),
        db=_isolated(DbSettings, url=database_url),
        worker=_isolated(
            WorkerSettings,
            concurrency=8,
            lease_s=15.0,
            processing_budget_s=30.0,
            drain_s=10.0,
            fetch_wait_s=0.5,
        ),
        scoring=_isolated(ScoringSettings, url=scoring_url, scoring_timeout_s=9.0),
        gateway=_isolated(
            GatewaySettings,
            url=gateway_url,
            api_key=SecretStr(GatewayConfig().api_key),
            gateway_timeout_s=5.0,
        ),
        http=_isolated(HttpSettings, http_host="127.0.0.1", metrics_port=0),
        log=_isolated(LogSettings, log_format="json"),
        retries=_isolated(RetrySettings, retry_schedule=(RETRY_AFTER_S,)),
    )


def describe(settings: Settings) -> str:
    """The demo's timings in one line."""
    nats, worker = settings.nats, settings.worker
    backoff = ",".join(f"{step:g}" for step in nats.backoff_s)
    return (
        f"AckWait {nats.ack_wait_s:g} s, backoff {backoff} s, max_deliver {nats.max_deliver}, "
        f"heartbeat every {settings.heartbeat_s:.2g} s, scoring timeout "
        f"{settings.scoring.scoring_timeout_s:g} s, lease {worker.lease_s:g} s, "
        f"{WORKERS} workers x concurrency {worker.concurrency}, "
        f"retry schedule {retry_schedule(settings)}"
    )


def retry_schedule(settings: Settings) -> str:
    """CHARGE_WORKER_RETRY_SCHEDULE as set, in seconds."""
    return ",".join(f"{step:g}s" for step in settings.retries.retry_schedule) or "(none)"


def _env_value(value: object) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, tuple):
        return ",".join(_env_value(item) for item in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def settings_env(settings: Settings) -> dict[str, str]:
    """Every set field of `settings` as the environment variable that sets it."""
    env: dict[str, str] = {}
    for group_name in Settings.model_fields:
        group: BaseModel = getattr(settings, group_name)
        for field in type(group).model_fields:
            value = getattr(group, field)
            if value is not None:
                env[env_name(type(group), field)] = _env_value(value)
    return env


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def child_env(settings: Settings) -> dict[str, str]:
    """The environment of a `charge-worker` child: the caller's, without its own settings
    and server addresses, and `settings` as variables."""
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(ENV_PREFIX) and key not in SERVER_VARS
    }
    return inherited | settings_env(settings)


async def run_cli(settings: Settings, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`charge-worker ARGS` as a child process with the demo's settings, run in `cwd`; its
    exit status and output, once it ends (`DemoFailed` if that takes `CLI_TIMEOUT_S`)."""
    command = [sys.executable, "-m", "charge_worker", *args]
    try:
        return await asyncio.to_thread(
            subprocess.run,
            command,
            env=child_env(settings),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        raise DemoFailed(f"charge-worker {' '.join(args)} ran {CLI_TIMEOUT_S:g} s") from error


class WorkerProcess:
    """One `python -m charge_worker run` child with a log file and a `/metrics` port."""

    def __init__(self, name: str, settings: Settings, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        self._cwd = log_dir
        self._env = child_env(settings)
        self._env[env_name(HttpSettings, "metrics_port")] = str(self.port)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the worker's own HTTP surface."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def returncode(self) -> int | None:
        """The exit status, or None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def start(self) -> None:
        """Start the worker; `wait_ready` tells when it consumes."""
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "charge_worker", "run"],
            env=self._env,
            cwd=self._cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the worker's log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Wait until `/readyz` answers 200; raise `DemoFailed` if the worker dies first."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise DemoFailed(
                    f"{self.name} exited with {self.returncode} during start; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                if (await client.get(f"{self.url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await asyncio.sleep(0.1)
        raise DemoFailed(f"{self.name} was not ready within {READY_TIMEOUT_S:g} s")

    async def scrape(self, client: httpx.AsyncClient) -> Samples:
        """Every sample of the worker's `/metrics`, by name and labels."""
        response = await client.get(f"{self.url}/metrics")
        response.raise_for_status()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM, then wait up to `timeout_s`; a worker still running then is killed."""
        proc = self._proc
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = await asyncio.to_thread(proc.wait)
        self._close_log()
        return code

    def kill(self) -> None:
        """Kill the worker if it still runs (cleanup after a failure)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
