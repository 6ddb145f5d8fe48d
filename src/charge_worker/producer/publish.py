"""Publishing due charges to `charges.due`, each with `Nats-Msg-Id:
charge:<order_id>:<billing_period>` (`...:<n>` for a declined period's try `n`, whose
message says `attempt: n`); a failing publish is retried with backoff for up to
`publish_retry_horizon_s`.

Two ways in:
- `Publisher.send`, inside `schedule`'s transaction: the batch's new charges, contract-checked
  and in hand, go out before their rows are inserted, and the rows are inserted already
  published (`published_at`, `published_seq`). Marking each row after its insert wrote every
  row twice, a third of PostgreSQL's work at a month start.
- `publish_scheduled` / `Publisher.publish_leftovers`: every `scheduled` row not published
  yet, oldest first, whoever wrote it (a run whose broker failed, rows written by hand, the
  next tries a run or `charge-worker retry` started). Each
  window's acked rows are then marked in one statement, outside any transaction that spans
  the publish.

Publishes go out `WINDOW` at a time, each replying to its own subject under one inbox, and
their acks are awaited together. One at a time, a publish and three statements per row held
a month's run to a few hundred charges a second. nats-py's `publish_async` does the same
with as much work again per message (docs/decisions/0003-producer-publish.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from dataclasses import dataclass
from typing import NamedTuple

import asyncpg
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode

from charge_worker import tracing
from charge_worker.errors import DependencyUnavailable
from charge_worker.messages import SCHEMA, ChargeDue
from charge_worker.producer.summary import Problem, Progress, Summary, Ticker
from charge_worker.settings import NatsSettings

DEFAULT_SUBJECT = "charges.due"
BATCH = 5000  # rows per read
WINDOW = 1000  # publishes awaiting their acks at once
PUBLISH_TIMEOUT_S = 5.0
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 5.0

# Keyset on the sort order: rows another run publishes meanwhile, or a worker claims, drop
# out; no row is read twice. A row written by hand may lack due_at: the contract's default.
# A row's message asks for its current try (`attempt`): 1, or the try a retry started.
_UNPUBLISHED = """
SELECT order_id, billing_period, subscription_id, customer_id, amount_minor, currency,
       coalesce(due_at, billing_period::timestamp AT TIME ZONE 'UTC') AS due_at, created_at,
       traceparent, current_try AS attempt
  FROM charge_attempts
 WHERE status = 'scheduled' AND published_at IS NULL
   AND (created_at, billing_period, order_id) > ($1, $2, $3)
   AND subscription_id > $5 AND ($6::text IS NULL OR subscription_id <= $6)
 ORDER BY created_at, billing_period, order_id
 LIMIT $4
"""

_UNPUBLISHED_AFTER = """
SELECT count(*) FROM charge_attempts
 WHERE status = 'scheduled' AND published_at IS NULL
   AND (created_at, billing_period, order_id) > ($1, $2, $3)
   AND subscription_id > $4 AND ($5::text IS NULL OR subscription_id <= $5)
"""

# Not "still scheduled": a worker may claim the message before this runs, and the row should
# still say when it was published, and where (reconcile reads it to tell a queued message
# from a lost one). The first publish is never overwritten, nor a trace the row names. The
# row is the charge's `published` event too (events.py).
# "Not published yet" is decided in SET, not in WHERE: a ledger of settled months has
# statistics saying no row is unpublished, and a generic plan trusting them scans the new
# month's rows once per key of the window (tests/integration/test_producer_plans.py).
_MARKED = """
UPDATE charge_attempts AS a
   SET published_at = coalesce(a.published_at, statement_timestamp()),
       published_seq = CASE WHEN a.published_at IS NULL THEN p.seq ELSE a.published_seq END,
       traceparent = coalesce(a.traceparent, p.traceparent)
  FROM unnest($1::bigint[], $2::date[], $3::bigint[], $4::text[])
       AS p(order_id, billing_period, seq, traceparent)
 WHERE a.order_id = p.order_id AND a.billing_period = p.billing_period
