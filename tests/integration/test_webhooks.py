"""The webhook receiver and its processor against real PostgreSQL, over real HTTP.

`charge-worker webhooks` runs in the test's event loop (`run_webhooks`) with a fast
processor; deliveries are signed here with `standardwebhooks` as the gateway signs them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import SecretStr

from charge_worker.errors import SettingsError
from charge_worker.explain import explain_command
from charge_worker.ledger import Ledger, Settlement
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import DbSettings, GatewaySettings, Settings, WebhookSettings
from charge_worker.webhooks.processor import ProcessorTuning
from charge_worker.webhooks.serve import run_webhooks
from charge_worker.webhooks.signature import sign, signed_headers
from tests.support.harness import eventually, set_sim
from tests.support.webhooks import (
    API_KEY,
    FAST,
    GATEWAY_TIMEOUT_S,
    OLD_SECRET,
    PERIOD,
    SECRET,
    WRONG_SECRET,
    Receiver,
    add_row,
    counted,
    due,
    entry,
    event,
    idle_processor,
    journal,
    ledger,
    running_receiver,
    settled,
    status_of,
    webhook_settings,
    webhook_story,
)


@pytest.fixture
async def receiver(database_url: str, gateway_sim: ServedApp) -> AsyncIterator[Receiver]:
    async with running_receiver(webhook_settings(database_url, gateway_sim.url)) as running:
        yield running


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


async def test_the_same_event_three_times_changes_the_ledger_once(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 1, "succeeded", charge_id="ch_1")
    refund = event("ch_1", "charge.refunded", revision=2)

    answers = [(await receiver.post(refund)).status_code for _ in range(3)]

    assert answers == [200, 200, 200]
    await eventually(lambda: settled(db, refund["id"]), "the refund processed")
    row = await ledger(db, 1)
    assert (row["status"], row["gateway_revision"]) == ("refunded", 2)
    assert [r["status"] for r in await journal(db)] == ["applied"]
    story = await webhook_story(db, 1)
    assert [(s["event_id"], s["outcome"], s["detail"]) for s in story] == [
        (refund["id"], "applied", "succeeded -> refunded")
    ]
    assert receiver.metric("charge_worker_webhook_duplicate_events_total", source="gateway") == 2
    journaled = receiver.metric(
        "charge_worker_webhook_deliveries_total", source="gateway", result="journaled"
    )
    assert journaled == 1


@pytest.mark.parametrize(
    "legacy", [False, True], ids=["refunded true, status succeeded", "status refunded (old shape)"]
)
async def test_a_refund_is_recorded_from_either_shape_of_the_charge(
    legacy: bool, receiver: Receiver, db: asyncpg.Connection
) -> None:
    # docs/contracts/gateway.md: a refunded charge keeps status succeeded, `refunded` says it
    await add_row(db, 20, "succeeded", charge_id="ch_20")
    refund = event("ch_20", "charge.refunded", revision=2, order_id=20, legacy=legacy)

    assert (await receiver.post(refund)).status_code == 200
    await eventually(lambda: settled(db, refund["id"]), "the refund processed")

    row = await ledger(db, 20)
    assert (row["status"], row["gateway_revision"]) == ("refunded", 2)
    assert await status_of(db, refund["id"]) == "applied"


async def test_ten_concurrent_copies_are_journaled_and_applied_once(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 1, "succeeded", charge_id="ch_1")
    refund = event("ch_1", "charge.refunded", revision=2)

    answers = await asyncio.gather(*(receiver.post(refund) for _ in range(10)))

    assert [a.status_code for a in answers] == [200] * 10
    assert sum(a.json()["duplicate"] for a in answers) == 9
    await eventually(lambda: settled(db, refund["id"]), "the refund processed")
    assert len(await journal(db)) == 1
    assert len(await webhook_story(db, 1)) == 1
    assert (await ledger(db, 1))["status"] == "refunded"
    assert receiver.metric("charge_worker_webhook_duplicate_events_total", source="gateway") == 9


# --- revisions: never roll back ----------------------------------------------------------


async def test_revision_11_after_12_is_stale_and_12_stays(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 1, "succeeded", charge_id="ch_1")
    newer = event("ch_1", "charge.refunded", revision=12)
    older = event("ch_1", "charge.succeeded", revision=11)

    assert (await receiver.post(newer)).status_code == 200
    await eventually(lambda: settled(db, newer["id"]), "revision 12 processed")
    assert (await receiver.post(older)).status_code == 200
    await eventually(lambda: settled(db, older["id"]), "revision 11 processed")

    row = await ledger(db, 1)
    assert (row["status"], row["gateway_revision"]) == ("refunded", 12)
    assert await status_of(db, newer["id"]) == "applied"
    assert await status_of(db, older["id"]) == "stale"
    assert [s["outcome"] for s in await webhook_story(db, 1)] == ["applied", "stale"]
    await counted(receiver, "charge_worker_webhook_events_total", status="stale")


async def test_a_replay_of_revision_12_changes_nothing(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 1, "succeeded", charge_id="ch_1")
    applied = event("ch_1", "charge.refunded", revision=12)
    assert (await receiver.post(applied)).status_code == 200
    await eventually(lambda: settled(db, applied["id"]), "revision 12 processed")
    before = await ledger(db, 1)

    redelivered = await receiver.post(applied)  # the gateway retries the same event
    resent = event("ch_1", "charge.refunded", revision=12)  # the same snapshot, a new event id
    assert (await receiver.post(resent)).status_code == 200
    await eventually(lambda: settled(db, resent["id"]), "the resent snapshot processed")

    assert (redelivered.status_code, redelivered.json()["duplicate"]) == (200, True)
    assert await ledger(db, 1) == before
    assert [(r["event_id"], r["status"]) for r in await journal(db)] == [
        (applied["id"], "applied"),
        (resent["id"], "stale"),
    ]


async def test_in_one_batch_only_the_newest_snapshot_of_a_charge_is_applied(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    # events queued up (a restart, a database outage): both snapshots reach one batch
    await add_row(db, 18, "pending")  # the worker's answer was lost, its lease is gone
    newer = event("ch_18", "charge.succeeded", revision=2, order_id=18)
    older = event("ch_18", "charge.failed", revision=1, order_id=18)
    async with idle_processor(database_url, gateway_sim.url) as (inbox, processor):
        for body in (newer, older):
            assert await inbox.journal(entry(body))
        assert await processor.run_once() == 2

    row = await ledger(db, 18)
    assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
        "succeeded",
        "ch_18",
        2,
    )
    assert await status_of(db, newer["id"]) == "applied"
    assert await status_of(db, older["id"]) == "stale"


async def test_an_older_snapshot_processed_after_a_newer_one_was_journaled_is_stale(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    await add_row(db, 19, "pending")
    older = event("ch_19", "charge.failed", revision=1, order_id=19)
    newer = event("ch_19", "charge.succeeded", revision=2, order_id=19)
    one_at_a_time = ProcessorTuning(**{**FAST.__dict__, "batch": 1})
    async with idle_processor(database_url, gateway_sim.url, one_at_a_time) as (inbox, processor):
        for body in (older, newer):  # the older one first: it is taken first, alone
            assert await inbox.journal(entry(body))
        assert await processor.run_once() == 1
        assert await status_of(db, older["id"]) == "stale"
        assert (await ledger(db, 19))["status"] == "pending"  # nothing rolled forward by it
        assert await processor.run_once() == 1

    row = await ledger(db, 19)
    assert (row["status"], row["gateway_revision"]) == ("succeeded", 2)
    assert await status_of(db, newer["id"]) == "applied"


async def outcome_types(db: asyncpg.Connection, order_id: int) -> list[str]:
    """The outcome events the ledger's changes wrote for the key, in sequence."""
    rows = await db.fetch(
        "SELECT type FROM charge_outcomes WHERE order_id = $1 ORDER BY sequence", order_id
    )
    return [row["type"] for row in rows]


