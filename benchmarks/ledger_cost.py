"""PostgreSQL's CPU per charge, part by part of what the worker writes: where the worker's
PostgreSQL cost goes, one backend at a time, with nothing else running.

Each variant has a fresh migrated database and one connection. A round writes `--charges`
charges through it one after another (a claim, then a settle as `succeeded`), and that
connection's backend's CPU (`/proc`, clock ticks) divided by the charges is the round's
figure. The variants take turns, round after round, so the VM's drift falls on them alike;
the first round is left out, the median of the rest printed with the difference to `bare`.

    PYTHONPATH=src:. .venv/bin/python -m benchmarks.ledger_cost [--rounds N] [--charges N]

The variants:
- `bare`: the bare pipeline's `INSERT` and `UPDATE` (benchmarks/bare_pipeline.py), the
  ledger's outbox triggers off, as in `make bench`;
- `worker, no outbox`: `Ledger.claim`, then `Ledger.settle` with the delivery's story, the
  outbox triggers off (case 2c of `make bench`);
- `worker, no story`: the triggers on, the settle without its story (`story=None`);
- `worker`: what a charge costs the worker's PostgreSQL (case 2), the outbox's relay left out
  (its two statements a batch are the next part);
- `worker + relay`: the same, and after each round the relay's statements on the round's
  events (`Outbox.relay`, their publishes answered at once);
- `worker, outbox triggers writing nothing`: the triggers called, their function emptied;
- `worker, outbox without CHECKs` / `without partial indexes`: the outbox table without its
  CHECK constraints, or without its two partial indexes: what its shape costs.

Every round checks what it wrote (the rows by status, the outcome events and story events
per charge), so a variant that stopped doing its part fails rather than reads cheap.

It needs PostgreSQL on this machine: the embedded server, or `DATABASE_URL` (a role that may
create databases) on a server whose backends this user can read in `/proc`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import asyncpg
import psutil

from benchmarks import bare_pipeline
from benchmarks.bare_pipeline import OWNER
from benchmarks.load import due_body
from benchmarks.processes import cpu_seconds
from benchmarks.stack import admin, with_database
from charge_worker import event_loop
from charge_worker.database import keep_session
from charge_worker.ledger import Attempted, Ledger, Settlement
from charge_worker.messages import ChargeDue
from charge_worker.migrate import migrate
from charge_worker.outcomes.outbox import Event, Outbox, Published
from charge_worker.sandbox.embedded import PostgresServer

LEASE_S = 30.0
RELAY_BATCH = 200
# a delivery's story as the worker writes it for a first delivery that charged
STORY = {
    "stream_seq": 1,
    "delivery": 1,
    "attempt": 1,
    "taken_from": None,
    "outcome": "charged",
    "error": None,
    "scoring": "approved",
    "gateway": "charged",
    "action": "ack",
}
NO_CHECKS = """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT conname FROM pg_constraint
                 WHERE conrelid = 'charge_outcomes'::regclass AND contype = 'c' LOOP
        EXECUTE format('ALTER TABLE charge_outcomes DROP CONSTRAINT %I', name);
    END LOOP;
