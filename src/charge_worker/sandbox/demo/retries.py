"""The demo's next tries, started as the product starts them (docs/decisions/0007-retries.md).

- On purpose: the customer whose card expired updates it (the gateway simulator's
  `succeeds_on_try` knob: their card is charged from try 2), and support runs
  `charge-worker retry ORDER_ID PERIOD`.
- By the schedule: once the soft declines' `retry_at` has come (the demo's
  CHARGE_WORKER_RETRY_SCHEDULE is seconds), `charge-worker produce` starts their next tries
  and publishes them. On a database of your own the demo starts them with `charge-worker
  retry` instead: `produce` would start, and publish to the demo's streams, the tries and
  scheduled rows of every other period in it too.

Each command is a child process with the workers' settings (`workers.run_cli`). Each step
returns the expectations it broke, and the orders it retried on purpose.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import asyncpg
import click
import httpx

from charge_worker.sandbox.demo.samples import Published
from charge_worker.sandbox.demo.workers import run_cli
from charge_worker.settings import Settings

DUE_TIMEOUT_S = 30.0
POLL_S = 0.2

# the demo's periods waiting for a try the schedule has not made due yet, and those due
_WAITING = """
SELECT count(*) FILTER (WHERE retry_at > now()) AS not_due,
       array_agg(order_id ORDER BY order_id) FILTER (WHERE retry_at <= now()) AS due
  FROM charge_attempts
 WHERE status = 'retry_scheduled' AND billing_period = $1 AND order_id = ANY($2::bigint[])
"""


def _echo(result: subprocess.CompletedProcess[str]) -> None:
    for line in (result.stdout + result.stderr).strip().splitlines():
        click.echo(f"    | {line}")


async def _retry(settings: Settings, cwd: Path, order_id: int, published: Published) -> list[str]:
    args = ("retry", str(order_id), published.period.isoformat())
    click.echo(f"    $ charge-worker {' '.join(args)}")
    result = await run_cli(settings, cwd, *args)
    _echo(result)
    if result.returncode != 0:
        return [f"charge-worker retry {order_id} exited {result.returncode}"]
    return []


Step = tuple[list[str], list[int]]  # the expectations broken, the orders retried on purpose


async def retry_on_purpose(
    http: httpx.AsyncClient, settings: Settings, cwd: Path, published: Published
) -> Step:
    """The customer fixes their card; support retries the period now."""
    customer = published.action_customer
    knob = {"succeeds_on_try": {customer: 2}}
    (await http.post(f"{settings.gateway.url}/_sim/config", json=knob)).raise_for_status()
    click.echo(f"    {customer} updates the card (gateway simulator: {json.dumps(knob)})")
    problems = await _retry(settings, cwd, published.action_order, published)
    return problems, [published.action_order]


async def _await_due(conn: asyncpg.Connection, published: Published) -> list[int]:
    """Wait until none of the demo's soft declines waits for a later `retry_at`; the due ones."""
    deadline = time.monotonic() + DUE_TIMEOUT_S
    while True:
        row = await conn.fetchrow(_WAITING, published.period, list(published.order_ids))
        assert row is not None  # an aggregate answers one row
        if row["not_due"] == 0 or time.monotonic() > deadline:
            return list(row["due"] or [])
        await asyncio.sleep(POLL_S)


async def start_due_tries(
    conn: asyncpg.Connection,
    settings: Settings,
    cwd: Path,
    published: Published,
    *,
    external: bool,
) -> Step:
    """Once the soft declines' next tries are due, start and publish them."""
    due = await _await_due(conn, published)
    click.echo(f"    due now: orders {', '.join(map(str, due)) or 'none'}")
    if external:
        click.echo("    (a database of your own: each started with charge-worker retry)")
        problems = []
        for order_id in due:
            problems += await _retry(settings, cwd, order_id, published)
        return problems, due
    click.echo("    $ charge-worker produce --json")
    result = await run_cli(settings, cwd, "produce", "--json")
    if result.returncode != 0:
        _echo(result)
        return [f"charge-worker produce exited {result.returncode}"], []
    summary = json.loads(result.stdout)
    started = summary["tries_started"]
    click.echo(
        f"    | next tries started: {started}, published: {summary['published']},"
        f" postponed by the cap: {summary['tries_postponed']}"
    )
    if started != len(due):
        return [f"charge-worker produce started {started} tries, {len(due)} due"], []
    return [], []
