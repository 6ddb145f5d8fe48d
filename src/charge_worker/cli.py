"""The `charge-worker` command: parse, build settings, configure logging, run. Nothing more.

click rather than typer: typer is click plus rich and type-hint introspection; the plain
decorators keep `mypy --strict` honest and nested groups (`dlq list`) are native to click.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from charge_worker import logs
from charge_worker.errors import ChargeWorkerError
from charge_worker.settings import Settings, load_settings

T = TypeVar("T")


class _Group(click.Group):
    """Turns every domain error into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ChargeWorkerError as error:
            raise click.ClickException(f"{type(error).__name__}: {error}") from error


def _settings() -> Settings:
    settings = load_settings()
    logs.configure(settings.log)
    return settings


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="charge-worker")
def main() -> None:
    """Charge each due subscription from NATS JetStream exactly once in effect.

    Settings come from the environment (then an optional .env): NATS_URL, DATABASE_URL,
    GATEWAY_URL, GATEWAY_API_KEY, SCORING_URL and CHARGE_WORKER_*; see the README.
    """


@main.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder of NNNN_name.sql files (default: the ones shipped with this version).",
)
def migrate(directory: Path | None) -> None:
    """Apply the database migrations not applied yet (safe to run concurrently)."""
    from charge_worker.migrate import migrate as apply_all  # noqa: PLC0415
    from charge_worker.settings import require  # noqa: PLC0415

    settings = _settings()
    dsn = require(settings.db.url, "DATABASE_URL")
    applied = _run(
        apply_all(dsn, directory, on_apply=lambda m: click.echo(f"applied {m.path.name}"))
    )
    click.echo(f"schema up to date ({len(applied)} applied now)")


@main.command()
@click.option("--apply", is_flag=True, help="Update fields that differ, where JetStream allows.")
def provision(apply: bool) -> None:
    """Create the CHARGES and CHARGES_DLQ streams and the durable consumer when missing.

    Existing ones with another configuration are reported, not changed, unless --apply.
    Exits 3 when a difference remains.
    """
    from charge_worker import streams  # noqa: PLC0415

    settings = _settings()

    async def go() -> bool:
        nc = await streams.connect(settings.nats, name="charge-worker-provision")
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
        clean = not report.drift or (apply and all(d.changeable for d in report.drift))
        if clean:
            click.echo("streams and consumer match the configuration")
        return clean

    if not _run(go()):
        raise SystemExit(3)


@main.command()
def run() -> None:
    """Consume charges.due and charge each due subscription once, until SIGTERM.

    On SIGTERM: stop fetching, finish in-flight work within CHARGE_WORKER_DRAIN_S, leave the
    rest un-acked for redelivery, exit 0.
    """
    from charge_worker.app import run_worker, stop_on_signals  # noqa: PLC0415

    settings = _settings()

    async def go() -> None:
        stop = asyncio.Event()
        with stop_on_signals(stop):
            await run_worker(settings, stop)

    _run(go())


@main.group()
def sandbox() -> None:
    """Run a simulator of a dependency on its own (for demos and manual tests)."""


@sandbox.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8090, show_default=True, type=int)
@click.option(
    "--config", "config_json", help='GatewayConfig as JSON, e.g. \'{"error_rates": {"503": 0.1}}\'.'
)
def sandbox_gateway(host: str, port: int, config_json: str | None) -> None:
    """Serve the payment gateway simulator (contracts/gateway.md)."""
    from charge_worker.sandbox.gateway import GatewayConfig, build_gateway_app  # noqa: PLC0415
    from charge_worker.sandbox.serve import serve_forever  # noqa: PLC0415

    config = GatewayConfig.model_validate_json(config_json) if config_json else GatewayConfig()
    click.echo(f"gateway simulator on http://{host}:{port} (api key from its config)")
    _run(serve_forever(build_gateway_app(config), host, port))


@sandbox.command("scoring")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8091, show_default=True, type=int)
@click.option("--incident", is_flag=True, help="Latency of the incident: p99 1.2 s, 2 % at 6-8 s.")
@click.option("--config", "config_json", help="ScoringConfig as JSON.")
def sandbox_scoring(host: str, port: int, incident: bool, config_json: str | None) -> None:
    """Serve the anti-fraud scoring simulator (contracts/scoring.md)."""
    from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app  # noqa: PLC0415
    from charge_worker.sandbox.serve import serve_forever  # noqa: PLC0415

    if config_json:
        config = ScoringConfig.model_validate_json(config_json)
    else:
        config = ScoringConfig.incident() if incident else ScoringConfig()
    click.echo(f"scoring simulator on http://{host}:{port}")
    _run(serve_forever(build_scoring_app(config), host, port))


@main.command()
@click.option("--keep", is_flag=True, help="Leave the servers running until Ctrl-C.")
def demo(keep: bool) -> None:
    """Start everything embedded, publish sample due charges and show what happened."""
    from charge_worker.sandbox.demo import run_demo  # noqa: PLC0415

    run_demo(keep=keep)
