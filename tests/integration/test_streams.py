"""Provisioning against a real nats-server: create, idempotent re-run, drift, --apply."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.api import AckPolicy, StorageType, StreamConfig

from charge_worker import streams
from charge_worker.settings import NatsSettings


async def test_creates_streams_and_consumer_per_contract(
    nc: Client, nats_settings: NatsSettings
) -> None:
    report = await streams.provision(nc.jetstream(), nats_settings)
    assert report.created == [
        f"stream {nats_settings.stream}",
        f"stream {nats_settings.dlq_stream}",
        f"stream {nats_settings.outcomes_stream}",
        f"consumer {nats_settings.stream}/charges-worker",
    ]
    js = nc.jetstream()
    charges = (await js.stream_info(nats_settings.stream)).config
    assert charges.subjects == [nats_settings.subject]
    assert charges.storage == StorageType.FILE
    assert charges.duplicate_window == 7200
    dlq = (await js.stream_info(nats_settings.dlq_stream)).config
    assert dlq.subjects == [nats_settings.dlq_subject]
    assert dlq.max_age == 30 * 86400
    outcomes = (await js.stream_info(nats_settings.outcomes_stream)).config
    assert outcomes.subjects == [f"{nats_settings.outcomes_subject}.>"]
    assert (outcomes.storage, outcomes.max_age) == (StorageType.FILE, 30 * 86400)
    assert outcomes.duplicate_window == 7200
    consumer = (await js.consumer_info(nats_settings.stream, "charges-worker")).config
    assert consumer.ack_policy == AckPolicy.EXPLICIT
    assert consumer.ack_wait == 30
    assert consumer.max_deliver == 5
    assert consumer.backoff == [30, 60, 300, 900]
    assert consumer.max_ack_pending == 1000


async def test_second_run_changes_nothing(nc: Client, nats_settings: NatsSettings) -> None:
    await streams.provision(nc.jetstream(), nats_settings)
    again = await streams.provision(nc.jetstream(), nats_settings)
    assert again.created == []
    assert again.drift == []
    assert again.updated == []


async def test_drift_is_reported_not_applied(nc: Client, nats_settings: NatsSettings) -> None:
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    changed = nats_settings.model_copy(update={"max_deliver": 8, "max_ack_pending": 64})
    report = await streams.provision(js, changed)
    assert {(d.field, d.actual, d.wanted) for d in report.drift} == {
        ("max_deliver", 5, 8),
        ("max_ack_pending", 1000, 64),
    }
    assert report.updated == []
    consumer = (await js.consumer_info(nats_settings.stream, "charges-worker")).config
    assert consumer.max_deliver == 5


async def test_apply_updates_what_jetstream_allows(nc: Client, nats_settings: NatsSettings) -> None:
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    changed = nats_settings.model_copy(
        update={"max_deliver": 6, "ack_wait_s": 10.0, "backoff_s": (10.0, 20.0, 40.0)}
    )
    report = await streams.provision(js, changed, apply=True)
    assert report.updated == [f"consumer {nats_settings.stream}/charges-worker"]
    consumer = (await js.consumer_info(nats_settings.stream, "charges-worker")).config
    assert (consumer.max_deliver, consumer.ack_wait, consumer.backoff) == (6, 10, [10, 20, 40])
    assert (await streams.provision(js, changed)).drift == []


async def test_unchangeable_drift_is_reported_and_left_alone(
    nc: Client, nats_settings: NatsSettings
) -> None:
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=nats_settings.stream,
            subjects=[nats_settings.subject],
            storage=StorageType.MEMORY,
            duplicate_window=7200,
        )
    )
    report = await streams.provision(js, nats_settings, apply=True)
    storage = [d for d in report.drift if d.field == "storage"]
    assert len(storage) == 1
    assert not storage[0].changeable
    assert "cannot change" in str(storage[0])
    assert f"stream {nats_settings.stream}" not in report.updated
    assert (await js.stream_info(nats_settings.stream)).config.storage == StorageType.MEMORY
