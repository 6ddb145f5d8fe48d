"""The producer's second step: publish every `scheduled` row not published yet.

Rows are read oldest first, whoever scheduled them: a run that died between its two steps
leaves some behind, and this step is what makes that harmless. Each is published with
`Nats-Msg-Id: charge:<order_id>:<billing_period>`, its ack awaited, and only then is
`published_at` set, outside any transaction that spans the publish. A failing publish is
retried with backoff for up to `publish_retry_horizon_s`.

Publishes go out `WINDOW` at a time (`publish_async`) and their acks are awaited together;
the window's rows are then marked and their events written in one statement each. One at
a time, a publish and three statements per row held a month's run to a few hundred
charges a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time

import asyncpg
import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck

from charge_worker import events
from charge_worker.errors import DependencyUnavailable
from charge_worker.messages import SCHEMA, ChargeDue
from charge_worker.producer.summary import Problem, Progress, Summary, Ticker
from charge_worker.settings import NatsSettings

ACTOR = "producer"
BATCH = 5000  # rows per read
WINDOW = 1000  # publishes awaiting their acks at once
PUBLISH_TIMEOUT_S = 5.0
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 5.0
log = structlog.get_logger(__name__)

# Keyset on the sort order: rows another run publishes meanwhile, or a worker claims, drop
# out; no row is read twice. A row written by hand may lack due_at: the contract's default.
_UNPUBLISHED = """
SELECT order_id, billing_period, subscription_id, customer_id, amount_minor, currency,
       coalesce(due_at, billing_period::timestamp AT TIME ZONE 'UTC') AS due_at, created_at
  FROM charge_attempts
 WHERE status = 'scheduled' AND published_at IS NULL
   AND (created_at, billing_period, order_id) > ($1, $2, $3)
 ORDER BY created_at, billing_period, order_id
 LIMIT $4
"""

_UNPUBLISHED_AFTER = """
SELECT count(*) FROM charge_attempts
 WHERE status = 'scheduled' AND published_at IS NULL
   AND (created_at, billing_period, order_id) > ($1, $2, $3)
"""

# Not "still scheduled": a worker may claim the message before this runs, and the row should
# still say when it was published, and where (reconcile reads it to tell a queued message
# from a lost one). The first publish is never overwritten.
_MARK_PUBLISHED = """
UPDATE charge_attempts AS a SET published_at = now(), published_seq = p.seq
  FROM unnest($1::bigint[], $2::date[], $3::bigint[]) AS p(order_id, billing_period, seq)
 WHERE a.order_id = p.order_id AND a.billing_period = p.billing_period
   AND a.published_at IS NULL
"""

_PUBLISHED_EVENTS = """
INSERT INTO charge_events (order_id, billing_period, kind, actor, detail)
SELECT order_id, billing_period, 'published', $4, detail
  FROM unnest($1::bigint[], $2::date[], $3::jsonb[]) AS e(order_id, billing_period, detail)
