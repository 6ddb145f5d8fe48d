"""Reconcile against real PostgreSQL, nats-server and the gateway simulator over HTTP.

Each test builds the mess reconcile exists for (a double charge, a purged stream, a worker
killed with an unknown outcome, a ledger charge the gateway never made, two runs at once)
and ends by counting money at the gateway simulator.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client.parser import text_string_to_metric_families

from charge_worker.reconcile.report import Counts, Report
from charge_worker.reconcile.run import LOCK_KEY, reconcile_command, run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import LogSettings, NatsSettings, Settings
from tests.support.harness import (
    PERIOD,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
)

NO_SCORING = "http://127.0.0.1:9"  # reconcile never scores
QUIET_S = 3600.0  # older than reconcile_quiet_s (900 s by default)
EXPIRED_S, LIVE_S = -60.0, 3600.0  # a lease run out a minute ago, or held for an hour


def key(order_id: int) -> str:
    return f"{order_id}:{PERIOD.isoformat()}"


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> Settings:
    return settings_for(nats_settings, database_url, gateway_sim.url, NO_SCORING)


async def put_row(
    conn: asyncpg.Connection,
    order_id: int,
    status: str,
    *,
    customer: str = "cus_ok",
    gateway_calls: int = 0,
    lease_s: float | None = None,
    charge_id: str | None = None,
    quiet_for_s: float = QUIET_S,
) -> None:
    """A ledger row as the producer or a worker leaves it; `lease_s` < 0 is expired."""
    await conn.execute(
        """
        INSERT INTO charge_attempts (
            order_id, billing_period, idempotency_key, subscription_id, customer_id,
            amount_minor, currency, due_at, status, gateway_calls, gateway_charge_id,
            lease_owner, lease_until, attempt, updated_at, settled_at)
        VALUES ($1, $2, $3, $4, $5, 99000, 'RUB', $6, $7, $8, $9,
                CASE WHEN $10::float8 IS NOT NULL THEN 'killed-worker' END,
                now() + make_interval(secs => $10::float8),
                CASE WHEN $7 = 'scheduled' THEN 0 ELSE 1 END,
                now() - make_interval(secs => $11::float8),
                CASE WHEN $7 NOT IN ('scheduled', 'pending') THEN now() END)
        """,
        order_id,
        PERIOD,
        key(order_id),
        f"sub_{order_id}",
        customer,
        dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        status,
        gateway_calls,
        charge_id,
        lease_s,
        quiet_for_s,
    )


async def post_charge(
    gateway_url: str,
    order_id: int,
    *,
    idempotency_key: str | None = None,
    customer: str = "cus_ok",
    amount: int = 99000,
) -> httpx.Response:
    """A charge made straight at the gateway, as a worker's lost request (or a bug) made it."""
    body = {
        "amount": amount,
        "currency": "RUB",
        "customer": customer,
        "metadata": {"order_id": str(order_id), "billing_period": PERIOD.isoformat()},
    }
    headers = {
        "Authorization": "Bearer sk_test_sandbox",
        "Idempotency-Key": idempotency_key or key(order_id),
    }
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        return await client.post("/v1/charges", json=body, headers=headers)


async def charge_id(gateway_url: str, order_id: int, **kwargs: Any) -> str:
    response = await post_charge(gateway_url, order_id, **kwargs)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def sim(gateway_url: str, path: str) -> Any:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{gateway_url}{path}")).json()


async def charge_statuses(gateway_url: str) -> dict[str, str]:
    """Each charge at the gateway: `succeeded`, `failed`, or `refunded` (a succeeded charge
    whose money went back: docs/contracts/gateway.md, "Refunds")."""
    data = (await sim(gateway_url, "/_sim/charges"))["data"]
    return {c["id"]: "refunded" if c["refunded"] else c["status"] for c in data}


async def ledger(conn: asyncpg.Connection) -> dict[int, tuple[str, str | None]]:
    rows = await conn.fetch("SELECT order_id, status, gateway_charge_id FROM charge_attempts")
    return {r["order_id"]: (r["status"], r["gateway_charge_id"]) for r in rows}


async def story(conn: asyncpg.Connection, kind: str) -> list[tuple[int, dict[str, Any]]]:
    rows = await conn.fetch(
        "SELECT order_id, actor, detail FROM charge_events WHERE kind = $1 ORDER BY id", kind
    )
    assert all(r["actor"] == "reconcile" for r in rows)
    return [(r["order_id"], json.loads(r["detail"])) for r in rows]


