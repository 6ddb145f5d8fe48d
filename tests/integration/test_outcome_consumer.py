"""`examples/outcome_consumer.py`, the reference consumer of docs/outcomes.md, against a real
`CHARGE_OUTCOMES`: the events the relay published from the ledger's changes, then what a
consumer meets besides them (a re-publish after the duplicate window, an older event
arriving after a newer one, a type it does not know, a side effect that fails once). It
applies each change once and keeps each period's highest sequence."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from charge_worker import streams
from charge_worker.ledger import Ledger, Settlement
from charge_worker.settings import NatsSettings
from tests.integration.test_ledger import PERIOD, charge
from tests.integration.test_outcome_relay import relay_for
from tests.support.harness import WAIT_S, eventually
from tests.support.outcomes import outcomes, unsent

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "outcome_consumer.py"
P = PERIOD.isoformat()


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("outcome_consumer", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def settle(ledger: Ledger, order_id: int, settlement: Settlement) -> None:
    claim = await ledger.claim(charge(order_id), "w1", stream_seq=order_id)
    await ledger.settle(claim, settlement, story=None)


@pytest.fixture
async def stream(pool: asyncpg.Pool, nc: Client, nats_settings: NatsSettings) -> NatsSettings:
    """The stream as downstream finds it: the relay's events of four periods (1: succeeded,
    refunded; 2: succeeded; 3: declined; 4: succeeded, disputed), then a re-publish of 1's
    last event after the duplicate window (another `Nats-Msg-Id`), one within it (dropped),
    an event of a type no consumer knows yet for 2, and 2's first event again after it."""
    cfg = nats_settings
    js = nc.jetstream()
    await streams.provision(js, cfg)
    ledger = Ledger(pool, lease_s=60)
    for order_id in (1, 2, 4):
        await settle(ledger, order_id, Settlement("succeeded", charge_id=f"ch_{order_id}"))
    await settle(ledger, 3, Settlement("declined", decline_code="insufficient_funds"))
    await pool.execute("UPDATE charge_attempts SET status = 'refunded' WHERE order_id = 1")
    await pool.execute("UPDATE charge_attempts SET disputed_at = now() WHERE order_id = 4")
    relay = relay_for(pool, nc, cfg)

    async def relayed() -> bool:
        await relay.relay_once()
        return await unsent(pool) == 0

    await eventually(relayed, "every event in the stream")
    published = await outcomes(js, cfg)
    body = {(m.body["order_id"], m.body["sequence"]): m.body for m in published}
    assert len(body) == 6

    async def publish(event: dict[str, Any], msg_id: str) -> bool:
        subject = f"{cfg.outcomes_subject}.{event['type'].removeprefix('charge.')}"
        ack = await js.publish(subject, json.dumps(event).encode(), headers={"Nats-Msg-Id": msg_id})
        return ack.duplicate

    assert not await publish(body[1, 2], f"outcome:1:{P}:2:after-the-window")
    assert await publish(body[1, 2], f"outcome:1:{P}:2")  # the stream drops it
    future = body[2, 1] | {"type": "charge.partially_refunded", "sequence": 2}
    assert not await publish(future | {"event_id": f"2:{P}:2"}, f"outcome:2:{P}:2")
    assert not await publish(body[2, 1], f"outcome:2:{P}:1:late")
    return cfg


async def test_the_reference_consumer_applies_each_change_once_and_keeps_the_highest(
    nc: Client, stream: NatsSettings
) -> None:
    example = load_example()
    periods = example.Periods()
    applied: list[str] = []
    failed_once: set[str] = set()
    verdicts: Counter[str] = Counter()

    async def apply(event: dict[str, Any]) -> None:
        # the side effect of 3's and 4's first events fails once: each comes again later,
        # 4's after its newer event was applied, so it is stale by then
        if event["event_id"] in {f"3:{P}:1", f"4:{P}:1"} - failed_once:
            failed_once.add(event["event_id"])
            raise example.TryLater
        applied.append(event["event_id"])

    def count(msg: Msg, verdict: Any) -> None:
        verdicts[verdict.value] += 1

    stop = asyncio.Event()
    js = nc.jetstream()
    consuming = asyncio.create_task(
        example.consume(
            js,
            periods,
            apply,
            stop,
            durable="billing-access",
            stream=stream.outcomes_stream,
            subject=f"{stream.outcomes_subject}.>",
            on_verdict=count,
            retry_delay_s=0.2,
        )
    )
    try:

        async def all_handled() -> bool:
            return verdicts.total() == 11

        await eventually(all_handled, "every delivery handled")
    finally:
        stop.set()
        await asyncio.wait_for(consuming, WAIT_S)

    assert sorted(applied) == [f"1:{P}:1", f"1:{P}:2", f"2:{P}:1", f"3:{P}:1", f"4:{P}:2"]
    assert periods.highest == {(1, P): 2, (2, P): 2, (3, P): 1, (4, P): 2}
    assert verdicts == {"applied": 5, "later": 2, "duplicate": 1, "stale": 2, "skipped": 1}
    info = await js.consumer_info(stream.outcomes_stream, "billing-access")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


@pytest.fixture
async def process(stream: NatsSettings) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        "--server",
        str(stream.url),
        "--durable",
        "billing-mailer",
        "--stream",
        stream.outcomes_stream,
        "--subject",
        f"{stream.outcomes_subject}.>",
        stdout=asyncio.subprocess.PIPE,
    )
    yield proc
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_the_reference_consumer_runs_as_the_docs_show(
    process: asyncio.subprocess.Process, stream: NatsSettings
) -> None:
    assert process.stdout is not None
    lines = []
    while sum(line.startswith("  ") for line in lines) < 9:  # a verdict per delivery
        line = await asyncio.wait_for(process.stdout.readline(), WAIT_S)
        assert line, lines  # it has not exited
        lines.append(line.decode())
    process.terminate()
    assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    subject = stream.outcomes_subject
    assert Counter(line.split(":")[0].strip() for line in lines if line.startswith("  ")) == {
        "applied": 6,
        "duplicate": 1,
        "skipped": 1,
        "stale": 1,
    }
    assert f"order 1, {P}: charge.refunded\n" in lines
    assert f"  skipped: {subject}.partially_refunded outcome:2:{P}:2\n" in lines
    assert f"  stale: {subject}.succeeded outcome:2:{P}:1:late\n" in lines


def test_the_docs_show_the_example_as_it_is() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "outcomes.md").read_text(), re.S)
    assert blocks
    assert all(block in EXAMPLE.read_text() for block in blocks)
