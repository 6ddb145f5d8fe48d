"""`GATEWAY_KIND=stripe` end to end against the Stripe-flavoured simulator: the worker charges
off-session PaymentIntents, a generic decline is soft (its next try scheduled),
`authentication_required` is a decline of its own kind (counted, shown by `explain`, waiting
for the customer), `processing` stays open and is never re-sent, and reconcile settles it
and refunds a double charge. Real nats-server, PostgreSQL and the simulators over HTTP."""

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

SETTLE_S = 4.0  # the bank debit of a `cus_processing…` charge, at the simulator


@pytest.fixture
def stripe_sim() -> Iterator[Provider]:
    with provider("stripe", processing_settle_s=SETTLE_S) as served:
        yield served


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, stripe_sim: Provider, scoring_sim: ServedApp
) -> Settings:
    return stripe_sim.worker_settings(
        nats_settings, database_url, scoring_sim.url, reconcile_quiet_s=0.01
    )


async def statuses(conn: asyncpg.Connection) -> dict[int, tuple[str, str | None]]:
    rows = await conn.fetch("SELECT order_id, status, decline_code FROM charge_attempts")
    return {r["order_id"]: (r["status"], r["decline_code"]) for r in rows}


async def told(settings: Settings, order_id: int, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert await explain_command(settings, order_id, PERIOD, as_json=False, ask_gateway=True) == 0
    return capsys.readouterr().out


async def test_worker_explain_and_reconcile_on_stripe(
    nc: Client,
    settings: Settings,
    conn: asyncpg.Connection,
    stripe_sim: Provider,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = await provisioned(nc, settings)
    customers = {1: "cus_ok", 2: "cus_decline_1", 3: "cus_auth_1", 4: "cus_processing_1"}
    async with running_worker(settings) as worker:
        for order_id, customer in customers.items():
            await publish(js, settings.nats.subject, due(order_id, customer))

        async def all_settled() -> bool:
            return len(await statuses(conn)) == 4 and await consumer_idle(nc, settings.nats)

        await eventually(all_settled, "every delivery acked")
        declines = "charge_worker_declines_total"
        assert (
            worker.metric(
                declines,
                kind="authentication_required",
                code="authentication_required",
                decline_class="customer_action",
            )
            == 1
        )
        assert (
            worker.metric(
                declines, kind="card_declined", code="generic_decline", decline_class="soft"
            )
            == 1
        )

    found = await statuses(conn)
    assert found[1][0] == "succeeded"
    assert found[2] == ("retry_scheduled", "generic_decline")  # the bank's code: soft
    assert found[3] == ("action_required", "authentication_required")  # the customer acts
    assert found[4] == ("processing", None)  # open: acked, never re-sent
    assert await stripe_sim.made() == {"1:2026-12-01": 1}  # the debit has not settled yet

    auth = await told(settings, 3, capsys)
    assert "authentication_required" in auth
    assert "e-mail them" in auth
    processing = await told(settings, 4, capsys)
    assert "processing: the provider accepted it" in processing

    async def debit_settled() -> bool:
        return (await stripe_sim.made())["4:2026-12-01"] == 1

    await eventually(debit_settled, "the bank debit settled at the simulator")
    await stripe_sim.charge_again(due(1, "cus_ok"))  # a double of key 1

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (1, 1)
    found = await statuses(conn)
    assert found[4][0] == "succeeded"  # reconcile's lookup: the debit went through
    assert found[3] == ("action_required", "authentication_required")
    assert (await stripe_sim.stats())["refunds"] == 1
    assert await reconciled_again_changes_nothing(settings)


async def test_explain_of_a_key_with_no_row_on_stripe_says_why_the_gateway_was_not_asked(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    code = await explain_command(settings, 99, PERIOD, as_json=False, ask_gateway=True)
    err = capsys.readouterr().err
    assert code == 1
    assert "no ledger row names the customer" in err
    assert "no charge 99:2026-12-01" in err


async def reconciled_again_changes_nothing(settings: Settings) -> bool:
    report = await run_reconcile(settings)
    return (report.counts.double_charges, report.counts.refunds) == (0, 0)