@pytest.mark.parametrize("extra_first", [False, True], ids=["extra_after", "extra_before"])
async def test_forced_double_charge_refunds_exactly_the_extra_one(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    extra_first: bool,
) -> None:
    """The ledger's charge is kept whether it is the earlier or the later of the two."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    # a gateway that forgot its keys, and a second request for the same charge
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    if extra_first:
        extra = await charge_id(gateway_sim.url, 1, idempotency_key="manual-retry-1")
    async with running_worker(settings):
        await publish(js, settings.nats.subject, due(1))
        await eventually(lambda: _status(conn, 1, "succeeded"), "the worker's charge")
        [(_, kept)] = (await ledger(conn)).values()
        assert kept is not None
        if not extra_first:
            extra = await charge_id(gateway_sim.url, 1, idempotency_key="manual-retry-1")

        dry = await run_reconcile(settings, dry_run=True)
        assert (dry.counts.double_charges, dry.counts.refunds) == (1, 0)
        [found] = dry.findings["double_charges"]
        assert (found.key, found.action) == (key(1), "would refund")
        assert found.detail == {"kept": kept, "ledger": "recorded", "extra": [extra]}
        assert await charge_statuses(gateway_sim.url) == {kept: "succeeded", extra: "succeeded"}
        assert await story(conn, "refund") == []

        repaired = await run_reconcile(settings)  # next to the live worker
        assert (repaired.counts.double_charges, repaired.counts.refunds) == (1, 1)
        assert not repaired.failures
        assert await charge_statuses(gateway_sim.url) == {kept: "succeeded", extra: "refunded"}
        assert await ledger(conn) == {1: ("succeeded", kept)}
        [(_, refund)] = await story(conn, "refund")
        assert (refund["charge_id"], refund["kept"], refund["reason"]) == (extra, kept, "duplicate")

        again = await run_reconcile(settings)
        assert again.counts == Counts()
        assert again.findings["double_charges"] == []
    assert (await sim(gateway_sim.url, "/_sim/stats"))["refunds"] == 1


async def test_the_run_after_a_refund_finds_no_double_and_refunds_nothing(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp, tmp_path: Path
) -> None:
    """A refunded charge keeps `status: "succeeded"` (docs/contracts/gateway.md, "Refunds"): only
    charges with money still captured make a double, so the run after the refund, and the
    one after a refund someone made by hand, find none and write no `refund` event."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    kept = await charge_id(gateway_sim.url, 1)
    extra = await charge_id(gateway_sim.url, 1, idempotency_key="again")
    await put_row(conn, 1, "succeeded", charge_id=kept)
    by_hand = await charge_id(gateway_sim.url, 2)
    await put_row(conn, 2, "succeeded", charge_id=by_hand)
    refunded_by_hand = await charge_id(gateway_sim.url, 2, idempotency_key="again-2")
    await refund_at(gateway_sim.url, refunded_by_hand)
    metrics = tmp_path / "reconcile.prom"

    first = await run_reconcile(settings)
    assert (first.counts.double_charges, first.counts.refunds) == (1, 1)
    assert [f.key for f in first.findings["double_charges"]] == [key(1)]

    for _ in range(2):
        code = await reconcile_command(
            settings,
            since=None,
            dry_run=False,
            as_json=False,
            fail_on_discrepancy=True,
            metrics_file=metrics,
        )
        assert code == 0
        assert _gauges(metrics)["charge_worker_reconcile_double_charges"] == 0
    assert await charge_statuses(gateway_sim.url) == {
        kept: "succeeded",
        extra: "refunded",
        by_hand: "succeeded",
        refunded_by_hand: "refunded",
    }
    assert [(order, detail["charge_id"]) for order, detail in await story(conn, "refund")] == [
        (1, extra)
    ]
    assert (await sim(gateway_sim.url, "/_sim/stats"))["refunds"] == 2


async def refund_at(gateway_url: str, charge_id: str) -> None:
    """A refund made at the gateway by someone else (support, a dashboard)."""
    headers = {"Authorization": "Bearer sk_test_sandbox", "Idempotency-Key": f"hand:{charge_id}"}
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        response = await client.post(
            "/v1/refunds", json={"charge": charge_id, "reason": "duplicate"}, headers=headers
        )
    assert response.status_code == 200, response.text