# --- events ahead of the ledger ----------------------------------------------------------


async def test_a_refund_before_the_charge_is_recorded_waits_then_applies(
    receiver: Receiver, db: asyncpg.Connection, database_url: str
) -> None:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    assert pool is not None
    worker = Ledger(pool, lease_s=60)
    try:
        claim = await worker.claim(due(5), "worker-1", stream_seq=1)
        # the gateway charged and refunded before the worker recorded the charge
        refund = event("ch_5", "charge.refunded", revision=2, order_id=5)
        assert (await receiver.post(refund)).status_code == 200

        async def waiting() -> bool:
            return await status_of(db, refund["id"]) == "awaiting_dependency"

        await eventually(waiting, "the refund waiting for the ledger")
        assert (await ledger(db, 5))["status"] == "pending"

        await worker.settle(claim, Settlement("succeeded", charge_id="ch_5"), story=None)
        await eventually(lambda: settled(db, refund["id"]), "the refund applied")
    finally:
        await pool.close()
    row = await ledger(db, 5)
    assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
        "refunded",
        "ch_5",
        2,
    )
    assert await outcome_types(db, 5) == ["charge.succeeded", "charge.refunded"]
    [entry] = await journal(db)
    assert (entry["status"], entry["outcome"]) == ("applied", "succeeded -> refunded")
    assert entry["attempts"] > 1
    assert receiver.metric("charge_worker_webhook_events_total", status="awaiting_dependency") >= 1


