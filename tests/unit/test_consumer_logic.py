"""One message from fetch to ack, in memory: the consumer executes the action the pipeline
concluded, once, counts it and tells it in one canonical line.

The consumer runs over the ports of tests/support/fakes.py (`FakeMessage` for the message,
`FakeDeadLetters` for the dead-letter stream and the requeued copies, the in-memory ledger,
gateway and scoring behind the real pipeline). JetStream's own part (redelivery after a nak,
AckWait, the copy delivered again) is tests/integration/test_worker.py's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest
import structlog
from nats.js import JetStreamContext

from charge_worker.settings import NatsSettings, Settings
from charge_worker.worker.consumer import Consumer
from charge_worker.worker.failpoints import Failpoints
from tests.support.fakes import (
    GATEWAY_URL,
    LEASE_S,
    SCORING_URL,
    FakeMessage,
    Refuse,
    World,
    due,
)
from tests.support.harness import settings_for

CHARGE = "POST /v1/charges"
ACK_WAIT_S = 5.0
MAX_DELIVER = 4


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with World() as made:
        yield made


def settings() -> Settings:
    return settings_for(
        NatsSettings(url="nats://127.0.0.1:4222"),
        "postgresql://fake@127.0.0.1:5432/fake",
        GATEWAY_URL,
        SCORING_URL,
        ack_wait_s=ACK_WAIT_S,
        backoff_s=(5.0, 10.0),
        max_deliver=MAX_DELIVER,
        lease_s=LEASE_S,
    )


def consumer(world: World, owner: str = "w1") -> Consumer:
    pipeline = world.pipeline(owner)
    return Consumer(
        settings(),
        js=JetStreamContext(None),  # type: ignore[arg-type]  # never fetches: messages are handed in
        pipeline=pipeline,
        dead_letters=world.dead_letters,
        gateway=pipeline.gateway,
        metrics=world.metrics,
        failpoints=Failpoints(),
    )


async def handle(
    world: World, msg: FakeMessage, owner: str = "w1"
) -> list[MutableMapping[str, Any]]:
    """Hand one fetched message to a consumer; the log lines it wrote."""
    with structlog.testing.capture_logs() as lines:
        await consumer(world, owner)._handle(msg, time.monotonic())
    return lines


def redeliveries(world: World) -> dict[str, float]:
    """`charge_worker_redeliveries_total` by cause."""
    causes = ("nak", "unacked")
    return {c: world.metric("charge_worker_redeliveries_total", cause=c) for c in causes}


def settled_line(lines: list[MutableMapping[str, Any]]) -> MutableMapping[str, Any]:
    [line] = [line for line in lines if line["event"] == "charge.settled"]
    return line


async def test_a_charge_is_acked_counted_and_told_in_one_canonical_line(world: World) -> None:
    msg = FakeMessage(due(7).to_json(), stream_seq=42)
    lines = await handle(world, msg)
    assert msg.told == [("ack", None)]
    line = settled_line(lines)
    assert {k: line[k] for k in ("order_id", "billing_period", "outcome", "action")} == {
        "order_id": 7,
        "billing_period": "2026-12-01",
        "outcome": "charged",
        "action": "ack",
    }
    assert (line["stream_seq"], line["delivery"]) == (42, 1)
    assert world.metric("charge_worker_messages_total", outcome="charged", action="ack") == 1
    assert world.metric("charge_worker_charges_total", result="charged") == 1
    assert redeliveries(world) == {"nak": 0, "unacked": 0}
    assert line["redelivery"] is None


async def test_a_retry_is_a_nak_with_its_delay_and_a_redelivery_is_counted(
    world: World,
) -> None:
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", "7"))
    msg = FakeMessage(due().to_json(), delivered=2)
    await handle(world, msg)
    assert msg.told == [("nak", 7.0)]
    assert redeliveries(world) == {"nak": 0, "unacked": 1}  # no row said its first nak'd
    assert world.metric("charge_worker_messages_total", outcome="rate_limited", action="nak") == 1


async def test_a_duplicate_is_acked_and_counted_as_absorbed(world: World) -> None:
    await handle(world, FakeMessage(due().to_json(), stream_seq=1))
    again = FakeMessage(due().to_json(), stream_seq=2)
    await handle(world, again)
    assert again.told == [("ack", None)]
    assert world.metric("charge_worker_duplicates_absorbed_total") == 1
    assert world.gateway.sent() == 1


async def test_poison_is_dead_lettered_byte_for_byte_then_terminated(world: World) -> None:
    body = b'{"schema": "charge.due/v9"}'
    msg = FakeMessage(body, stream_seq=9)
    await handle(world, msg)
    [letter] = world.dead_letters.letters
    assert (letter["body"], letter["reason"], letter["stream_seq"]) == (body, "poison", 9)
    assert "schema" in str(letter["error"])
    assert msg.told == [("term", None)]
    assert world.metric("charge_worker_dead_letters_total", reason="poison") == 1


async def test_a_dead_letter_that_cannot_be_written_is_a_nak_and_the_story_says_so(
    world: World,
) -> None:
    await handle(world, FakeMessage(due(amount=500).to_json()))
    world.dead_letters.down = True
    msg = FakeMessage(due(amount=900).to_json(), stream_seq=2)
    lines = await handle(world, msg)
    assert msg.told == [("nak", ACK_WAIT_S)]  # nothing dropped: it comes back
    assert world.dead_letters.letters == []
    assert settled_line(lines)["action"] == "nak"
    assert any(line["event"] == "dlq.write_failed" for line in lines)
    assert world.metric("charge_worker_dead_letters_total", reason="conflict") == 0
    assert [s["action"] for s in world.ledger.story(due())] == ["ack", "deadletter", "nak"]


async def test_the_last_delivery_of_an_outage_is_requeued_as_a_fresh_copy_and_acked(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(404))
    msg = FakeMessage(charge.to_json(), stream_seq=5, delivered=MAX_DELIVER)
    await handle(world, msg)
    assert world.dead_letters.copies == [(charge.to_json(), 5)]
    assert msg.told == [("ack", None)]
    row = world.ledger.row(charge)
    assert (row.status, row.published_seq) == ("pending", world.dead_letters.next_seq)
    assert world.metric("charge_worker_requeues_total") == 1


async def test_a_copy_that_cannot_be_published_is_a_nak_and_the_row_stays_pending(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(404))
    world.dead_letters.down = True
    msg = FakeMessage(charge.to_json(), delivered=MAX_DELIVER)
    await handle(world, msg)
    assert msg.told == [("nak", ACK_WAIT_S)]
    assert world.ledger.row(charge).status == "pending"
    assert [s["action"] for s in world.ledger.story(charge)] == ["requeue", "nak"]
    assert world.metric("charge_worker_requeues_total") == 0


async def test_a_connection_lost_before_the_ack_is_logged_and_left_to_the_ledger(
    world: World,
) -> None:
    charge = due()
    msg = FakeMessage(charge.to_json())
    msg.closed = True
    lines = await handle(world, msg)
    assert any(line["event"] == "consumer.settle_failed" for line in lines)
    assert world.ledger.row(charge).status == "succeeded"  # a redelivery is a duplicate
    assert settled_line(lines)["outcome"] == "charged"


# ---- redeliveries by cause: asked for by a nak (the ledger row says so), or not --------------


async def test_a_redelivery_after_a_nak_is_counted_as_asked_for_whichever_pod_nakd(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", "7"))
    first = FakeMessage(charge.to_json(), stream_seq=3)
    await handle(world, first, owner="w1")
    assert first.told == [("nak", 7.0)]
    again = FakeMessage(charge.to_json(), stream_seq=3, delivered=2)
    lines = await handle(world, again, owner="w2")  # another pod: only the row knows
    assert again.told == [("ack", None)]
    assert redeliveries(world) == {"nak": 1, "unacked": 0}
    assert settled_line(lines)["redelivery"] == "nak"


async def test_a_redelivery_nobody_nakd_is_unacked(world: World) -> None:
    charge = due()
    # delivery 1 claimed and its worker died: no nak, the lease runs out
    await world.ledger.claim(charge, "w1", 3)
    world.clock.advance(LEASE_S + 1)
    msg = FakeMessage(charge.to_json(), stream_seq=3, delivered=2)
    lines = await handle(world, msg, owner="w2")
    assert msg.told == [("ack", None)]
    assert redeliveries(world) == {"nak": 0, "unacked": 1}
    assert settled_line(lines)["redelivery"] == "unacked"


async def test_a_nak_earlier_than_the_previous_delivery_is_not_this_ones_cause(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", "7"))
    await handle(world, FakeMessage(charge.to_json(), stream_seq=3))  # delivery 1 naks
    await world.ledger.claim(charge, "w1", 3)  # delivery 2 claims, and its worker dies
    world.clock.advance(LEASE_S + 1)
    await handle(world, FakeMessage(charge.to_json(), stream_seq=3, delivered=3))
    assert redeliveries(world) == {"nak": 0, "unacked": 1}


async def test_a_nak_of_another_copy_of_the_charge_is_not_this_messages_cause(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", "7"))
    await handle(world, FakeMessage(charge.to_json(), stream_seq=3))  # naks as delivery 1
    # a copy of the charge at another stream sequence (a requeue, a re-publish), redelivered
    await handle(world, FakeMessage(charge.to_json(), stream_seq=8, delivered=2))
    assert redeliveries(world) == {"nak": 0, "unacked": 1}


async def test_a_requeue_records_no_nak(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(404), Refuse(404))
    await handle(world, FakeMessage(charge.to_json(), stream_seq=5, delivered=MAX_DELIVER - 1))
    assert world.ledger.row(charge).nak_delivery == MAX_DELIVER - 1
    await handle(world, FakeMessage(charge.to_json(), stream_seq=5, delivered=MAX_DELIVER))
    assert world.dead_letters.copies == [(charge.to_json(), 5)]  # acked: no redelivery asked
    assert world.ledger.row(charge).nak_delivery is None
    # the first of the two came with no nak before it; the second was asked for
    assert redeliveries(world) == {"nak": 1, "unacked": 1}


async def test_a_poison_redelivery_is_unacked(world: World) -> None:
    msg = FakeMessage(b'{"schema": "charge.due/v9"}', stream_seq=9, delivered=2)
    await handle(world, msg)
    assert msg.told == [("term", None)]
    assert redeliveries(world) == {"nak": 0, "unacked": 1}


async def test_a_redelivery_the_ledger_cannot_explain_is_unacked(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", "7"))
    await handle(world, FakeMessage(charge.to_json(), stream_seq=3))  # naks, recorded
    world.ledger.down.add("claim")  # PostgreSQL away: nothing shows the nak was asked for
    msg = FakeMessage(charge.to_json(), stream_seq=3, delivered=2)
    await handle(world, msg)
    assert msg.told[0][0] == "nak"
    assert redeliveries(world) == {"nak": 0, "unacked": 1}
