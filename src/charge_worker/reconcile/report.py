"""What one reconcile run found and did: the human table, the JSON, the Prometheus textfile.

Each sweep adds `Finding`s (a key and what was done about it) and `Failure`s (a key it
could not handle: reported, and the sweep went on); `Counts` are the figures the on-call
alerts watch. Pure: no I/O except `write_metrics`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

from charge_worker.display import printable
from charge_worker.jobs.figures import LAST_RUN, RECONCILE_GAUGES, RECONCILE_PREFIX

Sweep = Literal[
    "forgotten_charges",
    "double_charges",
    "unrecorded_charges",
    "unknown_outcomes",
    "lost_messages",
    "discrepancies",
    "unmatched_charges",
    "reviewed",
]
SWEEPS: tuple[Sweep, ...] = (
    "forgotten_charges",
    "double_charges",
    "unrecorded_charges",
    "unknown_outcomes",
    "lost_messages",
    "discrepancies",
    "unmatched_charges",
    "reviewed",
)
TITLES: dict[Sweep, str] = {
    "forgotten_charges": "forgotten charges",
    "double_charges": "double charges",
    "unrecorded_charges": "unrecorded charges",
    "unknown_outcomes": "unknown outcomes",
    "lost_messages": "lost messages",
    "discrepancies": "discrepancies",
    "unmatched_charges": "unmatched charges",
    "reviewed": "reviewed",
}


@dataclass(frozen=True)
class Finding:
    """One key a sweep found, and what it did (or, in a dry run, would do) about it."""

    order_id: int
    billing_period: dt.date
    action: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.order_id}:{self.billing_period.isoformat()}"


@dataclass(frozen=True)
class Failure:
    """A key a sweep could not handle; the sweep went on with the next one."""

    sweep: Sweep
    key: str
    error: str


@dataclass
class Counts:
    """The run's figures, as the metrics file carries them.

    `double_charges` counts proven extra charges (beyond the one kept per key), so
    `double_charges - refunds` is what is still owed back after a real run.
    `unrecorded_charges` counts keys the ledger said no to (or whose period waits for its next
    try) that the gateway charged (with a charge matching the row, of any try),
    `ledger_repaired` those now recorded. `unmatched_charges` counts captured charges not
    proven a key's own, left for a person. `adopted` counts
    charges the gateway made that the ledger had forgotten, recorded now, for rows whose
    message was gone; `adopted_rows` those for keys whose row was lost altogether (a
    database failover), recorded from their subscription. `still_waiting` counts quiet open rows
    whose message still waits in the stream (a queue, not a loss: nothing done).
    A discrepancy or unmatched charge a person has reviewed (`reconcile resolve`) is in
    neither count, so its alert clears: `Report.reviewed` counts it.
    """

    double_charges: int = 0
    refunds: int = 0
    unrecorded_charges: int = 0
    ledger_repaired: int = 0
    unknown_resolved: int = 0
    adopted: int = 0
    adopted_rows: int = 0
    republished: int = 0
    still_waiting: int = 0
    discrepancies: int = 0
    unmatched_charges: int = 0
    errors: int = 0


@dataclass
class Report:
    """Everything one run found and did; `skipped` says why it did nothing at all.

    What it read: the gateway's history created in [`since`, `until`] (`mode`: `window`
    on the first run, `incremental` from the checkpoint, `full`, or `since`), `pages` of
    `charges_seen` charges; `candidates` keys decided on a lookup (`followups` of them
    from the queue of keys earlier runs left unsettled), and `lookups` made in all.
    `checkpoint`: what it stored (None: a dry run, or a `--since` that left a gap).
    `held`: why a real run changed nothing, as a dry run does (the charges consumer is
    paused: `charge-worker pause`), or None. `reviewed`: the discrepancies and unmatched
    charges found that a person has reviewed (`reconcile resolve`), listed apart and in no
    count the alerts read.
    """

    started_at: dt.datetime
    since: dt.datetime
    dry_run: bool
    mode: str = "window"
    until: dt.datetime | None = None
    checkpoint: dt.datetime | None = None
    skipped: str | None = None
    held: str | None = None
    pages: int = 0
    charges_seen: int = 0
    candidates: int = 0
    followups: int = 0
    lookups: int = 0
    reviewed: int = 0
    counts: Counts = field(default_factory=Counts)
    findings: dict[Sweep, list[Finding]] = field(
        default_factory=lambda: {sweep: [] for sweep in SWEEPS}
    )
    failures: list[Failure] = field(default_factory=list)

    def add(self, sweep: Sweep, finding: Finding) -> None:
        self.findings[sweep].append(finding)

    def sort(self) -> None:
        """Keys in order (they are worked on several at once); a key's findings as made."""
        for found in self.findings.values():
            found.sort(key=lambda item: (item.order_id, item.billing_period))
        order = {sweep: n for n, sweep in enumerate(SWEEPS)}
        self.failures.sort(key=lambda failure: (order[failure.sweep], failure.key))

    def fail(self, sweep: Sweep, key: str, error: str) -> None:
        self.failures.append(Failure(sweep, key, " ".join(error.split())[:300]))
        self.counts.errors += 1

    def exit_code(self, *, fail_on_discrepancy: bool) -> int:
        """4: discrepancies or unmatched charges found (for a person) and asked to fail on
        them; 1: a key could not be handled; else 0 (double charges found and refunded,
        unrecorded charges recorded, are a success)."""
        if fail_on_discrepancy and (self.counts.discrepancies or self.counts.unmatched_charges):
            return 4
        return 1 if self.failures else 0


