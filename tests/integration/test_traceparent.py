"""A `traceparent` header from outside: forwarded when valid, dropped when not, never fatal."""

from __future__ import annotations

import json

import structlog
from nats.aio.client import Client

from charge_worker import streams
from charge_worker.dlq import DeadLetters
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    PERIOD,
    consumer_idle,
    due,
    eventually,
    gateway_charges,
    provisioned,
    running_worker,
    settings_for,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
VALID = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
NON_ASCII = "00-4bf92f3577b34da6a3ce929d0e0e473ü-00f067aa0ba902b7-01"


async def test_a_non_ascii_traceparent_is_dropped_and_the_charge_made(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """Found in production: a non-ASCII traceparent crashed every delivery of its charge."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    cfg = settings.nats
    js = await provisioned(nc, settings)
    with structlog.testing.capture_logs() as logs:
        async with running_worker(settings) as worker:
            for order_id, traceparent in ((81, NON_ASCII), (82, VALID)):
                headers = {"Nats-Msg-Id": f"charge:{order_id}:{PERIOD}", "traceparent": traceparent}
                await js.publish(cfg.subject, due(order_id), headers=headers)

            async def both_charged() -> bool:
                return len(await gateway_charges(gateway_sim.url)) == 2

            await eventually(both_charged, "both charges made")
            await eventually(lambda: consumer_idle(nc, cfg), "both messages acked")
            assert worker.metric("charge_worker_redeliveries_total", cause="unacked") == 0
            assert worker.metric("charge_worker_redeliveries_total", cause="nak") == 0
    assert await gateway_charges(gateway_sim.url) == {f"81:{PERIOD}": 1, f"82:{PERIOD}": 1}
    assert (await js.stream_info(cfg.dlq_stream)).state.messages == 0
    traced = {
        line["order_id"]: line["trace_id"] for line in logs if line["event"] == "charge.settled"
    }
    assert traced == {81: None, 82: TRACE_ID}
    assert not [line for line in logs if line["event"] == "charge.crashed"]


async def test_a_dead_letter_and_its_replay_keep_only_a_valid_traceparent(
    nc: Client, nats_settings: NatsSettings
) -> None:
    """Found in production: `dlq replay` copied a non-ASCII traceparent back to the charges
    stream, where it crashed the charge again."""
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    dead = DeadLetters(js, nats_settings)
    body = json.dumps({"schema": "charge.due/v1", "order_id": 83}).encode()
    await dead.write(
        body,
        reason="max_deliveries",
        error="crashed",
        stream_seq=1,
        num_delivered=4,
        original={"Nats-Msg-Id": "charge:83", "traceparent": NON_ASCII},
    )
    # a dead letter written before this fix, its envelope holding the header as it came
    older = {"Nats-Msg-Id": "dlq:2", "Dlq-Reason": "max_deliveries", "traceparent": NON_ASCII}
    await js.publish(nats_settings.dlq_subject, body, headers=older)
    await dead.write(
        body,
        reason="max_deliveries",
        error="gave up",
        stream_seq=3,
        num_delivered=4,
        original={"traceparent": VALID},
    )

    first = await dead.get(1)
    assert first is not None
    assert "traceparent" not in first.headers
    report = await dead.replay([1, 2, 3])

    assert report.replayed == [1, 2, 3]
    replays = [await js.get_msg(nats_settings.stream, seq) for seq in (1, 2, 3)]
    assert [msg.headers for msg in replays] == [
        {"Nats-Msg-Id": "replay:1"},
        {"Nats-Msg-Id": "replay:2"},
        {"Nats-Msg-Id": "replay:3", "traceparent": VALID},
    ]
