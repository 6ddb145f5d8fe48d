"""The gateway simulator's webhooks: signed per the contract, retried on its schedule, and,
reordered and duplicated, still leaving the ledger exactly as the gateway's charges are."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charge_worker.gateway import ContractGateway
from charge_worker.ledger import Attempted, Ledger, Settlement
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import GatewaySettings
from charge_worker.webhooks.bodies import parse_event
from charge_worker.webhooks.processor import ProcessorTuning
from charge_worker.webhooks.rules import state_of
from charge_worker.webhooks.signature import Verifier, read_headers
from tests.support.harness import eventually, set_sim
from tests.support.webhooks import (
    API_KEY,
    FAST,
    OPEN,
    PERIOD,
    SECRET,
    due,
    ledger,
    running_receiver,
    webhook_settings,
)

SCALED = {"webhook_secret": SECRET, "webhook_time_scale": 0.001}


async def sim_webhooks(gateway_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        report: dict[str, Any] = (await client.get(f"{gateway_url}/_sim/webhooks")).json()
    return report


async def sim_done(gateway_url: str, deliveries: int) -> bool:
    """The simulator has made `deliveries` deliveries and none is still going."""
    report = await sim_webhooks(gateway_url)
    return report["pending"] == 0 and len(report["deliveries"]) == deliveries


def state(charge: dict[str, Any]) -> str:
    """A simulator charge's state: a refunded one keeps status succeeded
    (docs/contracts/gateway.md)."""
    return state_of(charge["status"], refunded=charge.get("refunded") is True)


class Flaky:
    """A receiver that fails its first `failures` answers (the last of them by being slow)."""

    def __init__(self, failures: int, *, slow_s: float = 0.0) -> None:
        self.failures = failures
        self.slow_s = slow_s
        self.requests: list[tuple[dict[str, str], bytes]] = []

    async def answer(self, request: Request) -> Response:
        self.requests.append((dict(request.headers), await request.body()))
        if len(self.requests) > self.failures:
            return Response(status_code=204)
        if len(self.requests) == self.failures and self.slow_s:
            await asyncio.sleep(self.slow_s)  # the fault: an answer later than the timeout
        return Response(status_code=503)


@pytest.fixture
def flaky() -> Iterator[tuple[Flaky, str]]:
    endpoint = Flaky(failures=3, slow_s=2.0)
    app = Starlette(routes=[Route("/hook", endpoint.answer, methods=["POST"])])
    with ServedApp(app) as served:
        yield endpoint, f"{served.url}/hook"


@pytest.fixture
async def gateway(gateway_sim: ServedApp) -> AsyncIterator[ContractGateway]:
    client = ContractGateway(
        GatewaySettings(url=gateway_sim.url, api_key=SecretStr(API_KEY), gateway_timeout_s=5.0)
    )
    yield client
    await client.aclose()


async def test_a_delivery_is_signed_and_retried_on_the_schedule_until_a_2xx(
    gateway_sim: ServedApp, gateway: ContractGateway, flaky: tuple[Flaky, str]
) -> None:
    endpoint, url = flaky
    await set_sim(
        gateway_sim.url,
        webhook_url=url,
        webhook_timeout_s=0.5,
        webhook_retry_schedule_s=[0, 30, 180, 1800],
        **SCALED,
    )
    result = await gateway.charge(due(1))

    await eventually(lambda: sim_done(gateway_sim.url, 1), "the delivery finished")
    [delivery] = (await sim_webhooks(gateway_sim.url))["deliveries"]
    assert delivery["attempts"] == [503, 503, "TimeoutError", 204]
    assert delivery["delivered"]
    verifier = Verifier([SECRET])
    ids = set()
    for headers, body in endpoint.requests:
        signed = read_headers(headers)
        verifier.verify(body, signed)  # raises unless signed per the contract
        ids.add(signed.message_id)
        sent = parse_event(body)
        assert (sent.id, sent.type) == (signed.message_id, "charge.succeeded")
        assert (sent.data.object.id, sent.data.object.revision) == (result.charge_id, 1)
        assert sent.data.object.metadata == {"order_id": "1", "billing_period": "2026-12-01"}
    assert len(ids) == 1  # the same event id on every attempt


async def test_a_delivery_never_answered_gives_up_after_the_schedule(
    gateway_sim: ServedApp, gateway: ContractGateway, flaky: tuple[Flaky, str]
) -> None:
    endpoint, url = flaky
    endpoint.failures, endpoint.slow_s = 100, 0.0
    await set_sim(gateway_sim.url, webhook_url=url, webhook_retry_schedule_s=[0, 1], **SCALED)
    await gateway.charge(due(1))

    await eventually(lambda: sim_done(gateway_sim.url, 1), "the delivery given up")
    [delivery] = (await sim_webhooks(gateway_sim.url))["deliveries"]
    assert (delivery["attempts"], delivery["gave_up"]) == ([503, 503, 503], True)


def test_the_default_schedule_is_the_contracts() -> None:
    schedule = GatewayConfig().webhook_retry_schedule_s
    assert schedule[:3] == (0.0, 30.0, 180.0)  # at once, 30 s, 3 min
    gaps = schedule[3:]
    assert list(gaps) == sorted(gaps)  # growing gaps
    assert sum(schedule) <= 3 * 86400
    assert GatewayConfig().webhook_url is None  # nothing is sent unless asked


def test_a_webhook_secret_not_in_whsec_form_is_refused() -> None:
    with pytest.raises(ValueError, match="whsec_"):
        GatewayConfig(webhook_secret="plain-text")


async def test_reordered_and_duplicated_deliveries_leave_the_ledger_as_the_gateway_is(
    database_url: str, gateway_sim: ServedApp, gateway: ContractGateway
) -> None:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    worker = Ledger(pool, lease_s=60)
    settings = webhook_settings(database_url, gateway_sim.url)
    # 5's refund arrives before its succeeded snapshot, which is then stale: with the row
    # still pending, the refund's body proves the charge (its fingerprint) and applies
    bounded = ProcessorTuning(**{**FAST.__dict__, "wait_bound_tries": 3})
    async with running_receiver(settings, bounded) as receiver:
        hook = f"{receiver.url}/webhooks/gateway"
        await set_sim(gateway_sim.url, webhook_url=hook, webhook_duplicate=0.5, **SCALED)
        charged: dict[int, str] = {}
        # 6 and 7 are declined; 5 and 7 lose their answer: the worker never records them
        for order_id in (6, 7, 1, 2, 3, 4, 5, 8):
            if order_id == 1:  # every first snapshot from here on arrives after the next one
                await set_sim(gateway_sim.url, webhook_reorder=1.0, webhook_reorder_delay_s=60)
            customer = "cus_decline" if order_id in (6, 7) else "cus_ok"
            claim = await worker.claim(due(order_id, customer), "worker-1", stream_seq=order_id)
            result = await gateway.charge(due(order_id, customer))
            if result.charge_id:
                charged[order_id] = result.charge_id
            if order_id not in (5, 7):
                await worker.settle(
                    claim,
                    Settlement(result.status, charge_id=result.charge_id),
                    story=None,
                    attempted=Attempted(1, "approved"),
                )
        await pool.execute(
            "UPDATE charge_attempts SET lease_until = now() WHERE status = 'pending'"
        )
        charged[5] = (await gateway.lookup(5, PERIOD))[0].id
        await set_sim(gateway_sim.url, webhook_reorder=0.0)
        for order_id in (1, 2, 4, 5):
            await gateway.refund(charged[order_id])
        async with httpx.AsyncClient(base_url=gateway_sim.url) as client:
            for order_id in (3, 8):
                disputed = await client.post("/_sim/disputes", json={"charge": charged[order_id]})
                assert disputed.status_code == 200
            missing = await client.post("/_sim/disputes", json={"charge": "ch_none"})
            assert missing.status_code == 404
        sent = 8 + 4 + 2  # charges (2 declined), refunds, disputes

        async def all_processed() -> bool:
            report = await sim_webhooks(gateway_sim.url)
            if report["pending"] or len({d["event_id"] for d in report["deliveries"]}) < sent:
                return False
            statuses = await pool.fetch("SELECT status FROM webhook_inbox")
            return len(statuses) == sent and all(r["status"] not in OPEN for r in statuses)

        await eventually(all_processed, "every event delivered and processed")
        duplicates = receiver.metric(
            "charge_worker_webhook_duplicate_events_total", source="gateway"
        )

    try:
        report = await sim_webhooks(gateway_sim.url)
        assert all(d["delivered"] for d in report["deliveries"])
        copies = [d for d in report["deliveries"] if d["copy"] == 1]
        assert copies, "no duplicate was sent: change the seed"
        assert duplicates == len(copies)
        journal = await pool.fetch(
            "SELECT order_id, revision, status FROM webhook_inbox ORDER BY id"
        )
        assert {r["status"] for r in journal} <= {"applied", "stale"}
        arrival = [(r["order_id"], r["revision"]) for r in journal]
        for order_id in (1, 2, 3, 4, 5, 8):  # revision 2 was journaled before revision 1
            assert arrival.index((order_id, 2)) < arrival.index((order_id, 1)), order_id

        async with httpx.AsyncClient() as client:
            at_gateway = (await client.get(f"{gateway_sim.url}/_sim/charges")).json()["data"]
        expected_status = {"succeeded": "succeeded", "refunded": "refunded", "failed": "declined"}
        for charge in at_gateway:
            order_id = int(charge["metadata"]["order_id"])
            row = await ledger(pool, order_id)
            # 7's decline reached the ledger only by its webhook: a generic decline, soft,
            # leaves the period waiting for its next try (6's the test recorded as final)
            expected = "retry_scheduled" if order_id == 7 else expected_status[state(charge)]
            assert (row["status"], row["gateway_charge_id"], row["gateway_revision"]) == (
                expected,
                charge["id"],
                charge["revision"],
            ), order_id
            assert (row["disputed_at"] is not None) == (order_id in (3, 8)), order_id
        statuses = {int(c["metadata"]["order_id"]): state(c) for c in at_gateway}
        assert statuses == {
            1: "refunded",
            2: "refunded",
            3: "succeeded",
            4: "refunded",
            5: "refunded",
            6: "failed",
            7: "failed",
            8: "succeeded",
        }
    finally:
        await pool.close()


def test_reset_forgets_the_deliveries() -> None:
    app = build_gateway_app(GatewayConfig(seed=3))
    sim = app.state.sim
    assert sim.webhooks.report() == {"pending": 0, "deliveries": []}
    sim.reset()
    assert sim.webhooks.report() == {"pending": 0, "deliveries": []}
