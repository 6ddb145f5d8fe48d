"""One request rate for the whole fleet at the gateway: a token bucket in PostgreSQL.

Payment providers cap requests per account (Stripe: 100 per second in live mode). At
month start every pod at full concurrency would find that cap as a 429 storm; instead the
workers and reconcile share one bucket (`CHARGE_WORKER_GATEWAY_RATE_LIMIT`, requests per
second for the fleet), in the database they already use: a row refilled at the rate, up
to one second's worth, taken from in one statement.

A process takes tokens in small batches and keeps them for at most `KEEP_S`: tokens kept
longer would add up to a burst above the rate. The worker reserves tokens before it
fetches (`reserve`), so a message it cannot send stays in the stream and spends no
delivery; every gateway request then spends one (`spend`), waiting when there is none.
Off (rate 0), both cost nothing.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from charge_worker.database import translated

KEEP_S = 1.0  # a token taken is used within this, or dropped
BUCKET = "gateway"

# Refill by the time elapsed, up to one second's worth (at least one token), and take what
# is there up to what is wanted: one row, one statement. $1 bucket, $2 rate per second, $3
# tokens wanted, $4 the bucket's size.
_TAKE = """
INSERT INTO rate_buckets AS b (name, tokens, updated_at, granted)
VALUES ($1, $4 - least($3, floor($4)), now(), least($3, floor($4)))
ON CONFLICT (name) DO UPDATE
   SET tokens = least($4, b.tokens + extract(epoch FROM now() - b.updated_at) * $2)
                - least($3, floor(least($4, b.tokens
                        + extract(epoch FROM now() - b.updated_at) * $2))),
       granted = least($3, floor(least($4, b.tokens
                        + extract(epoch FROM now() - b.updated_at) * $2))),
       updated_at = now()
RETURNING granted
"""


class RateLimiter:
    """The fleet's gateway rate, as seen from one process."""

    def __init__(self, pool: asyncpg.Pool | None, *, rate_per_s: float) -> None:
        self.pool = pool
        self.rate = rate_per_s
        self.tokens = 0
        self.taken_at = 0.0
        self.lock = asyncio.Lock()

    @property
    def on(self) -> bool:
        return self.rate > 0 and self.pool is not None

    async def reserve(self, wanted: int) -> int:
        """Up to `wanted` tokens held for this process now (0 when the fleet used them
        all); without a limit, `wanted`."""
        if not self.on:
            return wanted
        async with self.lock:
            self._expire()
            if self.tokens < wanted:
                self.tokens += await self._take(wanted - self.tokens)
                self.taken_at = time.monotonic()
            return min(self.tokens, wanted)

    async def spend(self) -> None:
        """Take one token for a gateway request, waiting for the bucket to refill."""
        if not self.on:
            return
        while True:
            async with self.lock:
                self._expire()
                if self.tokens == 0:
                    self.tokens = await self._take(1)
                    self.taken_at = time.monotonic()
                if self.tokens > 0:
                    self.tokens -= 1
                    return
            await asyncio.sleep(1.0 / self.rate)

    def _expire(self) -> None:
        if self.tokens and time.monotonic() - self.taken_at > KEEP_S:
            self.tokens = 0

    async def _take(self, wanted: int) -> int:
        assert self.pool is not None
        async with translated("rate limit"):
            granted = await self.pool.fetchval(
                _TAKE, BUCKET, self.rate, wanted, max(self.rate, 1.0)
            )
        return int(granted or 0)