async def test_extra_charges_not_proven_ours_are_reported_for_a_person_never_refunded(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A refund is money leaving the company: only an extra charge that matches the key's
    ledger row (amount, currency, customer) is a proven double. Charges made at the gateway
    with our metadata for another amount or customer, or for a key the ledger has no row
    for, are reported (their own finding kind, JSON, metrics file) and never refunded."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    kept = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "succeeded", charge_id=kept)
    other_amount = await charge_id(gateway_sim.url, 1, idempotency_key="x1", amount=1000)
    other_customer = await charge_id(gateway_sim.url, 1, idempotency_key="x2", customer="cus_x")
    no_row = [await charge_id(gateway_sim.url, 2, idempotency_key=f"y{n}") for n in (1, 2)]
    proven = await charge_id(gateway_sim.url, 3)
    await put_row(conn, 3, "succeeded", charge_id=proven)
    extra = await charge_id(gateway_sim.url, 3, idempotency_key="z")
    before = await charge_statuses(gateway_sim.url)
    metrics = tmp_path / "reconcile.prom"
    command = {"since": None, "dry_run": False, "as_json": True, "metrics_file": metrics}

    assert await reconcile_command(settings, fail_on_discrepancy=False, **command) == 0

    printed = json.loads(capsys.readouterr().out)
    assert await charge_statuses(gateway_sim.url) == before | {extra: "refunded"}
    assert (printed["counts"]["double_charges"], printed["counts"]["refunds"]) == (1, 1)
    assert printed["counts"]["unmatched_charges"] == 4
    assert [item["order_id"] for item in printed["double_charges"]] == [3]
    unmatched = {item["order_id"]: item for item in printed["unmatched_charges"]}
    assert set(unmatched) == {1, 2}
    assert unmatched[1]["ledger"] == "succeeded 99000 RUB cus_ok"
    assert {c.split()[0] for c in unmatched[1]["charges"]} == {other_amount, other_customer}
    assert unmatched[2]["ledger"] == "no ledger row"
    assert {c.split()[0] for c in unmatched[2]["charges"]} == set(no_row)
    assert _gauges(metrics)["charge_worker_reconcile_unmatched_charges"] == 4
    assert [(order, d["charge_id"]) for order, d in await story(conn, "refund")] == [(3, extra)]
    reported = {d["charge_id"] for _, d in await story(conn, "discrepancy")}
    assert reported == {other_amount, other_customer, *no_row}

    # still there on the next run, for a person; still not refunded, told only once
    assert await reconcile_command(settings, fail_on_discrepancy=True, **command) == 4
    again = json.loads(capsys.readouterr().out)
    assert again["counts"]["unmatched_charges"] == 4
    assert again["counts"]["refunds"] == 0
    assert await charge_statuses(gateway_sim.url) == before | {extra: "refunded"}
    assert len(await story(conn, "discrepancy")) == 4


async def test_a_key_whose_ledger_charge_does_not_match_its_row_refunds_nothing(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The ledger records a charge for another amount than its row: which of the captured
    charges is the right one is a person's call, even for the one that matches."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    recorded = await charge_id(gateway_sim.url, 1, amount=1000)
    matching = await charge_id(gateway_sim.url, 1, idempotency_key="again")
    await put_row(conn, 1, "succeeded", charge_id=recorded)

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (0, 0)
    assert report.counts.unmatched_charges == 2
    [found] = report.findings["unmatched_charges"]
    assert {c.split()[0] for c in found.detail["charges"]} == {recorded, matching}
    assert await charge_statuses(gateway_sim.url) == {recorded: "succeeded", matching: "succeeded"}


@pytest.mark.parametrize("status", ["declined", "failed", "blocked"])
async def test_a_charge_captured_for_a_row_the_ledger_said_no_to_is_recorded(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp, status: str
) -> None:
    """The customer paid; the ledger says declined, failed or blocked. A charge that matches
    the row's amount, currency and customer is recorded (guarded by the row's status), with
    a `resolved` event; a run after it finds nothing. One that does not match: a person."""
    made = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, status, gateway_calls=1)
    stranger = await charge_id(gateway_sim.url, 2, customer="cus_someone_else")
    await put_row(conn, 2, status, gateway_calls=1)

    dry = await run_reconcile(settings, dry_run=True)
    assert [(f.key, f.action) for f in dry.findings["unrecorded_charges"]] == [
        (key(1), "would record succeeded")
    ]
    assert await ledger(conn) == {1: (status, None), 2: (status, None)}

    report = await run_reconcile(settings)

    assert (report.counts.unrecorded_charges, report.counts.ledger_repaired) == (1, 1)
    [found] = report.findings["unrecorded_charges"]
    assert (found.key, found.action) == (key(1), "recorded succeeded")
    assert (found.detail["charge_id"], found.detail["was"]) == (made, status)
    assert report.counts.unmatched_charges == 1
    [person] = report.findings["unmatched_charges"]
    assert (person.key, person.detail["ledger"]) == (key(2), f"{status} 99000 RUB cus_ok")
    assert person.detail["charges"] == [f"{stranger} 99000 RUB cus_someone_else"]
    assert report.counts.refunds == 0
    assert await ledger(conn) == {1: ("succeeded", made), 2: (status, None)}
    [(order, resolved)] = await story(conn, "resolved")
    assert (order, resolved["status"], resolved["charge_id"], resolved["was"]) == (
        1,
        "succeeded",
        made,
        status,
    )

    again = await run_reconcile(settings)
    assert again.findings["unrecorded_charges"] == []
    assert again.counts.unrecorded_charges == 0
    assert again.counts.unmatched_charges == 1  # still for a person
    assert await ledger(conn) == {1: ("succeeded", made), 2: (status, None)}


async def _status(conn: asyncpg.Connection, order_id: int, status: str) -> bool:
    row = (await ledger(conn)).get(order_id)
    return row is not None and row[0] == status


@pytest.mark.parametrize(("lease_s", "row_after"), [(EXPIRED_S, "succeeded"), (LIVE_S, "pending")])
async def test_double_charge_nobody_recorded_keeps_the_earliest(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    lease_s: float,
    row_after: str,
) -> None:
    """A pending row (the worker died, or is still at it) and two charges at the gateway:
    the earliest stays, the other is refunded; the row records the earliest only when no
    live worker holds it."""
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    earliest = await charge_id(gateway_sim.url, 1)
    later = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "pending", gateway_calls=2, lease_s=lease_s, quiet_for_s=0)

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (1, 1)
    assert await charge_statuses(gateway_sim.url) == {earliest: "succeeded", later: "refunded"}
    recorded = earliest if row_after == "succeeded" else None
    assert await ledger(conn) == {1: (row_after, recorded)}
    lease = await conn.fetchval("SELECT lease_until > now() FROM charge_attempts")
    assert lease is (True if lease_s > 0 else None)  # a live worker's lease is untouched
    assert len(await story(conn, "resolved")) == (1 if row_after == "succeeded" else 0)