def _stamp(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _done(report: Report, sweep: Sweep) -> int | str:
    counts = report.counts
    done: dict[Sweep, int | str] = {
        "double_charges": counts.refunds,
        "unrecorded_charges": counts.ledger_repaired,
        "unknown_outcomes": counts.unknown_resolved,
        "lost_messages": counts.republished + counts.adopted,
        "forgotten_charges": counts.adopted_rows,
    }
    return done.get(sweep, "-")  # the rest is never repaired here: a human decides


def _found(report: Report, sweep: Sweep) -> int:
    counted: dict[Sweep, int] = {
        "double_charges": report.counts.double_charges,
        "discrepancies": report.counts.discrepancies,
        "unmatched_charges": report.counts.unmatched_charges,
        "reviewed": report.reviewed,
    }
    return counted.get(sweep, len(report.findings[sweep]))


def _value(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _describe(detail: dict[str, Any]) -> str:
    return "  ".join(f"{name}={_value(value)}" for name, value in detail.items())


def table(report: Report) -> Iterator[str]:
    """The human summary, a line at a time; what the gateway or a row said is escaped
    (`display.printable`): a terminal never obeys it."""
    for line in _table(report):
        yield printable(line)


def _table(report: Report) -> Iterator[str]:
    """The human summary: one line per sweep, then every key each sweep touched."""
    if report.skipped:
        yield f"reconcile did nothing: {report.skipped}"
        return
    if report.held:
        yield f"held, changing nothing (as a dry run) while charging is paused: {report.held}"
    mode = "  (dry run: nothing changed)" if report.dry_run or report.held else ""
    yield (
        f"reconcile at {_stamp(report.started_at)}, gateway history since"
        f" {_stamp(report.since)} ({report.mode})"
    )
    yield (
        f"{report.pages} page(s), {report.charges_seen} charge(s) read, {report.candidates}"
        f" key(s) looked at ({report.followups} followed up), {report.lookups} lookup(s){mode}"
    )
    yield ""
    yield f"{'sweep':<18} {'found':>6} {'done':>6} {'failed':>6}"
    for sweep in SWEEPS:
        failed = sum(1 for f in report.failures if f.sweep == sweep)
        found, done = _found(report, sweep), _done(report, sweep)
        yield f"{TITLES[sweep]:<18} {found:>6} {done!s:>6} {failed:>6}"
    for sweep in SWEEPS:
        if report.findings[sweep]:
            yield ""
            yield TITLES[sweep]
            for item in report.findings[sweep]:
                yield f"  {item.key:<24} {item.action:<28} {_describe(item.detail)}".rstrip()
    if report.failures:
        yield ""
        yield "failed (left for the next run)"
        for failure in report.failures:
            yield f"  {failure.key:<24} {TITLES[failure.sweep]:<28} {failure.error}"


def to_json(report: Report, *, exit_code: int) -> dict[str, Any]:
    """The machine summary (`--json`)."""
    if report.skipped:
        return {"ran": False, "reason": report.skipped, "exit_code": exit_code}
    return {
        "ran": True,
        "dry_run": report.dry_run,
        "held": report.held,
        "started_at": _stamp(report.started_at),
        "since": _stamp(report.since),
        "until": _stamp(report.until or report.started_at),
        "mode": report.mode,
        "checkpoint": _stamp(report.checkpoint) if report.checkpoint else None,
        "history": {"pages": report.pages, "charges": report.charges_seen},
        "candidates": report.candidates,
        "followups": report.followups,
        "lookups": report.lookups,
        "counts": asdict(report.counts),
        **{
            sweep: [
                {
                    "order_id": item.order_id,
                    "billing_period": item.billing_period.isoformat(),
                    "action": item.action,
                    **item.detail,
                }
                for item in report.findings[sweep]
            ]
            for sweep in SWEEPS
        },
        "failures": [asdict(failure) for failure in report.failures],
        "exit_code": exit_code,
    }


def write_metrics(report: Report, path: Path) -> None:
    """Write the run's gauges in Prometheus text format (node-exporter textfile collector),
    named and explained as the worker pods export them from `job_runs` (jobs/figures.py)."""
    registry = CollectorRegistry()
    values = asdict(report.counts) | {LAST_RUN: report.started_at.timestamp()}
    for name, help_text in RECONCILE_GAUGES.items():
        Gauge(f"{RECONCILE_PREFIX}_{name}", help_text, registry=registry).set(values[name])
    write_to_textfile(str(path), registry)
