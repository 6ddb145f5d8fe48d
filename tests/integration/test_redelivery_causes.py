"""Redeliveries by cause against the real servers: the ledger row remembers which delivery
nak'd, whichever pod did, and the worker counts a redelivery `nak` (asked for) or
`unacked` (nobody told JetStream anything) from it (`charge_worker_redeliveries_total`).

The decision itself is unit tested (tests/unit/test_decisions.py, test_consumer_logic.py);
here are what only the servers show: the claim's SQL reading the nak back for the same
message only, JetStream's own redelivery after a nak with a delay, and after AckWait.
"""

from __future__ import annotations

from collections.abc import Callable

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.ledger import Ledger
from charge_worker.messages import parse
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    RunningWorker,
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
)

EXPIRED = "UPDATE charge_attempts SET lease_until = now() - interval '1 second'"


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    # scoring without a verdict under `hold` naks with the backoff's delay: one second
    return settings_for(
        nats_settings,
        database_url,
        gateway_sim.url,
        scoring_sim.url,
        scoring_policy="hold",
        ack_wait_s=1.0,
        backoff_s=(1.0, 1.0),
        heartbeat_s=0.3,
        max_deliver=6,
        scoring_breaker_failures=100,
    )


def acked_charged(worker: RunningWorker) -> Callable[[], bool]:
    """The delivery that charged is counted: its redelivery with it (one synchronous step)."""
    return lambda: (
        worker.metric("charge_worker_messages_total", outcome="charged", action="ack") == 1
    )


async def test_a_claim_reads_back_the_nak_of_its_own_message_only(pool: asyncpg.Pool) -> None:
    ledger = Ledger(pool, lease_s=60)
    charge = parse(due(5))
    first = await ledger.claim(charge, "w1", stream_seq=7)
    assert first.nak_delivery is None  # inserted: nothing before it
    await ledger.retry_later(first, "scoring gave no verdict", keep_lease=False, nak_delivery=1)
    again = await ledger.claim(charge, "w2", stream_seq=7)  # delivery 2 of that message
    assert again.nak_delivery == 1
    # delivery 2 dies (no write); another copy of the charge (a re-publish) takes over
    await pool.execute(EXPIRED)
    other = await ledger.claim(charge, "w3", stream_seq=9)
    assert other.nak_delivery is None  # message 7's nak is not message 9's
    # a requeue (an ack, not a nak) records no nak for the next claim of its message
    await ledger.retry_later(other, "gateway away", keep_lease=False, nak_delivery=None)
    assert (await ledger.claim(charge, "w4", stream_seq=9)).nak_delivery is None


async def test_every_redelivery_a_hold_on_scoring_asks_for_is_counted_nak(
    nc: Client, settings: Settings, scoring_sim: ServedApp
) -> None:
    await set_sim(scoring_sim.url, error_rate=1.0)  # no verdict: every delivery naks
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(11))
    async with running_worker(settings) as worker:

        def counted(cause: str) -> float:
            return worker.metric("charge_worker_redeliveries_total", cause=cause)

        await eventually(lambda: counted("nak") >= 2, "two redeliveries asked for by naks")
        await set_sim(scoring_sim.url, error_rate=0.0)
        await eventually(acked_charged(worker), "charged once scoring answers")
        assert counted("unacked") == 0
        naks = worker.metric("charge_worker_messages_total", outcome="unavailable", action="nak")
        assert counted("nak") == naks  # each nak came back once, and was known as asked for


async def test_a_redelivery_whose_worker_died_mid_charge_is_counted_unacked(
    nc: Client, settings: Settings, pool: asyncpg.Pool
) -> None:
    js = await provisioned(nc, settings)
    await publish(js, settings.nats.subject, due(12))
    # a worker fetches the message, claims the charge, and is killed: no ack, no nak
    sub = await js.pull_subscribe_bind(durable=settings.nats.durable, stream=settings.nats.stream)
    [msg] = await sub.fetch(1, timeout=5)
    await Ledger(pool, lease_s=60).claim(parse(msg.data), "killed", msg.metadata.sequence.stream)
    await sub.unsubscribe()
    await pool.execute(EXPIRED)  # its lease ran out with it
    async with running_worker(settings) as worker:
        await eventually(acked_charged(worker), "charged by the redelivery after AckWait")
        assert worker.metric("charge_worker_redeliveries_total", cause="unacked") == 1
        assert worker.metric("charge_worker_redeliveries_total", cause="nak") == 0
