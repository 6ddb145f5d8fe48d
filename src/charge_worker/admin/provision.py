"""`charge-worker provision [--apply]`: create the streams and the consumer, report drift."""

from __future__ import annotations

import dataclasses
import json

import click

from charge_worker import streams
from charge_worker.settings import Settings

DRIFT_EXIT = 3


async def provision_command(settings: Settings, *, apply: bool, as_json: bool = False) -> int:
    """Create what is missing; 3 when a difference from the configuration remains."""
    nc = await streams.connect(settings.nats, name="charge-worker-provision", reconnect=False)
    try:
        report = await streams.provision(nc.jetstream(), settings.nats, apply=apply)
    finally:
        await nc.close()
    remains = report.drift and not (apply and all(d.changeable for d in report.drift))
    code = DRIFT_EXIT if remains else 0
    if as_json:
        drift = [dataclasses.asdict(d) | {"changeable": d.changeable} for d in report.drift]
        document = {
            "created": report.created,
            "updated": report.updated,
            "drift": drift,
            "exit_code": code,
        }
        click.echo(json.dumps(document, default=str))
        return code
    for line in report.created:
        click.echo(f"created {line}")
    for line in report.updated:
        click.echo(f"updated {line}")
    for drift_line in report.drift:
        click.echo(f"differs: {drift_line}", err=True)
    if not remains:
        click.echo("streams and consumer match the configuration")
    return code
