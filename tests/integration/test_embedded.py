"""The embedded servers the demo, the chaos suite and the benchmarks stand on.

A fault a test injects must be the fault it says: a paused PostgreSQL answers nothing on
any connection, a killed stream leader is replaced, a promoted standby has exactly the
commits that reached it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterator

import asyncpg
import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from charge_worker.sandbox.embedded import PostgresServer
from charge_worker.sandbox.nats_cluster import NatsCluster
from tests.support.harness import eventually

pytestmark = pytest.mark.slow


async def test_a_paused_postgres_answers_no_connection_old_or_new() -> None:
    with PostgresServer() as pg:
        conn = await asyncpg.connect(pg.url)
        try:
            pg.pause()
            with pytest.raises(TimeoutError):  # the backend of an open connection is frozen too
                await asyncio.wait_for(conn.fetchval("SELECT 1"), 2)
            pg.resume()
        finally:
            conn.terminate()


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    primary = PostgresServer().start()
    try:
        standby = PostgresServer.standby_of(primary).start()
        try:
            yield primary, standby
        finally:
            standby.stop()
    finally:
        primary.stop()


async def _rows(url: str) -> list[int]:
    conn = await asyncpg.connect(url)
    try:
        return [r["n"] for r in await conn.fetch("SELECT n FROM t ORDER BY n")]
    finally:
        await conn.close()


async def test_a_promoted_async_standby_lacks_what_never_reached_it(
    pair: tuple[PostgresServer, PostgresServer],
) -> None:
    primary, standby = pair
    conn = await asyncpg.connect(primary.url)
    await conn.execute("CREATE TABLE t (n int)")
    await conn.execute("INSERT INTO t SELECT generate_series(1, 10)")
    await eventually(lambda: _replicated(standby.url, 10), "the standby caught up")
    assert primary.walsenders(), "no walsender streams to the standby"
    primary.hold_replication()
    await conn.execute("INSERT INTO t SELECT generate_series(11, 20)")  # acked, not shipped
    conn.terminate()
    primary.terminate(signal.SIGKILL)
    standby.promote()
    assert await _rows(standby.url) == list(range(1, 11))


async def _replicated(url: str, count: int) -> bool:
    try:
        return len(await _rows(url)) == count
    except asyncpg.UndefinedTableError:
        return False


async def test_a_three_node_cluster_elects_a_new_stream_leader_when_one_is_killed() -> None:
    with NatsCluster() as cluster:
        nc = await nats.connect(servers=cluster.urls, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream()
            await js.add_stream(
                StreamConfig(name="R3", subjects=["r3.>"], storage=StorageType.FILE, num_replicas=3)
            )

            def published(payload: bytes) -> Callable[[], Awaitable[bool]]:
                async def once() -> bool:
                    try:
                        # a retried publish whose ack was lost is dropped as a duplicate
                        msg_id = {"Nats-Msg-Id": payload.decode()}
                        await js.publish("r3.a", payload, timeout=1, headers=msg_id)
                    except (nats.errors.Error, TimeoutError):
                        return False
                    return True

                return once

            # a new R3 stream answers once its first leader is elected: on a loaded
            # machine, after the add_stream call has returned
            await eventually(published(b"1"), "a publish to the new stream")
            info = await js.stream_info("R3")
            assert info.cluster is not None
            leader = info.cluster.leader
            assert leader in cluster.nodes
            assert len(info.cluster.replicas or []) == 2
            cluster.kill(str(leader))
            await eventually(published(b"2"), "a publish after the election")
            new = (await js.stream_info("R3")).cluster
            assert new is not None
            assert new.leader not in (None, leader)
            assert (await js.stream_info("R3")).state.messages == 2
        finally:
            await nc.close()


async def test_an_isolated_node_loses_its_routes_until_healed() -> None:
    with NatsCluster() as cluster:
        cluster.isolate("n3")

        def cut_off() -> bool:
            routes = cluster.nodes["n3"].monitor("/routez").get("num_routes")
            return routes == 0

        await eventually(cut_off, "n3 without routes")
        cluster.heal()
        await eventually(
            lambda: cluster.nodes["n3"].monitor("/routez").get("num_routes", 0) > 0,
            "n3 routed again",
        )
        await asyncio.to_thread(cluster.wait_ready)
