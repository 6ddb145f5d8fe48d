"""`GATEWAY_KIND=yookassa` end to end against the YooKassa-flavoured simulator: the worker
charges autopayments with the saved method, a `general_decline` is soft (its next try
scheduled), `3d_secure_failed` is of the `authentication_required` kind (waiting for the
customer), `permission_revoked` is final, `pending` stays open with its payment id and is
never re-sent, and reconcile settles it and refunds a double charge. Real nats-server,
PostgreSQL and the simulators over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import pytest
from nats.aio.client import Client

from charge_worker.explain import explain_command
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    PERIOD,
    consumer_idle,
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
)
from tests.support.providers import Provider, provider

SETTLE_S = 4.0  # a `cus_processing…` payment stays `pending` this long at the simulator
CUSTOMERS = {
    1: "cus_ok",
    2: "cus_decline_1",
    3: "cus_auth_1",
    4: "cus_code_permission_revoked_1",
    5: "cus_processing_1",
}


@pytest.fixture
def yookassa_sim() -> Iterator[Provider]:
    with provider("yookassa", processing_settle_s=SETTLE_S) as served:
        yield served


@pytest.fixture
def settings(
    nats_settings: NatsSettings,
    database_url: str,
    yookassa_sim: Provider,
    scoring_sim: ServedApp,
) -> Settings:
    return yookassa_sim.worker_settings(
        nats_settings, database_url, scoring_sim.url, reconcile_quiet_s=0.01
    )


async def ledger(conn: asyncpg.Connection) -> dict[int, tuple[str, str | None, str | None]]:
    rows = await conn.fetch(
        "SELECT order_id, status, decline_code, gateway_charge_id FROM charge_attempts"
    )
    return {r["order_id"]: (r["status"], r["decline_code"], r["gateway_charge_id"]) for r in rows}


async def test_worker_explain_and_reconcile_on_yookassa(
    nc: Client,
    settings: Settings,
    conn: asyncpg.Connection,
    yookassa_sim: Provider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = await provisioned(nc, settings)
    async with running_worker(settings) as worker:
        for order_id, customer in CUSTOMERS.items():
            await publish(js, settings.nats.subject, due(order_id, customer))

        async def all_settled() -> bool:
            return len(await ledger(conn)) == len(CUSTOMERS) and await consumer_idle(
                nc, settings.nats
            )

        await eventually(all_settled, "every delivery acked")
        assert (
            worker.metric(
                "charge_worker_declines_total",
                kind="authentication_required",
                code="3d_secure_failed",
                decline_class="customer_action",
            )
            == 1
        )

    found = await ledger(conn)
    assert found[1][0] == "succeeded"
    assert found[2][:2] == ("retry_scheduled", "general_decline")  # soft: tried again
    assert found[3][:2] == ("action_required", "3d_secure_failed")  # the customer acts
    assert found[4][:2] == ("declined", "permission_revoked")  # consent withdrawn: final
    assert found[5][:2] == ("processing", None)  # pending: acked, never re-sent
    pending_id = found[5][2]
    assert pending_id is not None  # the pending answer's payment id, recorded
    assert await yookassa_sim.made() == {"1:2026-12-01": 1}  # the pending one not yet

    capsys.readouterr()
    assert await explain_command(settings, 3, PERIOD, as_json=False, ask_gateway=True) == 0
    told = capsys.readouterr().out
    assert "3d_secure_failed" in told
    assert "e-mail them" in told

    async def settled_at_the_provider() -> bool:
        return (await yookassa_sim.made())["5:2026-12-01"] == 1

    await eventually(settled_at_the_provider, "the pending payment succeeded at YooKassa")
    await yookassa_sim.charge_again(due(1, "cus_ok"))  # a double of key 1

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (1, 1)
    found = await ledger(conn)
    assert found[5] == ("succeeded", None, pending_id)  # reconcile's lookup: it went through
    assert found[4][:2] == ("declined", "permission_revoked")
    assert (await yookassa_sim.stats())["refunds"] == 1
    again = await run_reconcile(settings)
    assert (again.counts.double_charges, again.counts.refunds) == (0, 0)
