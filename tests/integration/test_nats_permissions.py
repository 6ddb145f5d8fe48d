"""Each component's NATS user, exactly as docs/nats-permissions.md lists it, on a real
nats-server started with that block: each can do its job with charge-worker's own code, and
nothing outside its list (issue 34, item 3: whoever can publish to `charges.due` can move
money; issue 36: whoever can publish to `charges.outcome.>` can say a charge was made).

The names are charge-worker's defaults (the doc's), so each test has a server of its own.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import nats
import pytest
from nats.aio.client import Client

from charge_worker import dlq, streams
from charge_worker.admin.pause import pause, resume
from charge_worker.admin.status import gather
from charge_worker.reconcile.republisher import NatsRepublisher
from charge_worker.sandbox.embedded import NatsServer
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import due, eventually, running_worker, settings_for

DOC = Path(__file__).parents[2] / "docs" / "nats-permissions.md"
USERS = ("producer", "worker", "reconcile", "dlq", "provision")
# a succeeded charge's outcome event: only the worker's relay may publish there
OUTCOME_SUBJECT = "charges.outcome.succeeded"


def doc_config() -> str:
    """The doc's nats-server block, each user's password `<user>-password`."""
    text = DOC.read_text()
    match = re.search(r"```conf\n(.*?)```", text, flags=re.DOTALL)
    assert match, "docs/nats-permissions.md has no ```conf block"
    config = re.sub(
        r'user: (\w+), password: "…"', r'user: \1, password: "\1-password"', match.group(1)
    )
    assert re.findall(r"user: (\w+),", config) == list(USERS)
    return config


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer(config=doc_config()) as started:
        yield started


def settings_as(server: NatsServer, user: str) -> NatsSettings:
    """charge-worker's default stream, subject and consumer names, connecting as `user`."""
    return NatsSettings(url=f"nats://{user}:{user}-password@127.0.0.1:{server.port}")


class Connection:
    """A connection as `user`, with the errors the server sent it."""

    def __init__(self, nc: Client, errors: list[Exception]) -> None:
        self.nc = nc
        self.errors = errors

    def refused(self) -> list[str]:
        """The server's refusals, in nats-py's words (lowercased)."""
        said = [str(error).lower() for error in self.errors]
        return [line for line in said if "permissions violation" in line]


Connect = Callable[[str], Awaitable[Connection]]


@pytest.fixture
async def connect(server: NatsServer) -> AsyncIterator[Connect]:
    opened: list[Client] = []

    async def as_user(user: str) -> Connection:
        errors: list[Exception] = []

        async def on_error(error: Exception) -> None:
            errors.append(error)

        nc = await nats.connect(
            settings_as(server, user).url, error_cb=on_error, allow_reconnect=False
        )
        opened.append(nc)
        return Connection(nc, errors)

    yield as_user
    for nc in opened:
        await nc.close()


async def refused_publish(conn: Connection, subject: str) -> bool:
    """Publish to `subject` and wait for the server's answer: True when it was refused."""
    before = len(conn.refused())
    await conn.nc.publish(subject, b"{}")
    await conn.nc.flush()

    async def answered() -> bool:
        return len(conn.refused()) > before

    try:
        await eventually(answered, f"the server's refusal of {subject}", within_s=5)
    except AssertionError:
        return False
    return f'publish to "{subject.lower()}"' in conn.refused()[-1]  # nats-py lowercases it


async def test_the_producer_provisions_a_first_install_and_publishes_due_charges(
    server: NatsServer, connect: Connect
) -> None:
    cfg = settings_as(server, "producer")
    producer = await connect("producer")
    js = producer.nc.jetstream()
    report = await streams.provision(js, cfg)
    ack = await js.publish(cfg.subject, due(1), headers={"Nats-Msg-Id": "charge:1:2026-12"})
    assert report.created == [
        "stream CHARGES",
        "stream CHARGES_DLQ",
        "stream CHARGE_OUTCOMES",
        "consumer CHARGES/charges-worker",
    ]
    assert ack.seq == 1
    assert producer.refused() == []
    # it may not read the charges, nor write a dead letter or an outcome, nor wipe the queue
    assert await refused_publish(producer, cfg.dlq_subject)
    assert await refused_publish(producer, OUTCOME_SUBJECT)
    assert await refused_publish(producer, "$JS.API.STREAM.PURGE.CHARGES")
    assert await refused_publish(producer, "$JS.API.CONSUMER.MSG.NEXT.CHARGES.charges-worker")


