"""JetStream's MAX_DELIVERIES advisory: a message whose last delivery died with its worker.

Every worker hears it; the requeue's and the dead letter's `Nats-Msg-Id` keep it to one copy
and one letter. The advisory carries only the stream sequence: the message is read back
from the stream (gone when it was acked meanwhile), and `decisions.after_deliveries_ran_out`
says whether to forget, requeue or dead-letter it.
"""

from __future__ import annotations

import contextlib
import json

import nats.errors
import structlog
from nats.aio.msg import Msg

from charge_worker.dlq import DeadLetters
from charge_worker.errors import ChargeWorkerError, PoisonMessage
from charge_worker.ledger import Ledger
from charge_worker.messages import parse
from charge_worker.worker.decisions import EXHAUSTED_HEADER, after_deliveries_ran_out
from charge_worker.worker.metrics import Metrics

log = structlog.get_logger(__name__)


class Advisories:
    def __init__(self, dead_letters: DeadLetters, ledger: Ledger, metrics: Metrics) -> None:
        self.dead_letters = dead_letters
        self.ledger = ledger
        self.metrics = metrics

    def subject(self) -> str:
        return self.dead_letters.advisory_subject()

    async def on_message(self, advisory: Msg) -> None:
        """The subscription's callback: a failure is one error line, never a dead callback."""
        try:
            await self.on_max_deliveries(json.loads(advisory.data))
        except (ChargeWorkerError, nats.errors.Error, TimeoutError, ValueError, KeyError) as error:
            log.error("dlq.advisory_failed", error=repr(error))

    async def on_max_deliveries(self, event: dict[str, object]) -> None:
        seq = int(str(event["stream_seq"]))
        stored = await self.dead_letters.stream_copy(seq)
        if stored is None:
            return
        body, headers = stored.data or b"", dict(stored.headers or {})
        charge = None
        with contextlib.suppress(PoisonMessage):
            charge = parse(body)
        valid = charge is not None
        status = None
        if charge is not None:
            status = await self.ledger.status_of(charge.order_id, charge.billing_period)
        exhausted = _count(headers.get(EXHAUSTED_HEADER))
        verdict = after_deliveries_ran_out(status, valid=valid, exhausted=exhausted)
        log.warning(
            "consumer.deliveries_ran_out",
            stream_seq=seq,
            ledger_status=status,
            exhausted=exhausted,
            verdict=verdict,
        )
        self.metrics.exhausted.labels(verdict).inc()
        if verdict == "requeue":
            copy = headers | {EXHAUSTED_HEADER: str(exhausted + 1)}
            copy_seq = await self.dead_letters.requeue(body, copy, from_seq=seq)
            self.metrics.requeues.inc()
            if charge is not None:
                await self.ledger.published(charge.order_id, charge.billing_period, copy_seq)
        elif verdict == "dead_letter":
            await self.dead_letters.write(
                body,
                reason="max_deliveries",
                error=f"deliveries ran out unsettled, {exhausted + 1} time(s) (advisory)",
                stream_seq=seq,
                num_delivered=int(str(event.get("deliveries", 0))),
                original=stored.headers,
            )
            self.metrics.dead_letters.labels("max_deliveries").inc()


def _count(header: str | None) -> int:
    """A non-negative count from a header someone else may have written; junk counts as 0."""
    return int(header) if header and header.isdigit() else 0
