"""`--json` on every command that prints a result, as a script runs them: one JSON object on
stdout, nothing else there, the same exit codes as without it (in process: tests.support.cli)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.dlq import DeadLetters
from charge_worker.migrate import default_directory
from charge_worker.settings import NatsSettings
from tests.integration.test_reconcile import put_row
from tests.support.cli import Ran, cli
from tests.support.harness import PERIOD

# every command that prints a result (the others serve, or tell a story: run, webhooks,
# sandbox *, demo); `retry --json` itself: tests/integration/test_retry_command.py
RESULT_COMMANDS = [
    ["migrate"],
    ["provision"],
    ["maintain"],
    ["produce"],
    ["retry"],
    ["reconcile"],
    ["explain"],
    ["dlq", "list"],
    ["dlq", "show"],
    ["dlq", "replay"],
]
CHARGE = {
    "schema": "charge.due/v1",
    "order_id": 48291,
    "billing_period": "2026-12-01",
    "subscription_id": "sub_48291",
    "customer_id": "cus_42",
    "amount_minor": 99000,
    "currency": "RUB",
    "due_at": "2026-12-01T00:00:00Z",
}
POISON = b"not json \xff\x1b[31m"


def document(result: Ran) -> dict[str, Any]:
    """stdout as exactly one JSON object."""
    parsed = json.loads(result.stdout)
    assert isinstance(parsed, dict), result.stdout
    return parsed


@pytest.fixture
def env(nats_settings: NatsSettings) -> dict[str, str]:
    return {
        "NATS_URL": str(nats_settings.url),
        "CHARGE_WORKER_STREAM": nats_settings.stream,
        "CHARGE_WORKER_SUBJECT": nats_settings.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats_settings.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats_settings.dlq_subject,
    }


@pytest.fixture
async def js(nc: Client, nats_settings: NatsSettings) -> JetStreamContext:
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    return js


@pytest.fixture
async def dead(js: JetStreamContext, nats_settings: NatsSettings) -> DeadLetters:
    """Dead letters 1 (poison, not UTF-8, an escape sequence inside) and 2 (rejected)."""
    letters = DeadLetters(js, nats_settings)
    await letters.write(
        POISON,
        reason="poison",
        error="not UTF-8 JSON",
        stream_seq=11,
        num_delivered=1,
        original=None,
    )
    await letters.write(
        json.dumps(CHARGE).encode(),
        reason="rejected",
        error="card number format invalid",
        stream_seq=12,
        num_delivered=2,
        original={"Nats-Msg-Id": "charge:48291:2026-12-01"},
    )
    return letters


@pytest.mark.parametrize("command", RESULT_COMMANDS, ids=" ".join)
def test_every_command_that_prints_a_result_offers_json(command: list[str]) -> None:
    result = cli(*command, "--help", env={})
    assert result.returncode == 0, result.stderr
    assert "--json" in result.stdout


def test_explain_json_carries_the_periods_outcome_events(database_url: str) -> None:
    asyncio.run(a_row(database_url, 48291, "succeeded", charge_id="ch_1"))
    period = PERIOD.isoformat()
    result = cli("explain", "--json", "48291", period, env={"DATABASE_URL": database_url})

    assert result.returncode == 0, result.stderr
    outcomes = document(result)["outcomes"]
    assert (outcomes["count"], outcomes["pruned"]) == (1, 0)
    [event] = outcomes["events"]
    assert (event["sequence"], event["type"]) == (1, "charge.succeeded")
    assert (event["sent_at"], event["stream_seq"], event["tries"]) == (None, None, 0)
    assert event["occurred_at"] == event["next_try_at"]  # due for its first try at once


async def a_row(database_url: str, order_id: int, status: str, *, charge_id: str) -> None:
    """A ledger row as a worker leaves it (its triggers write its outcome events)."""
    conn = await asyncpg.connect(database_url)
    try:
        await put_row(conn, order_id, status, charge_id=charge_id)
    finally:
        await conn.close()


def test_migrate_json_lists_the_files_applied(empty_database_url: str) -> None:
    env = {"DATABASE_URL": empty_database_url}
    first = cli("migrate", "--json", env=env)
    again = cli("migrate", "--json", env=env)

    assert first.returncode == 0, first.stderr
    files = sorted(path.name for path in default_directory().glob("*.sql"))
    assert document(first) == {"applied": files, "exit_code": 0}
    assert again.returncode == 0, again.stderr
    assert document(again) == {"applied": [], "exit_code": 0}


def test_migrate_json_edited_file_is_still_one_line_on_stderr_and_exit_1(
    empty_database_url: str, tmp_path: Path
) -> None:
    env = {"DATABASE_URL": empty_database_url}
    (tmp_path / "0001_first.sql").write_text("CREATE TABLE one (id int);")
    assert cli("migrate", "--json", "--dir", str(tmp_path), env=env).returncode == 0
    (tmp_path / "0001_first.sql").write_text("CREATE TABLE one (id bigint);")

    edited = cli("migrate", "--json", "--dir", str(tmp_path), env=env)

    assert edited.returncode == 1
    assert edited.stdout == ""
    [line] = edited.stderr.strip().splitlines()
    assert "0001_first.sql was edited after it was applied" in line


def test_maintain_json_says_what_it_would_make_then_makes_it(database_url: str) -> None:
    """A migrated database has next year's partitions; the month twelve ahead is the one
    the first daily run makes, and the run after it finds nothing to do."""
    env = {"DATABASE_URL": database_url}
    dry = cli("maintain", "--dry-run", "--json", env=env)
    real = cli("maintain", "--json", env=env)
    again = cli("maintain", "--json", env=env)

    assert dry.returncode == 0, dry.stderr
    assert document(dry)["dry_run"] is True
    assert real.returncode == 0, real.stderr
    assert document(real)["created"] == document(dry)["created"]
    assert document(real)["dropped"] == []
    assert document(again)["created"] == []


@pytest.mark.usefixtures("nc")  # deletes the streams afterwards
def test_provision_json_reports_created_then_drift_with_exit_3(
    nats_settings: NatsSettings, env: dict[str, str]
) -> None:
    created = cli("provision", "--json", env=env)
    drifted = cli("provision", "--json", env=env | {"CHARGE_WORKER_MAX_ACK_PENDING": "50"})
    applied = cli(
        "provision", "--json", "--apply", env=env | {"CHARGE_WORKER_MAX_ACK_PENDING": "50"}
    )

    assert created.returncode == 0, created.stderr
    first = document(created)
    assert f"stream {nats_settings.stream}" in first["created"]
    assert first["drift"] == []
    assert first["exit_code"] == 0
    assert drifted.returncode == 3
    assert document(drifted)["drift"] == [
        {
            "kind": "consumer",
            "name": nats_settings.durable,
            "field": "max_ack_pending",
            "actual": 1000,
            "wanted": 50,
            "changeable": True,
        }
    ]
    assert document(drifted)["exit_code"] == 3
    assert applied.returncode == 0, applied.stderr
    assert document(applied)["updated"] == [f"consumer {nats_settings.stream}/charges-worker"]


@pytest.mark.usefixtures("dead")
def test_dlq_show_json_gives_headers_and_the_exact_body(env: dict[str, str]) -> None:
    poison = cli("dlq", "show", "1", "--json", env=env)
    rejected = cli("dlq", "show", "2", "--json", env=env)

    assert poison.returncode == 0, poison.stderr
    shown = document(poison)
    assert shown["seq"] == 1
    assert shown["headers"]["Dlq-Reason"] == "poison"
    assert base64.b64decode(shown["body_base64"]) == POISON
    assert shown["body_json"] is None
    assert "\x1b" not in poison.stdout  # nothing the body brought reaches the terminal raw
    assert document(rejected)["body_json"] == CHARGE
    assert document(rejected)["headers"]["Dlq-Error"] == "card number format invalid"


@pytest.mark.usefixtures("dead")
def test_dlq_show_json_of_an_unknown_seq_prints_nothing_on_stdout_and_exits_1(
    env: dict[str, str],
) -> None:
    result = cli("dlq", "show", "9", "--json", env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "no dead letter with sequence 9" in result.stderr


@pytest.mark.usefixtures("dead")
def test_dlq_replay_json_reports_each_outcome_by_sequence(env: dict[str, str]) -> None:
    first = cli("dlq", "replay", "2", "--yes", "--json", env=env)
    again = cli("dlq", "replay", "2", "7", "--yes", "--json", env=env)

    assert first.returncode == 0, first.stderr
    assert document(first) == {"replayed": [2], "duplicates": [], "missing": [], "exit_code": 0}
    assert document(again) == {"replayed": [], "duplicates": [2], "missing": [7], "exit_code": 0}


@pytest.mark.usefixtures("js")
def test_dlq_replay_json_with_nothing_to_replay_is_still_one_object(env: dict[str, str]) -> None:
    result = cli("dlq", "replay", "--all", "--yes", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert document(result) == {"replayed": [], "duplicates": [], "missing": [], "exit_code": 0}