async def gateway_charge(gateway_url: str, order_id: int, customer: str = "cus_ok") -> str:
    """A real charge at the gateway simulator for this order; its id."""
    async with httpx.AsyncClient(
        base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as client:
        response = await client.post(
            "/v1/charges",
            json={
                "amount": 99000,
                "currency": "RUB",
                "customer": customer,
                "metadata": {"order_id": str(order_id), "billing_period": PERIOD.isoformat()},
            },
            headers={"Idempotency-Key": f"{order_id}:{PERIOD.isoformat()}"},
        )
        charge_id = str(response.json()["id"])
        if customer == "cus_ok":
            refunded = await client.post(
                "/v1/refunds",
                json={"charge": charge_id, "reason": "requested_by_customer"},
                headers={"Idempotency-Key": f"refund:{charge_id}"},
            )
            assert refunded.status_code == 200
    return charge_id


async def test_after_the_wait_bound_the_charge_is_looked_up_and_applied(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    # the worker's answer was lost: the row stays pending, its lease expired long ago
    charge_id = await gateway_charge(gateway_sim.url, 6)
    await add_row(db, 6, "pending", lease_s=-60)
    bounded = ProcessorTuning(**{**FAST.__dict__, "wait_bound_tries": 3})
    settings = webhook_settings(database_url, gateway_sim.url)
    async with running_receiver(settings, bounded) as receiver:
        # a dispute waits for the charge it names (a full refund's body would prove it)
        refund = event(charge_id, "charge.dispute_created", revision=2, order_id=6)
        assert (await receiver.post(refund)).status_code == 200
        await eventually(lambda: settled(db, refund["id"]), "the refund resolved by lookup")

    row = await ledger(db, 6)
    assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
        "refunded",
        charge_id,
        2,
    )
    [entry] = await journal(db)
    assert (entry["status"], entry["attempts"]) == ("applied", 3)
    [story] = await webhook_story(db, 6)
    assert (story["looked_up"], story["detail"]) == ("refunded", "pending -> refunded")


async def test_a_gap_the_gateway_cannot_explain_goes_to_needs_review(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    await add_row(db, 7, "pending", lease_s=-60)
    bounded = ProcessorTuning(**{**FAST.__dict__, "wait_bound_tries": 2})
    settings = webhook_settings(database_url, gateway_sim.url)
    async with running_receiver(settings, bounded) as receiver:
        # a dispute waits for the charge it names (a full refund's body would prove it)
        refund = event("ch_nobody_made", "charge.dispute_created", revision=2, order_id=7)
        assert (await receiver.post(refund)).status_code == 200
        await eventually(lambda: settled(db, refund["id"]), "the refund given up on")
        await counted(receiver, "charge_worker_webhook_needs_review_total")

    [entry] = await journal(db)
    assert entry["status"] == "needs_review"
    assert "the gateway holds no ch_nobody_made for this key (none)" in entry["outcome"]
    assert (await ledger(db, 7))["status"] == "pending"  # nothing guessed
    [story] = await webhook_story(db, 7)
    assert story["outcome"] == "needs_review"


async def test_a_lookup_that_fails_keeps_the_event_waiting_until_the_gateway_answers(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    charge_id = await gateway_charge(gateway_sim.url, 16)
    await add_row(db, 16, "pending", lease_s=-60)
    await set_sim(gateway_sim.url, error_rates={"503": 1.0})
    bounded = ProcessorTuning(**{**FAST.__dict__, "wait_bound_tries": 2})
    async with running_receiver(webhook_settings(database_url, gateway_sim.url), bounded) as r:
        # a dispute of a charge not recorded yet waits for it (a full refund would prove it)
        refund = event(charge_id, "charge.dispute_created", revision=2, order_id=16)
        assert (await r.post(refund)).status_code == 200

        async def lookup_failed() -> bool:
            [entry] = await journal(db)
            return entry["status"] == "awaiting_dependency" and "lookup failed" in (
                entry["last_error"] or ""
            )

        await eventually(lookup_failed, "the event waiting after a failed lookup")
        await set_sim(gateway_sim.url, error_rates={})
        await eventually(lambda: settled(db, refund["id"]), "the dispute applied by lookup")
    row = await ledger(db, 16)
    assert row["status"] == "refunded"  # as the lookup found it
    assert row["disputed_at"] is not None


async def test_an_event_that_keeps_failing_goes_to_needs_review(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    await add_row(db, 17, "succeeded", charge_id="ch_17")
    locker = await asyncpg.connect(database_url)
    held = locker.transaction()
    await held.start()
    quick = ProcessorTuning(**{**FAST.__dict__, "give_up_tries": 2})
    try:
        await locker.execute("SELECT 1 FROM charge_attempts WHERE order_id = 17 FOR UPDATE")
        async with running_receiver(webhook_settings(database_url, gateway_sim.url), quick) as r:
            refund = event("ch_17", "charge.refunded", revision=2, order_id=17)
            assert (await r.post(refund)).status_code == 200
            await eventually(lambda: settled(db, refund["id"]), "the event given up on")
            # counted just after the journal write, not in the same step
            await counted(r, "charge_worker_webhook_needs_review_total")
    finally:
        await held.rollback()
        await locker.close()
    [entry] = await journal(db)
    assert entry["status"] == "needs_review"
    assert "processing failed 2 times" in entry["outcome"]
    assert "LockNotAvailableError" in entry["outcome"]
    assert (await ledger(db, 17))["status"] == "succeeded"


async def test_a_lost_answer_is_recorded_from_charge_succeeded_once_the_lease_is_gone(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 8, "pending", lease_s=60)  # the worker is still on it
    succeeded = event("ch_8", "charge.succeeded", order_id=8)
    assert (await receiver.post(succeeded)).status_code == 200

    async def waiting() -> bool:
        return await status_of(db, succeeded["id"]) == "awaiting_dependency"

    await eventually(waiting, "the event waiting while the worker holds the lease")
    assert (await ledger(db, 8))["status"] == "pending"

    await db.execute("UPDATE charge_attempts SET lease_until = now() WHERE order_id = 8")
    await eventually(lambda: settled(db, succeeded["id"]), "the charge recorded")
    row = await ledger(db, 8)
    assert (row["status"], row["gateway_charge_id"], row["lease_owner"]) == (
        "succeeded",
        "ch_8",
        None,
    )


async def test_charge_failed_records_a_pending_rows_decline(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 9, "pending")
    failed = event("ch_9", "charge.failed", order_id=9)
    assert (await receiver.post(failed)).status_code == 200
    await eventually(lambda: settled(db, failed["id"]), "the decline recorded")
    row = await ledger(db, 9)
    # a decline naming no code is generic, soft: the period's next try is scheduled
    assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
        "retry_scheduled",
        "ch_9",
        1,
    )


async def test_a_dispute_flags_the_charge_for_review(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 10, "succeeded", charge_id="ch_10")
    dispute = event("ch_10", "charge.dispute_created", revision=2, order_id=10)
    assert (await receiver.post(dispute)).status_code == 200
    await eventually(lambda: settled(db, dispute["id"]), "the dispute recorded")
    row = await ledger(db, 10)
    assert (row["status"], row["gateway_revision"]) == ("succeeded", 2)
    assert row["disputed_at"] is not None
    assert row["review_reason"] == "gateway: dispute opened on ch_10"
    assert await outcome_types(db, 10) == ["charge.succeeded", "charge.disputed"]


async def test_a_second_successful_charge_for_a_key_goes_to_needs_review(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 11, "succeeded", charge_id="ch_11a")
    double = event("ch_11b", "charge.succeeded", order_id=11)
    refund_of_double = event("ch_11b", "charge.refunded", revision=2, order_id=11)
    assert (await receiver.post(double)).status_code == 200
    await eventually(lambda: settled(db, double["id"]), "the double processed")
    assert (await receiver.post(refund_of_double)).status_code == 200
    await eventually(lambda: settled(db, refund_of_double["id"]), "its refund processed")

    assert [r["status"] for r in await journal(db)] == ["needs_review", "applied"]
    assert (await ledger(db, 11))["gateway_charge_id"] == "ch_11a"  # the recorded one stays
    await counted(receiver, "charge_worker_webhook_needs_review_total")


# --- rejected before anything is recorded ------------------------------------------------


Delivery = tuple[bytes, dict[str, str]]


def _signed(body: bytes, secret: str = SECRET, offset_s: int = 0) -> dict[str, str]:
    return signed_headers(secret, "evt_x", body, timestamp=int(time.time()) + offset_s)


def _tampered(body: bytes) -> Delivery:
    return body.replace(b'"revision": 2', b'"revision": 3'), _signed(body)


def _without(name: str) -> Any:
    def delivery(body: bytes) -> Delivery:
        headers = _signed(body)
        del headers[name]
        return body, headers

    return delivery


def _replaced(name: str, value: str) -> Any:
    return lambda body: (body, _signed(body) | {name: value})


REJECTIONS = {
    "tampered body": (_tampered, 401),
    "wrong secret": (lambda body: (body, _signed(body, WRONG_SECRET)), 401),
    "timestamp 6 min ahead": (lambda body: (body, _signed(body, offset_s=+360)), 401),
    "timestamp 6 min behind": (lambda body: (body, _signed(body, offset_s=-360)), 401),
    "no webhook-id": (_without("webhook-id"), 400),
    "no webhook-timestamp": (_without("webhook-timestamp"), 400),
    "no webhook-signature": (_without("webhook-signature"), 400),
    "signature not v<n>,<base64>": (_replaced("webhook-signature", "abc"), 400),
    "timestamp not unix seconds": (_replaced("webhook-timestamp", "soon"), 400),
    "only a v2 signature": (
        _replaced("webhook-signature", "v2," + base64.b64encode(b"x" * 32).decode()),
        401,
    ),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
async def test_a_bad_delivery_is_rejected_with_no_journal_row(
    case: str, receiver: Receiver, db: asyncpg.Connection
) -> None:
    make, expected = REJECTIONS[case]
    body = json.dumps(event("ch_1", "charge.refunded", revision=2, event_id="evt_x")).encode()
    sent, headers = make(body)

    response = await receiver.post(sent, headers=headers)

    assert response.status_code == expected
    assert await journal(db) == []
    result = {400: "malformed", 401: "unauthorized"}[expected]
    assert (
        receiver.metric("charge_worker_webhook_deliveries_total", source="gateway", result=result)
        == 1
    )
    for signature in headers.get("webhook-signature", "").split():
        assert signature not in response.text


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"id": "evt_x", "type": "charge.succeeded"}', b"\xff\xfe"],
    ids=["not json", "no data", "not utf-8"],
)
async def test_a_signed_body_that_is_no_event_is_400(
    body: bytes, receiver: Receiver, db: asyncpg.Connection
) -> None:
    signed_over = body if body.isascii() else b"{}"  # the signer itself needs UTF-8
    response = await receiver.post(body, headers=signed_headers(SECRET, "msg_1", signed_over))
    assert response.status_code == 400
    assert await journal(db) == []


async def test_an_event_with_a_nul_character_the_database_cannot_hold_is_400(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    odd = event("ch_1")
    odd["data"]["object"]["customer"] = "cus_\u0000"
    response = await receiver.post(odd)
    assert response.status_code == 400
    assert await journal(db) == []


async def test_a_1_mb_body_is_413_without_reading_it(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    big = event("ch_1")
    big["padding"] = "x" * (1024 * 1024)
    raw = json.dumps(big).encode()
    headers = signed_headers(SECRET, big["id"], raw)

    declared = await receiver.post(raw, headers=headers)

    async def stream() -> AsyncIterator[bytes]:  # chunked: no Content-Length to go by
        for start in range(0, len(raw), 64 * 1024):
            yield raw[start : start + 64 * 1024]

    streamed = await receiver.client.post(
        "/webhooks/gateway", content=stream(), headers=headers, timeout=GATEWAY_TIMEOUT_S
    )
    assert (declared.status_code, streamed.status_code) == (413, 413)
    assert await journal(db) == []
    too_large = receiver.metric(
        "charge_worker_webhook_deliveries_total", source="gateway", result="too_large"
    )
    assert too_large == 2


async def test_during_a_rotation_one_valid_signature_among_several_is_enough(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    settings = webhook_settings(database_url, gateway_sim.url, SECRET, OLD_SECRET)
    async with running_receiver(settings) as receiver:
        # the gateway signs with every secret it has, one we no longer know among them
        first = event("ch_1")
        raw = json.dumps(first).encode()
        at = int(time.time())
        junk = sign(WRONG_SECRET, first["id"], at, raw)
        valid = sign(SECRET, first["id"], at, raw)
        several = {
            "webhook-id": first["id"],
            "webhook-timestamp": str(at),
            "webhook-signature": f"{junk} v1a,{junk[3:]} {valid}",
        }
        # a gateway still on the old secret
        second = event("ch_2", order_id=2)

        answers = [
            (await receiver.post(raw, headers=several)).status_code,
            (await receiver.post(second, secret=OLD_SECRET)).status_code,
            (await receiver.post(event("ch_3"), secret=WRONG_SECRET)).status_code,
        ]
    assert answers == [200, 200, 401]
    assert [r["event_id"] for r in await journal(db)] == [first["id"], second["id"]]


# --- fast, whatever the database does ---------------------------------------------------


async def test_the_answer_stays_fast_while_the_processor_waits_on_a_locked_ledger_row(
    receiver: Receiver, db: asyncpg.Connection, database_url: str
) -> None:
    await add_row(db, 12, "succeeded", charge_id="ch_12")
    locker = await asyncpg.connect(database_url)
    held = locker.transaction()
    await held.start()
    try:
        # a slow transaction holds the row the processor must lock to apply anything
        await locker.execute("SELECT 1 FROM charge_attempts WHERE order_id = 12 FOR UPDATE")
        refund = event("ch_12", "charge.refunded", revision=2, order_id=12)
        assert (await receiver.post(refund)).status_code == 200

        async def processor_blocked() -> bool:
            waiting = await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return bool(waiting)

        await eventually(processor_blocked, "the processor waiting for the ledger row lock")
        # each answer arrives inside the gateway's 5 s (the client gives up after 5 s)
        more = [event(f"ch_{n}", order_id=n) for n in range(100, 110)]
        answers = await asyncio.gather(*(receiver.post(e) for e in more))
        assert [a.status_code for a in answers] == [200] * 10
        assert (await ledger(db, 12))["status"] == "succeeded"
    finally:
        await held.rollback()
        await locker.close()
    await eventually(lambda: settled(db, refund["id"]), "the refund applied once unlocked")
    assert (await ledger(db, 12))["status"] == "refunded"


async def test_a_journal_that_cannot_write_answers_503_inside_5_s_and_records_nothing(
    receiver: Receiver, db: asyncpg.Connection, database_url: str
) -> None:
    locker = await asyncpg.connect(database_url)
    held = locker.transaction()
    await held.start()
    refund = event("ch_13", "charge.refunded", revision=2, order_id=13)
    try:
        await locker.execute("LOCK TABLE webhook_inbox IN EXCLUSIVE MODE")
        blocked = await receiver.post(refund)
    finally:
        await held.rollback()
        await locker.close()

    assert blocked.status_code == 503  # the gateway retries: nothing was promised
    assert await journal(db) == []
    assert (await receiver.post(refund)).status_code == 200  # its retry
    assert [r["event_id"] for r in await journal(db)] == [refund["id"]]
    unavailable = receiver.metric(
        "charge_worker_webhook_deliveries_total", source="gateway", result="unavailable"
    )
    assert unavailable == 1


# --- the rest of the surface ---------------------------------------------------------------


async def test_health_readiness_and_metrics(receiver: Receiver) -> None:
    assert (await receiver.client.get("/healthz")).status_code == 200
    assert (await receiver.client.get("/readyz")).text == "ready"
    scraped = (await receiver.client.get("/metrics")).text
    assert 'charge_worker_webhook_duplicate_events_total{source="gateway"} 0.0' in scraped
    assert "charge_worker_webhook_needs_review_total 0.0" in scraped
    assert (await receiver.client.get("/webhooks/gateway")).status_code == 405


async def test_the_journal_gauges_show_what_waits(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 14, "pending", lease_s=60)
    waiting = event("ch_14", order_id=14)
    assert (await receiver.post(waiting)).status_code == 200

    def reported() -> bool:
        rows = receiver.metric("charge_worker_webhook_inbox_rows", status="awaiting_dependency")
        processing = receiver.metric("charge_worker_webhook_inbox_rows", status="processing")
        return rows + processing == 1

    await eventually(reported, "the waiting event in the gauges")
    assert receiver.metric("charge_worker_webhook_oldest_unprocessed_seconds") >= 0


async def test_old_final_rows_are_purged_and_the_rest_kept(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    # an idle processor: a running one purges at start too, and on a slow machine that
    # purge met these rows half-inserted, leaving this one a single row to count
    old = "now() - interval '4 days'"
    for event_id, status, received_at in [
        ("evt_old_applied", "applied", old),
        ("evt_old_stale", "stale", old),
        ("evt_old_review", "needs_review", old),
        ("evt_new_applied", "applied", "now()"),
    ]:
        await db.execute(
            f"""
            INSERT INTO webhook_inbox (source, event_id, message_id, event_type, object_id,
                revision, payload, status, received_at)
            VALUES ('gateway', $1, $1, 'charge.succeeded', 'ch_1', 1, '{{}}', $2, {received_at})
            """,
            event_id,
            status,
        )
    async with idle_processor(database_url, gateway_sim.url) as (_, processor):
        deleted = await processor.purge()
        purged = processor.metrics.registry.get_sample_value("charge_worker_webhook_purged_total")

    assert deleted == 2
    kept = {r["event_id"] for r in await db.fetch("SELECT event_id FROM webhook_inbox")}
    assert kept == {"evt_old_review", "evt_new_applied"}
    assert purged == 2


async def test_explain_shows_the_webhooks_applied_to_a_charge(
    receiver: Receiver,
    db: asyncpg.Connection,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await add_row(db, 15, "succeeded", charge_id="ch_15")
    refund = event("ch_15", "charge.refunded", revision=2, order_id=15)
    assert (await receiver.post(refund)).status_code == 200
    await eventually(lambda: settled(db, refund["id"]), "the refund applied")

    code = await explain_command(
        Settings(db=DbSettings(url=database_url)), 15, PERIOD, as_json=False, ask_gateway=False
    )

    out = capsys.readouterr().out
    assert code == 0
    assert "charge 15:2026-12-01: refunded ch_15" in out
    assert "  gateway revision 2 (webhooks applied)" in out
    [line] = [line for line in out.splitlines() if "  webhooks  " in line]
    assert "  webhook  " in line
    assert f"event_id {refund['id']}" in line
    assert "outcome applied" in line
    assert "detail succeeded -> refunded" in line


def test_a_receiver_refuses_to_start_without_a_good_secret(
    database_url: str, gateway_sim: ServedApp
) -> None:
    for secrets in [(), ("not-a-whsec",), ("whsec_!!!",), ("whsec_c2hvcnQ=",)]:
        settings = Settings(
            db=DbSettings(url=database_url),
            gateway=GatewaySettings(url=gateway_sim.url, api_key=SecretStr(API_KEY)),
            webhooks=WebhookSettings(webhook_secrets=tuple(SecretStr(s) for s in secrets)),
        )
        with pytest.raises(SettingsError, match="CHARGE_WORKER_WEBHOOK_SECRETS") as raised:
            asyncio.run(run_webhooks(settings, asyncio.Event()))
        for secret in secrets:
            assert secret not in str(raised.value)


# --- issue 34: a charge is recorded only with its fingerprint -----------------------------


@pytest.mark.parametrize(
    "foreign",
    [{"amount": 100}, {"currency": "EUR"}, {"customer": "cus_support_agent"}],
    ids=["amount", "currency", "customer"],
)
async def test_a_lost_answer_with_another_fingerprint_records_nothing(
    foreign: dict[str, Any], receiver: Receiver, db: asyncpg.Connection
) -> None:
    """Issue 34 item 2: a charge made by someone else with our metadata (a support agent, a
    verification charge) is not the period's payment: the row stays as it was, so the due
    charge goes ahead, and a person is told."""
    await add_row(db, 40, "pending")
    made = event("ch_40", revision=1, order_id=40, **foreign)

    assert (await receiver.post(made)).status_code == 200
    await eventually(lambda: settled(db, made["id"]), "the event processed")

    row = await ledger(db, 40)
    assert (row["status"], row["gateway_charge_id"]) == ("pending", None)
    [journaled] = await journal(db)
    assert journaled["status"] == "needs_review"
    assert (journaled["last_error"] or "").startswith("unmatched charge: ch_40"), journaled
    await counted(receiver, "charge_worker_webhook_unmatched_charges_total")


async def test_a_lost_answer_with_our_fingerprint_is_recorded(
    receiver: Receiver, db: asyncpg.Connection
) -> None:
    await add_row(db, 41, "pending")
    made = event("ch_41", revision=1, order_id=41, currency="rub")  # as a provider spells it

    assert (await receiver.post(made)).status_code == 200
    await eventually(lambda: settled(db, made["id"]), "the event processed")

    row = await ledger(db, 41)
    assert (row["status"], row["gateway_charge_id"]) == ("succeeded", "ch_41")
    assert receiver.metric("charge_worker_webhook_unmatched_charges_total") == 0


# --- issue 34: a refund ahead of its charge's event proves the charge ----------------------


async def test_a_refund_before_the_charges_own_event_applies_at_once(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    """Issue 34 item 13: revision 3 (refunded) before 2 (succeeded). The refund's body is the
    whole charge: made, for this key, this amount, currency and customer, then refunded. It
    is applied on its first try, not after the ~15 minute wait bound; 2 is then stale."""
    await add_row(db, 42, "pending")
    refund = event("ch_42", "charge.refunded", revision=3, order_id=42)
    charged = event("ch_42", revision=2, order_id=42)
    async with idle_processor(database_url, gateway_sim.url) as (inbox, processor):
        await inbox.journal(entry(refund))
        assert await processor.run_once() == 1
        assert await status_of(db, refund["id"]) == "applied"
        row = await ledger(db, 42)
        assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
            "refunded",
            "ch_42",
            3,
        )
        await inbox.journal(entry(charged))
        assert await processor.run_once() == 1
        assert await status_of(db, charged["id"]) == "stale"


async def test_a_refund_ahead_of_its_charge_with_another_fingerprint_records_nothing(
    database_url: str, gateway_sim: ServedApp, db: asyncpg.Connection
) -> None:
    await add_row(db, 43, "pending")
    refund = event("ch_43", "charge.refunded", revision=3, order_id=43, amount=1)
    async with idle_processor(database_url, gateway_sim.url) as (inbox, processor):
        await inbox.journal(entry(refund))
        assert await processor.run_once() == 1
    assert await status_of(db, refund["id"]) != "applied"
    row = await ledger(db, 43)
    assert (row["status"], row["gateway_charge_id"]) == ("pending", None)
