"""The worker end to end in-process: real NATS, PostgreSQL and simulators over HTTP.

Each test is one of the incidents the product exists for; each would fail on the
incident's code (no claim, no heartbeat, no idempotency). What a delivery comes to for each
outcome (conflict, unverified, every answer of the gateway) is the pipeline's logic, unit
tested on in-memory ports (tests/unit/test_pipeline.py, test_consumer_logic.py); here is
what needs the servers: JetStream's deliveries, acks and dead letters, PostgreSQL's claim.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Awaitable, Callable

import asyncpg
import httpx
import pytest
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client.parser import text_string_to_metric_families

from charge_worker.dlq import DeadLetters
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import PostgresServer
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    consumer_idle,
    dead_letters_at_least,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
    statuses,
)


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)


def settled(database_url: str, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        rows = await statuses(database_url)
        return len(rows) >= count and all(s not in ("pending", "scheduled") for s in rows.values())

    return check


async def test_charges_declines_and_blocks(
    nc: Client, settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    js = await provisioned(nc, settings)
    with structlog.testing.capture_logs() as logs:
        await _charge_decline_block(js, settings, database_url)
    settled_lines = [line for line in logs if line["event"] == "charge.settled"]
    assert sorted(
        (line["order_id"], line["outcome"], line["action"]) for line in settled_lines
    ) == [
        (1, "charged", "ack"),
        (2, "declined", "ack"),
        (3, "blocked", "ack"),
    ]
    for line in settled_lines:  # one canonical line per message, with its context bound
        assert line["billing_period"] == "2026-12-01"
        assert line["delivery"] == 1
        assert {"stream_seq", "duration_s", "trace_id"} <= line.keys()
    # a decline that names no code is a generic one, soft: the period's next try is scheduled
    assert await statuses(database_url) == {1: "succeeded", 2: "retry_scheduled", 3: "blocked"}
    assert await gateway_charges(gateway_sim.url) == {"1:2026-12-01": 1}


async def _charge_decline_block(
    js: JetStreamContext, settings: Settings, database_url: str
) -> None:
    async with running_worker(settings) as worker:
        await publish(js, settings.nats.subject, due(1))
        await publish(js, settings.nats.subject, due(2, customer="cus_decline_x"))
        await publish(js, settings.nats.subject, due(3, customer="cus_block_x"))
        await eventually(settled(database_url, 3), "three charges settled")
        await eventually(
            lambda: (
                worker.metric("charge_worker_messages_total", outcome="blocked", action="ack") == 1
            ),
            "the last ack counted",
        )


async def test_one_message_delivered_three_times_charges_once(
    nc: Client, settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    js = await provisioned(nc, settings)
    for copy in range(3):  # three stream messages, as a producer retrying past the window
        await publish(js, settings.nats.subject, due(7), msg_id=f"retry-{copy}")
    async with running_worker(settings) as worker:
        await eventually(settled(database_url, 1), "the charge settled")
        await eventually(
            lambda: worker.metric("charge_worker_duplicates_absorbed_total") == 2,
            "two duplicates absorbed",
        )
    assert await gateway_charges(gateway_sim.url) == {"7:2026-12-01": 1}


async def test_ten_concurrent_copies_charge_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, concurrency=10
    )
    await set_sim(gateway_sim.url, latency={"fixed_s": 0.3})  # copies overlap in flight
    js = await provisioned(nc, settings)
    for copy in range(10):
        await publish(js, settings.nats.subject, due(8), msg_id=f"copy-{copy}")
    async with running_worker(settings):
        await eventually(settled(database_url, 1), "the charge settled")
        await eventually(lambda: consumer_idle(nc, settings.nats), "every copy acked", within_s=90)
    assert await gateway_charges(gateway_sim.url) == {"8:2026-12-01": 1}


async def test_scoring_slower_than_ack_wait_charges_once_without_redelivery(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """The incident: scoring at 7 s, AckWait 5 s. Heartbeats keep the message ours."""
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        ack_wait_s=5.0,
        backoff_s=(5.0, 10.0),
        scoring_timeout_s=9.0,
    )
    await set_sim(scoring_sim.url, latency={"fixed_s": 7.0})
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(9))
    async with running_worker(settings) as worker:
        await eventually(settled(database_url, 1), "the charge settled")
        assert worker.metric("charge_worker_redeliveries_total", cause="unacked") == 0
        assert worker.metric("charge_worker_redeliveries_total", cause="nak") == 0
        assert worker.metric("charge_worker_heartbeats_total") >= 3
    assert await gateway_charges(gateway_sim.url) == {"9:2026-12-01": 1}


async def test_idempotency_disabled_at_the_gateway_still_charges_once(
    nc: Client, settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    js = await provisioned(nc, settings)
    for copy in range(5):
        await publish(js, settings.nats.subject, due(10), msg_id=f"copy-{copy}")
    async with running_worker(settings):
        await eventually(settled(database_url, 1), "the charge settled")
        await eventually(lambda: consumer_idle(nc, settings.nats), "every copy acked")
    assert await gateway_charges(gateway_sim.url) == {"10:2026-12-01": 1}


async def test_poison_is_dead_lettered_after_one_delivery(nc: Client, settings: Settings) -> None:
    body, reason = b"not json", "not UTF-8 JSON"
    js = await provisioned(nc, settings)
    seq = await publish(js, settings.nats.subject, body, msg_id="poison-1")
    async with running_worker(settings):
        await eventually(lambda: dead_letters_at_least(nc, settings.nats), "one dead letter")
    dead = await js.get_msg(settings.nats.dlq_stream, 1)
    headers = dead.headers or {}
    assert dead.data == body  # byte for byte
    assert headers["Dlq-Reason"] == "poison"
    assert reason in headers["Dlq-Error"]
    assert headers["Dlq-Stream-Seq"] == str(seq)
    assert headers["Dlq-Num-Delivered"] == "1"
    assert headers["Dlq-Orig-Msg-Id"] == "poison-1"
    assert await consumer_idle(nc, settings.nats)


async def test_max_deliveries_dead_letters_with_the_original_payload(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """Processing that crashes on every delivery ends in the DLQ, not in a loop."""
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        max_deliver=3,
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        heartbeat_s=0.3,
        failpoints="after_claim:raise",
    )
    body = due(14)
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, body)
    async with running_worker(settings) as worker:
        await eventually(
            lambda: dead_letters_at_least(nc, settings.nats), "dead-lettered after 3 deliveries"
        )
        assert worker.metric("charge_worker_messages_total", outcome="crashed", action="nak") == 2
    dead = await js.get_msg(settings.nats.dlq_stream, 1)
    headers = dead.headers or {}
    assert dead.data == body
    assert headers["Dlq-Reason"] == "max_deliveries"
    assert headers["Dlq-Num-Delivered"] == "3"
    assert "after_claim" in headers["Dlq-Error"]
    assert await statuses(database_url) == {14: "failed"}  # never sent to the gateway
    assert await gateway_charges(gateway_sim.url) == {}

    fixed = settings.model_copy(
        update={"worker": settings.worker.model_copy(update={"failpoints": ""})}
    )
    async with running_worker(fixed):  # the bug is fixed; the operator replays
        report = await DeadLetters(js, settings.nats).replay([1])
        assert report.replayed == [1]
        await eventually(settled(database_url, 1), "charged after the replay")
    assert await statuses(database_url) == {14: "succeeded"}
    assert await gateway_charges(gateway_sim.url) == {"14:2026-12-01": 1}


async def test_a_dependency_outage_past_max_deliver_requeues_instead_of_dead_lettering(
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
        scoring_policy="hold",
        max_deliver=2,
        ack_wait_s=1.0,
        backoff_s=(1.0,),
        heartbeat_s=0.3,
        scoring_timeout_s=0.5,
        scoring_breaker_failures=100,
    )
    await set_sim(scoring_sim.url, error_rate=1.0)  # no verdict; policy hold waits for one
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(17))
    async with running_worker(settings) as worker:
        await eventually(lambda: worker.metric("charge_worker_requeues_total") >= 2, "requeued")
        await set_sim(scoring_sim.url, error_rate=0.0)
        await eventually(settled(database_url, 1), "charged once scoring answers")
        assert worker.metric("charge_worker_dead_letters_total", reason="max_deliveries") == 0
    assert await statuses(database_url) == {17: "succeeded"}
    assert await gateway_charges(gateway_sim.url) == {"17:2026-12-01": 1}


async def test_scoring_down_defers_then_a_late_block_marks_the_charge_for_review(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    # the breaker opens during the outage; once nothing but the checks calls scoring, their
    # loop must still probe it closed (the breaker half-opens only on a call), and the checks
    # a failed round took must come due at the next round, not a whole batch's timeout later
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        deferred_check_interval_s=0.2,
        scoring_breaker_failures=2,
        scoring_breaker_reset_s=0.5,
    )
    await set_sim(scoring_sim.url, error_rate=1.0)
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(15, customer="cus_block_later"))
    await publish(js, settings.nats.subject, due(16))
    async with running_worker(settings) as worker:
        await eventually(settled(database_url, 2), "both charged without a verdict")
        assert worker.metric("charge_worker_scoring_total", result="failed_defer") == 2
        await eventually(
            lambda: worker.metric("charge_worker_breaker_open", dependency="scoring") == 1,
            "the scoring breaker open",
        )
        await set_sim(scoring_sim.url, error_rate=0.0)  # scoring is healthy again
        await eventually(
            lambda: (
                worker.metric("charge_worker_deferred_checks_resolved_total", verdict="blocked")
                == 1
            ),
            "the late block found",
        )
        await eventually(
            lambda: (
                worker.metric("charge_worker_deferred_checks_resolved_total", verdict="approved")
                == 1
            ),
            "the other check approved",
        )
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT order_id, status, scoring, review_reason FROM charge_attempts ORDER BY 1"
        )
        checks = await conn.fetch("SELECT order_id, status FROM deferred_scoring_checks ORDER BY 1")
    finally:
        await conn.close()
    assert [(r["order_id"], r["status"], r["scoring"]) for r in rows] == [
        (15, "succeeded", "deferred"),
        (16, "succeeded", "deferred"),
    ]
    assert rows[0]["review_reason"] is not None
    assert rows[1]["review_reason"] is None
    assert [(c["order_id"], c["status"]) for c in checks] == [(15, "blocked"), (16, "approved")]


async def test_health_and_readiness_flip_with_the_database(
    nc: Client, nats_settings: NatsSettings, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> None:
    with PostgresServer() as pg:
        await migrate(pg.url)
        settings = settings_for(nats_settings, pg.url, gateway_sim.url, scoring_sim.url)
        await provisioned(nc, settings)
        async with (
            running_worker(settings) as worker,
            httpx.AsyncClient(base_url=worker.http_url) as client,
        ):
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 200
            await asyncio.to_thread(pg.terminate)
            down = await client.get("/readyz")
            assert down.status_code == 503
            assert "PostgreSQL" in down.text
            assert (await client.get("/healthz")).status_code == 200  # alive: a restart won't help
            await asyncio.to_thread(pg.start)
            await eventually(
                lambda: _status(client, "/readyz", 200), "ready again once PostgreSQL is back"
            )
            worker.stop.set()
            await eventually(lambda: _status(client, "/readyz", 503), "not ready while draining")


async def _status(client: httpx.AsyncClient, path: str, expected: int) -> bool:
    try:
        return (await client.get(path)).status_code == expected
    except httpx.TransportError:
        return expected != 200


async def test_consumer_and_dead_letter_gauges(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, stats_interval_s=0.2
    )
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, b"not json")
    await publish(js, settings.nats.subject, due(61))
    async with running_worker(settings) as worker:
        await eventually(lambda: worker.metric("charge_worker_dlq_messages") == 1, "DLQ gauge")
        await eventually(settled(database_url, 1), "charged")
        assert worker.metric("charge_worker_consumer_max_ack_pending") == 1000


async def test_metrics_scraped_after_redeliveries_and_dead_letters(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """What Prometheus would scrape: the counters the alerts read, at the right values."""
    settings = settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        scoring_policy="hold",
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        heartbeat_s=0.3,
        scoring_breaker_failures=100,
    )
    await set_sim(scoring_sim.url, error_rate=1.0)  # the first delivery finds no verdict
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, b"{not json")
    await publish(js, settings.nats.subject, due(71))
    async with running_worker(settings) as worker:
        await eventually(
            lambda: (
                worker.metric("charge_worker_messages_total", outcome="unavailable", action="nak")
                == 1
            ),
            "the first delivery nak'd",
        )
        await set_sim(scoring_sim.url, error_rate=0.0)
        await eventually(settled(database_url, 1), "charged on the redelivery")
        async with httpx.AsyncClient(base_url=worker.http_url) as client:
            exposition = (await client.get("/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }
    assert samples[("charge_worker_redeliveries_total", (("cause", "nak"),))] == 1
    assert samples[("charge_worker_redeliveries_total", (("cause", "unacked"),))] == 0
    assert samples[("charge_worker_dead_letters_total", (("reason", "poison"),))] == 1
    charged = (("action", "ack"), ("outcome", "charged"))
    assert samples[("charge_worker_messages_total", charged)] == 1
    assert samples[("charge_worker_charges_total", (("result", "charged"),))] == 1
    assert samples[("charge_worker_scoring_total", (("result", "failed_hold"),))] == 1
    if shutil.which("promtool"):  # Prometheus' own view of the names, types and help
        checked = await asyncio.to_thread(
            subprocess.run,
            ["promtool", "check", "metrics"],
            input=exposition,
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