END
$$"""
NO_PARTIAL_INDEXES = "DROP INDEX charge_outcomes_unsent_idx, charge_outcomes_sent_idx"
TRIGGERS_OFF = "ALTER TABLE charge_attempts DISABLE TRIGGER USER"
# the outbox's triggers fire and write nothing: what calling them costs
NOOP_TRIGGER = """
CREATE OR REPLACE FUNCTION charge_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NEW;
END
$$"""


@dataclass(frozen=True)
class Variant:
    name: str
    worker: bool = True  # False: the bare pipeline's statements
    outbox: bool = True  # False: the outbox triggers off
    events: bool = True  # False: the triggers write nothing
    story: bool = True
    relay: bool = False
    schema: tuple[str, ...] = ()  # run after the migrations

    def setup(self) -> tuple[str, ...]:
        return (() if self.outbox else (TRIGGERS_OFF,)) + self.schema

    def expected(self, charges: int) -> tuple[int, int, int, int]:
        """What a round of `charges` leaves: charges `succeeded`, outcome events, those of
        them not yet sent, story events."""
        events = charges if self.outbox and self.events else 0
        stories = charges if self.worker and self.story else 0
        return charges, events, 0 if self.relay else events, stories


VARIANTS = (
    Variant("bare", worker=False, outbox=False, story=False),
    Variant("worker, no outbox", outbox=False),
    Variant("worker, no story", story=False),
    Variant("worker"),
    Variant("worker + relay", relay=True),
    Variant("worker, outbox triggers writing nothing", events=False, schema=(NOOP_TRIGGER,)),
    Variant("worker, outbox without CHECKs", schema=(NO_CHECKS,)),
    Variant("worker, outbox without partial indexes", schema=(NO_PARTIAL_INDEXES,)),
)


class Subject:
    """One variant's database, its one connection (in a pool of one, as the worker's
    `Ledger` takes a pool) and that connection's backend."""

    def __init__(self, variant: Variant, pool: asyncpg.Pool, backend: int) -> None:
        self.variant = variant
        self.pool = pool
        self.backend = backend
        self.ledger = Ledger(pool, lease_s=LEASE_S)
        self.outbox = Outbox(pool, hold_s=60.0, retry_max_s=60.0)

    async def round(self, order_ids: range) -> float:
        """Write a charge for each order; the backend's CPU µs per charge."""
        before = cpu_seconds(self.backend)
        for order_id in order_ids:
            body = due_body(order_id)
            await (self._worker(body) if self.variant.worker else self._bare(body))
        if self.variant.relay:
            while await self.outbox.relay(RELAY_BATCH, _stored):
                pass
        return (cpu_seconds(self.backend) - before) / len(order_ids) * 1e6

    async def _worker(self, body: bytes) -> None:
        charge = ChargeDue.model_validate_json(body)
        claim = await self.ledger.claim(charge, OWNER, charge.order_id)
        await self.ledger.settle(
            claim,
            Settlement("succeeded", charge_id=f"ch_{charge.order_id}"),
            story=STORY if self.variant.story else None,
            attempted=Attempted(calls=1, scoring="approved"),
        )

    async def _bare(self, body: bytes) -> None:
        charge = json.loads(body)  # as the bare pipeline reads it
        period, _ = await bare_pipeline.claim(self.pool, charge)
        order_id = charge["order_id"]
        await bare_pipeline.mark(self.pool, order_id, period, f"ch_{order_id}", None)

    async def check(self, order_ids: range) -> None:
        """The round left what the variant writes (`Variant.expected`)."""
        first, last = order_ids[0], order_ids[-1]
        row = await self.pool.fetchrow(
            """SELECT (SELECT count(*) FROM charge_attempts
                            WHERE order_id BETWEEN $1 AND $2 AND status = 'succeeded'),
                          (SELECT count(*) FROM charge_outcomes WHERE order_id BETWEEN $1 AND $2),
                          (SELECT count(*) FROM charge_outcomes
                            WHERE order_id BETWEEN $1 AND $2 AND sent_at IS NULL),
                          (SELECT count(*) FROM charge_events WHERE order_id BETWEEN $1 AND $2)""",
            first,
            last,
        )
        found = tuple(row.values()) if row is not None else ()
        expected = self.variant.expected(len(order_ids))
        if found != expected:
            raise RuntimeError(
                f"{self.variant.name}: charges succeeded, outcome events, unsent, stories:"
                f" {found}, expected {expected}"
            )


async def _stored(events: list[Event]) -> Published:
    """Every event stored at once, as a stream that acks at once would."""
    return list(range(1, len(events) + 1))


async def measure(
    admin_url: str, rounds: int, charges: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    """Each variant's CPU µs per charge, by round (the first left out)."""
    figures: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
    async with AsyncExitStack() as stack:
        subjects = [await _subject(stack, admin_url, variant) for variant in VARIANTS]
        for number in range(rounds + 1):
            order_ids = range(number * charges + 1, (number + 1) * charges + 1)
            for subject in subjects:
                cost = await subject.round(order_ids)
                await subject.check(order_ids)
                if number:
                    figures[subject.variant.name].append(cost)
            progress(f"round {number}/{rounds}" + (" (warm-up, left out)" if not number else ""))
    return figures


async def _subject(stack: AsyncExitStack, admin_url: str, variant: Variant) -> Subject:
    name = f"ledger_cost_{uuid.uuid4().hex[:10]}"
    await admin(admin_url, f"CREATE DATABASE {name}")
    stack.push_async_callback(admin, admin_url, f"DROP DATABASE {name} WITH (FORCE)")
    url = with_database(admin_url, name)
    await migrate(url)
    conn = await asyncpg.connect(url)
    try:
        for statement in variant.setup():
            await conn.execute(statement)
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(url, min_size=1, max_size=1, reset=keep_session)
    assert pool is not None
    stack.push_async_callback(pool.close)
    backend = int(await pool.fetchval("SELECT pg_backend_pid()"))
    if not _is_postgres(backend):
        raise SystemExit(
            "benchmarks.ledger_cost: PostgreSQL's backends are not processes of this machine"
            " (DATABASE_URL): it reads their CPU time here"
        )
    return Subject(variant, pool, backend)


def _is_postgres(pid: int) -> bool:
    try:
        return "postgres" in psutil.Process(pid).name()
    except psutil.Error:
        return False


def report(figures: dict[str, list[float]], charges: int) -> str:
    bare = statistics.median(figures["bare"])
    lines = [
        f"PostgreSQL backend CPU per charge, {charges} charges a round, one after another"
        " (median of the rounds; the difference to bare; the rounds):"
    ]
    for name, costs in figures.items():
        median = statistics.median(costs)
        against = "" if name == "bare" else f"{median - bare:+7.0f}"
        rounds = ", ".join(f"{cost:.0f}" for cost in costs)
        lines.append(f"  {name:40s} {median:7.0f} us {against:>8s}   ({rounds})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds after the warm-up")
    parser.add_argument("--charges", type=int, default=1500, help="charges a round, per variant")
    args = parser.parse_args()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def run(admin_url: str) -> dict[str, list[float]]:
        return await measure(admin_url, args.rounds, args.charges, progress)

    if admin_url := os.environ.get("DATABASE_URL"):
        figures = event_loop.run(run(admin_url))
    else:
        with PostgresServer() as server:
            figures = event_loop.run(run(server.url))
    print(report(figures, args.charges))


if __name__ == "__main__":
    main()