async def test_history_is_paged_through_to_a_double_charge_on_a_later_page(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for order_id in range(100, 250):  # one and a half pages of single charges, recorded
        await put_row(
            conn, order_id, "succeeded", charge_id=await charge_id(gateway_sim.url, order_id)
        )
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    kept = await charge_id(gateway_sim.url, 1)
    extra = await charge_id(gateway_sim.url, 1, idempotency_key="again")
    await put_row(conn, 1, "succeeded", charge_id=kept)

    code = await reconcile_command(
        settings.model_copy(update={"log": LogSettings(log_format="console")}),
        since=None,
        dry_run=False,
        as_json=True,
        fail_on_discrepancy=True,
        metrics_file=None,
    )

    assert code == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["history"] == {"pages": 2, "charges": 152}
    assert "gateway history page 2, 152 charges" in printed.err
    assert (await charge_statuses(gateway_sim.url))[extra] == "refunded"


async def test_purged_stream_every_due_charge_republished_and_charged_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """A broker that lost acknowledged messages: the ledger still knows every due charge."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    await put_row(conn, 1, "scheduled")
    await put_row(conn, 2, "scheduled")
    await put_row(conn, 3, "pending", lease_s=EXPIRED_S)  # claimed, worker killed before the call
    await put_row(conn, 4, "pending", lease_s=EXPIRED_S, gateway_calls=1)  # call never arrived
    for n in (1, 2, 3, 4):  # as the producer publishes them: inside the dedup window
        await publish(js, settings.nats.subject, due(n), msg_id=f"charge:{key(n)}")
    await js.purge_stream(settings.nats.stream)
    assert (await js.stream_info(settings.nats.stream)).state.messages == 0

    async with running_worker(settings):
        report = await run_reconcile(settings)
        assert report.counts.republished == 4
        assert not report.failures
        assert [(f.key, f.action) for f in report.findings["unknown_outcomes"]] == [
            (key(4), "not found: re-publish")
        ]
        for found_key, headers in (await _republished(js, settings, report)).items():
            assert headers["Nats-Msg-Id"].startswith(f"reconcile:{found_key}:")
        await eventually(lambda: _all(conn, "succeeded", 4), "every re-published charge settled")
        again = await run_reconcile(settings)
        assert again.counts.republished == 0
    assert await gateway_charges(gateway_sim.url) == {key(n): 1 for n in (1, 2, 3, 4)}
    assert {order for order, _ in await story(conn, "republished")} == {1, 2, 3, 4}


async def test_a_republished_message_carries_the_trace_its_row_names(
    nc: Client, settings: Settings, conn: asyncpg.Connection
) -> None:
    """Every copy of a charge's message continues the trace its row names, reconcile's too."""
    js = await provisioned(nc, settings)
    traced = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await put_row(conn, 1, "scheduled")
    await put_row(conn, 2, "scheduled")
    await conn.execute("UPDATE charge_attempts SET traceparent = $1 WHERE order_id = 1", traced)

    report = await run_reconcile(settings)

    assert report.counts.republished == 2
    headers = await _republished(js, settings, report)
    assert headers[key(1)]["traceparent"] == traced
    assert "traceparent" not in headers[key(2)]


async def _republished(
    js: JetStreamContext, settings: Settings, report: Report
) -> dict[str, dict[str, str]]:
    """The headers of each message the run re-published, by key."""
    headers = {}
    for found in report.findings["lost_messages"]:
        message = await js.get_msg(settings.nats.stream, found.detail["stream_seq"])
        headers[found.key] = dict(message.headers or {})
    return headers


async def _all(conn: asyncpg.Connection, status: str, count: int) -> bool:
    rows = await ledger(conn)
    return len(rows) == count and all(s == status for s, _ in rows.values())


async def test_unknown_outcomes_of_a_killed_worker_are_resolved_by_lookup(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await provisioned(nc, settings)
    charged = await charge_id(gateway_sim.url, 1)
    declined = await post_charge(gateway_sim.url, 2, customer="cus_decline_2")
    assert declined.status_code == 402
    held = await charge_id(gateway_sim.url, 3)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=EXPIRED_S)
    await put_row(conn, 2, "pending", gateway_calls=1, lease_s=EXPIRED_S, customer="cus_decline_2")
    await put_row(conn, 3, "pending", gateway_calls=1, lease_s=LIVE_S)  # a live worker's
    await put_row(conn, 4, "pending", gateway_calls=1, lease_s=EXPIRED_S)  # never charged
    charges_before = await charge_statuses(gateway_sim.url)

    report = await run_reconcile(settings)

    # a generic decline is soft: the default schedule tries again, as the worker would
    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(1): "recorded succeeded",
        key(2): "recorded retry_scheduled",
        key(4): "not found: re-publish",
    }
    assert report.counts.unknown_resolved == 2
    assert await ledger(conn) == {
        1: ("succeeded", charged),
        2: ("retry_scheduled", None),
        3: ("pending", None),
        4: ("pending", None),
    }
    assert [f.key for f in report.findings["lost_messages"]] == [key(4)]
    assert report.counts.discrepancies == 0  # what it just recorded agrees with the gateway
    assert await charge_statuses(gateway_sim.url) == charges_before  # nothing charged
    assert held in charges_before
    resolved = await story(conn, "resolved")  # written by keys worked on at once
    assert sorted((order, detail["status"]) for order, detail in resolved) == [
        (1, "succeeded"),
        (2, "retry_scheduled"),
    ]

    again = await run_reconcile(settings)  # 4 was re-published just now: not again yet
    assert again.counts == Counts()
    assert all(not items for items in again.findings.values())


async def test_a_row_a_worker_takes_meanwhile_is_left_to_it(
    settings: Settings, database_url: str, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """Reconcile read the row (attempt 1, lease expired) and looked it up; before its write
    lands, a worker takes the row over. The guarded write must then change nothing."""
    await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=EXPIRED_S)
    worker = conn.transaction()
    await worker.start()
    await conn.execute("SELECT 1 FROM charge_attempts WHERE order_id = 1 FOR UPDATE")
    running = asyncio.create_task(run_reconcile(settings))
    await eventually(lambda: running.done() or _waiting_on_the_row(database_url), "it waits")
    assert not running.done()
    # what ledger.claim does to a row whose lease ran out
    await conn.execute(
        "UPDATE charge_attempts SET attempt = attempt + 1, lease_owner = 'live-worker', "
        "lease_until = now() + interval '30 seconds', updated_at = now() WHERE order_id = 1"
    )
    await worker.commit()

    report = await running

    assert [f.action for f in report.findings["unknown_outcomes"]] == [
        "taken by a worker: left alone"
    ]
    assert report.counts.unknown_resolved == 0
    row = await conn.fetchrow("SELECT status, attempt, lease_owner FROM charge_attempts")
    assert tuple(row.values()) == ("pending", 2, "live-worker")
    assert await story(conn, "resolved") == []


async def test_one_broken_key_is_reported_and_the_sweep_goes_on(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await provisioned(nc, settings)
    first = await charge_id(gateway_sim.url, 1)
    second = await charge_id(gateway_sim.url, 2)
    # a corrupt ledger: order 9 claims order 1's charge, so 1 cannot record it
    await put_row(conn, 9, "succeeded", charge_id=first)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=EXPIRED_S)
    await put_row(conn, 2, "pending", gateway_calls=1, lease_s=EXPIRED_S)

    report = await run_reconcile(settings)

    assert [(f.sweep, f.key) for f in report.failures] == [("unknown_outcomes", key(1))]
    assert "ledger refused" in report.failures[0].error
    assert (await ledger(conn))[2] == ("succeeded", second)
    assert [f.key for f in report.findings["discrepancies"]] == [key(9)]  # not its charge
    assert report.exit_code(fail_on_discrepancy=False) == 1


async def test_ledger_charge_unknown_to_the_gateway_is_reported_never_charged(
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "succeeded", charge_id=real)
    await put_row(conn, 2, "succeeded", charge_id="ch_the_gateway_never_made")
    command = {"since": None, "dry_run": False, "as_json": False, "metrics_file": None}

    assert await reconcile_command(settings, fail_on_discrepancy=True, **command) == 4
    out = capsys.readouterr().out
    assert "discrepancies" in out
    assert key(2) in out
    assert "ch_the_gateway_never_made" in out
    assert key(1) not in out

    assert await reconcile_command(settings, fail_on_discrepancy=False, **command) == 0
    assert await charge_statuses(gateway_sim.url) == {real: "succeeded"}  # nothing charged
    assert await ledger(conn) == {
        1: ("succeeded", real),
        2: ("succeeded", "ch_the_gateway_never_made"),
    }
    [(order, detail)] = await story(conn, "discrepancy")  # once, not once per run
    assert (order, detail["ledger_charge_id"]) == (2, "ch_the_gateway_never_made")


async def test_a_charge_made_before_the_window_is_confirmed_not_reported(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A row settled inside the window whose charge is older than it (a late lookup):
    the page does not show the charge, the key's lookup does, once."""
    made = await charge_id(gateway_sim.url, 1)
    await put_row(conn, 1, "succeeded", charge_id=made)
    after_it = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)

    report = await run_reconcile(settings, since=after_it)

    assert report.charges_seen == 0
    assert report.counts.discrepancies == 0
    assert report.lookups == 1
    again = await run_reconcile(settings, since=after_it)
    assert (again.counts.discrepancies, again.lookups) == (0, 0)


