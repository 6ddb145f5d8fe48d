"""`charge-worker dlq list | show | replay`: the dead letters kept in `CHARGES_DLQ`.

Each command prints its result (one JSON object, or one per line for `list`, with `--json`)
and returns the exit code; the dead letters themselves are never changed or deleted here.
What a message brought is printed escaped (`display.printable`), or JSON-escaped with
`--json`: a body is no place to take escape sequences for the operator's terminal from.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import sys

import click

from charge_worker.display import printable
from charge_worker.dlq import Letter, ReplayReport, opened, table
from charge_worker.settings import Settings

REPLAY_PROGRESS_FROM = 20  # dead letters; fewer replay too fast for a bar to help


async def list_command(settings: Settings, *, reason: str | None, limit: int, as_json: bool) -> int:
    """Dead letters, oldest first, one line each (one JSON object each with `as_json`)."""
    async with opened(settings.nats) as dead_letters:
        page = await dead_letters.summaries(reason=reason, limit=limit)
    if not page.items:
        # stderr under --json, so that stdout stays valid JSON lines (none)
        click.echo("no dead letters" + (f" with reason {reason}" if reason else ""), err=as_json)
        return 0
    if as_json:
        # ensure_ascii: json.dumps escapes C0 controls only, not C1 or bidirectional overrides
        lines = [json.dumps(dataclasses.asdict(row)) for row in page.items]
    else:
        lines = table(page.items, width=shutil.get_terminal_size((200, 24)).columns)
    for line in lines:
        click.echo(line)
    if page.more:
        click.echo(f"more dead letters match than the {limit} shown (--limit)", err=True)
    return 0


async def show_command(settings: Settings, seq: int, *, as_json: bool = False) -> int:
    """Every header, a blank line, then the body (one JSON object with `as_json`); 1 when
    `seq` is not a dead letter."""
    async with opened(settings.nats) as dead_letters:
        letter = await dead_letters.get(seq)
    if letter is None:
        click.echo(
            f"Error: no dead letter with sequence {seq} in {settings.nats.dlq_stream}", err=True
        )
        return 1
    if as_json:
        click.echo(json.dumps(_letter_json(letter)))
        return 0
    for name, value in letter.headers.items():
        click.echo(f"{printable(name)}: {printable(value)}")
    click.echo()
    click.echo(letter.pretty_body())
    return 0


def _letter_json(letter: Letter) -> dict[str, object]:
    """The exact body as base64 (what a replay sends), and parsed when it is UTF-8 JSON."""
    try:
        parsed: object = json.loads(letter.body.decode("utf-8"))
    except ValueError:
        parsed = None
    return {
        "seq": letter.seq,
        "headers": dict(letter.headers),
        "body_base64": base64.b64encode(letter.body).decode("ascii"),
        "body_json": parsed,
    }


async def select(settings: Settings, reason: str | None) -> list[int]:
    """The sequences of every dead letter, or of those with `reason`."""
    async with opened(settings.nats) as dead_letters:
        return await dead_letters.seqs(reason)


async def replay_command(settings: Settings, seqs: list[int], *, as_json: bool = False) -> int:
    """Republish these dead letters' bodies to the charges subject; print what happened."""
    async with opened(settings.nats) as dead_letters:
        if len(seqs) < REPLAY_PROGRESS_FROM:
            report = await dead_letters.replay(seqs)
        else:
            with click.progressbar(length=len(seqs), label="replaying", file=sys.stderr) as bar:
                report = await dead_letters.replay(seqs, on_each=lambda *_: bar.update(1))
    print_replay(report, as_json=as_json)
    return 0


def print_replay(report: ReplayReport, *, as_json: bool) -> None:
    """One line: replayed / duplicates / missing; or one JSON object of their sequences."""
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(report) | {"exit_code": 0}))
    elif not (report.replayed or report.duplicates or report.missing):
        click.echo("no dead letters to replay")
    else:
        click.echo(report.summary())
