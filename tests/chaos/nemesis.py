"""Nemeses: seeded fault loops, each action written to the chronicle with its time.

Each runs `act` every `period_s` (with ±50 % jitter) until told to stop; an action that
makes something unavailable (a paused server, a blackholed proxy) also undoes it before it
returns, and `Cluster.heal()` undoes anything left when the faults stop. Blocking server
operations run in a thread so the harness's own loop keeps turning.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
import httpx
import nats.errors
from nats.js.api import ConsumerInfo, StreamInfo

from charge_worker.sandbox.nats_cluster import NatsCluster
from tests.chaos.cluster import Cluster, connect_direct

Act = Callable[[Cluster, random.Random], Awaitable[None]]
PARTITION_MIN_S = 10.0  # nats-server's Raft elections time out after 4-9 s


@dataclass(frozen=True)
class Nemesis:
    name: str
    period_s: float
    act: Act
    at_most: int | None = None  # strikes in one run (a failover consumes the standby)


async def run(nemesis: Nemesis, cluster: Cluster, rng: random.Random, stop: asyncio.Event) -> None:
    """Act soon after the start (while the work is flowing), then every period."""
    wait = nemesis.period_s * rng.uniform(0.1, 0.3)
    while not stop.is_set() and cluster.chronicle.attacks[nemesis.name] < (nemesis.at_most or 1e9):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        if not stop.is_set():
            cluster.chronicle.first_fault = cluster.chronicle.first_fault or time.time()
            try:
                await nemesis.act(cluster, rng)
            except Exception as error:  # the run gathers its nemeses quietly: say it here
                cluster.chronicle("nemesis", f"{nemesis.name} failed: {error!r}")
                raise
            cluster.chronicle.attacks[nemesis.name] += 1
        wait = nemesis.period_s * rng.uniform(0.5, 1.5)


async def kill_worker(cluster: Cluster, rng: random.Random) -> None:
    cluster.kill(rng.randrange(len(cluster.workers)))


async def restart_nats(cluster: Cluster, rng: random.Random) -> None:
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    nats = cluster.servers.nats
    if isinstance(nats, NatsCluster):  # one of the cluster's servers
        name = rng.choice(sorted(nats.nodes))
        cluster.chronicle("nemesis", f"nats-server {name} restart ({sig.name})")
        await asyncio.to_thread(nats.kill, name, sig)
        await asyncio.to_thread(nats.restart, name)
    else:
        cluster.chronicle("nemesis", f"nats-server restart ({sig.name})")
        await asyncio.to_thread(nats.restart, sig)
    _ended(cluster, f"nats-server {sig.name}")


async def crash_postgres(cluster: Cluster, rng: random.Random) -> None:
    """Immediate shutdown (SIGQUIT: no checkpoint, crash recovery at start), then start."""
    async with cluster.postgres_faults:
        cluster.chronicle("nemesis", "postgres immediate stop + start")
        await asyncio.to_thread(cluster.servers.pg.restart, signal.SIGQUIT)
        _ended(cluster, "postgres immediate stop")


async def pause_postgres(cluster: Cluster, rng: random.Random) -> None:
    seconds = rng.uniform(1.0, 4.0)
    async with cluster.postgres_faults:  # not between a crash's stop and start
        cluster.chronicle("nemesis", f"postgres SIGSTOP for {seconds:.1f}s")
        cluster.servers.pg.pause()
        try:
            await asyncio.sleep(seconds)
        finally:
            cluster.servers.pg.resume()
        _ended(cluster, "postgres SIGSTOP")


async def network_fault(cluster: Cluster, rng: random.Random) -> None:
    """Latency, a blackhole or resets on one proxy (NATS, PostgreSQL or the gateway)."""
    target = rng.choice(sorted(cluster.proxies))
    proxy = cluster.proxies[target]
    mode = rng.choice(["latency", "blackhole", "reset"])
    seconds = rng.uniform(0.5, 3.0)
    cluster.chronicle("nemesis", f"{target} proxy: {mode} for {seconds:.1f}s")
    if mode == "latency":
        proxy.latency(rng.uniform(0.2, 1.5))
    elif mode == "blackhole":
        proxy.blackhole()
    else:
        proxy.reset()
    try:
        await asyncio.sleep(seconds)
    finally:
        proxy.pass_through()
    _ended(cluster, f"{target} {mode}")


async def nats_latency(cluster: Cluster, rng: random.Random) -> None:
    """Heartbeats and acks late by more than ack_wait: redelivery while still processing."""
    seconds = rng.uniform(1.0, 3.0)
    cluster.chronicle("nemesis", f"nats proxy: 1.5 s latency for {seconds:.1f}s")
    for proxy in cluster.nats_proxies():
        proxy.latency(1.5)
    try:
        await asyncio.sleep(seconds)
    finally:
        for proxy in cluster.nats_proxies():
            proxy.pass_through()


async def cut_heartbeats(cluster: Cluster, rng: random.Random) -> None:
    """Every NATS proxy blackholed for longer than ack_wait while gateway calls go on (the
    gateway proxy passes): no heartbeat, no ack, so JetStream redelivers what the workers
    are still charging, to whichever worker fetches first once the cut heals."""
    ack_wait = cluster.settings.shortest_ack_wait_s
    seconds = rng.uniform(1.5 * ack_wait, 2.5 * ack_wait)
    before = await _gateway_requests(cluster)
    for _ in range(20):  # mid-call: not before the gateway's requests are flowing
        await asyncio.sleep(0.5)
        if (now := await _gateway_requests(cluster)) > before:
            before = now
            break
    cluster.chronicle(
        "nemesis", f"nats proxy: blackhole for {seconds:.1f}s (ack_wait {ack_wait:g}s)"
    )
    for proxy in cluster.nats_proxies():
        proxy.blackhole()
    try:
        await asyncio.sleep(seconds)
    finally:
        for proxy in cluster.nats_proxies():
            proxy.pass_through()
    during = await _gateway_requests(cluster) - before
    figures = cluster.chronicle.figures
    figures["gateway_requests_during_cuts"] = (
        figures.get("gateway_requests_during_cuts", 0) + during
    )
    _ended(cluster, f"heartbeats cut ({during} gateway requests meanwhile)")


async def _gateway_requests(cluster: Cluster) -> int:
    """Requests the gateway simulator has answered or is answering, so far."""
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{cluster.gateway.url}/_sim/stats")
        response.raise_for_status()
        return int(response.json()["requests"])


async def flip_lost_answers(cluster: Cluster, rng: random.Random) -> None:
    """Alternate the gateway between losing 30 % of answers by timeout and 10 % by 5xx."""
    mode = rng.choice(["timeout", "5xx"])
    rate = 0.3 if mode == "timeout" else 0.1
    cluster.chronicle("nemesis", f"gateway loses {rate:.0%} of answers after commit ({mode})")
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{cluster.gateway.url}/_sim/config",
            json={"lost_answer_rate": rate, "lost_answer_mode": mode},
        )
        response.raise_for_status()


def _nodes(cluster: Cluster) -> NatsCluster:
    nats = cluster.servers.nats
    assert isinstance(nats, NatsCluster), "a cluster nemesis needs the cluster shape"
    return nats


async def _leader(cluster: Cluster, of: str) -> str | None:
    """The server leading the stream's (or the consumer's) replica group, as JetStream says."""
    cfg = cluster.direct_nats
    for _ in range(20):  # right after an election the info calls answer 503 for a moment
        nc = await connect_direct(cluster)
        try:
            js = nc.jetstream()
            if of == "stream":
                info: StreamInfo | ConsumerInfo = await js.stream_info(cfg.stream)
            else:
                info = await js.consumer_info(cfg.stream, cfg.durable)
            if info.cluster is not None and info.cluster.leader:
                return info.cluster.leader
        except (nats.errors.Error, TimeoutError):
            pass
        finally:
            await nc.close()
        await asyncio.sleep(0.5)
    return None


async def _kill_leader(cluster: Cluster, rng: random.Random, of: str) -> None:
    """kill -9 the leader; it stays down while the other two carry on, then restarts."""
    nodes = _nodes(cluster)
    leader = await _leader(cluster, of)
    if leader is None:
        cluster.chronicle("nemesis", f"no {of} leader to kill (an election under way)")
        return
    down_s = rng.uniform(2.0, 6.0)
    cluster.chronicle("nemesis", f"kill -9 the {of} leader {leader}, down {down_s:.1f}s")
    await asyncio.to_thread(nodes.kill, leader, signal.SIGKILL)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(nodes.restart, leader)
    _ended(cluster, f"{of} leader {leader} killed")


async def kill_stream_leader(cluster: Cluster, rng: random.Random) -> None:
    await _kill_leader(cluster, rng, "stream")


async def kill_consumer_leader(cluster: Cluster, rng: random.Random) -> None:
    await _kill_leader(cluster, rng, "consumer")


async def rolling_restart(cluster: Cluster, rng: random.Random) -> None:
    """An upgrade: each server in turn stopped (SIGTERM), started, and waited for."""
    nodes = _nodes(cluster)
    for name in nodes.nodes:
        cluster.chronicle("nemesis", f"rolling restart: {name}")
        await asyncio.to_thread(nodes.kill, name, signal.SIGTERM)
        await asyncio.to_thread(nodes.restart, name)
    _ended(cluster, "rolling restart")


async def partition(cluster: Cluster, rng: random.Random) -> None:
    """One server cut from the other two for longer than an election can take."""
    nodes = _nodes(cluster)
    name = rng.choice(sorted(nodes.nodes))
    seconds = rng.uniform(PARTITION_MIN_S, PARTITION_MIN_S + 4.0)
    cluster.chronicle("nemesis", f"partition {name} from its peers for {seconds:.1f}s")
    nodes.isolate(name)
    try:
        await asyncio.sleep(seconds)
    finally:
        nodes.heal()
    await asyncio.to_thread(nodes.wait_ready)
    _ended(cluster, f"partition of {name}")


async def failover(cluster: Cluster, rng: random.Random) -> None:
    """WAL shipping held while charges flow, then the primary's machine dies and the
    standby is promoted; the database address is re-pointed to it. What the primary
    committed while shipping was held is gone (an asynchronous standby) or was never
    acknowledged (a synchronous one: commits wait for the standby)."""
    servers = cluster.servers
    if servers.standby is None:
        return
    held_s = rng.uniform(2.0, 4.0)
    cluster.chronicle("nemesis", f"postgres: WAL shipping held {held_s:.1f}s, charges flowing")
    servers.pg.hold_replication()
    await asyncio.sleep(held_s)
    before = await _ledger_states(cluster.database_url)
    cluster.chronicle("nemesis", "kill -9 the primary, promote the standby, re-point")
    promoted = await asyncio.to_thread(servers.failover)
    cluster.proxies["postgres"].retarget(promoted.port)
    after = await _ledger_states(cluster.database_url)
    lost = sum(1 for key, state in before.items() if after.get(key) != state)
    cluster.chronicle.figures["commits_lost"] = lost
    cluster.chronicle("nemesis", f"failover done: {lost} ledger row(s) lost their last commit")
    _ended(cluster, "postgres failover")


async def _ledger_states(database_url: str) -> dict[str, tuple[str, int, int]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT idempotency_key, status, attempt, gateway_calls FROM charge_attempts"
        )
    finally:
        await conn.close()
    return {r["idempotency_key"]: (r["status"], r["attempt"], r["gateway_calls"]) for r in rows}


def _ended(cluster: Cluster, what: str) -> None:
    cluster.chronicle.outages.append((what, time.time()))
    cluster.chronicle("nemesis", f"{what}: over")


KILL_WORKER = Nemesis("kill -9 worker", 2.0, kill_worker)
RESTART_NATS = Nemesis("nats-server restart", 6.0, restart_nats)
CRASH_POSTGRES = Nemesis("postgres crash", 8.0, crash_postgres)
PAUSE_POSTGRES = Nemesis("postgres SIGSTOP", 6.0, pause_postgres)
NETWORK = Nemesis("proxy faults", 3.0, network_fault)
NATS_LATENCY = Nemesis("nats latency", 4.0, nats_latency)
HEARTBEATS_CUT = Nemesis("heartbeats cut", 8.0, cut_heartbeats)
LOST_ANSWERS = Nemesis("gateway lost answers", 3.0, flip_lost_answers)
KILL_STREAM_LEADER = Nemesis("kill -9 stream leader", 12.0, kill_stream_leader)
KILL_CONSUMER_LEADER = Nemesis("kill -9 consumer leader", 12.0, kill_consumer_leader)
ROLLING_RESTART = Nemesis("rolling restart", 20.0, rolling_restart)
PARTITION = Nemesis("partition one server", 20.0, partition)
FAILOVER = Nemesis("postgres failover", 40.0, failover, at_most=1)  # strikes 4-12 s in
