"""Spans of the webhook receiver and processor, and of reconcile's repairs and refunds.
Real PostgreSQL, nats-server and the gateway simulator; the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from charge_worker.reconcile.run import run_reconcile
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import PERIOD, eventually, provisioned, set_sim, settings_for
from tests.support.spans import children, recorded_spans
from tests.support.webhooks import add_row, event, running_receiver, settled, webhook_settings


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def _one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [found] = [s for s in spans if s.name == name]
    return found


async def test_a_webhook_delivery_and_its_processing_are_spans(
    database_url: str, gateway_sim: ServedApp, exported: InMemorySpanExporter
) -> None:
    db = await asyncpg.connect(database_url)
    try:
        await add_row(db, 1, "succeeded", charge_id="ch_1")
        refund = event("ch_1", "charge.refunded", revision=2)
        async with running_receiver(webhook_settings(database_url, gateway_sim.url)) as receiver:
            assert (await receiver.post(refund)).status_code == 200
            await eventually(lambda: settled(db, refund["id"]), "the refund processed")
    finally:
        await db.close()
    spans = list(exported.get_finished_spans())
    served = _one(spans, "POST /webhooks/gateway")
    assert served.kind is SpanKind.SERVER
    assert (served.attributes or {}).items() >= {
        "http.route": "/webhooks/gateway",
        "http.response.status_code": 200,
        "charge_worker.event_id": refund["id"],
        "charge_worker.charge_id": "ch_1",
    }.items()
    processed = _one(spans, "webhook.process")
    assert (processed.attributes or {})["charge_worker.event_id"] == refund["id"]


async def test_a_refund_of_a_double_charge_is_a_span_of_its_key_in_the_run(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    exported: InMemorySpanExporter,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, "http://127.0.0.1:9")
    await provisioned(nc, settings)
    await set_sim(gateway_sim.url, idempotency_enabled=False)  # two charges for one key
    kept = await _charge(gateway_sim.url, "attempt-1")
    await _charge(gateway_sim.url, "attempt-2")  # the extra one, to be refunded
    db = await asyncpg.connect(database_url)
    try:
        await add_row(db, 1, "succeeded", charge_id=kept)
    finally:
        await db.close()

    report = await run_reconcile(settings)

    assert (report.counts.double_charges, report.counts.refunds) == (1, 1)
    spans = list(exported.get_finished_spans())
    refund = _one(spans, "reconcile.refund")
    [call] = children(spans, refund)
    assert call.kind is SpanKind.CLIENT
    assert str((call.attributes or {}).get("http.url", "")).endswith("/v1/refunds")
    above = _ancestors(spans, refund)
    assert above[-1].name == "reconcile.run"
    assert "reconcile.double_charges" in [s.name for s in above]
    assert all(
        (s.attributes or {})["charge_worker.key"] == f"1:{PERIOD}"
        for s in above
        if s.name == "reconcile.double_charges"
    )


def _ancestors(spans: list[ReadableSpan], span: ReadableSpan) -> list[ReadableSpan]:
    """The span's parent, its parent's, ... up to the root."""
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    found = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        found.append(span)
    return found


async def _charge(gateway_url: str, idempotency_key: str) -> str:
    body = {
        "amount": 99000,
        "currency": "RUB",
        "customer": "cus_ok",
        "metadata": {"order_id": "1", "billing_period": PERIOD.isoformat()},
    }
    headers = {"Authorization": "Bearer sk_test_sandbox", "Idempotency-Key": idempotency_key}
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        response = await client.post("/v1/charges", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])
