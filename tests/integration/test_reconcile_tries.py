"""Reconcile on periods with more than one try, against real PostgreSQL, nats-server and the
gateway simulator over HTTP (docs/decisions/0007-retries.md).

A lookup by `order_id` and `billing_period` lists every try's charges. Reconcile reads it
as the worker does: money of any try settles the period, only the current try's failed
charge is its decline (and the retry schedule decides what follows it), and a period that
holds money is never tried again. A double is a second captured charge of the period,
whichever tries' keys made it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import asyncpg
import httpx
import pytest
from nats.aio.client import Client

from charge_worker import events
from charge_worker.messages import idempotency_key, parse
from charge_worker.reconcile.run import run_reconcile
from charge_worker.retries.starts import start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import PERIOD, provisioned, settings_for

NO_SCORING = "http://127.0.0.1:9"  # reconcile never scores
SCHEDULE = (600.0, 1200.0)  # tries 2 and 3 follow a soft decline; try 3's decline is final
QUIET_S = 3600.0
CAP = 8


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(
        nats_settings, database_url, gateway_sim.url, NO_SCORING, retry_schedule=SCHEDULE
    )


async def put_row(
    conn: asyncpg.Connection,
    order_id: int,
    status: str,
    *,
    try_no: int,
    customer: str = "cus_ok",
    gateway_calls: int = 1,
    charge_id: str | None = None,
    retry_in_s: float = -60.0,
    published: bool = True,
) -> None:
    """The period's row at its try `try_no`, quiet for an hour, its lease run out; earlier
    tries archived (declined soft), as `retries/starts.py` leaves them."""
    await conn.execute(
        """
        INSERT INTO charge_attempts (
            order_id, billing_period, idempotency_key, subscription_id, customer_id,
            amount_minor, currency, due_at, status, gateway_calls, gateway_charge_id,
            lease_owner, lease_until, attempt, current_try, try_started_at, retry_at,
            decline_code, decline_class, created_at, updated_at, settled_at, published_at)
        VALUES ($1, $2, $3, $4, $5, 99000, 'RUB', $6, $7, $8, $9,
                CASE WHEN $7 = 'pending' THEN 'killed-worker' END,
                CASE WHEN $7 = 'pending' THEN now() - interval '1 minute' END, 1, $10,
                CASE WHEN $10 > 1 THEN now() - interval '2 hours' END,
                CASE WHEN $7 = 'retry_scheduled' THEN now() + make_interval(secs => $11) END,
                CASE WHEN $7 IN ('retry_scheduled', 'action_required', 'declined')
                     THEN 'insufficient_funds' END,
                CASE WHEN $7 IN ('retry_scheduled', 'action_required', 'declined')
                     THEN 'soft' END,
                now() - interval '3 days', now() - make_interval(secs => $12),
                CASE WHEN $7 NOT IN ('scheduled', 'pending', 'processing') THEN now() END,
                CASE WHEN $13 THEN now() - interval '2 hours' END)
        """,
        order_id,
        PERIOD,
        idempotency_key(order_id, PERIOD, try_no),
        f"sub_{order_id}",
        customer,
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        status,
        gateway_calls,
        charge_id,
        try_no,
        retry_in_s,
        QUIET_S,
        published,
    )
    for earlier in range(1, try_no):
        await conn.execute(
            """
            INSERT INTO charge_tries (order_id, billing_period, try_no, idempotency_key,
                                      decline_code, decline_class, started_at, ended_at)
            VALUES ($1, $2, $3, $4, 'insufficient_funds', 'soft', now() - interval '3 days',
                    now() - interval '3 days')
            """,
            order_id,
            PERIOD,
            earlier,
            idempotency_key(order_id, PERIOD, earlier),
        )


async def post_try(
    gateway_url: str,
    order_id: int,
    try_no: int,
    customer: str = "cus_ok",
    *,
    idempotency: str | None = None,
) -> httpx.Response:
    """Try `try_no` of the period, as the contract adapter sends it (its key, `attempt`)."""
    metadata = {"order_id": str(order_id), "billing_period": PERIOD.isoformat()}
    if try_no > 1:
        metadata["attempt"] = str(try_no)
    body = {"amount": 99000, "currency": "RUB", "customer": customer, "metadata": metadata}
    headers = {
        "Authorization": "Bearer sk_test_sandbox",
        "Idempotency-Key": idempotency or idempotency_key(order_id, PERIOD, try_no),
    }
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        return await client.post("/v1/charges", json=body, headers=headers)


async def charged(gateway_url: str, order_id: int, try_no: int, **kwargs: Any) -> str:
    response = await post_try(gateway_url, order_id, try_no, **kwargs)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def declined(gateway_url: str, order_id: int, try_no: int, customer: str) -> str:
    response = await post_try(gateway_url, order_id, try_no, customer)
    assert response.status_code == 402, response.text
    return str(response.json()["error"]["charge"])


# a sweep last looked at the row this long ago
LOOKED_AT = "UPDATE charge_attempts SET updated_at = now() - $2::interval WHERE order_id = $1"


async def row(conn: asyncpg.Connection, order_id: int) -> dict[str, Any]:
    found = await conn.fetchrow(
        """
        SELECT status, current_try, gateway_charge_id, decline_code, decline_class,
               extract(epoch FROM retry_at - now()) AS retry_in_s
          FROM charge_attempts WHERE order_id = $1
        """,
        order_id,
    )
    assert found is not None
    return dict(found)


async def charge_statuses(gateway_url: str) -> dict[str, str]:
    async with httpx.AsyncClient() as client:
        data = (await client.get(f"{gateway_url}/_sim/charges")).json()["data"]
    return {c["id"]: "refunded" if c["refunded"] else c["status"] for c in data}


def key(order_id: int) -> str:
    return f"{order_id}:{PERIOD.isoformat()}"


# --- 1. an unknown outcome of try n is resolved by the worker's rule ----------------------


@pytest.mark.parametrize(
    ("customer", "status", "code", "klass", "retry_in_s"),
    [
        ("cus_soft_1", "retry_scheduled", "insufficient_funds", "soft", SCHEDULE[1]),
        ("cus_auth_1", "action_required", "authentication_required", "customer_action", None),
        ("cus_code_stolen_card_1", "declined", "stolen_card", "hard", None),
    ],
    ids=["soft", "customer_action", "hard"],
)
async def test_the_current_trys_decline_found_leaves_the_period_as_the_schedule_says(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    customer: str,
    status: str,
    code: str,
    klass: str,
    retry_in_s: float | None,
) -> None:
    """Try 2's worker died with its call's outcome unknown; the gateway declined it. The
    period takes the state the worker would have given it: a soft decline schedules try 3
    after the schedule's second step, a customer-action one waits, a hard one is final."""
    await declined(gateway_sim.url, 1, 1, customer)
    failed = await declined(gateway_sim.url, 1, 2, customer)
    await put_row(conn, 1, "pending", try_no=2, customer=customer)

    report = await run_reconcile(settings)

    [finding] = report.findings["unknown_outcomes"]
    assert (finding.key, finding.action) == (key(1), f"recorded {status}")
    assert (finding.detail["charge_id"], finding.detail["try"]) == (failed, 2)
    after = await row(conn, 1)
    assert (after["status"], after["current_try"]) == (status, 2)
    assert (after["decline_code"], after["decline_class"]) == (code, klass)
    assert after["gateway_charge_id"] is None
    if retry_in_s is None:
        assert after["retry_in_s"] is None
    else:  # due the schedule's step after now (less the seconds this test took)
        assert retry_in_s - 60 < after["retry_in_s"] <= retry_in_s


