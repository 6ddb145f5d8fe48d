"""`charge-worker retry ORDER_ID PERIOD [--json]` as support runs it (in process:
tests.support.cli): the next try started and published at once as that try, a refusal in
one line with exit 1, and a try whose publish failed left for the next `produce`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.messages import parse
from charge_worker.producer.schedule import produce
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import DbSettings, NatsSettings, Settings
from tests.integration.test_retry_starts import PERIOD, put_try
from tests.support.cli import cli
from tests.support.producer import stream_messages

KEY = f"31:{PERIOD.isoformat()}"


@pytest.fixture
def env(nats_settings: NatsSettings, database_url: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
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


def on_db(database_url: str, step: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
    """Run one step on the test's database, outside the command's own event loop."""

    async def run() -> Any:
        conn = await asyncpg.connect(database_url)
        try:
            return await step(conn)
        finally:
            await conn.close()

    return asyncio.run(run())


def the_row(database_url: str) -> dict[str, Any]:
    async def read(conn: asyncpg.Connection) -> dict[str, Any]:
        found = await conn.fetchrow("SELECT * FROM charge_attempts WHERE order_id = 31")
        assert found is not None
        return dict(found)

    row: dict[str, Any] = on_db(database_url, read)
    return row


def messages(js: JetStreamContext, nats_settings: NatsSettings) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        # the fixture's client lives on another loop: a connection of this one
        nc = await streams.connect(nats_settings, name="test", reconnect=False)
        try:
            return await stream_messages(nc.jetstream(), nats_settings.stream)
        finally:
            await nc.close()

    return asyncio.run(read())


def test_a_try_started_on_purpose_is_published_at_once_as_that_try(
    js: JetStreamContext, nats_settings: NatsSettings, database_url: str, env: dict[str, str]
) -> None:
    on_db(database_url, lambda conn: put_try(conn, 31, "action_required"))

    result = cli("retry", "31", PERIOD.isoformat(), env=env)

    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"started try 2 of {KEY} (was action_required), key {KEY}:2: published as charge:{KEY}:2\n"
    )
    found = messages(js, nats_settings)
    assert list(found) == [f"charge:{KEY}:2"]
    assert parse(found[f"charge:{KEY}:2"]).attempt == 2
    row = the_row(database_url)
    assert (row["status"], row["current_try"], row["idempotency_key"]) == (
        "scheduled",
        2,
        f"{KEY}:2",
    )
    assert row["published_seq"] == 1


def test_json_says_the_same_as_one_object(
    js: JetStreamContext, nats_settings: NatsSettings, database_url: str, env: dict[str, str]
) -> None:
    on_db(database_url, lambda conn: put_try(conn, 31, "declined"))

    result = cli("retry", "--json", "31", PERIOD.isoformat(), env=env)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "order_id": 31,
        "billing_period": PERIOD.isoformat(),
        "try": 2,
        "key": f"{KEY}:2",
        "msg_id": f"charge:{KEY}:2",
        "was": "declined",
        "published": True,
        "error": None,
        "exit_code": 0,
    }
    assert list(messages(js, nats_settings)) == [f"charge:{KEY}:2"]


@pytest.mark.parametrize("as_json", [False, True])
def test_a_refusal_is_one_line_on_stderr_exit_1_and_changes_nothing(
    js: JetStreamContext,
    nats_settings: NatsSettings,
    database_url: str,
    env: dict[str, str],
    as_json: bool,
) -> None:
    on_db(
        database_url,
        lambda conn: put_try(conn, 31, "declined", decline_code="fraudulent", decline_class="hard"),
    )
    before = the_row(database_url)

    result = cli("retry", *(["--json"] if as_json else []), "31", PERIOD.isoformat(), env=env)

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"Error: RetryRefused: {KEY} is final by a hard decline (fraudulent): never tried again\n"
    )
    assert the_row(database_url) == before
    assert messages(js, nats_settings) == {}


def test_a_try_whose_publish_failed_stays_started_and_the_next_produce_publishes_it(
    js: JetStreamContext, nats_settings: NatsSettings, database_url: str, env: dict[str, str]
) -> None:
    on_db(database_url, lambda conn: put_try(conn, 31, "retry_scheduled", retry_in_s=86400.0))
    nowhere = env | {"NATS_URL": f"nats://127.0.0.1:{free_port()}"}

    result = cli("retry", "31", PERIOD.isoformat(), env=nowhere)

    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(
        f"started try 2 of {KEY} (was retry_scheduled), key {KEY}:2: NOT published (cannot"
        " connect to NATS at "
    )
    assert result.stdout.endswith("; the next `charge-worker produce` publishes it\n")
    assert (the_row(database_url)["status"], the_row(database_url)["published_at"]) == (
        "scheduled",
        None,
    )
    # a second retry is refused: the try is in flight
    again = cli("retry", "31", PERIOD.isoformat(), env=env)
    assert again.returncode == 1
    assert "has a try in flight (try 2 is scheduled)" in again.stderr

    settings = Settings(nats=nats_settings, db=DbSettings(url=database_url))
    summary = asyncio.run(produce(settings, PERIOD))

    assert (summary.tries_started, summary.published) == (0, 1)
    assert list(messages(js, nats_settings)) == [f"charge:{KEY}:2"]
