"""The relay against real NATS and PostgreSQL: what committed reaches `CHARGE_OUTCOMES` once
per `event_id`, in `sequence` order per period, whatever fails in between."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import asyncpg
import jsonschema
import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from charge_worker import streams
from charge_worker.ledger import Ledger, Settlement
from charge_worker.outcomes.outbox import Outbox
from charge_worker.outcomes.relay import OutboxMetrics, Relay
from charge_worker.settings import NatsSettings, WorkerSettings
from tests.integration.test_ledger import PERIOD, charge
from tests.support.contracts import schema
from tests.support.outcomes import outcomes, unsent

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Crash(Exception):
    """A relay dying between the publish and the mark."""


def relay_for(
    pool: asyncpg.Pool,
    nc: Client,
    cfg: NatsSettings,
    *,
    batch: int = 200,
    before_mark: Callable[[], None] = lambda: None,
    registry: CollectorRegistry | None = None,
) -> Relay:
    worker = WorkerSettings(outbox_batch=batch, outbox_publish_timeout_s=2.0)
    outbox = Outbox(pool, hold_s=5.0, retry_max_s=worker.outbox_retry_max_s)
    metrics = OutboxMetrics(registry or CollectorRegistry())
    return Relay(outbox, nc.jetstream(), cfg, worker, metrics, before_mark=before_mark)


@pytest.fixture
async def provisioned(nc: Client, nats_settings: NatsSettings) -> NatsSettings:
    await streams.provision(nc.jetstream(), nats_settings)
    return nats_settings


async def succeed(pool: asyncpg.Pool, order_id: int, charge_id: str | None = None) -> None:
    ledger = Ledger(pool, lease_s=60)
    claim = await ledger.claim(charge(order_id), "w1", stream_seq=order_id)
    await ledger.settle(
        claim, Settlement("succeeded", charge_id=charge_id or f"ch_{order_id}"), story=None
    )


async def test_committed_events_reach_the_stream_marked_with_their_place(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    await succeed(pool, 1)
    await pool.execute("UPDATE charge_attempts SET traceparent = $1", TRACEPARENT)
    await pool.execute("UPDATE charge_attempts SET status = 'refunded'")
    relay = relay_for(pool, nc, provisioned)
    assert await relay.relay_once() == 1  # one event of a period per batch: its lowest
    assert await relay.relay_once() == 1
    first, second = await outcomes(nc.jetstream(), provisioned)
    assert first.subject == f"{provisioned.outcomes_subject}.succeeded"
    assert first.headers["Nats-Msg-Id"] == f"outcome:1:{PERIOD.isoformat()}:1"
    assert "traceparent" not in first.headers  # the charge had none when it succeeded
    assert second.subject == f"{provisioned.outcomes_subject}.refunded"
    assert second.headers["traceparent"] == TRACEPARENT
    for message in (first, second):
        jsonschema.validate(message.body, schema("charge-outcome.v1.json"))
    assert [m.body["sequence"] for m in (first, second)] == [1, 2]
    marked = await pool.fetch("SELECT stream_seq, sent_at FROM charge_outcomes ORDER BY sequence")
    assert [r["stream_seq"] for r in marked] == [first.seq, second.seq]
    assert all(r["sent_at"] is not None for r in marked)
    assert await relay.relay_once() == 0


async def test_a_crash_between_publish_and_mark_leaves_one_message_per_event(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    for order_id in range(1, 6):
        await succeed(pool, order_id)

    def crash() -> None:
        raise Crash

    with pytest.raises(Crash):
        await relay_for(pool, nc, provisioned, before_mark=crash).relay_once()
    assert await unsent(pool) == 5  # the mark rolled back with the crash
    registry = CollectorRegistry()
    assert await relay_for(pool, nc, provisioned, registry=registry).relay_once() == 5
    assert await unsent(pool) == 0
    stored = await outcomes(nc.jetstream(), provisioned)
    assert sorted(m.headers["Nats-Msg-Id"] for m in stored) == [
        f"outcome:{n}:{PERIOD.isoformat()}:1" for n in range(1, 6)
    ]
    assert (
        registry.get_sample_value("charge_worker_outbox_publishes_total", {"result": "duplicate"})
        == 5
    )


async def test_with_no_stream_events_wait_and_are_tried_again(
    pool: asyncpg.Pool, nc: Client, nats_settings: NatsSettings
) -> None:
    """NATS without the stream (or away) answers no publish: rows wait, counted, later."""
    await succeed(pool, 1)
    registry = CollectorRegistry()
    relay = relay_for(pool, nc, nats_settings, registry=registry)
    assert await relay.relay_once() == 1
    row = await pool.fetchrow(
        "SELECT tries, last_error, next_try_at > now() AS later FROM charge_outcomes"
    )
    assert (row["tries"], row["later"]) == (1, True)
    assert row["last_error"]
    assert (
        registry.get_sample_value("charge_worker_outbox_publishes_total", {"result": "failed"}) == 1
    )
    assert await relay.relay_once() == 0  # not before its next try
    await pool.execute("UPDATE charge_outcomes SET next_try_at = now()")
    await streams.provision(nc.jetstream(), nats_settings)
    assert await relay.relay_once() == 1
    assert len(await outcomes(nc.jetstream(), nats_settings)) == 1
    await relay.look()
    assert registry.get_sample_value("charge_worker_outbox_oldest_unsent_seconds") == 0


async def test_a_period_waits_behind_its_own_failed_event(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    """Event 2 is never published while event 1 is unsent, even if 1 failed and waits."""
    await succeed(pool, 1)
    await pool.execute("UPDATE charge_attempts SET status = 'refunded'")
    await pool.execute(
        "UPDATE charge_outcomes SET next_try_at = now() + interval '1 hour' WHERE sequence = 1"
    )
    relay = relay_for(pool, nc, provisioned)
    assert await relay.relay_once() == 0
    assert await outcomes(nc.jetstream(), provisioned) == []


async def test_relays_in_every_pod_publish_each_event_once(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    for order_id in range(1, 201):
        await succeed(pool, order_id)
    registries = [CollectorRegistry() for _ in range(4)]
    relays = [relay_for(pool, nc, provisioned, batch=10, registry=r) for r in registries]

    async def drain(relay: Relay) -> None:
        while await unsent(pool):
            await relay.relay_once()

    await asyncio.gather(*(drain(r) for r in relays))
    stored = await outcomes(nc.jetstream(), provisioned)
    assert len(stored) == 200
    assert len({m.headers["Nats-Msg-Id"] for m in stored}) == 200
    published = [
        r.get_sample_value("charge_worker_outbox_publishes_total", {"result": "published"}) or 0
        for r in registries
    ]
    assert sum(published) == 200
    assert sum(1 for p in published if p) > 1, published  # SKIP LOCKED shared the work


async def test_many_changes_of_one_period_arrive_in_sequence_order(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    await succeed(pool, 7)
    for status in ("refunded", "succeeded", "refunded", "succeeded"):
        await pool.execute("UPDATE charge_attempts SET status = $1", status)
    relays = [relay_for(pool, nc, provisioned) for _ in range(3)]
    while await unsent(pool):
        await asyncio.gather(*(r.relay_once() for r in relays))
    stored = await outcomes(nc.jetstream(), provisioned)
    assert [m.body["sequence"] for m in stored] == [1, 2, 3, 4, 5]


async def test_sent_events_past_the_retention_are_pruned(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    for order_id in (1, 2):
        await succeed(pool, order_id)
    await succeed(pool, 3)
    relay = relay_for(pool, nc, provisioned)
    await pool.execute(
        "UPDATE charge_outcomes SET next_try_at = now() + interval '1 day' WHERE order_id = 3"
    )
    assert await relay.relay_once() == 2
    await pool.execute(
        "UPDATE charge_outcomes SET sent_at = now() - interval '8 days' WHERE order_id = 1"
    )
    outbox = Outbox(pool, hold_s=5.0, retry_max_s=60.0)
    assert await outbox.prune(retention_s=7 * 86400) == 1
    left = await pool.fetch("SELECT order_id FROM charge_outcomes ORDER BY order_id")
    assert [r["order_id"] for r in left] == [2, 3]  # a recent one, and one never sent
    assert await outbox.oldest_unsent_s() > 0


async def test_an_id_a_failover_lost_commit_took_is_not_reused(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    """An asynchronous standby promoted without the primary's last commits: the relay had
    published the event of such a commit (1:…:1, charged ch_lost), the ledger no longer has
    it, and the change made again gets sequence 1 once more. Inside the duplicate window the
    stream would drop it as a re-publish, and downstream would never hear of it: the relay
    tells the two apart by their bodies, and renumbers the period's unsent events past it."""
    js = nc.jetstream()
    lost = {"event_id": f"1:{PERIOD.isoformat()}:1", "sequence": 1, "gateway_charge_id": "ch_lost"}
    await js.publish(
        f"{provisioned.outcomes_subject}.succeeded",
        json.dumps(lost).encode(),
        headers={"Nats-Msg-Id": f"outcome:1:{PERIOD.isoformat()}:1"},
    )
    await succeed(pool, 1, "ch_now")
    await pool.execute("UPDATE charge_attempts SET status = 'refunded'")  # unsent behind it
    registry = CollectorRegistry()
    relay = relay_for(pool, nc, provisioned, registry=registry)
    while await unsent(pool):
        await relay.relay_once()
    stored = await outcomes(js, provisioned)
    assert [(m.body["sequence"], m.body["gateway_charge_id"]) for m in stored] == [
        (1, "ch_lost"),
        (2, "ch_now"),
        (3, "ch_now"),
    ]
    assert [m.body["type"] for m in stored[1:]] == ["charge.succeeded", "charge.refunded"]
    assert [m.headers["Nats-Msg-Id"] for m in stored[1:]] == [
        f"outcome:1:{PERIOD.isoformat()}:2",
        f"outcome:1:{PERIOD.isoformat()}:3",
    ]
    assert await pool.fetchval("SELECT outcome_seq FROM charge_attempts") == 3
    assert (
        registry.get_sample_value("charge_worker_outbox_publishes_total", {"result": "renumbered"})
        == 1
    )
    await pool.execute("UPDATE charge_attempts SET status = 'succeeded'")  # the next change
    await relay.relay_once()
    assert (await outcomes(js, provisioned))[-1].body["sequence"] == 4


async def test_a_re_publish_of_the_same_event_is_not_renumbered(
    pool: asyncpg.Pool, nc: Client, provisioned: NatsSettings
) -> None:
    await succeed(pool, 1)

    def crash() -> None:
        raise Crash

    with pytest.raises(Crash):
        await relay_for(pool, nc, provisioned, before_mark=crash).relay_once()
    await relay_for(pool, nc, provisioned).relay_once()
    assert await pool.fetchval("SELECT outcome_seq FROM charge_attempts") == 1
    assert len(await outcomes(nc.jetstream(), provisioned)) == 1