async def test_the_last_allowed_trys_soft_decline_found_is_final(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    for try_no in (1, 2, 3):
        await declined(gateway_sim.url, 1, try_no, "cus_soft_1")
    await put_row(conn, 1, "pending", try_no=3, customer="cus_soft_1")

    report = await run_reconcile(settings)

    [finding] = report.findings["unknown_outcomes"]
    assert (finding.action, finding.detail["exhausted"]) == ("recorded declined", True)
    assert (await row(conn, 1))["status"] == "declined"


async def test_an_earlier_trys_decline_never_settles_the_current_try(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Try 2's call may have been made; the lookup shows only try 1's decline. That is try
    1's answer, recorded already: try 2 stays pending, and goes out again as try 2."""
    js = await provisioned(nc, settings)
    await declined(gateway_sim.url, 1, 1, "cus_soft2_1")
    await put_row(conn, 1, "pending", try_no=2, customer="cus_soft2_1")

    report = await run_reconcile(settings)

    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(1): "not found: re-publish"
    }
    assert report.counts.unknown_resolved == 0
    assert report.counts.republished == 1
    after = await row(conn, 1)
    assert (after["status"], after["current_try"]) == ("pending", 2)
    sub = await js.pull_subscribe(settings.nats.subject, stream=settings.nats.stream)
    [msg] = await sub.fetch(1, timeout=5)
    assert (parse(msg.data).attempt, parse(msg.data).key) == (2, f"{key(1)}:2")


async def test_a_lost_trys_earlier_decline_is_no_answer_its_message_goes_out_again(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Try 2 was started and its message lost before any worker took it; the lookup shows
    try 1's decline only. The row is re-published as try 2, not recorded declined."""
    js = await provisioned(nc, settings)
    await declined(gateway_sim.url, 1, 1, "cus_soft2_1")
    await put_row(conn, 1, "scheduled", try_no=2, customer="cus_soft2_1", gateway_calls=0)

    report = await run_reconcile(settings)

    assert [(f.key, f.action) for f in report.findings["lost_messages"]] == [
        (key(1), "re-published")
    ]
    assert (await row(conn, 1))["status"] == "scheduled"
    sub = await js.pull_subscribe(settings.nats.subject, stream=settings.nats.stream)
    [msg] = await sub.fetch(1, timeout=5)
    assert parse(msg.data).attempt == 2


async def test_money_of_any_try_found_settles_the_period(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Try 1 declined, try 2 charged (its answer lost): the period is `succeeded` with try
    2's charge; and a row whose try 2 is unknown while try 1's charge turns out captured
    (a late capture) is `succeeded` with try 1's."""
    await declined(gateway_sim.url, 1, 1, "cus_soft2_1")
    second = await charged(gateway_sim.url, 1, 2, customer="cus_soft2_1")
    await put_row(conn, 1, "pending", try_no=2, customer="cus_soft2_1")
    first = await charged(gateway_sim.url, 2, 1)
    await put_row(conn, 2, "pending", try_no=2)

    report = await run_reconcile(settings)

    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(1): "recorded succeeded",
        key(2): "recorded succeeded",
    }
    assert [
        (r["status"], r["gateway_charge_id"]) for r in [await row(conn, n) for n in (1, 2)]
    ] == [
        ("succeeded", second),
        ("succeeded", first),
    ]
    assert report.counts.refunds == 0


async def test_a_processing_row_is_settled_by_a_lookup_where_the_provider_reads_no_id(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The contract's webhooks may leave a row `processing` (`charge.processing`), and the
    contract has no read by id: reconcile looks the key up, as before it read charges by id
    where a provider can."""
    made = await charged(gateway_sim.url, 3, 1)
    await put_row(conn, 3, "processing", try_no=1, charge_id=made)
    await conn.execute(LOOKED_AT, 3, dt.timedelta(days=2))

    report = await run_reconcile(settings)

    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(3): "recorded succeeded"
    }
    assert (await row(conn, 3))["status"] == "succeeded"


async def test_a_processing_row_is_looked_at_again_after_gaps_that_grow_with_its_age(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A quarter of its try's age, at least the quiet time, at most a day: a row processing
    for 3 days and looked at an hour ago waits (18 h); one looked at a day ago does not."""
    for order_id in (4, 5):
        made = await charged(gateway_sim.url, order_id, 1)
        await put_row(conn, order_id, "processing", try_no=1, charge_id=made)  # 3 days old
    await conn.execute(LOOKED_AT, 4, dt.timedelta(hours=1))
    await conn.execute(LOOKED_AT, 5, dt.timedelta(days=1))

    report = await run_reconcile(settings)

    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(5): "recorded succeeded"
    }
    assert [(await row(conn, n))["status"] for n in (4, 5)] == ["processing", "succeeded"]


# --- 2. money for a period the ledger said no to, or waits to try again -------------------


@pytest.mark.parametrize("status", ["retry_scheduled", "action_required", "declined"])
async def test_a_captured_charge_of_a_period_waiting_for_a_retry_is_recorded_and_never_retried(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp, status: str
) -> None:
    """The ledger has try 2 declined, but try 1's charge is captured at the gateway (its
    decline was a lost answer). The period holds money: it is recorded `succeeded` (with a
    `resolved` event), so no try 3 is ever started; its due `retry_at` is gone."""
    made = await charged(gateway_sim.url, 1, 1)
    await put_row(conn, 1, status, try_no=2)

    report = await run_reconcile(settings)

    [finding] = report.findings["unrecorded_charges"]
    assert (finding.key, finding.action) == (key(1), "recorded succeeded")
    assert (finding.detail["charge_id"], finding.detail["was"]) == (made, status)
    assert (report.counts.unrecorded_charges, report.counts.ledger_repaired) == (1, 1)
    after = await row(conn, 1)
    assert (after["status"], after["gateway_charge_id"], after["retry_in_s"]) == (
        "succeeded",
        made,
        None,
    )
    resolved = await conn.fetchval(
        "SELECT detail FROM charge_events WHERE kind = 'resolved' AND order_id = 1"
    )
    assert json.loads(resolved)["was"] == status
    assert (await start_due(conn, limit=10, cap=CAP)).started == 0
    assert (await row(conn, 1))["current_try"] == 2


# --- 3. a double is a second captured charge of the period, whichever tries made it -------


async def test_two_tries_captured_charges_of_a_period_are_a_double_one_refunded(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Try 1's charge was captured (its answer lost as a decline) and try 2 charged again
    under its own key: two keys, one period, one charge too many. The recorded one (try
    2's) is kept, try 1's refunded; a period waiting for try 3 with both captured keeps the
    earliest, records it and is tried no more."""
    first = await charged(gateway_sim.url, 1, 1)
    second = await charged(gateway_sim.url, 1, 2)
    await put_row(conn, 1, "succeeded", try_no=2, charge_id=second)
    early = await charged(gateway_sim.url, 2, 1)
    late = await charged(gateway_sim.url, 2, 2)
    await put_row(conn, 2, "retry_scheduled", try_no=2)

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (2, 2)
    doubles = {f.key: f.detail for f in report.findings["double_charges"]}
    assert doubles[key(1)] == {"kept": second, "ledger": "recorded", "refunded": [first]}
    assert (doubles[key(2)]["kept"], doubles[key(2)]["refunded"]) == (early, [late])
    assert await charge_statuses(gateway_sim.url) == {
        first: "refunded",
        second: "succeeded",
        early: "succeeded",
        late: "refunded",
    }
    assert [
        (r["status"], r["gateway_charge_id"]) for r in [await row(conn, n) for n in (1, 2)]
    ] == [
        ("succeeded", second),
        ("succeeded", early),
    ]
    assert (await start_due(conn, limit=10, cap=CAP)).started == 0

    again = await run_reconcile(settings)
    assert (again.counts.double_charges, again.counts.refunds) == (0, 0)


# --- 5. the story names the current try's message -----------------------------------------


async def test_the_story_of_a_period_at_try_2_names_try_2s_message(
    conn: asyncpg.Connection,
) -> None:
    await put_row(conn, 1, "scheduled", try_no=2, gateway_calls=0)

    story = await events.story(conn, 1, PERIOD)

    [published] = [e for e in story if e.kind == "published"]
    assert published.detail["msg_id"] == f"charge:{key(1)}:2"
