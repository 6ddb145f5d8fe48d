"""The `charge-worker` command: parse, build settings, configure logging, run. Nothing more.

click rather than typer: typer is click plus rich and type-hint introspection; the plain
decorators keep `mypy --strict` honest and nested groups (`dlq list`) are native to click.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from charge_worker import event_loop, logs, tracing
from charge_worker.display import printable
from charge_worker.errors import ChargeWorkerError
from charge_worker.settings import Settings, load_settings

T = TypeVar("T")


class _OneLineErrors(click.Group):
    """Turns every domain error into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ChargeWorkerError as error:
            # one line even when a driver's message has several (PostgreSQL's DETAIL), and
            # nothing a dependency or a message said is obeyed by the terminal
            raise click.ClickException(printable(f"{type(error).__name__}: {error}")) from error


def _settings() -> Settings:
    """The settings, once; logs configured, and traces when the OTEL_* variables ask for
    them (exported, and the exporter flushed, as the command ends)."""
    settings = load_settings()
    logs.configure(settings.log)
    ctx = click.get_current_context()
    tracing.setup(" ".join(ctx.command_path.split()[1:]))
    ctx.call_on_close(tracing.shutdown)
    return settings


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return event_loop.run(coro)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="charge-worker")
def main() -> None:
    """Charge each due subscription from NATS JetStream exactly once in effect.

    Settings come from the environment (then an optional .env): NATS_URL, DATABASE_URL,
    GATEWAY_URL, GATEWAY_API_KEY, SCORING_URL and CHARGE_WORKER_*; traces from the
    standard OTEL_* variables (environment only); see docs/configuration.md.
    """