async def test_the_worker_charges_dead_letters_and_reports_with_its_own_user(
    server: NatsServer,
    connect: Connect,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """The real worker, as `worker`: it provisions (the streams exist: info only), pulls,
    charges and acks a due charge, publishes its outcome event (the relay), dead-letters a
    poison body (publish to charges.dlq, then term), subscribes to the MAX_DELIVERIES
    advisory and reads the consumer's gauges; the server refuses it nothing."""
    provision = await connect("provision")
    await streams.provision(provision.nc.jetstream(), settings_as(server, "provision"))
    producer = await connect("producer")
    js = producer.nc.jetstream()
    settings = settings_for(
        settings_as(server, "worker"), database_url, gateway_sim.url, scoring_sim.url
    )
    async with running_worker(settings) as worker:
        await js.publish("charges.due", due(1))
        await js.publish("charges.due", b"not a charge")
        db = await asyncpg.connect(database_url)
        try:

            async def charged() -> bool:
                status = await db.fetchval("SELECT status FROM charge_attempts WHERE order_id = 1")
                return status == "succeeded"

            await eventually(charged, "the due charge made by the worker")

            async def relayed() -> bool:
                sent = await db.fetchval(
                    "SELECT sent_at IS NOT NULL AND stream_seq IS NOT NULL FROM charge_outcomes"
                    " WHERE order_id = 1 AND type = 'charge.succeeded'"
                )
                return bool(sent)

            await eventually(relayed, "the outcome event published and marked by the relay")
        finally:
            await db.close()
        stored = await provision.nc.jetstream().stream_info("CHARGE_OUTCOMES", subjects_filter=">")
        published = worker.metric("charge_worker_outbox_publishes_total", result="published")
        reader = await connect("dlq")
        async with dlq.opened(settings_as(server, "dlq")) as letters:

            async def dead_lettered() -> bool:
                return len(await letters.seqs(None)) == 1

            await eventually(dead_lettered, "the poison body dead-lettered")
        async with httpx.AsyncClient() as client:
            ready = await client.get(f"{worker.http_url}/readyz")
    assert (ready.status_code, ready.text) == (200, "ready")
    assert stored.state.subjects == {OUTCOME_SUBJECT: 1}
    assert published == 1
    assert worker.metric("charge_worker_outbox_publishes_total", result="failed") == 0
    assert reader.refused() == []
    log = server.log_path.read_text()
    assert "Violation" not in log, log


async def test_the_worker_cannot_publish_outside_its_list(
    server: NatsServer, connect: Connect
) -> None:
    worker = await connect("worker")
    for subject in (
        "payments.refund",
        "charges.anything",
        "$JS.API.STREAM.DELETE.CHARGES",
        "$JS.API.STREAM.PURGE.CHARGES",
        "$JS.API.STREAM.UPDATE.CHARGES",
        "$JS.API.CONSUMER.DELETE.CHARGES.charges-worker",
        "$JS.API.STREAM.MSG.DELETE.CHARGES_DLQ",
        # the outcome events: published, never taken back or rewritten
        "charges.outcome",
        "$JS.API.STREAM.DELETE.CHARGE_OUTCOMES",
        "$JS.API.STREAM.PURGE.CHARGE_OUTCOMES",
        "$JS.API.STREAM.UPDATE.CHARGE_OUTCOMES",
        "$JS.API.STREAM.MSG.DELETE.CHARGE_OUTCOMES",
    ):
        assert await refused_publish(worker, subject), subject
    # nor listen to what it does not need
    await worker.nc.subscribe("charges.due")
    await worker.nc.flush()
    await eventually(
        lambda: any('subscription to "charges.due"' in e for e in worker.refused()),
        "the server's refusal of the subscription",
    )


async def test_reconcile_sees_where_the_consumer_stands_and_republishes_nothing_else(
    server: NatsServer, connect: Connect
) -> None:
    provision = await connect("provision")
    await streams.provision(provision.nc.jetstream(), settings_as(server, "provision"))
    async with NatsRepublisher(settings_as(server, "reconcile")) as republisher:
        position = await republisher.position()
        seq = await republisher.republish(due(2), "charge:2:2026-12", traceparent=None)
    assert position.waiting(seq)
    reconcile = await connect("reconcile")
    assert await refused_publish(reconcile, "charges.dlq")
    assert await refused_publish(reconcile, OUTCOME_SUBJECT)
    assert await refused_publish(reconcile, "$JS.ACK.CHARGES.charges-worker.1.1.1.1.1")
    assert await refused_publish(reconcile, "$JS.API.CONSUMER.MSG.NEXT.CHARGES.charges-worker")


async def test_the_dlq_operator_replays_and_reads_status_but_cannot_forge_a_dead_letter(
    server: NatsServer, connect: Connect
) -> None:
    provision = await connect("provision")
    await streams.provision(provision.nc.jetstream(), settings_as(server, "provision"))
    worker = await connect("worker")
    dead_letters = dlq.DeadLetters(worker.nc.jetstream(), settings_as(server, "worker"))
    await dead_letters.write(
        due(3),
        reason="poison",
        error="test",
        stream_seq=1,
        num_delivered=1,
        original=None,
    )
    async with dlq.opened(settings_as(server, "dlq")) as letters:
        seqs = await letters.seqs(None)
        report = await letters.replay(seqs)
    assert seqs == [1]
    assert report.summary() == "replayed 1, skipped as duplicates 0, missing 0"
    status = await gather(Settings(nats=settings_as(server, "dlq")), dead_letters_read=10)
    assert [f.part for f in status.failed] == ["database"]  # every NATS part read
    assert status.dead_letters is not None
    assert status.charging is not None
    operator = await connect("dlq")
    assert await refused_publish(operator, "charges.dlq")
    assert await refused_publish(operator, OUTCOME_SUBJECT)
    assert await refused_publish(operator, "$JS.API.STREAM.MSG.DELETE.CHARGES_DLQ")


async def test_provision_applies_drift_and_the_others_cannot(
    server: NatsServer, connect: Connect
) -> None:
    await streams.provision(
        (await connect("provision")).nc.jetstream(),
        settings_as(server, "provision"),
    )
    cfg = settings_as(server, "provision")
    changed = cfg.model_copy(
        update={
            "stream_max_age_s": 2 * cfg.stream_max_age_s,
            "outcomes_max_age_s": 2 * cfg.outcomes_max_age_s,
        }
    )
    provision = await connect("provision")
    report = await streams.provision(provision.nc.jetstream(), changed, apply=True)
    assert report.updated == ["stream CHARGES", "stream CHARGE_OUTCOMES"]
    assert await refused_publish(provision, OUTCOME_SUBJECT)
    worker = await connect("worker")
    assert await refused_publish(worker, "$JS.API.STREAM.UPDATE.CHARGES")


async def test_the_kill_switch_is_the_provision_users_and_no_pods(
    server: NatsServer, connect: Connect
) -> None:
    """`pause` and `resume` run as the operator's `provision` user; the worker and reconcile
    users (the pods') cannot pause."""
    cfg = settings_as(server, "provision")
    js = (await connect("provision")).nc.jetstream()
    await streams.provision(js, cfg)
    now = dt.datetime.now(dt.UTC)

    state, _ = await pause(js, cfg, reason="drill", by="on-call", now=now)
    assert (state.paused, state.reason) == (True, "drill")
    state, _ = await resume(js, cfg)
    assert not state.paused
    for user in ("worker", "reconcile"):
        assert await refused_publish(
            await connect(user), "$JS.API.CONSUMER.PAUSE.CHARGES.charges-worker"
        )


async def test_without_a_user_nothing_is_published(server: NatsServer) -> None:
    """The webhook receiver, migrate and maintain have no NATS user: a client without one
    that publishes a due charge anyway is refused."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        info = await reader.readline()
        writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        writer.write(b"PUB charges.due 2\r\n{}\r\nPING\r\n")
        await writer.drain()
        answer = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    assert info.startswith(b"INFO ")
    assert b'"auth_required":true' in info
    assert answer.strip() == b"-ERR 'Authorization Violation'"
