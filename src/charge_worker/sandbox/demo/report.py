"""What the demo shows at the end: read every witness, print a summary, list what went wrong.

Witnesses: the gateway simulator (charges per period, across every try's key: the promise),
the ledger (`charge_attempts`, `charge_tries`), the dead-letter stream, each worker's
`/metrics` and JSON log, the scoring simulator's counters, and the outcome events a
downstream consumer read (`outcomes.py`). The summary ends with each declined period's
tries in plain words (`periods.py`). `print_summary` returns the broken expectations, if any.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import nats.js.errors
from nats.js import JetStreamContext

from charge_worker.sandbox.demo.ledger import CHARGED, EarlierTry, LedgerRow
from charge_worker.sandbox.demo.outcomes import DOWNSTREAM_DURABLE, Read, mismatches
from charge_worker.sandbox.demo.periods import Retries, period_of, print_periods
from charge_worker.sandbox.demo.samples import Published
from charge_worker.sandbox.demo.workers import Samples, metric
from charge_worker.worker.decisions import Outcome

INDENT = "    "
WHAT_FOLLOWED = {  # what the worker did with a delivery of each outcome
    Outcome.DUPLICATE: "final already: ack",
    Outcome.LEASE_HELD: "key busy: nak",
    Outcome.POISON: "dead letter",
    Outcome.CONFLICT: "dead letter",
    Outcome.REJECTED: "dead letter",
}


@dataclass(frozen=True)
class DeadLetterRow:
    """One message of the dead-letter stream, by its headers."""

    seq: int
    reason: str
    error: str
    stream_seq: str
    delivered: str
    order_id: str


def _order_of(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return "-"
    return str(data.get("order_id", "-")) if isinstance(data, dict) else "-"


async def read_dead_letters(js: JetStreamContext, stream: str) -> list[DeadLetterRow]:
    """Every dead letter from the stream's first to its last sequence."""
    state = (await js.stream_info(stream)).state
    found = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            msg = await js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue  # deleted meanwhile
        headers = msg.headers or {}
        found.append(
            DeadLetterRow(
                seq=seq,
                reason=headers.get("Dlq-Reason", "?"),
                error=headers.get("Dlq-Error", ""),
                stream_seq=headers.get("Dlq-Stream-Seq", "?"),
                delivered=headers.get("Dlq-Num-Delivered", "?"),
                order_id=_order_of(msg.data or b""),
            )
        )
    return found


async def sim_json(client: httpx.AsyncClient, url: str) -> Any:
    """A simulator's `/_sim/...` answer."""
    response = await client.get(url)
    response.raise_for_status()
    return response.json()


def charges_per_period(charges: Iterable[dict[str, Any]]) -> Counter[str]:
    """Successful charges at the gateway, per period (`<order_id>:<billing_period>`), whichever
    try's key made them."""
    return Counter(period_of(c["idempotency_key"]) for c in charges if c["status"] in CHARGED)


@dataclass(frozen=True)
class WorkerLog:
    """What a worker's JSON log tells beyond its metrics."""

    slow: list[tuple[float, int]] = field(default_factory=list)  # (seconds, delivery number)
    complaints: Counter[str] = field(default_factory=Counter)  # warning/error events


def read_log(path: Path, ack_wait_s: float) -> WorkerLog:
    """Deliveries that outlived the AckWait, and warning/error events, from a JSON log."""
    log = WorkerLog()
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            log.complaints["(not JSON) " + line[:60]] += 1
            continue
        if not isinstance(entry, dict):
            continue
        if entry.get("level") in ("warning", "error", "critical"):
            log.complaints[f"{entry.get('level')}: {entry.get('event')}"] += 1
        seconds = entry.get("duration_s")
        if (
            entry.get("event") == "charge.settled"
            and isinstance(seconds, float | int)
            and seconds > ack_wait_s
        ):
            log.slow.append((float(seconds), int(entry.get("delivery", 0))))
    return log


@dataclass(frozen=True)
class WorkerResult:
    """A worker's metrics (scraped before SIGTERM), log and exit status."""

    name: str
    samples: Samples
    log: WorkerLog
    log_path: Path
    exit_code: int


@dataclass(frozen=True)
class Story:
    """Everything the summary is printed from."""

    published: Published
    all_final: bool
    rows: list[LedgerRow]
    tries: dict[int, list[EarlierTry]]
    retries: Retries
    gateway_charges: list[dict[str, Any]]
    gateway_stats: dict[str, Any]
    scoring_stats: dict[str, Any]
    scoring_shape: str
    dead_letters: list[DeadLetterRow]
    dlq_stream: str
    workers: list[WorkerResult]
    ack_wait_s: float
    outcomes: Read
    outcomes_stream: str
    outcomes_subject: str
    outcomes_drained: bool


