"""`charge-worker demo`: the whole stack on one machine, and a printed account of it.

Starts (unless NATS_URL / DATABASE_URL point elsewhere) an embedded nats-server and
PostgreSQL on free loopback ports, the gateway and scoring simulators, migrates, provisions,
publishes sample due charges (among them a duplicate publish and a poison message) and shows
the stream and consumer state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
from collections.abc import Iterator

import click
from nats.aio.client import Client

from charge_worker import streams
from charge_worker.messages import ChargeDue
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import NatsServer, PostgresServer
from charge_worker.sandbox.gateway import build_gateway_app
from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings

PERIOD = dt.date(2026, 12, 1)
SAMPLES = [  # (order_id, customer, amount_minor, currency)
    (1001, "cus_alice", 99000, "RUB"),
    (1002, "cus_bob", 4999, "EUR"),
    (1003, "cus_decline_carol", 1500, "USD"),  # the gateway declines cus_decline*
    (1004, "cus_block_mallory", 250000, "RUB"),  # scoring blocks cus_block*
    (1005, "cus_dave", 120000, "RUB"),
]


def _step(text: str) -> None:
    click.secho(f"==> {text}", fg="cyan", bold=True)


@contextlib.contextmanager
def _server(env_name: str, server: NatsServer | PostgresServer) -> Iterator[str]:
    if url := os.environ.get(env_name):
        click.echo(f"    using {env_name}={url}")
        yield url
        return
    with server:
        click.echo(f"    started embedded {server.name} on {server.url} (data in {server.root})")
        yield server.url


def _sample(order_id: int, customer: str, amount: int, currency: str) -> ChargeDue:
    return ChargeDue.model_validate(
        {
            "schema": "charge.due/v1",
            "order_id": order_id,
            "billing_period": PERIOD,
            "subscription_id": f"sub_{order_id}",
            "customer_id": customer,
            "amount_minor": amount,
            "currency": currency,
            "due_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
        },
        strict=False,
    )


async def _publish_samples(nc: Client, cfg: NatsSettings) -> None:
    js = nc.jetstream()
    charges = [_sample(*row) for row in SAMPLES]
    for charge in charges:
        ack = await js.publish(
            cfg.subject, charge.to_json(), headers={"Nats-Msg-Id": charge.msg_id}
        )
        click.echo(f"    published {charge.key:<18} seq={ack.seq}")
    again = charges[0]
    ack = await js.publish(cfg.subject, again.to_json(), headers={"Nats-Msg-Id": again.msg_id})
    click.echo(f"    re-published {again.key} with the same Nats-Msg-Id: duplicate={ack.duplicate}")
    ack = await js.publish(cfg.subject, json.dumps({"schema": "charge.due/v1"}).encode())
    click.echo(f"    published a poison message (missing fields) seq={ack.seq}")


async def _show_state(nc: Client, cfg: NatsSettings) -> None:
    js = nc.jetstream()
    stream = await js.stream_info(cfg.stream)
    consumer = await js.consumer_info(cfg.stream, cfg.durable)
    dlq = await js.stream_info(cfg.dlq_stream)
    click.echo(f"    stream {cfg.stream}: {stream.state.messages} messages")
    click.echo(
        f"    consumer {cfg.durable}: {consumer.num_pending} pending, "
        f"{consumer.num_ack_pending} awaiting ack, {consumer.num_redelivered} redelivered"
    )
    click.echo(f"    dead-letter stream {cfg.dlq_stream}: {dlq.state.messages} messages")


async def _story(nats_url: str, database_url: str) -> None:
    cfg = NatsSettings(url=nats_url)
    _step("migrating the ledger")
    for migration in await migrate(database_url):
        click.echo(f"    applied {migration.path.name}")
    nc = await streams.connect(cfg, name="charge-worker-demo")
    try:
        _step("provisioning streams and the durable consumer")
        report = await streams.provision(nc.jetstream(), cfg)
        for line in report.created or ["(all present already)"]:
            click.echo(f"    {line}")
        _step("publishing sample due charges")
        await _publish_samples(nc, cfg)
        _step("stream state (the worker that settles these comes next)")
        await _show_state(nc, cfg)
    finally:
        await nc.close()


def run_demo(*, keep: bool = False) -> None:
    """Run the demo from start to end, printing each step."""
    _step("starting NATS JetStream, PostgreSQL and the simulators")
    with (
        _server("NATS_URL", NatsServer()) as nats_url,
        _server("DATABASE_URL", PostgresServer()) as database_url,
        ServedApp(build_gateway_app()) as gateway,
        ServedApp(build_scoring_app(ScoringConfig.incident())) as scoring,
    ):
        click.echo(f"    gateway simulator on {gateway.url}, scoring simulator on {scoring.url}")
        asyncio.run(_story(nats_url, database_url))
        if keep:
            click.echo("servers keep running; press Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(asyncio.Event().wait())
    _step("done; embedded servers stopped and their data removed")
