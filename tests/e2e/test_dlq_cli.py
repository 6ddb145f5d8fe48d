"""`charge-worker dlq` as an operator runs it: list, show and replay real dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import subprocess
import sys
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.dlq import MAX_ERROR_CHARS, DeadLetters
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.cli import Ran
from tests.support.cli import cli as in_process
from tests.support.cli import cli_off_loop as cli
from tests.support.harness import (
    PERIOD,
    due,
    eventually,
    gateway_charges,
    provisioned,
    running_worker,
    set_sim,
    settings_for,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
LONG_ERROR = "gateway said: " + "card number format invalid " * 20


async def spawned(*args: str, env: dict[str, str], stdin: int = subprocess.DEVNULL) -> Ran:
    """`charge-worker ARGS` as a process of its own: stdin may be a terminal, and a worker in
    the test's process may log while it runs."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHARGE_WORKER_") and k not in ("NATS_URL", "DATABASE_URL", "COLUMNS")
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "charge_worker",
        *args,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean | env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(), err.decode())


@contextlib.contextmanager
def terminal_answering(answer: str) -> Iterator[int]:
    """A pseudo-terminal as stdin with `answer` already typed."""
    primary, secondary = pty.openpty()
    os.write(primary, answer.encode() + b"\n")
    try:
        yield secondary
    finally:
        os.close(secondary)
        os.close(primary)


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


def charge(order_id: int) -> dict[str, object]:
    return {
        "schema": "charge.due/v1",
        "order_id": order_id,
        "billing_period": "2026-12-01",
        "subscription_id": f"sub_{order_id}",
        "customer_id": "cus_42",
        "amount_minor": 99000,
        "currency": "RUB",
        "due_at": "2026-12-01T00:00:00Z",
    }


POISON = b"not json \xff"
EXHAUSTED = json.dumps(charge(48291)).encode()
REJECTED = json.dumps(charge(48292), indent=1).encode()  # odd layout: kept byte for byte


@pytest.fixture
async def three(js: JetStreamContext, nats_settings: NatsSettings) -> DeadLetters:
    """Dead letters 1 (poison), 2 (max_deliveries, traced) and 3 (rejected)."""
    dead = DeadLetters(js, nats_settings)
    await dead.write(
        POISON,
        reason="poison",
        error="not UTF-8 JSON",
        stream_seq=11,
        num_delivered=1,
        original={"Nats-Msg-Id": "producer-1"},
    )
    await dead.write(
        EXHAUSTED,
        reason="max_deliveries",
        error="deliveries ran out",
        stream_seq=12,
        num_delivered=5,
        original={"Nats-Msg-Id": "charge:48291:2026-12-01", "traceparent": TRACEPARENT},
    )
    await dead.write(
        REJECTED, reason="rejected", error=LONG_ERROR, stream_seq=13, num_delivered=2, original=None
    )
    return dead


async def charges(js: JetStreamContext, cfg: NatsSettings) -> list[tuple[bytes, dict[str, str]]]:
    """Every message in the charges stream: body and headers."""
    state = (await js.stream_info(cfg.stream)).state
    stored = [await js.get_msg(cfg.stream, seq) for seq in range(1, state.last_seq + 1)]
    return [(msg.data or b"", dict(msg.headers or {})) for msg in stored]


async def dead_letter_count(js: JetStreamContext, cfg: NatsSettings) -> int:
    return (await js.stream_info(cfg.dlq_stream)).state.messages


