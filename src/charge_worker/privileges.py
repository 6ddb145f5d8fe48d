"""The PostgreSQL privileges each command needs on our tables, and the check of them.

Every command but `migrate` and `maintain` runs as a least-privilege role (`DATABASE_URL`):
`webhooks`, the internet-facing receiver, as a role of its own granted exactly `WEBHOOKS`;
the others as the worker role, granted exactly what the other lists name. The
"PostgreSQL roles" section of docs/deploying.md has the GRANT statements, and nothing
more. A grant left out does not stop a command from starting: it fails the first
statement that needs it, which may be deep into a run (a delivery journaled by nobody, a
refund made but not recorded). So the long-running commands check in `/readyz`
(`not_granted`, which names the table) and a CronJob at its start (`require`, one line
naming the privilege).

A table that does not exist yet (the migrations have not run) counts as missing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import asyncpg

from charge_worker.database import PROBE_TIMEOUT_S, translated
from charge_worker.errors import DependencyUnavailable, SettingsError

# per requirement: granted, NULL when the table (or its serial sequence) does not exist
_CHECK = """
SELECT CASE WHEN to_regclass(n.relation) IS NULL THEN NULL
            WHEN n.serial = '' THEN has_table_privilege(n.relation, n.privilege)
            ELSE has_sequence_privilege(pg_get_serial_sequence(n.relation, n.serial), 'USAGE')
       END AS granted
  FROM unnest($1::text[], $2::text[], $3::text[])
       WITH ORDINALITY AS n(relation, privilege, serial, i)
 ORDER BY n.i
"""


@dataclass(frozen=True)
class Grant:
    """`privileges` on `table`; with `serial`, USAGE on the sequence behind that column too
    (an INSERT takes its default from it)."""

    table: str
    privileges: tuple[str, ...]
    serial: str = ""

    def requirements(self) -> list[tuple[str, str, str]]:
        """(table, privilege, serial column) rows, the sequence's last."""
        rows = [(self.table, privilege, "") for privilege in self.privileges]
        if self.serial:
            rows.append((self.table, "USAGE", self.serial))
        return rows


@dataclass(frozen=True)
class Needs:
    """What one command needs."""

    command: str
    grants: tuple[Grant, ...]


_EVENTS = Grant("charge_events", ("INSERT",), serial="id")  # the append-only story
_RATE = Grant("rate_buckets", ("SELECT", "INSERT", "UPDATE"))  # the fleet's gateway rate
# each real run of produce and reconcile recorded at its end (jobs/runs.py; maintain, the
# schema owner, records its own and prunes them)
_RUN_RECORD = Grant("job_runs", ("INSERT",))

