"""Watching the demo's workers: progress until every charge is settled, then their metrics.

"Settled" means every published period is in one of the awaited states in the ledger (the
final ones; or those and the two a declined try waits in, `retry_scheduled` and
`action_required`) and the consumer has nothing to deliver and nothing awaiting an ack; a
worker that dies or a deadline that passes ends the wait early, printing what is still open.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import asyncpg
import click
import httpx
from nats.js import JetStreamContext

from charge_worker.sandbox.demo.ledger import FINAL, LedgerRow, ledger_rows
from charge_worker.sandbox.demo.samples import Published
from charge_worker.sandbox.demo.workers import Samples, WorkerProcess, metric
from charge_worker.settings import NatsSettings

PROGRESS_EVERY_S = 5.0
POLL_S = 0.5
COUNTED_WITHIN_S = 5.0


def _progress_line(
    rows: list[LedgerRow],
    keys: int,
    pending: int,
    unacked: int,
    *,
    until: frozenset[str],
    word: str,
) -> str:
    done = sum(row.status in until for row in rows)
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.status for r in rows).items()))
    return (
        f"ledger {done}/{keys} {word} ({statuses or 'no rows yet'}) | "
        f"consumer: {pending} to deliver, {unacked} unacked"
    )


async def await_settled(
    js: JetStreamContext,
    conn: asyncpg.Connection,
    cfg: NatsSettings,
    published: Published,
    workers: list[WorkerProcess],
    *,
    timeout_s: float,
    until: frozenset[str] = FINAL,
    word: str = "final",
) -> bool:
    """Print progress until every period's status is in `until` (`word` names them) and the
    consumer holds nothing; False if not."""
    started = time.monotonic()
    keys = len(published.order_ids)
    last_line, last_print = "", 0.0
    while True:
        rows = await ledger_rows(conn, published.period, published.order_ids)
        info = await js.consumer_info(cfg.stream, cfg.durable)
        line = _progress_line(
            rows, keys, info.num_pending, info.num_ack_pending, until=until, word=word
        )
        now = time.monotonic()
        if line != last_line or now - last_print >= PROGRESS_EVERY_S:
            click.echo(f"    [{now - started:5.1f} s] {line}")
            last_line, last_print = line, now
        done = sum(row.status in until for row in rows)
        if done == keys and info.num_pending == 0 and info.num_ack_pending == 0:
            return True
        if dead := [w for w in workers if w.returncode is not None]:
            for worker in dead:
                click.secho(f"    {worker.name} exited with {worker.returncode}; log:", fg="red")
                click.echo(worker.log_tail())
            return False
        if now - started > timeout_s:
            _print_open(rows, published, timeout_s, until)
            click.echo(
                f"      consumer {cfg.durable}: {info.num_pending} to deliver, "
                f"{info.num_ack_pending} unacked, {info.num_redelivered} redelivered"
            )
            return False
        await asyncio.sleep(POLL_S)


def _print_open(
    rows: list[LedgerRow], published: Published, waited_s: float, until: frozenset[str]
) -> None:
    click.secho(f"    still open after {waited_s:g} s:", fg="red", bold=True)
    seen = {row.order_id: row for row in rows}
    for order_id in published.order_ids:
        row = seen.get(order_id)
        if row is None:
            click.echo(f"      order {order_id}: never claimed")
        elif row.status not in until:
            error = f", last error: {row.last_error}" if row.last_error else ""
            click.echo(f"      order {order_id}: {row.status}, claims: {row.claims}{error}")


async def scrape_when_counted(
    js: JetStreamContext, cfg: NatsSettings, workers: list[WorkerProcess], http: httpx.AsyncClient
) -> list[Samples]:
    """Every worker's metrics, once they count each delivery the consumer made (or 5 s).

    The ack reaches JetStream a moment before the worker counts the message, so a scrape
    taken the instant the consumer is idle may miss the last one.
    """
    deadline = time.monotonic() + COUNTED_WITHIN_S
    while True:
        scraped: list[Samples] = []
        for worker in workers:
            try:
                scraped.append(await worker.scrape(http))
            except httpx.HTTPError:
                scraped.append({})  # a dead worker: the summary says so by its exit status
        counted = sum(metric(s, "charge_worker_messages_total") for s in scraped)
        delivered = (await js.consumer_info(cfg.stream, cfg.durable)).delivered.consumer_seq
        if counted >= delivered or time.monotonic() > deadline:
            if counted != delivered:
                click.secho(
                    f"    workers counted {counted:g} deliveries; JetStream made {delivered}",
                    fg="yellow",
                )
            return scraped
        await asyncio.sleep(0.2)