@pytest.mark.parametrize(
    "command", [["dlq"], ["dlq", "list"], ["dlq", "show"], ["dlq", "replay"]], ids=" ".join
)
def test_every_dlq_command_explains_itself(command: list[str]) -> None:
    result = in_process(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: charge-worker" in result.stdout
    assert len(result.stdout.split("\n\n")[1].strip()) > 20
    if command[-1] == "replay":
        assert "NOT deleted" in result.stdout


@pytest.mark.usefixtures("three")
async def test_list_is_one_line_per_dead_letter(env: dict[str, str]) -> None:
    result = await cli("dlq", "list", env=env | {"COLUMNS": "120"})

    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["SEQ", "DEAD", "AT"]
    assert len(rows) == 3
    cells = [row.split(maxsplit=7) for row in rows]
    assert [c[0] for c in cells] == ["1", "2", "3"]
    assert [c[2:7] for c in cells] == [
        ["poison", "11", "1", "-", "-"],
        ["max_deliveries", "12", "5", "48291", "2026-12-01"],
        ["rejected", "13", "2", "48292", "2026-12-01"],
    ]
    assert cells[0][7] == "not UTF-8 JSON"
    assert rows[2].endswith("…")  # the long error is cut to the terminal's width
    assert all(len(row) <= 120 for row in rows)


@pytest.mark.usefixtures("three")
async def test_list_json_with_a_reason_and_a_limit(env: dict[str, str]) -> None:
    rejected = await cli("dlq", "list", "--json", "--reason", "rejected", env=env)
    limited = await cli("dlq", "list", "--limit", "2", env=env)

    assert rejected.returncode == 0, rejected.stderr
    [line] = rejected.stdout.splitlines()
    row = json.loads(line)
    assert row.pop("dead_at").endswith("Z")
    assert row == {
        "seq": 3,
        "reason": "rejected",
        "stream_seq": 13,
        "num_delivered": 2,
        "order_id": 48292,
        "billing_period": "2026-12-01",
        "error": " ".join(LONG_ERROR.split())[:MAX_ERROR_CHARS],  # as stored, not cut to fit
    }
    assert limited.returncode == 0, limited.stderr
    assert len(limited.stdout.splitlines()) == 1 + 2
    assert "--limit" in limited.stderr


@pytest.mark.usefixtures("js")
async def test_list_says_when_there_are_no_dead_letters(env: dict[str, str]) -> None:
    result = await cli("dlq", "list", env=env)
    assert (result.returncode, result.stdout) == (0, "no dead letters\n")


@pytest.mark.usefixtures("three")
async def test_show_prints_every_header_and_the_body(env: dict[str, str]) -> None:
    exhausted = await cli("dlq", "show", "2", env=env)
    poison = await cli("dlq", "show", "1", env=env)

    assert exhausted.returncode == 0, exhausted.stderr
    head, body = exhausted.stdout.split("\n\n", 1)
    headers = dict(line.split(": ", 1) for line in head.splitlines())
    assert headers.pop("Dlq-Dead-At").endswith("Z")
    assert headers.pop("Dlq-First-Seen").endswith("Z")
    assert headers == {
        "Dlq-Reason": "max_deliveries",
        "Dlq-Error": "deliveries ran out",
        "Dlq-Stream-Seq": "12",
        "Dlq-Num-Delivered": "5",
        "Nats-Msg-Id": "dlq:12",
        "Dlq-Orig-Msg-Id": "charge:48291:2026-12-01",
        "traceparent": TRACEPARENT,
    }
    assert body.startswith('{\n  "schema"')  # pretty-printed
    assert json.loads(body) == charge(48291)
    assert poison.returncode == 0, poison.stderr
    assert poison.stdout.endswith(f"\n\n{POISON!r}\n")


@pytest.mark.usefixtures("three")
async def test_show_an_unknown_seq_is_one_line_and_exit_1(
    env: dict[str, str], nats_settings: NatsSettings
) -> None:
    result = await cli("dlq", "show", "4", env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: no dead letter with sequence 4 in {nats_settings.dlq_stream}"
    ]


async def test_replay_yes_republishes_the_original_bodies(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings, three: DeadLetters
) -> None:
    first = await cli("dlq", "replay", "2", "3", "--yes", env=env)
    again = await cli("dlq", "replay", "3", "7", "--yes", env=env)

    assert first.returncode == 0, first.stderr
    assert first.stdout == "replayed 2, skipped as duplicates 0, missing 0\n"
    assert await charges(js, nats_settings) == [
        (EXHAUSTED, {"Nats-Msg-Id": "replay:2", "traceparent": TRACEPARENT}),
        (REJECTED, {"Nats-Msg-Id": "replay:3"}),
    ]
    assert again.returncode == 0, again.stderr
    assert again.stdout == "replayed 0, skipped as duplicates 1, missing 1 (seq 7)\n"
    assert len(await charges(js, nats_settings)) == 2
    assert await dead_letter_count(js, nats_settings) == 3  # replay deletes nothing


@pytest.mark.usefixtures("three")
async def test_replay_all_of_one_reason(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    result = await cli("dlq", "replay", "--all", "--reason", "poison", "--yes", env=env)

    assert result.returncode == 0, result.stderr
    assert result.stdout == "replayed 1, skipped as duplicates 0, missing 0\n"
    assert await charges(js, nats_settings) == [(POISON, {"Nats-Msg-Id": "replay:1"})]


async def test_replay_of_many_shows_progress(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    dead = DeadLetters(js, nats_settings)
    for order_id in range(1, 26):
        body = json.dumps(charge(order_id)).encode()
        await dead.write(
            body,
            reason="rejected",
            error="invalid",
            stream_seq=order_id,
            num_delivered=1,
            original=None,
        )

    result = await cli("dlq", "replay", "--all", "--yes", env=env)

    assert result.returncode == 0, result.stderr
    assert "replaying" in result.stderr
    assert result.stdout == "replayed 25, skipped as duplicates 0, missing 0\n"
    assert len(await charges(js, nats_settings)) == 25


@pytest.mark.usefixtures("three")
async def test_replay_without_yes_and_no_terminal_refuses(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    result = await cli("dlq", "replay", "--all", env=env)

    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert "--yes" in line
    assert await charges(js, nats_settings) == []


@pytest.mark.usefixtures("three")
async def test_replay_asks_on_a_terminal(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    with terminal_answering("n") as stdin:
        declined = await spawned("dlq", "replay", "2", env=env, stdin=stdin)
    assert declined.returncode == 1
    assert f"Replay 1 dead letter to {nats_settings.subject}? [y/N]" in declined.stdout
    assert await charges(js, nats_settings) == []

    with terminal_answering("y") as stdin:
        accepted = await spawned("dlq", "replay", "--all", env=env, stdin=stdin)
    assert accepted.returncode == 0, accepted.stderr
    assert f"Replay 3 dead letters to {nats_settings.subject}? [y/N]" in accepted.stdout
    assert accepted.stdout.endswith("replayed 3, skipped as duplicates 0, missing 0\n")
    assert [body for body, _ in await charges(js, nats_settings)] == [POISON, EXHAUSTED, REJECTED]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "sequences or --all"),
        (["1", "--all"], "sequences or --all"),
        (["1", "--reason", "poison"], "--reason goes with --all"),
    ],
)
async def test_replay_needs_either_seqs_or_all(
    env: dict[str, str], args: list[str], message: str
) -> None:
    result = await cli("dlq", "replay", *args, "--yes", env=env)
    assert result.returncode == 2
    assert message in result.stderr


async def test_unreachable_nats_is_one_line() -> None:
    result = await cli("dlq", "list", env={"NATS_URL": f"nats://127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: DependencyUnavailable: cannot connect to NATS")


@pytest.mark.usefixtures("nc")  # deletes the streams, should anything create them
async def test_missing_dead_letter_stream_is_one_line(env: dict[str, str]) -> None:
    result = await cli("dlq", "list", env=env)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert "run `charge-worker provision`" in line


async def test_list_and_show_a_dead_letter_with_non_ascii_headers(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    """Found in production: one dead letter whose Dlq-Error held non-ASCII text broke
    `dlq list` for all of them (written here as an older version or another tool did)."""
    headers = {
        "Nats-Msg-Id": "dlq:21",
        "Dlq-Reason": "poison",
        "Dlq-Stream-Seq": "21",
        "Dlq-Error": "Betrag ungültig",
    }
    await js.publish(nats_settings.dlq_subject, EXHAUSTED, headers=headers)

    listed = await cli("dlq", "list", env=env | {"COLUMNS": "160"})
    as_json = await cli("dlq", "list", "--json", env=env)
    shown = await cli("dlq", "show", "1", env=env)

    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].endswith("Betrag ungültig")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["error"] == "Betrag ungültig"
    assert shown.returncode == 0, shown.stderr
    assert "Dlq-Error: Betrag ungültig\n" in shown.stdout


HOSTILE = json.dumps(
    {
        "schema": "charge.due/v1",
        "order_id": "\x1b[2J\x1b[H",  # clear the screen
        "billing_period": "\x1b]0;owned\x07\x9b2J",  # retitle the window; C1 CSI
        "note": "\x9b31m\u202egnp.exe",  # C1 CSI, right-to-left override
    }
).encode()


async def test_escape_sequences_from_a_body_never_reach_the_terminal(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    """Found in production: a message body's escape sequences reached the operator's
    terminal through `dlq list` and `dlq show`. `--json` keeps the values, JSON-escaped."""
    await js.publish(
        nats_settings.dlq_subject,
        HOSTILE,
        headers={"Nats-Msg-Id": "dlq:5", "Dlq-Reason": "poison", "Dlq-Error": "bad\x1b[5m"},
    )

    listed = await cli("dlq", "list", env=env | {"COLUMNS": "160"})
    as_json = await cli("dlq", "list", "--json", env=env)
    shown = await cli("dlq", "show", "1", env=env)

    for result in (listed, as_json, shown):
        assert result.returncode == 0, result.stderr
        assert all(line.isprintable() for line in result.stdout.splitlines()), result.stdout
    assert "\\x1b[2J\\x1b[H" in listed.stdout
    assert "bad\\x1b[5m" in listed.stdout
    row = json.loads(as_json.stdout)
    assert row["order_id"] == "\x1b[2J\x1b[H"
    assert row["billing_period"] == "\x1b]0;owned\x07\x9b2J"
    assert "Dlq-Error: bad\\x1b[5m\n" in shown.stdout
    assert '"note": "\\x9b31m\\u202egnp.exe"' in shown.stdout


async def test_replay_revives_failed_rows_and_looks_up_before_charging(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    env: dict[str, str],
) -> None:
    """Two rows a gateway answer failed (a 404 from a wrong path, once taken for a final
    rejection), each dead-lettered `rejected` after a gateway call. `dlq replay` brings both
    back to a running worker, which looks each key up first: the key the gateway did charge
    is recorded from the lookup, never charged again; the other is charged, once."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    await set_sim(gateway_sim.url, idempotency_enabled=False)  # only the lookup guards now
    made = await _charge_at_gateway(gateway_sim.url, 2)
    dead = DeadLetters(js, settings.nats)
    conn = await asyncpg.connect(database_url)
    try:
        for order_id in (1, 2):
            await _failed_row(conn, order_id)
            await dead.write(
                due(order_id),
                reason="rejected",
                error="gateway 404",
                stream_seq=order_id,
                num_delivered=1,
                original={"Nats-Msg-Id": f"charge:{order_id}:{PERIOD.isoformat()}"},
            )
        async with running_worker(settings):
            replay = await spawned("dlq", "replay", "--all", "--yes", env=env)
            assert replay.returncode == 0, replay.stderr
            assert replay.stdout == "replayed 2, skipped as duplicates 0, missing 0\n"

            async def both_succeeded() -> bool:
                rows = await conn.fetch("SELECT status FROM charge_attempts")
                return [r["status"] for r in rows] == ["succeeded"] * 2

            await eventually(both_succeeded, "both replayed charges settled")
        recorded = await conn.fetchval(
            "SELECT gateway_charge_id FROM charge_attempts WHERE order_id = 2"
        )
        lookups = await conn.fetch(
            "SELECT order_id, detail->>'lookup' AS lookup FROM charge_events"
            " WHERE kind = 'delivery' ORDER BY order_id"
        )
    finally:
        await conn.close()
    assert recorded == made
    assert [(r["order_id"], r["lookup"]) for r in lookups] == [(1, "nothing"), (2, "charged")]
    assert await gateway_charges(gateway_sim.url) == {
        f"{n}:{PERIOD.isoformat()}": 1 for n in (1, 2)
    }


async def _charge_at_gateway(gateway_url: str, order_id: int) -> str:
    """The charge an earlier call made although its answer said otherwise."""
    body = {
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_ok",
        "metadata": {"order_id": str(order_id), "billing_period": PERIOD.isoformat()},
    }
    headers = {
        "Authorization": "Bearer sk_test_sandbox",
        "Idempotency-Key": f"{order_id}:{PERIOD.isoformat()}",
    }
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        response = await client.post("/v1/charges", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def _failed_row(conn: asyncpg.Connection, order_id: int) -> None:
    """The row as a worker left it after a gateway call answered 404 (before the fix)."""
    await conn.execute(
        """
        INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
            customer_id, amount_minor, currency, status, gateway_calls, attempt, scoring,
            last_error, settled_at)
        VALUES ($1, $2, $3, $4, 'cus_ok', 99000, 'RUB', 'failed', 1, 1, 'approved',
                'gateway 404', now())
        """,
        order_id,
        PERIOD,
        f"{order_id}:{PERIOD.isoformat()}",
        f"sub_{order_id}",
    )
