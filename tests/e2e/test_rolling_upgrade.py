"""A rolling upgrade while charges flow: the previous release's worker and the current one,
each a `charge-worker run` process, on the schema before and after the migrations under
review; every charge charged once, none lost.

The order is the chart's: the old schema and the old worker charging; the pre-upgrade hook
(`charge-worker migrate`) applies the new migrations while the old worker has a charge in
flight; the old worker goes on charging on the new schema; the new worker joins; the old one
is stopped (SIGTERM) while it holds a charge, drains and exits 0; the new one charges alone.
Due charges are published in a batch in each phase. (The new worker never meets the old
schema: the hook runs before any new pod starts.)

The previous release is the tree before the newest migration was added (the parent of the
commit that added the highest-numbered file in `migrations/`), so the schema change under
review always meets the code that predates it. To run it against a real release instead,
name its tag or commit: `CHARGE_WORKER_PREVIOUS_REV=v1.4.0 .venv/bin/python -m pytest -q
tests/e2e/test_rolling_upgrade.py`. A checkout without git history (a tarball) skips it;
CI runs on a clone.

The old release runs from `git archive` of its `src/` and `migrations/`, in a venv of its
own whose only entry is that tree (tests/support/previous_release.py). When it pinned the
same runtime dependencies as the current tree (`requirements/runtime.txt`, exported from
`uv.lock`), the venv reuses the packages installed now: the same versions, and the test stays
in seconds. After a dependency change the old pins are installed into its venv with
`pip install --require-hashes` from the index, as the old image did: slower (a download and
an install), and only in the release that changed them.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import asyncpg
import httpx
import pytest
from nats.aio.client import Client

from charge_worker.migrate import default_directory, discover, migrate
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    PERIOD,
    WorkerProcess,
    consumer_idle,
    due,
    eventually,
    gateway_charges,
    provisioned,
    publish,
    set_sim,
    settings_for,
)
from tests.support.previous_release import (
    NoHistory,
    PreviousRelease,
    PreviousWorkerProcess,
    materialise,
    previous_revision,
)

# a charge cut off is redelivered soon; a worker holds at most 4, so two share each batch
FAST = {
    "gateway_timeout_s": 2.0,
    "lease_s": 8.0,
    "ack_wait_s": 2.0,
    "backoff_s": (2.0, 4.0),
    "concurrency": 4,
}
# charges take this long at the gateway while a phase needs a worker mid-charge
IN_FLIGHT_S = 0.5
# every seventh order is declined for good (stolen_card, `hard`): never charged, `declined`
DECLINED_EVERY = 7
FINAL = ("succeeded", "declined")


@pytest.fixture
def previous(tmp_path: Path) -> PreviousRelease:
    try:
        rev = previous_revision()
    except NoHistory as reason:
        pytest.skip(f"no previous release to run: {reason}")
    return materialise(rev, tmp_path / "previous")


def customer(order_id: int) -> str:
    return f"cus_code_stolen_card_{order_id}" if order_id % DECLINED_EVERY == 0 else "cus_ok"


def key(order_id: int) -> str:
    return f"{order_id}:{PERIOD.isoformat()}"


class Flow:
    """The due charges published so far, and the ledger they must reach."""

    def __init__(self, conn: asyncpg.Connection, settings: Settings, nc: Client) -> None:
        self.conn, self.settings, self.js = conn, settings, nc.jetstream()
        self.published: list[int] = []

    async def batch(self, size: int) -> list[int]:
        start = len(self.published) + 1
        orders = list(range(start, start + size))
        for order_id in orders:
            await publish(self.js, self.settings.nats.subject, due(order_id, customer(order_id)))
        self.published += orders
        return orders

    async def settled(self, orders: list[int]) -> bool:
        count = await self.conn.fetchval(
            "SELECT count(*) FROM charge_attempts WHERE order_id = ANY($1) AND status = ANY($2)",
            orders,
            list(FINAL),
        )
        return bool(count == len(orders))

    async def held_by(self, worker: WorkerProcess, orders: list[int]) -> bool:
        """Whether `worker` holds the lease of one of `orders`: it is mid-charge."""
        owner = f"%:{worker.proc.pid}:%"
        return bool(
            await self.conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM charge_attempts"
                " WHERE order_id = ANY($1) AND lease_owner LIKE $2)",
                orders,
                owner,
            )
        )

    async def handled_by(self, orders: list[int]) -> set[str]:
        """The pids of the workers whose deliveries the story of `orders` records."""
        actors = await self.conn.fetch(
            "SELECT DISTINCT actor FROM charge_events WHERE kind = 'delivery'"
            " AND order_id = ANY($1)",
            orders,
        )
        return {row["actor"].split(":")[1] for row in actors}


async def ready(port: int) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    except httpx.TransportError:
        return False


async def test_old_and_new_workers_across_the_migration_charge_each_once(
    previous: PreviousRelease,
    nc: Client,
    nats_settings: NatsSettings,
    empty_database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(
        nats_settings, empty_database_url, gateway_sim.url, scoring_sim.url, **FAST
    )
    # the old schema, as the previous release's own migrate left it
    old_schema = previous.cli("migrate", settings=settings)
    assert old_schema.returncode == 0, old_schema.stderr
    await provisioned(nc, settings)
    conn = await asyncpg.connect(empty_database_url)
    try:
        flow = Flow(conn, settings, nc)

        # 1. the old worker on the old schema
        old_port = free_port()
        old = PreviousWorkerProcess(
            previous, settings, tmp_path / "old.log", CHARGE_WORKER_METRICS_PORT=str(old_port)
        )
        spawn.append(old)
        await eventually(lambda: ready(old_port), "the old worker ready")
        first = await flow.batch(8)
        await eventually(lambda: flow.settled(first), "the old schema's charges settled")

        # 2. the upgrade hook's migrate while the old worker has a charge at the gateway
        await set_sim(gateway_sim.url, latency={"fixed_s": IN_FLIGHT_S})
        during = await flow.batch(8)
        await eventually(lambda: flow.held_by(old, during), "the old worker mid-charge")
        applied = await migrate(empty_database_url)
        assert [m.version for m in applied] == [
            m.version for m in discover(default_directory()) if m.version not in previous.migrations
        ]
        await eventually(lambda: flow.settled(during), "the charges across the migration")
        await set_sim(gateway_sim.url, latency={"fixed_s": 0.0})

        # 3. the old worker alone on the new schema
        on_new = await flow.batch(8)
        await eventually(lambda: flow.settled(on_new), "the old worker's on the new schema")

        # 4. the new worker joins; the old one stops while it holds a charge
        new_port = free_port()
        new = WorkerProcess(
            settings, tmp_path / "new.log", CHARGE_WORKER_METRICS_PORT=str(new_port)
        )
        spawn.append(new)
        await eventually(lambda: ready(new_port), "the new worker ready")
        await set_sim(gateway_sim.url, latency={"fixed_s": IN_FLIGHT_S})
        shared = await flow.batch(16)
        await eventually(lambda: flow.held_by(old, shared), "the old worker mid-charge again")
        old.proc.send_signal(signal.SIGTERM)
        assert await old.exited() == 0
        await set_sim(gateway_sim.url, latency={"fixed_s": 0.0})

        # 5. the new worker alone
        last = await flow.batch(8)
        await eventually(lambda: flow.settled(flow.published), "every charge settled")
        await eventually(lambda: consumer_idle(nc, settings.nats), "nothing left to deliver")
        new.proc.send_signal(signal.SIGTERM)
        assert await new.exited() == 0

        # zero doubles, zero lost: each charged once at the gateway, as the ledger says
        charged = [n for n in flow.published if customer(n) == "cus_ok"]
        assert await gateway_charges(gateway_sim.url) == Counter({key(n): 1 for n in charged})
        rows = await conn.fetch("SELECT order_id, status FROM charge_attempts")
        statuses = {row["order_id"]: row["status"] for row in rows}
        assert statuses == {
            n: "succeeded" if customer(n) == "cus_ok" else "declined" for n in flow.published
        }
        dlq = await nc.jetstream().stream_info(settings.nats.dlq_stream)
        assert dlq.state.messages == 0
        # each release did charge in the phases only it ran in
        assert await flow.handled_by(first + during + on_new) == {str(old.proc.pid)}
        assert await flow.handled_by(last) == {str(new.proc.pid)}
    finally:
        await conn.close()