"""

_FIRST = (dt.datetime.min.replace(tzinfo=dt.UTC), dt.date.min, 0)


@dataclass(frozen=True)
class Share:
    """The subscriptions one process of a run takes (`produce --processes`), and the rows
    earlier runs left unpublished that it publishes: subscription ids after `after` and up
    to `through` (None: no end), in the database's order. The whole run: all of them."""

    after: str = ""
    through: str | None = None


WHOLE = Share()


class Outgoing(NamedTuple):
    """A charge to publish, with the trace its row names (None: opened when published). A
    tuple: a month start makes a million of them."""

    charge: ChargeDue
    traceparent: str | None


async def publish_scheduled(
    conn: asyncpg.Connection,
    nc: NATS,
    cfg: NatsSettings,
    summary: Summary,
    *,
    batch_size: int = BATCH,
    progress: Progress | None = None,
) -> None:
    """Publish every `scheduled` row not published yet, oldest first, counting into
    `summary` (`Publisher.publish_leftovers`)."""
    await Publisher(conn, nc, cfg, summary, progress).publish_leftovers(batch_size)


class Publisher:
    """Publishes batches of charges a window at a time, for the lanes of a run (`send`) and
    for what earlier runs left (`publish`, which marks the acked rows on `conn`).

    After a window whose publishes failed for the whole retry horizon it publishes nothing
    more: the failures are counted as `failed`, every charge handed to it afterwards as
    `abandoned` (all stay `scheduled` for the next run).
    """

    def __init__(
        self,
        conn: asyncpg.Connection,
        nc: NATS,
        cfg: NatsSettings,
        summary: Summary,
        progress: Progress | None = None,
    ) -> None:
        self.conn = conn
        self.nc = nc
        self.cfg = cfg
        self.summary = summary
        self.ticker = Ticker("charges published", progress)
        self.broken = False

    async def publish_leftovers(self, batch_size: int = BATCH, share: Share = WHOLE) -> None:
        """Publish every `scheduled` row of `share` not published yet, oldest first: what
        earlier runs left, and rows written by hand (checked against the contract here).

        A publish that fails for the whole retry horizon ends the step after its window: the
        broker stores nothing, and each further row would wait as long. The rows after it
        are counted as `abandoned`."""
        cursor: tuple[dt.datetime, dt.date, int] = _FIRST
        while rows := await self.conn.fetch(
            _UNPUBLISHED, *cursor, batch_size, share.after, share.through
        ):
            outgoing = [
                Outgoing(ChargeDue.model_validate({"schema": SCHEMA, **dict(r)}), r["traceparent"])
                for r in rows
            ]
            last = rows[-1]
            cursor = (last["created_at"], last["billing_period"], last["order_id"])
            if not await self.publish(outgoing):
                self.summary.abandoned += await self.conn.fetchval(
                    _UNPUBLISHED_AFTER, *cursor, share.after, share.through
                )
                return

    async def publish(self, outgoing: list[Outgoing]) -> bool:
        """Publish the batch and mark the acked rows; False when the broker failed (now or
        before). An unexpected error is raised once its window's acked rows are marked."""
        for window in _windows(_traced(outgoing, self.cfg.subject)):
            acks, error = await self._send(window)
            await mark_published(self.conn, window, acks)
            if error is not None:
                raise error
        return not self.broken

    async def send(self, outgoing: list[Outgoing]) -> list[PubAck | None]:
        """Publish the charges, marking nothing: each one's ack, None where it has none (it
        failed, or came after a failure). The caller records the acks with the rows."""
        acks: list[PubAck | None] = []
        for window in _windows(outgoing):
            answers, error = await self._send(window)
            if error is not None:
                raise error
            acks += answers
        return acks

    async def _send(
        self, window: list[Outgoing]
    ) -> tuple[list[PubAck | None], BaseException | None]:
        """Publish one window and count it: each charge's ack (or None), and the first error
        that is not the broker's failure to store."""
        if self.broken:
            self.summary.abandoned += len(window)
            return [None] * len(window), None
        acks: list[PubAck | None] = []
        error: BaseException | None = None
        for o, answer in zip(window, await _publish_window(self.nc, self.cfg, window), strict=True):
            if isinstance(answer, PubAck):
                acks.append(answer)
                if answer.duplicate:
                    self.summary.deduplicated += 1
                else:
                    self.summary.published += 1
                continue
            acks.append(None)
            if isinstance(answer, DependencyUnavailable):
                self.summary.failed.append(
                    Problem(o.charge.subscription_id, o.charge.key, str(answer))
                )
                self.broken = True
            elif error is None:
                error = answer
        self.ticker.tick(sum(ack is not None for ack in acks))
        return acks, error


