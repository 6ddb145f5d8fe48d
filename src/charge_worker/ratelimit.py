"""One request rate for the whole fleet at the gateway: a token bucket in PostgreSQL.

Payment providers cap requests per account (Stripe: 100 per second in live mode). At
month start every pod at full concurrency would find that cap as a 429 storm; instead the
workers and reconcile share one bucket (`CHARGE_WORKER_GATEWAY_RATE_LIMIT`, requests per
second for the fleet), in the database they already use: a row refilled at the rate and
taken from in one statement.

The bucket holds only `BURST_S` worth of tokens (at least one): in any second the fleet
sends at most the rate plus that, so a provider's own one-second bucket never runs dry
(a bucket of one second's worth lets a lull be followed by up to twice the rate in one
second, which a provider answers with 429s). A gateway request spends one token
(`spend`); the waiting requests of a process queue behind one lock, and the one in front
takes a batch for those queued (never more than the bucket holds), or sleeps for the time
a batch takes to refill. While a request of the process waits, `reserve` lets the consumer
fetch nothing: messages wait in the stream and spend no delivery. Off (rate 0), both cost
nothing.
"""

from __future__ import annotations

import asyncio
import math
import time

import asyncpg

from charge_worker.database import translated

BURST_S = 0.025  # the bucket holds this much of a second's rate
KEEP_S = 0.05  # a token taken and not spent by then (its request went away) is dropped
BUCKET = "gateway"

# Refill by the time elapsed, up to the bucket's size, and take what is there up to what
# is wanted: one row, one statement. $1 bucket, $2 rate per second, $3 tokens wanted, $4 the
# bucket's size. clock_timestamp(), not now(): a statement that waited for the row's lock
# must not count time from before the one it waited for.
_TAKE = """
INSERT INTO rate_buckets AS b (name, tokens, updated_at, granted)
VALUES ($1, $4::int - least($3::int, $4::int), clock_timestamp(), least($3::int, $4::int))
ON CONFLICT (name) DO UPDATE
   SET tokens = least($4::int, b.tokens + greatest(0, extract(epoch FROM clock_timestamp()
                                 - b.updated_at)) * $2::float8)
                - least($3::int, floor(least($4::int, b.tokens + greatest(0, extract(epoch
                        FROM clock_timestamp() - b.updated_at)) * $2::float8))),
       granted = least($3::int, floor(least($4::int, b.tokens + greatest(0, extract(epoch
                         FROM clock_timestamp() - b.updated_at)) * $2::float8))),
       updated_at = clock_timestamp()
RETURNING granted
"""


class RateLimiter:
    """The fleet's gateway rate, as seen from one process."""

    def __init__(self, pool: asyncpg.Pool | None, *, rate_per_s: float) -> None:
        self.pool = pool
        self.rate = rate_per_s
        self.capacity = max(1, math.ceil(rate_per_s * BURST_S))
        self.tokens = 0
        self.taken_at = 0.0
        self.waiting = 0
        self.lock = asyncio.Lock()

    @property
    def on(self) -> bool:
        return self.rate > 0 and self.pool is not None

    async def reserve(self, wanted: int) -> int:
        """How many messages to fetch now: none while a request of this process waits for
        a token, else `wanted`."""
        return 0 if self.on and self.waiting else wanted

    async def spend(self) -> None:
        """Take one token for a gateway request, waiting for the bucket to refill."""
        if not self.on:
            return
        self.waiting += 1
        try:
            async with self.lock:
                while True:
                    if self.tokens and time.monotonic() - self.taken_at > KEEP_S:
                        self.tokens = 0
                    if self.tokens == 0:
                        self.tokens = await self._take(min(self.waiting, self.capacity))
                        self.taken_at = time.monotonic()
                    if self.tokens > 0:
                        self.tokens -= 1
                        return
                    await asyncio.sleep(self.capacity / self.rate)
        finally:
            self.waiting -= 1

    async def _take(self, wanted: int) -> int:
        assert self.pool is not None
        async with translated("rate limit"):
            granted = await self.pool.fetchval(_TAKE, BUCKET, self.rate, wanted, self.capacity)
        return int(granted or 0)
