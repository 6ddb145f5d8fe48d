"""Dead letters (contracts/charge-due.md): the original body, byte for byte, with headers.

A dead letter is published with `Nats-Msg-Id: dlq:<stream seq>` and its publish ack awaited
before the original is terminated, so it is written once and never lost. The
MAX_DELIVERIES advisory is a safety net for messages whose last delivery died with its
worker: the message is read back from the stream by sequence and dead-lettered.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from charge_worker.errors import DependencyUnavailable
from charge_worker.settings import NatsSettings

MAX_ERROR_CHARS = 300


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def envelope_headers(
    *,
    reason: str,
    error: str,
    stream_seq: int,
    num_delivered: int,
    original: Mapping[str, str] | None,
    first_seen: str | None = None,
) -> dict[str, str]:
    """The dead-letter headers; `error` is cut to one line."""
    one_line = " ".join((error or reason).split())[:MAX_ERROR_CHARS]
    headers = {
        "Dlq-Reason": reason,
        "Dlq-Error": one_line,
        "Dlq-Stream-Seq": str(stream_seq),
        "Dlq-Num-Delivered": str(num_delivered),
        "Dlq-First-Seen": first_seen or _now(),
        "Dlq-Dead-At": _now(),
        "Nats-Msg-Id": f"dlq:{stream_seq}",
    }
    original = original or {}
    if msg_id := original.get("Nats-Msg-Id"):
        headers["Dlq-Orig-Msg-Id"] = msg_id
    if traceparent := original.get("traceparent"):
        headers["traceparent"] = traceparent
    return headers


class DeadLetters:
    def __init__(self, js: JetStreamContext, cfg: NatsSettings) -> None:
        self.js = js
        self.cfg = cfg

    async def write(
        self,
        body: bytes,
        *,
        reason: str,
        error: str,
        stream_seq: int,
        num_delivered: int,
        original: Mapping[str, str] | None,
        first_seen: str | None = None,
    ) -> None:
        """Publish a dead letter and wait for JetStream to store it."""
        headers = envelope_headers(
            reason=reason,
            error=error,
            stream_seq=stream_seq,
            num_delivered=num_delivered,
            original=original,
            first_seen=first_seen,
        )
        try:
            await self.js.publish(self.cfg.dlq_subject, body, headers=headers, timeout=5)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error_:
            raise DependencyUnavailable(f"dead-letter stream not writable: {error_!r}") from error_

    def advisory_subject(self) -> str:
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.cfg.stream}.{self.cfg.durable}"

    async def on_max_deliveries(self, advisory: Msg) -> None:
        """Dead-letter the stream copy of a message whose deliveries ran out."""
        event = json.loads(advisory.data)
        seq = int(event["stream_seq"])
        try:
            stored = await self.js.get_msg(self.cfg.stream, seq)
        except nats.js.errors.NotFoundError:
            return  # acked or purged meanwhile: nothing to keep
        await self.write(
            stored.data or b"",
            reason="max_deliveries",
            error="deliveries ran out without a settled outcome (advisory)",
            stream_seq=seq,
            num_delivered=int(event.get("deliveries", 0)),
            original=stored.headers,
        )