async def test_two_reconciles_at_once_one_works_and_the_other_stands_aside(
    settings: Settings, database_url: str, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    earliest = await charge_id(gateway_sim.url, 1)
    later = await charge_id(gateway_sim.url, 1, idempotency_key="again")
    await put_row(conn, 1, "pending", gateway_calls=2, lease_s=EXPIRED_S, quiet_for_s=0)
    # hold the row, so the first run stops inside its work (recording `earliest`)
    blocker = conn.transaction()
    await blocker.start()
    await conn.execute("SELECT 1 FROM charge_attempts WHERE order_id = 1 FOR UPDATE")
    first = asyncio.create_task(run_reconcile(settings))
    await eventually(lambda: first.done() or _waiting_on_the_row(database_url), "first inside")
    assert not first.done()

    second = await run_reconcile(settings)

    assert second.skipped is not None
    assert "another reconcile is running" in second.skipped
    assert second.counts == Counts()
    await blocker.rollback()
    report = await first
    assert report.counts.refunds == 1
    assert await charge_statuses(gateway_sim.url) == {earliest: "succeeded", later: "refunded"}
    assert (await sim(gateway_sim.url, "/_sim/stats"))["refunds"] == 1
    assert await ledger(conn) == {1: ("succeeded", earliest)}


async def _waiting_on_the_row(database_url: str) -> bool:
    watcher = await asyncpg.connect(database_url)
    try:
        waiting = await watcher.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'charge-worker reconcile' AND wait_event_type = 'Lock'"
        )
    finally:
        await watcher.close()
    return bool(waiting)