@main.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder of NNNN_name.sql files (default: the ones shipped with this version).",
)
@click.option(
    "--lock-timeout",
    "lock_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=3.0,
    show_default=True,
    help="Seconds a migration waits for a table's lock before its try is rolled back.",
)
@click.option(
    "--lock-retries",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Tries after the first when the lock wait timed out, 1 s apart doubling to 30 s.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the files applied now as JSON.")
def migrate(
    directory: Path | None, lock_timeout_s: float, lock_retries: int, as_json: bool
) -> None:
    """Apply the database migrations not applied yet (safe to run concurrently)."""
    from charge_worker.migrate import LockWait, Migration  # noqa: PLC0415
    from charge_worker.migrate import migrate as apply_all  # noqa: PLC0415

    def waited(w: LockWait) -> None:
        click.echo(
            f"{w.migration.path.name}: waited {w.lock_timeout_s:g} s for a lock (try "
            f"{w.attempt} of {w.tries}), rolled back; trying again in {w.retry_in_s:g} s",
            err=True,
        )

    def applied_now(m: Migration) -> None:
        if not as_json:
            click.echo(f"applied {m.path.name}")

    run = apply_all(
        _settings().db.dsn,
        directory,
        lock_timeout_s=lock_timeout_s,
        lock_retries=lock_retries,
        on_apply=applied_now,
        on_lock_wait=waited,
    )
    applied = _run(run)
    if as_json:
        click.echo(json.dumps({"applied": [m.path.name for m in applied], "exit_code": 0}))
    else:
        click.echo(f"schema up to date ({len(applied)} applied now)")


@main.command()
@click.option("--apply", is_flag=True, help="Update fields that differ, where JetStream allows.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print what was created, updated or differs as JSON."
)
def provision(apply: bool, as_json: bool) -> None:
    """Create the CHARGES and CHARGES_DLQ streams and the durable consumer when missing.

    Existing ones with another configuration are reported, not changed, unless --apply.
    Exits 3 when a difference remains.
    """
    from charge_worker.admin import provision_command  # noqa: PLC0415

    raise SystemExit(_run(provision_command(_settings(), apply=apply, as_json=as_json)))


@main.command()
@click.option("--reason", help="Why, kept with the pause for whoever looks next.")
@click.option("--by", help="Who pauses (default: user@host of this shell).")
@click.option("--json", "as_json", is_flag=True, help="Print the consumer's state as JSON.")
def pause(reason: str | None, by: str | None, as_json: bool) -> None:
    """Stop all charging: pause the durable consumer until `resume` (nats-server 2.11+).

    Workers stay up and Ready and deliver nothing; messages wait in the stream. Who, when
    and why are kept on the consumer. Paused already: changes nothing.
    """
    from charge_worker.admin import pause_command  # noqa: PLC0415

    raise SystemExit(_run(pause_command(_settings(), reason=reason, by=by, as_json=as_json)))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the consumer's state as JSON.")
def resume(as_json: bool) -> None:
    """Resume charging after `pause`: every message waiting is delivered, none is lost.

    Not paused: changes nothing.
    """
    from charge_worker.admin import resume_command  # noqa: PLC0415

    raise SystemExit(_run(resume_command(_settings(), as_json=as_json)))


@main.command()
@click.option(
    "--dry-run", is_flag=True, help="Print what would be made and dropped; change nothing."
)
@click.option("--json", "as_json", is_flag=True, help="Print what was made and dropped as JSON.")
def maintain(dry_run: bool, as_json: bool) -> None:
    """Keep charge_events inside its retention: a daily job, as the schema owner.

    Makes the monthly partitions of the next twelve months and drops those wholly older
    than CHARGE_WORKER_EVENTS_RETENTION_MONTHS. The ledger itself is never trimmed.
    """
    from charge_worker.admin import maintain_command  # noqa: PLC0415

    raise SystemExit(_run(maintain_command(_settings(), dry_run=dry_run, as_json=as_json)))


@main.command()
def run() -> None:
    """Consume charges.due and charge each due subscription once, until SIGTERM.

    On SIGTERM: stop fetching, finish in-flight work within CHARGE_WORKER_DRAIN_S, leave the
    rest un-acked for redelivery, exit 0.
    """
    from charge_worker.worker import run_command  # noqa: PLC0415

    raise SystemExit(_run(run_command(_settings())))


@main.command()
@click.option(
    "--date",
    "due_date",
    type=click.DateTime(formats=["%Y-%m-%d"]),
    help="Publish what is due on or before this day (default: today, UTC).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--processes",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Run in this many processes at once (one per core: a month start's run is bound by"
    " its own CPU).",
)
# one process of `--processes N`: its share of the ids
@click.option("--after", default="", hidden=True)
@click.option("--through", default=None, hidden=True)
def produce(
    due_date: dt.datetime | None,
    as_json: bool,
    processes: int,
    after: str,
    through: str | None,
) -> None:
    """Publish every subscription whose billing day has come to charges.due (a daily CronJob).

    Each due charge is published with Nats-Msg-Id charge:<order_id>:<billing_period> and
    recorded as a `scheduled` row in one transaction. Safe to run twice, or twice at once.
    Subscription rows that break the contract are reported and skipped. Exits 1 if any
    charge could not be published (re-run: nothing is published twice that matters).
    """
    from charge_worker.producer import Share, produce_command, produce_in_processes  # noqa: PLC0415

    day = (due_date or dt.datetime.now(dt.UTC)).date()
    settings = _settings()  # checked here, once, whoever runs the steps
    if processes > 1:
        command = produce_in_processes(settings, day, processes, as_json=as_json)
    else:
        share = Share(after, through)
        command = produce_command(settings, day, as_json=as_json, share=share)
    raise SystemExit(_run(command))


@main.group(invoke_without_command=True)
@click.option(
    "--since",
    type=click.DateTime(formats=["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"]),
    help="Page gateway history from here (default: the last run's checkpoint less"
    " CHARGE_WORKER_RECONCILE_OVERLAP_S; the first run: CHARGE_WORKER_RECONCILE_WINDOW_S ago).",
)
@click.option(
    "--full", is_flag=True, help="Page the whole window, whatever the checkpoint (the daily sweep)."
)
@click.option("--dry-run", is_flag=True, help="Report only: no refund, no re-publish, no write.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option(
    "--fail-on-discrepancy", is_flag=True, help="Exit 4 when ledger and gateway disagree."
)
@click.option(
    "--metrics-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the run's figures in Prometheus text format (node-exporter textfile collector).",
)
@click.pass_context
def reconcile(
    ctx: click.Context,
    *,
    since: dt.datetime | None,
    full: bool,
    dry_run: bool,
    as_json: bool,
    fail_on_discrepancy: bool,
    metrics_file: Path | None,
) -> None:
    """Compare the gateway's history with the ledger and repair what can be repaired.

    Refunds double charges (all but the one the ledger records), resolves unknown outcomes
    by lookup, re-publishes due charges that went quiet (a broker that lost messages), and
    reports charges the ledger has but the gateway does not (never "fixed" by charging).
    Safe to run next to workers and next to itself. A CronJob, every 15 minutes.
    `reconcile resolve` marks a key's findings reviewed by a person.
    """
    from charge_worker.reconcile import reconcile_command  # noqa: PLC0415

    if ctx.invoked_subcommand is not None:  # `reconcile resolve`: the run's options unused
        return
    start = since.replace(tzinfo=dt.UTC) if since else None
    raise SystemExit(
        _run(
            reconcile_command(
                _settings(),
                since=start,
                dry_run=dry_run,
                as_json=as_json,
                fail_on_discrepancy=fail_on_discrepancy,
                metrics_file=metrics_file,
                full=full,
            )
        )
    )


@reconcile.command("resolve")
@click.argument("order_id", type=int)
@click.argument("billing_period", type=click.DateTime(formats=["%Y-%m-%d"]))
@click.option("--note", required=True, help="What the review found and did; kept with it.")
@click.option("--by", help="Who reviewed (default: user@host of this shell).")
@click.option("--json", "as_json", is_flag=True, help="Print what was reviewed as JSON.")
def reconcile_resolve(
    order_id: int, billing_period: dt.datetime, note: str, by: str | None, as_json: bool
) -> None:
    """Mark a key's discrepancy and unmatched charges reviewed, so their alerts clear.

    Covers exactly the findings reconcile reports for the key now (a charge found later is
    a new finding); later runs count them as `reviewed`. Refunds and records nothing. Exits
    1 (one line) when the key has nothing to review; 0 when reviewed, or reviewed already.
    """
    from charge_worker.admin.pause import operator  # noqa: PLC0415
    from charge_worker.reconcile import resolve_command  # noqa: PLC0415

    if not note.strip():
        raise click.UsageError("--note must say what the review found")
    period = billing_period.date()
    command = resolve_command(
        _settings(), order_id, period, note=note, by=by or operator(), as_json=as_json
    )
    raise SystemExit(_run(command))


@main.command()
@click.argument("order_id", type=int)
@click.argument("billing_period", type=click.DateTime(formats=["%Y-%m-%d"]))
@click.option("--json", "as_json", is_flag=True, help="Print the story as JSON.")
@click.option("--gateway", "ask_gateway", is_flag=True, help="Also look the key up at the gateway.")
def explain(order_id: int, billing_period: dt.datetime, as_json: bool, ask_gateway: bool) -> None:
    """Tell the whole story of one charge, in time order.

    Scheduled and published, each delivery and what it came to, claims and lease
    takeovers, the scoring verdict or its deferral, each gateway call and its answer, the ack
    or dead letter and why, refunds and re-publishes by reconcile.
    """
    from charge_worker.explain import explain_command  # noqa: PLC0415

    period = billing_period.date()
    raise SystemExit(
        _run(
            explain_command(_settings(), order_id, period, as_json=as_json, ask_gateway=ask_gateway)
        )
    )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print everything read as one JSON object.")
def status(as_json: bool) -> None:
    """One screen for the on-call: is charging paused, how far behind is it, what died.

    The kill switch (who paused, when, why), the consumer's lag, ack-pending against its
    limit and redeliveries, the oldest due charge not yet charged, dead letters by reason,
    the latest produce, reconcile (and its findings) and maintain runs, the outbox's oldest
    unsent event, deferred scoring checks pending. Breakers are per pod: see
    charge_worker_breaker_open on each worker's /metrics. Exits 1, after showing what it
    could read, when a part could not be read (one line each).
    """
    from charge_worker.admin import status_command  # noqa: PLC0415

    raise SystemExit(_run(status_command(_settings(), as_json=as_json)))


@main.command()
@click.argument("order_id", type=int)
@click.argument("billing_period", type=click.DateTime(formats=["%Y-%m-%d"]))
@click.option("--json", "as_json", is_flag=True, help="Print the try started as JSON.")
def retry(order_id: int, billing_period: dt.datetime, as_json: bool) -> None:
    """Start a declined period's next try now, on purpose (the customer fixed their card).

    Allowed from retry_scheduled, action_required, and declined unless by a hard decline;
    refused in one line (exit 1) when the period holds money, has a try in flight, is
    blocked or failed, or has reached CHARGE_WORKER_RETRY_CAP_30D. The try is published at
    once with Nats-Msg-Id charge:<order_id>:<billing_period>:<n>; exits 1 if it could not
    be (it stays started: the next `produce` publishes it).
    """
    from charge_worker.producer import retry_command  # noqa: PLC0415

    period = billing_period.date()
    raise SystemExit(_run(retry_command(_settings(), order_id, period, as_json=as_json)))


@main.command()
def webhooks() -> None:
    """Receive the gateway's webhooks: verify, journal, answer 2xx fast; apply them in order.

    Serves POST /webhooks/gateway on CHARGE_WORKER_WEBHOOK_PORT (default 8081), signed per
    Standard Webhooks with CHARGE_WORKER_WEBHOOK_SECRETS (comma-separated, for rotation).
    Journaled events are applied to the ledger by revision, after any crash. Stops on SIGTERM.
    """
    from charge_worker.webhooks import serve_command  # noqa: PLC0415

    raise SystemExit(_run(serve_command(_settings())))


@main.group()
def dlq() -> None:
    """Inspect and replay the dead letters kept in the dead-letter stream (CHARGES_DLQ).

    A dead letter is a charges.due message the worker gave up on, stored byte for byte with
    Dlq-* headers saying why (docs/contracts/charge-due.md). SEQ is its sequence in the
    dead-letter stream, as `dlq list` shows it.
    """


_REASON_HELP = (
    "Only dead letters with this Dlq-Reason (poison, max_deliveries, rejected, conflict,"
    " unverified)."
)


@dlq.command("list")
@click.option("--reason", help=_REASON_HELP)
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="Show at most this many, oldest first.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per line; errors not cut to fit."
)
def dlq_list(reason: str | None, limit: int, as_json: bool) -> None:
    """List dead letters, oldest first, one line each.

    Columns: DLQ sequence, Dlq-Dead-At, Dlq-Reason, the original stream sequence, deliveries,
    order_id and billing_period when the body is JSON with them (else -), and Dlq-Error cut
    to the terminal's width.
    """
    from charge_worker.admin import list_command  # noqa: PLC0415

    raise SystemExit(_run(list_command(_settings(), reason=reason, limit=limit, as_json=as_json)))


@dlq.command("show")
@click.argument("seq", type=click.IntRange(min=1))
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object: seq, headers, the exact body as base64, the body parsed if JSON.",
)
def dlq_show(seq: int, as_json: bool) -> None:
    """Print one dead letter: every header, a blank line, then the body.

    The body is shown as indented JSON when it parses, else as the repr of its bytes; a
    replay always sends the stored bytes, never this rendering. Exits 1 when SEQ is not in
    the dead-letter stream.
    """
    from charge_worker.admin import show_command  # noqa: PLC0415

    raise SystemExit(_run(show_command(_settings(), seq, as_json=as_json)))


