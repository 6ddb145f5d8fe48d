"""`charge-worker status`'s screen: `render` turns one gathered `Status` (status.py) into
lines, one section a line or two, ages from the moment it was gathered.

The worker pods are those seen within `pods.SEEN_WITHIN_S` (each writes its row every
`pods.TICK_S`), one line each: its breakers (a breaker not closed in capitals, with how
long since it changed, on the pod's clock), its messages in flight, and whether it saw the
consumer paused; the rows not seen for longer are counted, gone or stuck.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from charge_worker.display import printable
from charge_worker.jobs.pods import TICK_S, Pod, Pods

if TYPE_CHECKING:  # status.py imports this module to print what it gathered
    from charge_worker.admin.status import (
        Backlog,
        DeadLetterCounts,
        JobRuns,
        ReconcileRun,
        Status,
    )
    from charge_worker.streams import PauseState

# the findings of reconcile's latest finished run shown on the screen (--json: all counts)
_FINDINGS = {
    "double_charges": "double charges",
    "discrepancies": "discrepancies",
    "unmatched_charges": "unmatched",
    "errors": "errors",
}


def render(status: Status) -> list[str]:
    """The screen: one section a line or two, ages from `checked_at`."""
    now = status.checked_at
    lines = [f"charge-worker status at {status.checked_at:%Y-%m-%d %H:%M:%S} UTC"]
    lines += _charging(status.charging)
    lines += _backlog(status.backlog, status.oldest_due_s)
    lines += _dead_letter_lines(status.dead_letters)
    lines += _run_lines(status.runs, status.reconcile, now)
    if status.outbox_oldest_unsent_s is None:
        lines.append(_row("outbox", "not read"))
    elif status.outbox_oldest_unsent_s <= 0:
        lines.append(_row("outbox", "every outcome event is in the stream"))
    else:
        age = _age(status.outbox_oldest_unsent_s)
        lines.append(_row("outbox", f"oldest outcome event not in the stream yet: {age} old"))
    pending = status.deferred_checks_pending
    count = "not read" if pending is None else f"{pending} pending"
    lines.append(_row("scoring", f"deferred checks (charged before a verdict): {count}"))
    lines += _pod_lines(status.pods, now)
    lines += [_row("FAILED", f"{f.part}: {f.error}") for f in status.failed]
    return lines


def _row(label: str, text: str) -> str:
    return f"{label + ':' if label else '':<14}{text}"


def _charging(state: PauseState | None) -> list[str]:
    if state is None:
        return [_row("charging", "not read")]
    where = f"{state.stream}/{state.consumer}"
    if not state.paused:
        return [_row("charging", f"delivering ({where})")]
    told = (
        f"since {state.paused_at or 'unknown'} by {state.paused_by or 'unknown'},"
        f" reason: {state.reason or 'none given'}"
    )
    return [
        _row("charging", f"PAUSED ({where}): nothing is charged until `charge-worker resume`"),
        _row("", printable(told)),
    ]


def _backlog(counts: Backlog | None, oldest_due_s: float | None) -> list[str]:
    if counts is None:
        first = "not read"
    else:
        first = (
            f"{counts.lag} waiting (lag), {counts.ack_pending} ack pending of max"
            f" {counts.max_ack_pending}, {counts.redelivered} redelivered,"
            f" {counts.waiting_pulls} pulls waiting"
        )
    if oldest_due_s is None:
        due = "oldest due charge not yet charged: not read"
    elif oldest_due_s <= 0:
        due = "no due charge waiting to be charged"
    else:
        due = f"oldest due charge not yet charged: due {_age(oldest_due_s)} ago"
    return [_row("backlog", first), _row("", due)]


def _dead_letter_lines(counts: DeadLetterCounts | None) -> list[str]:
    if counts is None:
        return [_row("dead letters", "not read")]
    if not counts.total:
        return [_row("dead letters", f"none in {counts.stream}")]
    reasons = ", ".join(f"{printable(r)} {n}" for r, n in counts.by_reason.items()) or "-"
    lines = [_row("dead letters", f"{counts.total} in {counts.stream}: {reasons}")]
    if counts.capped:
        lines.append(_row("", f"(reasons of the newest {counts.read} only; `dlq list` for all)"))
    return lines


def _run_lines(
    latest: tuple[JobRuns, ...] | None, reconcile: ReconcileRun | None, now: dt.datetime
) -> list[str]:
    if latest is None:
        return [_row("last runs", "not read")]
    lines = []
    for i, job in enumerate(latest):
        ok = f"ok {_ago(job.last_ok_at, now)}" if job.last_ok_at else "never ok"
        text = f"{job.job:<10} {ok}"
        if job.last_failed_at is not None:
            text += f", failed {_ago(job.last_failed_at, now)}"
            if job.last_ok_at is None or job.last_failed_at > job.last_ok_at:
                text += " (the latest run failed)"
        lines.append(_row("last runs" if i == 0 else "", text))
        if job.job == "reconcile":
            lines.append(_row("", " " * 11 + _findings(reconcile, now)))
    return lines


def _findings(run: ReconcileRun | None, now: dt.datetime) -> str:
    if run is None:
        return "no finished run: no findings"
    found = ", ".join(f"{label} {run.counts.get(name, 0)}" for name, label in _FINDINGS.items())
    text = f"its latest finished run ({_ago(run.finished_at, now)}) found: {found}"
    if run.held:
        text += "; held (paused): changed nothing"
    return text


def _pod_lines(found: Pods | None, now: dt.datetime) -> list[str]:
    if found is None:
        return [_row("pods", "not read")]
    rule = f"seen in the last {_age(found.seen_within_s)} (each writes every {_age(TICK_S)})"
    gone = f"{found.not_seen} not seen for longer (gone or stuck)"
    lines = [_row("pods", f"{len(found.seen)} {rule}, {gone}")]
    lines += [_row("", _pod(pod, now)) for pod in found.seen]
    return lines


def _pod(pod: Pod, now: dt.datetime) -> str:
    breakers = ", ".join(
        f"{name} {b.state}"
        if b.state == "closed"
        else f"{name} {b.state.upper()} for {_age((now - b.since).total_seconds())}"
        for name, b in sorted(pod.breakers.items())
    )
    text = f"{pod.worker}: seen {_age(pod.seen_s_ago)} ago, {pod.in_flight} in flight"
    if pod.paused:
        text += ", saw the consumer paused"
    return printable(f"{text}; breakers: {breakers or 'none'}")


def _ago(moment: dt.datetime, now: dt.datetime) -> str:
    return f"{_age((now - moment).total_seconds())} ago"


def _age(seconds: float) -> str:
    """`45s`, `12m 3s`, `3h 12m`, `2d 4h`."""
    s = max(int(seconds), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"
