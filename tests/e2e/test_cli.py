"""The command as a user runs it: help everywhere, one-line errors, exit codes (in process:
`tests.support.cli`; the demo as a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import NatsSettings
from tests.support.cli import cli

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
    """As a separate process: the demo starts servers and simulators of its own."""
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
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: charge-worker" in result.stdout
    summary = result.stdout.split("\n\n")[1].strip()
    assert len(summary) > 20  # a real sentence, not an empty docstring


def test_missing_server_address_is_one_line_naming_it() -> None:
    result = cli("migrate")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: SettingsError: DATABASE_URL is not set; this command needs it"
    ]


def test_invalid_setting_stops_the_command_with_one_line() -> None:
    result = cli("provision", env={"CHARGE_WORKER_MAX_DELIVER": "2"})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "CHARGE_WORKER_MAX_DELIVER" in lines[0]


def test_unreachable_database_is_one_line() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = cli("migrate", env={"DATABASE_URL": url})
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
    first = cli("provision", env=env)
    assert first.returncode == 0, first.stderr
    assert f"created stream {stream}" in first.stdout
    drifted = cli("provision", env={**env, "CHARGE_WORKER_MAX_ACK_PENDING": "50"})
    assert drifted.returncode == 3
    assert "max_ack_pending is 1000, configured 50" in drifted.stderr
    applied = cli("provision", "--apply", env={**env, "CHARGE_WORKER_MAX_ACK_PENDING": "50"})
    assert applied.returncode == 0, applied.stderr
    assert f"updated consumer {stream}/charges-worker" in applied.stdout


@pytest.mark.parametrize("spacing", [",", ", "])
def test_nats_url_may_list_several_servers_and_any_that_answers_will_do(
    nats_settings: NatsSettings, spacing: str
) -> None:
    """As the chart writes it: `nats://a:4222,nats://b:4222,nats://c:4222`, seeds down."""
    down = [f"nats://127.0.0.1:{free_port()}" for _ in range(2)]
    env = {
        "NATS_URL": spacing.join([down[0], str(nats_settings.url), down[1]]),
        "CHARGE_WORKER_STREAM": nats_settings.stream,
        "CHARGE_WORKER_SUBJECT": nats_settings.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats_settings.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats_settings.dlq_subject,
    }
    result = cli("provision", env=env)
    assert result.returncode == 0, result.stderr
    assert f"created stream {nats_settings.stream}" in result.stdout


def test_unreachable_nats_is_one_line_within_seconds() -> None:
    result = cli("provision", env={"NATS_URL": f"nats://127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: DependencyUnavailable: cannot connect to NATS")


SECRET = "s3cr3t-pw"


def test_credentials_in_the_nats_url_are_never_printed() -> None:
    """Found in production: a connect error printed NATS_URL with its user and password."""
    port = free_port()
    result = cli("provision", env={"NATS_URL": f"nats://alice:{SECRET}@127.0.0.1:{port}"})
    assert result.returncode == 1
    assert SECRET not in result.stdout + result.stderr
    assert f"cannot connect to NATS at nats://***@127.0.0.1:{port}" in result.stderr


@pytest.mark.timeout(90)
def test_the_demo_never_prints_credentials_of_the_servers_it_is_given() -> None:
    """Found in production: the demo printed a DATABASE_URL it was given, password and all."""
    nats_port, pg_port = free_port(), free_port()
    env = {
        "NATS_URL": f"nats://alice:{SECRET}@127.0.0.1:{nats_port}",
        "DATABASE_URL": f"postgresql://bob:{SECRET}@127.0.0.1:{pg_port}/ledger",
    }
    result = run("demo", env=env)
    assert result.returncode == 1  # nothing listens there
    assert SECRET not in result.stdout + result.stderr
    assert f"using NATS_URL=nats://***@127.0.0.1:{nats_port}" in result.stdout
    assert f"using DATABASE_URL=postgresql://***@127.0.0.1:{pg_port}/ledger" in result.stdout
