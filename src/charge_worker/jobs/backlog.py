"""How far behind the charges are: the oldest due charge not yet settled.

Open rows are `scheduled`, `pending` and `processing` (migrations 0001, 0010; `ledger.py`).
No index is keyed by `due_at`, so each half of the question reads its open rows through the
partial index that holds exactly them (`charge_attempts_open_idx`,
`charge_attempts_processing_idx`): a cost of the open rows, few in steady state, not of the
ledger. `retry_scheduled` and `action_required` periods wait for a time or a person, by
design: not a backlog.
"""

from __future__ import annotations

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from charge_worker.database import translated

# seconds since the oldest open row's due_at, on the database's clock; 0 when none is open
# or none names its due time
_OLDEST_DUE = """
SELECT coalesce(extract(epoch FROM now() - least(
    (SELECT min(due_at) FROM charge_attempts WHERE status IN ('scheduled', 'pending')),
    (SELECT min(due_at) FROM charge_attempts WHERE status = 'processing'))), 0)::float8
"""


async def oldest_due_s(conn: asyncpg.Connection | PoolConnectionProxy[asyncpg.Record]) -> float:
    """Seconds since the oldest due charge still open was due (0: none); never negative (a
    charge due in the future is not late)."""
    async with translated("ledger"):
        seconds: float = await conn.fetchval(_OLDEST_DUE)
    return max(seconds, 0.0)