def _windows(outgoing: list[Outgoing]) -> list[list[Outgoing]]:
    return [outgoing[start : start + WINDOW] for start in range(0, len(outgoing), WINDOW)]


async def _publish_window(
    nc: NATS, cfg: NatsSettings, outgoing: list[Outgoing]
) -> list[PubAck | BaseException]:
    """Publish the charges together: each one's ack, or why it has none. Each message
    carries its charge's `traceparent`; each publish is a `send` span in that trace."""
    if not tracing.enabled():
        return await _publish_all(nc, cfg, outgoing)
    sends = [_sending(o.charge, o.traceparent, cfg.subject) for o in outgoing]
    answers = await _publish_all(nc, cfg, outgoing)
    for span, answer in zip(sends, answers, strict=True):
        _sent(span, answer)
    return answers


def _traced(outgoing: list[Outgoing], subject: str) -> list[Outgoing]:
    """The charges, each with a trace: a row scheduled with tracing off gets its trace
    opened now, with tracing on."""
    if not tracing.enabled():
        return outgoing
    return [
        o if o.traceparent else Outgoing(o.charge, _open_now(o.charge, subject)) for o in outgoing
    ]


async def _publish_all(
    nc: NATS, cfg: NatsSettings, outgoing: list[Outgoing]
) -> list[PubAck | BaseException]:
    """Each charge's ack, or why it has none. All go out at once with their acks awaited
    together (`_Acks`); the few that get no ack in time, or a refusal, are retried one by
    one, up to the retry horizon."""
    acks = await _Acks.collect(nc, cfg, outgoing)
    retried = [o for o, ack in zip(outgoing, acks, strict=True) if ack is None]
    js = nc.jetstream()
    again = iter(
        await asyncio.gather(
            *(_publish(js, cfg, o.charge, _headers(o, cfg.stream)) for o in retried),
            return_exceptions=True,
        )
    )
    return [ack if ack is not None else next(again) for ack in acks]


class _Acks:
    """One window's publishes, each replying to its own subject under one inbox, and the
    acks that come back: what `publish_async` does, without its future, semaphore, nuid and
    random token per message, which cost about as much again as the publish (ADR 0003)."""

    def __init__(self, size: int) -> None:
        self.acks: list[PubAck | None] = [None] * size
        self.waiting = size
        self.all_in = asyncio.Event()

    @classmethod
    async def collect(
        cls, nc: NATS, cfg: NatsSettings, outgoing: list[Outgoing]
    ) -> list[PubAck | None]:
        """The ack of each publish that got one in time; None where it did not, or where
        the stream refused it (`_publish` tries those again and says why)."""
        window = cls(len(outgoing))
        inbox = nc.new_inbox()
        with contextlib.suppress(nats.errors.Error, TimeoutError):  # the rest: one by one
            sub = await nc.subscribe(f"{inbox}.*", cb=window.on_reply)
            try:
                for i, o in enumerate(outgoing):
                    await nc.publish(
                        cfg.subject,
                        o.charge.to_json(),
                        reply=f"{inbox}.{i}",
                        headers=_headers(o, cfg.stream),
                    )
                await asyncio.wait_for(window.all_in.wait(), PUBLISH_TIMEOUT_S)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        return window.acks

    async def on_reply(self, msg: Msg) -> None:
        i = int(msg.subject.rpartition(".")[2])
        ack = stored(msg.data)
        if ack is not None and self.acks[i] is None:
            self.acks[i] = ack
            self.waiting -= 1
            if self.waiting == 0:
                self.all_in.set()


