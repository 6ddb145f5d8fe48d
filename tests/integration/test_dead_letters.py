"""Dead letters: the advisory safety net, and a DLQ that cannot be written."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import asyncpg
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.dlq import DeadLetters
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    PERIOD,
    consumer_idle,
    dead_letters_at_least,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    settings_for,
)


async def _advise(nc: Client, subject: str, seq: int) -> None:
    """What JetStream publishes when the last delivery of stream message `seq` timed out."""
    await nc.publish(subject, json.dumps({"stream_seq": seq, "deliveries": 4}).encode())
    await nc.flush()


async def test_a_last_delivery_that_died_requeues_an_open_charge_then_dead_letters_it(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """The MAX_DELIVERIES advisory: a death is no verdict; the third copy to run out is."""
    # the worker's own naks wait 2 min (the lease held elsewhere, clamped to the last step):
    # its deliveries must not run out (and requeue a copy of their own) while the test
    # plays JetStream's advisories, as they once did on a loaded machine
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, backoff_s=(5.0, 120.0)
    )
    js = await provisioned(nc, settings)
    cfg = settings.nats
    db = await asyncpg.connect(database_url)
    # a live lease of another worker's: every delivery of order 61 naks, nothing is charged
    await db.execute(
        """INSERT INTO charge_attempts (order_id, billing_period, idempotency_key,
               subscription_id, customer_id, amount_minor, currency, status, lease_owner,
               lease_until)
           VALUES (61, $1, '61:2026-12-01', 'sub_61', 'cus_ok', 99000, 'RUB', 'pending',
                   'elsewhere', now() + interval '1 hour')""",
        PERIOD,
    )
    body = due(61)
    seq = await publish(js, cfg.subject, body, msg_id="charge:61:2026-12-01")
    subject = DeadLetters(js, cfg).advisory_subject()
    async with running_worker(settings) as worker:
        copies = []
        for exhausted in (1, 2):
            await _advise(nc, subject, copies[-1] if copies else seq)
            await eventually(_stream_grew(js, cfg.stream, seq + exhausted - 1), f"copy {exhausted}")
            copy = await js.get_msg(cfg.stream, await _last_seq(js, cfg.stream))
            assert copy.data == body
            assert (copy.headers or {})["Charge-Exhausted"] == str(exhausted)
            copies.append(copy.seq)
        assert (copy.headers or {})["Nats-Msg-Id"] == f"requeue:{copies[0]}"

        await _advise(nc, subject, copies[-1])  # the third copy ran out too
        await eventually(lambda: dead_letters_at_least(nc, cfg), "the dead letter")
        dead = await js.get_msg(cfg.dlq_stream, 1)
        headers = dead.headers or {}
        assert dead.data == body
        assert headers["Dlq-Reason"] == "max_deliveries"
        assert headers["Dlq-Stream-Seq"] == str(copies[-1])
        assert headers["Nats-Msg-Id"] == f"dlq:{copies[-1]}"

        # settled meanwhile: the next advisory forgets it, no copy and no letter
        await db.execute(
            """UPDATE charge_attempts SET status = 'succeeded', gateway_charge_id = 'ch_61',
                   lease_owner = NULL, lease_until = NULL, settled_at = now()
             WHERE order_id = 61"""
        )
        await _advise(nc, subject, seq)
        forgotten = "charge_worker_deliveries_exhausted_total"
        await eventually(lambda: worker.metric(forgotten, verdict="forget") == 1, "forgotten")
        assert await _last_seq(js, cfg.stream) == copies[-1]
        assert (await js.stream_info(cfg.dlq_stream)).state.messages == 1
        assert worker.metric(forgotten, verdict="requeue") == 2
        assert await gateway_charges(gateway_sim.url) == {}
    await db.close()


async def _last_seq(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.last_seq


def _stream_grew(js: JetStreamContext, stream: str, past: int) -> Callable[[], Awaitable[bool]]:
    async def grew() -> bool:
        return await _last_seq(js, stream) > past

    return grew


async def test_unwritable_dead_letter_stream_naks_never_drops(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        max_deliver=10,
        heartbeat_s=0.3,
    )
    js = await provisioned(nc, settings)
    async with running_worker(settings):
        await js.delete_stream(settings.nats.dlq_stream)  # nowhere to write dead letters
        await publish(js, settings.nats.subject, b"poison")

        async def redelivered() -> bool:
            info = await js.consumer_info(settings.nats.stream, settings.nats.durable)
            return info.num_redelivered >= 1

        await eventually(redelivered, "the poison redelivered, not dropped")
        await streams.provision(js, settings.nats)  # the DLQ is back
        await eventually(lambda: dead_letters_at_least(nc, settings.nats), "dead-lettered at last")
    assert await consumer_idle(nc, settings.nats)


async def test_a_body_postgresql_cannot_store_is_dead_lettered_poison_at_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """Found in production: these passed the parser and failed in PostgreSQL on every
    delivery; taken for an outage, one was requeued 41 times in 8 minutes."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    cfg = settings.nats
    js = await provisioned(nc, settings)
    bodies = [
        due(71, customer="cus\x00"),
        due(72, subscription_id="sub\x00"),
        due(73, due_at="0001-01-01T00:30:00+01:00"),
        due(74, due_at="9999-12-31T23:30:00-01:00"),
    ]
    async with running_worker(settings) as worker:
        seqs = [await publish(js, cfg.subject, body) for body in bodies]
        await eventually(lambda: dead_letters_at_least(nc, cfg, len(bodies)), "the dead letters")
        await eventually(lambda: consumer_idle(nc, cfg), "every message settled")
        assert worker.metric("charge_worker_dead_letters_total", reason="poison") == len(bodies)
        assert worker.metric("charge_worker_redeliveries_total", cause="unacked") == 0
        assert worker.metric("charge_worker_redeliveries_total", cause="nak") == 0
        assert worker.metric("charge_worker_requeues_total") == 0
    for dlq_seq, (seq, body) in enumerate(zip(seqs, bodies, strict=True), start=1):
        dead = await js.get_msg(cfg.dlq_stream, dlq_seq)
        headers = dead.headers or {}
        assert dead.data == body
        assert headers["Dlq-Reason"] == "poison"
        assert headers["Dlq-Stream-Seq"] == str(seq)
        assert headers["Dlq-Num-Delivered"] == "1"
    assert (await nc.jetstream().stream_info(cfg.stream)).state.last_seq == seqs[-1]
    assert await gateway_charges(gateway_sim.url) == {}
