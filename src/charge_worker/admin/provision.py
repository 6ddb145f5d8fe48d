"""`charge-worker provision [--apply]`: create the streams and the consumer, report drift."""

from __future__ import annotations

import click

from charge_worker import streams
from charge_worker.settings import Settings

DRIFT_EXIT = 3


async def provision_command(settings: Settings, *, apply: bool) -> int:
    """Create what is missing; 3 when a difference from the configuration remains."""
    nc = await streams.connect(settings.nats, name="charge-worker-provision", reconnect=False)
    try:
        report = await streams.provision(nc.jetstream(), settings.nats, apply=apply)
    finally:
        await nc.close()
    for line in report.created:
        click.echo(f"created {line}")
    for line in report.updated:
        click.echo(f"updated {line}")
    for drift in report.drift:
        click.echo(f"differs: {drift}", err=True)
    if report.drift and not (apply and all(d.changeable for d in report.drift)):
        return DRIFT_EXIT
    click.echo("streams and consumer match the configuration")
    return 0