RUN = Needs(
    "run",
    (
        Grant("charge_attempts", ("SELECT", "INSERT", "UPDATE")),
        Grant("deferred_scoring_checks", ("SELECT", "INSERT", "UPDATE")),
        _EVENTS,
        _RATE,
        # the relay takes, marks and prunes the outcome events; the ledger row's triggers
        # write them as the schema owner, so no role needs INSERT
        Grant("charge_outcomes", ("SELECT", "UPDATE", "DELETE")),
        # the jobs' latest runs, exported as gauges (jobs/exporter.py)
        Grant("job_runs", ("SELECT",)),
        # each pod's own row: its breakers, in flight, pause seen (worker/presence.py)
        Grant("worker_pods", ("SELECT", "INSERT", "UPDATE")),
    ),
)
# CHARGE_WORKER_VERIFY_SUBSCRIPTION=match: the claim reads the message's subscription
RUN_VERIFYING = Needs("run", (*RUN.grants, Grant("subscriptions", ("SELECT",))))
WEBHOOKS = Needs(
    "webhooks",
    (
        Grant("webhook_inbox", ("SELECT", "INSERT", "UPDATE", "DELETE"), serial="id"),
        Grant("charge_attempts", ("SELECT", "UPDATE")),
        # a charge a webhook shows made with no verdict kept is checked after the fact
        Grant("deferred_scoring_checks", ("SELECT", "INSERT")),
        _EVENTS,
        # its re-fetches and lookups spend the fleet's gateway rate too (serve.py)
        _RATE,
    ),
)
# starting a declined period's next try archives the try before (retries/starts.py)
_TRIES = Grant("charge_tries", ("SELECT", "INSERT"))
PRODUCE = Needs(
    "produce",
    (
        Grant("subscriptions", ("SELECT", "UPDATE")),
        # its rows tell the charge's `scheduled` and `published` (events.py): no event row
        Grant("charge_attempts", ("SELECT", "INSERT", "UPDATE")),
        _TRIES,
        _RUN_RECORD,
    ),
)
# `charge-worker retry`: one period's next try, started and published now
RETRY = Needs("retry", (Grant("charge_attempts", ("SELECT", "UPDATE")), _TRIES))
RECONCILE = Needs(
    "reconcile",
    (
        # INSERT: a charge whose row a failover lost is recorded from its subscription
        Grant("charge_attempts", ("SELECT", "INSERT", "UPDATE")),
        Grant("subscriptions", ("SELECT",)),
        Grant("charge_events", ("SELECT", "INSERT"), serial="id"),
        # a charge it finds made with no verdict kept is checked after the fact
        Grant("deferred_scoring_checks", ("SELECT", "INSERT")),
        # how far the gateway's history is reconciled, and the keys to look at again
        Grant("reconcile_checkpoint", ("SELECT", "INSERT", "UPDATE")),
        Grant("reconcile_followups", ("SELECT", "INSERT", "UPDATE", "DELETE")),
        _RATE,
        # a period's earlier tries: their keys and charges
        Grant("charge_tries", ("SELECT",)),
        _RUN_RECORD,
        # findings a person has reviewed: counted apart by each run, written by `resolve`
        Grant("reconcile_reviews", ("SELECT", "INSERT")),
    ),
)
# `charge-worker reconcile resolve`: a person's review of a key's findings, and its event
RESOLVE = Needs(
    "reconcile resolve",
    (
        Grant("charge_attempts", ("SELECT",)),
        Grant("charge_events", ("SELECT", "INSERT"), serial="id"),
        Grant("reconcile_reviews", ("SELECT", "INSERT")),
    ),
)
EXPLAIN = Needs(
    "explain",
    (
        Grant("charge_attempts", ("SELECT",)),
        Grant("deferred_scoring_checks", ("SELECT",)),
        Grant("charge_events", ("SELECT",)),
        Grant("charge_outcomes", ("SELECT",)),
        Grant("charge_tries", ("SELECT",)),
    ),
)
# `charge-worker status`: it reads the jobs' runs, the open due charges, the outbox's
# oldest unsent event, the deferred checks pending and the worker pods' rows; it writes
# nothing
STATUS = Needs(
    "status",
    (
        Grant("charge_attempts", ("SELECT",)),
        Grant("job_runs", ("SELECT",)),
        Grant("charge_outcomes", ("SELECT",)),
        Grant("deferred_scoring_checks", ("SELECT",)),
        Grant("worker_pods", ("SELECT",)),
    ),
)
EVERY_COMMAND = (RUN, WEBHOOKS, PRODUCE, RETRY, RECONCILE, RESOLVE, EXPLAIN, STATUS)


def _describe(table: str, privilege: str, serial: str, granted: bool | None) -> str:
    if granted is None:
        return f"table {table} (it does not exist: run charge-worker migrate)"
    if serial:
        return f"USAGE on the sequence of {table}.{serial}"
    return f"{privilege} on {table}"


async def missing(db: asyncpg.Pool | asyncpg.Connection, needs: Needs) -> list[str]:
    """What the connected role lacks of `needs`, each naming its table; empty when nothing."""
    rows = [row for grant in needs.grants for row in grant.requirements()]
    columns = [list(column) for column in zip(*rows, strict=True)]
    async with translated("privileges"):
        granted = [record["granted"] for record in await db.fetch(_CHECK, *columns)]
    found = [_describe(*row, ok) for row, ok in zip(rows, granted, strict=True) if ok is not True]
    return list(dict.fromkeys(found))  # a missing table once, not once per privilege


async def not_granted(pool: asyncpg.Pool, needs: Needs) -> str | None:
    """For `/readyz`: why this role cannot do its work (naming the table), or why PostgreSQL
    does not answer within seconds; None when it answers and everything is granted."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            lacking = await missing(pool, needs)
    except (TimeoutError, DependencyUnavailable) as error:
        cause = error.__cause__ or error
        return f"PostgreSQL not answering: {type(cause).__name__}"
    if not lacking:
        return None
    return f"the database role lacks {'; '.join(lacking)}"


async def require(db: asyncpg.Pool | asyncpg.Connection, needs: Needs) -> None:
    """At a command's start: `SettingsError`, in one line naming what the role lacks."""
    lacking = await missing(db, needs)
    if lacking:
        raise SettingsError(
            f"DATABASE_URL: the role lacks {'; '.join(lacking)}, which `{needs.command}` "
            'needs (docs/deploying.md, "PostgreSQL roles", lists the grants)'
        )