def _heading(text: str) -> None:
    click.secho(f"{INDENT}{text}", bold=True)


def _promise(story: Story, problems: list[str]) -> None:
    charged = charges_per_period(story.gateway_charges)
    twice = {key: n for key, n in charged.items() if n > 1}
    if twice:
        for key, n in sorted(twice.items()):
            click.secho(f"{INDENT}!!! period {key} was charged {n} times !!!", fg="red", bold=True)
        problems.append(f"{len(twice)} periods charged more than once")
    else:
        later = sum(row.current_try > 1 for row in story.rows if row.status in CHARGED)
        click.secho(
            f"{INDENT}{len(charged)} periods, each charged exactly once across every try's key"
            f" ({later} on a later try)",
            fg="green",
            bold=True,
        )
    period = story.published.period.isoformat()
    succeeded = {f"{r.order_id}:{period}" for r in story.rows if r.status in CHARGED}
    if succeeded != set(charged):
        problems.append("the ledger's succeeded rows and the gateway's charges differ")
        only_ledger, only_gateway = succeeded - set(charged), set(charged) - succeeded
        click.secho(
            f"{INDENT}ledger and gateway disagree: only in the ledger {sorted(only_ledger)}, "
            f"only at the gateway {sorted(only_gateway)}",
            fg="red",
        )
    by_status = story.gateway_stats.get("by_status", {})
    answers = ", ".join(f"{n} x HTTP {status}" for status, n in sorted(by_status.items()))
    click.echo(f"{INDENT}  gateway answers: {answers or 'none'}")


