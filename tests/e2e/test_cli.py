"""The command as a user runs it: help everywhere, one-line errors, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import NatsSettings

COMMANDS = [
    [],
    ["migrate"],
    ["provision"],
    ["demo"],
    ["sandbox"],
    ["sandbox", "gateway"],
    ["sandbox", "scoring"],
]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CHARGE_WORKER_")}
    clean.pop("DATABASE_URL", None)
    clean.pop("NATS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "charge_worker", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_every_command_explains_itself(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: charge-worker" in result.stdout
    summary = result.stdout.split("\n\n")[1].strip()
    assert len(summary) > 20  # a real sentence, not an empty docstring


def test_missing_server_address_is_one_line_naming_it() -> None:
    result = run("migrate")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: SettingsError: DATABASE_URL is not set; this command needs it"
    ]


def test_invalid_setting_stops_the_command_with_one_line() -> None:
    result = run("provision", env={"CHARGE_WORKER_MAX_DELIVER": "2"})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "CHARGE_WORKER_MAX_DELIVER" in lines[0]


def test_unreachable_database_is_one_line() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = run("migrate", env={"DATABASE_URL": url})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "cannot connect to the database" in lines[0]


@pytest.mark.usefixtures("nc")  # deletes the streams afterwards
def test_provision_reports_drift_with_exit_3(nats_settings: NatsSettings) -> None:
    stream = nats_settings.stream
    env = {
        "NATS_URL": str(nats_settings.url),
        "CHARGE_WORKER_STREAM": stream,
        "CHARGE_WORKER_SUBJECT": nats_settings.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats_settings.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats_settings.dlq_subject,
    }
    first = run("provision", env=env)
    assert first.returncode == 0, first.stderr
    assert f"created stream {stream}" in first.stdout
    drifted = run("provision", env={**env, "CHARGE_WORKER_MAX_ACK_PENDING": "50"})
    assert drifted.returncode == 3
    assert "max_ack_pending is 1000, configured 50" in drifted.stderr
    applied = run("provision", "--apply", env={**env, "CHARGE_WORKER_MAX_ACK_PENDING": "50"})
    assert applied.returncode == 0, applied.stderr
    assert f"updated consumer {stream}/charges-worker" in applied.stdout


def test_unreachable_nats_is_one_line_within_seconds() -> None:
    result = run("provision", env={"NATS_URL": f"nats://127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: DependencyUnavailable: cannot connect to NATS")