async def test_metrics_file_and_json_carry_the_run(
    nc: Client,
    settings: Settings,
    conn: asyncpg.Connection,
    gateway_sim: ServedApp,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await provisioned(nc, settings)
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    await put_row(conn, 1, "succeeded", charge_id=await charge_id(gateway_sim.url, 1))
    await charge_id(gateway_sim.url, 1, idempotency_key="again")  # a double charge
    await put_row(conn, 2, "succeeded", charge_id="ch_unknown")  # a discrepancy
    await charge_id(gateway_sim.url, 3)
    await put_row(conn, 3, "pending", gateway_calls=1, lease_s=EXPIRED_S)  # an unknown outcome
    await put_row(conn, 4, "scheduled")  # a lost message
    await charge_id(gateway_sim.url, 5)
    await put_row(conn, 5, "declined", gateway_calls=1)  # an unrecorded charge
    await charge_id(gateway_sim.url, 6, customer="cus_x")  # two unmatched: no ledger row
    await charge_id(gateway_sim.url, 6, idempotency_key="again-6")
    path = tmp_path / "reconcile.prom"
    before = time.time()

    code = await reconcile_command(
        settings,
        since=None,
        dry_run=False,
        as_json=True,
        fail_on_discrepancy=False,
        metrics_file=path,
    )

    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    figures = {
        "double_charges": 1,
        "refunds": 1,
        "unrecorded_charges": 1,
        "ledger_repaired": 1,
        "discrepancies": 1,
        "unknown_resolved": 1,
        "adopted": 0,
        "adopted_rows": 0,
        "republished": 1,
        "still_waiting": 0,
        "unmatched_charges": 2,
        "errors": 0,
    }
    assert printed["counts"] == figures
    assert [item["order_id"] for item in printed["lost_messages"]] == [4]
    assert printed["exit_code"] == 0
    written = _gauges(path)
    assert written.pop("charge_worker_reconcile_last_run_timestamp_seconds") >= int(before)
    assert written == {f"charge_worker_reconcile_{name}": value for name, value in figures.items()}

    # a run that finds the lock taken leaves the file of the run that holds it alone
    content = path.read_text()
    holder = await asyncpg.connect(settings.db.dsn)
    try:
        assert await holder.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)
        code = await reconcile_command(
            settings,
            since=None,
            dry_run=False,
            as_json=True,
            fail_on_discrepancy=True,
            metrics_file=path,
        )
    finally:
        await holder.close()
    assert code == 0
    assert json.loads(capsys.readouterr().out)["ran"] is False
    assert path.read_text() == content


def _gauges(path: Path) -> dict[str, float]:
    families = text_string_to_metric_families(path.read_text())
    return {sample.name: sample.value for family in families for sample in family.samples}


