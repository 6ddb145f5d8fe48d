"""`charge-worker status` as the on-call runs it: one JSON object with `--json`, exit 0 when
every part was read; with PostgreSQL away, the NATS parts still shown, the database named in
one line, exit 1, no traceback. (What it gathers: tests/integration/test_status.py.)
"""

from __future__ import annotations

import json

from nats.aio.client import Client

from charge_worker import streams
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import DbSettings, NatsSettings, Settings
from tests.support.cli import cli_off_loop as cli
from tests.support.harness import settings_env


async def test_status_json_then_the_database_away(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    await streams.provision(nc.jetstream(), nats_settings)
    env = settings_env(Settings(nats=nats_settings, db=DbSettings(url=database_url)))
    paused = await cli("pause", "--reason", "gateway incident", "--by", "ann", env=env)
    assert paused.returncode == 0, paused.stderr

    result = await cli("status", "--json", env=env)

    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()  # one object, nothing else on stdout
    document = json.loads(line)
    assert document["exit_code"] == 0
    assert document["failed"] == []
    assert (document["charging"]["paused"], document["charging"]["reason"]) == (
        True,
        "gateway incident",
    )
    assert document["backlog"]["lag"] == 0
    assert document["dead_letters"]["total"] == 0
    assert [run["job"] for run in document["runs"]] == ["produce", "reconcile", "maintain"]
    assert document["reconcile"] is None  # no run yet
    assert (document["oldest_due_s"], document["deferred_checks_pending"]) == (0, 0)
    assert document["pods"] == {"seen": [], "not_seen": 0, "seen_within_s": 120.0}

    away = env | {"DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"}
    result = await cli("status", env=away)

    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("charging:     PAUSED") for line in lines), result.stdout
    assert "last runs:    not read" in lines
    [failed] = [line for line in lines if line.startswith("FAILED:")]
    assert failed.startswith("FAILED:       database: cannot connect to the database")
