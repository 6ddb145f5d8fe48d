"""`explain` tells each story the product lives through, from the events every part writes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker import events
from charge_worker.explain import explain_command
from charge_worker.producer.schedule import produce
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import eventually, provisioned, running_worker, set_sim, settings_for

from .test_producer import DAY, Sub, add_subscriptions
from .test_reconcile import charge_id, put_row


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    yield connection
    await connection.close()


async def told(settings: Settings, order_id: int, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert await explain_command(settings, order_id, DAY, as_json=False, ask_gateway=True) == 0
    return capsys.readouterr().out


async def test_scheduled_published_charged_then_a_double_refunded(
    nc: Client,
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await provisioned(nc, settings)
    await add_subscriptions(settings.db.dsn, Sub("sub_1", 1))
    await produce(settings, DAY)
    async with running_worker(settings):

        async def charged() -> bool:
            status = await conn.fetchval("SELECT status FROM charge_attempts WHERE order_id = 1")
            return bool(status == "succeeded")

        await eventually(charged, "the charge settled")
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    extra = await charge_id(gateway_sim.url, 1, idempotency_key="a-forgotten-key")
    await run_reconcile(settings)
    story = await told(settings, 1, capsys)
    lines = story.splitlines()
    kinds = [line.split()[2] for line in lines if line.startswith("  20")]
    assert kinds == ["scheduled", "published", "delivery", "refund"]
    assert "charged -> ack" in story
    assert f"charge_id {extra}" in story
    assert "refunded" in story  # the gateway's view of the extra charge


async def test_unknown_outcome_resolved_by_reconcile(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await put_row(conn, 2, "pending", gateway_calls=1, lease_s=-60.0)
    made = await charge_id(gateway_sim.url, 2)  # the killed worker's call went through
    await run_reconcile(settings)
    story = await told(settings, 2, capsys)
    assert f"charge 2:{DAY.isoformat()}: succeeded {made}" in story
    assert "resolved" in story


async def test_quiet_charge_republished_by_reconcile(
    nc: Client, settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    await provisioned(nc, settings)
    await put_row(conn, 3, "scheduled")
    await run_reconcile(settings)
    story = await told(settings, 3, capsys)
    assert "republished" in story
    assert "scheduled" in story.splitlines()[0]


async def test_unknown_charge_exits_1(settings: Settings) -> None:
    assert await explain_command(settings, 999, DAY, as_json=True, ask_gateway=False) == 1


async def test_escape_sequences_in_the_story_never_reach_the_terminal(
    settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in production: text from message bodies, stored in the ledger and its story,
    reached the operator's terminal through `explain` as escape sequences."""
    await put_row(conn, 5, "pending", customer="cus\x1b[2J")
    await conn.execute(
        "UPDATE charge_attempts SET last_error = $1 WHERE order_id = 5", "gateway said \x9b31m"
    )
    await events.record(
        conn,
        5,
        DAY,
        "delivery",
        "worker-\x1b]0;owned\x07",
        delivery=1,
        stream_seq=9,
        outcome="outcome_unknown",
        action="nak",
        error="gateway timed out \u202egnp.exe",
    )
    await events.record(conn, 5, DAY, "discrepancy", "reconcile", why="\x1b[31mred")

    story = await told(settings, 5, capsys)

    assert all(line.isprintable() for line in story.splitlines()), story
    assert "customer cus\\x1b[2J" in story
    assert "last error: gateway said \\x9b31m" in story
    assert "worker-\\x1b]0;owned\\x07" in story
    assert "gateway timed out \\u202egnp.exe" in story
    assert "why \\x1b[31mred" in story


async def test_the_producers_steps_are_told_by_the_row_and_only_for_its_rows(
    conn: asyncpg.Connection,
) -> None:
    """`scheduled` and `published` come from the ledger row's columns: a row a worker made
    from a message someone else published tells neither, and the rows of an earlier
    version that wrote them as events are told once."""
    await put_row(conn, 6, "pending")  # claimed from a message no producer of ours sent
    await put_row(conn, 7, "succeeded", charge_id="ch_7")
    await events.record(conn, 7, DAY, "scheduled", "producer", subscription_id="sub_7")
    await conn.execute(
        "UPDATE charge_attempts SET published_at = now(), published_seq = 4 WHERE order_id = 7"
    )

    assert await events.story(conn, 6, DAY) == []
    [scheduled, published] = await events.story(conn, 7, DAY)
    assert (scheduled.kind, scheduled.detail) == ("scheduled", {"subscription_id": "sub_7"})
    assert (published.kind, published.detail) == ("published", {"msg_id": f"charge:7:{DAY}"})
