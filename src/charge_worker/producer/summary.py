"""What a `charge-worker produce` run did and is doing: counts, refused rows, progress.

Two renderings of the same facts: `lines()` for people, `as_json()` for machines. Progress
lines go elsewhere (stderr), every `PROGRESS_EVERY` rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass, field

PROGRESS_EVERY = 1000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Problem:
    """A subscription or a charge the run could not carry through, and why (one line)."""

    subscription_id: str | None
    key: str | None
    reason: str


@dataclass
class Summary:
    """The figures of one run.

    `due` counts subscriptions this run took (a concurrent run takes the others); every other
    count is of charges, one per (order_id, billing_period). `tries_started` counts the
    declined periods whose next try this run started (`scheduled` again, published with the
    others), `tries_postponed` those whose due try the 30-day cap pushed later.
    `published` and `deduplicated` (re-publishes JetStream dropped) include charges
    scheduled by earlier runs that had not been published yet, and the tries started.
    `failed` is the publish that failed for the whole retry horizon; `abandoned` counts the
    unpublished rows after it, not tried once the broker had failed.
    """

    day: dt.date
    due: int = 0
    scheduled: int = 0
    already_scheduled: int = 0
    already_settled: int = 0
    tries_started: int = 0
    tries_postponed: int = 0
    published: int = 0
    deduplicated: int = 0
    invalid: list[Problem] = field(default_factory=list)
    conflicts: list[Problem] = field(default_factory=list)
    failed: list[Problem] = field(default_factory=list)
    abandoned: int = 0

    @classmethod
    def from_json(cls, text: str) -> Summary:
        """The summary `as_json` printed (`exit_code` is derived, not read)."""
        document = json.loads(text)
        document.pop("exit_code", None)
        document["day"] = dt.date.fromisoformat(document["day"])
        for name in ("invalid", "conflicts", "failed"):
            document[name] = [Problem(**problem) for problem in document[name]]
        return cls(**document)

    def add(self, other: Summary) -> None:
        """Count another run's figures in: the processes of one run took disjoint
        subscriptions, so their counts add up."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.invalid += other.invalid
        self.conflicts += other.conflicts
        self.failed += other.failed

    @property
    def exit_code(self) -> int:
        """1 if a due charge was left unpublished; refused rows alone do not fail the run."""
        return 1 if self.failed or self.abandoned else 0

    def figures(self) -> dict[str, object]:
        """The run's counts by name, problems counted (what `job_runs` keeps of the run)."""
        counts = {name: getattr(self, name) for name in _COUNTS}
        problems = {name: len(getattr(self, name)) for name in ("invalid", "conflicts", "failed")}
        return {"day": self.day.isoformat()} | counts | problems

    def as_json(self) -> str:
        """One JSON object; problems are listed in full."""
        document = dataclasses.asdict(self) | {"exit_code": self.exit_code}
        return json.dumps(document, default=str, ensure_ascii=False)

    def lines(self) -> list[str]:
        """A table of the counts, then every refused or failed row on a line of its own."""
        rows = [
            ("due subscriptions", self.due),
            ("scheduled now", self.scheduled),
            ("already scheduled", self.already_scheduled),
            ("already settled", self.already_settled),
            ("next tries started", self.tries_started),
            ("tries postponed by the cap", self.tries_postponed),
            ("published", self.published),
            ("deduplicated by the server", self.deduplicated),
            ("invalid (skipped)", len(self.invalid)),
            ("conflicts (skipped)", len(self.conflicts)),
            ("failed to publish", len(self.failed) + self.abandoned),
        ]
        out = [f"produce for {self.day.isoformat()}"]
        out += [f"  {name:<28}{count:>8}" for name, count in rows]
        for title, problems in (
            ("invalid subscriptions (not advanced)", self.invalid),
            ("conflicts (not advanced)", self.conflicts),
            ("failed to publish (left scheduled for the next run)", self.failed),
        ):
            if problems:
                out.append(f"{title}:")
                out += [f"  {_who(p)}: {p.reason}" for p in problems]
        if self.abandoned:
            out.append(
                f"  {self.abandoned} more not attempted: the broker failed for the whole "
                "retry horizon (left scheduled for the next run)"
            )
        out.append("result: " + ("ok" if self.exit_code == 0 else "INCOMPLETE, re-run"))
        return out


_COUNTS = (
    "due",
    "scheduled",
    "already_scheduled",
    "already_settled",
    "tries_started",
    "tries_postponed",
    "published",
    "deduplicated",
    "abandoned",
)


def _who(problem: Problem) -> str:
    names = [name for name in (problem.subscription_id, problem.key) if name]
    return " ".join(names)


class Ticker:
    """Counts rows and reports every `PROGRESS_EVERY` of them."""

    def __init__(self, what: str, progress: Progress | None) -> None:
        self.what = what
        self.progress = progress
        self.count = 0

    def tick(self, rows: int = 1) -> None:
        before, self.count = self.count, self.count + rows
        if self.progress is not None and before // PROGRESS_EVERY < self.count // PROGRESS_EVERY:
            self.progress(f"produce: {self.count} {self.what}")
