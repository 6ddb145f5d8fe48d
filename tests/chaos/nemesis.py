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

import httpx

from tests.chaos.cluster import Cluster

Act = Callable[[Cluster, random.Random], Awaitable[None]]


@dataclass(frozen=True)
class Nemesis:
    name: str
    period_s: float
    act: Act


async def run(nemesis: Nemesis, cluster: Cluster, rng: random.Random, stop: asyncio.Event) -> None:
    """Act soon after the start (while the work is flowing), then every period."""
    wait = nemesis.period_s * rng.uniform(0.1, 0.3)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait)
        if not stop.is_set():
            await nemesis.act(cluster, rng)
            cluster.chronicle.attacks[nemesis.name] += 1
        wait = nemesis.period_s * rng.uniform(0.5, 1.5)


async def kill_worker(cluster: Cluster, rng: random.Random) -> None:
    cluster.kill(rng.randrange(len(cluster.workers)))


async def restart_nats(cluster: Cluster, rng: random.Random) -> None:
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    cluster.chronicle("nemesis", f"nats-server restart ({sig.name})")
    await asyncio.to_thread(cluster.servers.nats.restart, sig)
    _ended(cluster, f"nats-server {sig.name}")


async def crash_postgres(cluster: Cluster, rng: random.Random) -> None:
    """Immediate shutdown (SIGQUIT: no checkpoint, crash recovery at start), then start."""
    cluster.chronicle("nemesis", "postgres immediate stop + start")
    await asyncio.to_thread(cluster.servers.pg.restart, signal.SIGQUIT)
    _ended(cluster, "postgres immediate stop")


async def pause_postgres(cluster: Cluster, rng: random.Random) -> None:
    seconds = rng.uniform(1.0, 4.0)
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
    cluster.proxies["nats"].latency(1.5)
    try:
        await asyncio.sleep(seconds)
    finally:
        cluster.proxies["nats"].pass_through()


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


def _ended(cluster: Cluster, what: str) -> None:
    cluster.chronicle.outages.append((what, time.time()))
    cluster.chronicle("nemesis", f"{what}: over")


KILL_WORKER = Nemesis("kill -9 worker", 2.0, kill_worker)
RESTART_NATS = Nemesis("nats-server restart", 6.0, restart_nats)
CRASH_POSTGRES = Nemesis("postgres crash", 8.0, crash_postgres)
PAUSE_POSTGRES = Nemesis("postgres SIGSTOP", 6.0, pause_postgres)
NETWORK = Nemesis("proxy faults", 3.0, network_fault)
NATS_LATENCY = Nemesis("nats latency", 4.0, nats_latency)
LOST_ANSWERS = Nemesis("gateway lost answers", 3.0, flip_lost_answers)
