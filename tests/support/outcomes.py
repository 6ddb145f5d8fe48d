"""Reading `CHARGE_OUTCOMES` as a downstream consumer would, for tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

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