@dlq.command("replay")
@click.argument("seqs", nargs=-1, type=click.IntRange(min=1), metavar="[SEQ]...")
@click.option("--all", "every", is_flag=True, help="Replay every dead letter (see --reason).")
@click.option("--reason", help="With --all: " + _REASON_HELP[0].lower() + _REASON_HELP[1:])
@click.option("--yes", "-y", is_flag=True, help="Do not ask; required when stdin is no terminal.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the sequences replayed, duplicate, missing."
)
def dlq_replay(
    seqs: tuple[int, ...], every: bool, reason: str | None, yes: bool, as_json: bool
) -> None:
    """Republish dead letters' original bodies to charges.due.

    Give DLQ sequences (see `dlq list`), or --all [--reason R]. Each body goes back byte for
    byte with a fresh Nats-Msg-Id replay:<SEQ> (and its original traceparent), each publish
    acked before the next. Replaying a dead letter again within the charges stream's
    duplicate window is skipped as a duplicate. Prints replayed / duplicates / missing.

    The dead letters are NOT deleted: they stay in the dead-letter stream for inspection
    until they age out. Replaying never charges twice: the charge_attempts claim allows at
    most one charge per (order_id, billing_period).
    """
    from charge_worker.admin import replay_command  # noqa: PLC0415
    from charge_worker.admin.dlq import print_replay, select  # noqa: PLC0415
    from charge_worker.dlq import ReplayReport  # noqa: PLC0415

    if bool(seqs) == every:
        raise click.UsageError("give the dead letters' sequences or --all, not both")
    if reason is not None and not every:
        raise click.UsageError("--reason goes with --all")
    if not yes and not (sys.stdin and sys.stdin.isatty()):  # None when fd 0 is closed
        raise click.ClickException("stdin is not a terminal to confirm on; pass --yes to replay")
    settings = _settings()
    chosen = _run(select(settings, reason)) if every else list(dict.fromkeys(seqs))
    if not chosen:
        print_replay(ReplayReport(), as_json=as_json)
        return
    if not yes:  # outside the event loop: a slow answer must not stall the NATS connection
        noun = "dead letter" if len(chosen) == 1 else "dead letters"
        question = f"Replay {len(chosen)} {noun} to {settings.nats.subject}?"
        click.confirm(question, abort=True, err=as_json)  # stdout keeps only the JSON
    raise SystemExit(_run(replay_command(settings, chosen, as_json=as_json)))


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
    """Serve the payment gateway simulator (docs/contracts/gateway.md)."""
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
    """Serve the anti-fraud scoring simulator (docs/contracts/scoring.md)."""
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
@click.option(
    "--nats-cluster",
    type=click.Choice(["1", "3"]),
    default="1",
    show_default=True,
    help="3: an embedded 3-node JetStream cluster, streams replicated 3 times.",
)
def demo(keep: bool, nats_cluster: str) -> None:
    """Start everything embedded, publish sample due charges and show what happened."""
    from charge_worker.sandbox.demo import run_demo  # noqa: PLC0415

    run_demo(keep=keep, nats_cluster=int(nats_cluster))