"""

_FIRST = (dt.datetime.min.replace(tzinfo=dt.UTC), dt.date.min, 0)


async def publish_scheduled(
    conn: asyncpg.Connection,
    js: JetStreamContext,
    cfg: NatsSettings,
    summary: Summary,
    *,
    batch_size: int = BATCH,
    progress: Progress | None = None,
) -> None:
    """Publish every `scheduled` row not published yet, oldest first, counting into `summary`.

    A publish that fails for the whole retry horizon ends the step after its window: the
    broker stores nothing, and each further row would wait as long. The window's failures
    are counted as `failed`, the rows after it as `abandoned`; all stay `scheduled` for
    the next run.
    """
    ticker = Ticker("charges published", progress)
    cursor: tuple[dt.datetime, dt.date, int] = _FIRST
    while rows := await conn.fetch(_UNPUBLISHED, *cursor, batch_size):
        for start in range(0, len(rows), WINDOW):
            window = rows[start : start + WINDOW]
            acked, failed = await _publish_window(conn, js, cfg, window)
            for ack in acked:
                if ack.duplicate:
                    summary.deduplicated += 1
                else:
                    summary.published += 1
                ticker.tick()
            last = window[-1]
            cursor = (last["created_at"], last["billing_period"], last["order_id"])
            if failed:
                summary.failed += failed
                summary.abandoned = await conn.fetchval(_UNPUBLISHED_AFTER, *cursor)
                return


async def _publish_window(
    conn: asyncpg.Connection, js: JetStreamContext, cfg: NatsSettings, rows: list[asyncpg.Record]
) -> tuple[list[PubAck], list[Problem]]:
    """Publish the rows together and mark the acked ones: their acks, and what could not
    be stored. Any other error is raised once the acked rows are marked."""
    charges = [ChargeDue.model_validate({"schema": SCHEMA, **dict(r)}) for r in rows]
    answers = await _publish_all(js, cfg, charges)
    acked = [(c, a) for c, a in zip(charges, answers, strict=True) if isinstance(a, PubAck)]
    await _mark_published(conn, acked)
    failed = []
    for charge, answer in zip(charges, answers, strict=True):
        if isinstance(answer, DependencyUnavailable):
            failed.append(Problem(charge.subscription_id, charge.key, str(answer)))
        elif isinstance(answer, BaseException):
            raise answer
    return [ack for _, ack in acked], failed


async def _publish_all(
    js: JetStreamContext, cfg: NatsSettings, charges: list[ChargeDue]
) -> list[PubAck | BaseException]:
    """Each charge's ack, or why it has none. All go out at once with their acks awaited
    together (`publish_async`: no request and timer per message); the few that get no ack
    in time are retried one by one, up to the retry horizon."""
    futures: list[asyncio.Future[PubAck]] = []
    with contextlib.suppress(nats.errors.Error, TimeoutError):  # the rest go the slow way
        for charge in charges:
            futures.append(
                await js.publish_async(
                    cfg.subject,
                    charge.to_json(),
                    stream=cfg.stream,
                    headers={"Nats-Msg-Id": charge.msg_id},
                )
            )
    if futures:
        await asyncio.wait(futures, timeout=PUBLISH_TIMEOUT_S)
    acked: list[PubAck | None] = [_ack_of(future) for future in futures]
    acked += [None] * (len(charges) - len(acked))
    retried = [c for c, ack in zip(charges, acked, strict=True) if ack is None]
    again = iter(
        await asyncio.gather(*(_publish(js, cfg, c) for c in retried), return_exceptions=True)
    )
    return [ack if ack is not None else next(again) for ack in acked]


def _ack_of(future: asyncio.Future[PubAck]) -> PubAck | None:
    """The ack a publish got in time; None (and the future cancelled) otherwise."""
    if not future.done():
        future.cancel()
        return None
    if future.cancelled() or future.exception() is not None:
        return None
    return future.result()


async def _mark_published(conn: asyncpg.Connection, acked: list[tuple[ChargeDue, PubAck]]) -> None:
    """Set `published_at` on the acked rows and write their `published` events."""
    if not acked:
        return
    order_ids = [c.order_id for c, _ in acked]
    periods = [c.billing_period for c, _ in acked]
    await conn.execute(_MARK_PUBLISHED, order_ids, periods, [a.seq for _, a in acked])
    details = [
        events.to_json({"stream_seq": a.seq, "msg_id": c.msg_id, "duplicate": bool(a.duplicate)})
        for c, a in acked
    ]
    try:
        await conn.execute(_PUBLISHED_EVENTS, order_ids, periods, details, ACTOR)
    except asyncpg.PostgresError as error:  # the events describe; they never decide
        log.warning("events.write_failed", kind="published", rows=len(acked), error=repr(error))


async def _publish(js: JetStreamContext, cfg: NatsSettings, charge: ChargeDue) -> PubAck:
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
                headers={"Nats-Msg-Id": charge.msg_id},
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
