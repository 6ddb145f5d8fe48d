"""`explain` tells each story the product lives through, from the events every part writes."""

from __future__ import annotations

import datetime as dt
import json
import re

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker import events, streams
from charge_worker.explain import explain_command
from charge_worker.ledger import Ledger, Settlement
from charge_worker.producer.schedule import produce
from charge_worker.reconcile.run import run_reconcile
from charge_worker.retries.starts import start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import eventually, provisioned, running_worker, set_sim, settings_for
from tests.support.outcomes import unsent

from .test_ledger import PERIOD, charge
from .test_outcome_relay import relay_for
from .test_producer import DAY, Sub, add_subscriptions
from .test_reconcile import charge_id, put_row
from .test_retry_starts import put_try


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)


async def told(
    settings: Settings,
    order_id: int,
    capsys: pytest.CaptureFixture[str],
    period: dt.date = DAY,
    *,
    as_json: bool = False,
) -> str:
    capsys.readouterr()
    assert await explain_command(settings, order_id, period, as_json=as_json, ask_gateway=True) == 0
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

        async def relayed() -> bool:
            return await unsent(conn) == 0

        await eventually(relayed, "the worker's relay published the outcome event")
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
    # refunding a double changes nothing of the period: still its one event
    assert "outcome events: 1\n" in story
    assert re.search(
        r"  #1  charge\.succeeded .* occurred 20\S+  in the stream 20\S+, stream seq \d+\n", story
    ), story


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


async def test_outcome_events_each_with_where_it_is_and_the_count_past_pruning(
    nc: Client, pool: asyncpg.Pool, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger(pool, lease_s=60)
    claim = await ledger.claim(charge(8), "w1", stream_seq=1)
    await ledger.settle(claim, Settlement("succeeded", charge_id="ch_8"), story=None)
    await pool.execute("UPDATE charge_attempts SET status = 'refunded' WHERE order_id = 8")
    await pool.execute("UPDATE charge_attempts SET disputed_at = now() WHERE order_id = 8")
    relay = relay_for(pool, nc, settings.nats)
    # no stream yet: the first try fails, and the event waits with its error
    assert await relay.relay_once() == 1

    story = await told(settings, 8, capsys, PERIOD)
    assert "outcome events: 3\n" in story
    [first, second, third] = story.split("outcome events: 3\n")[1].splitlines()[:3]
    assert re.fullmatch(
        r"  #1  charge\.succeeded +occurred \S+  not in the stream yet: 1 try, next at \S+,"
        r" last error: \w+.*",
        first,
    ), first
    assert "#2  charge.refunded" in second
    assert "not in the stream yet: 0 tries" in second
    assert "#3  charge.disputed" in third

    await streams.provision(nc.jetstream(), settings.nats)

    async def sent() -> bool:
        await relay.relay_once()
        return bool(
            await pool.fetchval("SELECT bool_and(sent_at IS NOT NULL) FROM charge_outcomes")
        )

    await eventually(sent, "every event in the stream")
    await pool.execute(
        "UPDATE charge_outcomes SET sent_at = now() - interval '8 days' WHERE sequence < 3"
    )
    assert await relay.outbox.prune(settings.worker.outbox_retention_s) == 2

    story = await told(settings, 8, capsys, PERIOD)
    assert (
        "outcome events: 3; 2 not shown: sent, then pruned after the outbox's retention"
        " (CHARGE_WORKER_OUTBOX_RETENTION_S)\n" in story
    )
    assert re.search(r"\n  #3  charge\.disputed .* in the stream \S+, stream seq 3\n", story)
    assert "#1" not in story.split("outcome events")[1]

    document = json.loads(await told(settings, 8, capsys, PERIOD, as_json=True))
    outcomes = document["outcomes"]
    assert (outcomes["count"], outcomes["pruned"]) == (3, 2)
    [kept] = outcomes["events"]
    assert (kept["sequence"], kept["type"], kept["stream_seq"]) == (3, "charge.disputed", 3)
    assert kept["sent_at"] is not None
    assert document["state"]["outcome_seq"] == 3


async def test_a_period_without_outcome_events_says_so(
    settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    await put_row(conn, 9, "pending")
    story = await told(settings, 9, capsys)
    assert "outcome events: none (no change of state an event is written for)" in story
    document = json.loads(await told(settings, 9, capsys, as_json=True))
    assert document["outcomes"] == {"count": 0, "pruned": 0, "events": []}


async def test_every_try_of_the_period_with_its_key_decline_and_times(
    settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    """Try 1 declined soft, try 2 started by the producer's step and declined again: the
    period waits for try 3."""
    await put_try(conn, 10)
    await start_due(conn, limit=10, cap=8)
    await conn.execute(
        "UPDATE charge_attempts SET status = 'retry_scheduled', retry_at = now() + interval"
        " '3 days', decline_code = 'do_not_honor', decline_class = 'soft', settled_at = now(),"
        " gateway_charge_id = 'ch_10_2' WHERE order_id = 10"
    )

    story = await told(settings, 10, capsys)

    assert re.search(r"\n  retry scheduled: try 3 is due at 20\S+ \(the `produce` run", story)
    tries = story.split("tries: 2\n")[1].splitlines()[:3]
    assert re.fullmatch(
        rf"  try 1  10:{DAY} +declined +insufficient_funds \(soft\)  ch_10_1"
        r"  started 20\S+  ended 20\S+",
        tries[0],
    ), tries[0]
    assert re.fullmatch(
        rf"  try 2  10:{DAY}:2 +retry_scheduled +do_not_honor \(soft\)  ch_10_2"
        r"  started 20\S+  ended 20\S+",
        tries[1],
    ), tries[1]
    assert tries[2] == "story:"

    document = json.loads(await told(settings, 10, capsys, as_json=True))
    assert [
        (t["try"], t["key"], t["status"], t["decline_code"], t["decline_class"])
        for t in document["tries"]
    ] == [
        (1, f"10:{DAY}", "declined", "insufficient_funds", "soft"),
        (2, f"10:{DAY}:2", "retry_scheduled", "do_not_honor", "soft"),
    ]
    first, second = document["tries"]
    assert first["ended_at"] <= second["started_at"]
    assert document["state"]["current_try"] == 2


async def test_a_period_on_its_first_try_lists_that_one(
    settings: Settings, conn: asyncpg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    await put_row(conn, 11, "pending")
    story = await told(settings, 11, capsys)
    assert re.search(rf"\ntries: 1\n  try 1  11:{DAY} +pending +started 20\S+\nstory:\n", story)
    document = json.loads(await told(settings, 11, capsys, as_json=True))
    [only] = document["tries"]
    assert (only["try"], only["key"], only["ended_at"]) == (1, f"11:{DAY}", None)
