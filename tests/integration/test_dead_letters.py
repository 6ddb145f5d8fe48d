"""Dead letters: the advisory safety net, and a DLQ that cannot be written."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from charge_worker import streams
from charge_worker.dlq import DeadLetters
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings

from .worker_harness import (
    consumer_idle,
    dead_letters_at_least,
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
    settings_for,
)


async def test_max_deliveries_advisory_dead_letters_the_stream_copy(
    nc: Client, nats_settings: NatsSettings
) -> None:
    """A worker that died on the last delivery never settles it: the advisory does."""
    cfg = nats_settings.model_copy(update={"durable": "short-lived"})
    js = nc.jetstream()
    await streams.provision(js, cfg)
    await js.add_consumer(
        cfg.stream,
        ConsumerConfig(
            durable_name=cfg.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=0.5,
            max_deliver=1,
            filter_subject=cfg.subject,
        ),
    )
    dead_letters = DeadLetters(js, cfg)
    await nc.subscribe(dead_letters.advisory_subject(), cb=dead_letters.on_max_deliveries)
    body = due(51)
    seq = await publish(js, cfg.subject, body, msg_id="charge:51:2026-12-01")
    sub = await js.pull_subscribe_bind(durable=cfg.durable, stream=cfg.stream)
    [taken] = await sub.fetch(1, timeout=5)  # taken, then "the worker dies": never settled
    assert taken.metadata.num_delivered == 1
    await eventually(lambda: dead_letters_at_least(nc, cfg), "the advisory's dead letter")
    dead = await js.get_msg(cfg.dlq_stream, 1)
    headers = dead.headers or {}
    assert dead.data == body
    assert headers["Dlq-Reason"] == "max_deliveries"
    assert headers["Dlq-Stream-Seq"] == str(seq)
    assert headers["Dlq-Orig-Msg-Id"] == "charge:51:2026-12-01"
    assert headers["Nats-Msg-Id"] == f"dlq:{seq}"


async def test_unwritable_dead_letter_stream_naks_never_drops(
    nc: Client, nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:  # fmt: skip
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url,
        ack_wait_s=1.0, backoff_s=(1.0, 1.0), max_deliver=10, heartbeat_s=0.3,
    )  # fmt: skip
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
