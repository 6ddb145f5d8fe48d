"""How far behind the charges are: the oldest due charge not yet settled.

Not yet charged: rows `scheduled` or `pending` (migration 0001; `ledger.py`). No index is
keyed by `due_at`, so the question reads the open rows through the partial index that holds
exactly them (`charge_attempts_open_idx`): a cost of the open rows, few in steady state, not
of the ledger. Not a backlog: `processing` (the gateway took the charge; a bank debit may
take days to settle, and its webhook or reconcile's lookup ends it), `retry_scheduled` and
`action_required` (waiting for a time or a person, by design).
"""

from __future__ import annotations

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from charge_worker.database import translated

# seconds since the oldest open row's due_at, on the database's clock; 0 when none is open
# or none names its due time
_OLDEST_DUE = """
SELECT coalesce(extract(epoch FROM now() - min(due_at)), 0)::float8
  FROM charge_attempts WHERE status IN ('scheduled', 'pending')
"""


async def oldest_due_s(conn: asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]) -> float:
    """Seconds since the oldest due charge not yet charged was due (0: none); never negative (a
    charge due in the future is not late)."""
    async with translated("ledger"):
        seconds: float = await conn.fetchval(_OLDEST_DUE)
    return max(seconds, 0.0)
