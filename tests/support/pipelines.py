"""One worker's pipeline on the real ledger, with scoring approving over a MockTransport:
for tests that give the pipeline a gateway of an unkind shape and look at what it did."""

from __future__ import annotations

import asyncpg
import httpx
from prometheus_client import CollectorRegistry

from charge_worker.gateway import Gateway
from charge_worker.ledger import Ledger
from charge_worker.scoring import ScoringClient
from charge_worker.settings import ScoringSettings
from charge_worker.worker.failpoints import Failpoints
from charge_worker.worker.metrics import Metrics
from charge_worker.worker.pipeline import Delivery, Pipeline, Processed


def approving_scoring() -> ScoringClient:
    async def approve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"decision": "approve", "score": 0.1})

    cfg = ScoringSettings(url="http://127.0.0.1:9")
    return ScoringClient(cfg, transport=httpx.MockTransport(approve))


async def process_once(
    pool: asyncpg.Pool, gateway: Gateway, data: bytes, *, lease_s: float, owner: str = "worker-1"
) -> Processed:
    """One delivery of `data` through a fresh pipeline; the gateway is closed after."""
    scoring = approving_scoring()
    pipeline = Pipeline(
        Ledger(pool, lease_s=lease_s),
        gateway,
        scoring,
        owner=owner,
        metrics=Metrics(CollectorRegistry()),
        failpoints=Failpoints(),
    )
    try:
        return await pipeline.process(Delivery(data, stream_seq=1, num_delivered=1))
    finally:
        await gateway.aclose()
        await scoring.aclose()