def stored(answer: bytes) -> PubAck | None:
    """The stream's ack in a reply to a publish, read as `JetStreamContext.publish` reads
    it; None when the stream refused the message (its answer may name the stream all the
    same) or no stream answered (a 503 status, no body)."""
    try:
        reply = json.loads(answer)
        if not isinstance(reply, dict) or "error" in reply:
            return None
        return PubAck.from_response(reply)
    except (ValueError, TypeError):  # not JSON; no stream or sequence
        return None


async def mark_published(
    conn: asyncpg.Connection, outgoing: list[Outgoing], acks: list[PubAck | None]
) -> None:
    """Set `published_at`, the stream sequence and the trace (if the row names none) on the
    rows of the acked charges."""
    acked = [(o, ack) for o, ack in zip(outgoing, acks, strict=True) if ack is not None]
    if acked:
        await conn.execute(
            _MARKED,
            [o.charge.order_id for o, _ in acked],
            [o.charge.billing_period for o, _ in acked],
            [ack.seq for _, ack in acked],
            [o.traceparent for o, _ in acked],
        )


async def _publish(
    js: JetStreamContext, cfg: NatsSettings, charge: ChargeDue, headers: dict[str, str]
) -> PubAck:
    """Publish and wait for the ack; retry timeouts and refusals up to the retry horizon.

    Every try carries the same Nats-Msg-Id, and the duplicate window is at least the
    horizon, so a try that was stored although its ack was lost is dropped when repeated.
    """
    deadline = time.monotonic() + cfg.publish_retry_horizon_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return await js.publish(
                cfg.subject,
                charge.to_json(),
                timeout=PUBLISH_TIMEOUT_S,
                stream=cfg.stream,
                headers=headers,
            )
        except nats.errors.ConnectionClosedError as error:
            # a command's connection is not re-established: no further try could succeed
            raise DependencyUnavailable("the connection to NATS was lost") from error
        except (nats.errors.Error, TimeoutError) as error:
            left = deadline - time.monotonic()
            if left <= 0:
                cause = str(error) or type(error).__name__
                raise DependencyUnavailable(
                    f"not stored after {cfg.publish_retry_horizon_s:g}s of retries: {cause}"
                ) from error
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, MAX_RETRY_S)


def opened(charge: ChargeDue, subject: str) -> Span:
    """The span that opens a due charge's trace: the `create` span of its message (the
    semantic conventions' creation context, which every copy of the message carries). The
    caller ends it. Off: a span that is nothing."""
    if not tracing.enabled():
        return INVALID_SPAN
    attributes = tracing.messaging("create", subject, charge.msg_id) | _charge_attributes(charge)
    return tracing.start(f"create {subject}", attributes=attributes, kind=SpanKind.PRODUCER)


def _open_now(charge: ChargeDue, subject: str) -> str | None:
    span = opened(charge, subject)
    span.end()
    return tracing.traceparent_of(span)


def _sending(charge: ChargeDue, trace: str | None, subject: str) -> Span:
    if not tracing.enabled():
        return INVALID_SPAN
    attributes = tracing.messaging("send", subject, charge.msg_id) | _charge_attributes(charge)
    return tracing.start(f"send {subject}", trace, attributes, kind=SpanKind.CLIENT)


def _sent(span: Span, answer: PubAck | BaseException) -> None:
    if isinstance(answer, PubAck):
        span.set_attributes(
            {
                "charge_worker.stream_seq": answer.seq,
                "charge_worker.duplicate": bool(answer.duplicate),
            }
        )
    else:
        span.set_status(StatusCode.ERROR, str(answer) or type(answer).__name__)
    span.end()


def _charge_attributes(charge: ChargeDue) -> dict[str, str | int]:
    return {
        "charge_worker.order_id": charge.order_id,
        "charge_worker.billing_period": charge.billing_period.isoformat(),
    }


def _headers(outgoing: Outgoing, stream: str) -> dict[str, str]:
    """The message's headers: it may be stored in `stream` only."""
    headers = {Header.EXPECTED_STREAM: stream, "Nats-Msg-Id": outgoing.charge.msg_id}
    if outgoing.traceparent:
        headers["traceparent"] = outgoing.traceparent
    return headers
