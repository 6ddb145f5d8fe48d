"""`GATEWAY_KIND=stripe` against localstripe, a Stripe fake no one here wrote: a batch of due
charges for customers with saved test cards, a worker killed mid-run, then reconcile;
counted by listing the PaymentIntents on localstripe. Its signed webhooks reach the receiver
and are applied by re-fetching each intent. localstripe keeps no idempotency keys, so this
is also the idempotency-off case. Its differences from Stripe are worked around in
`localstripe_server.shim_app`, never in the adapter (docs/adapters.md)."""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from pydantic import SecretStr

from charge_worker.explain import explain_command
from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings, WebhookSettings
from tests.external import localstripe_server as ls
from tests.support.harness import (
    PERIOD,
    WorkerProcess,
    consumer_idle,
    due,
    eventually,
    provisioned,
    publish,
    settings_for,
)
from tests.support.webhooks import OPEN, SECRET, running_receiver

pytestmark = [pytest.mark.external, pytest.mark.timeout(240)]
CHARGES = 40
DECLINED = {7, 14, 21, 28, 35}  # order ids whose customer's card localstripe declines
# what a declined try leaves its period in, as its decline code's class says (gateway.md)
DECLINED_STATES = ("declined", "retry_scheduled", "action_required")
AMOUNT = 1990


@pytest.fixture(scope="module")
def localstripe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if (why := ls.not_installed()) is not None:
        pytest.skip(why)
    with ls.localstripe(tmp_path_factory.mktemp("localstripe") / "localstripe.log") as url:
        yield url


@pytest.fixture
def shim(localstripe: str) -> Iterator[ServedApp]:
    with ServedApp(ls.shim_app(localstripe)) as served:
        yield served


@pytest.fixture
async def stripe_api(localstripe: str) -> AsyncIterator[ls.Stripe]:
    api = ls.Stripe(localstripe)
    yield api
    await api.aclose()


@pytest.fixture
def settings(
    nats_settings: NatsSettings, database_url: str, shim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    built = settings_for(
        nats_settings,
        database_url,
        shim.url,
        scoring_sim.url,
        kind="stripe",
        api_key=SecretStr(ls.API_KEY),
        concurrency=2,
        reconcile_quiet_s=0.01,
    )
    webhooks = WebhookSettings(
        webhook_host="127.0.0.1", webhook_port=0, webhook_secrets=(SecretStr(SECRET),)
    )
    return built.model_copy(update={"webhooks": webhooks})


async def rows(conn: asyncpg.Connection) -> dict[int, str]:
    found = await conn.fetch("SELECT order_id, status FROM charge_attempts")
    return {r["order_id"]: r["status"] for r in found}


def captured(intent: dict[str, Any]) -> bool:
    """Money still held: succeeded and not refunded in full (localstripe embeds the charge)."""
    charge = intent.get("latest_charge") or {}
    refunded = int(charge.get("amount_refunded") or 0) if isinstance(charge, dict) else 0
    return intent["status"] == "succeeded" and refunded < int(intent["amount"])


async def test_a_batch_on_localstripe_is_charged_once_per_key_through_a_killed_worker(
    nc: Client,
    settings: Settings,
    database_url: str,
    stripe_api: ls.Stripe,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    js = await provisioned(nc, settings)
    conn = await asyncpg.connect(database_url)
    try:
        async with running_receiver(settings) as receiver:
            await stripe_api.webhooks_to(f"{receiver.url}/webhooks/gateway", SECRET)
            customers = {
                order_id: await stripe_api.customer_with_card(
                    ls.DECLINED_CARD if order_id in DECLINED else ls.GOOD_CARD
                )
                for order_id in range(1, CHARGES + 1)
            }
            workers = [WorkerProcess(settings, tmp_path / f"worker-{n}.log") for n in (1, 2)]
            try:
                for order_id, customer in customers.items():
                    body = due(order_id, customer, amount=AMOUNT, currency="EUR")
                    await publish(js, settings.nats.subject, body)

                async def some_settled() -> bool:
                    return sum(s != "pending" for s in (await rows(conn)).values()) >= 8

                await eventually(some_settled, "a fifth of the batch settled")
                workers[0].kill()  # mid-run: its in-flight charges are redelivered
                workers.append(WorkerProcess(settings, tmp_path / "worker-3.log"))

                async def all_final() -> bool:
                    found = await rows(conn)
                    return (
                        len(found) == CHARGES
                        and all(s in ("succeeded", *DECLINED_STATES) for s in found.values())
                        and await consumer_idle(nc, settings.nats)
                    )

                await eventually(all_final, "every charge final", within_s=150)
            finally:
                for worker in workers:
                    worker.kill()
            report = await run_reconcile(settings)
            intents = await stripe_api.intents()

            async def webhooks_applied() -> bool:
                journaled = await conn.fetch("SELECT object_id, status FROM webhook_inbox")
                return {r["object_id"] for r in journaled} >= {pi["id"] for pi in intents} and all(
                    r["status"] not in OPEN for r in journaled
                )

            await eventually(webhooks_applied, "localstripe's webhooks journaled and applied")
            reviews = await conn.fetchval(
                "SELECT count(*) FROM webhook_inbox WHERE status = 'needs_review'"
            )
    finally:
        await conn.close()

    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for intent in intents:
        by_key[intent["metadata"]["order_id"]].append(intent)
    held = Counter({key: sum(captured(pi) for pi in found) for key, found in by_key.items()})
    ledger = await _ledger(database_url)
    for order_id in range(1, CHARGES + 1):
        key = str(order_id)
        if order_id in DECLINED:
            assert held[key] == 0, by_key[key]
            assert ledger[order_id] in DECLINED_STATES
            assert all(pi["status"] == "requires_payment_method" for pi in by_key[key])
        else:
            assert held[key] == 1, by_key[key]  # charged once: none missing, none double
            assert ledger[order_id] == "succeeded"
    assert not report.failures
    assert report.counts.double_charges == report.counts.refunds  # any double was refunded
    assert reviews == 0
    assert {pi["metadata"]["billing_period"] for pi in intents} == {
        dt.date(2026, 12, 1).isoformat()
    }
    for order_id in (1, min(DECLINED)):  # explain asks localstripe, as on-call would
        capsys.readouterr()
        code = await explain_command(settings, order_id, PERIOD, as_json=False, ask_gateway=True)
        told = capsys.readouterr().out
        assert code == 0
        assert told.startswith(f"charge {order_id}:2026-12-01: {ledger[order_id]}")
        assert "at the gateway:\n" in told
        for intent in by_key[str(order_id)]:
            assert f"  {intent['id']}  " in told


async def _ledger(database_url: str) -> dict[int, str]:
    conn = await asyncpg.connect(database_url)
    try:
        return await rows(conn)
    finally:
        await conn.close()