def _counts(counts: dict[str, int] | Counter[str]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "none"


def _ledger(story: Story, problems: list[str]) -> None:
    published = story.published
    statuses = Counter(row.status for row in story.rows)
    _heading(f"ledger (charge_attempts): {len(story.rows)} keys: {_counts(statuses)}")
    for row in story.rows:
        if row.status not in CHARGED or row.current_try > 1:
            line = (
                f"{row.order_id}  {row.status:<9} try {row.current_try}  {row.customer_id:<28}"
                f" {row.decline_code or row.last_error or ''}"
            )
            click.echo(f"{INDENT}  order {line.rstrip()}")
    deferred = sum(row.scoring == "deferred" for row in story.rows)
    if deferred:
        click.echo(f"{INDENT}  {deferred} charged without a scoring verdict (deferred check)")
    status = {row.order_id: row.status for row in story.rows}
    for order, wanted in (
        (published.declined_order, "declined"),
        (published.blocked_order, "blocked"),
    ):
        if status.get(order) != wanted:
            problems.append(f"order {order} is {status.get(order)}, expected {wanted}")
    if not story.all_final:
        problems.append("not every charge reached a final state in time")


def _dead_letters(story: Story, problems: list[str]) -> None:
    letters = story.dead_letters
    _heading(f"dead letters ({story.dlq_stream}): {len(letters)}")
    for dead in letters:
        click.echo(
            f"{INDENT}  #{dead.seq} {dead.reason:<14} order {dead.order_id:<5} "
            f"stream seq {dead.stream_seq}, delivery {dead.delivered}: {dead.error}"
        )
    reasons = Counter(dead.reason for dead in letters)
    if reasons["poison"] < 2:
        problems.append(f"{reasons['poison']} poison dead letters, expected 2")
    conflict = str(story.published.conflict_order)
    if not any(d.reason == "conflict" and d.order_id == conflict for d in letters):
        problems.append(f"no conflict dead letter for order {conflict}")


def _row(label: str, values: Sequence[float]) -> None:
    cells = "".join(f"{v:>10g}" for v in values)
    click.echo(f"{INDENT}  {label:<36}{cells}{sum(values):>10g}")


def _workers(story: Story, problems: list[str]) -> None:
    workers = story.workers
    names = "".join(f"{w.name:>10}" for w in workers)
    _heading(f"{'workers (metrics scraped before SIGTERM)':<38}{names}{'total':>10}")

    def per_worker(name: str, **labels: str) -> list[float]:
        return [metric(w.samples, name, **labels) for w in workers]

    _row("deliveries processed", per_worker("charge_worker_messages_total"))
    for outcome in Outcome:
        counts = per_worker("charge_worker_messages_total", outcome=outcome.value)
        if any(counts):
            followed = f" ({WHAT_FOLLOWED[outcome]})" if outcome in WHAT_FOLLOWED else ""
            _row(f"  {outcome.value}{followed}", counts)
    _row("redeliveries (num_delivered > 1)", per_worker("charge_worker_redeliveries_total"))
    _row("duplicates absorbed by the ledger", per_worker("charge_worker_duplicates_absorbed_total"))
    _row("heartbeats sent (+WPI)", per_worker("charge_worker_heartbeats_total"))
    tries = "charge_worker_tries_total"
    _row("retries (tries 2 and later) ended", per_worker(tries, retry="retry"))
    _row("  charged: recovered by a retry", per_worker(tries, outcome="succeeded", retry="retry"))
    _row("periods declined, no try left", per_worker("charge_worker_periods_exhausted_total"))
    slow = sorted((s for w in workers for s in w.log.slow), reverse=True)
    if slow:
        first_try = sum(delivery == 1 for _, delivery in slow)
        click.echo(
            f"{INDENT}  {len(slow)} deliveries outlived the {story.ack_wait_s:g} s AckWait "
            f"(longest {slow[0][0]:.1f} s); {first_try} settled on their first delivery, "
            "kept by heartbeats"
        )
        if first_try < len(slow):
            problems.append(f"{len(slow) - first_try} slow deliveries were not held by heartbeats")
    else:  # the seeded scoring simulator makes some calls slow in every run
        problems.append(
            f"no delivery outlived the {story.ack_wait_s:g} s AckWait: no incident shown"
        )
    for worker in workers:
        for complaint, n in sorted(worker.log.complaints.items()):
            click.echo(f"{INDENT}  {worker.name} logged {n} x {complaint}")
    codes = ", ".join(f"{w.name} exited {w.exit_code}" for w in workers)
    click.echo(f"{INDENT}  stopped with SIGTERM: {codes}")
    problems.extend(f"{w.name} exited {w.exit_code} on SIGTERM" for w in workers if w.exit_code)


def _scoring(story: Story) -> None:
    stats = story.scoring_stats
    _heading(
        f"scoring simulator ({story.scoring_shape}): "
        f"{stats.get('calls', 0)} calls, {_counts(stats.get('by_decision', {}))}"
    )


def _outcomes(story: Story, problems: list[str]) -> None:
    events = story.outcomes.events
    kinds = Counter(event.type.removeprefix("charge.") for event in events)
    consumer = f"durable {DOWNSTREAM_DURABLE} on {story.outcomes_subject}.>"
    _heading(
        f"outcome events ({story.outcomes_stream}), as a downstream consumer read them"
        f" ({consumer}): {len(events)}: {_counts(kinds)}; by period, in sequence"
    )
    for event in sorted(events, key=lambda e: (e.order_id, e.sequence)):
        retry_at = f"  retry_at {event.retry_at}" if event.retry_at else ""
        decline = f"  {event.decline_code}" if event.decline_code else ""
        click.echo(
            f"{INDENT}  {event.event_id:<22} {event.type:<22} try {event.attempt}"
            f"  sequence {event.sequence}  {event.amount_minor} {event.currency}"
            f"{decline}{retry_at}"
        )
    if not story.outcomes_drained:
        problems.append("outcome events were left unsent")
    changes = {row.order_id: (row.outcome_seq, row.outcome_type) for row in story.rows}
    made, dropped = sum(count for count, _ in changes.values()), story.outcomes.duplicates
    if wrong := mismatches(story.outcomes, changes):
        click.secho(f"{INDENT}  the consumer and the ledger differ: {'; '.join(wrong)}", fg="red")
        problems.append(f"{len(wrong)} orders' outcome events differ from the ledger's changes")
    else:
        click.echo(
            f"{INDENT}  each of the ledger's {made} changes (charge_attempts.outcome_seq) seen"
            f" once; {dropped} duplicate deliveries dropped by event_id"
        )


def print_summary(story: Story) -> list[str]:
    """Print the story's outcome; return the expectations it broke (empty: all held)."""
    problems: list[str] = []
    _heading("the promise, counted at the gateway simulator (GET /_sim/charges)")
    _promise(story, problems)
    _ledger(story, problems)
    _dead_letters(story, problems)
    _workers(story, problems)
    _scoring(story)
    for worker in story.workers:
        click.echo(f"{INDENT}{worker.name} log: {worker.log_path}")
    _outcomes(story, problems)
    problems += print_periods(
        story.rows, story.tries, story.gateway_charges, story.published, story.retries
    )
    return problems
