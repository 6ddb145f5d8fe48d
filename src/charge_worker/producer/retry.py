"""`charge-worker retry ORDER_ID PERIOD`: start a declined period's next try now, on purpose.

Support runs it once the customer has fixed what the decline asked of them (a card
replaced, a payment authenticated). The try is started as the producer starts a due one
(`retries.starts.retry_now`: the row `scheduled` for try `n`, try `n - 1` archived), then
published at once as the producer publishes a `scheduled` row (`Publisher.publish`:
`attempt: n`, `Nats-Msg-Id: charge:<order_id>:<billing_period>:<n>`). Should the publish
fail, the try stays started and unpublished: the next `charge-worker produce` publishes it.
"""

from __future__ import annotations

import datetime as dt
import json

import asyncpg
import click

from charge_worker import database, privileges, streams
from charge_worker.database import translated
from charge_worker.errors import DependencyUnavailable
from charge_worker.producer.publish import Outgoing, Publisher
from charge_worker.producer.summary import Summary
from charge_worker.retries.starts import StartedTry, retry_now
from charge_worker.settings import Settings

LEFT_FOR_PRODUCE = "the next `charge-worker produce` publishes it"


async def retry_command(
    settings: Settings, order_id: int, billing_period: dt.date, *, as_json: bool
) -> int:
    """Start and publish the period's next try; print what was started. Exit 0 when its
    message is stored, 1 when the try is started but not published (`produce` will), and a
    refusal (`RetryRefused`, one line) raises before anything changes."""
    conn = await database.connect(settings.db, application_name="charge-worker retry")
    try:
        async with translated("retry"):
            await privileges.require(conn, privileges.RETRY)
            cap = settings.retries.retry_cap_30d
            started = await retry_now(conn, order_id, billing_period, cap)
            summary = Summary(dt.datetime.now(dt.UTC).date())
            why = await _publish(conn, settings, started, summary)
    finally:
        await database.close_quietly(conn)
    _report(started, why, as_json=as_json)
    return 0 if why is None else 1


async def _publish(
    conn: asyncpg.Connection, settings: Settings, started: StartedTry, summary: Summary
) -> str | None:
    """Publish the started try's message and mark its row; why it is not stored, if not."""
    try:
        nc = await streams.connect(settings.nats, name="charge-worker-retry", reconnect=False)
    except DependencyUnavailable as error:
        return str(error)
    try:
        outgoing = [Outgoing(started.charge, started.traceparent)]
        await Publisher(conn, nc, settings.nats, summary).publish(outgoing)
    finally:
        await nc.close()
    if summary.failed:
        return summary.failed[0].reason
    return None


def _report(started: StartedTry, why: str | None, *, as_json: bool) -> None:
    charge = started.charge
    if as_json:
        document = {
            "order_id": charge.order_id,
            "billing_period": charge.billing_period.isoformat(),
            "try": started.try_no,
            "key": charge.key,
            "msg_id": charge.msg_id,
            "was": started.was,
            "published": why is None,
            "error": None if why is None else f"{why}; {LEFT_FOR_PRODUCE}",
            "exit_code": 0 if why is None else 1,
        }
        click.echo(json.dumps(document))
        return
    line = f"started try {started.try_no} of {charge.order_id}:{charge.billing_period}"
    line += f" (was {started.was}), key {charge.key}: "
    if why is None:
        click.echo(line + f"published as {charge.msg_id}")
    else:
        click.echo(line + f"NOT published ({why}); {LEFT_FOR_PRODUCE}")
