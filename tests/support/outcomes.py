"""Reading `CHARGE_OUTCOMES` as a downstream consumer would, for tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from charge_worker.settings import NatsSettings


@dataclass(frozen=True)
class Outcome:
    """One message of the outcomes stream."""

    seq: int
    subject: str
    headers: dict[str, str]
    body: dict[str, Any]


async def outcomes(js: JetStreamContext, cfg: NatsSettings) -> list[Outcome]:
    """Every message of the outcomes stream, in stream order ([] if it does not exist)."""
    try:
        info = await js.stream_info(cfg.outcomes_stream)
    except nats.js.errors.NotFoundError:
        return []
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        msg = await js.get_msg(cfg.outcomes_stream, seq)
        found.append(Outcome(seq, msg.subject, dict(msg.headers or {}), json.loads(msg.data)))
    return found


async def outcomes_batched(
    js: JetStreamContext, cfg: NatsSettings, *, batch: int = 1000, wait_s: float = 5.0
) -> list[Outcome]:
    """What `outcomes` returns, read through an ephemeral pull consumer `batch` messages a
    request instead of one request a message: for streams of thousands of events. Messages
    stored after the call began are left out."""
    try:
        info = await js.stream_info(cfg.outcomes_stream)
    except nats.js.errors.NotFoundError:
        return []
    if info.state.messages == 0:
        return []
    last = info.state.last_seq
    sub = await js.pull_subscribe(
        f"{cfg.outcomes_subject}.>",
        stream=cfg.outcomes_stream,
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=wait_s * 2,
            mem_storage=True,
        ),
    )
    found: list[Outcome] = []
    try:
        while not found or found[-1].seq < last:
            try:
                messages = await sub.fetch(batch, timeout=wait_s)
            except nats.errors.TimeoutError:
                break  # nothing more: the tail was deleted
            for msg in messages:
                outcome = Outcome(
                    msg.metadata.sequence.stream,
                    msg.subject,
                    dict(msg.headers or {}),
                    json.loads(msg.data),
                )
                found.append(outcome)
    finally:
        await sub.unsubscribe()
    return [outcome for outcome in found if outcome.seq <= last]


async def unsent(pool: asyncpg.Pool | asyncpg.Connection) -> int:
    """Outcome events the outbox holds that are not in the stream yet."""
    return int(await pool.fetchval("SELECT count(*) FROM charge_outcomes WHERE sent_at IS NULL"))