async def _published(conn: asyncpg.Connection, js: Any, settings: Settings, order_id: int) -> int:
    """Publish the row's message as the producer does, and record where it went."""
    seq = await publish(js, settings.nats.subject, due(order_id), msg_id=f"charge:{key(order_id)}")
    await conn.execute(
        "UPDATE charge_attempts SET published_seq = $2, published_at = now() WHERE order_id = $1",
        order_id,
        seq,
    )
    return seq


async def test_a_month_start_queue_is_not_taken_for_lost_messages(
    nc: Client, settings: Settings, conn: asyncpg.Connection
) -> None:
    """Messages still waiting in the stream, however long: no re-publish, counted waiting."""
    js = await provisioned(nc, settings)
    for order_id in range(1, 6):
        await put_row(conn, order_id, "scheduled")  # quiet for an hour: the queue is long
        await _published(conn, js, settings, order_id)

    report = await run_reconcile(settings)

    assert (report.counts.republished, report.counts.still_waiting) == (0, 5)
    assert (await js.stream_info(settings.nats.stream)).state.messages == 5
    assert not await story(conn, "republished")


async def test_a_charge_made_for_a_message_acked_while_the_ledger_forgot_is_recorded(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A failover lost the claim and the settle; the message was acked and is gone. The
    gateway keeps no idempotency keys: re-publishing would charge twice; the lookup does not."""
    js = await provisioned(nc, settings)
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    await put_row(conn, 1, "scheduled")  # what the promoted standby remembers
    await put_row(conn, 2, "scheduled")  # acked too, never charged (the worker died first)
    await _published(conn, js, settings, 1)
    await _published(conn, js, settings, 2)
    made = await charge_id(gateway_sim.url, 1)
    sub = await js.pull_subscribe_bind(durable=settings.nats.durable, stream=settings.nats.stream)
    for msg in await sub.fetch(2, timeout=5):
        await msg.ack_sync()

    report = await run_reconcile(settings)

    assert (report.counts.adopted, report.counts.republished) == (1, 1)
    assert (await ledger(conn))[1] == ("succeeded", made)
    assert [order for order, _ in await story(conn, "republished")] == [2]
    assert await gateway_charges(gateway_sim.url) == {key(1): 1}


async def _subscription(conn: asyncpg.Connection, order_id: int, amount: int = 99000) -> None:
    await conn.execute(
        "INSERT INTO subscriptions (subscription_id, order_id, customer_id, amount_minor,"
        " currency, next_billing_date) VALUES ($1, $2, 'cus_ok', $3, 'RUB', $4)",
        f"sub_{order_id}",
        order_id,
        amount,
        PERIOD,
    )


async def test_a_dry_run_tells_what_the_run_does_for_a_key_that_lost_its_row(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """No row, two charges its subscription proves: the run records the earliest and refunds
    the other; the dry run before it says exactly that, not "for a person"."""
    await _subscription(conn, 1)
    made = await charge_id(gateway_sim.url, 1)
    extra = await charge_id(gateway_sim.url, 1, idempotency_key="a-lost-retry")

    dry = await run_reconcile(settings, dry_run=True)
    real = await run_reconcile(settings)

    for report, recorded, refunded in (
        (dry, "would record", "would refund"),
        (real, "recorded", "refunded"),
    ):
        assert [f.action for f in report.findings["forgotten_charges"]] == [f"{recorded} succeeded"]
        [double] = report.findings["double_charges"]
        assert (double.action, double.detail["kept"]) == (refunded, made)
        assert report.findings["unmatched_charges"] == []
    assert real.counts.refunds == 1
    assert (await charge_statuses(gateway_sim.url))[extra] == "refunded"


async def test_a_lost_row_the_ledger_refuses_to_record_is_reported_and_the_run_goes_on(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The subscriptions table checks nothing: a customer id longer than the ledger takes
    makes the adoption fail for that key alone."""
    too_long = "cus_" + "x" * 80
    await _subscription(conn, 1)
    await conn.execute("UPDATE subscriptions SET customer_id = $1 WHERE order_id = 1", too_long)
    await _subscription(conn, 2)
    await charge_id(gateway_sim.url, 1, customer=too_long)
    made = await charge_id(gateway_sim.url, 2)

    report = await run_reconcile(settings)

    assert [(f.sweep, f.key) for f in report.failures] == [("forgotten_charges", key(1))]
    assert await ledger(conn) == {2: ("succeeded", made)}


async def test_a_charge_whose_ledger_row_was_lost_is_recorded_from_its_subscription(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """No row at all (the producer's commit lost too): the subscription proves the charge;
    a charge it does not prove is a person's."""
    await _subscription(conn, 1)
    await _subscription(conn, 2, amount=12300)  # the charge below is not its amount
    made = await charge_id(gateway_sim.url, 1)
    await charge_id(gateway_sim.url, 2)

    report = await run_reconcile(settings)

    assert (report.counts.adopted_rows, report.counts.unmatched_charges) == (1, 1)
    assert await ledger(conn) == {1: ("succeeded", made)}
    [(order_id, detail)] = await story(conn, "resolved")
    assert (order_id, detail["charge_id"]) == (1, made)
    again = await run_reconcile(settings)
    assert (again.counts.adopted_rows, again.counts.refunds) == (0, 0)


async def test_a_foreign_charge_does_not_resolve_an_unknown_outcome(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A worker died with its call's outcome unknown; the lookup by metadata finds charges
    someone else made with it (a support agent's for another customer, a verification
    charge for another amount). Neither is the period's payment: each is reported for a
    person, and the row stays pending and is re-published, so the due charge goes ahead."""
    js = await provisioned(nc, settings)
    agent = await charge_id(gateway_sim.url, 1, idempotency_key="support:1", customer="cus_x")
    check = await charge_id(gateway_sim.url, 2, idempotency_key="verify:2", amount=100)
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=EXPIRED_S)
    await put_row(conn, 2, "pending", gateway_calls=1, lease_s=EXPIRED_S)
    before = await charge_statuses(gateway_sim.url)

    report = await run_reconcile(settings)

    assert {f.key: f.action for f in report.findings["unknown_outcomes"]} == {
        key(1): "not found: re-publish",
        key(2): "not found: re-publish",
    }
    assert report.counts.unknown_resolved == 0
    assert await ledger(conn) == {1: ("pending", None), 2: ("pending", None)}
    assert report.counts.unmatched_charges == 2
    unmatched = {f.order_id: f.detail["charges"] for f in report.findings["unmatched_charges"]}
    assert unmatched == {1: [f"{agent} 99000 RUB cus_x"], 2: [f"{check} 100 RUB cus_ok"]}
    assert {d["charge_id"] for _, d in await story(conn, "discrepancy")} == {agent, check}
    assert await story(conn, "resolved") == []
    assert report.counts.republished == 2  # the due charges go ahead
    assert set(await _republished(js, settings, report)) == {key(1), key(2)}
    assert await charge_statuses(gateway_sim.url) == before  # nothing refunded, nothing made


async def test_a_foreign_charge_is_not_taken_for_a_lost_message_s_charge(
    nc: Client, settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """A message acked while the ledger forgot the claim: the lookup finds only a charge
    another integration made with our metadata for another amount. It is a person's; the
    row is re-published, not recorded `succeeded` with it. Our own charge beside a foreign
    one is recorded, and the foreign one reported."""
    js = await provisioned(nc, settings)
    await put_row(conn, 1, "scheduled")
    await put_row(conn, 2, "scheduled")
    await _published(conn, js, settings, 1)
    await _published(conn, js, settings, 2)
    foreign = await charge_id(gateway_sim.url, 1, idempotency_key="other-app:1", amount=4200)
    other = await charge_id(gateway_sim.url, 2, idempotency_key="other-app:2", amount=4200)
    made = await charge_id(gateway_sim.url, 2)
    sub = await js.pull_subscribe_bind(durable=settings.nats.durable, stream=settings.nats.stream)
    for msg in await sub.fetch(2, timeout=5):
        await msg.ack_sync()

    report = await run_reconcile(settings)

    assert await ledger(conn) == {1: ("scheduled", None), 2: ("succeeded", made)}
    assert (report.counts.adopted, report.counts.republished) == (1, 1)
    assert [order for order, _ in await story(conn, "republished")] == [1]
    assert report.counts.unmatched_charges == 2
    unmatched = {f.order_id: f.detail["charges"] for f in report.findings["unmatched_charges"]}
    assert unmatched == {1: [f"{foreign} 4200 RUB cus_ok"], 2: [f"{other} 4200 RUB cus_ok"]}
    assert (await charge_statuses(gateway_sim.url))[foreign] == "succeeded"


async def test_a_foreign_charge_on_the_history_for_an_open_row_is_reported(
    settings: Settings, conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The history shows the only charge of a key whose row a live worker holds, made an
    hour ago for another amount: not the worker's charge it has not recorded yet, but one
    someone else made with our metadata. Reported for a person at once; the row is left to
    its worker."""
    an_hour_ago = int(time.time()) - 3600
    async with httpx.AsyncClient(base_url=gateway_sim.url) as client:
        body = {"first_order_id": 1, "count": 1, "billing_period": PERIOD.isoformat()}
        body |= {"amount": 100, "customer_prefix": "cus_ok_", "created": an_hour_ago}
        assert (await client.post("/_sim/charges/load", json=body)).status_code == 200
    await put_row(conn, 1, "pending", gateway_calls=1, lease_s=LIVE_S, customer="cus_ok_1")

    report = await run_reconcile(settings)

    [found] = report.findings["unmatched_charges"]
    assert found.detail == {
        "ledger": "pending 99000 RUB cus_ok_1",
        "charges": [f"ch_load_1_{PERIOD.isoformat()} 100 RUB cus_ok_1"],
    }
    assert await ledger(conn) == {1: ("pending", None)}
